"""One fused speculation step: the draft loop, the target's verification and the acceptance as ONE graph.

``FusedStep`` is a pure function of fixed-shape tensors plus the state it updates in place (both KV
caches and, for EAGLE, the draft's feature / token buffers), so it compiles as one program
(``torch.compile`` fullgraph, ``torch.export`` strict, an XLA / Neuron trace) and a step needs no
host work between the draft and the target:

    inputs : tail [B, 2] i64       the last two tokens of each row's sequence S (S[-1] not in the
                                   target's cache yet)
             lengths [B] i64       len(S); the target's cache holds S[:-1]
             active [B] bool       rows that advance (others keep their lengths)
             params [B, 4] f32     per-row sampling parameters (``specdec.core.sampling``)
             uniform [B, U] f32    every random draw of the step, in [0, 1) (zeros for greedy graphs):
                                   the drafter's ``uniforms`` first, then k+1 for the target's sampling
                                   of the verified positions, then k + 1 for the acceptance rule —
                                   the order the unfused step draws them in, so one seed gives the
                                   same tokens fused and unfused
             (presence [B, V] bool — ``penalty`` graphs: the tokens in each row's sequence)
    outputs: result [B, k+2] i64   column 0: n = accepted drafts; columns 1..n+1: the emitted tokens
                                   (accepted drafts, then the correction / bonus token), -1 after —
                                   the one small tensor the host reads per step
             next_tail [B, 2], next_lengths [B]   the next step's inputs (lengths + n + 1 on active rows)

A drafter (``ChainDrafter``) is the proposer's k draft steps unrolled as an ``nn.Module``; each chain
strategy supplies its own (``DraftModel.fused_drafter``, ``EagleDraft.fused_drafter``). Acceptance is
the shared rule set (``specdec.speculation.acceptance.accept``: greedy, lossless rejection sampling with the
draft's probabilities), so fused and unfused speculation decide identically.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..core.graphs import GraphKey, StepGraph
from ..core.sampling import TEMPERATURE
from ..speculation.acceptance import accept


@dataclass(frozen=True)
class FusedKey:
    """What a fused graph is compiled for: k drafts per step, the target's KV bucket, the draft's KV
    bucket, greedy or sampling (``top_filter``: top-k / top-p warping compiled in), the repetition
    penalty (``penalty``) and the drafter's re-read width (EAGLE; 0 for a draft model)."""

    k: int
    kv_len: int
    draft_kv_len: int
    do_sample: bool
    top_filter: bool = False
    penalty: bool = False
    width: int = 0

    def describe(self) -> str:
        mode = ("sample" if self.top_filter else "sample-T") if self.do_sample else "greedy"
        return (f"fused k={self.k} kv={self.kv_len} draft-kv={self.draft_kv_len} {mode}"
                f"{f' width={self.width}' if self.width else ''}{' +penalty' if self.penalty else ''}")

    def step_key(self, n_tokens: int, n_logits: int, kv_len: int, penalty: bool = False) -> GraphKey:
        """The ``GraphKey`` of one forward inside the fused graph (draft steps return probabilities when
        sampling, as the unfused proposers ask for them)."""
        return GraphKey(n_tokens, n_logits, kv_len, self.do_sample, self.do_sample, self.top_filter,
                        penalty=penalty)


class ChainDrafter(Protocol):
    """A chain proposer's k draft steps as one module (built by the proposer's ``fused_drafter``).

    ``uniforms``: random numbers per row one step consumes. ``forward(tail, lengths, params, uniform
    [B, uniforms])`` → (tokens [B, k] i64, probs [B, k, V] f32 — the distributions the drafts were
    sampled from — or None for greedy graphs). ``update(lengths, hidden [B, k+1, H·(1+A)], emitted [B, k+1])``
    runs after acceptance with the target's verify hidden output (with A ``feature_layers``, their hidden
    states after the final-norm ones: ``core.model.split_hidden``) and the emitted tokens (-1 padded)."""

    uniforms: int

    def __call__(self, tail: torch.Tensor, lengths: torch.Tensor, params: torch.Tensor,
                 uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def update(self, lengths: torch.Tensor, hidden: torch.Tensor, emitted: torch.Tensor) -> None: ...


def causal_inputs(lengths: torch.Tensor, start: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """Inputs of an n-token causal chain written at slots start .. start+n-1 of every row:
    (position_ids [B, n], token_mask [B, n, n], logit_index [B, n] = all positions)."""
    B, dev = lengths.shape[0], lengths.device
    offsets = torch.arange(n, device=dev)
    mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(B, n, n)
    return start.unsqueeze(1) + offsets, mask, offsets.expand(B, n)


def draft_chain(one: nn.Module, k: int, token: torch.Tensor, probs: torch.Tensor | None, first_slot: torch.Tensor,
                lengths: torch.Tensor, params: torch.Tensor, uniform: torch.Tensor,
                feature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's one-token steps after its first draft token: step j (1 <= j < k) feeds x_j at slot
    ``first_slot + j`` with ``uniform[:, j]`` (and, EAGLE, ``feature``: the draft feature the previous
    step made) → x_{j+1}. ``token`` [B, 1] / ``probs`` [B, 1, V] (None: greedy) are x_1 and its
    distribution; ``one`` is the drafter's one-token ``StepGraph``. → (tokens [B, k], probs [B, k, V] or None)."""
    tokens, dists = [token], [probs]
    for j in range(1, k):
        at = first_slot + j
        positions, mask, logit_index = causal_inputs(lengths, at, 1)
        out = one(tokens[-1], positions, at, mask, logit_index, params, uniform[:, j:j + 1],
                  *(() if feature is None else (feature,)))
        tokens.append(out[0])
        dists.append(out[1] if probs is not None else None)
        feature = out[-1] if feature is not None else None
    return torch.cat(tokens, 1), None if probs is None else torch.cat(dists, 1)


class FusedStep(nn.Module):
    """Draft loop + target verification + acceptance (+ the drafter's update) for ``key``."""

    def __init__(self, target_lm: nn.Module, drafter: nn.Module, key: FusedKey, global_topk: int | None):
        super().__init__()
        self.lm, self.drafter, self.key = target_lm, drafter, key      # ``lm``: what the backends place
        self.ran = False                     # run at least once (a compiled graph: its code generated)
        self.verify = StepGraph(target_lm, key.step_key(key.k + 1, key.k + 1, key.kv_len, key.penalty), global_topk)

    @property
    def uniforms(self) -> int:
        """Random numbers per row one step consumes (see the module docstring)."""
        return self.drafter.uniforms + 2 * (self.key.k + 1)

    def forward(self, tail, lengths, active, params, uniform, *presence):
        k, sampled = self.key.k, self.key.do_sample
        d = self.drafter.uniforms
        drafts, draft_probs = self.drafter(tail, lengths, params, uniform[:, :d])
        base = lengths - 1                                   # slot (and position) of S[-1]
        positions, mask, logit_index = causal_inputs(lengths, base, k + 1)
        out = self.verify(torch.cat([tail[:, 1:], drafts], 1), positions, base, mask, logit_index, params,
                          uniform[:, d:d + k + 1], *presence)
        target_tokens, target_probs, hidden = (out[0], out[1], out[3]) if sampled else (out[0], None, out[2])
        a = d + k + 1
        n, emitted = accept(drafts, target_probs, draft_probs, target_tokens=target_tokens,
                            greedy_rows=params[:, TEMPERATURE] <= 0, uniform=uniform[:, a:a + k],
                            residual_uniform=uniform[:, a + k])
        self.drafter.update(lengths, hidden, emitted)
        last = emitted.gather(1, n.unsqueeze(1))
        before = emitted.gather(1, (n - 1).clamp(min=0).unsqueeze(1))
        next_tail = torch.cat([torch.where(n.unsqueeze(1) > 0, before, tail[:, 1:]), last], 1)
        next_lengths = torch.where(active, lengths + n + 1, lengths)
        next_tail = torch.where(active.unsqueeze(1), next_tail, tail)
        return torch.cat([n.unsqueeze(1), emitted], 1), next_tail, next_lengths

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Valid inputs of the graph's shapes: every row at length 2 (greedy or sampling at T = 1)."""
        dev = self.lm.inv_freq.device
        params = torch.tensor([[0.0, 1.0, 1.0, 1.0]], device=dev).expand(batch_size, 4).contiguous()
        inputs = (torch.ones(batch_size, 2, dtype=torch.long, device=dev),
                  torch.full((batch_size,), 2, dtype=torch.long, device=dev),
                  torch.ones(batch_size, dtype=torch.bool, device=dev), params,
                  torch.full((batch_size, self.uniforms), 0.5, device=dev))
        if self.key.penalty:
            inputs += (torch.zeros(batch_size, self.lm.config.vocab_size, dtype=torch.bool, device=dev),)
        return inputs
