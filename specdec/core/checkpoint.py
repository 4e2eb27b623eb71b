"""Read Hugging Face checkpoints shard by shard into a preallocated module.

Layouts (first found wins): ``model.safetensors.index.json``, ``model.safetensors``,
``pytorch_model.bin.index.json``, ``pytorch_model.bin``. Each tensor is copied into the module's
own parameter and released, so peak memory is the model plus one shard (one tensor for safetensors).

Tensor-parallel ranks load only their shards (``parallel.shard_plan``): safetensors are read with
``get_slice`` so the other ranks' rows are never materialised; ``.bin`` files are memory-mapped
and sliced. Padding rows/columns are zeros.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from itertools import groupby
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from .parallel import Shard

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


def iter_sources(shards: list[Path]) -> Iterator[tuple[str, object]]:
    """Yield (name, source) one at a time: a safetensors slice handle (nothing read yet) or a
    memory-mapped tensor of a .bin shard; both are indexed (``source[a:b]``) to read them."""
    for shard in shards:
        if shard.suffix == ".safetensors":
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name)
        else:
            state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
            while state:
                yield state.popitem()
            del state


def iter_tensors(shards: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, each read in full."""
    for name, source in iter_sources(shards):
        yield name, source[...]


def mapped_tensor(path: str | Path, name: str) -> torch.Tensor | None:
    """Tensor ``name`` of the safetensors checkpoint at ``path`` on the file's own pages (memory-mapped, private: no
    byte is read until used, and writes would stay in this process), or None where no safetensors shard holds it."""
    for shard in checkpoint_shards(path):
        if shard.suffix == ".safetensors":
            with safe_open(shard, framework="pt") as f:
                if name in f.keys():
                    return f.get_tensor(name)
    return None


def embedding_and_lm_head(path: str | Path) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(``model.embed_tokens.weight``, LM head) of a checkpoint, as stored, reading only those two
    tensors; the head is the embedding when config.json ties them or no ``lm_head.weight`` exists.
    None where absent."""
    path = Path(path)
    config = path / "config.json"
    tied = config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
    embed = head = None
    for name, source in iter_sources(checkpoint_shards(path)):
        if name == "model.embed_tokens.weight":
            embed = source[...]
        elif name == "lm_head.weight":
            head = source[...]
    return embed, embed if head is None or tied else head


def target_lm_head(target_dir: str | Path) -> torch.Tensor:
    """The target's LM head [V, H] as stored (its embedding when the weights are tied)."""
    _, head = embedding_and_lm_head(target_dir)
    if head is None:
        raise KeyError(f"target checkpoint {target_dir} has neither lm_head.weight nor (tied) "
                       "model.embed_tokens.weight")
    return head


def source_shape(source) -> tuple[int, ...]:
    return tuple(source.get_shape() if hasattr(source, "get_shape") else source.shape)


def copy_shard(param: torch.Tensor, source, shard: Shard | None) -> None:
    """Copy ``source`` (or only the rows ``shard`` names, one read per contiguous run) into ``param``."""
    if shard is None:
        param.copy_(source[...])
        return
    param.zero_()
    # consecutive source rows have a constant (source - param) row offset: one slice per run
    for offset, run in groupby(enumerate(shard.index), key=lambda p: p[1] - p[0] if p[1] >= 0 else None):
        if offset is None:        # padding rows stay zero
            continue
        rows = [i for i, _ in run]
        start, stop = rows[0] + offset, rows[-1] + offset + 1
        part = source[start:stop] if shard.dim == 0 else source[:, start:stop]
        param.narrow(shard.dim, rows[0], len(rows)).copy_(part)


def load_weights(module: nn.Module, path: str | Path, progress: bool = True,
                 shards: dict[str, Shard] | None = None, rename: Callable[[str], str] | None = None,
                 optional: frozenset[str] = frozenset(), skip: frozenset[str] = frozenset()) -> None:
    """Copy a checkpoint into ``module``'s parameters (names = HF keys, or ``rename(key)``), casting
    to their dtype; tensors named in ``shards`` are loaded partially (tensor parallelism); those named in
    ``skip`` already hold their values (a GGUF file's blocks, a mapped table) and are neither read nor written.

    Raises KeyError for missing tensors (except those in ``optional``, left as they are) and
    ValueError for shape mismatches, naming the tensor. Unknown tensors (e.g.
    ``rotary_emb.inv_freq``) are ignored.
    """
    shards = shards or {}
    # tied weights appear once, under their first name; persistent buffers (e.g. a reduced
    # vocabulary's token ids) load like weights
    persistent = set(module.state_dict())
    params = dict(module.named_parameters())
    params.update((n, b) for n, b in module.named_buffers() if n in persistent)
    params = {n: t for n, t in params.items() if n not in skip}
    loaded: set[str] = set()
    with torch.no_grad(), tqdm(total=len(params), desc=f"loading {Path(path).name}", unit="tensor",
                               disable=not progress) as bar:
        for name, source in iter_sources(checkpoint_shards(path)):
            name = rename(name) if rename else name
            param = params.get(name)
            if param is None or name in loaded:
                continue
            shard = shards.get(name)
            expected = list(param.shape)
            if shard is not None:
                expected[shard.dim] = shard.size
            if source_shape(source) != tuple(expected):
                raise ValueError(f"tensor {name!r} in {path} has shape {source_shape(source)}, "
                                 f"but the config implies {tuple(expected)}")
            copy_shard(param, source, shard)
            loaded.add(name)
            bar.update()
    missing = sorted(set(params) - loaded - optional)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise KeyError(f"checkpoint {path} is missing tensor(s): {', '.join(missing[:5])}{more}")
