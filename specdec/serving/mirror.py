"""Tensor-parallel serving: every rank runs the same engine operations in the same order.

Rank 0 serves HTTP and schedules; its core ``Engine`` is wrapped in ``MirroredEngine``, which
broadcasts each state-changing call (``add`` with all its arguments, explicit seed included;
``step``; ``release``) to the other ranks before running it. The other ranks ``follow``: they
receive the calls and run them on their own shard, so the collectives inside the graphs line up.
``close()`` sends the stop command. The engine is deterministic given its calls, so every rank's
state stays identical.
"""
from __future__ import annotations

import logging

import torch.distributed as dist

from ..core.engine import Engine

log = logging.getLogger("specdec.serving")

STOP = None


class MirroredEngine:
    """Rank 0's ``Engine`` whose ``add`` / ``step`` / ``release`` run on every rank of ``engine.target.tp``.
    Reads (rows, stats, target, ...) go to the local engine."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tp = engine.target.tp

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def _send(self, command) -> None:
        dist.broadcast_object_list([command], src=0, group=self.tp.group)

    def add(self, prompt, **kwargs) -> int:
        self._send(("add", list(prompt), kwargs))
        return self.engine.add(prompt, **kwargs)

    def step(self) -> dict[int, list[int]]:
        self._send(("step", None, None))
        return self.engine.step()

    def release(self, row: int) -> None:
        self._send(("release", row, None))
        self.engine.release(row)

    def close(self) -> None:
        """Tell the other ranks to stop following."""
        self._send(STOP)


def follow(engine: Engine) -> None:
    """Ranks > 0: run rank 0's engine calls until it closes. An exception a call raises is the one
    rank 0's call raised too (same inputs, same code): it is logged and the next call follows."""
    tp = engine.target.tp
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=tp.group)
        if box[0] is STOP:
            return
        op, arg, kwargs = box[0]
        try:
            if op == "add":
                engine.add(arg, **kwargs)
            elif op == "step":
                engine.step()
            else:
                engine.release(arg)
        except Exception:
            log.exception("rank %d: engine %s failed (as on rank 0, which decides what follows)", tp.rank, op)
