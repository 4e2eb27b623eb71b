"""The trained EAGLE draft for the embedded SmolLM2-135M-Instruct.

The package ships the draft in the public EAGLE-1 layout (``specdec/eagle/weights/smollm2-135m-instruct/``:
``fc``, ``layers.0`` with its input norm, the reduced vocabulary's ``output_token_ids``, config.json;
no embedding, no LM head). ``embedded_eagle_path()`` adds the target's LM-head rows once with
``copy_lm_head`` (the NxD Inference layout) into ``$SPECDEC_CACHE/eagle/``; the embedding is shared
with the target at load time.

Reproduce the shipped weights with ``specdec train-eagle`` (see ``specdec.train.eagle_cli``).
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from ..core.paths import cache_dir, resolve_model_path
from .checkpoint import copy_lm_head

SHIPPED_EAGLE = Path(__file__).parent / "weights" / "smollm2-135m-instruct"


def embedded_eagle_path(ship_dir: str | Path | None = None) -> Path:
    """A loadable EAGLE checkpoint directory for the embedded model (LM head added once)."""
    ship_dir = Path(ship_dir) if ship_dir is not None else SHIPPED_EAGLE
    weights = ship_dir / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"no EAGLE weights at {weights}; train them with `specdec train-eagle --ship {ship_dir}`")
    digest = hashlib.sha256(weights.read_bytes() + (ship_dir / "config.json").read_bytes()).hexdigest()[:16]
    out = cache_dir() / "eagle" / f"smollm2-135m-instruct-{digest}"
    if not (out / "model.safetensors").is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        copy_lm_head(ship_dir, resolve_model_path(None), tmp)
        tmp.replace(out)
    return out
