"""``MatchOrDraft``: per row and step, a text source's chain where it matches, a model draft's chain elsewhere.

The base of ``LookupOrDraft`` (prompt lookup, ``specdec.lookup``) and ``SuffixOrDraft`` (suffix decoding,
``specdec.suffix``). A *source* is a chain proposer that drafts by matching the row's sequence against text
seen before and says how long the match is:

    source.matches(tail, lengths, k) → tokens [B, k] long (padded with S[-1]), matched [B] long (0: no match)

Per row and step: when ``matched >= min_match`` the row's proposal is the source's k tokens; otherwise it is
the model proposer's (``DraftModel``, ``EagleDraft`` or any chain ``Proposer``, given to the constructor:
strategies never import each other). The choice is made before verification from the sequence (and, for a
cache, what earlier requests left) alone.

Both proposers run ``start`` / ``accepted`` / ``finished`` for every row, every step, and ``propose`` too
except that a model proposer declaring "resyncs" (``DraftModel``) is not asked to propose in a greedy step
where every row takes the source (its drafts would go unused), so each keeps its own state on the row's real sequence
whichever proposal was verified: the source appends the emitted tokens; EAGLE stores the target's verified
features and the emitted tokens (true whoever proposed them); the draft model finds the first emitted token
that differs from its own drafts (or all of them, after a skipped step) and re-reads the sequence from there
(``specdec.draft.proposer``). The combination is "padded": source rows have the source's real drafts
(``drafted``), model rows k or the model's own count (a draft model's confidence stop) (``Proposal.num_drafts``),
so a step verifies only the longest real draft.

Gated drafts (``gate_drafts(gate)``; ``SpeculativeGenerator(..., gate=True)`` calls it): the source's drafts
cost only their verify, the model's cost its draft steps too, which a CPU may not earn back where the text is
new. A ``GateMeter`` then measures the steps where some row has no source match ("misses") in two kinds, those
where the model drafts for those rows and those where they take the source's drafts anyway (a match shorter
than ``min_match``, or none: a plain decode step when no row has any), each from ``propose`` to ``accepted``
(the model's draft steps and catch-up, the verify): the emitted tokens of every row over the seconds, moving
averages, warm-up and probes as the cost gate's (``specdec.speculation.gate``). At a miss the faster kind
runs. Lossless as the gate is: the choice is a function of earlier steps' clock readings, never of this step's
drafts or noise; a row without drafts takes the target's token. Per batch, like the gate.

Sampling: source rows' proposals are deterministic (q one-hot on the proposed token), model rows' are
sampled from the model's q. In a batch that mixes them, source rows get q = onehot(x) (a scatter into
zeros [B, k, V]): the rejection rule with a one-hot q *is* the one-hot rule (accept x with probability
min(1, p(x)/1) = p(x); on rejection draw from max(p - onehot(x), 0) = p without x), so every row is
verified losslessly by its own proposal's rule. When the model proposes deterministically too (greedy
rows, argmax drafts: no q), no q is built.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..core.sampling import any_sampled
from .gate import CostGate, GateMeter
from .proposer import BaseProposer, Proposal, Proposer, Verified, declared


class MatchSource(Proposer, Protocol):
    """A chain proposer that drafts from matches of the row's sequence (``PromptLookup``, ``SuffixChain``)."""

    drafted: torch.Tensor

    def matches(self, tail: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's k drafts [B, k] (padded) and the length of the match behind them [B] (0: none); sets
        ``drafted`` [B] long, each row's real drafts."""
        ...

    def finished(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> None:
        """The requests in ``rows`` ended (``BaseProposer.finished``)."""
        ...


class MatchOrDraft(BaseProposer):
    """Per row, ``source``'s proposal when its match is at least ``min_match`` tokens, else ``draft``'s (a
    chain ``specdec.speculation.proposer.Proposer``, declared: ``specdec.speculation.proposer.declared``); itself a
    chain proposer.
    ``from_source`` [B] bool: which rows the last proposal took from the source. ``draft_meter``: the
    ``GateMeter`` of the model's drafts at misses (``gate_drafts``; None: the model drafts at every miss).
    Subclasses name the source (``LookupOrDraft.lookup``, ``SuffixOrDraft.suffix``) and check ``min_match``
    against it."""

    abilities = frozenset({"check_target", "draft", "finished", "padded", "deferred", "gate_drafts"})

    def __init__(self, source: MatchSource, draft: Proposer, min_match: int):
        draft = declared(draft)
        if isinstance(min_match, bool) or not isinstance(min_match, int) or min_match < 1:
            raise ValueError(f"min_match must be an int >= 1 (tokens of the match), got {min_match!r}")
        name = type(self).__name__
        if draft.depth is not None or draft.verifier is not None:
            raise ValueError(f"{name} combines chain proposals; {type(draft).__name__} proposes trees")
        if (draft.batch_size, draft.vocab_size) != (source.batch_size, source.vocab_size):
            raise ValueError(f"draft (batch {draft.batch_size}, vocab {draft.vocab_size}) and {type(source).__name__} "
                             f"(batch {source.batch_size}, vocab {source.vocab_size}) must serve the same target")
        self.source, self.draft, self.min_match = source, draft, min_match
        self.vocab_size, self.batch_size = draft.vocab_size, draft.batch_size
        self.from_source = torch.zeros(self.batch_size, dtype=torch.bool)
        self.draft_meter: GateMeter | None = None
        self._miss: tuple[bool, float] | None = None    # this step's kind at a miss (model drafts?) and its start

    def gate_drafts(self, gate: CostGate) -> GateMeter:
        """Draft with the model at a miss only while such steps emit tokens faster than steps without it
        (module docstring); ``gate``'s warm-up, probes and smoothing → the meter (``draft_meter``)."""
        self.draft_meter = GateMeter(gate)
        return self.draft_meter

    def check_target(self, target) -> None:
        """The model proposer's own check (``SpeculativeGenerator`` calls it)."""
        self.draft.check_target(target)

    def start(self, rows, prompts, params, rng, target_out) -> None:
        self.source.start(rows, prompts, params, rng, target_out)
        self.draft.start(rows, prompts, params, rng, target_out)

    def flush(self, params) -> None:
        """What the model proposer's ``start`` deferred (a draft model's prompt encoding), done now; with gated
        drafts, only when the model's kind is next at a miss (``draft_meter.speculate()``, which reads earlier
        steps only), so a request whose misses never take the model never pays it. The speculation step calls
        it before each speculative step, outside every rate the gates measure."""
        if self.draft_meter is None or self.draft_meter.speculate():
            self.draft.flush(params)

    def max_draft_tokens(self, length: int) -> int:
        return min(self.source.max_draft_tokens(length), self.draft.max_draft_tokens(length))

    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        tokens, matched = self.source.matches(tail, lengths, k)
        self.from_source = matched >= self.min_match
        drafting = True         # whether the model drafts for the rows without a match
        if self.draft_meter is not None and not bool(self.from_source.all()):
            drafting = self.draft_meter.speculate()     # (flush ran the model's deferred work when it is True)
            self._miss = (drafting, self.draft_meter.clock())
        if not drafting:        # every row takes the source's drafts: a shorter match's, or none
            self.from_source = torch.ones_like(self.from_source)
        real = torch.where(self.from_source, self.source.drafted, k)
        if bool(self.from_source.all()) and (not drafting or not any_sampled(params)) \
                and "resyncs" in self.draft.abilities:
            # the model's drafts would go unused (sampling with every row matched: it still drafts, so a row's
            # random stream is the same whatever its batch neighbours take; the gate's choice is per batch)
            return Proposal(tokens, num_drafts=real)
        model = self.draft.propose(tail, lengths, k, params, rng)    # the model tracks the sequence
        if model.num_drafts is not None:     # a padded model proposer (a draft model's confidence stop)
            real = torch.where(self.from_source, self.source.drafted, model.num_drafts.cpu())
        use = self.from_source.to(model.tokens.device)
        tokens = torch.where(use.unsqueeze(1), tokens.to(model.tokens.device), model.tokens)
        probs = None if model.probs is None else self.one_hot_rows(model.probs, tokens, use)
        return Proposal(tokens, probs, num_drafts=real)

    @staticmethod
    def one_hot_rows(probs: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``probs`` [B, k, V] with the ``rows`` [B] bool replaced by one-hot distributions on ``tokens`` [B, k]."""
        one_hot = torch.zeros_like(probs).scatter_(-1, tokens.unsqueeze(-1), 1.0)
        return torch.where(rows.view(-1, 1, 1), one_hot, probs)

    def accepted(self, lengths, verified: Verified) -> None:
        self.source.accepted(lengths, verified)
        self.draft.accepted(lengths, verified)
        if self._miss is not None:      # a step at a miss ends: its kind's tokens and seconds
            drafting, started = self._miss
            assert self.draft_meter is not None
            tokens = int((verified.num_accepted.cpu() + 1).sum())
            self.draft_meter.record(drafting, tokens, self.draft_meter.clock() - started)
            self._miss = None

    def finished(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> None:
        """Both proposers hear that the requests in ``rows`` ended."""
        self.source.finished(rows, lengths)
        self.draft.finished(rows, lengths)
