"""Decoder layers of a GGUF file's own blocks as five CPU kernel calls (``quantization="gguf"``, f32, the CPU).

A ``model.DecoderLayer`` whose projections are all ``BlockLinear`` runs, per graph call, as

    qkv = block_mm(x, W_qkv, norm=input_layernorm) + b_qkv          (q, k, v: one call each when unfused)
    a   = cache_attention(q, k, v, cos, sin, k_cache, v_cache, rows, slots, mask)
    x   = x + block_mm(a, W_o)
    gu  = block_mm(x, W_gate_up, norm=post_attention_layernorm)     (gate, up: one call each when unfused)
    x   = x + block_mm(silu(gate) · up, W_down)

— the layer's own math (``model.DecoderLayer.forward``) with its RMSNorms, SiLU gate, biases and residual adds
inside the matmul calls (``block_mm``'s prologue and epilogue) and RoPE, the KV-cache writes and the attention in
one call (``kernels/attention.cpp``), instead of a dozen element-wise kernels and SDPA between the matmuls; the
five calls are made from C++ (``kernels/block_layer.cpp``), one dispatch a layer. On a 2-core CPU the steps
between the matmuls took a third of a 0.5B draft step (docs/real-pair.md). Every step is row-invariant, so
decode, verify and batched calls agree bit for bit. ``use_block_layers`` installs the runner as
``DecoderLM.layer_runners``; the ``regional`` backend then compiles nothing (there is nothing left to fuse).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

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
    it does. Each layer's kernel arguments are gathered here, once (``BlockLayerArgs``): call it again after
    replacing a layer's projections or norms."""
    if not block_layers_apply(lm):
        return False
    lm.layer_runners = [partial(run_block_layer, args=BlockLayerArgs.of(layer)) for layer in lm.model.layers]
    return True


@dataclass(frozen=True)
class BlockLayerArgs:
    """A decoder layer's ``block_layer`` arguments that do not change between calls: ``weights`` (each
    projection's qs, d, dmin, sc, mn and bias, in the order qkv or q / k / v, o, gate_up or gate / up, down,
    then the two RMSNorm weights), ``layout`` (the counts of attention and MLP input projections, then each
    projection's ``BlockLinear.kernel_layout``) and the RMSNorm ``eps``."""
    weights: list[torch.Tensor]
    layout: list[int]
    eps: float

    @classmethod
    def of(cls, layer: DecoderLayer) -> BlockLayerArgs:
        attn, mlp = layer.self_attn, layer.mlp
        attn_in = _parts(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        mlp_in = _parts(mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        projections = [*attn_in, attn.o_proj, *mlp_in, mlp.down_proj]
        weights = [t for p in projections for t in p.kernel_weights()]
        weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        layout = [len(attn_in), len(mlp_in), *(v for p in projections for v in p.kernel_layout())]
        return cls(weights, layout, layer.input_layernorm.eps)


def run_block_layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    slots: torch.Tensor, mask: torch.Tensor, kv_len: int,
                    seq_ids: torch.Tensor | None = None, args: BlockLayerArgs | None = None) -> torch.Tensor:
    """``layer(x, cos, sin, slots, mask, kv_len, seq_ids)`` (``model.DecoderLayer.forward``'s contract: x
    [b, n, H] f32, cos / sin [b, n, D], slots [b, n], mask [b, 1, n, kv_len]) as one ``block_layer`` call
    (``kernels/block_layer.cpp``: the five kernel calls above, made from C++). ``args``: the layer's
    ``BlockLayerArgs``, gathered once (``use_block_layers``); None gathers them now."""
    attn = layer.self_attn
    if args is None:
        args = BlockLayerArgs.of(layer)
    rows = torch.arange(x.shape[0], device=x.device) if seq_ids is None else seq_ids
    return torch.ops.specdec.block_layer(x, cos, sin, attn.k_cache, attn.v_cache, rows, slots, mask, args.weights,
                                         args.layout, args.eps)
