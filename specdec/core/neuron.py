"""The ``neuron`` backend: graph modules traced and compiled ahead of time for AWS Neuron
(Inferentia2 / Trainium) with neuronx-distributed's ModelBuilder units, in the shape NxD Inference
builds a model:

    trace(NeuronGraph(graph, n), args=graph.example_inputs(B)) one HLO per graph key (bucket), for
                                                               every rank (SPMD; in NxDParallelState)
    compile(hlo, metaneff, key=...)                            neuronx-cc → one NEFF per key
    NxDModel(world_size).add(key, traced, compiled)            one executable holding every key
    set_weights([state dict per rank]); to_neuron()            weights and state loaded once, shared
    nxd(*inputs, model_name=key)                               a call names its key: graphs of equal
                                                               input shapes (KV buckets, greedy vs
                                                               sampling) are told apart by name
    save(path) / NxDModel.load(path)                           compiled artifacts without weights

Every key wraps the same decoder module, so the weights and the state (the KV caches) have the same
names in every graph and exist once on the device. The KV caches are state: while tracing, each
``Attention`` writes them out of place (``Attention.store`` with ``functional_state``), the form the
tracer turns into outputs aliased to their inputs, so a call updates the caches where they lie.

A graph module has the contract of ``graphs.StepGraph``: a forward over fixed-shape tensors that may
update buffers, and ``example_inputs(batch_size)``.

Tensor parallelism (``tp_degree > 1``), SPMD as NxD Inference runs it: one host process, ONE trace per
key for every rank. The decoder is built with ``parallel.spmd_group`` (rank 0's shapes, which every
rank shares), so its collectives are neuronx-distributed's (``reduce_from_tensor_model_parallel_region``
after the embedding, o_proj and down_proj; ``gather_from_tensor_model_parallel_region`` of the logits)
and its rank is the ``tp_rank`` parameter ([1] int32, as NxD's ``SPMDRank`` holds it), a weight like any
other. Tracing runs inside ``NxDParallelState(world_size=tp, tensor_model_parallel_size=tp)``; the
program is ``NxDModel(world_size=tp)``; ``set_weights`` gets one state dict per rank, rank r's holding
the shards ``parallel.shard_plan`` gives rank r and ``tp_rank = [r]`` (``DecoderModel.rank_weights``).

Nothing here has run on Neuron hardware or with the Neuron SDK installed: it is written against the
documented APIs (torch-neuronx, neuronx-distributed ModelBuilder V2); the tests check its calls to
them with a recording stand-in only.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from .model import Attention

INSTALL = ("backend='neuron' needs the AWS Neuron SDK (a Neuron instance: inf2 / trn1 / trn2), which is not "
           "on PyPI: pip install --extra-index-url https://pip.repos.neuron.amazonaws.com torch-neuronx "
           "neuronx-cc neuronx-distributed")
COMPILER_ARGS = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"   # ModelBuilder's default


# Tensor-parallel degrees per platform (Neuron docs: transformers-neuronx developer guide
# "Tensor-parallelism support", NxD Inference, Trn2 LNC pages); ``specdec.tools.plan`` reports the same lists.
TP_DEGREES: dict[tuple[str, int], tuple[int, ...]] = {
    ("inf2", 1): (1, 2, 4, 8, 24),
    ("trn1", 1): (1, 2, 8, 16, 32),
    ("trn2", 2): (1, 2, 4, 8, 16, 32, 64),
    ("trn2", 1): (1, 2, 4, 8, 16, 32, 64, 128),
}


def check_tp_degree(tp_degree: int) -> None:
    """ValueError unless some Neuron platform supports ``tp_degree`` (the platform itself is known only
    on the instance; ``specdec plan`` checks a given one)."""
    if not any(tp_degree in degrees for degrees in TP_DEGREES.values()):
        lists = "; ".join(f"{family}{' (LNC=1)' if family == 'trn2' and lnc == 1 else ''}: "
                          f"{', '.join(map(str, d))}" for (family, lnc), d in TP_DEGREES.items())
        raise ValueError(f"backend='neuron' does not support tp_degree={tp_degree}: no Neuron platform runs it. "
                         f"Supported degrees — {lists}")


def import_sdk():
    """neuronx-distributed's ModelBuilder units (``trace``, ``compile``, ``NxDModel``) and its
    ``NxDParallelState``, or one ImportError saying how to install the SDK."""
    try:
        import torch_neuronx  # noqa: F401  (the XLA device and neuronx-cc bindings the units use)
        from neuronx_distributed import NxDModel, NxDParallelState
        from neuronx_distributed.trace.model_builder import compile as nxd_compile
        from neuronx_distributed.trace.model_builder import trace as nxd_trace
    except ImportError as e:
        raise ImportError(INSTALL) from e
    return nxd_trace, nxd_compile, NxDModel, NxDParallelState


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
    state dict (parameters — at tp_degree > 1 the rank ``tp_rank`` too —, persistent buffers) and the
    non-persistent buffers that are not state (RoPE frequencies); the KV caches are state, which the
    program zero-initialises on the device."""
    state = {id(b) for a in graph.modules() if isinstance(a, Attention) for b in a.cache_buffers()}
    weights = dict(graph.state_dict())
    weights |= {name: b for name, b in graph.named_buffers() if id(b) not in state and name not in weights}
    return {f"graph.{name}": t.detach().contiguous() for name, t in weights.items()}


class NeuronProgram:
    """One ``NxDModel`` over ``tp_degree`` NeuronCores holding a compiled graph per key (``add``: one
    SPMD trace serves every rank), started with the weights, one state dict per rank (``start``);
    ``runner(key)`` calls one graph by name. Graphs that share state (a model's KV caches) must be keys
    of one program: state is per program."""

    def __init__(self, nxd, keys: list[str] | None = None, compiler_workdir: str | Path | None = None,
                 compiler_args: str = COMPILER_ARGS, tp_degree: int = 1):
        self.nxd, self.keys, self.tp_degree = nxd, list(keys or []), tp_degree
        self.workdir = None if compiler_workdir is None else str(compiler_workdir)
        self.compiler_args = compiler_args

    @classmethod
    def create(cls, tp_degree: int = 1, compiler_workdir: str | Path | None = None,
               compiler_args: str = COMPILER_ARGS) -> NeuronProgram:
        """An empty program for ``tp_degree`` NeuronCores."""
        check_tp_degree(tp_degree)
        nxd_model = import_sdk()[2]
        return cls(nxd_model(world_size=tp_degree), None, compiler_workdir, compiler_args, tp_degree)

    @classmethod
    def load(cls, path: str | Path, keys: list[str], tp_degree: int = 1) -> NeuronProgram:
        """A program ``save`` wrote (``keys``: its graph names); ``start`` it with the weights."""
        nxd_model = import_sdk()[2]
        return cls(nxd_model.load(str(path)), keys, tp_degree=tp_degree)

    def add(self, key: str, graph: nn.Module, batch_size: int) -> None:
        """Trace ``graph`` on its example inputs (in neuronx-distributed's parallel state for
        ``tp_degree`` ranks) and compile it as ``key``."""
        nxd_trace, nxd_compile, _, parallel_state = import_sdk()
        inputs = graph.example_inputs(batch_size)
        wrapped = NeuronGraph(graph, len(inputs))
        state = (parallel_state(world_size=self.tp_degree, tensor_model_parallel_size=self.tp_degree)
                 if self.tp_degree > 1 else nullcontext())
        with wrapped.tracing(), state:
            traced = nxd_trace(wrapped, args=inputs)
        compiled = nxd_compile(traced.hlo, traced.metaneff, compiler_workdir=self.workdir,
                               compiler_args=self.compiler_args, key=key)
        self.nxd.add(key, traced, compiled)
        self.keys.append(key)

    def start(self, weights: list[dict[str, torch.Tensor]]) -> None:
        """Load ``weights`` (per rank: ``neuron_weights`` of any key's graph, one copy for all keys) and
        the zeroed state onto the NeuronCores."""
        if len(weights) != self.tp_degree:
            raise ValueError(f"a program for tp_degree={self.tp_degree} needs one state dict per rank, "
                             f"got {len(weights)}")
        self.nxd.set_weights(list(weights))
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
    program.start([neuron_weights(graph)])
    return program.runner(name)
