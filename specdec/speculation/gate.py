"""Speculate only while it pays: a batch-level choice between speculative and plain decode steps.

``SpeculativeGenerator(draft, target, k, gate=True)`` (or ``gate=CostGate(probe_every, smoothing,
max_probe_every, warmup)``) measures, as it runs, the rate at which each kind of step emits tokens:

    R = moving average of a kind's tokens per step (emitted by the active rows)
        / moving average of its wall seconds per step       (weight ``smoothing``; a plain mean at first)

and runs the kind with the higher R (ratios of averages: a speculative step's tokens vary a lot from
step to step). The first 2 * ``warmup`` steps alternate the kinds, speculative first; then after
``probe_every`` - 1 steps of the preferred kind the other kind runs once (a probe), so a rate that
changes (acceptance follows the text; a step's cost follows the KV bucket) is seen. A probe that leaves
the preference as it was doubles the spacing of probes, up to ``max_probe_every``; one that flips it
resets the spacing to ``probe_every`` (so a kind that is much slower costs little). Where speculation
is slower than decoding — a verify that costs more than τ decode steps, as at batch 4 on a CPU without
AMX or against autotuned kernels (docs/strategies/gate.md) — the generator decodes plainly, paying only the warm-up and
the probes; where it pays it keeps speculating.

Lossless: a plain step is the proposer's k = 0 step (``specdec.speculation.speculative``: the target decodes one
token, the proposer reads its outputs), which emits the target's token. The choice for a step is a
function of earlier steps' token counts and clock readings only, never of this step's drafts or random
draws, so conditioned on everything before the step its tokens follow the target's distribution
whichever kind runs (the argument of ``specdec.speculation.adaptive``); greedy output stays token for token the
target's. The choice is per batch (one graph call serves every row).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CostGate:
    """The policy (module docstring): ``warmup`` steps of each kind (alternating) before choosing; then
    probe the other kind after ``probe_every`` - 1 steps of the preferred one, doubling the spacing up to
    ``max_probe_every`` while probes confirm the preference; average with weight ``smoothing`` on the
    newest step."""

    probe_every: int = 16
    smoothing: float = 0.1
    max_probe_every: int = 256
    warmup: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 1:
            raise ValueError(f"CostGate.warmup must be an int >= 1 (steps of each kind measured before "
                             f"choosing), got {self.warmup!r}")
        if isinstance(self.probe_every, bool) or not isinstance(self.probe_every, int) or self.probe_every < 2:
            raise ValueError(f"CostGate.probe_every must be an int >= 2 (steps between probes of the other "
                             f"kind of step), got {self.probe_every!r}")
        if isinstance(self.max_probe_every, bool) or not isinstance(self.max_probe_every, int) \
                or self.max_probe_every < self.probe_every:
            raise ValueError(f"CostGate.max_probe_every must be an int >= probe_every={self.probe_every}, got "
                             f"{self.max_probe_every!r}")
        if isinstance(self.smoothing, bool) or not isinstance(self.smoothing, (int, float)) \
                or not 0 < self.smoothing <= 1:
            raise ValueError(f"CostGate.smoothing must be a number in (0, 1], got {self.smoothing!r}")


class GateMeter:
    """One generator's measurements and choice under ``gate`` (``clock``: seconds, perf_counter).

    Per kind (True: speculative, False: plain): ``steps`` run so far and moving averages of the tokens
    and the seconds of a step (weight max(``smoothing``, 1 / steps): a plain mean while a kind has few
    steps), whose ratio is the kind's ``rate``; ``speculate()`` picks the next step's kind,
    ``record(speculated, tokens, seconds)`` adds a finished step."""

    def __init__(self, gate: CostGate, clock: Callable[[], float] = time.perf_counter):
        self.gate, self.clock = gate, clock
        self.reset()

    def reset(self) -> None:
        """Forget every measurement: the next steps warm up again (e.g. when the machine's load changes)."""
        self.steps = {True: 0, False: 0}
        self.tokens = {True: 0.0, False: 0.0}
        self.seconds = {True: 0.0, False: 0.0}
        self.run = 0                        # steps of the preferred kind since the last probe
        self.spacing = self.gate.probe_every    # the current probe spacing

    def rate(self, speculated: bool) -> float | None:
        """Tokens per second of the kind (None before its first step)."""
        if not self.steps[speculated]:
            return None
        return self.tokens[speculated] / max(self.seconds[speculated], 1e-9)

    def preferred(self) -> bool | None:
        """The faster kind (True: speculative), None while either has fewer than ``warmup`` steps."""
        if min(self.steps.values()) < self.gate.warmup:
            return None
        return self.rate(True) >= self.rate(False)

    def speculate(self) -> bool:
        preferred = self.preferred()
        if preferred is None:               # warming up: the kinds alternate, speculative first
            return self.steps[True] <= self.steps[False]
        return (not preferred) if self.run >= self.spacing - 1 else preferred

    def record(self, speculated: bool, tokens: int, seconds: float) -> None:
        before = self.preferred()
        self.steps[speculated] += 1
        w = max(self.gate.smoothing, 1.0 / self.steps[speculated])
        self.tokens[speculated] += w * (tokens - self.tokens[speculated])
        self.seconds[speculated] += w * (seconds - self.seconds[speculated])
        if before is None:                  # warming up: runs count from its end
            self.run = 0
        elif speculated != before:          # a probe: space the next one by what it showed
            kept = self.preferred() == before
            self.spacing = min(2 * self.spacing, self.gate.max_probe_every) if kept else self.gate.probe_every
            self.run = 0
        else:
            self.run += 1
