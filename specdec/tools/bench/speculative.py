"""Speculative-decoding benchmark: the embedded model with a shipped proposer, MT-Bench first turns.

In one process run, for each temperature (greedy and 0.7) and each k:
  specdec-target      ``DecoderModel.generate`` (target only)
  specdec-{s}-k{k}    ``SpeculativeGenerator(shipped(s, target), target, k).generate`` with the shipped
                      ``--strategy`` s (a name of ``specdec.registry``): ``model`` (the vanilla draft model) or
                      ``eagle`` (the EAGLE head); ``--strategy`` takes a comma list, every strategy's systems
                      run in the same process
  specdec-{s}-fused-k{k}  the same with ``fused=True`` (one graph per step; ``--fused on`` or ``both``)
  specdec-eagle3[-tree]-...    ``--strategy eagle3`` / ``eagle3-tree`` (and ``lookup+`` them): the same with the
                      shipped EAGLE-3 head (``--eagle DIR``: another EAGLE head for the eagle strategies)
  specdec-eagle-tree-{DxKxN}  ``--strategy eagle-tree``: the shipped EAGLE head drafting EAGLE-2 dynamic
                      trees of each ``--dynamic-trees`` shape (depth x top-k x nodes); k = the depth
  specdec-{s}-adaptive-k{k}  ``--adaptive``: the same with ``adaptive=True`` (per-row k <= k, HF's heuristic
                      schedule; unfused, chain strategies)
  specdec-...-gate    ``--gate on|both``: the speculative systems with ``gate=True`` (a step speculates only
                      while speculative steps emit tokens faster than plain ones; unfused)
  specdec-lookup+{m}-k{k}  ``--strategy lookup+model`` / ``lookup+eagle``: ``LookupOrDraft`` (prompt lookup
                      where an n-gram of 2 tokens matches, the shipped draft model / EAGLE head elsewhere)
  specdec-lookup+eagle-tree-{DxKxN}  the same trees with the prompt-lookup continuation (as long as the
                      depth) grafted on (``LookupBranch``)
  specdec-suffix-k{k} ``--strategy suffix``: suffix decoding chains (``SuffixChain``); ``suffix+model`` /
                      ``suffix+eagle`` / ``suffix+eagle3``: ``SuffixOrDraft`` (the suffix chain where a match of
                      4+ tokens is found, the shipped draft elsewhere). Every call starts with an empty suffix
                      cache (a fresh generator), so only the call's own rows are matched: MT-Bench questions do
                      not repeat each other (``bench/bench_suffix.py`` measures workloads that do)
  specdec-medusa-{t}  ``--strategy medusa``: the shipped Medusa heads (or ``--heads DIR``) with tree t of
                      ``--trees`` (a built-in name, a JSON file, or ``shipped``: the tree built from the
                      heads' measured accuracy, stored with them); k = the tree's depth
  hf-assisted-k{k}    ``transformers`` assisted generation (batch 1 only): the target as a
                      transformers model (eager, f32), the shipped vanilla draft as assistant
                      (``HFAdapter``, eager f32), a constant ``num_assistant_tokens=k``
``--batch-size`` prompts per call (tokens/s counts every row), ``--max-new-tokens`` (128) per prompt
with EOS disabled, on the MT-Bench questions shipped with the package (or ``--prompts FILE``).
Checks that every system's greedy output equals target-only decoding's (``greedy_equals_target`` in its
temperature-0 runs; a warning on stderr where it does not). Reports tokens/s (median over calls), τ,
acceptance rate, per-position acceptance and speedups (over
specdec target-only, and over the fastest ``hf-assisted`` configuration at the same temperature) as
JSON (stdout) and a markdown table (stderr), and per system the time per step spent inside graph calls
and outside them (host work: bucket choice, random draws, input preparation, acceptance bookkeeping,
emission), summed over all calls; the target-only run's graph time per step is one decode step.

    python bench/bench_speculative.py [--strategy model|eagle] [--num-prompts 10] [--ks 2,4,6] [--batch-size 1]
    python bench/bench_speculative.py --strategy medusa [--trees chain_4,mc_sim_7b_63,shipped]
    python bench/bench_speculative.py --strategy eagle-tree [--dynamic-trees 3x8x8,4x8x16]

Both specdec systems use the same runtime settings (``--backend``, ``--amp``, one KV bucket of
``--n-positions`` slots so the compiled backend builds fewer graphs).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from ...core.chat import chat_ids
from ...core.config import module_bytes
from ...eagle.proposer import EagleDraft
from ...eagle.smollm2 import embedded_eagle_path
from ...eagle.tree import DynamicTree
from ...medusa.draft import MedusaDraft
from ...options import DRAFT_QUANTIZATIONS, options_from
from ...registry import REGISTRY, name_list
from ..arguments import int_list
from . import runtime
from .prompts import add_prompt_arguments, load_records, resolve_prompts

SPECULATIVE = tuple(name for name, s in REGISTRY.items() if s.speculative)
"""The registry's strategies a ``--strategy`` may name (target-only runs in every benchmark)."""


@dataclass(frozen=True)
class SpecBenchOptions:
    """What ``run`` measures (the flags of ``add_arguments``, same names): ``prompts`` (a prompt set name or
    MT-Bench style jsonl; None: MT-Bench), its first ``num_prompts`` (or ``per_category`` of every category),
    ``max_new_tokens`` per prompt; the systems: ``strategy`` (registry names), ``ks`` (chains),
    ``dynamic_trees`` / ``trees`` (comma lists of EAGLE-2 shapes / Medusa trees), ``heads`` / ``eagle`` (other
    weights than the shipped ones), ``fused`` / ``gate`` ("off", "on", "both"), ``adaptive``, ``no_hf`` (no
    transformers assisted generation); the runtime: ``batch_size`` prompts per call, ``temperatures`` (a comma
    list), ``backend``, ``amp``, ``quantization`` (the target's), ``draft_quantization``, ``autotune``,
    ``n_positions``, ``seed``, ``threads`` (None: torch's); ``output``: also write the JSON there."""

    prompts: str | None = None
    num_prompts: int = 10
    max_new_tokens: int = 128
    strategy: list[str] = field(default_factory=lambda: ["model"])
    dynamic_trees: str = "3x8x8"
    trees: str = "chain_4,mc_sim_7b_63,shipped"
    heads: str | None = None
    eagle: str | None = None
    per_category: int | None = None
    batch_size: int = 1
    ks: list[int] = field(default_factory=lambda: [2, 4, 6])
    temperatures: str = "0,0.7"
    backend: str = "compiled"
    amp: str = "bf16"
    quantization: str | None = None
    draft_quantization: str | None = None
    autotune: bool = False
    n_positions: int = 384
    fused: str = "off"
    adaptive: bool = False
    gate: str = "off"
    no_hf: bool = False
    seed: int = 0
    threads: int | None = None
    output: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_prompt_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--strategy", default=["model"], type=name_list(SPECULATIVE),
                        help=f"comma list of {', '.join(SPECULATIVE)}: the shipped vanilla draft model, EAGLE head "
                             "(chains, or EAGLE-2 dynamic trees) or Medusa heads, prompt lookup (no weights), prompt "
                             "lookup where an n-gram matches and the draft model / EAGLE head elsewhere, "
                             "EAGLE-2 trees with the prompt-lookup continuation grafted on (lookup+eagle-tree), "
                             "suffix decoding (suffix; no weights) or suffix decoding where it matches and the "
                             "draft model / EAGLE head elsewhere (suffix+model, suffix+eagle, suffix+eagle3)")
    parser.add_argument("--dynamic-trees", default="3x8x8",
                        help="eagle-tree: comma list of DEPTHxTOPKxNODES dynamic tree shapes")
    parser.add_argument("--trees", default="chain_4,mc_sim_7b_63,shipped",
                        help="medusa: comma list of trees (built-in names, JSON files, 'shipped')")
    parser.add_argument("--heads", default=None, help="medusa: heads directory (default: the shipped heads)")
    parser.add_argument("--eagle", default=None,
                        help="eagle strategies: an EAGLE draft directory, a checkpoint or a `train-eagle --ship` "
                             "directory (default: the shipped head)")
    parser.add_argument("--per-category", type=int, default=None, metavar="N",
                        help="the first N prompts of every category of --prompts instead of --num-prompts; tokens/s "
                             "and τ are also reported per category (batch 1, or calls within one category)")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per call (HF assisted needs 1)")
    parser.add_argument("--ks", type=int_list, default=[2, 4, 6], help="draft tokens per step")
    parser.add_argument("--temperatures", default="0,0.7", help="comma list; 0 = greedy")
    parser.add_argument("--backend", default="compiled", choices=["eager", "compiled", "regional", "xla"])
    parser.add_argument("--amp", default="bf16", choices=["f32", "bf16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf", "q4_0"],
                        help="the target's weights (DecoderModel.from_pretrained(quantization=...)); drafts inherit it")
    parser.add_argument("--draft-quantization", default=None, choices=DRAFT_QUANTIZATIONS,
                        help="the draft model's / EAGLE head's own weight-only scheme (default: the target's); "
                             "it changes what a draft step costs and which tokens it proposes, never the output")
    parser.add_argument("--autotune", action="store_true",
                        help="compiled backend: autotuned graphs (DecoderModel.from_pretrained(autotune=True))")
    parser.add_argument("--n-positions", type=int, default=384,
                        help="cache slots; must hold the longest prompt + max-new-tokens + max(ks) + 1")
    parser.add_argument("--fused", default="off", choices=["off", "on", "both"],
                        help="draft / eagle: unfused systems (off), fused ones (on) or both side by side")
    parser.add_argument("--adaptive", action="store_true",
                        help="chain strategies, unfused: per-row adaptive k <= each --ks value (adaptive=True)")
    parser.add_argument("--gate", default="off", choices=["off", "on", "both"],
                        help="unfused: speculative systems that speculate only while they emit tokens faster than "
                             "plain decode steps (gate=True, specdec.speculation.gate; names end in -gate): "
                             "none (off), only those (on), or both side by side")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers assisted generation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--output", default=None, help="also write the JSON result here")


SIDES = {"off": [False], "on": [True], "both": [False, True]}
"""The settings an off / on / both flag (``--fused``, ``--gate``) runs side by side."""


def _timed(fn) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run(options: SpecBenchOptions) -> dict:
    from transformers import AutoModelForCausalLM

    from ... import DecoderModel, Engine, SpecStats
    from ...core.hf_adapter import HFAdapter
    from ...draft.smollm2 import embedded_draft_path

    torch.set_grad_enabled(False)
    if options.threads:
        torch.set_num_threads(options.threads)
    kw = dict(n_positions=options.n_positions, amp=options.amp, backend=options.backend, progress=False,
              kv_buckets=[options.n_positions], autotune=options.autotune)
    B = options.batch_size
    target = DecoderModel.from_pretrained(None, batch_size=B, quantization=options.quantization, **kw)
    systems, draft_module = speculative_systems(options, target)   # name -> System
    records = bench_records(options)
    prompts = [chat_ids(target.tokenizer, text) for _, _, text in records]
    calls = [prompts[i:i + B] for i in range(0, len(prompts), B)]
    call_category = []          # each call's prompt category ("mixed" when its rows differ)
    for i in range(0, len(records), B):
        found = {c for _, c, _ in records[i:i + B]}
        call_category.append(found.pop() if len(found) == 1 else "mixed")
    n_new = options.max_new_tokens
    width = max(system.width for system in systems.values())
    needed = max(len(p) for p in prompts) + n_new + width
    if needed > options.n_positions:  # else k shrinks near the end and new graph shapes compile mid-run
        raise ValueError(f"--n-positions {options.n_positions} is too small: the longest prompt + {n_new} new tokens "
                         f"+ a verify step of {width} tokens needs {needed}")
    temps = [float(t) for t in options.temperatures.split(",")]
    hf = None if options.no_hf or B > 1 else \
        AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
    if hf is not None:
        hf.generation_config.eos_token_id = None
    assistant = None if hf is None else HFAdapter(
        DecoderModel.from_pretrained(embedded_draft_path(),
                                     **{**kw, "backend": "eager", "amp": "f32", "autotune": False}))

    def sampling(t):
        return dict(do_sample=t > 0, temperature=t) if t > 0 else dict(do_sample=False)

    runs: dict[str, dict] = {}
    # warm-up (graph building / compilation), not timed: every call once, so the prefill graphs of
    # every context bucket (long prompts: summarization, RAG) are built before any system is timed
    for t in temps:
        for batch in calls:
            target.generate(batch, max_new_tokens=8, eos_token_id=[], **sampling(t))
            for system in systems.values():
                system.make().generate(batch, max_new_tokens=8, eos_token_id=[], **sampling(t))
    greedy: dict[int, torch.Tensor] = {}     # call → target-only greedy output (the target's jobs run first)
    jobs = [(t, None, "specdec-target") for t in temps]
    jobs += [(t, system.k, name) for t in temps for name, system in systems.items()]
    if hf is not None:
        jobs += [(t, k, f"hf-assisted-k{k}") for t in temps for k in options.ks]
    for t, k, name in tqdm(jobs, desc="benchmark", unit="config", file=sys.stderr):
        rates, stats, clock, gated = [], SpecStats(), GraphClock(), {True: 0, False: 0}
        by_category: dict[str, tuple[list[float], SpecStats]] = {}
        same = True             # greedy: every call's output equals target-only decoding's
        for i, batch in enumerate(calls):
            seed = options.seed + i
            if name == "specdec-target":
                engine = Engine(target)
                clock.watch(engine, [target])
                # (B023: _timed calls each lambda at once, so it reads this iteration's loop variables)
                out, dt = _timed(lambda: engine.generate(batch, max_new_tokens=n_new, eos_token_id=[],  # noqa: B023
                                                         seed=seed, **sampling(t)))  # noqa: B023
                clock.add_wall(dt)
                if t == 0:
                    greedy[i] = out
            elif name in systems:
                gen = systems[name].make()
                clock.watch(gen.engine, [target, drafting_model(gen.proposer), gen.speculator])
                out, dt = _timed(lambda: gen.generate(batch, max_new_tokens=n_new, eos_token_id=[],  # noqa: B023
                                                      seed=seed, **sampling(t)))  # noqa: B023
                clock.add_wall(dt)
                same = same and (t != 0 or torch.equal(out, greedy[i]))
                stats = stats + gen.last_stats
                for kind, count in (gen.gate_meter.steps.items() if gen.gate_meter else ()):
                    gated[kind] += count
                by_category.setdefault(call_category[i], ([], SpecStats()))[1].merge(gen.last_stats)
            else:
                torch.manual_seed(seed)
                x = torch.tensor(batch)
                out, dt = _timed(lambda: hf.generate(
                    x, attention_mask=torch.ones_like(x), assistant_model=assistant,  # noqa: B023
                    max_new_tokens=n_new, min_new_tokens=n_new, num_assistant_tokens=k,  # noqa: B023
                    num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
                    **sampling(t)))  # noqa: B023
                if out.shape[1] - x.shape[1] != n_new:
                    raise RuntimeError(f"{name}: generated {out.shape[1] - x.shape[1]} tokens, not {n_new}")
            rates.append(len(batch) * n_new / dt)
            by_category.setdefault(call_category[i], ([], SpecStats()))[0].append(rates[-1])
        entry = {"temperature": t, "k": k, "tokens_per_s": statistics.median(rates),
                 "tokens_per_s_all": rates, **clock.per_step()}
        if len(by_category) > 1:        # per prompt category: median tokens/s and τ (speculative systems)
            entry["by_category"] = {c: {"tokens_per_s": statistics.median(r), "calls": len(r),
                                        **({"tau": st.mean_acceptance_length} if st.steps else {})}
                                    for c, (r, st) in by_category.items()}
        if name in systems:
            d = stats.to_dict()
            entry.update(tau=d["mean_acceptance_length"], acceptance_rate=d["acceptance_rate"],
                         per_position_acceptance=d["per_position_acceptance"], stats=d)
            if t == 0:
                entry["greedy_equals_target"] = same
            if gated[True] + gated[False]:     # gated systems: the share of steps that speculated
                entry["speculative_step_share"] = gated[True] / (gated[True] + gated[False])
        runs[f"{name}@T{t}"] = entry
    for key, e in runs.items():
        if e.get("greedy_equals_target") is False:
            print(f"warning: {key}: the greedy output differs from target-only decoding's", file=sys.stderr)
        reference = runs[f"specdec-target@T{e['temperature']}"]
        e["speedup_vs_specdec_target"] = e["tokens_per_s"] / reference["tokens_per_s"]
        for c, per in e.get("by_category", {}).items():
            per["speedup_vs_specdec_target"] = per["tokens_per_s"] / reference["by_category"][c]["tokens_per_s"]
        if "outside_graphs_ms_per_step" in e:
            e["outside_graphs_vs_decode_step"] = e["outside_graphs_ms_per_step"] / reference["graph_ms_per_step"]
        unfused = key.replace("-fused-", "-")
        if unfused != key and unfused in runs:
            e["speedup_vs_unfused"] = e["tokens_per_s"] / runs[unfused]["tokens_per_s"]
        hf_best = max((r["tokens_per_s"] for name, r in runs.items()
                       if name.startswith("hf-assisted") and r["temperature"] == e["temperature"]), default=None)
        if key.split("@")[0] in systems and hf_best:
            e["speedup_vs_hf_assisted"] = e["tokens_per_s"] / hf_best
    return {"config": {"strategy": options.strategy, "batch_size": B, "backend": options.backend, "amp": options.amp,
                       "quantization": options.quantization, "draft_quantization": options.draft_quantization,
                       "autotune": options.autotune, "fused": options.fused,
                       "adaptive": options.adaptive, "gate": options.gate,
                       "num_prompts": len(prompts), "prompts": str(resolve_prompts(options.prompts).name),
                       "question_ids": [q for q, _, _ in records], "max_new_tokens": n_new, "systems": list(systems),
                       "temperatures": temps, "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "draft_cost_ratio": 0.0 if draft_module is None else
                       bytes_read_per_step(draft_module) / bytes_read_per_step(target.lm)},
            "runs": runs}


def bench_records(options: SpecBenchOptions) -> list[tuple[object, str, str]]:
    """``(question_id, category, text)`` of the benchmark's prompts: the first ``--num-prompts`` of
    ``--prompts``, or with ``--per-category N`` the first N of every category (in file order)."""
    if not options.per_category:
        return load_records(options.prompts, options.num_prompts)
    return load_records(options.prompts, per_category=options.per_category)


class System(NamedTuple):
    """One speculative configuration: draft tokens per step k, verify width (tokens per target
    forward) and a factory of fresh ``SpeculativeGenerator`` objects."""

    k: int
    width: int
    make: Callable


def speculative_systems(options: SpecBenchOptions, target) -> tuple[dict[str, System], torch.nn.Module | None]:
    """``{name: System}`` for every ``--strategy`` and the first one's drafting module (for its
    weight-read cost). The shipped proposers take the target's runtime settings (batch size, buckets,
    amp, backend)."""
    if options.adaptive and (not all(REGISTRY[s].adaptive for s in options.strategy) or options.fused != "off"):
        raise ValueError(f"--adaptive applies to chain strategies "
                         f"({', '.join(n for n, s in REGISTRY.items() if s.adaptive)}) with --fused off")
    if options.gate != "off" and options.fused != "off":
        raise ValueError("--gate runs unfused (a fused step's graph always drafts): use --fused off")
    systems, modules = {}, []
    for strategy in options.strategy:
        for gate in SIDES[options.gate]:
            found, module = strategy_systems(strategy, options, target, gate)
            systems.update({f"{name}-gate" if gate else name: system for name, system in found.items()})
        modules.append(module)
    return systems, next((m for m in modules if m is not None), None)


def strategy_model(name: str, options: SpecBenchOptions, target, **build):
    """The draft network's proposer of strategy ``name`` (a model-backed one): the shipped weights
    (``specdec.shipped``), or ``--eagle DIR`` for the EAGLE strategies, ``--heads DIR`` for Medusa;
    ``--draft-quantization``; ``build``: ``tree=`` for trees."""
    from ... import shipped
    cls, path = REGISTRY[name].proposer, None
    if options.eagle is not None and issubclass(cls, EagleDraft):
        path = embedded_eagle_path(options.eagle)
    elif options.heads and issubclass(cls, MedusaDraft):
        path = options.heads
    if options.draft_quantization is not None:
        if not REGISTRY[name].quantizable:
            raise ValueError("--draft-quantization applies to the draft model and EAGLE heads; Medusa heads follow "
                             "the target's --quantization")
        build["quantization"] = options.draft_quantization
    return shipped(name, target, **build) if path is None else REGISTRY[name].build(target, path, **build)


def strategy_systems(name: str, options: SpecBenchOptions, target,
                     gate: bool = False) -> tuple[dict[str, System], torch.nn.Module | None]:
    """One strategy's systems (named ``specdec-{name}-...``; ``gate``: gated generators) and its drafting
    module. Trees: one system per tree (``--trees`` for static trees, ``--dynamic-trees`` for EAGLE-2 shapes;
    k = the depth; suffix trees: one per k of ``--ks``, its depth); chains: one per k of ``--ks`` (and
    ``--fused`` where the strategy fuses). One draft network serves all of a strategy's systems; each generator
    gets a fresh combination around it."""
    from ... import SpeculativeGenerator
    s = REGISTRY[name]
    generator = partial(SpeculativeGenerator, gate=gate)
    spec = f"specdec-{name}"
    if s.kind == "tree" and s.tree is None:         # suffix trees, grown from the text: depth = each k of --ks
        return {f"{spec}-k{k}": System(k, s.build(target, depth=k).verify_size,
                                       lambda k=k: generator(s.build(target, depth=k), target, None))
                for k in options.ks}, None
    if s.kind == "tree":
        shapes = options.trees.split(",") if s.tree == "static" else options.dynamic_trees.split(",")
        parts = {shape: strategy_model(s.part, options, target, tree=None if shape == "shipped" else
                                       DynamicTree.parse(shape) if s.tree == "dynamic" else shape)
                 for shape in shapes}
        return {f"{spec}-{Path(shape).stem}": System(d.depth, s.build(target, part=d).verify_size,
                                                     lambda d=d: generator(s.build(target, part=d), target, None))
                for shape, d in parts.items()}, next(iter(parts.values())).module
    part = None if s.part is None else strategy_model(s.part, options, target)
    adaptive = "-adaptive" if options.adaptive else ""
    modes = SIDES[options.fused] if s.fused else [False]
    return {f"{spec}{'-fused' if fused else ''}{adaptive}-k{k}":
            System(k, k + 1, lambda k=k, fused=fused: generator(s.build(target, part=part), target, k, fused=fused,
                                                                adaptive=options.adaptive))
            for k in options.ks for fused in modes}, None if part is None else part.module


def drafting_model(proposer):
    """The draft network whose graphs ``proposer`` (a declared proposer: ``gen.proposer``) runs, through a
    prompt-lookup combination (its ``draft``); None for prompt lookup alone."""
    return (proposer.draft or proposer).model


class GraphClock:
    """Wall time inside graph calls vs outside them, over the runs it watches.

    ``watch(engine, owners)`` times every graph callable the owners hand out through their ``graph(key)``
    method (a ``DecoderModel``'s, a fused speculator's; their graph tables stay as they are) and counts
    the engine's steps. On the CPU a graph call returns when its work is done, so the wrapped time is the
    graph's time; the rest of a run's wall time (``add_wall``) is host work."""

    def __init__(self):
        self.graph_s = self.wall_s = 0.0
        self.steps = 0

    def _timed(self, fn):
        def timed(*inputs):
            start = time.perf_counter()
            try:
                return fn(*inputs)
            finally:
                self.graph_s += time.perf_counter() - start
        return timed

    def watch(self, engine, owners) -> None:
        clock = self
        for owner in owners:
            graph = getattr(type(owner), "graph", None)      # the class's method (not an earlier clock's)
            if graph is None:
                continue

            def timed_graph(key, owner=owner, graph=graph):
                found = graph(owner, key)
                if isinstance(found, tuple):                 # a fused speculator's (module, callable)
                    return found[0], clock._timed(found[1])
                return clock._timed(found)
            owner.graph = timed_graph
        step = engine.step

        def counted():
            clock.steps += 1
            return step()
        engine.step = counted

    def add_wall(self, seconds: float) -> None:
        self.wall_s += seconds

    def per_step(self) -> dict:
        if not self.steps:
            return {}
        return {"steps": self.steps, "graph_ms_per_step": 1e3 * self.graph_s / self.steps,
                "outside_graphs_ms_per_step": 1e3 * (self.wall_s - self.graph_s) / self.steps}


def bytes_read_per_step(module: torch.nn.Module) -> int:
    """Weight bytes one decode step of ``module`` reads: all its weights (:func:`module_bytes`) except
    an input embedding table that is not also the LM head (one row of it is read). DecoderLM and
    EagleLM have such a table; Medusa heads do not (all their weights are read)."""
    total = module_bytes(module)
    embed = getattr(getattr(module, "model", module), "embed_tokens", None)   # DecoderLM / EagleLM
    if embed is None:
        return total
    head = getattr(module, "lm_head", None)
    if head is not None and getattr(head, "weight", None) is embed.weight:   # a quantized head has its own
        return total   # tied: the table is read whole as the LM head
    return total - module_bytes(embed)


def _cell(value, spec: str) -> str:
    return "" if value is None or value != value else format(value, spec)     # None and nan: an empty cell


def table(result: dict) -> str:
    """A result's markdown table (bench-spec prints it to stderr; the docs' tables are generated with it,
    ``scripts/results_tables.py``): one row per system and temperature, then what was run."""
    rows = ["| system | T | tok/s | τ | per-position | × target | × HF assisted | graph / host ms per step |",
            "|---|---:|---:|---:|---|---:|---:|---|"]
    for key, e in result["runs"].items():
        pp = ", ".join(f"{p:.2f}" for p in e.get("per_position_acceptance", []))
        ms = (f"{e['graph_ms_per_step']:.1f} / {e['outside_graphs_ms_per_step']:.1f}"
              if e.get("graph_ms_per_step") is not None else "")
        rows.append(f"| {key.split('@')[0].removeprefix('specdec-')} | {e['temperature']:g} | "
                    f"{e['tokens_per_s']:.1f} | {_cell(e.get('tau'), '.2f')} | {pp} | "
                    f"{_cell(e.get('speedup_vs_specdec_target'), '.2f')} | "
                    f"{_cell(e.get('speedup_vs_hf_assisted'), '.2f')} | {ms} |")
    cfg = result["config"]
    prompts = Path(cfg.get("prompts") or "mt_bench_questions.jsonl").stem
    rows += ["", f"Medians over calls: {cfg['num_prompts']} prompts of `{prompts}`, batch {cfg.get('batch_size', 1)}, "
                 f"{cfg['max_new_tokens']} new tokens (EOS off), {cfg['backend']} {cfg['amp']}"
                 + (f" `{cfg['quantization']}`" if cfg.get("quantization") else "")
                 + (", autotuned" if cfg.get("autotune") else "") + f", {cfg['threads']} threads; "
                 "× target: over target-only at the same T in the same run."]
    return "\n".join(rows)


print_result = partial(runtime.print_result, table=table)      # JSON to stdout (and --output), the table to stderr


def parse_options(argv: list[str] | None = None) -> SpecBenchOptions:
    """``python bench/bench_speculative.py``'s arguments (``argv`` None: ``sys.argv``) as options."""
    parser = argparse.ArgumentParser(prog="bench_speculative", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return options_from(SpecBenchOptions, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    return print_result(run(options), options.output)


if __name__ == "__main__":
    sys.exit(main())
