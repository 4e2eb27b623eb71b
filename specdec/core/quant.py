"""Weight-only quantization of the decoder's linear layers.

``int8``: per-output-channel symmetric int8 (NxD Inference's ``quantization_type=
"per_channel_symmetric"``, transformers-neuronx's ``quant_dtype="s8"``): for row i of a weight W [N, K],

    scale_i = max_k |W_ik| / 127,   q_ik = round(W_ik / scale_i) in [-127, 127],   W_ik ≈ q_ik · scale_i

so the rounding error of every weight is at most scale_i / 2. ``y = x Wᵀ`` becomes
``(x qᵀ) · scale``: bf16 activations run PyTorch's CPU weight-only kernel
(``aten._weight_int8pack_mm``, reads int8 weights: a quarter of f32's bytes, half of bf16's); other
dtypes multiply by the int8 weights cast to the activation dtype (exact reference math, for tests).

``int4``: group-wise asymmetric 4-bit over groups of ``INT4_GROUP`` = 32 consecutive weights of a row
(GGUF Q4_1's layout): per group g, ``scale = (max − min) / 15``, ``q = round((w − min) / scale)`` in
[0, 15], ``w ≈ (q − 8) · scale + zero`` with ``zero = min + 8 · scale`` (error ≤ scale / 2). It runs
PyTorch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``, any float dtype; scales and zeros
kept in the compute dtype), half of int8's bytes. Shapes: out features divisible by 16 and in
features by 32 (per rank), else a ValueError says to use int8; CPU only.

``q4_0``: GGML's Q4_0 blocks (``gguf_weights.quantize_q4_0``: per group of 32, d = f16(m / -8) for m the weight of
largest magnitude, q = round(w / d) in [-8, 7]) on the ``block_mm`` CPU kernel (``block_linear``), the LM
head too: 4.5 bits a weight read, for cheap drafts (a GGUF file's own Q4_0 tensors are kept as they are, its
other blocks re-quantized from their exact values while it loads: ``gguf_weights.load_gguf_blocks``).

Quantized (int8 or int4): every attention and MLP projection (q, k, v, o, gate, up, down) with the
scheme, and the LM head with per-channel int8 under both (the output layer stays at 8 bits, as
llama.cpp keeps it at >= 6 bits and the embedded GGUF file stores it as Q8_0; at the embedded model's
49,152 × 576 it is a third of the bf16 bytes a decode step reads). Drafts, EAGLE heads and Medusa
heads follow the target's scheme: a Medusa ResBlock's linear with the scheme, each head's vocabulary
projection (one shared module for tied heads) at per-channel int8, as the LM head
(``MedusaDraft.from_pretrained``; ``quantize_linears``' ``names`` / ``head_names``). Not quantized:
embeddings (a tied embedding keeps its float table; a step reads one row of it) and norms. Under tensor
parallelism each rank quantizes its own shard; a row-parallel layer's rows are split along K, so their
maxima are all-reduced over the ranks first: a sharded model holds exactly the values of the
unsharded one (the vocab-parallel LM head is split along rows: its scales are the rank's own).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .block_linear import BlockLinear, cat_biases
from .config import INT4_GROUP
from .gguf_weights import quantize_q4_0
from .parallel import TPGroup, all_reduce_max

ALIASES = {"int8": "int8", "s8": "int8", "per_channel_symmetric": "int8", "int8_weight_only": "int8",
           "int4": "int4", "s4": "int4", "int4_weight_only": "int4", "gguf": "gguf", "q4_0": "q4_0"}
INT4_PACK_ROWS = 64       # the CPU int4 packing's row blocks (``Int4Linear.cat_rows``)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")     # sharded along K (their input dimension) at tp > 1
# The scheme of the output projections (the LM head, Medusa's) under each scheme: int8 per channel, as the
# logits feel a head's error most, except under q4_0, which exists to read the fewest bytes (a draft's head)
HEAD_SCHEMES = {"int8": "int8", "int4": "int8", "q4_0": "q4_0"}


def parse_quantization(name: str | None) -> str | None:
    """The canonical scheme for ``name`` (None / "none": no quantization); ValueError otherwise."""
    if name is None or name == "none":
        return None
    if name in ALIASES:
        return ALIASES[name]
    raise ValueError(f"quantization={name!r} is not supported: use None, 'int8', 'int4', 'gguf' or 'q4_0' "
                     f"(aliases: {', '.join(a for a in ALIASES if a != ALIASES[a])})")


def quantize_int8(weight: torch.Tensor, row_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q [N, K] int8 in [-127, 127], scale [N] f32) per output channel, symmetric.
    ``row_max`` [N]: the rows' max |w| when the rows are longer than ``weight`` (a K-shard); all-zero
    rows get scale 1 (q = 0)."""
    w = weight.detach().float()
    if row_max is None:
        row_max = w.abs().amax(dim=1)
    scale = torch.where(row_max > 0, row_max / 127, torch.ones_like(row_max))
    q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights [N, K] and per-output-channel scales [N] (buffers ``weight``,
    ``scale``; the optional ``bias`` stays in the compute dtype). x [..., K] → [..., N]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scale", scale.to(dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, row_max: torch.Tensor | None = None) -> Int8Linear:
        q, scale = quantize_int8(linear.weight, row_max)
        return cls(q, scale, linear.bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scale)
        else:
            y = F.linear(flat, self.weight.to(x.dtype)) * self.scale
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations, scales, outputs)."""
        return self.scale.dtype

    @classmethod
    def cat_rows(cls, layers: list[Int8Linear]) -> Int8Linear:
        """One layer whose output is the layers' outputs concatenated (the same input width)."""
        return cls(torch.cat([layer.weight for layer in layers]), torch.cat([layer.scale for layer in layers]),
                   cat_biases(layers), layers[0].dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer computes with, [N, K] f32 (``q · scale``)."""
        return self.weight.float() * self.scale.float().unsqueeze(1)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (K divisible by ``INT4_GROUP``) → (q [N, K] int32 in [0, 15], scale [N, K/G] f32,
    zero [N, K/G] f32) with w ≈ (q − 8) · scale + zero per group of G weights; constant groups get
    scale 1."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = w.amin(-1), w.amax(-1)
    scale = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
    q = torch.round((w - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.int32).view(n, k)
    return q, scale, low + 8 * scale


class Int4Linear(nn.Module):
    """``nn.Linear`` with group-wise int4 weights packed for PyTorch's CPU kernel (buffer ``weight``
    [N, K/2] uint8) and ``scales_and_zeros`` [K/G, N, 2] in the compute dtype. x [..., K] → [..., N].

    The packing keeps blocks of ``INT4_PACK_ROWS`` rows apart: the packed rows of matrices whose row
    counts are multiples of it concatenate into the packing of the concatenated matrix (``cat_rows``)."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], 2 * packed.shape[1]
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        dtype = scales_and_zeros.dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> Int4Linear:
        """q [N, K] int32 codes in [0, 15], scale / zero [N, K/G] (``quantize_int4``'s outputs) in ``dtype``."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        return cls(packed, torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous(), bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4Linear:
        n, k = linear.weight.shape
        if n % 16 or k % INT4_GROUP or linear.weight.device.type != "cpu":
            raise ValueError(f"int4 needs a CPU layer with out features divisible by 16 and in features by "
                             f"{INT4_GROUP} (PyTorch's CPU int4 kernel); this layer is [{n}, {k}] on "
                             f"{linear.weight.device.type}: use quantization='int8'")
        return cls.from_codes(*quantize_int4(linear.weight), linear.bias, linear.weight.dtype)

    @classmethod
    def cat_rows(cls, layers: list[Int4Linear]) -> Int4Linear:
        """One layer whose output is the layers' outputs concatenated (the same input width, each
        ``out_features`` a multiple of ``INT4_PACK_ROWS``)."""
        return cls(torch.cat([layer.weight for layer in layers]),
                   torch.cat([layer.scales_and_zeros for layer in layers], dim=1), cat_biases(layers))

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations, scales and zeros, outputs)."""
        return self.scales_and_zeros.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()     # the kernel takes contiguous rows only
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, INT4_GROUP, self.scales_and_zeros)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Projections that read the same input, fused into one kernel call: fused name → the parts in order."""


def fuse_projections(lm: nn.Module, float_layers: bool = False) -> None:
    """In every block of ``lm`` replace the projections that read one input (``FUSED``) by one layer
    computing their concatenated outputs (``Attention.qkv_proj`` / ``MLP.gate_up_proj``), when all parts
    are quantized kernel layers of one kind that can be concatenated (``cat_rows``) or, with
    ``float_layers``, float ``nn.Linear`` layers of one dtype and device (``cat_linears``); mixed kinds
    (a GGUF file's mixed block types) stay apart. On the embedded model one call instead of three (two)
    saves ~20 µs per layer and step for the int4 / int8 kernels; in bf16 one matmul over the
    concatenated rows is 3-10% faster per graph call (docs/results.md, "Graph calls before / after
    fused float projections")."""
    for block in list(lm.modules()):
        for fused_name, names in FUSED.items():
            fused = _fused([getattr(block, name, None) for name in names], float_layers)
            if fused is None:
                continue
            setattr(block, fused_name, fused)
            for name in names:
                delattr(block, name)


def _fused(parts: list[nn.Module | None], float_layers: bool) -> nn.Module | None:
    """The one layer ``fuse_projections`` puts in place of ``parts``, or None where they stay apart."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts):
        return None
    if kind is nn.Linear:
        same = len({(p.weight.dtype, p.weight.device, p.in_features) for p in parts}) == 1
        return cat_linears(parts) if float_layers and same else None
    if kind is BlockLinear:
        return kind.cat_rows(parts) if len({p.layout for p in parts}) == 1 else None
    if kind not in (Int4Linear, Int8Linear):
        return None
    if kind is Int4Linear and any(p.out_features % INT4_PACK_ROWS for p in parts):
        return None
    return kind.cat_rows(parts)


def cat_linears(layers: list[nn.Linear]) -> nn.Linear:
    """One float layer whose output is the layers' outputs concatenated (the same input width, dtype and
    device); its weight is a new tensor, the layers' are left as they are."""
    return linear_of(torch.cat([layer.weight.detach() for layer in layers]), cat_biases(layers))


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` [out, in] (and ``bias`` [out]) as frozen Parameters, without
    allocating or initialising weights of its own."""
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def compute_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a linear layer (``nn.Linear`` or a quantized one) takes and returns: an ``nn.Linear``'s
    weight dtype, a quantized layer's ``dtype`` (its scales', not its integer codes')."""
    return layer.weight.dtype if isinstance(layer, nn.Linear) else layer.dtype


def computed_weight(layer: nn.Module) -> torch.Tensor:
    """The weight [N, K] a linear layer (``nn.Linear`` or a quantized one) computes with, in its compute
    dtype: an ``nn.Linear``'s own; a quantized layer's as its kernel applies it (its outputs for the
    identity matrix, less the bias)."""
    if isinstance(layer, nn.Linear):
        return layer.weight.detach()
    eye = torch.eye(layer.in_features, dtype=layer.dtype, device=next(layer.buffers()).device)
    out = layer(eye)
    return (out if getattr(layer, "bias", None) is None else out - layer.bias).t().contiguous()


def quantize_linears(lm: nn.Module, scheme: str | None, tp: TPGroup = TPGroup(), *,
                     names: Sequence[str] = PROJECTIONS, head_names: Sequence[str] = ("lm_head",)) -> nn.Module:
    """Replace the layers named ``names`` (default: the attention and MLP projections ``PROJECTIONS``
    of every decoder layer) of every submodule of ``lm`` (a ``DecoderLM``, an EAGLE draft, Medusa
    heads) with ``scheme``'s quantized ones, and the layers named ``head_names`` (output projections:
    default the ``lm_head``; Medusa's) with ``HEAD_SCHEMES[scheme]``'s, in place (a tied
    ``lm_head`` gets its own tensor; the embedding keeps its table). Layers sharing their
    weight and bias Parameters (tied Medusa projections) become one quantized module they all share.
    Layers already quantized (a GGUF file's own blocks, ``gguf_weights``) are left alone; ``"gguf"``
    quantizes nothing more: float tensors stay float. The loaders fuse projections afterwards
    (``quantize_and_fuse``), quantized and float alike."""
    if scheme is None or scheme == "gguf":
        return lm
    done: dict[tuple[int, int], nn.Module] = {}     # ids of a float layer's weight and bias -> quantized
    for block in list(lm.modules()):
        for name in (*names, *head_names):
            linear = getattr(block, name, None)
            if not isinstance(linear, nn.Linear):
                continue
            key = (id(linear.weight), id(linear.bias))
            if key not in done:
                layer_scheme = HEAD_SCHEMES[scheme] if name in head_names else scheme
                done[key] = _quantized(linear, layer_scheme, name in ROW_PARALLEL, tp)
            setattr(block, name, done[key])
    return lm


def quantize_and_fuse(lm: nn.Module, scheme: str | None, backend: str, tp: TPGroup = TPGroup()) -> None:
    """A loaded decoder's (target or EAGLE draft) projections as they run: ``quantize_linears`` with
    ``scheme``, then ``fuse_projections`` — quantized q/k/v and gate/up always, float ones on every backend
    but ``"neuron"`` (whose ranks re-read their shards by checkpoint name)."""
    quantize_linears(lm, scheme, tp)
    fuse_projections(lm, float_layers=backend != "neuron")


def _quantized(linear: nn.Linear, scheme: str, row_parallel: bool, tp: TPGroup) -> nn.Module:
    """``linear`` [N, K] quantized with ``scheme``; a row-parallel layer's int8 row maxima are
    all-reduced over the ranks (its rows are split along K at tp > 1)."""
    if scheme == "int4":     # groups lie within a row and a rank's K range: no cross-rank statistic
        return Int4Linear.from_linear(linear)
    if scheme == "q4_0":
        return quantize_q4_0(linear.weight).to_module(linear.weight.dtype, linear.bias)
    row_max = None
    if row_parallel and tp.size > 1:
        row_max = all_reduce_max(linear.weight.detach().float().abs().amax(dim=1), tp)
    return Int8Linear.from_linear(linear, row_max)
