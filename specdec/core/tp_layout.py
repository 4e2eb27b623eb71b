"""How attention heads are laid out across tensor-parallel ranks (GQA sharding, head padding).

Column-parallel q/k/v give each rank a contiguous block of head *slots*; a slot holds one source
head or padding (zero weights, so it contributes nothing through the zero columns of o_proj).
Within a rank, q slot ``j`` attends to kv slot ``j // (q_per_rank // kv_per_rank)``.

Strategies (NxD Inference's ``GQA`` names and values):

- ``replicate-to-tp-degree``: KV heads are split when ``num_kv_heads % tp == 0``; when
  ``tp % num_kv_heads == 0`` each KV head is replicated ``tp / num_kv_heads`` times (one per rank)
  and its query group is split over those ranks, padded to equal size. The default when possible.
- ``convert-to-mha``: every query head gets its own copy of its KV head; query (and KV) heads are
  padded up to a multiple of ``tp``. Works for any head counts; the default otherwise.

Example, SmolLM2-135M (9 query / 3 KV heads) at tp=2: 3 and 2 do not divide each other, so
convert-to-mha: 10 query slots and 10 KV slots (one of each is padding), 5 per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class GQA(str, Enum):
    REPLICATE_TO_TP_DEGREE = "replicate-to-tp-degree"
    CONVERT_TO_MHA = "convert-to-mha"


@dataclass(frozen=True)
class HeadLayout:
    """Head slots across ``tp_degree`` ranks.

    q_index[s] / kv_index[s]: the source query / KV head in global slot ``s`` (-1 = padding);
    rank r owns q slots ``[r * q_per_rank, (r + 1) * q_per_rank)`` and likewise KV slots.
    """

    tp_degree: int
    strategy: GQA
    num_heads: int        # source query heads
    num_kv_heads: int     # source KV heads
    q_index: tuple[int, ...]
    kv_index: tuple[int, ...]

    @property
    def q_per_rank(self) -> int:
        return len(self.q_index) // self.tp_degree

    @property
    def kv_per_rank(self) -> int:
        return len(self.kv_index) // self.tp_degree

    @property
    def padded_heads(self) -> int:
        return len(self.q_index)

    @property
    def padded_kv_heads(self) -> int:
        return len(self.kv_index)

    def rank_slots(self, rank: int) -> tuple[list[int], list[int]]:
        """(q source heads, kv source heads) of ``rank``'s slots, -1 for padding."""
        q, kv = self.q_per_rank, self.kv_per_rank
        return list(self.q_index[rank * q:(rank + 1) * q]), list(self.kv_index[rank * kv:(rank + 1) * kv])


def parse_gqa(strategy: str | GQA | None) -> GQA | None:
    if strategy is None or isinstance(strategy, GQA):
        return strategy
    try:
        return GQA(str(strategy).lower().replace("_", "-"))
    except ValueError:
        allowed = ", ".join(repr(g.value) for g in GQA)
        raise ValueError(f"gqa_strategy={strategy!r} is not supported; "
                         f"use one of {allowed} or None (automatic)") from None


def head_layout(num_heads: int, num_kv_heads: int, tp_degree: int, strategy: str | GQA | None = None) -> HeadLayout:
    """The head layout for ``tp_degree`` ranks; ``strategy=None`` picks replicate-to-tp-degree when
    the KV heads and the degree divide one another, else convert-to-mha."""
    if not isinstance(tp_degree, int) or tp_degree < 1:
        raise ValueError(f"tp_degree must be an integer >= 1, got {tp_degree!r}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} must be a positive multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    replicable = num_kv_heads % tp_degree == 0 or tp_degree % num_kv_heads == 0
    chosen = parse_gqa(strategy) or (GQA.REPLICATE_TO_TP_DEGREE if replicable else GQA.CONVERT_TO_MHA)
    if chosen is GQA.REPLICATE_TO_TP_DEGREE:
        if not replicable:
            degrees = sorted(d for d in range(1, 2 * num_kv_heads + 1)
                             if num_kv_heads % d == 0 or d % num_kv_heads == 0)
            raise ValueError(
                f"gqa_strategy='replicate-to-tp-degree' needs num_key_value_heads ({num_kv_heads}) and tp_degree "
                f"({tp_degree}) to divide one another; use 'convert-to-mha' (pads heads) or a tp_degree among "
                f"{degrees}")
        if num_kv_heads % tp_degree == 0:      # split the KV heads, queries follow their groups
            q_index, kv_index = tuple(range(num_heads)), tuple(range(num_kv_heads))
        else:                                  # one KV head per rank, its query group split r ways
            r = tp_degree // num_kv_heads
            per = math.ceil(group / r)
            kv_index = tuple(s // r for s in range(tp_degree))
            q_index = tuple(
                (kv * group + j * per + i) if j * per + i < group else -1
                for s, kv in enumerate(kv_index) for j in [s % r] for i in range(per))
    else:                                      # every query head gets its own KV copy; pad to tp
        padded = math.ceil(num_heads / tp_degree) * tp_degree
        q_index = tuple(h if h < num_heads else -1 for h in range(padded))
        kv_index = tuple(h // group if h < num_heads else -1 for h in range(padded))
    return HeadLayout(tp_degree, chosen, num_heads, num_kv_heads, q_index, kv_index)
