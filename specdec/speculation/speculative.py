"""One speculation step, for every strategy: propose → verify → accept → the proposer's update.

Convention: ``k`` = draft tokens proposed per step for a chain, the tree's depth for a tree; the
target verifies the drafts plus S[-1], so a step emits between 1 and k + 1 tokens.
(transformers-neuronx's ``speculation_length`` counts verified tokens, i.e. our k + 1.)

``Speculator`` plugs into the request loop (``specdec.core.engine.Engine``), which owns the rows,
emission, EOS / budget / stopping criteria and statistics. Per step, for every row (S = prompt +
emitted tokens, the target's cache holds S[:-1]):
  1. the proposer proposes a chain x_1..x_k or a tree continuing S (``specdec.speculation.proposer``);
  2. its verifier runs the target once over [S[-1], drafts] and applies the shared acceptance rules
     (``specdec.speculation.verify``, ``specdec.speculation.acceptance``): n accepted drafts, then the correction /
     bonus token;
  3. the target's length moves to len(S) + n (rolling back rejected slots is just that);
  4. the proposer updates its own state (its KV rollback; EAGLE / Medusa read the target's outputs).
When a request ends the engine tells the proposer (``finished``: a suffix cache learns the output).
Near ``n_positions`` the step's k shrinks so no graph writes past a cache; at k = 0 the step is a plain
decode step. With an ``AdaptiveK`` policy (``specdec.speculation.adaptive``) each row has its own k_r: the step
drafts the largest k_r of the active rows and caps every row at its own (``Proposal.num_drafts``).
A "padded" proposer's rows say how many of their k drafts are real (``Proposal.num_drafts``): a step
verifies only the longest active row's (``narrowed``); a greedy step where no row has any is a plain decode
step.
With a ``GateMeter`` (``specdec.speculation.gate``) a step is plain (k = 0) whenever plain steps have been
emitting tokens faster than speculative ones. What a proposer's ``start`` deferred ("deferred": a draft model's
prompt encoding) runs before the first step that speculates, outside the step's time the gate measures: a cost
paid once a request is not a speculative step's rate.
The loop never asks which strategy it runs.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..core.decoder import DecoderModel
from ..core.engine import StepResult, decode_step
from ..core.sampling import RowGenerators, any_sampled
from ..core.stats import SpecStats
from .adaptive import AdaptiveK
from .gate import GateMeter
from .proposer import Proposal, Proposer, Verified, declared, step_k
from .verify import ChainVerifier


class Speculator:
    """A proposer, the verifier of its proposals and k, bound to ``target`` (``Engine``'s speculator).

    ``proposer``: any ``Proposer``, checked once here (``specdec.speculation.proposer.declared``); ``self.proposer`` is
    the declared one (a ``BaseProposer``), whose optional abilities the step reads as plain attributes.

    ``adaptive``: an ``AdaptiveK`` policy (chain proposers): per-row k within its bounds, ``row_k`` [B].
    ``gate``: a ``GateMeter`` choosing between speculative and plain steps (``specdec.speculation.gate``)."""

    def __init__(self, proposer: Proposer, target: DecoderModel, k: int, adaptive: AdaptiveK | None = None,
                 gate: GateMeter | None = None):
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an integer >= 0 (draft tokens per step), got {k!r}")
        if k + 1 > target.kv_buckets[-1] or k + 1 > target.n_positions - 1:
            raise ValueError(f"k={k} is too large: a verify step needs k+1={k + 1} slots but the target's "
                             f"largest KV bucket is {target.kv_buckets[-1]} (n_positions={target.n_positions})")
        proposer = declared(proposer)
        if proposer.batch_size != target.batch_size:
            raise ValueError(f"draft batch_size={proposer.batch_size} != target batch_size={target.batch_size}: "
                             "compile both for the same batch size")
        if proposer.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocab_size={proposer.vocab_size} != target vocab_size={target.vocab_size}: "
                             "draft and target must share the tokenizer")
        self.proposer, self.target, self.k = proposer, target, k
        self.verifier = proposer.verifier or ChainVerifier()
        self.adaptive, self.gate = adaptive, gate
        if adaptive is not None:
            self.row_k = torch.full((target.batch_size,), adaptive.bounds(k)[1], dtype=torch.long)

    def start(self, rows: list[int] | None, prompts: list[torch.Tensor], params: torch.Tensor,
              rng: RowGenerators, target_out) -> None:
        if self.adaptive is not None:    # (re)started rows begin at max_k
            self.row_k[slice(None) if rows is None else rows] = self.adaptive.bounds(self.k)[1]
        self.proposer.start(rows, prompts, params, rng, target_out)

    def finished(self, rows: list[int], lengths: list[int]) -> None:
        """The requests in ``rows`` ended with len(S) = ``lengths``: the proposer's "finished" (no-op default)."""
        self.proposer.finished(rows, lengths)

    def step(self, tail: torch.Tensor, lengths: torch.Tensor, active: torch.Tensor, params: torch.Tensor,
             rng: RowGenerators, stats: SpecStats) -> StepResult:
        """One step for every row (see the module docstring); the target's lengths are len(S) - 1."""
        longest = int(lengths[active].max())
        k = step_k(self.proposer, self.k, self.target.n_positions, longest)
        if self.gate is not None and not self.gate.speculate():
            k = 0
        if k > 0:   # what start deferred (a draft model's prompt encoding): once a request, outside the gate's rates
            with stats.timer("draft"):
                self.proposer.flush(params)
        started = self.gate.clock() if self.gate is not None else 0.0
        caps = None     # per-row caps (adaptive k)
        if self.adaptive is not None and k > 0:
            k = min(k, int(self.row_k[active].max()))
            caps = self.row_k.clamp(max=k)
        proposal = drafted = None
        if k > 0:
            with stats.timer("draft"):
                proposal, k = narrowed(self.proposer.propose(tail, lengths, k, params, rng), k, caps, active,
                                       sampled=any_sampled(params), split_draws=rng.splits_draws)
        if k == 0:   # no room to draft, the gate, or no row drafted: a plain decode step; the proposer still reads it
            with stats.timer("verify"):
                out = decode_step(self.target, tail, params, rng, active)
                none = torch.zeros_like(out.tokens[:, 0])
                verified = Verified(none, out.tokens, out, none)
        else:
            drafted = proposal.num_drafts
            with stats.timer("verify"):
                verified = self.verifier.verify(self.target, proposal, tail, lengths, params, rng)
        with stats.timer("other"):
            self.proposer.accepted(lengths, verified)
            n, emitted = verified.num_accepted.cpu(), verified.emitted.cpu()
            if drafted is None:
                drafted = torch.full_like(n, k)
            elif self.adaptive is not None:     # (narrowed's num_drafts: on the host)
                self.row_k = torch.where(active, self.adaptive.next_k(self.row_k, drafted, n, self.k), self.row_k)
        if self.gate is not None:
            self.gate.record(k > 0, int((n + 1)[active.cpu()].sum()), self.gate.clock() - started)
        return StepResult(n, emitted, drafted)


def narrowed(proposal: Proposal, k: int, caps: torch.Tensor | None, active: torch.Tensor,
             sampled: bool = False, split_draws: bool = True) -> tuple[Proposal, int]:
    """A chain ``proposal`` of k drafts [B, k] capped per row at ``caps`` [B] (adaptive k; None: no cap), at
    the proposer's own ``num_drafts`` (a "padded" proposer's real drafts) and, for a row that is not ``active``,
    at none (its verify positions are padding), then cut to the longest active row's drafts → (the proposal,
    the step's k; 0: nothing to verify, a plain decode step). A tree passes unchanged (k: its depth).

    Sampling steps (``sampled``) draw a row's acceptance and sampling noise per verified position, and a row's
    random stream must not depend on its neighbours (rows are independent of their batch). So a cut sampling
    chain keeps at least one draft (a row without drafts takes its bonus token from the verify's noise, as in
    an uncut step, never from a decode step's) and records ``draw_width`` = k: its verifier draws the noise of
    k drafts (``ChainVerifier``). That needs streams where n draws then m draws are the n + m draws of one
    call (``RowGenerators.splits_draws``: CPU generators); elsewhere sampling steps keep k.
    Lossless: a row's acceptance over its first d_r drafts is a d_r-draft step (causal mask), and d_r depends
    on S, the draft's side and earlier steps only, never on this step's verify noise."""
    if proposal.tree is not None:
        return proposal, k
    num = torch.full_like(active, k, dtype=torch.long) if proposal.num_drafts is None else proposal.num_drafts.cpu()
    if caps is not None:
        num = torch.minimum(num, caps)
    num = torch.where(active, num.clamp(max=k), 0)      # a row that is not active verifies nothing: padding
    longest = int(num[active].max()) if bool(active.any()) else 0
    if not sampled:
        width = longest
    elif split_draws:
        width = max(longest, 1)
    else:
        width = k
    if width == k:
        return replace(proposal, num_drafts=num), k
    probs = None if proposal.probs is None else proposal.probs[:, :width]
    return replace(proposal, tokens=proposal.tokens[:, :width], probs=probs, num_drafts=num.clamp(max=width),
                   draw_width=k if sampled else None), width
