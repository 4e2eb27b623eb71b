"""``EagleModel``: an EAGLE-1 draft network on the static runtime, bound to its target (the drafting
strategy around it is ``specdec.eagle.proposer.EagleDraft``).

It is a ``DecoderModel`` (own KV cache, buckets, graphs, ``compile``/``save``/``load`` of graphs)
whose graphs take one more input, the target features [B, n, H]. Its runtime settings (batch size,
``n_positions``, ``amp``, buckets, sampling config, backend, device) are the target's, so the
target's features feed it without conversion. Without ``embed_tokens.weight`` in the checkpoint it
uses the target's embedding table (the same tensor, no copy).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..core.config import ModelConfig
from ..core.decoder import DecoderModel
from ..core.graphs import GraphKey
from ..core.checkpoint import load_weights
from ..core.quant import quantize_linears
from .checkpoint import check_layout, eagle_key, tensor_names
from .model import EagleLM


class EagleModel(DecoderModel):
    @classmethod
    def from_pretrained(cls, path: str | Path, target: DecoderModel, *, eagle_input_norm: bool | None = None,
                        backend: str | None = None, progress: bool = True) -> "EagleModel":
        """Load an EAGLE draft network for ``target`` (a ``DecoderModel``).

        ``eagle_input_norm``: apply the layer's input RMSNorm (NxD Inference's
        ``enable_eagle_draft_input_norm``); default: config.json's ``eagle_input_norm``, else False.
        ``backend``: default the target's."""
        if target.tp.size > 1:
            raise ValueError(f"EAGLE drafts need a target at tp_degree=1 (got {target.tp.size}): "
                             "tensor-parallel EAGLE is not supported yet")
        path = Path(path)
        config = ModelConfig.from_dir(path)
        raw = json.loads((path / "config.json").read_text())
        input_norm = bool(raw.get("eagle_input_norm", False)) if eagle_input_norm is None else eagle_input_norm
        for key, mine, theirs in (("hidden_size", config.hidden_size, target.config.hidden_size),
                                  ("vocab_size", config.vocab_size, target.config.vocab_size)):
            if mine != theirs:
                raise ValueError(f"EAGLE draft {key}={mine} ({path}) != target {key}={theirs}: "
                                 "the draft must be trained for this target")
        names = tensor_names(path)
        check_layout(path, names, input_norm)
        settings = replace(target.settings, backend=backend or target.settings.backend, tp_degree=1,
                           gqa_strategy=None)
        if config.max_position_embeddings < settings.n_positions:
            config = replace(config, max_position_embeddings=settings.n_positions)
        dtype = target.dtype
        with torch.device("meta"):
            lm = EagleLM(config, settings.batch_size, settings.n_positions, dtype, input_norm,
                         fc_bias="fc.bias" in names, kv_cache_dtype=settings.kv_cache_dtype)
        lm = lm.to_empty(device=settings.device).to(dtype)
        lm.init_buffers()
        shared_embedding = "embed_tokens.weight" not in names
        if shared_embedding:
            lm.embed_tokens.weight = target.lm.model.embed_tokens.weight
        load_weights(lm, path, progress=progress, rename=eagle_key,
                     optional=frozenset({"embed_tokens.weight"}) if shared_embedding else frozenset())
        quantize_linears(lm, settings.quantization)      # the target's quantization, its decoder layer
        lm.eval().requires_grad_(False)
        draft = cls(path, config, lm, settings)
        draft.target_path = target.path
        return draft

    @property
    def tokenizer(self):
        """The target's tokenizer (EAGLE checkpoints ship none)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.target_path)
        return self._tokenizer

    def graph_keys(self, do_sample: bool | None = None, spec_tokens: tuple[int, ...] = (),
                   prompt_length: int | None = None, max_length: int | None = None,
                   single_row: bool = False) -> list[GraphKey]:
        """Context keys and one-token keys as a target's, plus for each k in ``spec_tokens`` the
        (k+1)-position re-read step with logits at one position (see ``specdec.eagle.proposer``)."""
        keys = super().graph_keys(do_sample, (), prompt_length, max_length, single_row)
        one = [replace(k, return_probs=k.do_sample) for k in keys if k.n_tokens == 1]
        context = [k for k in keys if k.n_tokens > 1]
        return context + one + [replace(k, n_tokens=n + 1) for n in spec_tokens for k in one if k.kv_len >= n + 1]

    @classmethod
    def load(cls, directory: str | Path, target: DecoderModel, progress: bool = True) -> "EagleModel":
        """Re-create a draft written by ``save`` (the inherited ``DecoderModel.save``: checkpoint path,
        runtime settings, compiled graphs) for ``target``, whose runtime settings it shares."""
        directory = Path(directory)
        meta_file = directory / "specdec.json"
        if not meta_file.is_file():
            raise FileNotFoundError(f"{directory} holds no saved specdec model (specdec.json missing)")
        meta = json.loads(meta_file.read_text())
        draft = cls.from_pretrained(meta["checkpoint"], target, backend=meta["settings"]["backend"],
                                    progress=progress)
        draft._load_compiled(directory, [GraphKey(**k) for k in meta["graphs"]], progress)
        return draft
