"""``SuffixIndex``: the positions of some token sequences, found by the n-gram that ends at each one.

Suffix decoding needs, for a context c, the occurrences of c's longest suffix in the stored sequences
and what followed each one. A suffix tree answers that exactly but holds up to (match + draft depth)
nodes per stored token, too much for a Python cache of hundreds of thousands of tokens; this index holds
a few integers per token and finds the same occurrences (up to a recency cap) in ~0.1 ms:

- every stored sequence (``seqs``: id → ``array("i")`` of tokens) is kept as is;
- position e of sequence s is *indexed* iff a token follows it (e + 1 < len(seq)); for each key length
  n in ``keys`` (default 1 and 4) with e - n + 1 >= 0 its packed id ``s << POS_BITS | e`` is recorded
  under ``tables[i][key(seq[e-n+1 : e+1])]``: the id itself for a single occurrence, else a list in
  insertion order (latest last). A key is the token itself for n = 1 and the tuple's hash otherwise (a
  collision only costs a candidate whose measured match is shorter);
- ``candidates(c)``: for the longest key length n whose key of c[-n:] has entries, that list read latest
  first (up to 2 · ``max_candidates`` live entries, 4 · ``max_candidates`` read; a removed sequence's
  entries are skipped), each occurrence with its measured match length l (the common suffix of c and
  seq[:e+1], at most ``max_match``); the ``max_candidates`` longest are returned.

Costs: insertion O(len(keys)) per token; ``candidates`` O(max_candidates · max_match) whatever the
stored size. ``discard`` is O(1) and leaves the sequence's entries behind as garbage (``garbage``
counts them); ``sweep(work)`` removes garbage key by key, ``work`` entries at a time, so a cache that
sweeps in proportion to what it inserts keeps its entries within a constant factor of the live ones.
Not thread-safe on its own: ``SuffixCache`` holds a lock around it; a per-row index has one owner.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

POS_BITS = 32
"""Bits of a packed position id (``sid << POS_BITS | end``) holding the position: sequences up to 2^32 tokens."""
_POS_MASK = (1 << POS_BITS) - 1

Candidate = tuple[int, array, int, int]
"""An occurrence of the context's suffix: (sequence id, the sequence's tokens, end position e, match
length l): seq[e-l+1 : e+1] == context[-l:], and the continuation starts at seq[e+1]."""


def _key(tokens: Sequence[int]) -> int:
    """The table key of an n-gram: the token itself for n = 1, else the tuple's hash."""
    return tokens[0] if len(tokens) == 1 else hash(tuple(tokens))


class SuffixIndex:
    """An n-gram position index over token sequences (see the module docstring).

    ``keys``: the n-gram lengths positions are indexed by (distinct, >= 1; longer ones find long matches
    among frequent short n-grams); ``max_match``: the longest match measured; ``max_candidates``: the
    most occurrences ``candidates`` returns (the longest matches among the latest occurrences)."""

    def __init__(self, keys: Sequence[int] = (1, 4), max_match: int = 16, max_candidates: int = 32):
        keys = tuple(sorted(set(keys)))
        if not keys or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in keys):
            raise ValueError(f"keys must be n-gram lengths >= 1, got {keys!r}")
        if max_match < keys[-1]:
            raise ValueError(f"max_match={max_match} must be >= the longest key length {keys[-1]}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        self.keys, self.max_match, self.max_candidates = keys, max_match, max_candidates
        self.seqs: dict[int, array] = {}
        self.tables: list[dict[int, int | list[int]]] = [{} for _ in keys]    # key → packed id(s)
        self.entries = 0         # packed ids in the tables, live and garbage
        self.garbage = 0         # entries of discarded sequences
        self._table = 0                      # the table being swept
        self._todo: list[int] = []           # its keys the sweep has still to visit

    # ------------------------------------------------------------------ updates
    def add(self, sid: int, tokens: Sequence[int]) -> None:
        """Store a new sequence under the id ``sid`` (never reused: stale entries of an old one would alias)."""
        if sid in self.seqs:
            raise ValueError(f"sequence {sid} is already stored")
        self.seqs[sid] = array("i")
        self.extend(sid, tokens)

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``sid``, indexing the positions that gain a continuation."""
        seq = self.seqs[sid]
        first = max(len(seq) - 1, 0)          # the old last position gets its continuation now
        seq.extend(tokens)
        stop = len(seq) - 1
        base = sid << POS_BITS
        packed = [base | e for e in range(first, stop)]         # one int object per position, shared
        for table, n in zip(self.tables, self.keys):
            lo = max(first, n - 1)
            for e in range(lo, stop):
                key = seq[e] if n == 1 else hash(tuple(seq[e - n + 1:e + 1]))
                entry = table.get(key)
                if entry is None:
                    table[key] = packed[e - first]              # one occurrence: the id itself
                elif entry.__class__ is int:
                    table[key] = [entry, packed[e - first]]
                else:
                    entry.append(packed[e - first])
            self.entries += max(stop - lo, 0)

    def discard(self, sid: int) -> int:
        """Forget sequence ``sid`` (O(1)); its entries become garbage. Returns its length."""
        seq = self.seqs.pop(sid)
        self.garbage += sum(max(len(seq) - n, 0) for n in self.keys)
        return len(seq)

    def sweep(self, work: int) -> None:
        """Remove garbage entries, visiting keys table by table until about ``work`` entries were read
        (each table's pass starts from a snapshot of its keys: 8 bytes per key, once per pass)."""
        seqs = self.seqs
        while work > 0 and self.garbage > 0:
            if not self._todo:
                self._table = (self._table + 1) % len(self.tables)
                self._todo = list(self.tables[self._table])
                work -= 1
                continue
            table = self.tables[self._table]
            key = self._todo.pop()
            entry = table.get(key)
            if entry is None:
                continue
            if entry.__class__ is int:
                work -= 1
                if (entry >> POS_BITS) not in seqs:
                    del table[key]
                    self.garbage -= 1
                    self.entries -= 1
                continue
            live = [p for p in entry if (p >> POS_BITS) in seqs]
            work -= len(entry)
            removed = len(entry) - len(live)
            if removed:
                self.garbage -= removed
                self.entries -= removed
                if len(live) > 1:
                    entry[:] = live
                elif live:
                    table[key] = live[0]
                else:
                    del table[key]

    # ------------------------------------------------------------------ lookups
    def candidates(self, context: Sequence[int]) -> list[Candidate]:
        """Occurrences of ``context``'s longest suffix match, each with its match length l >= 1 (see
        ``Candidate``); [] without a match. The key n-gram list of the longest key length that ``context``
        ends with is read latest first, up to ``2 · max_candidates`` live entries (``4 · max_candidates``
        read in all); of those, the ``max_candidates`` with the longest matches are returned (ties: the
        latest), longest first."""
        M = min(self.max_match, len(context))
        if M == 0:
            return []
        tail = array("i", context[-M:])
        seqs, cap = self.seqs, self.max_candidates
        for table, n in zip(reversed(self.tables), reversed(self.keys)):
            if n > M:
                continue
            entry = table.get(_key(tail[-n:]))
            if entry is None:
                continue
            found: list[Candidate] = []
            budget = 4 * cap                                  # entries read, live or garbage
            for packed in ((entry,) if entry.__class__ is int else reversed(entry)):      # latest first
                budget -= 1
                if budget < 0:
                    break
                sid = packed >> POS_BITS
                seq = seqs.get(sid)
                if seq is None:
                    continue
                e = packed & _POS_MASK
                lim = min(M, e + 1)
                if seq[e - lim + 1:e + 1] == tail[M - lim:]:
                    length = lim
                else:
                    length, j = 0, e
                    while seq[j] == tail[M - 1 - length]:
                        length += 1
                        j -= 1
                if length:
                    found.append((sid, seq, e, length))
                    if len(found) == 2 * cap:
                        break
            if found:
                if len(found) > cap:
                    found.sort(key=lambda c: -c[3])         # stable: the latest first among equal matches
                    del found[cap:]
                return found
        return []

    def __len__(self) -> int:
        """Stored tokens."""
        return sum(len(s) for s in self.seqs.values())
