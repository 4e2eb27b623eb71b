"""``GraphCache``: the graphs of one decoder on its backend, each built once.

It owns the step graphs by ``GraphKey`` (``built``: the callable each backend runs; ``ran``: the keys run at
least once, i.e. whose compiled code exists), the KV-compaction graphs by the number of slots m they move per
row (``compactions``), on ``neuron`` the one program holding all of them (``neuron``), and the seconds each
graph took to compile (``compile_seconds``, by ``GraphKey.describe()`` / compaction name).

With ``settings.saved_graphs`` (the ``compiled`` backend on the CPU, without autotune) a graph is compiled
ahead of time into a file and loaded from it by later processes (``saved_graphs``); its compilation can be
deferred (``defer``): a ``pending`` graph runs eagerly until ``compile_deferred`` builds it.

Invariants: ``ran`` ⊆ ``built``; ``pending`` ∩ ``built`` is empty; on ``neuron`` nothing is built lazily:
``built`` and ``compactions`` hold what ``to_neuron`` routed to the program. Running graphs writes the
decoder's KV cache; the caller (``DecoderModel``) owns the row lengths and resets them after ``warm`` /
``to_neuron``. Compiling ahead of time never writes it.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from .graphs import COMPILING, CacheCompaction, GraphKey, StepGraph, build_graph
from .loading import RuntimeSettings
from .model import DecoderLM
from .saved_graphs import load_or_compile


class GraphCache:
    """The graphs over ``lm`` for ``settings`` (backend, batch size, global top-k, autotune).
    ``rank_weights(graph)``: the per-rank weights a Neuron program of ``graph`` loads (``loading.rank_weights``)."""

    def __init__(self, lm: DecoderLM, settings: RuntimeSettings,
                 rank_weights: Callable[[torch.nn.Module], list[dict[str, torch.Tensor]]]):
        self.lm, self.settings, self.rank_weights = lm, settings, rank_weights
        self.built: dict[GraphKey, Callable] = {}
        self.ran: set[GraphKey] = set()
        self.compactions: dict[int, Callable] = {}
        self.neuron = None                     # backend 'neuron': the program holding every graph
        self.compile_seconds: dict[str, float] = {}
        self.pending: dict[GraphKey, StepGraph] = {}   # deferred (``defer``): the module run eagerly until compiled

    @property
    def saves_graphs(self) -> bool:
        """Whether graphs are compiled ahead of time into files (``saved_graphs``): ``settings.saved_graphs``
        on the ``compiled`` backend on the CPU without autotune."""
        s = self.settings
        return s.saved_graphs and s.backend == "compiled" and not s.autotune and torch.device(s.device).type == "cpu"

    def module(self, key: GraphKey) -> StepGraph:
        """The graph module of ``key`` (over the decoder): what every backend runs or traces."""
        return StepGraph(self.lm, key, self.settings.sampling.global_topk)

    def graph(self, key: GraphKey) -> Callable:
        """The callable for ``key``, built (and for ``compiled`` / ``xla``, traced on first call) once;
        ``neuron`` graphs exist only as ``to_neuron`` built them (ahead of time)."""
        if key in self.pending:
            return self.pending[key]
        if key not in self.built:
            if self.settings.backend == "neuron":
                raise ValueError(f"graph {key.describe()} was not compiled: backend='neuron' compiles ahead of "
                                 "time, so call to_neuron() with the shapes the run needs (spec_tokens, "
                                 "prompt_length, max_length, single_row, compaction_slots)")
            self.built[key] = self._build(self.module(key), key.describe())
        return self.built[key]

    def _build(self, module: torch.nn.Module, name: str) -> Callable:
        """``module`` on the backend: loaded or compiled ahead of time (``saves_graphs``), else ``build_graph``."""
        if self.saves_graphs:
            return load_or_compile(module, self.settings.batch_size)
        return build_graph(module, self.settings.backend, self.settings.batch_size, name,
                           autotune=self.settings.autotune)

    def defer(self, keys: list[GraphKey]) -> None:
        """Run ``keys`` eagerly until ``compile_deferred`` builds them (``saves_graphs`` only: the first run
        of a request answers at once, and the graphs compiled after it are saved for later runs)."""
        if not self.saves_graphs:
            raise ValueError("deferred compilation needs saved graphs: backend='compiled' on the CPU, "
                             "saved_graphs=True, autotune=False")
        self.pending.update({key: self.module(key) for key in keys
                             if key not in self.built and key not in self.pending})

    def compile_deferred(self, progress: bool) -> None:
        """Compile (ahead of time, saving each file) the graphs ``defer`` left to run eagerly, with a bar
        when ``progress``. Ctrl-C stops after the graphs saved so far (the rest run eagerly) and re-raises."""
        todo = list(self.pending)
        bar = tqdm(todo, desc="compiling for later runs (saved; Ctrl-C stops)", unit="graph",
                   disable=not progress or not todo or self.lm.tp.rank > 0)
        for key in bar:
            with self._timed(key):
                self.built[key] = self._build(self.pending[key], key.describe())
            del self.pending[key]

    def compaction(self, m: int) -> Callable:
        """The KV-compaction graph moving m slots per row, built once (``neuron``: by ``to_neuron``)."""
        if m not in self.compactions:
            if self.settings.backend == "neuron":
                raise ValueError(f"the KV-compaction graph for {m} slots was not compiled: call "
                                 f"to_neuron(compaction_slots=({m},), ...) (tree verification: the tree's depth)")
            self.compactions[m] = self._build(CacheCompaction(self.lm, m), compaction_name(m))
        return self.compactions[m]

    def clear(self) -> None:
        """Drop the step graphs (rebuilt on use), e.g. when the graph outputs change."""
        self.built.clear()
        self.ran.clear()

    def warm(self, keys: list[GraphKey], desc: str, progress: bool,
             compaction_slots: tuple[int, ...] | list[int] = ()) -> None:
        """Build each graph (and the compaction graphs of ``compaction_slots``) and run it once on
        example inputs (timed; writes KV cache slots). The bar counts the graphs whose compiled code came
        from the on-disk cache. ``neuron``: one program of all of them (``to_neuron``)."""
        if self.settings.backend == "neuron":
            self.to_neuron(keys, compaction_slots, progress)
            return
        cached = 0
        bar = tqdm(keys, desc=desc, unit="graph", disable=not progress or not keys or self.lm.tp.rank > 0)
        for key in bar:
            hits = _cache_hits()
            with self._timed(key), torch.no_grad():
                self.graph(key)(*StepGraph(self.lm, key, None).example_inputs(self.settings.batch_size))
            if self.settings.backend in COMPILING:
                cached += _cache_hits() > hits
                bar.set_postfix_str(f"{cached} from cache")
        for m in compaction_slots:
            with torch.no_grad():
                self.compaction(m)(*CacheCompaction(self.lm, m).example_inputs(self.settings.batch_size))

    def first_run(self, key: GraphKey, inputs: list[torch.Tensor], progress: bool,
                  graph: Callable[[GraphKey], Callable]):
        """Run a compiled graph that ``warm`` did not build, got through ``graph`` (the model's ``graph``):
        torch.compile generates (or loads from the on-disk cache) its code now, so say so (one line on
        stderr, when ``progress``) and time it."""
        if key in self.pending:    # deferred: eager until compile_deferred
            with torch.no_grad():
                return graph(key)(*inputs)
        say = progress and self.lm.tp.rank == 0
        if say:
            print(f"specdec: compiling graph {key.describe()} on first use (cached on disk for later runs; "
                  f"compile() builds graphs ahead of time) ...", end="", file=sys.stderr, flush=True)
        hits = _cache_hits()
        with self._timed(key), torch.no_grad():
            out = graph(key)(*inputs)
        if say:
            print(f" {self.compile_seconds[key.describe()]:.1f} s{' (from the cache)' if _cache_hits() > hits else ''}",
                  file=sys.stderr, flush=True)
        return out

    @contextmanager
    def _timed(self, key: GraphKey) -> Iterator[None]:
        """Around the first build / run of ``key``: its seconds into ``compile_seconds``, ``key`` into ``ran``."""
        start = time.perf_counter()
        yield
        self.compile_seconds[key.describe()] = time.perf_counter() - start
        self.ran.add(key)

    def to_neuron(self, keys: list[GraphKey], compaction_slots: tuple[int, ...] | list[int], progress: bool,
                  program=None) -> None:
        """Trace and compile ``keys`` and the compaction graphs into one Neuron program (or take
        ``program``, loaded from disk), load it with the decoder's weights and route the graphs to it."""
        from .neuron import NeuronProgram
        modules = {key.describe(): self.module(key) for key in keys}
        modules |= {compaction_name(m): CacheCompaction(self.lm, m) for m in compaction_slots}
        if program is None:
            program = NeuronProgram.create(self.lm.tp.size)
            for name, module in tqdm(modules.items(), desc="compiling (neuron)", unit="graph",
                                     disable=not progress or self.lm.tp.rank > 0):
                start = time.perf_counter()
                program.add(name, module, self.settings.batch_size)
                self.compile_seconds[name] = time.perf_counter() - start
        program.start(self.rank_weights(next(iter(modules.values()))))
        self.built.update({key: program.runner(key.describe()) for key in keys})
        self.compactions.update({m: program.runner(compaction_name(m)) for m in compaction_slots})
        self.ran.update(keys)
        self.neuron = program

    def export(self, key: GraphKey) -> torch.export.ExportedProgram:
        """``torch.export`` (strict, static shapes) of one graph: the check that it is trace-clean."""
        module = self.module(key)
        return torch.export.export(module, module.example_inputs(self.settings.batch_size), strict=True)


def compaction_name(m: int) -> str:
    """The name of the KV-compaction graph moving m slots per row (in a Neuron program)."""
    return f"kv-compaction m={m}"


def _cache_hits() -> int:
    """Graphs Inductor has loaded from its on-disk FX-graph cache in this process so far."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["fxgraph_cache_hit"]
