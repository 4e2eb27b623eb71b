"""Replay suffix decoding on recorded greedy outputs: a batch-1 run's exact steps, without the target.

Greedy speculation emits target-only greedy output whatever it drafts, and a suffix proposer's drafts are a
deterministic function of what it has seen (the row's prompt and emitted tokens, the cache of finished
requests). So, given the requests' prompts and their target-only greedy outputs in the order they ran,
every step of a batch-1 run is known on the host alone: the draft (``SuffixProposer.step_drafts``, what
``propose`` verifies), how much of it the target accepts (the deepest draft path equal to the output: a chain's longest
equal prefix), what the step emits. ``replay`` returns those steps, the same as the engine's (tests compare
them), in milliseconds per request instead of a target's seconds: what a researcher tunes ``alpha``,
``min_prob``, k or the tree shape with, and what bounds a rule that chooses how much of a proposal to verify.

``oracle=True`` verifies only the drafts the target will accept (the step's real ``drafted`` is cut to its
``accepted``): no rule that decides how many of the proposed tokens to verify emits more per step or verifies
fewer. With a verify cost curve (``VerifyCost``: ms of one target call over n tokens, from
``bench/bench_decode_step.py``) a replay gives the decode phase's modelled time and speedup over target-only.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..speculation.proposer import Verified, step_k
from .proposer import SuffixProposer
from .speculate import Draft


@dataclass(frozen=True)
class ReplayStep:
    """One step of a row: ``drafted`` tokens verified (0: a decode step), ``accepted`` of them, ``emitted``
    tokens kept (accepted + 1, cut where the request ended), ``match_len`` behind the draft (0: none)."""

    drafted: int
    accepted: int
    emitted: int
    match_len: int


@dataclass
class Replay:
    """The steps of a replay, request after request (each request's first token came from its prompt's
    encoding, not from a step)."""

    steps: list[ReplayStep] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.emitted for s in self.steps)

    @property
    def tau(self) -> float:
        """Tokens a step (the mean acceptance length of the steps' tokens)."""
        return self.tokens / len(self.steps) if self.steps else 0.0

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    def modelled_speedup(self, cost: VerifyCost) -> float:
        """Target-only decode time of the same tokens (one decode step each) / the steps' verify time."""
        return self.tokens * cost(1) / sum(cost(s.drafted + 1) for s in self.steps)


@dataclass(frozen=True)
class VerifyCost:
    """ms of one batch-1 target call over n tokens, linear between measured sizes ``sizes`` (ascending,
    starting at 1) and proportional past the last one."""

    sizes: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self):
        if not self.sizes or self.sizes[0] != 1 or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"sizes must ascend from 1 (a decode step), got {self.sizes!r}")
        if len(self.ms) != len(self.sizes) or min(self.ms) <= 0:
            raise ValueError(f"one positive time per size, got {self.ms!r} for {self.sizes!r}")

    @classmethod
    def from_decode_steps(cls, result: dict) -> VerifyCost:
        """From a ``bench_decode_step.py`` result: its batch-1 shapes' median ms."""
        rows = sorted((r["n"], r["median_ms"]) for r in result["results"] if r["batch"] == 1)
        return cls(tuple(n for n, _ in rows), tuple(ms for _, ms in rows))

    def __call__(self, n: int) -> float:
        i = bisect_left(self.sizes, n)
        if i < len(self.sizes) and self.sizes[i] == n:
            return self.ms[i]
        if i == len(self.sizes):
            return self.ms[-1] * n / self.sizes[-1]
        (a, ta), (b, tb) = (self.sizes[i - 1], self.ms[i - 1]), (self.sizes[i], self.ms[i])
        return ta + (tb - ta) * (n - a) / (b - a)


def accepted_depth(draft: Draft, truth: Sequence[int]) -> int:
    """The depth of the deepest draft node whose path equals ``truth``'s start (greedy acceptance)."""
    depth = {0: 0}
    best = 0
    for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents), 1):
        d = depth.get(parent, -1) + 1
        if d > 0 and d <= len(truth) and truth[d - 1] == token:
            depth[i] = d
            best = max(best, d)
    return best


def replay(proposer: SuffixProposer, records: Iterable[tuple[Sequence[int], Sequence[int]]], k: int, *,
           oracle: bool = False) -> Replay:
    """Replay ``proposer`` (batch 1; its cache as the runs before left it) drafting at most ``k`` tokens a
    step over ``records``: (prompt ids, the target-only greedy output's ids, first token included), in the
    order the requests ran. See the module docstring; ``oracle``: verify only what will be accepted."""
    if proposer.batch_size != 1:
        raise ValueError(f"replay runs batch 1, the proposer has batch_size={proposer.batch_size}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    out = Replay()
    for prompt, output in records:
        if not prompt or not output:
            raise ValueError("every record needs a prompt and at least one output token")
        proposer.start([0], [torch.tensor(list(prompt))], None, None,
                       SimpleNamespace(tokens=torch.tensor([[output[0]]])))
        pos, total = 1, len(prompt) + len(output)
        while pos < len(output):
            seq = proposer.seq(0)
            length = len(seq)
            tail, lengths = torch.tensor([seq[-2:].tolist()]), torch.tensor([length])
            depth = step_k(proposer, k, proposer.target.n_positions, length)
            draft = proposer.step_drafts(tail, lengths, depth)[0] if depth else Draft()
            accepted = accepted_depth(draft, output[pos:pos + depth])
            emitted = list(output[pos:pos + accepted + 1])
            drafted = accepted if oracle else len(draft.tokens)
            out.steps.append(ReplayStep(drafted, accepted, len(emitted), draft.match_len))
            proposer.accepted(lengths, Verified(torch.tensor([accepted]), torch.tensor([emitted]), None, None))
            pos += len(emitted)
        proposer.finished([0], [total])
    return out
