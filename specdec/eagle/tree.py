"""``EagleTreeDraft``: EAGLE-2 dynamic draft trees — expand by the draft's confidence, rerank, verify
the best N nodes in one target forward.

Per row, S = prompt + emitted tokens, n = len(S). The tree is rebuilt every step from the draft's own
scores (EAGLE-2, Li et al. 2024), so each row verifies its own tree (``specdec.speculation.tree.RowTrees``):

  1. the (D+1)-position re-read (as chain drafting, ``EagleDraft``) gives the draft's distribution of
     the token after S[-1] and its feature f^; the top K tokens are the depth-1 candidates, scored
     s = log q (q = softmax of the draft's logits, no temperature);
  2. expansion, depths 2 .. D: the K *frontier* nodes of the previous depth (the best-scored among
     that depth's candidates; all K at depth 1) go through the draft, each reading its parent's output
     feature at position n - 2 + depth and attending to its ancestors (tree mask); each scores its own
     top K children with s(child) = s(parent) + log q(child | path). The best K of those K² candidates
     are the next frontier;
  3. rerank: the N best of all K + (D-1)K² candidates by score (a child never outranks its parent:
     scores fall along a path, ties broken towards the shallower node), ordered by depth, form the
     tree verified with ``TreeVerifier``.

Every draft call after the re-read recomputes the expanded tree so far (depth d: (d-1)K tokens at
draft slots n-1 .. n-2+(d-1)K, with the tree mask among them), so the draft's cache never has to hide
one branch from another; slots past n-1 are scratch, overwritten by the next step's re-read.

Proposals are deterministic (top-K of the draft, whatever the sampling parameters), so sampled rows
are accepted by recursive multi-draft rejection with one-hot proposals (``accept_tree_sampled``):
lossless; greedy rows take the deepest path matching the target argmax: target-only greedy output.
``accepted`` stores the target's features of the accepted path (the root and the accepted nodes), so
the next re-read pairs true features with true tokens, as in chain drafting.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..core.decoder import DecoderModel
from ..core.graphs import GraphKey
from ..speculation.proposer import Proposal, Verified
from ..speculation.tree import RowTrees, row_trees
from ..speculation.verify import TreeVerifier
from .draft import EagleModel
from .proposer import EagleDraft


@dataclass(frozen=True)
class DynamicTree:
    """Shape of an EAGLE-2 tree: ``depth`` D (drafts a step can accept at most), ``top_k`` K (children
    scored per expanded node, nodes expanded per depth) and ``num_nodes`` N (nodes verified, root
    excluded: the target verifies N + 1 tokens)."""

    # defaults: the fastest shape measured on the 2-core CPU (docs/strategies/eagle.md, "EAGLE-2 dynamic trees")
    depth: int = 3
    top_k: int = 8
    num_nodes: int = 8

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "num_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicTree.{name} must be a positive int, got {value!r}")
        pool = self.top_k + (self.depth - 1) * self.top_k ** 2
        if self.num_nodes > pool:
            raise ValueError(f"DynamicTree.num_nodes={self.num_nodes} exceeds the {pool} candidates a tree of "
                             f"depth {self.depth} and top_k {self.top_k} scores (K + (D-1)K^2)")

    @classmethod
    def parse(cls, text: str) -> DynamicTree:
        """``"5x8x24"`` → ``DynamicTree(depth=5, top_k=8, num_nodes=24)`` (ValueError naming the format)."""
        try:
            depth, top_k, num_nodes = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"dynamic tree {text!r}: expected DEPTHxTOPKxNODES, e.g. 5x8x24") from None
        return cls(depth, top_k, num_nodes)

    @property
    def draft_slots(self) -> int:
        """Draft cache slots the deepest expansion writes past S[:-1]: (D-1)K (at least 1)."""
        return max(1, (self.depth - 1) * self.top_k)


class EagleTreeDraft(EagleDraft):
    """EAGLE drafting with dynamic trees (a tree ``specdec.speculation.proposer.Proposer``; k = ``tree.depth``); its
    step's trees wait in ``pending`` for ``accepted`` (``LookupBranch`` replaces them); not fused."""

    abilities = frozenset({"depth", "verifier", "verify_size", "check_target", "reread_width", "model", "pending"})

    def __init__(self, model: EagleModel, tree: DynamicTree = DynamicTree()):
        super().__init__(model)
        if tree.top_k > (model.config.output_vocab_size or model.vocab_size):
            raise ValueError(f"DynamicTree.top_k={tree.top_k} exceeds the draft's "
                             f"{model.config.output_vocab_size or model.vocab_size}-token vocabulary")
        self.tree, self.depth = tree, tree.depth
        self.verifier = TreeVerifier()
        self.greedy = model.sampling_params(do_sample=False)     # the draft only scores: no sampling graphs
        self.pending: RowTrees | None = None                      # the trees of the step being verified

    @classmethod
    def from_pretrained(cls, path: str | Path, target: DecoderModel, *, tree: DynamicTree = DynamicTree(),
                        **kwargs) -> EagleTreeDraft:
        """An EAGLE-1 / NxD / EAGLE-3-layout checkpoint for ``target`` (``EagleModel.from_pretrained``
        arguments) drafting ``tree``-shaped dynamic trees."""
        return cls(EagleModel.from_pretrained(path, target, **kwargs), tree)

    def check_target(self, target: DecoderModel) -> None:
        super().check_target(target)
        largest = min(target.kv_buckets[-1], target.n_positions - 1)
        if self.tree.num_nodes + 1 > largest:
            raise ValueError(f"DynamicTree.num_nodes={self.tree.num_nodes} needs {self.tree.num_nodes + 1} verify "
                             f"slots but the target allows {largest} (largest KV bucket {target.kv_buckets[-1]}, "
                             f"n_positions {target.n_positions})")

    fused_drafter = None       # the expansion's top-K reranking is host-driven: fused speculation takes chains

    @property
    def verify_size(self) -> int:
        """Tokens the target verifies per step: the N nodes and the root."""
        return self.tree.num_nodes + 1

    def draft_graph_keys(self, prompt_length: int, max_length: int, single_row: bool = False) -> list[GraphKey]:
        """The draft network's graphs for sequences up to ``max_length``: its context graphs (the
        request's sampling mode), the (D+1)-position re-read and the expansion steps ((d-1)·K tokens,
        K logits, d = 2..D), which reach ``draft_slots`` past S[:-1]; the last two score top-K in the graph."""
        d, D, K = self.model, self.depth, self.tree.top_k
        reach = min(d.n_positions, max_length + self.tree.draft_slots)
        context = [k for k in d.graph_keys(prompt_length=prompt_length, max_length=max_length, single_row=single_row)
                   if k.n_tokens == k.kv_len]
        greedy = d.graph_keys(do_sample=False, spec_tokens=(D,), prompt_length=prompt_length, max_length=reach)
        reread = [replace(k, top_k=K) for k in greedy if k.n_tokens != k.kv_len and k.n_tokens == D + 1]
        expand = [replace(k, n_tokens=(depth - 1) * K, n_logits=K, return_probs=False, top_k=K)
                  for k in greedy if k.n_tokens == 1 for depth in range(2, D + 1) if k.kv_len >= (depth - 1) * K]
        return context + reread + expand

    def max_draft_tokens(self, length: int) -> int:
        """The tree's depth while its N + 1 verify slots and the draft's expansion fit before
        ``n_positions``, else 0 (a plain decode step)."""
        fits = length + max(self.tree.num_nodes, self.depth) <= self.model.n_positions and \
            length - 1 + self.tree.draft_slots <= self.model.n_positions
        return self.depth if fits else 0

    # ------------------------------------------------------------------ propose
    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        K, N, D, dev = self.tree.top_k, self.tree.num_nodes, k, self.features.device
        n = lengths.to(dev)
        out, feature = self.reread(n, k, self.greedy, None, top_k=K)   # the draft scores only: top-K graphs
        scores, tokens = out.logits[:, 0], out.tokens[:, 0]                     # depth 1: log q, ids [B, K]
        pool_tokens, pool_scores = [tokens], [scores]
        pool_parent = [torch.full_like(tokens, -1)]                                       # -1: the root
        frontier = torch.arange(K, device=dev).expand_as(tokens)                          # pool indices
        frontier_feature = feature.expand(-1, K, -1)
        exp_tokens, exp_features, exp_parent = tokens, frontier_feature, torch.full_like(tokens, -1)
        self.model.set_lengths(n - 1)
        for depth in range(2, D + 1):
            width = exp_tokens.shape[1]
            out = self.model.step(exp_tokens, self.greedy, None, advance=False,
                                  token_mask=row_trees(_with_root(exp_parent), D, K).mask[:, 1:, 1:],
                                  position_ids=n.unsqueeze(1) - 1 + _depths(exp_parent, K),
                                  logit_index=torch.arange(width - K, width, device=dev).expand(len(n), K),
                                  features=exp_features, top_k=K)
            child_scores, child_tokens = out.logits, out.tokens                             # [B, K, K]
            child_scores = scores.unsqueeze(-1) + child_scores.clamp(max=0)      # scores never rise
            offset = sum(t.shape[1] for t in pool_tokens)
            pool_tokens.append(child_tokens.flatten(1))
            pool_scores.append(child_scores.flatten(1))
            pool_parent.append(frontier.repeat_interleave(K, 1))
            scores, best = child_scores.flatten(1).topk(K, dim=-1)                          # next frontier
            tokens = child_tokens.flatten(1).gather(1, best)
            frontier = offset + best
            source = best // K                                                              # its parent
            if depth < D:
                hidden = out.hidden[:, width - K:]
                frontier_feature = hidden.gather(1, source.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
                exp_tokens = torch.cat([exp_tokens, tokens], 1)
                exp_features = torch.cat([exp_features, frontier_feature], 1)
                exp_parent = torch.cat([exp_parent, width - K + source], 1)
        nodes, parent = _rerank(torch.cat(pool_tokens, 1), torch.cat(pool_scores, 1), torch.cat(pool_parent, 1), K, N)
        self.pending = row_trees(parent, D, K)
        return Proposal(nodes, None, self.pending)

    # ------------------------------------------------------------------ accepted
    def accepted(self, lengths, verified: Verified) -> None:
        """Store the target's features along the accepted path: root, then nodes at depths 1 .. n."""
        if self.pending is None:               # a plain decode step (no room for a tree)
            return super().accepted(lengths, verified)
        features = self.model.true_features(verified.target_out)                      # [B, N+1, H]
        path = self.pending.ancestors.gather(
            1, verified.last_node.view(-1, 1, 1).expand(-1, 1, self.pending.ancestors.shape[-1])).squeeze(1)
        path = path.clamp(min=0).to(features.device)                                   # [B, D+1]
        self.pending = None
        self._store(lengths, features.gather(1, path.unsqueeze(-1).expand(-1, -1, features.shape[-1])),
                    verified.emitted)


def _with_root(parent: torch.Tensor) -> torch.Tensor:
    """Parent array over [root, nodes] from node parents given as node indices (-1 = the root)."""
    return torch.cat([torch.zeros_like(parent[:, :1]), parent + 1], 1)


def _depths(parent: torch.Tensor, K: int) -> torch.Tensor:
    """Depth - 1 of the expanded nodes, which come in blocks of K per depth: [B, (d-1)K]."""
    return (torch.arange(parent.shape[1], device=parent.device) // K).expand_as(parent)


def _rerank(tokens: torch.Tensor, scores: torch.Tensor, parent: torch.Tensor, K: int,
            N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The N best candidates of each row as a tree in node order.

    tokens / scores / parent [B, P]: the candidate pool (parent = pool index, -1 = the root), depth-1
    candidates first, then blocks of K² per depth. Returns (node tokens [B, N], parent [B, N+1] over
    [root, nodes] for ``row_trees``). A child's score is its parent's plus a log-probability <= 0; the
    key (in f64) subtracts 1e-9 per depth, so a parent always outranks its children, even on an exact
    tie, and the selection is prefix-closed. Nodes are ordered by depth, then by score (best first)."""
    P = tokens.shape[1]
    depth = torch.ones(P, dtype=torch.long, device=tokens.device)
    depth[K:] = 2 + torch.arange(P - K, device=tokens.device) // (K * K)
    key = scores.double().clamp(min=-1e4) - 1e-9 * depth                    # f64: the tie-break is exact
    top = key.topk(N, dim=-1).indices                                                   # [B, N]
    order = torch.argsort(depth[top] * 1e6 - key.gather(1, top), dim=-1)
    chosen = top.gather(1, order)
    node_of = torch.zeros(tokens.shape[0], P + 1, dtype=torch.long, device=tokens.device)    # pool+1 → node
    node_of.scatter_(1, chosen + 1, torch.arange(1, N + 1, device=tokens.device).expand_as(chosen))
    parent_node = node_of.gather(1, parent.gather(1, chosen) + 1)
    return tokens.gather(1, chosen), torch.cat([torch.zeros_like(parent_node[:, :1]), parent_node], 1)
