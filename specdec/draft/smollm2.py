"""The trained draft for the embedded SmolLM2-135M-Instruct.

specdec ships only the draft's own tensors, in the specdec-assets distribution
(``assets/specdec_assets/draft/smollm2-135m-instruct/``: decoder layers + final norm in bf16, the reduced
vocabulary's ``output_token_ids``, config.json); the input embedding and the LM head rows come from the
target. ``embedded_draft_path()`` assembles a full checkpoint directory once, in ``$SPECDEC_CACHE/drafts/``, and
``specdec.shipped("model", target)`` loads it.

Reproduce the shipped weights with ``specdec train-draft`` (see ``specdec.tools.train.cli``).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from ..core.cache_files import cache_dir
from ..core.paths import resolve_model_path
from ..speculation.assets import asset_path
from .assemble import SHIP_WEIGHTS, assemble


def shipped_draft_dir() -> Path:
    """The shipped draft's directory (in the installed specdec-assets distribution)."""
    return asset_path("draft", "smollm2-135m-instruct")


def embedded_draft_path(ship_dir: str | Path | None = None) -> Path:
    """A loadable checkpoint directory of the draft for the embedded model (assembled once)."""
    ship_dir = Path(ship_dir) if ship_dir is not None else shipped_draft_dir()
    weights = ship_dir / SHIP_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"no draft weights at {weights}; "
                                f"train them with `specdec train-draft --ship {ship_dir}`")
    digest = hashlib.sha256(weights.read_bytes() + (ship_dir / "config.json").read_bytes()).hexdigest()[:16]
    target = resolve_model_path(None)
    return assemble(ship_dir, target, cache_dir() / "drafts" / f"smollm2-135m-instruct-{digest}")
