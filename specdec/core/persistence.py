"""Persistence: a decoder's compiled state written to a directory and read back in a fresh process.

A saved directory holds ``specdec.json`` (rank 0: ``checkpoint``, the path weights reload from; ``settings``,
the ``RuntimeSettings`` as a dict; ``graphs``, the ``GraphKey`` fields of every graph built; ``compactions``, the
slots per row of every KV-compaction graph) and, ``compiled``: ``compile_cache.bin`` (one per rank at
tp_degree > 1: ``compile_cache.rank{r}.bin``), Inductor's cache artifacts; ``neuron``: ``neuron.pt``, the
compiled program (NEFFs, no weights). Weights are never saved: they are read from the checkpoint again.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .graph_cache import GraphCache, compaction_name
from .graphs import COMPILING, GraphKey, configure_compile_cache
from .parallel import TPGroup, barrier
from .sampling import SamplingConfig

META_FILE = "specdec.json"
NEURON_FILE = "neuron.pt"


class Saved(NamedTuple):
    """What ``specdec.json`` records: the checkpoint, ``from_pretrained`` keyword arguments (the runtime
    settings), the graph keys and the compaction graphs' slots per row."""

    checkpoint: str
    settings: dict[str, Any]
    keys: list[GraphKey]
    compaction_slots: list[int]


def save_compiled(graphs: GraphCache, source: str | Path, directory: str | Path) -> None:
    """Write the settings and the compiled graphs of ``graphs`` (a model loaded from ``source``) to
    ``directory``. At tp_degree > 1 every rank calls it: rank 0 writes the settings, each rank its
    artifacts; it returns once every rank has written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tp = graphs.lm.tp
    if tp.rank == 0:
        meta = {"checkpoint": str(Path(source).resolve()), "settings": asdict(graphs.settings),
                "graphs": [asdict(k) for k in graphs.built], "compactions": list(graphs.compactions)}
        (directory / META_FILE).write_text(json.dumps(meta, indent=2))
        if graphs.neuron is not None:
            graphs.neuron.save(directory / NEURON_FILE)
    if graphs.settings.backend in COMPILING:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is not None:
            _compile_cache_file(directory, tp).write_bytes(artifacts[0])
    barrier(tp)


def read_saved(directory: str | Path) -> Saved:
    """The record of a saved model; FileNotFoundError when ``directory`` holds none."""
    directory = Path(directory)
    meta_file = directory / META_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(f"{directory} holds no saved specdec model ({META_FILE} missing)")
    meta = json.loads(meta_file.read_text())
    s = meta["settings"]
    s["sampling"] = SamplingConfig(**s["sampling"])
    s["feature_layers"] = tuple(s.get("feature_layers", ()))
    return Saved(meta["checkpoint"], s, [GraphKey(**k) for k in meta["graphs"]], meta.get("compactions", []))


def load_compiled(graphs: GraphCache, directory: str | Path, keys: list[GraphKey], progress: bool,
                  compaction_slots: tuple[int, ...] | list[int] = ()) -> None:
    """Unpack the saved compile cache (if any) and warm ``keys`` from it (``neuron``: load the saved
    program with ``keys`` and the compaction graphs of ``compaction_slots``). Writes KV cache slots."""
    directory = Path(directory)
    if graphs.settings.backend == "neuron":
        from .neuron import NeuronProgram
        names = [k.describe() for k in keys] + [compaction_name(m) for m in compaction_slots]
        graphs.to_neuron(keys, compaction_slots, progress,
                         NeuronProgram.load(directory / NEURON_FILE, names, graphs.lm.tp.size))
        return
    cache = _compile_cache_file(directory, graphs.lm.tp)
    if cache.is_file():
        configure_compile_cache()  # unpack into the cache directory the graphs will read
        torch.compiler.load_cache_artifacts(cache.read_bytes())
    graphs.warm(keys, "loading graphs", progress)


def _compile_cache_file(directory: Path, tp: TPGroup) -> Path:
    return directory / ("compile_cache.bin" if tp.size == 1 else f"compile_cache.rank{tp.rank}.bin")
