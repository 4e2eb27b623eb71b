"""KV-cache quantization: keys and values stored in 8 bits, one f32 scale per (row, slot, KV head).

``kv_cache_dtype`` (vLLM's option of the same name; NxD Inference's ``kv_cache_quant=True`` is fp8):
``"int8"`` or ``"fp8_e4m3"`` (alias ``"fp8"``); None / ``"auto"`` keeps the cache in the compute dtype.
For one token's key (after RoPE) or value in one KV head, x [D]:

    scale = max_d |x_d| / QMAX                    (an all-zero vector gets scale 1: q = 0)
    int8:     q = clamp(round(x / scale), -127, 127) as int8               QMAX = 127
    fp8_e4m3: q = float8_e4m3fn(clamp(x / scale, ±448)), round to nearest  QMAX = 448 (largest finite)
    x̂ = q.float() · scale, then cast to the compute dtype before attention

Error bound per element of x̂ (in f32, before that cast):
    int8:     |x̂ − x| ≤ scale / 2
    fp8_e4m3: |x̂ − x| ≤ 2⁻⁴ · |x| + 2⁻¹⁰ · scale   (3 mantissa bits: half an ulp is 2⁻⁴ of the value for
              normal |x / scale| ≥ 2⁻⁶; below that the subnormal spacing 2⁻⁹ gives 2⁻¹⁰ · scale)

Storage: 1 byte per element plus 4 bytes (the scale) per (slot, head), for K and for V. Each vector is
quantized on its own, when it is written: a token's dequantized K/V do not depend on which graph
(context encoding, one-token step, multi-token verify) wrote it, nor on the other rows or ranks.
"""
from __future__ import annotations

import torch

STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
ALIASES = {"fp8": "fp8_e4m3"}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 4      # f32 scale per (slot, head)


def parse_kv_cache_dtype(name: str | None) -> str | None:
    """The canonical KV-cache dtype for ``name``: None (None / "auto": the compute dtype), "int8" or
    "fp8_e4m3" ("fp8" accepted); ValueError otherwise."""
    if name is None or name == "auto":
        return None
    name = ALIASES.get(name, name)
    if name in STORAGE:
        return name
    raise ValueError(f"kv_cache_dtype={name!r} is not supported: use None (or 'auto': the compute dtype), "
                     f"'int8' or 'fp8_e4m3' (alias 'fp8')")


def storage_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The torch dtype of a quantized cache ("int8" → int8, "fp8_e4m3" → float8_e4m3fn)."""
    return STORAGE[kv_cache_dtype]


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → (q [..., D] in ``dtype`` (int8 or float8_e4m3fn), scale [...] f32), one scale per
    vector over its last dimension (the module docstring's format)."""
    x32 = x.float()
    qmax = QMAX[dtype]
    amax = x32.abs().amax(-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = (x32 / scale.unsqueeze(-1)).clamp(-qmax, qmax)
    return (y.round() if dtype == torch.int8 else y).to(dtype), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] and scale [...] → x̂ [..., D] in ``dtype`` (``q.float() · scale``, then cast)."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def kv_cache_bytes(elems: int, head_dim: int, nbytes: int, kv_cache_dtype: str | None = None) -> int:
    """Bytes of ``elems`` cached K/V elements: ``nbytes`` each, or quantized 1 byte each plus a 4-byte
    scale per ``head_dim`` elements (one (slot, head) vector)."""
    if kv_cache_dtype is None:
        return elems * nbytes
    return elems + elems // head_dim * SCALE_BYTES
