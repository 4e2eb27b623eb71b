"""Fused speculation: the draft loop, the target's verification and the acceptance as one graph per
step (``FusedStep``), chained by ``FusedSpeculator``; ``SpeculativeGenerator(draft, target, k,
fused=True)`` runs it. Chain proposers (``DraftModel``, ``EagleDraft``) supply their draft loop as a
module (``fused_drafter``); Medusa trees and prompt lookup run unfused."""
from .speculator import FusedSpeculator
from .step import ChainDrafter, FusedKey, FusedStep

__all__ = ["ChainDrafter", "FusedKey", "FusedSpeculator", "FusedStep"]
