"""From the occurrences of a context's suffix to a draft: SuffixDecoding's frequency-scored token tree.

Given the candidates of one lookup (``SuffixIndex.candidates``: occurrences of the context's suffix,
each with its match length l), the occurrences of the suffix of length m are those with l >= m, the
set a suffix tree's node for that suffix counts. Their continuations (the next ``depth`` tokens of
each) form a count trie: a node's count is the number of occurrences whose continuation starts with
its path, and its empirical probability is count / occurrences, the product of the conditional
frequencies along the path (what SuffixDecoding scores with).

``speculate`` evaluates, like SuffixDecoding, every match length m among the candidates' (longest
first): the budget is max_spec = min(max_nodes, floor(alpha · m + offset)) nodes; a tree takes the
nodes of highest probability that are at least ``min_prob`` (best-first from the root: a child never
outscores its parent, so the set is prefix-closed), a chain follows the most frequent child while it
is at least ``min_prob``. The draft with the highest score (the sum of its nodes' probabilities, the
expected number of accepted tokens were the frequencies exact) wins; ties go to the longer match.

``periodic`` (a row's own sequence, where the query is the sequence's own end): a continuation that
reaches the end of the sequence goes on repeating the period between the occurrence and the end, as
prompt lookup continues a repeating stretch.

Cost: O(candidates · depth) to build the trie, O(max_nodes · log) per match length to select.
"""
from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass, field

from .index import Candidate


@dataclass
class Draft:
    """A proposal for one row, parents before children.

    tokens [n]: the node tokens; parents [n]: each node's parent as a node number (0 = the root, i = the
    node tokens[i-1]); probs [n]: each node's empirical probability (occurrences whose continuation
    starts with the node's path / occurrences of the match); match_len: the suffix length m the
    frequencies were counted for (0: no match, an empty draft). A chain has parents [0, 1, 2, ...]."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        """The sum of the nodes' probabilities (0 for an empty draft)."""
        return sum(self.probs)


def continuation(seq: array | list[int], end: int, depth: int, periodic: bool = False) -> list[int]:
    """Up to ``depth`` tokens after position ``end`` of ``seq``; ``periodic``: past the end of ``seq``,
    repeat with period len(seq) - 1 - end (the query is seq itself, ending a repeat of seq[:end+1])."""
    out = list(seq[end + 1:end + 1 + depth])
    if periodic and len(out) < depth:
        period = len(seq) - 1 - end
        while len(out) < depth:
            out.append(out[len(out) - period])
    return out


def speculate(candidates: list[Candidate], depth: int, max_nodes: int, *, alpha: float = 1.0,
              offset: float = 0.0, min_prob: float = 0.1, tree: bool = True, periodic: bool = False) -> Draft:
    """The best draft from ``candidates`` (see the module docstring): a tree of at most ``max_nodes``
    nodes and ``depth`` levels, or a chain of at most ``min(max_nodes, depth)`` tokens."""
    best = Draft()
    if not candidates or depth < 1 or max_nodes < 1:
        return best
    ordered = sorted(candidates, key=lambda c: -c[3])          # stable: latest first within a match length
    tokens, parents, depths, counts = [-1], [0], [0], [0]      # the count trie, node 0 = the root
    kids: list[dict[int, int]] = [{}]                           # node → {token: child}, in creation order
    limit = min(depth, max_nodes, int(alpha * ordered[0][3] + offset + 1e-6))   # the deepest node any budget takes
    for i, (_, seq, end, length) in enumerate(ordered):
        node = 0
        counts[0] += 1
        for t in continuation(seq, end, limit, periodic):
            nxt = kids[node].get(t)
            if nxt is None:
                nxt = kids[node][t] = len(tokens)
                tokens.append(t)
                parents.append(node)
                depths.append(depths[node] + 1)
                counts.append(0)
                kids.append({})
            counts[nxt] += 1
            node = nxt
        if i + 1 < len(ordered) and ordered[i + 1][3] == length:
            continue                                            # the group of match length m is not complete
        budget = min(max_nodes, int(alpha * length + offset + 1e-6))
        if budget < 1:
            continue
        pick = _tree(counts, depths, kids, budget, min_prob) if tree else _chain(counts, kids, budget, min_prob)
        draft = _draft(pick, tokens, parents, counts, length)
        if draft.score > best.score:
            best = draft
    return best


def _tree(counts: list[int], depths: list[int], kids: list[dict[int, int]], budget: int, min_prob: float) -> list[int]:
    """Best-first from the root: the ``budget`` nodes of highest count (ties: shallower, then earlier)
    with count / counts[0] >= min_prob, in the order taken (parents first)."""
    total, picked = counts[0], []
    heap = [(-counts[c], depths[c], c) for c in kids[0].values()]
    heapq.heapify(heap)
    while heap and len(picked) < budget:
        neg, _, node = heapq.heappop(heap)
        if -neg < min_prob * total:
            break
        picked.append(node)
        for c in kids[node].values():
            heapq.heappush(heap, (-counts[c], depths[c], c))
    return picked


def _chain(counts: list[int], kids: list[dict[int, int]], budget: int, min_prob: float) -> list[int]:
    """The most frequent child at each level (ties: the earlier), while count / counts[0] >= min_prob."""
    total, picked, node = counts[0], [], 0
    while kids[node] and len(picked) < budget:
        node = max(kids[node].values(), key=lambda c: (counts[c], -c))
        if counts[node] < min_prob * total:
            break
        picked.append(node)
    return picked


def _draft(picked: list[int], tokens: list[int], parents: list[int], counts: list[int], match_len: int) -> Draft:
    """The picked trie nodes (parents before children) renumbered 1..n as a ``Draft``."""
    number = {0: 0}
    for i, node in enumerate(picked):
        number[node] = i + 1
    total = counts[0]
    return Draft([tokens[n] for n in picked], [number[parents[n]] for n in picked],
                 [counts[n] / total for n in picked], match_len)
