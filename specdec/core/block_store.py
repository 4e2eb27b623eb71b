"""A GGUF file's kernel-ready layers kept on disk: the ``BlockLinear`` buffers that decoding the file's blocks and
packing them (``gguf_weights``, ``kernels.layout``) produce — about 15 s for the 1.5B on 2 cores — written once per
(file, what is kept) under ``$SPECDEC_CACHE/blocks`` and read back by later loads in about a second.

A stored file is a safetensors file named ``<file stem>-<SHA-256 prefix>-<key>.safetensors`` (``key``: the
scheme and whether the LM head is kept). Per layer name it holds the tensors ``<name>.qs``, ``.d``, ``.dmin``,
``.sc`` and ``.mn``; its metadata holds ``FORMAT`` and, per name, the layer's out features and ``Layout`` (JSON).

Invariants: a stored file exists only complete (written to a temporary file in the same directory, then renamed);
one of another ``FORMAT`` — raised whenever the packed layout, ``Layout``, the block decoding or what a scheme keeps
(``gguf_weights.KEEP``, its re-quantization) change — or one that does not read is rebuilt, never used; a store
that cannot be written (a full disk) leaves the load as it was, with the layers built from the file.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .block_linear import BlockLinear
from .cache_files import cache_dir, file_sha256, write_atomic
from .huge_pages import HUGE_PAGE
from .kernels.layout import Layout

FORMAT = "2"


def store_dir() -> Path:
    return cache_dir() / "blocks"


def store_path(gguf: Path, key: str) -> Path:
    """Where the layers of ``gguf`` kept as ``key`` are stored."""
    return store_dir() / f"{gguf.stem}-{file_sha256(gguf, progress=False)[:16]}-{key}.safetensors"


def _read(path: Path) -> dict[str, BlockLinear] | None:
    """The stored layers (f32, no bias); None when ``path`` is missing, unreadable or of another format."""
    if not path.is_file():
        return None
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                return None
            return {name: BlockLinear(*(_owned(f.get_tensor(f"{name}.{b}")) for b in BlockLinear.BUFFERS),
                                      spec["out_features"], Layout(**spec["layout"]), None, torch.float32)
                    for name, spec in json.loads(meta["layers"]).items()}
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return None


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A tensor read from a stored file (its pages, memory-mapped) in memory of its own when it is smaller than a huge
    page: ``move_to_huge_pages`` moves only larger ones, and one small tensor left on the file would keep the whole
    file mapped, with every page the load read, for the model's lifetime."""
    return t.clone() if t.untyped_storage().nbytes() < HUGE_PAGE else t


def _write(path: Path, layers: dict[str, BlockLinear]) -> None:
    """Store ``layers`` at ``path`` atomically; a warning (not an error) when it cannot."""
    tensors = {f"{name}.{b}": t for name, layer in layers.items() for b, t in zip(BlockLinear.BUFFERS, layer.blocks())}
    specs = {name: {"out_features": layer.out_features, "layout": asdict(layer.layout)}
             for name, layer in layers.items()}
    metadata = {"format": FORMAT, "layers": json.dumps(specs)}
    try:
        write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    except OSError as e:
        print(f"specdec: could not keep the packed blocks at {path} ({e}); the next load packs them again",
              file=sys.stderr)


def stored_layers(gguf: Path, key: str, build: Callable[[], dict[str, BlockLinear]]) -> dict[str, BlockLinear]:
    """The layers of ``gguf`` kept as ``key`` (name → ``BlockLinear`` in f32 without bias): read from the store,
    or ``build()`` and stored for the next load."""
    path = store_path(Path(gguf), key)
    layers = _read(path)
    if layers is None:
        layers = build()
        _write(path, layers)
    return layers
