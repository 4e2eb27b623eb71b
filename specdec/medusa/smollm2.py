"""The Medusa heads trained for the embedded SmolLM2-135M-Instruct.

Shipped in the specdec-assets distribution (``assets/specdec_assets/medusa/smollm2-135m-instruct/``) in the
FasterDecoding/Medusa layout with tied projections (``medusa_tied_lm_head``: the ResBlocks and the reduced
vocabulary's ``token_ids``; the projection is the target's LM head, taken at load time) and the tree built from
the heads' measured accuracy (``medusa_tree``). Reproduce with ``specdec train-medusa``
(``specdec.tools.train.medusa_cli``).
"""
from __future__ import annotations

from pathlib import Path

from ..speculation.assets import asset_path


def shipped_medusa_dir() -> Path:
    """The shipped heads' directory (in the installed specdec-assets distribution)."""
    return asset_path("medusa", "smollm2-135m-instruct")
