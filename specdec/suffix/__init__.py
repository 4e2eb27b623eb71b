"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): training-free token trees from the longest suffix
match of each row's context in its own prompt + output (``SuffixIndex``) and in a global, bounded,
thread-safe cache of earlier requests (``SuffixCache``); ``SuffixDraft`` proposes trees,
``SuffixChain`` chains, ``SuffixOrDraft`` the suffix chain where it matches and a model draft elsewhere."""
from .cache import SuffixCache
from .combined import SuffixOrDraft
from .index import SuffixIndex
from .proposer import SuffixChain, SuffixDraft, SuffixProposer
from .speculate import Draft, speculate

__all__ = ["Draft", "SuffixCache", "SuffixChain", "SuffixDraft", "SuffixIndex", "SuffixOrDraft", "SuffixProposer",
           "speculate"]
