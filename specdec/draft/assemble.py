"""Assemble a loadable draft checkpoint directory from a "ship" directory and the target.

A ship directory holds only what cannot be recomputed from the target: ``config.json`` (the draft's
Llama config with ``draft_vocab_size``) and ``draft.safetensors`` (decoder layers + final norm,
``output_token_ids``). ``assemble`` adds the target's input embedding, the target's embedding / LM-head
rows of ``output_token_ids`` as ``lm_head.weight`` and the target's tokenizer files, and writes a full
checkpoint directory ``DecoderModel.from_pretrained`` loads (``specdec.tools.train.export`` writes ship
directories).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..core.checkpoint import embedding_and_lm_head

SHIP_WEIGHTS = "draft.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def assemble(ship_dir: str | Path, target_dir: str | Path, out_dir: str | Path) -> Path:
    """Full draft checkpoint in ``out_dir`` (once; an existing finished one is reused): the shipped
    tensors + the target's embedding, lm_head rows and tokenizer files."""
    ship_dir, target_dir, out_dir = Path(ship_dir), Path(target_dir), Path(out_dir)
    if (out_dir / "model.safetensors").is_file() and (out_dir / "config.json").is_file():
        return out_dir
    tensors = load_file(ship_dir / SHIP_WEIGHTS)
    cfg = json.loads((ship_dir / "config.json").read_text())
    target_cfg = json.loads((target_dir / "config.json").read_text())
    for key in ("vocab_size", "hidden_size"):
        if cfg[key] != target_cfg[key]:
            raise ValueError(f"draft {key}={cfg[key]} does not match the target's {target_cfg[key]} ({target_dir})")
    embed, head = embedding_and_lm_head(target_dir)
    if embed is None:
        raise KeyError(f"{target_dir} has no model.embed_tokens.weight")
    dtype = tensors["model.norm.weight"].dtype
    tensors["model.embed_tokens.weight"] = embed.to(dtype).contiguous()
    tensors["lm_head.weight"] = head[tensors["output_token_ids"]].to(dtype).contiguous()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, tmp / name)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return out_dir
