"""``FusedSpeculator``: speculation steps that are one graph call each, chained on the device.

It plugs into the request loop like the unfused ``Speculator`` (same proposer, same ``start``, same
row semantics; ``Engine`` owns emission, EOS, budgets and statistics) but a step is ONE call of a
``FusedStep`` graph (draft loop + verification + acceptance, ``specdec.fused.step``) instead of
1 + k graph calls with host work in between. Per step the host:

- chooses k (shrunk near ``n_positions``, as unfused) and the KV buckets from the longest active row,
  which it knows from the tokens it has already read (no extra device read);
- draws the step's random numbers from each row's generator (sampling graphs only), in the order
  the unfused step draws them;
- passes the device-resident ``next_tail`` / ``next_lengths`` the previous call returned when the
  rows are those the previous step left (no row joined, finished or was released), else the
  engine's host values;
- reads one small tensor back ([B, k+2]: accepted counts and emitted tokens), which the engine needs
  to stop rows exactly at EOS / budget / stopping criteria.

Graphs are built per ``FusedKey`` (k, KV buckets, greedy / sampling, top filter, penalty, re-read
width) on the target's backend (``eager``; ``compiled``: ``torch.compile`` fullgraph, static shapes;
``xla``: one ``torch_xla.compile`` full-graph program; not ``neuron`` yet)
and kept as long as the proposer lives (``_GRAPHS``), so every speculator over the same proposer and
target reuses them, as a ``DecoderModel`` keeps its own graphs. Chain proposers qualify by declaring
the ability ``fused_drafter(key)`` (``DraftModel``, ``EagleDraft``; ``specdec.speculation.proposer``), with ``model``
(the draft network: its KV buckets) and ``reread_width(k)``; tree proposers (Medusa) and prompt lookup run
unfused (``MissingAbility`` names "fused_drafter").
"""
from __future__ import annotations

import sys
import time
import weakref
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from ..core.buckets import pick_bucket
from ..core.decoder import DecoderModel
from ..core.engine import StepResult
from ..core.graphs import build_graph
from ..core.sampling import RowGenerators, any_penalised, any_sampled, needs_filter
from ..core.stats import SpecStats
from ..speculation.proposer import Proposer, step_k
from ..speculation.speculative import Speculator
from .step import FusedKey, FusedStep

# proposer -> {FusedKey: (FusedStep, callable)}: the fused graphs built for that proposer (and its target)
_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class FusedSpeculator(Speculator):
    """A ``Speculator`` whose steps are fused graphs (see the module docstring)."""

    def __init__(self, proposer: Proposer, target: DecoderModel, k: int):
        super().__init__(proposer, target, k)
        self.proposer.require("fused_drafter", "fused speculation needs a chain proposer whose draft loop runs "
                              "inside the graph", ": use fused=False (or a DraftModel with p_min=None: its "
                              "confidence stop drafts a varying number of tokens, a fused graph k)")
        self.proposer.require("model", "fused speculation sizes the draft's KV buckets from its network")
        if target.tp.size > 1:
            raise ValueError(f"fused speculation runs at tp_degree=1 (got {target.tp.size}): use fused=False")
        if target.settings.backend == "neuron":
            raise ValueError("fused speculation is not wired into the neuron backend's program yet (the fused graph "
                             "would hold its own copy of the weights and KV caches): use fused=False on neuron")
        self.graphs: dict[FusedKey, tuple[FusedStep, object]] = _GRAPHS.setdefault(self.proposer, {})
        self.compile_seconds: dict[str, float] = {}
        self._chain: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def start(self, rows, prompts, params, rng, target_out) -> None:
        self._chain = None
        super().start(rows, prompts, params, rng, target_out)
        self.proposer.flush(params)     # the fused graph's draft loop reads the draft's cache of S[:-2]

    def key(self, k: int, longest: int, params: torch.Tensor) -> FusedKey:
        """The graph for k drafts when the longest active row has ``longest`` tokens."""
        target, draft = self.target, self.proposer.model
        sampled = any_sampled(params)
        width = self.proposer.reread_width(k)
        return FusedKey(k, pick_bucket(target.kv_buckets, longest + k, "KV length"),
                        pick_bucket(draft.kv_buckets, longest + k, "draft KV length"), sampled,
                        sampled and needs_filter(params, target.settings.sampling.global_topk),
                        target.presence is not None and any_penalised(params), width)

    def compile(self, max_length: int, penalty: bool = False, progress: bool = True) -> FusedSpeculator:
        """Build and warm the fused graphs of full-k steps for sequences up to ``max_length`` tokens
        (every KV bucket up to the one ``max_length + k`` needs; the target's sampling config decides
        greedy or sampling), as ``DecoderModel.compile`` does for its own graphs. Steps near
        ``n_positions`` with a smaller k build theirs on first use. Overwrites KV cache slots."""
        target = self.target
        needed = min(max_length + self.k, target.n_positions)
        params = target.sampling_params()
        keys = [self.key(self.k, length - self.k, params) for length in target.kv_buckets
                if self.k + 2 <= length <= pick_bucket(target.kv_buckets, needed, "max_length")]
        keys = [replace(key, penalty=penalty) for key in dict.fromkeys(keys)]
        for key in tqdm(keys, desc=f"compiling fused ({target.settings.backend})", unit="graph",
                        disable=not progress or not keys):
            module, run = self.graph(key)
            self._call(key, run, list(module.example_inputs(target.batch_size)))
        if keys:
            self._wrote(torch.zeros(target.batch_size, dtype=torch.long), 0)
        return self

    def _wrote(self, lengths: torch.Tensor, width: int) -> None:
        """A step's graph wrote the target's rows from len(S) - 1 and the draft's from len(S) - 1 - ``width``."""
        if self.target.prefix_cache:
            self.target.forget_from(lengths - 1)
            self.proposer.model.forget_from((lengths - 2 - width).clamp(min=0))

    def graph(self, key: FusedKey) -> tuple[FusedStep, object]:
        """(module, callable on the target's backend) for ``key``, built once per proposer and target."""
        if key not in self.graphs or self.graphs[key][0].lm is not self.target.lm:
            module = FusedStep(self.target.lm, self.proposer.fused_drafter(key), key,
                               self.target.settings.sampling.global_topk)
            settings = self.target.settings
            self.graphs[key] = module, build_graph(module, settings.backend, self.target.batch_size,
                                                   autotune=settings.autotune)
        return self.graphs[key]

    def step(self, tail: torch.Tensor, lengths: torch.Tensor, active: torch.Tensor, params: torch.Tensor,
             rng: RowGenerators, stats: SpecStats) -> StepResult:
        longest = int(lengths[active].max())
        k = step_k(self.proposer, self.k, self.target.n_positions, longest)
        if k == 0:        # no room to draft: the unfused plain decode step
            self._chain = None
            return super().step(tail, lengths, active, params, rng, stats)
        dev, B = self.target.device, self.target.batch_size
        with stats.timer("verify"):
            key = self.key(k, longest, params)
            module, run = self.graph(key)
            if key.do_sample:
                uniform = rng.uniform(module.uniforms).to(dev)
            else:
                uniform = torch.zeros(B, module.uniforms, device=dev)
            tail_d, lengths_d = self._chained_inputs(tail, lengths, active)
            inputs = [tail_d, lengths_d, active.to(dev), params.to(dev), uniform]
            if key.penalty:
                inputs.append(self.target.presence)
            result, next_tail, next_lengths = self._call(key, run, inputs)
            self._wrote(lengths, key.width)
        with stats.timer("other"):
            result = result.cpu()
            n = result[:, 0]
            self._chain = (torch.where(active, lengths + n + 1, lengths), active.clone(), next_tail, next_lengths)
        return StepResult(n, result[:, 1:], torch.full_like(n, k))

    def _chained_inputs(self, tail: torch.Tensor, lengths: torch.Tensor,
                        active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous call's device outputs when the rows are as that step left them, else the
        engine's host values copied to the device."""
        if self._chain is not None:
            expected, was_active, next_tail, next_lengths = self._chain
            if torch.equal(expected, lengths) and torch.equal(was_active, active):
                return next_tail, next_lengths
        dev = self.target.device
        return tail.to(dev), lengths.to(dev)

    def _call(self, key: FusedKey, run, inputs: list[torch.Tensor]):
        """Run a graph; a compiled graph's first call generates its code (say so on stderr, time it)."""
        module = self.graphs[key][0]
        first = not module.ran and self.target.settings.backend != "eager"
        say = first and self.target.progress
        if say:
            print(f"specdec: compiling graph {key.describe()} ...", end="", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with torch.no_grad():
            out = run(*inputs)
        if first:
            self.compile_seconds[key.describe()] = seconds = time.perf_counter() - start
            module.ran = True
            if say:
                print(f" {seconds:.1f} s", file=sys.stderr, flush=True)
        return out
