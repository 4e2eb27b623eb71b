"""Read Hugging Face checkpoints shard by shard into a preallocated module.

Layouts (first found wins): ``model.safetensors.index.json``, ``model.safetensors``,
``pytorch_model.bin.index.json``, ``pytorch_model.bin``. Each tensor is copied into the module's
own parameter and released, so peak memory is the model plus one shard (one tensor for safetensors).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

LAYOUTS = ("model.safetensors.index.json", "model.safetensors",
           "pytorch_model.bin.index.json", "pytorch_model.bin")


def checkpoint_shards(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory, in load order."""
    path = Path(path)
    for layout in LAYOUTS:
        f = path / layout
        if not f.is_file():
            continue
        if not layout.endswith(".index.json"):
            return [f]
        weight_map = json.loads(f.read_text())["weight_map"]
        shards = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise FileNotFoundError(f"{f} lists shard(s) that do not exist: {', '.join(missing)}")
        return shards
    raise FileNotFoundError(f"no weights in {path}: expected one of {', '.join(LAYOUTS)}")


def iter_tensors(shards: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time; a .bin shard is memory-mapped, not copied."""
    for shard in shards:
        if shard.suffix == ".safetensors":
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
            while state:
                yield state.popitem()
            del state


def load_weights(module: nn.Module, path: str | Path, progress: bool = True) -> None:
    """Copy a checkpoint into ``module``'s parameters (names = HF keys), casting to their dtype.

    Raises KeyError for missing tensors and ValueError for shape mismatches, naming the tensor.
    Unknown tensors (e.g. ``rotary_emb.inv_freq``) are ignored.
    """
    # tied weights appear once, under their first name; persistent buffers (e.g. a reduced
    # vocabulary's token ids) load like weights
    persistent = set(module.state_dict())
    params = dict(module.named_parameters())
    params.update((n, b) for n, b in module.named_buffers() if n in persistent)
    loaded: set[str] = set()
    shards = checkpoint_shards(path)
    with torch.no_grad(), tqdm(total=len(params), desc=f"loading {Path(path).name}", unit="tensor",
                               disable=not progress) as bar:
        for name, tensor in iter_tensors(shards):
            param = params.get(name)
            if param is None or name in loaded:
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"tensor {name!r} in {path} has shape {tuple(tensor.shape)}, "
                                 f"but the config implies {tuple(param.shape)}")
            param.copy_(tensor)
            loaded.add(name)
            bar.update()
    missing = sorted(set(params) - loaded)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise KeyError(f"checkpoint {path} is missing tensor(s): {', '.join(missing[:5])}{more}")
