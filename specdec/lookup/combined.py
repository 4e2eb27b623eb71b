"""``LookupOrDraft``: prompt lookup where the sequence repeats itself, a model draft elsewhere.

Per row and step: when ``PromptLookup`` finds the row's last n tokens earlier in its sequence with
n >= ``min_match``, the row's proposal is the lookup's k tokens; otherwise it is the model proposer's
(``DraftModel``, ``EagleDraft`` or any chain ``Proposer``). The switch, the state both proposers keep and
the lossless verification of a batch that mixes both kinds of rows are ``specdec.speculation.combined.MatchOrDraft``'s,
shared with suffix decoding's ``SuffixOrDraft``.
"""
from __future__ import annotations

import torch

from ..speculation.combined import MatchOrDraft
from ..speculation.proposer import Proposer
from .proposer import PromptLookup


class LookupOrDraft(MatchOrDraft):
    """Per row, ``lookup``'s proposal when it continues an n-gram of at least ``min_match`` tokens (within the
    lookup's n-gram range), else ``draft``'s (a chain ``specdec.speculation.proposer.Proposer``); itself a chain
    ``Proposer``. ``from_lookup`` [B] bool: which rows the last proposal took from the lookup."""

    def __init__(self, lookup: PromptLookup, draft: Proposer, min_match: int = 2):
        if not lookup.min_ngram <= min_match <= lookup.max_ngram:
            raise ValueError(f"min_match={min_match} must lie in the lookup's n-gram range "
                             f"[min_ngram={lookup.min_ngram}, max_ngram={lookup.max_ngram}]")
        super().__init__(lookup, draft, min_match)

    @property
    def lookup(self) -> PromptLookup:
        """The prompt lookup (the source)."""
        return self.source

    @property
    def from_lookup(self) -> torch.Tensor:
        """[B] bool: the rows whose last proposal was the lookup's."""
        return self.from_source
