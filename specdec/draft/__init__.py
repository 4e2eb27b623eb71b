"""Vanilla draft-model speculation (``DraftModel``) and the draft shipped for the embedded model
(``smollm2``; its checkpoint is assembled from the shipped tensors by ``assemble``)."""
from .proposer import DraftModel

__all__ = ["DraftModel"]
