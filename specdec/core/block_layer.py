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
five calls are made from C++ (``kernels/block_layer.cpp``), one dispatch a layer, and ``block_layers`` runs all
the layers in one parallel region (no thread start, allocation or check between the steps). On a 2-core CPU the
steps between the matmuls took a third of a 0.5B draft step (docs/real-pair.md). Every step is row-invariant, so
decode, verify and batched calls agree bit for bit. ``use_block_layers`` installs the runner as
``DecoderLM.layer_runners``, and all the layers in one call (``BlockStack``, ``block_layers``) as
``DecoderLM.stack_runner``; the ``regional`` backend then compiles nothing (there is nothing left to fuse).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache, partial

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
    """Run every decoder layer of ``lm`` as ``run_block_layer`` when ``block_layers_apply``, and all of them in
    one call (``BlockStack``, ``DecoderLM.stack_runner``) where the forward returns no feature layers; returns
    whether it does. Each layer's kernel arguments are gathered here, once (``BlockLayerArgs``): call it again
    after replacing a layer's projections or norms."""
    if not block_layers_apply(lm):
        return False
    args = [BlockLayerArgs.of(layer) for layer in lm.model.layers]
    lm.layer_runners = [partial(run_block_layer, args=a) for a in args]
    lm.stack_runner = BlockStack.of(lm, args)
    return True


def runs_block_layers(lm: torch.nn.Module) -> bool:
    """Whether ``use_block_layers`` installed its runners on ``lm`` (any other module, e.g. an EAGLE head: no)."""
    runners = (lm.layer_runners or []) if isinstance(lm, DecoderLM) else []
    return bool(runners) and all(isinstance(r, partial) and r.func is run_block_layer for r in runners)


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
    rows = all_rows(x.shape[0], x.device) if seq_ids is None else seq_ids
    return torch.ops.specdec.block_layer(x, cos, sin, attn.k_cache, attn.v_cache, rows, slots, mask, args.weights,
                                         args.layout, args.eps)


@dataclass(frozen=True)
class BlockStack:
    """A ``DecoderLM.stack_runner``: every decoder layer in one ``block_layers`` call (``kernels/block_layer.cpp``:
    ``block_layer`` for each layer in turn, from C++), the same bits as the layers' ``run_block_layer`` calls
    one by one without a Python call and a dispatch a layer (on a 24-layer 0.5B draft step 1.8 of 14 ms).
    ``layers``: the decoder layers (their KV caches are read at each call); ``weights`` / ``layout``: their
    ``BlockLayerArgs`` one after the other; ``eps``: the RMSNorm epsilon they share."""
    layers: list[DecoderLayer]
    weights: list[torch.Tensor]
    layout: list[int]
    eps: float

    @classmethod
    def of(cls, lm: DecoderLM, args: list[BlockLayerArgs]) -> BlockStack | None:
        """The stack of ``lm``'s layers with their ``args``; None where the layers' epsilons differ."""
        if len({a.eps for a in args}) != 1:
            return None
        return cls(list(lm.model.layers), [t for a in args for t in a.weights], [v for a in args for v in a.layout],
                   args[0].eps)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor, seq_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The layers on x [b, n, H] (``model.DecoderLayer.forward``'s inputs, each layer's output the next one's
        input) → the last layer's output [b, n, H]."""
        attns = [layer.self_attn for layer in self.layers]
        rows = all_rows(x.shape[0], x.device) if seq_ids is None else seq_ids
        return torch.ops.specdec.block_layers(x, cos, sin, [a.k_cache for a in attns], [a.v_cache for a in attns],
                                              rows, slots, mask, self.weights, self.layout, self.eps)


@cache
def all_rows(b: int, device: torch.device) -> torch.Tensor:
    """The cache rows 0 .. b-1 (every row of the batch), made once per batch size and device and shared by
    every layer and call (``block_layer`` only reads it)."""
    return torch.arange(b, device=device)
