"""EAGLE-1 speculation: the draft network (``EagleModel``), its checkpoints (LM-head copying) and chain
drafting (``EagleDraft``, the strategy handed to ``SpeculativeGenerator``)."""
from .checkpoint import copy_lm_head
from .draft import EagleModel
from .proposer import EagleDraft

__all__ = ["EagleDraft", "EagleModel", "copy_lm_head"]
