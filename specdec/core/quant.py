"""Weight-only quantization of the decoder's linear layers.

``int8``: per-output-channel symmetric int8 (NxD Inference's ``quantization_type=
"per_channel_symmetric"``, transformers-neuronx's ``quant_dtype="s8"``): for row i of a weight W [N, K],

    scale_i = max_k |W_ik| / 127,   q_ik = round(W_ik / scale_i) in [-127, 127],   W_ik ≈ q_ik · scale_i

so the rounding error of every weight is at most scale_i / 2. ``y = x Wᵀ`` becomes
``(x qᵀ) · scale``: bf16 activations run PyTorch's CPU weight-only kernel
(``aten._weight_int8pack_mm``, reads int8 weights: a quarter of f32's bytes, half of bf16's); other
dtypes multiply by the int8 weights cast to the activation dtype (exact reference math, for tests).

Quantized: every attention and MLP projection (q, k, v, o, gate, up, down). Not quantized (as NxD's
defaults): embeddings, norms and the LM head. Under tensor parallelism each rank quantizes its own
shard; a row-parallel layer's rows are split along K, so their maxima are all-reduced over the ranks
first: a sharded model holds exactly the values of the unsharded one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import TPGroup, all_reduce_max

ALIASES = {"int8": "int8", "s8": "int8", "per_channel_symmetric": "int8", "int8_weight_only": "int8"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")     # sharded along K (their input dimension) at tp > 1


def parse_quantization(name: str | None) -> str | None:
    """The canonical scheme for ``name`` (None / "none": no quantization); ValueError otherwise."""
    if name is None or name == "none":
        return None
    if name in ALIASES:
        return ALIASES[name]
    if name in ("int4", "s4", "per_group_int4"):
        raise ValueError(f"quantization={name!r} is not implemented yet: use 'int8' or None")
    raise ValueError(f"quantization={name!r} is not supported: use None or 'int8' "
                     f"(aliases: {', '.join(a for a in ALIASES if a != 'int8')})")


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

    def dequantized(self) -> torch.Tensor:
        """The weight the layer computes with, [N, K] f32 (``q · scale``)."""
        return self.weight.float() * self.scale.float().unsqueeze(1)


def quantize_linears(lm: nn.Module, scheme: str | None, tp: TPGroup = TPGroup()) -> nn.Module:
    """Replace the attention and MLP projections (``PROJECTIONS``) of every decoder layer in ``lm``
    (a ``DecoderLM``, an EAGLE draft's layer) with quantized ones, in place."""
    if scheme is None:
        return lm
    for block in list(lm.modules()):
        for name in PROJECTIONS:
            linear = getattr(block, name, None)
            if not isinstance(linear, nn.Linear):
                continue
            row_max = None
            if name in ROW_PARALLEL and tp.size > 1:
                row_max = all_reduce_max(linear.weight.detach().float().abs().amax(dim=1), tp)
            setattr(block, name, Int8Linear.from_linear(linear, row_max))
    return lm
