"""``LookupOrDraft``: prompt lookup where the sequence repeats itself, a model draft elsewhere.

Per row and step: when ``PromptLookup`` finds the row's last n tokens earlier in its sequence with
n >= ``min_match``, the row's proposal is the lookup's k tokens; otherwise it is the model proposer's
(``DraftModel``, ``EagleDraft`` or any chain ``Proposer``, given to the constructor: strategies never
import each other). The choice is per row, made before verification from the sequence alone.

Both proposers run ``start`` / ``propose`` / ``accepted`` for every row, every step, so each keeps its
own state on the row's real sequence whichever proposal was verified: the lookup appends the emitted
tokens; EAGLE stores the target's verified features and the emitted tokens (true whoever proposed them);
the draft model finds the first emitted token that differs from its own drafts and re-reads the
sequence from there (``specdec.draft.proposer``).

Sampling: lookup rows' proposals are deterministic (q one-hot on the proposed token), model rows' are
sampled from the model's q. In a batch that mixes them, lookup rows get q = onehot(x) (a scatter into
zeros [B, k, V]): the rejection rule with a one-hot q *is* the one-hot rule (accept x with probability
min(1, p(x)/1) = p(x); on rejection draw from max(p - onehot(x), 0) = p without x), so every row is
verified losslessly by its own proposal's rule. When the model proposes deterministically too (greedy
rows, argmax drafts: no q), no q is built.
"""
from __future__ import annotations

import torch

from ..proposer import BaseProposer, Proposal, Proposer, Verified, declared
from .proposer import PromptLookup


class LookupOrDraft(BaseProposer):
    """Per row, ``lookup``'s proposal when it continues an n-gram of at least ``min_match`` tokens, else
    ``draft``'s (a chain ``specdec.proposer.Proposer``, declared: ``specdec.proposer.declared``); itself a
    chain ``Proposer``. ``from_lookup`` [B] bool: which rows the last proposal took from the lookup."""

    abilities = frozenset({"check_target", "draft"})

    def __init__(self, lookup: PromptLookup, draft: Proposer, min_match: int = 2):
        draft = declared(draft)
        if not lookup.min_ngram <= min_match <= lookup.max_ngram:
            raise ValueError(f"min_match={min_match} must lie in the lookup's n-gram range "
                             f"[min_ngram={lookup.min_ngram}, max_ngram={lookup.max_ngram}]")
        if draft.depth is not None or draft.verifier is not None:
            raise ValueError(f"LookupOrDraft combines chain proposals; {type(draft).__name__} proposes trees")
        if (draft.batch_size, draft.vocab_size) != (lookup.batch_size, lookup.vocab_size):
            raise ValueError(f"draft (batch {draft.batch_size}, vocab {draft.vocab_size}) and lookup (batch "
                             f"{lookup.batch_size}, vocab {lookup.vocab_size}) must serve the same target")
        self.lookup, self.draft, self.min_match = lookup, draft, min_match
        self.vocab_size, self.batch_size = draft.vocab_size, draft.batch_size
        self.from_lookup = torch.zeros(self.batch_size, dtype=torch.bool)

    def check_target(self, target) -> None:
        """The model proposer's own check (``SpeculativeGenerator`` calls it)."""
        self.draft.check_target(target)

    def start(self, rows, prompts, params, rng, target_out) -> None:
        self.lookup.start(rows, prompts, params, rng, target_out)
        self.draft.start(rows, prompts, params, rng, target_out)

    def max_draft_tokens(self, length: int) -> int:
        return min(self.lookup.max_draft_tokens(length), self.draft.max_draft_tokens(length))

    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        model = self.draft.propose(tail, lengths, k, params, rng)    # every row: the model tracks the sequence
        tokens, matched = self.lookup.matches(tail, lengths, k)
        self.from_lookup = matched >= self.min_match
        use = self.from_lookup.to(model.tokens.device)
        tokens = torch.where(use.unsqueeze(1), tokens.to(model.tokens.device), model.tokens)
        probs = None if model.probs is None else self.one_hot_rows(model.probs, tokens, use)
        return Proposal(tokens, probs)

    @staticmethod
    def one_hot_rows(probs: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``probs`` [B, k, V] with the ``rows`` [B] bool replaced by one-hot distributions on ``tokens`` [B, k]."""
        one_hot = torch.zeros_like(probs).scatter_(-1, tokens.unsqueeze(-1), 1.0)
        return torch.where(rows.view(-1, 1, 1), one_hot, probs)

    def accepted(self, lengths, verified: Verified) -> None:
        self.lookup.accepted(lengths, verified)
        self.draft.accepted(lengths, verified)
