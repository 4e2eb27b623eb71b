"""The draft model's k proposals as one in-graph loop, for fused speculation (``specdec.fused``).

The same steps as ``DraftModel.propose`` (see ``specdec.draft.proposer``), with the same shapes, so
the draft's numbers and random draws are those of the unfused proposer: per row, with n = len(S),
a 2-token step re-reads [S[-2], S[-1]] at slots n-2, n-1 (logits at both, the last one proposes x_1),
then k - 1 one-token steps feed x_j at slot n-1+j → x_{j+1}. Uniforms per row: 2 + (k - 1) = k + 1,
x_1 takes the second, x_{j+1} the (j+2)-th.
"""
from __future__ import annotations

from torch import nn

from ..core.graphs import StepGraph
from ..fused.step import FusedKey, causal_inputs, draft_chain


class DraftLoop(nn.Module):
    """k draft steps of ``lm`` (a ``DecoderLM``) in the draft's KV bucket ``key.draft_kv_len``
    (a ``specdec.fused.ChainDrafter``)."""

    def __init__(self, lm: nn.Module, key: FusedKey, global_topk: int | None):
        super().__init__()
        self.k, self.sampled, self.uniforms = key.k, key.do_sample, key.k + 1
        self.catch_up = StepGraph(lm, key.step_key(2, 2, key.draft_kv_len), global_topk)
        self.one = StepGraph(lm, key.step_key(1, 1, key.draft_kv_len), global_topk)

    def forward(self, tail, lengths, params, uniform):
        start = lengths - 2
        positions, mask, logit_index = causal_inputs(lengths, start, 2)
        out = self.catch_up(tail, positions, start, mask, logit_index, params, uniform[:, :2])
        return draft_chain(self.one, self.k, out[0][:, -1:], out[1][:, -1:] if self.sampled else None, lengths - 1,
                           lengths, params, uniform[:, 1:])

    def update(self, lengths, hidden, emitted) -> None:
        """Nothing to keep: the next step re-reads [S[-2], S[-1]] (rejected drafts' slots are overwritten)."""
