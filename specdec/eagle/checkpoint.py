"""EAGLE draft checkpoints: the public layouts, and copying the target's LM head into a draft.

Layouts read (``config.json`` = a one-layer Llama config, weights in any ``core.checkpoint`` layout):
- EAGLE-1 (the public ``yuhuili/EAGLE-*`` repos): ``fc.weight`` [H, 2H], ``fc.bias`` [H] (optional),
  ``layers.0.*`` (no ``input_layernorm`` unless the draft was trained with one), optional
  ``embed_tokens.weight``, **no** ``lm_head.weight``;
- NxD Inference: the same plus ``lm_head.weight`` (the target's, copied in);
- EAGLE-3 (the public ``yuhuili/EAGLE3-*`` repos, as vLLM / SGLang read them): config.json with
  ``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size`` N, optional ``target_hidden_size``
  and ``eagle_config.eagle_aux_hidden_state_layer_ids`` (default (2, L//2, L-3) for an L-layer target);
  ``fc.weight`` [H, 3H] (no bias), ``midlayer.*`` (= our ``layers.0.*``: ``input_layernorm``,
  ``hidden_norm``, q/k/v [., 2H], ...), ``norm.weight``, ``lm_head.weight`` [N, H] (the draft's own),
  ``d2t`` [N] int64 (draft id i is target id i + d2t[i]), ``t2d`` [V] bool (the target ids in the
  draft vocabulary), usually no ``embed_tokens.weight`` (the target's is used).
Keys may carry a ``model.`` prefix (HF / NxD style); it is ignored. A reduced EAGLE-1 draft vocabulary
is ``draft_vocab_size`` N in config.json plus an ``output_token_ids`` [N] tensor; its ``lm_head.weight``
holds the target's LM-head rows of those tokens.

``copy_lm_head`` (CLI: ``specdec eagle-lm-head``) turns the first layout into the second.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..core.checkpoint import checkpoint_shards, iter_sources, iter_tensors, target_lm_head

LM_HEAD_COMMAND = "specdec eagle-lm-head --draft {draft} --target TARGET_CHECKPOINT"


EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def eagle_key(name: str) -> str:
    """Checkpoint key → parameter name of ``EagleLM`` / ``Eagle3LM`` (drops a leading ``model.``; EAGLE-3's
    ``midlayer.`` is ``layers.0.``)."""
    name = name.removeprefix("model.")
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def is_eagle3(config: dict, names: set[str]) -> bool:
    """Whether a draft checkpoint (raw config.json, normalised tensor names) is in the EAGLE-3 layout."""
    return EAGLE3_ARCHITECTURE in (config.get("architectures") or []) or "layers.0.hidden_norm.weight" in names


def aux_layer_ids(config: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 draft reads (``eagle_config.eagle_aux_hidden_state_layer_ids``, default
    (2, L//2, L-3) as vLLM / SGLang), checked against the target's L = ``target_layers``."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if target_layers < 7:     # fewer layers repeat one of them
            raise ValueError(f"the EAGLE-3 default aux layers (2, L//2, L-3) need a target of >= 7 layers, got "
                             f"{target_layers}: give eagle_config.eagle_aux_hidden_state_layer_ids in config.json")
        return 2, target_layers // 2, target_layers - 3
    bad = [i for i in ids if not 0 <= int(i) <= target_layers]
    if bad:
        raise ValueError(f"EAGLE-3 draft reads target layer(s) {bad} (eagle_aux_hidden_state_layer_ids {list(ids)}) "
                         f"but the target has {target_layers} layers: the draft was trained for another target")
    return tuple(int(i) for i in ids)


def eagle3_token_ids(path: Path, vocab_size: int, draft_vocab_size: int) -> torch.Tensor | None:
    """Target token ids [N] of an EAGLE-3 draft's vocabulary (``arange(N) + d2t``), checked against ``t2d``
    when present; None for a full-vocabulary draft without ``d2t``. ValueError / KeyError naming the
    problem."""
    tensors = {eagle_key(name): source for name, source in iter_sources(checkpoint_shards(path))
               if eagle_key(name) in ("d2t", "t2d")}
    if "d2t" not in tensors:
        if draft_vocab_size != vocab_size:
            raise KeyError(f"EAGLE-3 draft {path} has draft_vocab_size={draft_vocab_size} < vocab_size={vocab_size} "
                           "but no d2t tensor mapping its vocabulary to the target's")
        return None
    d2t = tensors["d2t"][...].long()
    if d2t.shape != (draft_vocab_size,):
        raise ValueError(f"d2t in {path} has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},) "
                         "(draft_vocab_size)")
    ids = torch.arange(draft_vocab_size) + d2t
    if bool((ids < 0).any()) or bool((ids >= vocab_size).any()) or ids.unique().numel() != draft_vocab_size:
        raise ValueError(f"d2t in {path} maps the draft vocabulary outside [0, {vocab_size}) or twice onto one token")
    if "t2d" in tensors:
        t2d = tensors["t2d"][...].bool()
        expected = torch.zeros(vocab_size, dtype=torch.bool)
        expected[ids] = True
        if t2d.shape != (vocab_size,) or not torch.equal(t2d, expected):
            raise ValueError(f"t2d in {path} does not mark exactly the target ids d2t maps to")
    return ids


def tensor_names(path: str | Path) -> set[str]:
    """The (normalised) tensor names of a checkpoint directory, without reading any tensor."""
    return {eagle_key(name) for name, _ in iter_sources(checkpoint_shards(path))}


def copy_lm_head(draft_dir: str | Path, target_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the draft with the target's LM head as ``lm_head.weight`` (NxD Inference layout).

    ``out_dir`` (default: ``draft_dir`` itself) gets ``config.json`` and ``model.safetensors``
    holding every draft tensor unchanged plus ``lm_head.weight`` copied bit-exactly (same dtype)
    from the target — all its rows, or the rows of ``output_token_ids`` for a reduced vocabulary.
    Raises ValueError when vocabulary or hidden sizes differ, KeyError when a tensor is missing.
    """
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    out_dir = Path(out_dir) if out_dir is not None else draft_dir
    cfg = json.loads((draft_dir / "config.json").read_text())
    target_cfg = json.loads((target_dir / "config.json").read_text())
    for key in ("vocab_size", "hidden_size"):
        if cfg.get(key) != target_cfg.get(key):
            raise ValueError(f"draft {key}={cfg.get(key)} ({draft_dir}) != target {key}={target_cfg.get(key)} "
                             f"({target_dir}): the LM head must come from the draft's own target")
    tensors = {eagle_key(name): t for name, t in iter_tensors(checkpoint_shards(draft_dir))}
    if "fc.weight" not in tensors:
        raise KeyError(f"{draft_dir} is not an EAGLE draft: it has no fc.weight")
    head = target_lm_head(target_dir)
    if tuple(head.shape) != (cfg["vocab_size"], cfg["hidden_size"]):
        raise ValueError(f"target LM head has shape {tuple(head.shape)}, expected "
                         f"({cfg['vocab_size']}, {cfg['hidden_size']}) from the configs")
    if cfg.get("draft_vocab_size"):
        ids = tensors.get("output_token_ids")
        if ids is None or ids.numel() != cfg["draft_vocab_size"]:
            raise KeyError(f"{draft_dir} declares draft_vocab_size={cfg['draft_vocab_size']} but has no matching "
                           "output_token_ids tensor")
        head = head[ids.long()]
    tensors["lm_head.weight"] = head.contiguous()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "model.safetensors.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    if out_dir != draft_dir:
        shutil.copy(draft_dir / "config.json", out_dir / "config.json")
    elif (draft_dir / "model.safetensors.index.json").is_file():
        (draft_dir / "model.safetensors.index.json").unlink()   # the single file written here replaces it
    tmp.replace(out_dir / "model.safetensors")
    return out_dir


def check_layout(path: Path, names: set[str], input_norm: bool) -> None:
    """Clear errors for a draft checkpoint that cannot be loaded as configured."""
    if "fc.weight" not in names:
        raise KeyError(f"{path} is not an EAGLE draft checkpoint: no fc.weight (found e.g. "
                       f"{', '.join(sorted(names)[:4])})")
    if "lm_head.weight" not in names:
        raise KeyError(f"EAGLE draft {path} has no lm_head.weight (public EAGLE-1 checkpoints leave it out): "
                       f"copy the target's with `{LM_HEAD_COMMAND.format(draft=path)}` "
                       "(or specdec.eagle.copy_lm_head)")
    has_norm = "layers.0.input_layernorm.weight" in names
    if has_norm and not input_norm:
        raise ValueError(f"{path} has layers.0.input_layernorm.weight: load it with eagle_input_norm=True")
