"""Compiled graphs kept as files: ``torch.compile``'s ahead-of-time compilation of a graph module,
saved under ``$SPECDEC_CACHE/graphs`` and loaded by later processes without re-tracing.

Inductor's on-disk caches keep a graph's generated code, but every new process still re-runs Dynamo over
the graph's Python (the embedded model: ~13 s a graph on 2 cores). A saved graph (``aot_compile`` +
``save_compiled_function``) holds the traced bytecode and the compiled code; loading it takes about a
second. Compiling ahead of time also never runs the graph, so it leaves the KV cache alone: a first run can
generate eagerly and compile its graphs afterwards (``GraphCache.defer`` / ``compile_deferred``).

A file is named by a fingerprint of everything its code depends on: the graph module's structure
(every submodule's class and attributes, every parameter's and buffer's shape, dtype and stride; the
values of plain tensor attributes), the batch size, the intra-op thread count (Inductor's CPU kernels are
specialised on it), the torch version and the source of the ``specdec`` package. Weights are not in the
file: the module is handed to the loaded code (``external_data``), so one file serves every checkpoint
of the same architecture and format. A graph whose structure holds an object that cannot be named
across processes (its fingerprint would hold a memory address) is compiled but not saved.

Guards: the saved code checks none (``skip_all_guards_unsafe``; the runtime passes fixed shapes by
construction, as ``COMPILE_OPTIONS``' dropped size asserts already assume). Compile under
``torch.no_grad()`` (the runtime never differentiates a graph).
"""
from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
from torch import nn

from .graphs import attribute_key, configure_compile_cache, own_frame, unguarded_options


@cache
def source_digest() -> str:
    """SHA-256 over the ``specdec`` package's Python sources (any change compiles graphs anew)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fingerprint(graph: nn.Module, batch_size: int) -> str | None:
    """The name of ``graph``'s saved file at ``batch_size`` rows; None when an attribute has no name
    that holds across processes (its repr shows a memory address)."""
    parts = [torch.__version__, source_digest(), str(batch_size), str(torch.get_num_threads())]
    for name, module in graph.named_modules():
        tensors = {**module._parameters, **module._buffers}
        parts.append(repr((name, type(module).__qualname__,
                           sorted((k, tuple(t.shape), str(t.dtype), t.stride()) for k, t in tensors.items()
                                  if t is not None),
                           sorted((k, attribute_key(v, across_processes=True)) for k, v in vars(module).items()
                                  if not k.startswith("_") and k != "training"))))
    text = "\n".join(parts)
    if " at 0x" in text:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def graphs_dir() -> Path:
    """Where saved graphs live: ``$SPECDEC_CACHE/graphs``."""
    from .cache_files import cache_dir
    return cache_dir() / "graphs"


def saved_path(graph: nn.Module, batch_size: int) -> Path | None:
    """The file ``graph`` is saved in (None: not savable, see ``fingerprint``)."""
    name = fingerprint(graph, batch_size)
    return None if name is None else graphs_dir() / f"{name}.bin"


def is_saved(graph: nn.Module, batch_size: int) -> bool:
    """Whether a later ``load_or_compile`` of ``graph`` loads it instead of compiling."""
    path = saved_path(graph, batch_size)
    return path is not None and path.is_file()


def load_or_compile(graph: nn.Module, batch_size: int) -> Callable:
    """A callable running ``graph`` (a graph module with ``example_inputs(batch_size)``): loaded from its
    file, or compiled ahead of time (without running it) and saved. An unreadable file (another torch
    build, a torn write) is compiled again and replaced."""
    path = saved_path(graph, batch_size)
    if path is not None and path.is_file():
        try:
            with open(path, "rb") as f:
                return torch.compiler.load_compiled_function(f, external_data={"graph": graph})
        except Exception as e:   # noqa: BLE001 — any failure to load means: compile it again
            print(f"specdec: warning: cannot load the saved graph {path.name} ({type(e).__name__}: {e}); "
                  "compiling it again", file=sys.stderr)
    configure_compile_cache()
    with torch.no_grad():
        compiled = torch.compile(own_frame(graph), fullgraph=True, dynamic=False, options=unguarded_options())
        compiled = compiled.aot_compile((graph.example_inputs(batch_size), {}))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        compiled.save_compiled_function(str(path), external_data={"graph": graph})   # atomic (rename)
    return compiled
