"""Speculative-decoding statistics (vLLM's definitions), shared by every strategy."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch

__all__ = ["SpecStats"]

_PHASES = ("draft", "verify", "other")


def _as_long(x, like: torch.Tensor | None = None) -> torch.Tensor:
    t = torch.as_tensor(x).detach().to("cpu", torch.long).flatten()
    if like is not None and t.numel() == 1 and like.numel() != 1:
        t = t.expand(like.numel())
    return t


def _pad_add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class SpecStats:
    """Counters of speculative decoding, summed over row-steps (one active row in one step = 1 step).

    Raw counts (all derived values come from these):
      steps              row-steps taken (each active row in each speculation step counts once)
      drafted            draft tokens proposed (sum of num_drafted over row-steps)
      accepted           draft tokens accepted (sum of num_accepted; excludes the bonus/correction)
      emitted            tokens emitted (normally accepted + steps: each step adds one target token;
                         less when a row stops early at EOS / the length budget)
      accepted_per_position[i]  row-steps whose draft at position i was accepted (= accepted > i);
                         length k_max, grows when a longer step is recorded
      accepted_histogram[m]     row-steps that accepted exactly m drafts, m = 0..k_max
                         (sums to ``steps``; ``accepted = sum_m m * hist[m]``)
      draft_s / verify_s / other_s  wall time in proposing, in target verification, and in host
                         overhead (acceptance bookkeeping, KV rollback, streaming...)

    Derived:
      mean_acceptance_length  tau = 1 + accepted / steps  (counts the bonus token; plain decoding
                              = 1.0; 1.0 when no steps)
      acceptance_rate         accepted / drafted  (0.0 when nothing was drafted)
      per_position_acceptance[i] = accepted_per_position[i] / steps (non-increasing for chain drafts)
      tokens_per_step         emitted / steps
      total_s, tokens_per_s   wall time and emitted tokens per second
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    accepted_histogram: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0

    # ------------------------------------------------------------------ recording
    def _grow(self, k: int) -> None:
        if len(self.accepted_per_position) < k:
            self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
        if len(self.accepted_histogram) < k + 1:
            self.accepted_histogram += [0] * (k + 1 - len(self.accepted_histogram))

    def update(self, num_accepted, num_drafted, active=None, emitted=None) -> None:
        """Record one speculation step for a batch.

        num_accepted [B] and num_drafted [B] (tensor, list or scalar broadcast to all rows);
        active [B] bool (None = all rows): only active rows count, each as one step;
        emitted: tokens actually emitted, [B] or a total (default num_accepted + 1 per active row).
        One host sync per call, outside any graph.
        """
        acc = _as_long(num_accepted)
        rows = acc.numel()
        dr = _as_long(num_drafted, acc)
        if dr.numel() != acc.numel():
            raise ValueError(f"num_drafted has {dr.numel()} rows, num_accepted has {acc.numel()}")
        if active is None:
            mask = torch.ones_like(acc, dtype=torch.bool)
        else:
            mask = torch.as_tensor(active).detach().to("cpu", torch.bool).flatten().expand(acc.numel())
        acc, dr = acc[mask], dr[mask]
        if bool((acc < 0).any()) or bool((acc > dr).any()):
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {acc.tolist()} / {dr.tolist()}")
        k = int(dr.max()) if dr.numel() else 0
        self._grow(k)
        self.steps += int(acc.numel())
        self.drafted += int(dr.sum())
        self.accepted += int(acc.sum())
        if emitted is None:
            self.emitted += int(acc.sum()) + int(acc.numel())
        else:
            e = _as_long(emitted)
            self.emitted += int(e[mask].sum()) if e.numel() == rows else int(e.sum())
        if acc.numel():
            hist = torch.bincount(acc, minlength=k + 1).tolist()
            for m, c in enumerate(hist):
                self.accepted_histogram[m] += c
            for i in range(k):
                self.accepted_per_position[i] += int((acc > i).sum())

    def add_time(self, draft_s: float = 0.0, verify_s: float = 0.0, other_s: float = 0.0) -> None:
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.other_s += other_s

    @contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        """``with stats.timer("draft"): ...`` adds the block's wall time to ``draft_s`` (or verify/other).

        On an asynchronous device, synchronise inside the block for the split to be meaningful.
        """
        if phase not in _PHASES:
            raise ValueError(f"phase must be one of {_PHASES}, got {phase!r}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, f"{phase}_s", getattr(self, f"{phase}_s") + time.perf_counter() - t0)

    # ------------------------------------------------------------------ derived
    @property
    def k_max(self) -> int:
        return len(self.accepted_per_position)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    tau = mean_acceptance_length

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.steps if self.steps else 0.0 for a in self.accepted_per_position]

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.other_s

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.total_s if self.total_s > 0 else 0.0

    # ------------------------------------------------------------------ combining
    def merge(self, other: SpecStats) -> SpecStats:
        """Add ``other``'s counts and times into ``self`` (in place); returns self."""
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted
        self.accepted_per_position = _pad_add(self.accepted_per_position, other.accepted_per_position)
        self.accepted_histogram = _pad_add(self.accepted_histogram, other.accepted_histogram)
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        self.other_s += other.other_s
        return self

    def copy(self) -> SpecStats:
        return SpecStats.from_dict(self.to_dict())

    def __add__(self, other: SpecStats) -> SpecStats:
        if not isinstance(other, SpecStats):
            return NotImplemented
        return self.copy().merge(other)

    def __radd__(self, other):
        if other == 0:  # sum([...]) support
            return self.copy()
        return NotImplemented

    def reset(self) -> None:
        """Zero every counter and timer."""
        fresh = SpecStats()
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))

    # ------------------------------------------------------------------ export
    def to_dict(self) -> dict:
        """All raw fields plus the derived values (plain Python numbers/lists, JSON-serialisable)."""
        d = {f.name: (list(getattr(self, f.name)) if isinstance(getattr(self, f.name), list)
                      else getattr(self, f.name)) for f in fields(self)}
        d.update(
            k_max=self.k_max,
            mean_acceptance_length=self.mean_acceptance_length,
            acceptance_rate=self.acceptance_rate,
            per_position_acceptance=self.per_position_acceptance,
            tokens_per_step=self.tokens_per_step,
            total_s=self.total_s,
            tokens_per_s=self.tokens_per_s,
        )
        return d

    def to_frame(self):
        """``to_dict()`` as a one-row pandas DataFrame (list values stay lists: one cell each).

        Needs pandas (``pip install 'specdec[experiments]'``); ``pd.concat`` of several frames compares
        runs, ``specdec.tools.experiments`` sweeps them."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("SpecStats.to_frame needs pandas: pip install 'specdec[experiments]'") from e
        return pd.DataFrame([self.to_dict()])

    @classmethod
    def from_dict(cls, d: dict) -> SpecStats:
        """Inverse of ``to_dict`` (derived keys are ignored)."""
        names = {f.name for f in fields(cls)}
        kw = {k: (list(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
        return cls(**kw)

    def __str__(self) -> str:
        pos = ", ".join(f"{a:.2f}" for a in self.per_position_acceptance)
        return (f"SpecStats(steps={self.steps}, drafted={self.drafted}, accepted={self.accepted}, "
                f"emitted={self.emitted}, tau={self.mean_acceptance_length:.3f}, "
                f"acceptance_rate={self.acceptance_rate:.3f}, per_position=[{pos}], "
                f"time draft/verify/other={self.draft_s:.3f}/{self.verify_s:.3f}/{self.other_s:.3f}s)")
