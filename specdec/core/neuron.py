"""The ``neuron`` backend: graph modules traced and compiled ahead of time for AWS Neuron
(Inferentia2 / Trainium) with neuronx-distributed's ModelBuilder units, in the shape NxD Inference
builds a model:

    trace(NeuronGraph(graph, n), args=graph.example_inputs(B)) one HLO per graph key (bucket)
    compile(hlo, metaneff, key=...)                            neuronx-cc → one NEFF per key
    NxDModel(world_size).add(key, traced, compiled)            one executable holding every key
    set_weights([state dict]); to_neuron()                     weights and state loaded once, shared
    nxd(*inputs, model_name=key)                               a call names its key: graphs of equal
                                                               input shapes (KV buckets, greedy vs
                                                               sampling) are told apart by name
    save(path) / NxDModel.load(path)                           compiled artifacts without weights

Every key wraps the same decoder module, so the weights and the state (the KV caches) have the same
names in every graph and exist once on the device. The KV caches are state: while tracing, each
``Attention`` writes them out of place (``Attention.store`` with ``functional_state``), the form the
tracer turns into outputs aliased to their inputs, so a call updates the caches where they lie.

A graph module has the contract of ``graphs.StepGraph``: a forward over fixed-shape tensors that may
update buffers, and ``example_inputs(batch_size)``. Tensor parallelism on Neuron needs
neuronx-distributed's parallel layers (``ColumnParallelLinear``, ``RowParallelLinear``,
``ParallelEmbedding``) and the rank as device data (``SPMDRank``) in place of this runtime's
``torch.distributed`` layers; that port is not written, so ``tp_degree`` must be 1 here.

Nothing here has run on Neuron hardware or with the Neuron SDK installed: it is written against the
documented APIs (torch-neuronx, neuronx-distributed ModelBuilder V2); the tests check its calls to
them with a recording stand-in only.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from .model import Attention

INSTALL = ("backend='neuron' needs the AWS Neuron SDK (a Neuron instance: inf2 / trn1 / trn2), which is not "
           "on PyPI: pip install --extra-index-url https://pip.repos.neuron.amazonaws.com torch-neuronx "
           "neuronx-cc neuronx-distributed")
COMPILER_ARGS = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"   # ModelBuilder's default


def import_sdk():
    """neuronx-distributed's ModelBuilder units (``trace``, ``compile``, ``NxDModel``), or one
    ImportError saying how to install the SDK."""
    try:
        import torch_neuronx  # noqa: F401  (the XLA device and neuronx-cc bindings the units use)
        from neuronx_distributed import NxDModel
        from neuronx_distributed.trace.model_builder import compile as nxd_compile
        from neuronx_distributed.trace.model_builder import trace as nxd_trace
    except ImportError as e:
        raise ImportError(INSTALL) from e
    return nxd_trace, nxd_compile, NxDModel


class NeuronGraph(nn.Module):
    """What is traced for one graph key: ``graph`` (e.g. a ``StepGraph``) called with ``n_inputs``
    tensors, whose KV caches are updated out of place while it is traced (``tracing``). Its parameter
    and buffer names are ``graph.<name>`` for every key, so keys built on one decoder share weights and
    state by name.

    The tracer takes a forward with explicitly named parameters (no ``*args``): the forward is an
    instance attribute whose signature names the inputs ``input0 .. input{n-1}``."""

    def __init__(self, graph: nn.Module, n_inputs: int):
        super().__init__()
        self.graph = graph
        names = [f"input{i}" for i in range(n_inputs)]

        def forward(*args: torch.Tensor, **kwargs: torch.Tensor):
            return graph(*args, *(kwargs[name] for name in names[len(args):]))
        forward.__signature__ = inspect.Signature(
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names])
        self.forward = forward

    @contextmanager
    def tracing(self) -> Iterator[None]:
        attentions = [m for m in self.graph.modules() if isinstance(m, Attention)]
        for a in attentions:
            a.functional_state = True
        try:
            yield
        finally:
            for a in attentions:
                del a.functional_state     # back to the class default (in place)


def neuron_weights(graph: nn.Module) -> dict[str, torch.Tensor]:
    """What ``set_weights`` loads for programs of ``graph`` (named as in ``NeuronGraph(graph, n)``): the
    state dict (parameters, persistent buffers) and the non-persistent buffers that are not state (RoPE
    frequencies); the KV caches are state, which the program zero-initialises on the device."""
    state = {id(b) for a in graph.modules() if isinstance(a, Attention) for b in a.cache_buffers()}
    weights = dict(graph.state_dict())
    weights |= {name: b for name, b in graph.named_buffers() if id(b) not in state and name not in weights}
    return {f"graph.{name}": t.detach().contiguous() for name, t in weights.items()}


class NeuronProgram:
    """One ``NxDModel`` holding a compiled graph per key (``add``), started with one copy of the
    weights (``start``); ``runner(key)`` calls one graph by name. Graphs that share state (a model's
    KV caches) must be keys of one program: state is per program."""

    def __init__(self, nxd, keys: list[str] | None = None, compiler_workdir: str | Path | None = None,
                 compiler_args: str = COMPILER_ARGS):
        self.nxd, self.keys = nxd, list(keys or [])
        self.workdir = None if compiler_workdir is None else str(compiler_workdir)
        self.compiler_args = compiler_args

    @classmethod
    def create(cls, tp_degree: int = 1, compiler_workdir: str | Path | None = None,
               compiler_args: str = COMPILER_ARGS) -> "NeuronProgram":
        """An empty program for ``tp_degree`` NeuronCores."""
        if tp_degree != 1:
            raise ValueError(f"backend='neuron' traces tp_degree=1 only (got {tp_degree}): sharding over "
                             "NeuronCores needs neuronx-distributed's parallel layers, not ported yet")
        _, _, nxd_model = import_sdk()
        return cls(nxd_model(world_size=tp_degree), None, compiler_workdir, compiler_args)

    @classmethod
    def load(cls, path: str | Path, keys: list[str]) -> "NeuronProgram":
        """A program ``save`` wrote (``keys``: its graph names); ``start`` it with the weights."""
        _, _, nxd_model = import_sdk()
        return cls(nxd_model.load(str(path)), keys)

    def add(self, key: str, graph: nn.Module, batch_size: int) -> None:
        """Trace ``graph`` on its example inputs and compile it as ``key``."""
        nxd_trace, nxd_compile, _ = import_sdk()
        inputs = graph.example_inputs(batch_size)
        wrapped = NeuronGraph(graph, len(inputs))
        with wrapped.tracing():
            traced = nxd_trace(wrapped, args=inputs)
        compiled = nxd_compile(traced.hlo_module, traced.metaneff, compiler_workdir=self.workdir,
                               compiler_args=self.compiler_args, key=key)
        self.nxd.add(key, traced, compiled)
        self.keys.append(key)

    def start(self, weights: dict[str, torch.Tensor]) -> None:
        """Load ``weights`` (``neuron_weights`` of any key's graph: one copy for all) and the zeroed state
        onto the NeuronCores."""
        self.nxd.set_weights([weights])
        self.nxd.to_neuron()

    def runner(self, key: str) -> Callable[..., object]:
        """A callable running graph ``key`` (inputs on the host, outputs as traced)."""
        if key not in self.keys:
            raise KeyError(f"graph {key!r} was not compiled for Neuron; compiled: {', '.join(self.keys)}")
        return lambda *inputs: self.nxd(*inputs, model_name=key)

    def save(self, path: str | Path) -> None:
        """The compiled graphs (NEFFs and their metadata, no weights) as one TorchScript file."""
        self.nxd.save(str(path))


def build_neuron_graph(graph: nn.Module, batch_size: int, name: str) -> Callable[..., object]:
    """One graph module compiled on its own: a program of one key with its own weights and state, for a
    graph that owns all the state it reads (``DecoderModel.to_neuron`` compiles a model's graphs into
    one program instead)."""
    program = NeuronProgram.create()
    program.add(name, graph, batch_size)
    program.start(neuron_weights(graph))
    return program.runner(name)
