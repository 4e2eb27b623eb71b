"""Adaptive speculation length: each row's k follows its recent acceptance.

``SpeculativeGenerator(draft, target, k, adaptive=True)`` (or ``adaptive=AdaptiveK(min_k, max_k)``) keeps
a k_r per row, Hugging Face's assistant heuristic (``num_assistant_tokens_schedule="heuristic"``), per row:
after a step in which the row accepted every draft it was given, k_r += 2, else k_r -= 1, clamped to
[min_k, max_k] (max_k: the generator's k unless smaller). k_r starts at max_k whenever the row (re)starts.

A step drafts k_step = the largest k_r of the active rows (so graph shapes come from 1..k) and caps every
row at d_r = min(k_r, k_step) drafts (``Proposal.num_drafts`` → ``acceptance.accept``'s ``num_drafts``):
drafts past d_r are never accepted and the correction / bonus token is drawn at position d_r at the
latest. Statistics count d_r as the row's drafted tokens (vLLM's acceptance rate and per-position
acceptance stay per drafted token).

Why capping is lossless: the acceptance of a row over its first d_r drafts is exactly a d_r-draft
speculation step (the target's verify outputs at positions 0..d_r depend only on S and x_1..x_{d_r}:
causal mask), and such a step emits tokens distributed as the target's, given S, for any d_r
(``specdec.speculation.acceptance``). d_r is a function of earlier steps only (accepted counts already emitted),
never of this step's drafts or random draws, so conditioned on everything before the step the
emitted tokens still follow the target: the output distribution does not change (greedy output stays
token for token the target's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdaptiveK:
    """The per-row speculation length policy (see the module docstring): grow by 2 after a fully
    accepted step, shrink by 1 otherwise, within [min_k, max_k] (max_k None: the generator's k)."""

    min_k: int = 1
    max_k: int | None = None

    def __post_init__(self):
        for name, value in (("min_k", self.min_k), ("max_k", self.max_k)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"AdaptiveK: {name} must be an integer >= 1, got {value!r}")
        if self.max_k is not None and self.max_k < self.min_k:
            raise ValueError(f"AdaptiveK: need min_k <= max_k, got min_k={self.min_k}, max_k={self.max_k}")

    def bounds(self, k: int) -> tuple[int, int]:
        """(min_k, max_k) for a generator drafting at most ``k`` tokens per step."""
        hi = k if self.max_k is None else self.max_k
        if not self.min_k <= hi <= k:
            raise ValueError(f"AdaptiveK(min_k={self.min_k}, max_k={self.max_k}) does not fit k={k}: "
                             "need min_k <= max_k <= k (the step never drafts more than k)")
        return self.min_k, hi

    def next_k(self, row_k: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor, k: int) -> torch.Tensor:
        """Every row's k after a step: row_k [B] (the rows' k before it), drafted [B] (drafts each row was
        given), accepted [B] (accepted drafts), k: the generator's k → [B] long."""
        lo, hi = self.bounds(k)
        grown = torch.where(accepted >= drafted, row_k + 2, row_k - 1)
        return grown.clamp(lo, hi)
