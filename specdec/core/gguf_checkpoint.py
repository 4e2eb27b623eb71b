"""A GGUF file as a Hugging Face checkpoint: its config, its tensors under Hugging Face names, its tokenizer.

``paths.convert_gguf`` writes these once per file into the cache; they equal what ``transformers`` builds
from the same file (``from_pretrained(..., gguf_file=...)``: the same config values, bit-identical f32
tensors, the same tokenizer) without its 3-6 minutes on a 1.5B model. The header comes from
``gguf_index.read_header`` (well under a second; transformers' reader spends ~35 s decoding a 151,936-token
vocabulary into numpy arrays), the six block types of ``gguf_weights`` are dequantized by its vectorised
decoder (``BlockWeights.dequantize``, equal to ``gguf.quants.dequantize``), any other type by
``gguf.quants.dequantize``.

Architectures: the GGUF ``general.architecture`` values ``llama`` and ``qwen2`` (the model types the runtime
implements). llama.cpp's converter stores a llama model's ``attn_q`` / ``attn_k`` rows permuted for its RoPE
layout; they are permuted back (``gguf_weights.rope_row_order``), as transformers does.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .gguf_index import GGUFHeader, TensorEntry, read_header, tensor_bytes
from .gguf_weights import FORMATS, ROPE_PERMUTED, BlockWeights, hf_name, rope_row_order

ARCHITECTURES = ("llama", "qwen2")
# GGUF metadata key (after "<architecture>.") → Hugging Face config key
CONFIG_KEYS = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
               "feed_forward_length": "intermediate_size", "block_count": "num_hidden_layers",
               "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
               "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta"}
# llama only: transformers reads the rotary dimension as the head size
LLAMA_KEYS = {"rope.dimension_count": "head_dim"}
TOKEN_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
              "padding_token_id": "pad_token_id", "unknown_token_id": "unk_token_id"}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


def architecture(header: GGUFHeader, path: str | Path) -> str:
    arch = header.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return arch


def gguf_config(path: str | Path, header: GGUFHeader | None = None) -> dict:
    """The Hugging Face config values of a GGUF file: ``model_type``, sizes, RoPE base, norm epsilon, special
    token ids, ``vocab_size`` (the embedding's rows) and ``tie_word_embeddings`` (no ``output.weight``)."""
    header = header or read_header(path)
    arch, meta = architecture(header, path), header.metadata
    keys = CONFIG_KEYS | (LLAMA_KEYS if arch == "llama" else {})
    config = {"model_type": arch}
    config.update({hf: meta[f"{arch}.{key}"] for key, hf in keys.items() if f"{arch}.{key}" in meta})
    config.update({hf: meta[f"tokenizer.ggml.{key}"] for key, hf in TOKEN_KEYS.items()
                   if f"tokenizer.ggml.{key}" in meta})
    names = {t.name: t for t in header.tensors}
    if "token_embd.weight" not in names:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    config["vocab_size"] = names["token_embd.weight"].shape[0]
    config["tie_word_embeddings"] = "output.weight" not in names
    if arch == "llama":                 # qwen2 always has q / k / v biases
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    return config


def dequantize(path: str | Path, entry: TensorEntry) -> torch.Tensor:
    """One tensor of the file as f32, shape ``entry.shape``."""
    raw = tensor_bytes(path, entry)
    if entry.qtype in FORMATS:
        return BlockWeights.from_bytes(raw, entry.qtype).dequantize().reshape(entry.shape)
    if entry.qtype in FLOAT_TYPES:
        values = raw.view(FLOAT_TYPES[entry.qtype])
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        values = gguf_dequantize(raw, GGMLQuantizationType[entry.qtype])
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(entry.shape)      # a copy: the map is read-only


def gguf_tensors(path: str | Path, config: dict,
                 header: GGUFHeader | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, f32 tensor) for every tensor of the file the runtime reads, one at a time, in file
    order; q / k rows in Hugging Face order."""
    header = header or read_header(path)
    for entry in header.tensors:
        name, permute = hf_name(entry.name)
        if name is None:
            continue
        tensor = dequantize(path, entry)
        if permute and config["model_type"] in ROPE_PERMUTED:
            heads = config["num_attention_heads"] if permute == "heads" else \
                config.get("num_key_value_heads", config["num_attention_heads"])
            tensor = tensor[rope_row_order(tensor.shape[0], heads)]
        yield name, tensor
