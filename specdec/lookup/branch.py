"""``LookupBranch``: a tree proposer's tree plus the prompt-lookup continuation as one more branch.

Per row and step, the tree proposer (e.g. ``EagleTreeDraft``) proposes its tree of N nodes and
``PromptLookup`` the L tokens that followed the latest earlier occurrence of the row's suffix n-gram.
The lookup chain is grafted onto the tree: starting at the root, each lookup token that is already a
child of the current node moves there; from the first one that is not, the rest hang below it as new
nodes. The verify step sees N + L nodes (the slots of the chain's grafted prefix are spare children of the
root repeating the chain's first token, marked padding: never accepted, and not computed by kernels
that skip padding). One target forward verifies both sources, so a row whose output copies its
prompt (summaries, RAG answers, code edits) accepts the lookup run while other rows keep the model's
tree.

Proposals stay deterministic functions of the row's sequence, so acceptance is the tree rules'
(greedy: the deepest path matching the target argmax = target-only greedy output; sampled: recursive
multi-draft rejection with one-hot proposals): lossless. The wrapped proposer's per-step tree is
replaced by the grafted one (its ``pending`` attribute), so its ``accepted`` reads the path the
verifier took, whichever source proposed it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..speculation.proposer import BaseProposer, Proposal, Proposer, Verified, declared
from ..speculation.tree import row_trees
from .proposer import PromptLookup


class LookupBranch(BaseProposer):
    """``draft`` (a tree proposer declaring "pending": it keeps its step's trees there, as ``EagleTreeDraft``)
    with a ``length``-token prompt-lookup branch (``lookup``: a ``PromptLookup`` for the same target); the
    arguments in ``LookupOrDraft``'s order. Itself a tree proposer of ``draft``'s depth and verifier."""

    abilities = frozenset({"depth", "verifier", "verify_size", "check_target", "draft", "finished"})

    def __init__(self, lookup: PromptLookup, draft: Proposer, length: int = 4):
        draft = declared(draft)
        draft.require("pending", "LookupBranch grafts onto a dynamic tree proposer (EagleTreeDraft)")  # (and depth)
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= draft.depth:
            raise ValueError(f"length must be an int in [1, {draft.depth}] (the tree's depth), got {length!r}")
        if lookup.batch_size != draft.batch_size:
            raise ValueError(f"lookup batch_size={lookup.batch_size} != tree proposer batch_size={draft.batch_size}")
        self.draft, self.lookup, self.length = draft, lookup, length
        self.depth, self.verifier = draft.depth, draft.verifier
        self.vocab_size, self.batch_size = draft.vocab_size, draft.batch_size

    @property
    def num_nodes(self) -> int:
        """Nodes verified per step (root excluded): the tree's and the lookup branch's."""
        return self.draft.verify_size - 1 + self.length

    @property
    def verify_size(self) -> int:
        """Tokens the target verifies per step: the nodes and the root."""
        return self.num_nodes + 1

    def check_target(self, target) -> None:
        self.draft.check_target(target)
        largest = min(target.kv_buckets[-1], target.n_positions - 1)
        if self.num_nodes + 1 > largest:
            raise ValueError(f"tree + lookup branch need {self.num_nodes + 1} verify slots but the target allows "
                             f"{largest}: use a smaller tree or lookup length")

    def max_draft_tokens(self, length: int) -> int:
        k = self.draft.max_draft_tokens(length)
        return k if length + self.num_nodes <= self.lookup.target.n_positions else 0

    def start(self, rows, prompts, params, rng, target_out) -> None:
        self.draft.start(rows, prompts, params, rng, target_out)
        self.lookup.start(rows, prompts, params, rng, target_out)

    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        proposal = self.draft.propose(tail, lengths, k, params, rng)
        chain = self.lookup.propose(tail, lengths, self.length, params, rng).tokens.to(proposal.tokens.device)
        tokens, parent, spare = graft(proposal.tokens, proposal.tree.parent, chain)
        real = torch.cat([proposal.tree.mask.diagonal(dim1=1, dim2=2), ~spare], 1)
        merged = row_trees(parent, proposal.tree.max_depth, proposal.tree.max_children + self.length, real)
        self.draft.pending = merged
        return Proposal(tokens, None, merged)

    def accepted(self, lengths, verified: Verified) -> None:
        self.draft.accepted(lengths, verified)
        self.lookup.accepted(lengths, verified)

    def finished(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> None:
        """Both proposers hear that the requests in ``rows`` ended."""
        self.draft.finished(rows, lengths)
        self.lookup.finished(rows, lengths)


def graft(tokens: torch.Tensor, parent: torch.Tensor,
          chain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Graft ``chain`` [B, L] below the root of each row's tree → (tokens [B, N+L], parent [B, N+L+1], spare
    [B, L] bool: the new-node slots left unused).

    tokens [B, N] are the tree's nodes 1..N, parent [B, N+1] over [root, nodes] (parents first). Lookup
    token j follows the path while it matches a child of the current node (the lowest-index one); from
    its first miss on, it becomes new node N+1+j below the previous one. New-node slots of a fully
    grafted prefix are spare: they repeat chain[:, 0] below the root (the verifier's padding: ``LookupBranch``).
    Tensor ops only (a loop over L)."""
    B, N = tokens.shape
    L = chain.shape[1]
    node_tokens = torch.cat([torch.full_like(tokens[:, :1], -1), tokens], 1)                   # [B, N+1]
    new_tokens, new_parent, spare = [], [], []
    current = torch.zeros(B, dtype=torch.long, device=tokens.device)       # where the chain stands
    grafting = torch.ones(B, dtype=torch.bool, device=tokens.device)       # still inside the tree
    for j in range(L):
        hit = (parent == current.unsqueeze(1)) & (node_tokens == chain[:, j:j + 1])
        hit[:, 0] = False
        found = grafting & hit.any(1)
        slot = N + 1 + j
        new_tokens.append(torch.where(found, chain[:, 0], chain[:, j]))
        new_parent.append(torch.where(found, torch.zeros_like(current), current))
        spare.append(found)
        current = torch.where(found, hit.long().argmax(1), torch.full_like(current, slot))
        grafting = found
    return (torch.cat([tokens, torch.stack(new_tokens, 1)], 1),
            torch.cat([parent, torch.stack(new_parent, 1)], 1), torch.stack(spare, 1))
