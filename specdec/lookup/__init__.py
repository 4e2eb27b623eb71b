"""Prompt-lookup (n-gram) drafting: zero-cost proposals copied from the prompt and the output so far."""
from .proposer import PromptLookup

__all__ = ["PromptLookup"]
