"""``SuffixCache``: the global suffix cache of suffix decoding, shared by every row and request.

It stores recent finished sequences (a request's output, optionally with its prompt) in a
``SuffixIndex`` and answers longest-suffix-match lookups over all of them. Bounded and thread-safe:

- a token budget ``max_tokens``: adding a sequence evicts whole sequences, least recently used first,
  until the stored tokens fit (a sequence longer than the budget keeps its last ``max_tokens``
  tokens). "Used" = added, or returned as a candidate by a lookup;
- evicted sequences' index entries are swept incrementally: each ``add`` of L tokens reads about
  2 · L · len(keys) index entries, so the entries stay within a constant factor (about 2×) of the
  live ones and memory stays bounded over any number of requests (``stats()["entries"]``);
- one lock around every update and lookup, so the engine thread can add finished requests while
  other threads (server handlers, other engines) look up; a lookup holds it for the candidate scan
  only (~0.1 ms), the draft is built outside it (stored token lists are never mutated once added).

Lookups return ``SuffixIndex.candidates`` (occurrences with match lengths) and count hits.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from .index import Candidate, SuffixIndex


class SuffixCache:
    """A bounded, thread-safe suffix cache (see the module docstring).

    ``max_tokens``: the token budget (stored tokens never exceed it); ``keys`` / ``max_match`` /
    ``max_candidates``: the ``SuffixIndex`` settings, which per-row indexes of a ``SuffixDraft`` share.
    Counters: ``lookups``, ``hits`` (lookups with at least one candidate), ``added``, ``evicted``
    (sequences)."""

    def __init__(self, max_tokens: int = 1 << 18, *, keys: Sequence[int] = (1, 4), max_match: int = 16,
                 max_candidates: int = 32):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
            raise ValueError(f"max_tokens must be an int >= 2 (the cache's token budget), got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.index = SuffixIndex(keys, max_match, max_candidates)
        self.keys, self.max_match, self.max_candidates = self.index.keys, max_match, max_candidates
        self._lru: OrderedDict[int, int] = OrderedDict()        # sequence id → length, least recent first
        self._lock = threading.Lock()
        self._next_id = 0
        self.tokens = 0
        self.lookups = self.hits = self.added = self.evicted = 0

    def add(self, tokens: Sequence[int]) -> int | None:
        """Store a finished sequence (its last ``max_tokens`` tokens); evict least recently used sequences
        until the budget holds. Returns the sequence id (None for fewer than 2 tokens: nothing to match)."""
        seq = (tokens.tolist() if hasattr(tokens, "tolist") else tokens)[-self.max_tokens:]
        if len(seq) < 2:
            return None
        with self._lock:
            while self.tokens + len(seq) > self.max_tokens:
                sid, _ = self._lru.popitem(last=False)
                self.tokens -= self.index.discard(sid)
                self.evicted += 1
            sid, self._next_id = self._next_id, self._next_id + 1
            before = self.index.entries
            self.index.add(sid, seq)
            self._lru[sid] = len(seq)
            self.tokens += len(seq)
            self.added += 1
            self.index.sweep(2 * (self.index.entries - before))
        return sid

    def candidates(self, context: Sequence[int]) -> list[Candidate]:
        """The occurrences of ``context``'s longest matching suffix (``SuffixIndex.candidates``); their
        sequences count as used (LRU)."""
        with self._lock:
            found = self.index.candidates(context)
            self.lookups += 1
            if found:
                self.hits += 1
                for sid in {c[0] for c in found}:
                    self._lru.move_to_end(sid)
        return found

    def clear(self) -> None:
        """Drop every stored sequence (counters kept)."""
        with self._lock:
            keys, match, cap = self.index.keys, self.index.max_match, self.index.max_candidates
            self.index = SuffixIndex(keys, match, cap)
            self._lru.clear()
            self.tokens = 0

    def __len__(self) -> int:
        """Stored sequences."""
        return len(self._lru)

    def stats(self) -> dict[str, float]:
        """sequences, tokens, max_tokens, entries (index entries, garbage included), garbage, lookups, hits,
        hit_rate, added, evicted: what a server exports."""
        with self._lock:
            return dict(sequences=len(self._lru), tokens=self.tokens, max_tokens=self.max_tokens,
                        entries=self.index.entries, garbage=self.index.garbage, lookups=self.lookups,
                        hits=self.hits, hit_rate=self.hits / self.lookups if self.lookups else 0.0,
                        added=self.added, evicted=self.evicted)
