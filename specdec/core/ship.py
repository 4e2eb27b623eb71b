"""Compact storage for weights shipped inside the package: int8 matrices with per-row scales.

A packed safetensors file holds every 2-D floating tensor ``name`` [N, K] as int8 codes in [-127, 127]
plus ``name + SCALE_SUFFIX`` [N] f32 (symmetric per-row, ``quant.quantize_int8``); other tensors
(norms, token-id maps) are kept as they are. Unpacking gives ``codes * scale`` in the requested
dtype: the error per weight is at most half a step, max|row| / 254. The packed file is an internal
storage format, never loaded as a checkpoint: ``unpack_int8`` expands it once into an ordinary
checkpoint (e.g. ``specdec.eagle.smollm2.embedded_eagle_path``), which every loader reads.
"""
from __future__ import annotations

from collections.abc import Collection

import torch

from .quant import quantize_int8

SCALE_SUFFIX = "_scale"


def pack_int8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every 2-D floating tensor as int8 codes + ``<name>_scale`` [N] f32; the rest unchanged."""
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point() and t.dim() == 2:
            out[name], out[name + SCALE_SUFFIX] = quantize_int8(t)
        else:
            out[name] = t
    return out


def is_packed(names: Collection[str]) -> bool:
    """Whether a checkpoint with these tensor names (a state dict's keys, or the dict) is ``pack_int8``'s."""
    return any(name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in names for name in names)


def unpack_int8(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The inverse of ``pack_int8``: int8 tensors with a scale become ``codes * scale`` in ``dtype``."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in tensors:
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        out[name] = (t.float() * scale.float().unsqueeze(1)).to(dtype) if scale is not None else t
    return out
