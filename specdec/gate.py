"""Speculate only while it pays: a batch-level choice between speculative and plain decode steps.

``SpeculativeGenerator(draft, target, k, gate=True)`` (or ``gate=CostGate(probe_every, smoothing)``)
measures, as it runs, the rate at which each kind of step emits tokens:

    rate = tokens emitted by the active rows / wall seconds of the step      (one value per step)
    R_spec, R_plain = exponential moving averages of the two kinds' rates    (weight ``smoothing``)

and runs the kind with the higher rate. The first step speculates, the second is plain (so both rates
exist); then after ``probe_every`` - 1 steps of the preferred kind the other kind runs once (a probe),
so a rate that changes (acceptance follows the text; a step's cost follows the KV bucket) is seen. A
probe that leaves the preference as it was doubles the spacing of probes, up to ``max_probe_every``;
one that flips it resets the spacing to ``probe_every`` (so a kind that is much slower costs little). Where
speculation is slower than decoding — a verify that costs more than τ decode steps, as at batch 4 on a
CPU without AMX or against autotuned kernels (README) — the generator decodes plainly and is at most a
probe's cost slower than target-only; where it pays it keeps speculating.

Lossless: a plain step is the proposer's k = 0 step (``specdec.speculative``: the target decodes one
token, the proposer reads its outputs), which emits the target's token. The choice for a step is a
function of earlier steps' token counts and clock readings only, never of this step's drafts or random
draws, so conditioned on everything before the step its tokens follow the target's distribution
whichever kind runs (the argument of ``specdec.adaptive``); greedy output stays token for token the
target's. The choice is per batch (one graph call serves every row).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class CostGate:
    """The policy (module docstring): probe the other kind of step after ``probe_every`` - 1 steps of the
    preferred one, doubling the spacing up to ``max_probe_every`` while probes confirm the preference;
    average the rates with weight ``smoothing`` on the newest step."""

    probe_every: int = 16
    smoothing: float = 0.25
    max_probe_every: int = 256

    def __post_init__(self) -> None:
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
    """One generator's measured rates and choice under ``gate`` (``clock``: seconds, perf_counter).

    ``rates``: {True: R_spec, False: R_plain} (None until measured), ``steps``: {True: speculative steps,
    False: plain steps} run so far; ``speculate()`` picks the next step's kind, ``record(speculated, tokens,
    seconds)`` adds a finished step."""

    def __init__(self, gate: CostGate, clock: Callable[[], float] = time.perf_counter):
        self.gate, self.clock = gate, clock
        self.rates: dict[bool, float | None] = {True: None, False: None}
        self.steps = {True: 0, False: 0}
        self.run = 0                        # steps of the preferred kind since the last probe
        self.spacing = gate.probe_every     # the current probe spacing

    def preferred(self) -> bool | None:
        """The faster kind so far (True: speculative), None until both are measured."""
        spec, plain = self.rates[True], self.rates[False]
        return None if spec is None or plain is None else spec >= plain

    def speculate(self) -> bool:
        preferred = self.preferred()
        if preferred is None:
            return self.rates[True] is None
        return (not preferred) if self.run >= self.spacing - 1 else preferred

    def record(self, speculated: bool, tokens: int, seconds: float) -> None:
        self.steps[speculated] += 1
        before = self.preferred()
        rate = tokens / max(seconds, 1e-9)
        old = self.rates[speculated]
        self.rates[speculated] = rate if old is None else old + self.gate.smoothing * (rate - old)
        if before is None:                  # measuring the first rates: runs count from here
            self.run = 0
        elif speculated != before:          # a probe: space the next one by what it showed
            kept = self.preferred() == before
            self.spacing = min(2 * self.spacing, self.gate.max_probe_every) if kept else self.gate.probe_every
            self.run = 0
        else:
            self.run += 1
