"""Bucket lists and bucket choice.

A bucket is a fixed length a graph is compiled for: context buckets bound the padded prompt
length, KV buckets bound how many cache slots token generation / verification attends over.
"""
from __future__ import annotations


def default_buckets(n_positions: int, smallest: int = 128) -> list[int]:
    """Powers of two from ``smallest`` up to (and always including) ``n_positions``."""
    buckets, b = [], smallest
    while b < n_positions:
        buckets.append(b)
        b *= 2
    return buckets + [n_positions]


def fine_buckets(n_positions: int, smallest: int = 32) -> list[int]:
    """Powers of two and one and a half times powers of two from ``smallest`` up to (and always including)
    ``n_positions`` (32, 48, 64, 96, 128, 192, ...): a prompt longer than the smallest bucket is padded by
    less than half its length."""
    buckets, b = [], smallest
    while b < n_positions:
        buckets += [b] if b * 3 // 2 >= n_positions else [b, b * 3 // 2]
        b *= 2
    return buckets + [n_positions]


def check_buckets(name: str, buckets: list[int] | None, n_positions: int, fine: bool = False) -> list[int]:
    """Validate a user bucket list (sorted, unique, positive, ≤ n_positions) or build the default:
    ``default_buckets``, or ``fine_buckets`` with ``fine`` (graphs that compile nothing per bucket)."""
    if buckets is None:
        return fine_buckets(n_positions) if fine else default_buckets(n_positions)
    out = sorted({int(b) for b in buckets})
    if not out or out[0] < 1 or out[-1] > n_positions:
        raise ValueError(f"{name}={buckets!r}: buckets must be positive and at most n_positions={n_positions}")
    return out


def pick_bucket(buckets: list[int], needed: int, what: str = "length") -> int:
    """The smallest bucket ≥ ``needed``."""
    for b in buckets:
        if b >= needed:
            return b
    raise ValueError(f"{what} {needed} exceeds the largest bucket {buckets[-1]} (buckets: {buckets})")
