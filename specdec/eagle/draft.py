"""``EagleModel``: an EAGLE-1 or EAGLE-3 draft network on the static runtime, bound to its target (the
drafting strategy around it is ``specdec.eagle.proposer.EagleDraft``).

It is a ``DecoderModel`` (own KV cache, buckets, graphs, ``compile``/``save``/``load`` of graphs)
whose graphs take one more input, the target features [B, n, H]. Its runtime settings (batch size,
``n_positions``, ``amp``, buckets, sampling config, backend, device) are the target's, so the
target's features feed it without conversion. Without ``embed_tokens.weight`` in the checkpoint it
uses the target's embedding table (the same tensor, no copy). Loading an EAGLE-3 draft sets the
target's ``feature_layers`` to the draft's aux layers (``DecoderModel.use_feature_layers``), so the
target's graphs return the hidden states the draft's ``fc`` projects (``true_features``).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..core.checkpoint import load_weights
from ..core.config import ModelConfig
from ..core.decoder import DecoderModel
from ..core.graphs import GraphKey
from ..core.persistence import read_saved
from ..core.quant import parse_quantization, quantize_and_fuse
from ..core.target import StepOutput
from .checkpoint import aux_layer_ids, check_layout, eagle3_token_ids, eagle_key, is_eagle3, tensor_names
from .model import Eagle3LM, EagleLM


class EagleModel(DecoderModel):
    @classmethod
    def from_pretrained(cls, path: str | Path, target: DecoderModel, *, eagle_input_norm: bool | None = None,
                        backend: str | None = None, quantization: str | None = "target",
                        progress: bool = True) -> EagleModel:
        """Load an EAGLE draft network for ``target`` (a ``DecoderModel``): the EAGLE-1, NxD or EAGLE-3
        layout (``specdec.eagle.checkpoint``). An EAGLE-3 draft sets the target's feature layers.

        ``eagle_input_norm``: apply the layer's input RMSNorm (NxD Inference's
        ``enable_eagle_draft_input_norm``; EAGLE-1 only); default: config.json's ``eagle_input_norm``,
        else False. ``backend``: default the target's. ``quantization``: the draft's weight-only scheme
        (``specdec.core.quant``; "int8" / "int4" quantize its decoder layer with it and its LM head at
        int8, None or "none" keep it float); default "target": the target's, as ``DraftModel``'s. The
        draft only proposes, so its scheme changes what it proposes and what a step costs, never the
        output distribution."""
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
        eagle3 = is_eagle3(raw, names)
        if eagle3:
            if raw.get("target_hidden_size", config.hidden_size) != config.hidden_size:
                raise ValueError(f"EAGLE-3 draft {path} has hidden_size={config.hidden_size} but target_hidden_size="
                                 f"{raw['target_hidden_size']}: drafts narrower than their target are not supported")
            aux = aux_layer_ids(raw, target.config.num_layers)
            token_ids = eagle3_token_ids(path, config.vocab_size, config.output_vocab_size or config.vocab_size)
            config = replace(config, output_vocab_size=None if token_ids is None else len(token_ids))
        else:
            check_layout(path, names, input_norm)
        scheme = target.settings.quantization if quantization == "target" else parse_quantization(quantization)
        settings = replace(target.settings, backend=backend or target.settings.backend, tp_degree=1,
                           gqa_strategy=None, feature_layers=(), quantization=scheme, prompt_weights=None)
        if config.max_position_embeddings < settings.n_positions:
            config = replace(config, max_position_embeddings=settings.n_positions)
        dtype = target.dtype
        with torch.device("meta"):
            if eagle3:
                lm = Eagle3LM(config, settings.batch_size, settings.n_positions, dtype, aux, target.config.hidden_size,
                              kv_cache_dtype=settings.kv_cache_dtype)
            else:
                lm = EagleLM(config, settings.batch_size, settings.n_positions, dtype, input_norm,
                             fc_bias="fc.bias" in names, kv_cache_dtype=settings.kv_cache_dtype)
        lm = lm.to_empty(device=settings.device).to(dtype)
        lm.init_buffers()
        optional = set()
        if "embed_tokens.weight" not in names:      # the target's table, shared
            lm.embed_tokens.weight = target.lm.model.embed_tokens.weight
            optional.add("embed_tokens.weight")
        if eagle3 and token_ids is not None:        # from d2t, not a tensor of the checkpoint
            lm.output_token_ids.copy_(token_ids)
            optional.add("output_token_ids")
        load_weights(lm, path, progress=progress, rename=eagle_key, optional=frozenset(optional))
        if eagle3:
            target.use_feature_layers(aux)
        quantize_and_fuse(lm, settings.quantization, settings.backend)   # the draft's scheme (default the target's)
        lm.eval().requires_grad_(False)
        draft = cls(path, config, lm, settings)
        draft.target_path = target.path
        return draft

    def true_features(self, target_out: StepOutput) -> torch.Tensor:
        """The draft's input features [B, n, H] of the target positions in ``target_out`` (EAGLE-1: the
        target's final-norm hidden states; EAGLE-3: ``fc`` of its aux hidden states), in the draft's dtype."""
        with torch.no_grad():
            return self.lm.project(target_out.hidden, target_out.aux_hidden).to(self.dtype)

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
    def load(cls, directory: str | Path, target: DecoderModel, progress: bool = True) -> EagleModel:
        """Re-create a draft written by ``save`` (the inherited ``DecoderModel.save``: checkpoint path,
        runtime settings, compiled graphs) for ``target``, whose runtime settings it shares."""
        saved = read_saved(directory)
        draft = cls.from_pretrained(saved.checkpoint, target, backend=saved.settings["backend"], progress=progress)
        draft._load_compiled(directory, saved.keys, progress)
        return draft
