"""EAGLE-1 speculation: the draft network (``EagleModel``), its checkpoints (LM-head copying) and chain
drafting (``EagleDraft``, the strategy handed to ``SpeculativeGenerator``) and EAGLE-2 dynamic trees
(``EagleTreeDraft``)."""
from .checkpoint import copy_lm_head
from .draft import EagleModel
from .proposer import EagleDraft
from .tree import DynamicTree, EagleTreeDraft

__all__ = ["DynamicTree", "EagleDraft", "EagleModel", "EagleTreeDraft", "copy_lm_head"]
