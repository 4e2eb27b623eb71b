"""The proposer protocol: what speculation needs from any draft strategy.

A proposer only proposes; a verifier (``specdec.verify``) runs the target over the proposal and
applies the shared acceptance rules. The speculation step (``specdec.speculative.Speculator``) calls:

    start(rows, prompts, params, rng, target_out)   after the target's context encoding of ``rows``
    propose(tail, lengths, k, params, rng)          every step with k > 0 → Proposal
    accepted(lengths, verified)                     every step, after acceptance
    max_draft_tokens(length)                        the largest k a row of ``length`` tokens allows

Per row r, S_r = prompt + emitted tokens. ``tail`` [B, 2] holds the last two tokens of S_r and
``lengths`` [B] = len(S_r); S_r[-1] is not in the target's KV cache yet. ``rows`` names the batch rows
that (re)start (None: rows 0 .. len(prompts)-1 and every row restarts); a proposer keeps per-row state
and must leave the other rows' state alone. ``target_out`` (a ``StepOutput``) holds, in ``prompts``
order, the token sampled after each prompt and the hidden state of every prompt position. ``rng`` is
the per-row ``RowGenerators`` every random draw must come from. ``verified`` (``Verified``) holds the
accepted count, the emitted tokens and the target's verify outputs, which EAGLE / Medusa read.

A proposal is a chain or a tree (``Proposal``). ``verifier`` (optional attribute) is the verifier the
proposals are checked with: ``ChainVerifier()`` unless the proposer says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .core.decoder import StepOutput
from .core.sampling import RowGenerators
from .tree import RowTrees


@dataclass
class Proposal:
    """Draft tokens for every row: a chain or a tree.

    tokens [B, N] long: a chain's drafts x_1 .. x_k (N = k), or a tree's N non-root nodes in node order
    (``specdec.tree``; the root is S[-1]).
    probs [B, N, V] f32 or None: the distribution each token was *sampled* from (lossless rejection
    sampling needs it); None means deterministic proposals (argmax, lookup, top-k trees), for which the
    one-hot rule is used.
    tree: None for a chain, else the per-row trees (``specdec.tree.RowTrees``: mask [B, N+1, N+1],
    depth, parent [B, N+1], ancestors [B, N+1, D+1], child_nodes [B, N+1, C]); rows may differ.
    num_drafts [B] long or None (chains only): how many of the k drafts each row really proposes; the
    verifier ignores the rest (``acceptance.accept``'s ``num_drafts``). Proposers leave it None (= k
    for every row); the speculation step sets it when k adapts per row (``specdec.adaptive``).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    tree: RowTrees | None = None
    num_drafts: torch.Tensor | None = None


@dataclass
class Verified:
    """The verifier's result (device tensors): num_accepted [B] long; emitted [B, D+1] long — the
    accepted drafts, then the correction / bonus token, then -1; target_out: the target's verify
    ``StepOutput`` over the N+1 verified positions ([S[-1], drafts...]); last_node [B] long: the index
    into those positions of the last accepted token (chain: num_accepted; tree: the deepest accepted
    node), whose hidden state predicts the next token."""

    num_accepted: torch.Tensor
    emitted: torch.Tensor
    target_out: StepOutput
    last_node: torch.Tensor


@runtime_checkable
class Proposer(Protocol):
    vocab_size: int
    batch_size: int

    def start(self, rows: list[int] | None, prompts: list[torch.Tensor], params: torch.Tensor,
              rng: RowGenerators, target_out: StepOutput) -> None: ...

    def propose(self, tail: torch.Tensor, lengths: torch.Tensor, k: int, params: torch.Tensor,
                rng: RowGenerators) -> Proposal: ...

    def accepted(self, lengths: torch.Tensor, verified: Verified) -> None: ...

    def max_draft_tokens(self, length: int) -> int:
        """The largest k a step may ask for when the longest row has ``length`` tokens."""
        ...
