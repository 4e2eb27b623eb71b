"""The Medusa heads trained for the embedded SmolLM2-135M-Instruct.

Shipped in ``specdec/medusa/weights/smollm2-135m-instruct/`` in the FasterDecoding/Medusa layout with
tied projections (``medusa_tied_lm_head``: the ResBlocks and the reduced vocabulary's ``token_ids``;
the projection is the target's LM head, taken at load time) and the tree built from the heads'
measured accuracy (``medusa_tree``). Reproduce with ``specdec train-medusa`` (``specdec.train.medusa_cli``).
"""
from __future__ import annotations

from pathlib import Path

SHIPPED_MEDUSA = Path(__file__).parent / "weights" / "smollm2-135m-instruct"
