"""Model configuration: the subset of a Hugging Face ``config.json`` the runtime needs.

Parsing is done by ``transformers.AutoConfig`` (so rope-scaling conventions and defaults are the
library's own); this module validates the architecture and keeps the HF config for RoPE setup.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from .kv_quant import kv_cache_bytes

INT4_GROUP = 32
"""Weights per int4 group (``quant``'s int4 layout: one scale and one zero per group)."""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

AMP_DTYPES = {
    "f32": torch.float32, "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "f16": torch.float16, "fp16": torch.float16, "float16": torch.float16,
}


def amp_dtype(amp: str | torch.dtype) -> torch.dtype:
    """Map an ``amp`` name (f32 / bf16 / f16) or a torch dtype to a torch dtype."""
    if isinstance(amp, torch.dtype):
        if amp in AMP_DTYPES.values():
            return amp
    elif amp in AMP_DTYPES:
        return AMP_DTYPES[amp]
    raise ValueError(f"amp={amp!r} is not supported; use one of 'f32', 'bf16', 'f16'")


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s weights — parameters and persistent buffers (quantized weights and their
    scales; not the KV cache) — each distinct tensor in memory counted once (tied weights once).

    The measured counterpart of :meth:`ModelConfig.weight_bytes`, for any module (draft heads too)."""
    seen: dict[object, int] = {}
    for p in module.state_dict(keep_vars=True).values():
        nbytes = p.numel() * p.element_size()
        # tied weights: the same tensor, or the same memory under another Parameter object
        key = id(p) if p.device.type == "meta" else (p.device, p.data_ptr(), nbytes)
        seen[key] = nbytes
    return sum(seen.values())


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    hf_config: PretrainedConfig
    output_vocab_size: int | None = None  # reduced LM head (drafts): logits only for these tokens

    @classmethod
    def from_hf(cls, hf: PretrainedConfig) -> ModelConfig:
        if hf.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {hf.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (the Llama family incl. SmolLM2)")
        heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads or hf.num_attention_heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        # Qwen2 has q/k/v bias but no `attention_bias` field; Llama/Mistral default to none.
        bias = hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))
        window = getattr(hf, "sliding_window", None)
        if hf.model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        return cls(
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            attention_bias=bias,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=hf.max_position_embeddings,
            sliding_window=window,
            eos_token_ids=eos_ids,
            pad_token_id=getattr(hf, "pad_token_id", None),
            hf_config=hf,
            output_vocab_size=getattr(hf, "draft_vocab_size", None),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face checkpoint directory")
        return cls.from_hf(AutoConfig.from_pretrained(path))

    def weight_bytes(self, dtype: torch.dtype, quantization: str | None = None) -> int:
        """Bytes of all weights (tied embeddings counted once); with ``quantization`` ("int8", "int4") the
        attention and MLP projections and the LM head as ``core.quant`` stores them
        (``quant.quantized_bytes``; the head in int8, a tied embedding's float table kept beside it)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        projections = h * q + 2 * h * kv + q * h + 3 * h * i
        layer = projections + (q + 2 * kv if self.attention_bias else 0) + 2 * h
        head_rows = self.output_vocab_size or v
        float_head = 0 if self.tie_word_embeddings else head_rows * h
        total = self.num_layers * layer + v * h + h + float_head
        size = torch.finfo(dtype).bits // 8
        if quantization is None:
            return total * size
        rows = q + 2 * kv + h + 2 * i + h
        return self.num_layers * quantized_bytes(projections, rows, size, quantization) + \
            quantized_bytes(head_rows * h, head_rows, size, "int8") + \
            (total - self.num_layers * projections - float_head) * size

    def kv_bytes(self, dtype: torch.dtype, batch_size: int, n_positions: int, kv_cache_dtype: str | None = None) -> int:
        """Bytes of the preallocated KV cache (K and V of every layer, ``batch_size`` rows of ``n_positions``
        slots, unsharded): ``dtype`` elements, or with ``kv_cache_dtype`` ("int8", "fp8_e4m3") 1 byte per
        element plus a 4-byte scale per (slot, head) for K and for V (``kv_quant.kv_cache_bytes``)."""
        elems = 2 * self.num_layers * batch_size * n_positions * self.num_kv_heads * self.head_dim
        return kv_cache_bytes(elems, self.head_dim, torch.finfo(dtype).bits // 8, kv_cache_dtype)

    def bytes_read_per_token(self, dtype: torch.dtype, quantization: str | None = None) -> int:
        """Weight bytes a decode step reads: every weight except the embedding table (one row)."""
        h, v = self.hidden_size, self.vocab_size
        unread = v * h - h if not self.tie_word_embeddings or quantization is not None else 0
        return self.weight_bytes(dtype, quantization) - unread * torch.finfo(dtype).bits // 8


def quantized_bytes(elems: int, rows: int, nbytes: int, scheme: str) -> int:
    """Bytes of ``elems`` quantized weights in ``rows`` output rows, scales / zeros at ``nbytes`` each."""
    if scheme == "int8":
        return elems + rows * nbytes
    return elems // 2 + 2 * (elems // INT4_GROUP) * nbytes
