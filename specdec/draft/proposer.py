"""Vanilla draft-model speculation: a separate small model on the same runtime proposes k tokens.

KV bookkeeping (per row, S = prompt + emitted tokens, len(S) = n): before proposing, the draft's
length is set to n - 2 and it ingests [S[-2], S[-1]] in one 2-token step. This re-reads S[-2]
(harmless: same KV) so rows that accepted all k drafts last step — whose draft cache lacks the
k-th draft token — and rows that did not are handled by one fixed-shape step. Then k - 1 one-token
steps follow. Slots up to n - 2 are always valid because every accepted token was ingested by the
draft when it was proposed.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from ..core.decoder import DecoderModel
from ..core.paths import gguf_source
from ..core.sampling import any_sampled
from ..fused.step import FusedKey
from ..proposer import Proposal
from .fused import DraftLoop


class DraftModel:
    """A small ``DecoderModel`` proposing for a target with the same tokenizer (a ``Proposer``)."""

    def __init__(self, model: DecoderModel):
        if getattr(model.lm, "feature_size", None):
            raise ValueError("this is an EAGLE draft network: use EagleDraft.from_pretrained(path, target)")
        self.model, self.module = model, model.lm
        self.vocab_size, self.batch_size = model.vocab_size, model.batch_size

    @classmethod
    def from_pretrained(cls, path: str | Path | None, target: DecoderModel, **overrides) -> "DraftModel":
        """Load a draft checkpoint with the target's runtime settings (batch size, ``n_positions``,
        ``amp``, buckets, sampling config, backend, device, ``tp_degree``; the head layout is chosen for the
        draft's own heads) unless ``overrides`` (any
        ``DecoderModel.from_pretrained`` argument) say otherwise. A target's ``quantization="gguf"``
        applies to a GGUF draft; a checkpoint-directory draft then stays in ``amp``."""
        settings = {**asdict(target.settings), "sampling": target.settings.sampling, "gqa_strategy": None,
                    **overrides}
        if settings["quantization"] == "gguf" and gguf_source(path) is None:
            settings["quantization"] = None      # "gguf" keeps what a file stores: a checkpoint directory's floats
        model = DecoderModel.from_pretrained(path, **settings)
        draft = cls(model)
        draft.check_target(target)
        return draft

    def check_target(self, target: DecoderModel) -> None:
        """ValueError when this draft cannot propose for ``target`` (device, tokenizer)."""
        m = self.model
        if m.device != target.device:
            raise ValueError(f"draft is on {m.device}, target on {target.device}: use one device")
        dt, tt = _tokenizer_or_none(m), _tokenizer_or_none(target)
        if dt is not None and tt is not None and dt.get_vocab() != tt.get_vocab():
            raise ValueError(f"draft tokenizer ({m.path}) differs from the target's ({target.path}): "
                             "same vocab size but different token ids")

    def start(self, rows, prompts, params, rng, target_out) -> None:
        # a draft proposes without the repetition penalty (the acceptance rule still makes the output the
        # target's penalised distribution), also when its model ran as a target before and tracked presence
        self.model.presence = None
        self.model.prefill(prompts, params, rng, rows=rows)

    def max_draft_tokens(self, length: int) -> int:
        return self.model.n_positions - length + 1

    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        m = self.model
        sampled = any_sampled(params)
        m.set_lengths(lengths - 2)
        out = m.step(tail, params, rng, return_probs=sampled)
        tokens, probs = [out.tokens[:, -1]], [out.probs[:, -1]] if sampled else []
        for _ in range(k - 1):
            out = m.step(tokens[-1].unsqueeze(1), params, rng, return_probs=sampled)
            tokens.append(out.tokens[:, -1])
            if sampled:
                probs.append(out.probs[:, -1])
        return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1) if sampled else None)

    def accepted(self, lengths, verified) -> None:
        """Nothing to do: the next ``propose`` resets the draft's lengths from the sequence."""

    def fused_drafter(self, key: FusedKey) -> DraftLoop:
        """``propose``'s k steps as one module for fused speculation (``specdec.fused``)."""
        return DraftLoop(self.module, key, self.model.settings.sampling.global_topk)


def _tokenizer_or_none(model: DecoderModel):
    try:
        return model.tokenizer
    except (OSError, ValueError):
        return None
