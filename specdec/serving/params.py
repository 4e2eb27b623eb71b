"""Per-request generation parameters of the serving engine, validated at the API boundary.

Every value is checked against what the model's tensors can carry: sampling parameters travel as
float32 and integers as int64 on the device, so a value that passes here is one the model samples
with as asked (no overflow, no value that becomes 0, a subnormal or inf in float32)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_INT = 2**31 - 1                  # max_tokens, top_k: bounded well inside int32 / exact float32 compares
MAX_SEED = 2**63                     # seeds are int64
MIN_SCALE, MAX_SCALE = 1e-6, 1e6     # temperature, repetition_penalty: logits / x stays finite in float32
MIN_TOP_P = 1.1754943508222875e-38   # the smallest normal float32
MAX_STOP, MAX_STOP_CHARS = 16, 1000


class InvalidParam(ValueError):
    """A request parameter the server cannot honour; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestParams:
    """What one request asks for.

    max_tokens: new tokens in [1, 2**31 - 1] (None: up to the model's positions). temperature: 0 =
    greedy, else in [1e-6, 1e6]. top_k: 0 = off, else up to 2**31 - 1. top_p in (0, 1] (at least the
    smallest normal float32). seed: the row's random stream in [0, 2**63) (None: drawn by the server).
    stop: up to 16 strings of 1-1000 characters that end the output (not returned).
    repetition_penalty: HF's rule, 1 = off, in [1e-6, 1e6]. ignore_eos: generate ``max_tokens``
    tokens whatever the model emits. Invalid values raise ``InvalidParam`` (a ``ValueError``).
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
            ("max_tokens", self.max_tokens,
             self.max_tokens is None or _int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT,
             f"an integer in [1, {MAX_INT}] (or null: up to the model's context length)"),
            ("temperature", self.temperature,
             _number(self.temperature) and (self.temperature == 0 or MIN_SCALE <= self.temperature <= MAX_SCALE),
             "a number >= 0: 0 (greedy) or in [1e-06, 1e+06]"),
            ("top_k", self.top_k, _int(self.top_k) and 0 <= self.top_k <= MAX_INT,
             f"an integer >= 0 (0 = off) and <= {MAX_INT}"),
            ("top_p", self.top_p, _number(self.top_p) and MIN_TOP_P <= self.top_p <= 1,
             "a number in (0, 1] (at least 1.18e-38, the smallest normal float32)"),
            ("seed", self.seed, self.seed is None or _int(self.seed) and 0 <= self.seed < MAX_SEED,
             "an integer in [0, 2**63) or null"),
            ("repetition_penalty", self.repetition_penalty,
             _number(self.repetition_penalty) and MIN_SCALE <= self.repetition_penalty <= MAX_SCALE,
             "a number > 0 (1 = off) in [1e-06, 1e+06]"),
            ("stop", self.stop, isinstance(self.stop, tuple) and len(self.stop) <= MAX_STOP
             and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"a non-empty string or a list of at most {MAX_STOP} non-empty strings of at most "
             f"{MAX_STOP_CHARS} characters"),
            ("ignore_eos", self.ignore_eos, isinstance(self.ignore_eos, bool), "true or false"),
        )
        for name, value, ok, allowed in checks:
            if not ok:
                raise InvalidParam(f"{name}={_show(value)} is invalid: must be {allowed}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _show(value) -> str:
    """``repr`` of a value, shortened to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
