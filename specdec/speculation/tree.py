"""Token trees: a validated set of rank paths and the fixed buffers a tree verify step needs.

A tree is a list of *paths*; a path is a list of top-k ranks, one per depth: ``[r1, ..., rd]`` is
the continuation "the rank-r1 candidate at depth 1, then the rank-r2 candidate at depth 2, ...", a
node at depth d (d tokens after the root). The root is the last accepted token: already emitted, not
a path. Any tree strategy uses them (Medusa's static trees; the JSON format is FasterDecoding/Medusa's,
``[[0], [0, 0], [1], ...]``, in any order).

Node order (every buffer and ``TokenTree.paths`` use it): node 0 is the root; nodes 1..N are the
paths sorted by (depth, then lexicographic order of the ranks), so ``paths[i]`` is node ``i + 1``.
Hence parents come before their children, depth never decreases with the index, and the children of
a node appear in rank order.

``tree_buffers`` turns a tree into the constant tensors of a verify step (built once, on the host);
``TreeBuffers.per_row`` gives them a batch dimension (views, a ``RowTrees``), which is the form a
``Proposal`` carries, so rows may verify different trees; ``row_trees`` builds a ``RowTrees`` from
each row's parent array on the device (dynamic trees, EAGLE-2). The per-step code
(``specdec.speculation.acceptance.accept_tree_*``, ``specdec.speculation.verify.TreeVerifier``) only indexes them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..core.model import padding_mask

__all__ = ["PAD_NODE", "RowTrees", "TokenTree", "TreeBuffers", "row_trees", "tree_buffers"]

PAD_NODE = -1
"""Padding of the node-index buffers (``ancestors``, ``retrieve``, ``child_nodes``)."""

TreePath = tuple[int, ...]


def _node_order(path: TreePath) -> tuple[int, TreePath]:
    return len(path), path


def _as_paths(paths: Sequence[Sequence[int]]) -> tuple[TreePath, ...]:
    """Paths as tuples of non-negative ints; ValueError naming the first malformed path."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
        raise ValueError(f"a tree is a list of paths (lists of top-k ranks), got {type(paths).__name__}")
    out = []
    for i, path in enumerate(paths):
        if isinstance(path, (str, bytes)) or not isinstance(path, Sequence):
            raise ValueError(f"tree path #{i} must be a list of ranks, got {path!r}")
        if len(path) == 0:
            raise ValueError(f"tree path #{i} is empty (the root is implicit; paths have depth >= 1)")
        if any(isinstance(r, bool) or not isinstance(r, int) for r in path):
            raise ValueError(f"tree path {list(path)} must contain integer ranks")
        if min(path) < 0:
            raise ValueError(f"tree path {list(path)} has a negative rank")
        out.append(tuple(path))
    return tuple(out)


@dataclass(frozen=True)
class TokenTree:
    """A validated, prefix-closed set of paths for ``num_heads`` heads with ``top_k`` candidates each.

    ``paths`` is stored in node order (see the module docstring): ``paths[i]`` is node ``i + 1``.
    Invariants (checked on construction, ValueError otherwise): at least one path; every path is
    non-empty with ranks in ``[0, top_k)`` and depth ``<= num_heads``; no duplicates; every proper
    prefix of a path is itself a path. Build one with ``TokenTree.from_paths`` (which infers
    ``num_heads`` and ``top_k``) or ``load_tree``.
    """

    paths: tuple[TreePath, ...]
    num_heads: int
    top_k: int

    def __post_init__(self) -> None:
        paths = _as_paths(self.paths)
        if not paths:
            raise ValueError("a tree needs at least one path")
        for name in ("num_heads", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        seen: set[TreePath] = set()
        for path in paths:
            if len(path) > self.num_heads:
                raise ValueError(f"tree path {list(path)} has depth {len(path)} > num_heads {self.num_heads}")
            if max(path) >= self.top_k:
                raise ValueError(f"tree path {list(path)} uses rank {max(path)} >= top_k {self.top_k}")
            if path in seen:
                raise ValueError(f"tree path {list(path)} appears more than once")
            seen.add(path)
        for path in paths:
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"tree path {list(path)} has no parent {list(path[:-1])} in the tree "
                                 "(paths must be prefix-closed)")
        object.__setattr__(self, "paths", tuple(sorted(paths, key=_node_order)))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], *, num_heads: int | None = None,
                   top_k: int | None = None, max_verify_size: int | None = None) -> TokenTree:
        """Validate ``paths``; ``num_heads`` defaults to the depth, ``top_k`` to the largest rank + 1.

        ``max_verify_size`` (e.g. the verify graph's width): ValueError if N + 1 (nodes + root) exceeds it.
        """
        parsed = _as_paths(paths)
        if not parsed:
            raise ValueError("a tree needs at least one path")
        tree = cls(parsed,
                   max(len(p) for p in parsed) if num_heads is None else num_heads,
                   max(max(p) for p in parsed) + 1 if top_k is None else top_k)
        if max_verify_size is not None and tree.verify_size > max_verify_size:
            raise ValueError(f"tree has {tree.num_nodes} nodes + root = {tree.verify_size} tokens to verify, "
                             f"more than the max verify size {max_verify_size}")
        return tree

    @property
    def num_nodes(self) -> int:
        """N, the number of non-root nodes (= paths)."""
        return len(self.paths)

    @property
    def verify_size(self) -> int:
        """N + 1: tokens the target verifies per step (root included)."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        """Maximum depth D (the most drafts a step can accept)."""
        return len(self.paths[-1])

    def truncated(self, depth: int) -> TokenTree:
        """The paths of depth <= ``depth`` (still prefix-closed), with the same heads and top-k."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        return TokenTree(tuple(p for p in self.paths if len(p) <= depth), self.num_heads, self.top_k)

    def to_list(self) -> list[list[int]]:
        """The paths in node order as JSON-ready lists."""
        return [list(p) for p in self.paths]


class _TreeShape:
    """The static loop sizes of tree buffers with ``ancestors`` [..., D+1] and ``child_nodes`` [..., C]."""

    ancestors: torch.Tensor
    child_nodes: torch.Tensor

    @property
    def max_depth(self) -> int:
        """D, the static number of depth steps of the tree acceptance loops."""
        return self.ancestors.shape[-1] - 1

    @property
    def max_children(self) -> int:
        """C, the static number of sibling tries per depth."""
        return self.child_nodes.shape[-1]


@dataclass(frozen=True)
class RowTrees(_TreeShape):
    """The trees of one verify step, one per row, in node order (B rows, N nodes + root, depth <= D,
    at most C children per node): what the verifier and the tree acceptance rules index.

    mask        [B, N+1, N+1] bool  node i attends to node j iff j is i or an ancestor of i (the root is
                                    an ancestor of every node); the tree block of the verify mask.
    depth       [B, N+1] long       depth of each node (root 0): verify position = row length + depth.
    parent      [B, N+1] long       parent node index; the root's parent is itself (0), so gathers
                                    through ``parent`` stay in range (tell the root by ``depth == 0``).
    ancestors   [B, N+1, D+1] long  ancestors[b, i, d] = the node at depth d on the path root..i for
                                    d <= depth[i], PAD_NODE (-1) after; ancestors[b, i, depth[i]] = i.
    child_nodes [B, N+1, C] long    the children of each node in node order, PAD_NODE after.

    A static tree gives every row the same tree (``TreeBuffers.per_row``: expanded views); a dynamic
    tree (EAGLE-2) builds each row's from its parent array every step (``row_trees``).
    """

    mask: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    ancestors: torch.Tensor
    child_nodes: torch.Tensor


def row_trees(parent: torch.Tensor, max_depth: int, max_children: int, real: torch.Tensor | None = None) -> RowTrees:
    """Each row's tree buffers from its parent array, with tensor ops only (no host loop per node).

    parent [B, N+1] long: parent[:, 0] = 0 (the root) and 0 <= parent[:, i] < i for i >= 1 (parents
    come before their children). Invariants the caller keeps (not checked): no node deeper than
    ``max_depth`` (D), no node with more than ``max_children`` (C) children. Children are listed in node
    order. ``real`` [B, N+1] bool (None: all): a node that is not real is a padding slot of a row's static
    width, a leaf (checked: no node attends to it but itself): its diagonal mask entry is cleared
    (``model.padding_mask``: kernels that skip padding do not compute it) and it is no node's child, so no
    acceptance rule reaches it. See ``RowTrees`` for the outputs.
    """
    B, n1 = parent.shape
    dev = parent.device
    node = torch.arange(n1, device=dev).expand(B, n1)
    walk = [node]                                  # the node, its parent, grandparent, ... (root repeats)
    for _ in range(max_depth):
        walk.append(parent.gather(1, walk[-1]))
    chain = torch.stack(walk, -1)                                                     # [B, N+1, D+1]
    depth = (chain != 0).sum(-1)
    up = depth.unsqueeze(-1) - torch.arange(max_depth + 1, device=dev)                # steps up to depth d
    ancestors = torch.where(up >= 0, chain.gather(2, up.clamp(min=0)), PAD_NODE)
    mask = torch.zeros(B, n1, n1, dtype=torch.bool, device=dev).scatter_(2, ancestors.clamp(min=0), True)
    siblings = (parent.unsqueeze(2) == parent.unsqueeze(1)) & torch.ones(n1, n1, dtype=torch.bool,
                                                                          device=dev).tril(-1)
    siblings[:, :, 0] = False                      # the root is nobody's sibling
    rank = siblings.sum(-1)[:, 1:]                                                    # [B, N]
    slot = parent[:, 1:] * max_children + rank
    child_nodes = torch.full((B, n1 * max_children), PAD_NODE, dtype=torch.long, device=dev)
    child_nodes.scatter_(1, slot, node[:, 1:])
    if real is not None:
        real = real.to(dev)
        if not bool(real[:, 0].all() & real.gather(1, parent).all()):
            raise ValueError("row_trees: the root must be real and padding nodes leaves (no node's parent)")
        mask = padding_mask(mask, real)
        child_nodes = torch.where(real.gather(1, child_nodes.clamp(min=0)), child_nodes, PAD_NODE)
    return RowTrees(mask, depth, parent, ancestors, child_nodes.view(B, n1, max_children))


@dataclass(frozen=True)
class TreeBuffers(_TreeShape):
    """Constant tensors of a static tree in node order (N nodes + root, max depth D, at most C children):
    ``RowTrees``' fields without the batch dimension (mask [N+1, N+1], depth / parent [N+1], ancestors
    [N+1, D+1], child_nodes [N+1, C]; children in rank order), plus what a static tree strategy gathers with:

    candidate_index [N] long         for node i+1 (path [r1..rd]): (d-1) * top_k + rd, its token's index in
                                     the flat per-head candidates [num_heads * top_k] (head h's rank r at
                                     h * top_k + r).
    leaves          [L] long         the nodes without children, in node order.
    retrieve        [L, D+1] long    ancestors[leaves]: each root-to-leaf path, PAD_NODE-padded.
    """

    mask: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    candidate_index: torch.Tensor
    ancestors: torch.Tensor
    child_nodes: torch.Tensor
    leaves: torch.Tensor
    retrieve: torch.Tensor


    def to(self, device: torch.device | str) -> TreeBuffers:
        """The same buffers on ``device``."""
        return replace(self, **{f: getattr(self, f).to(device) for f in self.__dataclass_fields__})

    def per_row(self, batch_size: int) -> RowTrees:
        """Every row the same tree: the node buffers with a leading batch dimension (expanded views)."""
        return RowTrees(*(getattr(self, f).expand(batch_size, *getattr(self, f).shape)
                          for f in RowTrees.__dataclass_fields__))


def tree_buffers(tree: TokenTree, device: torch.device | str | None = None) -> TreeBuffers:
    """Build the static buffers of ``tree`` (host code, once per tree). See ``TreeBuffers``."""
    nodes: list[TreePath] = [(), *tree.paths]
    index = {p: i for i, p in enumerate(nodes)}
    parent = torch.tensor([[0] + [index[p[:-1]] for p in tree.paths]], dtype=torch.long)
    kids = [[i for i, p in enumerate(nodes) if p and p[:-1] == q] for q in nodes]
    rows = row_trees(parent, tree.depth, max(len(k) for k in kids))
    leaves = torch.tensor([i for i, k in enumerate(kids) if not k], dtype=torch.long)

    def one(x: torch.Tensor) -> torch.Tensor:
        return x[0].to(device)

    return TreeBuffers(
        mask=one(rows.mask), depth=one(rows.depth), parent=one(rows.parent),
        candidate_index=torch.tensor([(len(p) - 1) * tree.top_k + p[-1] for p in tree.paths], dtype=torch.long,
                                     device=device),
        ancestors=one(rows.ancestors), child_nodes=one(rows.child_nodes),
        leaves=leaves.to(device), retrieve=one(rows.ancestors)[leaves].to(device),
    )
