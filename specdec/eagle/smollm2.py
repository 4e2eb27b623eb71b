"""The trained EAGLE draft for the embedded SmolLM2-135M-Instruct.

specdec ships the draft in the specdec-assets distribution (``assets/specdec_assets/eagle/smollm2-135m-instruct/``)
either in the public EAGLE-1 layout (``fc``, ``layers.0`` with its input norm, the reduced vocabulary's
``output_token_ids``, config.json; no embedding, no LM head) or in the public EAGLE-3 layout with its matrices
packed as int8 with per-row scales (``specdec.core.ship``; the draft's own LM head makes a bf16 file too large to
ship).
``embedded_eagle_path()`` writes a loadable checkpoint once into ``$SPECDEC_CACHE/eagle/``: packed
matrices expanded to bf16, and for EAGLE-1 the target's LM-head rows added with ``copy_lm_head`` (the
NxD Inference layout); the embedding is shared with the target at load time.

Reproduce the shipped weights with ``specdec train-eagle`` (see ``specdec.tools.train.eagle_cli``).
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..core.cache_files import cache_dir
from ..core.paths import resolve_model_path
from ..core.ship import is_packed, unpack_int8
from ..speculation.assets import asset_path
from .checkpoint import copy_lm_head, tensor_names


def shipped_eagle_dir() -> Path:
    """The shipped EAGLE-1 head's directory (in the installed specdec-assets distribution)."""
    return asset_path("eagle", "smollm2-135m-instruct")


def shipped_eagle3_dir() -> Path:
    """The shipped EAGLE-3 head's directory (in the installed specdec-assets distribution)."""
    return asset_path("eagle", "smollm2-135m-instruct-eagle3")


def embedded_eagle_path(ship_dir: str | Path | None = None) -> Path:
    """A loadable EAGLE checkpoint directory for the embedded model, written once into the cache from
    ``ship_dir`` (default: the shipped head): packed int8 matrices expanded to the config's dtype, the
    target's LM-head rows added when the draft has no LM head."""
    ship_dir = Path(ship_dir) if ship_dir is not None else shipped_eagle_dir()
    weights = ship_dir / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"no EAGLE weights at {weights}; "
                                f"train them with `specdec train-eagle --ship {ship_dir}`")
    names = tensor_names(ship_dir)
    if not is_packed(names) and "lm_head.weight" in names:
        return ship_dir   # loadable as it is
    digest = hashlib.sha256(weights.read_bytes() + (ship_dir / "config.json").read_bytes()).hexdigest()[:16]
    out = cache_dir() / "eagle" / f"smollm2-135m-instruct-{digest}"
    if not (out / "model.safetensors").is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if is_packed(names):
            tmp.mkdir(parents=True)
            dtype = getattr(torch, json.loads((ship_dir / "config.json").read_text()).get("dtype", "bfloat16"))
            save_file(unpack_int8(load_file(weights), dtype), tmp / "model.safetensors", metadata={"format": "pt"})
            shutil.copy(ship_dir / "config.json", tmp / "config.json")
        if "lm_head.weight" not in names:
            copy_lm_head(tmp if tmp.is_dir() else ship_dir, resolve_model_path(None), tmp)
        tmp.replace(out)
    return out
