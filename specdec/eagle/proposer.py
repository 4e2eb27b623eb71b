"""EAGLE chain (flat) drafting: the draft runs one position behind the target on true features.

Per row, S = prompt + emitted tokens, n = len(S); the target has verified S[:-1] and so knows its
features f_0 .. f_{n-2} (f_i: EAGLE-1 the final-norm hidden state at i, which predicts S[i+1]; EAGLE-3
the draft's ``fc`` of the target's aux hidden states at i, ``EagleModel.true_features``). Draft position
i holds the pair (f_i, S[i+1]). The proposer keeps every pair on device (``features`` [B, N, H],
``next_tokens`` [B, N]), so no draft-made feature ever survives a verification (no drift):

- ``start``: after the target's context encoding of a row, the pairs of its whole prompt (the last one
  with the first sampled token) are ingested by the draft's context graph (into that row only);
- ``propose(k)``: one W-position step (W = the largest k + 1 seen) re-reads the pairs at positions
  max(0, n-1-W) .. n-2 — the up to k + 1 pairs that the last verification made true, plus older ones
  re-written unchanged — with logits at position n-2 only → x_1 and the draft feature f^_{n-1}; then
  k - 1 one-token steps, each pairing the previous draft feature with the previous draft token
  (f^_{n-2+j}, x_j) at position n-2+j → x_{j+1};
- ``accepted``: the verify step's hidden states are the true features of S[-1], x_1 .. x_k at
  positions n-1 .. n-1+k; with a accepted and the correction/bonus y, the pairs
  (f_{n-1}, x_1) .. (f_{n-1+a}, y) are stored (later positions are garbage, overwritten before use).

Sampling: each draft token is sampled from the draft's warped distribution, which is returned for
lossless rejection sampling; greedy rows take the argmax.

Build one with ``EagleDraft.from_pretrained(path, target)`` (the network, ``EagleModel``, takes the
target's runtime settings) and hand it to ``SpeculativeGenerator(eagle, target, k)``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..core.decoder import DecoderModel
from ..core.sampling import RowGenerators, any_sampled
from ..core.target import StepOutput
from ..fused.step import FusedKey
from ..speculation.proposer import BaseProposer, Proposal, refuse_prefix_cache
from .draft import EagleModel
from .fused import EagleLoop


class EagleDraft(BaseProposer):
    """EAGLE chain drafting (a ``specdec.speculation.proposer.Proposer``) with the draft network ``model``; it fuses
    (``fused_drafter``, re-reading ``reread_width(k)`` positions first)."""

    abilities = frozenset({"check_target", "fused_drafter", "reread_width", "model"})

    def __init__(self, model: EagleModel):
        self.model = model
        self.module = model.lm
        self.vocab_size, self.batch_size = model.vocab_size, model.batch_size
        B, N, dev = model.batch_size, model.n_positions, model.device
        self.features = torch.zeros(B, N, model.config.hidden_size, dtype=model.dtype, device=dev)
        self.next_tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
        self.rows = torch.arange(B, device=dev).unsqueeze(1)
        self.width = 1
        self.read_to = torch.zeros(B, dtype=torch.long)     # host: draft cache slots holding true pairs

    @classmethod
    def from_pretrained(cls, path: str | Path, target: DecoderModel, **kwargs) -> EagleDraft:
        """An EAGLE-1 / NxD / EAGLE-3-layout checkpoint for ``target`` (``EagleModel.from_pretrained``
        arguments: ``eagle_input_norm``, ``backend``, ``progress``)."""
        return cls(EagleModel.from_pretrained(path, target, **kwargs))

    def check_target(self, target: DecoderModel) -> None:
        """ValueError when this draft cannot propose for ``target``."""
        refuse_prefix_cache(target, "EAGLE")
        d = self.model
        if d.config.hidden_size != target.config.hidden_size or d.n_positions < target.n_positions:
            raise ValueError(f"EAGLE draft (hidden {d.config.hidden_size}, n_positions {d.n_positions}) "
                             f"does not fit the target (hidden {target.config.hidden_size}, n_positions "
                             f"{target.n_positions}): load it with EagleDraft.from_pretrained(path, target)")
        if d.dtype != target.dtype:
            raise ValueError(f"EAGLE draft runs in {d.dtype} but the target in {target.dtype}: "
                             "load it with EagleDraft.from_pretrained(path, target)")
        if d.lm.aux_layers and target.lm.feature_layers != d.lm.aux_layers:      # EAGLE-3
            raise ValueError(f"EAGLE draft reads the target's hidden states entering layers {list(d.lm.aux_layers)} "
                             f"but the target returns those of {list(target.lm.feature_layers)}: load the draft "
                             "with EagleDraft.from_pretrained(path, target) (it sets them)")

    def max_draft_tokens(self, length: int) -> int:
        return self.model.n_positions - length + 1

    def start(self, rows, prompts, params, rng, target_out) -> None:
        if rows is None:     # every row restarts: no earlier verification's pairs are left to re-read
            self.width = 1
        first = target_out.tokens[:, -1].to(self.next_tokens.device)
        longest = max(len(p) for p in prompts)
        slots = list(range(len(prompts))) if rows is None else rows
        shifted = []
        true = self.model.true_features(target_out)
        for i, (r, p) in enumerate(zip(slots, prompts)):
            self.read_to[r] = len(p)
            self.features[r, :len(p)] = true[i, :len(p)]
            s = torch.cat([p[1:].to(first.device), first[i:i + 1]])
            self.next_tokens[r, : len(s)] = s
            shifted.append(s)
        # rows=None: every row restarts in one batch context graph (rows past the prompts: dummies)
        features = self.features[:, :longest] if rows is None else \
            self.features[torch.tensor(rows, device=self.features.device), :longest]
        self.model.prefill(shifted, params, rng, features=features, rows=rows)

    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        d = self.model
        sampled = any_sampled(params)
        n = lengths.to(self.features.device)
        out, feature = self.reread(n, k, params, rng, return_probs=sampled)
        tokens, probs = [out.tokens[:, :1]], [out.probs] if sampled else []
        d.set_lengths(n - 1)
        for _ in range(k - 1):
            out = d.step(tokens[-1], params, rng, features=feature, return_probs=sampled)
            feature = out.hidden
            tokens.append(out.tokens)
            if sampled:
                probs.append(out.probs)
        return Proposal(torch.cat(tokens, 1), torch.cat(probs, 1) if sampled else None)

    def reread(self, n: torch.Tensor, k: int, params: torch.Tensor, rng: RowGenerators | None,
               return_probs: bool = False, top_k: int = 0) -> tuple[StepOutput, torch.Tensor]:
        """The first draft step of a k-token proposal (n [B] = len(S) per row): re-read the last
        ``reread_width(k)`` true (feature, token) pairs, up to position n-2 → (its ``StepOutput``, with the
        logits / token / probabilities of the token after S[-1] (``top_k``: its K best tokens and their
        log-probabilities, ``DecoderModel.step``), and the draft feature f^_{n-1} [B, 1, H] paired with that
        token).

        Rows whose cache lacks true pairs before the window (tokens emitted by plain decode steps,
        ``specdec.speculation.gate``) first re-read them in windows of the same shape (a slot's KV depends on its own
        pair only, so re-reading a slot that holds its true pair already leaves it unchanged)."""
        W = self.reread_width(k)
        n_host = n.cpu()            # the catch-up is decided on the host (no device-to-host sync in a graph)
        start_host, behind = (n_host - 1 - W).clamp(min=0), self.read_to
        while bool((behind < start_host).any()):
            first = torch.minimum(behind, start_host)
            self._read(first.to(n.device), W, params, rng, (first + W - 1).to(n.device), return_probs, top_k)
            behind = first + W
        start = start_host.to(n.device)
        out = self._read(start, W, params, rng, n - 2, return_probs, top_k)
        self.read_to = n_host - 1
        last = (n - 2 - start).view(-1, 1, 1).expand(-1, 1, out.hidden.shape[-1])
        return out, torch.gather(out.hidden, 1, last)

    def _read(self, first: torch.Tensor, W: int, params: torch.Tensor, rng: RowGenerators | None,
              logit_at: torch.Tensor, return_probs: bool, top_k: int) -> StepOutput:
        """One W-position step over the stored true pairs at positions first .. first + W - 1 (per row),
        logits at position ``logit_at``."""
        d = self.model
        pos = (first.unsqueeze(1) + torch.arange(W, device=first.device)).clamp(max=d.n_positions - 1)
        d.set_lengths(first)
        return d.step(self.next_tokens[self.rows, pos], params, rng, features=self.features[self.rows, pos],
                      logit_index=(logit_at - first).unsqueeze(1), advance=False, return_probs=return_probs,
                      top_k=top_k)

    def reread_width(self, k: int) -> int:
        """Positions the first draft step of a k-token proposal re-reads: the largest k + 1 seen since every
        row last restarted, so the pairs every earlier verification made true are re-read even when k
        shrinks (near ``n_positions``) or rows join with another k."""
        self.width = max(self.width, k + 1)
        return self.width

    def fused_drafter(self, key: FusedKey) -> EagleLoop:
        """``propose``'s k steps and ``accepted``'s update as one module for fused speculation
        (``specdec.fused``; ``key.width`` from ``reread_width``)."""
        return EagleLoop(self.module, self.features, self.next_tokens, key, self.model.settings.sampling.global_topk)

    def accepted(self, lengths, verified) -> None:
        self._store(lengths, self.model.true_features(verified.target_out), verified.emitted)

    def _store(self, lengths: torch.Tensor, features: torch.Tensor, emitted: torch.Tensor) -> None:
        """Positions n-1 .. n-2+w of each row get the true ``features`` [B, w, H] and the ``emitted`` tokens
        [B, >= w] (-1 padded; positions past the accepted ones hold garbage, overwritten before use)."""
        dev = self.features.device
        width = features.shape[1]
        pos = (lengths.to(dev) - 1).unsqueeze(1) + torch.arange(width, device=dev)
        pos = pos.clamp(max=self.model.n_positions - 1)
        self.features[self.rows, pos] = features.to(self.features.dtype)
        self.next_tokens[self.rows, pos] = emitted[:, :width].to(dev).clamp(min=0)
