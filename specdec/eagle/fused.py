"""EAGLE chain drafting as one in-graph loop, for fused speculation (``specdec.fused``).

The same steps as ``EagleDraft.propose`` / ``accepted`` (see ``specdec.eagle.proposer``), with the same
shapes: per row, n = len(S), a ``width``-position step re-reads the (feature, token) pairs at positions
max(0, n-1-width) .. (logits at n-2 → x_1 and the draft feature f^_{n-1}), then k - 1 one-token steps
pair the previous draft feature with the previous draft token. After acceptance ``update`` stores the
true features of the verified positions (EAGLE-3: ``fc`` of the target's aux hidden states, in the
graph) and the emitted tokens in the proposer's buffers (``features`` [B, N, H], ``next_tokens`` [B, N]:
the same tensors, updated in place). Uniforms per row: k (one per draft token).
"""
from __future__ import annotations

import torch
from torch import nn

from ..core.graphs import StepGraph
from ..core.model import split_hidden
from ..fused.step import FusedKey, causal_inputs, draft_chain


class EagleLoop(nn.Module):
    """k EAGLE draft steps of ``lm`` (an ``EagleLM``) over the proposer's pair buffers
    (a ``specdec.fused.ChainDrafter``)."""

    def __init__(self, lm: nn.Module, features: torch.Tensor, next_tokens: torch.Tensor, key: FusedKey,
                 global_topk: int | None):
        super().__init__()
        self.k, self.width, self.sampled, self.uniforms = key.k, key.width, key.do_sample, key.k
        self.lm = lm
        self.register_buffer("features", features, persistent=False)        # shared with EagleDraft
        self.register_buffer("next_tokens", next_tokens, persistent=False)
        self.reread = StepGraph(lm, key.step_key(key.width, 1, key.draft_kv_len), global_topk)
        self.one = StepGraph(lm, key.step_key(1, 1, key.draft_kv_len), global_topk)

    def forward(self, tail, lengths, params, uniform):
        B, N = self.next_tokens.shape
        rows = torch.arange(B, device=lengths.device).unsqueeze(1)
        start = (lengths - 1 - self.width).clamp(min=0)
        positions, mask, _ = causal_inputs(lengths, start, self.width)
        pos = positions.clamp(max=N - 1)
        last = (lengths - 2 - start).unsqueeze(1)
        out = self.reread(self.next_tokens[rows, pos], positions, start, mask, last, params, uniform[:, :1],
                          self.features[rows, pos])
        hidden = out[-1]
        feature = hidden.gather(1, last.unsqueeze(-1).expand(-1, 1, hidden.shape[-1]))    # f^_{n-1}: [B, 1, H]
        return draft_chain(self.one, self.k, out[0], out[1] if self.sampled else None, lengths - 2, lengths, params,
                           uniform, feature)

    def update(self, lengths, hidden, emitted) -> None:
        """The verified positions n-1 .. n-1+k get the true features (``EagleNetwork.project`` of the target's
        hidden output) and the emitted tokens (positions past the accepted ones hold garbage, overwritten
        before use)."""
        B, N = self.next_tokens.shape
        rows = torch.arange(B, device=lengths.device).unsqueeze(1)
        pos = ((lengths - 1).unsqueeze(1) + torch.arange(hidden.shape[1], device=lengths.device)).clamp(max=N - 1)
        self.features[rows, pos] = self.lm.project(*split_hidden(hidden, self.lm.target_hidden_size)).to(
            self.features.dtype)
        self.next_tokens[rows, pos] = emitted[:, :hidden.shape[1]].clamp(min=0)
