"""Decoder layers of a GGUF file's own blocks as five CPU kernel calls (``quantization="gguf"``, f32, the CPU).

A ``model.DecoderLayer`` whose projections are all ``BlockLinear`` runs, per graph call, as

    qkv = block_mm(x, W_qkv, norm=input_layernorm) + b_qkv          (q, k, v: one call each when unfused)
    a   = cache_attention(q, k, v, cos, sin, k_cache, v_cache, rows, slots, mask)
    x   = x + block_mm(a, W_o)
    gu  = block_mm(x, W_gate_up, norm=post_attention_layernorm)     (gate, up: one call each when unfused)
    x   = x + block_mm(silu(gate) · up, W_down)

— the layer's own math (``model.DecoderLayer.forward``) with its RMSNorms, SiLU gate, biases and residual adds
inside the matmul calls (``block_mm``'s prologue and epilogue) and RoPE, the KV-cache writes and the attention in
one call (``kernels/attention.cpp``), instead of a dozen element-wise kernels and SDPA between the matmuls. On
a 2-core CPU those cost about as much as the matmuls of a small draft model (docs/real-pair.md). Every step is
row-invariant, so decode, verify and batched calls agree bit for bit. ``use_block_layers`` installs the runner
as ``DecoderLM.layer_runners``; the ``regional`` backend then compiles nothing (there is nothing left to fuse).
"""
from __future__ import annotations

import torch

from .block_linear import BlockLinear
from .kernels import block_mm_isa
from .model import DecoderLayer, DecoderLM


def block_layers_apply(lm: DecoderLM) -> bool:
    """Whether every decoder layer of ``lm`` can run as ``run_block_layer``: the C++ kernels built, one rank,
    every projection a ``BlockLinear`` computing in f32, an unquantized f32 KV cache on the CPU, head dims a
    multiple of 16 (at most 256)."""
    if lm.tp.size != 1 or block_mm_isa() == "reference":
        return False
    return all(_layer_applies(layer) for layer in lm.model.layers)


def _layer_applies(layer: torch.nn.Module) -> bool:
    if type(layer) is not DecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    projections = [*_parts(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")), attn.o_proj,
                   *_parts(mlp, "gate_up_proj", ("gate_proj", "up_proj")), mlp.down_proj]
    return (all(isinstance(p, BlockLinear) and p.dtype == torch.float32 for p in projections)
            and attn.kv_cache_dtype is None and attn.k_cache.dtype == torch.float32
            and attn.k_cache.device.type == "cpu" and attn.head_dim % 16 == 0 and attn.head_dim <= 256
            and layer.input_layernorm.weight.dtype == torch.float32)


def _parts(module: torch.nn.Module, fused: str, names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The fused projection, or the separate ones it would replace (``quant.fuse_projections``)."""
    layer = getattr(module, fused)
    return [layer] if layer is not None else [getattr(module, name) for name in names]


def use_block_layers(lm: DecoderLM) -> bool:
    """Run every decoder layer of ``lm`` as ``run_block_layer`` when ``block_layers_apply``; returns whether
    it does."""
    if not block_layers_apply(lm):
        return False
    lm.layer_runners = [run_block_layer] * len(lm.model.layers)
    return True


def _project(parts: list[BlockLinear], x: torch.Tensor, **fused) -> torch.Tensor:
    """The parts' outputs on rows x [M, K], concatenated [M, Σ N]."""
    outs = [part.fused(x, **fused) for part in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


def run_block_layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    slots: torch.Tensor, mask: torch.Tensor, kv_len: int,
                    seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``layer(x, cos, sin, slots, mask, kv_len, seq_ids)`` (``model.DecoderLayer.forward``'s contract: x
    [b, n, H] f32, cos / sin [b, n, D], slots [b, n], mask [b, 1, n, kv_len]) in five kernel calls."""
    b, n, hidden = x.shape
    attn, mlp = layer.self_attn, layer.mlp
    flat = x.reshape(b * n, hidden)
    norm = layer.input_layernorm
    qkv = _project(_parts(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")), flat, norm=norm.weight, eps=norm.eps)
    q, k, v = (t.view(b, n, -1) for t in qkv.split(attn.qkv_sizes, dim=-1))
    rows = torch.arange(b, device=x.device) if seq_ids is None else seq_ids
    out = torch.ops.specdec.cache_attention(q, k, v, cos, sin, attn.k_cache, attn.v_cache, rows, slots,
                                            mask[:, 0])
    flat = attn.o_proj.fused(out.view(b * n, -1), residual=flat)
    norm = layer.post_attention_layernorm
    gate_up = _project(_parts(mlp, "gate_up_proj", ("gate_proj", "up_proj")), flat, norm=norm.weight, eps=norm.eps)
    return mlp.down_proj.fused(gate_up, gated=True, residual=flat).view(b, n, hidden)
