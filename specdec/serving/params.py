"""Per-request generation parameters of the serving engine, validated at the API boundary."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestParams:
    """What one request asks for.

    max_tokens: new tokens (None: up to the model's positions). temperature: 0 = greedy.
    top_k: 0 = off. top_p in (0, 1]. seed: the row's random stream (None: drawn by the server).
    stop: strings that end the output (not returned). repetition_penalty: HF's rule, 1 = off.
    ignore_eos: generate ``max_tokens`` tokens whatever the model emits.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    repetition_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self):
        checks = (
            ("max_tokens", self.max_tokens, self.max_tokens is None or _int(self.max_tokens) and self.max_tokens >= 1,
             "an integer >= 1 (or null: up to the model's context length)"),
            ("temperature", self.temperature, _finite(self.temperature) and self.temperature >= 0,
             "a number >= 0 (0 = greedy)"),
            ("top_k", self.top_k, _int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", self.top_p, _finite(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("seed", self.seed, self.seed is None or _int(self.seed) and 0 <= self.seed < 2**63,
             "an integer in [0, 2**63) or null"),
            ("repetition_penalty", self.repetition_penalty,
             _finite(self.repetition_penalty) and self.repetition_penalty > 0, "a number > 0 (1 = off)"),
            ("stop", self.stop, isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop)
             and len(self.stop) <= 16, "a non-empty string or a list of at most 16 non-empty strings"),
        )
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
