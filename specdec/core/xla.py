"""The ``xla`` backend: graphs traced by PyTorch/XLA's lazy tensors and compiled by XLA, on any
PJRT device (``PJRT_DEVICE=CPU`` for XLA:CPU, the one this project tests on).

A graph is any ``nn.Module`` whose forward takes fixed-shape tensors on the XLA device and may update
its buffers in place (the KV caches). ``build_xla_graph`` wraps it in ``torch_xla.compile(...,
full_graph=True)``: a call flushes pending lazy work, traces the forward into one XLA graph — a host
read inside it (``.item()``, ``.cpu()``) is an error, not a silent second graph — and executes it.
XLA caches the compiled program by the graph's hash, so a graph compiles on its first call only;
``max_different_graphs=1`` makes a second, different trace of the same module (a shape or a Python
value that changed) an error instead of a silent recompilation. Buffers updated in place are graph
outputs aliased to their inputs (``input_output_alias`` in the HLO): the KV cache is updated where it
lies, not copied. Compiled programs live in the process only: PyTorch/XLA's persistent cache
(``torch_xla.runtime.initialize_cache``) cannot reload programs on XLA:CPU (2.9: "Deserializing
serialized executable not supported"), so every process compiles its graphs once.

Installing: ``pip install "specdec[xla]"`` (``torch==2.9.0``, ``torch-xla==2.9.0``, the newest pair on
PyPI; the ``.ci/run`` script builds this environment as ``.venv-xla``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

INSTALL = ('backend="xla" needs torch_xla: pip install "specdec[xla]" (torch==2.9.0 with torch-xla==2.9.0; '
           'PJRT_DEVICE=CPU runs it on the CPU)')


def import_torch_xla():
    """The ``torch_xla`` module, or ImportError saying how to install it."""
    try:
        import torch_xla
    except ImportError as e:
        raise ImportError(INSTALL) from e
    return torch_xla


def xla_device() -> torch.device:
    """The default XLA device of this process (``xla:0``)."""
    return import_torch_xla().device()


def build_xla_graph(module: nn.Module, name: str) -> Callable[..., object]:
    """``module`` compiled as one XLA graph: call it with tensors on the XLA device (same shapes every
    call); it returns the forward's outputs as materialised device tensors. ``name`` labels the graph
    in PyTorch/XLA's debug output (``PT_XLA_DEBUG_LEVEL``).

    Each input is passed as a fresh tensor (a clone, materialised by the flush before the trace): a
    view such as ``arange(n).expand(b, n)`` would otherwise be traced as the ops that make it, a
    different graph from the one a plain tensor of the same shape gives. So a graph updates its buffers
    (the state), never its inputs: an in-place update of an input would land on the copy."""
    compiled = import_torch_xla().compile(module, full_graph=True, name=name, max_different_graphs=1)

    def run(*inputs: torch.Tensor):
        return compiled(*(t.clone() for t in inputs))
    return run


def materialize() -> None:
    """Run the pending lazy work (a model's weights and caches just written to the device), so it is
    not folded into the first graph's trace."""
    import_torch_xla().sync()
