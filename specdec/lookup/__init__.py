"""Prompt-lookup (n-gram) drafting: zero-cost proposals copied from the prompt and the output so far,
alone (``PromptLookup``) or with a model draft where no n-gram matches (``LookupOrDraft``)."""
from .combined import LookupOrDraft
from .proposer import PromptLookup

__all__ = ["LookupOrDraft", "PromptLookup"]
