"""Export a trained draft: a small "ship" directory holding only what cannot be recomputed from the
target (decoder layers, final norm, ``output_token_ids``, config); ``specdec.draft.assemble`` turns it
plus the target checkpoint into a full checkpoint directory ``DecoderModel.from_pretrained`` loads.

Ship directory: ``config.json`` (the draft's Llama config with ``draft_vocab_size``) and
``draft.safetensors`` (layers + norm in bf16 / f16, ``output_token_ids`` int64). The input
embedding is the target's and ``lm_head`` = the target's embedding (or LM head) rows of
``output_token_ids``, both frozen during training, so both are rebuilt by ``assemble``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ...draft.assemble import SHIP_WEIGHTS


def export_draft(ckpt_file: str | Path, ship_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the ship directory from a training checkpoint (``ckpt.pt``)."""
    ckpt = torch.load(ckpt_file, weights_only=False)
    ship_dir = Path(ship_dir)
    ship_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in ckpt["model"].items()}
    tensors["output_token_ids"] = ckpt["output_token_ids"].long().contiguous()
    cfg = dict(ckpt["draft_config"], dtype=str(dtype).removeprefix("torch."))
    meta = {"format": "pt", "step": str(ckpt["step"]), "spec": json.dumps(ckpt["spec"])}
    save_file(tensors, ship_dir / SHIP_WEIGHTS, metadata=meta)
    (ship_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return ship_dir
