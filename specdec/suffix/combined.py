"""``SuffixOrDraft``: suffix decoding where the text matches, a model draft elsewhere.

Per row and step: when ``SuffixChain`` finds the row's context in its own prompt + output or in the global
cache with a match of at least ``min_match`` tokens, the row's proposal is the suffix chain's k tokens (its
most frequent continuation, padded with S[-1]); otherwise it is the model proposer's (``DraftModel``,
``EagleDraft`` or any chain ``Proposer``). The switch, the state both proposers keep and the lossless
verification of a batch that mixes both kinds of rows are ``specdec.speculation.combined.MatchOrDraft``'s, shared with
prompt lookup's ``LookupOrDraft``; finished requests enter the suffix cache (``finished``) whichever source
drafted them.
"""
from __future__ import annotations

from ..speculation.combined import MatchOrDraft
from ..speculation.proposer import Proposer
from .cache import SuffixCache
from .proposer import SuffixChain


class SuffixOrDraft(MatchOrDraft):
    """Per row, ``suffix``'s chain when its match is at least ``min_match`` tokens (at most the cache's
    ``max_match``), else ``draft``'s (a chain ``specdec.speculation.proposer.Proposer``); itself a chain ``Proposer``
    declaring the suffix's ``cache``. ``source`` is the ``SuffixChain``; ``from_source`` [B] bool: which rows
    the last proposal took from it."""

    abilities = MatchOrDraft.abilities | {"cache"}

    def __init__(self, suffix: SuffixChain, draft: Proposer, min_match: int = 4):
        if isinstance(min_match, int) and min_match > suffix.cache.max_match:
            raise ValueError(f"min_match={min_match} exceeds the longest match the suffix cache measures "
                             f"(max_match={suffix.cache.max_match}): the suffix would never be chosen")
        super().__init__(suffix, draft, min_match)
        self.cache: SuffixCache = suffix.cache
