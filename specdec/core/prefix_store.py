"""``PrefixStore``: host copies of the KV prefixes rows gave up, so prefix caching outlives a row's next prompt.

A row keeps the KV of what it last held (``KVState.cached``); when it takes a prompt that shares little of it,
that KV would be lost, and a conversation that comes back after another one used its row (more sessions than
rows, a batch-1 model serving several users) would encode its whole history again. llama.cpp's server keeps
such a slot's prompt cache in host memory (``--cache-ram``) and vLLM keeps freed KV blocks reusable until they
are evicted; this store does the same for whole prefixes:

- an entry is a list of token ids and, for each per-slot cache buffer of every layer (K, V and, quantized, their
  scales: ``Attention.cache_buffers``), a CPU copy of the slots [0, len(tokens)) of the row that held them;
  every slot's KV is a function of the ids before it only (the model's numerics are row-invariant), so an entry
  may go back into any row;
- ``longest(prompt)``: the entry sharing the longest prefix with a prompt (at most len(prompt) - 1 ids: a
  prompt's last id is always fed);
- ``add``: an entry whose ids are a prefix of another's holds nothing more and is not kept (nor copied: the
  caller passes a function that reads the slots); the least recently used entries go when the copies pass
  ``max_bytes`` (an entry larger than that is not kept).

``DecoderModel.prefill`` uses it (``prefix_cache_mb``): it saves a row's record before a prompt overwrites most
of it, and restores an entry into the row when the entry shares more of the prompt than the row does.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

STORE_MIN_TOKENS = 16
"""A row's record is stored only when a prompt would overwrite at least this many of its tokens."""


@dataclass
class StoredPrefix:
    """token ids and, per cache buffer, their slots [len(tokens), ...] (CPU copies); ``key`` in the store."""

    tokens: list[int]
    slots: list[torch.Tensor]
    key: int

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slots)


def shared_length(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixStore:
    """Stored prefixes within ``max_bytes`` of host memory (see the module docstring); ``stats()`` counts
    entries, bytes, adds, restores (``hit``) and evictions."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"the prefix store's budget must be an int >= 0 (bytes), got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, StoredPrefix] = OrderedDict()    # least recently used first
        self.bytes = 0
        self.counts = dict.fromkeys(("added", "restored", "evicted"), 0)
        self._next = 0

    def longest(self, prompt: list[int]) -> tuple[int, StoredPrefix | None]:
        """(n, entry): the entry sharing the longest prefix with ``prompt``, n ids of it (at most len(prompt) - 1);
        (0, None) when none shares any."""
        best, found = 0, None
        for entry in self.entries.values():
            n = shared_length(entry.tokens, prompt[:len(prompt) - 1])
            if n > best:
                best, found = n, entry
        return best, found

    def hit(self, entry: StoredPrefix) -> None:
        """``entry`` went back into a row: it becomes the most recently used (if it is still held: the record
        its row gave up may have evicted or replaced it since ``longest`` found it)."""
        if entry.key in self.entries:
            self.entries.move_to_end(entry.key)
        self.counts["restored"] += 1

    def covers(self, tokens: list[int]) -> bool:
        """Whether an entry already holds ``tokens`` (as its ids or a prefix of them)."""
        return any(len(e.tokens) >= len(tokens) and e.tokens[:len(tokens)] == tokens for e in self.entries.values())

    def add(self, tokens: list[int], read: Callable[[], list[torch.Tensor]]) -> None:
        """Keep ``read()`` (per cache buffer, [len(tokens), ...] CPU copies) as the KV of ``tokens``; ``read`` is
        not called when an entry already holds them."""
        if self.covers(tokens):
            return
        entry = StoredPrefix(list(tokens), read(), self._next)
        if entry.nbytes > self.max_bytes:
            return
        for key in [k for k, e in self.entries.items() if entry.tokens[:len(e.tokens)] == e.tokens]:
            self._drop(key)                          # a prefix of the new entry: nothing the new one lacks
        self.entries[self._next] = entry
        self._next += 1
        self.bytes += entry.nbytes
        self.counts["added"] += 1
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.counts["evicted"] += 1

    def _drop(self, key: int) -> None:
        self.bytes -= self.entries.pop(key).nbytes

    def clear(self) -> None:
        """No entries (the counters stay)."""
        self.entries.clear()
        self.bytes = 0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self.entries), "bytes": self.bytes, "max_bytes": self.max_bytes, **self.counts}
