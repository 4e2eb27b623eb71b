"""Medusa's trees: the built-in trees (``trees/*.json``), tree files, the flat candidate gather, and
the greedy tree construction of the Medusa paper from measured head accuracy.

The tree structure itself (``TokenTree``, ``TreeBuffers``) is shared by every tree strategy and lives
in ``specdec.speculation.tree``.
"""
from __future__ import annotations

import heapq
import json
import os
from pathlib import Path

import torch

from ..speculation.tree import TokenTree, TreePath

__all__ = [
    "build_tree",
    "builtin_trees",
    "expected_accept_length",
    "gather_tree_tokens",
    "load_tree",
    "measure_head_accuracy",
    "save_tree",
]

TREES_DIR = Path(__file__).with_name("trees")


def builtin_trees() -> list[str]:
    """Names of the trees shipped in ``specdec/medusa/trees/*.json``."""
    return sorted(f.stem for f in TREES_DIR.glob("*.json"))


def load_tree(name_or_path: str | os.PathLike, *, num_heads: int | None = None, top_k: int | None = None,
              max_verify_size: int | None = None) -> TokenTree:
    """A built-in tree by name (``builtin_trees()``, e.g. ``"mc_sim_7b_63"``) or a JSON file of paths.

    Keyword arguments as ``TokenTree.from_paths``.
    """
    name = str(name_or_path)
    file = TREES_DIR / f"{name}.json" if name in builtin_trees() else Path(name_or_path)
    if not file.is_file():
        raise FileNotFoundError(f"no tree {name!r}: neither a built-in tree ({', '.join(builtin_trees())}) "
                                "nor a JSON file")
    try:
        paths = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"tree file {file} is not valid JSON: {e}") from e
    return TokenTree.from_paths(paths, num_heads=num_heads, top_k=top_k, max_verify_size=max_verify_size)


def save_tree(tree: TokenTree, path: str | os.PathLike) -> None:
    """Write ``tree`` as a JSON list of paths (node order), readable by ``load_tree`` and by Medusa."""
    Path(path).write_text(json.dumps(tree.to_list()) + "\n")


def gather_tree_tokens(root_tokens: torch.Tensor, head_candidates: torch.Tensor,
                       candidate_index: torch.Tensor) -> torch.Tensor:
    """Tokens of every tree node → [B, N+1] (node order; fixed shapes, traceable).

    root_tokens [B] (the last accepted token), head_candidates [B, num_heads, top_k] (each head's top-k
    token ids, rank order) or already flat [B, num_heads * top_k], candidate_index [N] from
    ``TreeBuffers``.
    """
    flat = head_candidates.reshape(head_candidates.shape[0], -1)
    nodes = flat.index_select(1, candidate_index)
    return torch.cat([root_tokens.view(-1, 1).to(nodes.dtype), nodes], dim=1)


def expected_accept_length(tree: TokenTree, head_accuracy: torch.Tensor) -> float:
    """Expected accepted drafts per step: sum over nodes of the product of accuracies along the path.

    head_accuracy [num_heads, top_k]: P(head h's rank-r candidate is the right token), taken as
    independent across heads (the Medusa paper's model). τ = 1 + this (the bonus token).
    """
    acc = head_accuracy.double()
    total = 0.0
    for path in tree.paths:
        total += float(torch.prod(acc[torch.arange(len(path)), torch.tensor(path)]))
    return total


def build_tree(head_accuracy: torch.Tensor, num_nodes: int) -> TokenTree:
    """The ``num_nodes``-node tree maximising ``expected_accept_length`` (Medusa paper, greedy).

    head_accuracy [num_heads, top_k] with values in [0, 1] (see ``measure_head_accuracy``). Start from
    the root's children as candidates; repeatedly add the candidate with the largest path product
    (ties: lower depth, then lexicographically smaller path) and make its children candidates.
    A node only becomes a candidate once its parent is in the tree, so the result is prefix-closed;
    since accuracies are <= 1 a child never beats its parent, so the greedy choice is optimal.
    """
    if head_accuracy.dim() != 2:
        raise ValueError(f"head_accuracy must be [num_heads, top_k], got shape {tuple(head_accuracy.shape)}")
    if not bool(((head_accuracy >= 0) & (head_accuracy <= 1)).all()):
        raise ValueError("head_accuracy values must be probabilities in [0, 1]")
    num_heads, top_k = head_accuracy.shape
    capacity = sum(top_k ** d for d in range(1, num_heads + 1))
    if not 1 <= num_nodes <= capacity:
        raise ValueError(f"num_nodes must be in [1, {capacity}] for {num_heads} heads x top-{top_k}, "
                         f"got {num_nodes}")
    acc = head_accuracy.double().tolist()
    frontier = [(-acc[0][r], 1, (r,)) for r in range(top_k)]  # (-path product, depth, path)
    heapq.heapify(frontier)
    paths: list[TreePath] = []
    while len(paths) < num_nodes:
        neg_value, depth, path = heapq.heappop(frontier)
        paths.append(path)
        if depth < num_heads:
            for r in range(top_k):
                heapq.heappush(frontier, (neg_value * acc[depth][r], depth + 1, path + (r,)))
    return TokenTree(tuple(paths), num_heads, top_k)


def measure_head_accuracy(head_topk: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-head, per-rank accuracy → [num_heads, top_k] float32.

    head_topk [T, num_heads, top_k]: each head's top-k token ids (rank order) at T positions;
    targets [T, num_heads]: the true token head h should have predicted there (token t+h+2), or a
    negative value where there is none (end of sequence): such entries are left out. Entry [h, r] is
    the fraction of valid positions where head h's rank-r candidate equals the target (0 when head h
    has no valid position).
    """
    valid = targets >= 0                                                       # [T, H]
    hits = (head_topk == targets.unsqueeze(-1)) & valid.unsqueeze(-1)          # [T, H, K]
    count = valid.sum(0).clamp(min=1).unsqueeze(-1)                            # [H, 1]
    return hits.sum(0).to(torch.float32) / count
