"""Verifiers: run the target over a proposal and apply the shared acceptance rules.

Per row, S = prompt + emitted tokens; on entry the target's length is len(S) - 1 (its cache holds
S[:-1]). Both verifiers feed S[-1] and the drafts in one multi-token forward, draw the acceptance noise
from the rows' own generators, and return a ``Verified`` (``specdec.speculation.proposer``). The caller then sets
the target's length to len(S) + num_accepted.

- ``ChainVerifier``: [S[-1], x_1 .. x_k] at slots len(S)-1 .. len(S)-1+k with a causal mask (``model.causal_mask``: a
  row's positions past its real drafts are padding) →
  ``acceptance.accept`` (greedy rows: longest prefix equal to the target argmax; sampled rows:
  lossless rejection sampling, with the draft probabilities or the one-hot rule), each row over its
  first ``proposal.num_drafts`` drafts when that is set.
- ``TreeVerifier``: [S[-1], N nodes] at slots len(S)-1 .. len(S)-1+N, RoPE positions
  len(S)-1 + depth, attention among them by each row's tree mask → the tree rules (greedy: the
  deepest path matching the argmax; sampled: recursive multi-draft rejection; or Medusa's lossy
  "typical" rule) → KV compaction: the accepted path's cache rows (slots len(S)-1 + node) move to the
  contiguous slots len(S) .. len(S)-1+n (one gather + scatter per layer, on device).
With tensor parallelism rank 0's acceptance is broadcast so every rank keeps the same tokens.
"""
from __future__ import annotations

import torch

from ..core.decoder import DecoderModel
from ..core.model import causal_mask
from ..core.parallel import broadcast
from ..core.sampling import RowGenerators, any_sampled, greedy_rows
from .acceptance import accept, accept_tree_greedy, accept_tree_sampled, accept_tree_typical
from .proposer import Proposal, Verified

TREE_ACCEPTANCE = ("lossless", "typical")


def _broadcast_decision(target: DecoderModel, n: torch.Tensor, emitted: torch.Tensor):
    """Rank 0 decides for every rank of a sharded target, so the ranks stay in lockstep."""
    return broadcast(n, target.tp), broadcast(emitted, target.tp)


class ChainVerifier:
    """Verification of chain proposals (tokens [B, k])."""

    def verify(self, target: DecoderModel, proposal: Proposal, tail: torch.Tensor, lengths: torch.Tensor,
               params: torch.Tensor, rng: RowGenerators) -> Verified:
        drafts = proposal.tokens
        k = drafts.shape[1]
        sampled = any_sampled(params)
        real = None if proposal.num_drafts is None else proposal.num_drafts + 1      # S[-1] and the row's drafts
        drawn = proposal.draw_width or k      # the noise of a chain of ``drawn`` drafts (``narrowed``)
        if sampled and drawn > k:   # the draws the cut graph leaves out, then its own: drawn + 1 in all
            rng.uniform(drawn - k)
        out = target.step(torch.cat([tail[:, 1:].to(drafts.device), drafts], 1), params, rng,
                          token_mask=causal_mask(k + 1, real), advance=False, return_probs=sampled)
        uniform = residual = None
        if sampled:
            u = rng.uniform(drawn + 1).to(out.probs.device)
            uniform, residual = u[:, :k], u[:, drawn]
        dev = out.tokens.device
        num_drafts = None if proposal.num_drafts is None else proposal.num_drafts.to(dev)
        n, emitted = accept(drafts.to(dev), out.probs if sampled else None, proposal.probs, target_tokens=out.tokens,
                            greedy_rows=greedy_rows(params).to(dev), num_drafts=num_drafts,
                            uniform=uniform, residual_uniform=residual)
        n, emitted = _broadcast_decision(target, n, emitted)
        return Verified(n, emitted, out, n)


class TreeVerifier:
    """Verification of tree proposals, with on-device KV compaction of the accepted path.

    ``acceptance``: 'lossless' (greedy rows: the deepest path matching the target argmax; sampled
    rows: recursive rejection over siblings, exactly the target's distribution) or 'typical' (Medusa's
    typical acceptance for sampled rows: NOT lossless; ``epsilon`` / ``delta`` are Medusa's
    posterior_threshold / posterior_alpha).
    """

    def __init__(self, acceptance: str = "lossless", epsilon: float = 0.09, delta: float = 0.3):
        if acceptance not in TREE_ACCEPTANCE:
            raise ValueError(f"acceptance={acceptance!r} is not supported; use one of {', '.join(TREE_ACCEPTANCE)}")
        self.acceptance, self.epsilon, self.delta = acceptance, epsilon, delta

    def verify(self, target: DecoderModel, proposal: Proposal, tail: torch.Tensor, lengths: torch.Tensor,
               params: torch.Tensor, rng: RowGenerators) -> Verified:
        tree, dev = proposal.tree, target.device
        B = target.batch_size
        base = lengths.to(dev) - 1                                     # slot (and position) of the root
        tokens = torch.cat([tail[:, 1:].to(dev), proposal.tokens.to(dev)], 1)
        sampled = any_sampled(params)
        out = target.step(tokens, params, rng, token_mask=tree.mask, position_ids=base.unsqueeze(1) + tree.depth,
                          advance=False, return_probs=sampled)
        real = tree.mask.diagonal(dim1=-2, dim2=-1)         # a padding node (``tree.row_trees``) is never accepted
        n, best, emitted = accept_tree_greedy(tokens, out.tokens, tree.parent, tree.ancestors, real=real)
        if sampled:
            u = rng.uniform(tree.max_depth * tree.max_children + 1).to(dev)
            uniform, residual = u[:, :-1].reshape(B, tree.max_depth, tree.max_children), u[:, -1]
            if self.acceptance == "typical":
                sn, sbest, semitted = accept_tree_typical(tokens, out.probs, tree.parent, tree.ancestors, residual,
                                                          epsilon=self.epsilon, delta=self.delta, real=real)
            else:
                sn, sbest, semitted = accept_tree_sampled(tokens, out.probs, tree.child_nodes, uniform, residual)
            keep = greedy_rows(params).to(dev)
            n, best = torch.where(keep, n, sn), torch.where(keep, best, sbest)
            emitted = torch.where(keep.unsqueeze(1), emitted, semitted)
        n, emitted = _broadcast_decision(target, n, emitted)
        self._compact(target, base, best, n, tree.ancestors)
        return Verified(n, emitted, out, best)

    @staticmethod
    def _compact(target: DecoderModel, base: torch.Tensor, best: torch.Tensor, n: torch.Tensor,
                 ancestors: torch.Tensor) -> None:
        """Move the accepted path's KV rows (slots base + node) to slots base + 1 .. base + n."""
        D = ancestors.shape[-1] - 1
        depth = torch.arange(1, D + 1, device=base.device)
        path = ancestors.gather(1, best.view(-1, 1, 1).expand(-1, 1, D + 1)).squeeze(1)[:, 1:]   # [B, D]
        keep = depth.unsqueeze(0) <= n.unsqueeze(1)
        dst = base.unsqueeze(1) + depth
        src = torch.where(keep, base.unsqueeze(1) + path.clamp(min=0), dst)     # unaccepted depths: no-op
        target.copy_cache_slots(src, dst)
