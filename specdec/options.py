"""Typed options of the tools (``specdec generate`` / ``serve``, serving, the benchmarks) and what is built
from them: the target model, the proposer and generator, the graphs a request needs (``precompile``).

    from specdec.options import ModelOptions, SpeculationOptions
    model = ModelOptions(backend="eager", amp="f32")
    speculation = SpeculationOptions(draft="eagle", k=5).checked(model)
    target = model.load()
    gen = speculation.make_generator(speculation.make_proposer(target), target)

The command line (``specdec.cli``) parses its arguments into these dataclasses (``options_from``); their
flags are in ``specdec.tools.arguments``. Errors in a combination of options are ``OptionError``s whose messages
name the command-line flags.
"""
from __future__ import annotations

import os
import typing
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from .core.decoder import DecoderModel
from .core.graph_cache import GraphCache
from .core.loading import AUTO, RuntimeSettings, resolve_auto
from .core.named_models import draft_preset, is_named_model
from .core.sampling import SamplingConfig
from .core.saved_graphs import is_saved
from .generator import SpeculativeGenerator
from .registry import REGISTRY

EMBEDDED_NAME = "smollm2-135m-instruct"
"""The embedded model's name (``--model`` default; the shipped strategies were trained for it)."""

T = TypeVar("T")


class OptionError(ValueError):
    """A bad option value or combination, found before any model loads (the command line reports it as one
    ``specdec: error:`` line, exit code 2)."""


def options_from(cls: type[T], source: object, **given: Any) -> T:
    """An options dataclass ``cls`` from the same-named attributes of ``source`` (an ``argparse.Namespace``,
    another options object): a field whose type is a dataclass is built the same way from ``source``; a field
    ``source`` lacks keeps its default; ``given`` sets fields directly."""
    hints = typing.get_type_hints(cls)
    values = dict(given)
    for f in fields(cls):
        if f.name in values:
            continue
        if is_dataclass(hints[f.name]):
            values[f.name] = options_from(hints[f.name], source)
        elif hasattr(source, f.name):
            values[f.name] = getattr(source, f.name)
    return cls(**values)


# ---------------------------------------------------------------------------------------------------
# threads

def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroups cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """``$OMP_NUM_THREADS`` (its first level) if set and valid, else ``available_cores()``."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) >= 1:
        return int(env)
    return available_cores()


# ---------------------------------------------------------------------------------------------------
# the target

def is_embedded(model: str | None) -> bool:
    """Whether ``model`` (a ``--model`` value) names the embedded model (the shipped strategies were trained
    for it): None, its name, or its GGUF file."""
    if model is None or model == EMBEDDED_NAME:
        return True
    if Path(model).suffix == ".gguf":
        from .core.paths import embedded_gguf_path
        try:
            return Path(model).resolve() == embedded_gguf_path().resolve()
        except FileNotFoundError:
            return False
    return False


@dataclass(frozen=True)
class ModelOptions:
    """How the target model loads (``DecoderModel.from_pretrained``'s arguments).

    model: a checkpoint directory, a ``.gguf`` file, a named model (``core.named_models``) or None / the
    embedded model's name; amp: weights / KV dtype ("f32", "bf16", "f16"); backend: a graph backend
    (``core.graphs.BACKENDS``); n_positions: the KV-cache length (prompt + new tokens); context_buckets: the
    prompt-length buckets of the context graphs (None: ``core.buckets.fine_buckets`` where the layers run as
    block kernels on eager / regional, else powers of two from 128 to n_positions); quantization:
    weight-only projections ("int8", "int4", "gguf", "q4_0") or "none"; kv_cache_dtype: an 8-bit KV cache ("int8",
    "fp8_e4m3") or None (the amp dtype); autotune: compiled graphs with frozen weights and timed kernel choice;
    tp_degree: tensor-parallel processes (NeuronCores with the neuron backend); gqa_strategy: how KV heads are
    sharded when they do not divide tp_degree (None: automatic); saved_graphs: compiled graphs kept as files
    that later processes load; prompt_weights: "bf16" (GGML blocks on eager / regional) also holds the layers'
    weights as dense bf16 matrices that prompts are encoded with; prefix_cache: a prompt's encoding keeps the KV
    its row already holds for the prompt's leading tokens, prefix_cache_mb: MiB of host memory keeping the prefixes
    rows give up (``DecoderModel.from_pretrained``).

    ``amp``, ``backend`` and ``quantization`` left None take the model's defaults when the options are made, by
    ``core.loading.resolve_auto`` (as ``from_pretrained``'s "auto"): a named model's ``Preset`` (gguf, f32,
    regional: its fastest measured runtime) where it runs on the host, else bf16 (the API's "auto": f32), compiled
    and no quantization (None) — also a named model on ``xla`` / ``neuron``, whose programs do not run the block
    kernels."""

    model: str | None = None
    amp: str | None = None
    backend: str | None = None
    n_positions: int = 1024
    context_buckets: list[int] | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    autotune: bool = False
    tp_degree: int = 1
    gqa_strategy: str | None = None
    saved_graphs: bool = True
    prompt_weights: str | None = None
    prefix_cache: bool = False
    prefix_cache_mb: int = 1024

    def __post_init__(self) -> None:
        given = RuntimeSettings(amp=self.amp or AUTO, backend=self.backend or AUTO,
                                quantization=AUTO if self.quantization is None else self.quantization)
        chosen = resolve_auto(self.model, given, other_amp="bf16")
        for name in ("amp", "backend", "quantization"):
            object.__setattr__(self, name, getattr(chosen, name))

    @property
    def name(self) -> str:
        """The model's name as given, the embedded model's for None."""
        return self.model or EMBEDDED_NAME

    def load(self, *, batch_size: int = 1, sampling: SamplingConfig | None = None,
             progress: bool = True) -> DecoderModel:
        """The target (this rank's shard at ``tp_degree`` > 1), ``batch_size`` rows; graphs build lazily."""
        return DecoderModel.from_pretrained(self.model, batch_size=batch_size, n_positions=self.n_positions,
                                            context_buckets=self.context_buckets, amp=self.amp, backend=self.backend,
                                            sampling=sampling, tp_degree=self.tp_degree, gqa_strategy=self.gqa_strategy,
                                            quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
                                            autotune=self.autotune, saved_graphs=self.saved_graphs,
                                            prompt_weights=self.prompt_weights, prefix_cache=self.prefix_cache,
                                            prefix_cache_mb=self.prefix_cache_mb, progress=progress)

    def threads_per_process(self, threads: int) -> int:
        """Intra-op threads of each of the ``tp_degree`` processes sharing ``threads`` (the neuron backend
        drives every core from one process)."""
        return max(1, threads // (1 if self.backend == "neuron" else self.tp_degree))


# ---------------------------------------------------------------------------------------------------
# speculation

SUFFIX_SETTINGS = {"suffix_cache_tokens": "cache", "suffix_alpha": "alpha", "suffix_min_prob": "min_prob",
                   "suffix_min_match": "min_match"}
"""``SpeculationOptions``' suffix fields → the suffix setting each gives (``Strategy.build``'s ``suffix``)."""


def _or(names: list[str]) -> str:
    """``["a", "b", "c"]`` → ``"a, b or c"``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _strategies(test) -> list[str]:
    """The registry's names whose ``Strategy`` passes ``test``, in registry order."""
    return [name for name, s in REGISTRY.items() if test(s)]


DRAFT_QUANTIZATIONS = ("none", "int8", "int4", "gguf", "q4_0")
"""What ``draft_quantization`` may be: a draft network's own weight-only scheme (``--draft-quantization``)."""


@dataclass(frozen=True)
class SpeculationOptions:
    """Which proposer drafts for the target, and how (``--draft`` and the options around it).

    draft: a strategy name of ``specdec.registry`` ("none": target only); draft_path: the checkpoint of its
    draft model / EAGLE head / Medusa heads (None: the shipped weights, trained for the embedded model);
    draft_model: a draft model for ``model`` / ``lookup+model`` / ``suffix+model`` (``checked`` turns it into
    ``draft_path``); k: draft tokens per step (None: the strategy's default, a tree's depth); fused: one graph
    per step; adaptive_k: per-row k <= k; gate: speculate only while it pays; draft_quantization: the draft's
    own weight-only scheme ("none", "int8", "int4", "gguf", "q4_0"; None: the target's); draft_vocab: a draft
    model scoring only token ids [0, draft_vocab) (``output_vocab_size``; None: its whole head); draft_p_min: a
    draft model's confidence stop (``DraftModel``'s ``p_min``; None or 0: k drafts a step); draft_window: the most
    tokens a draft model encodes at once (``DraftModel``'s ``window``; None: no limit); tree: a Medusa
    tree (name or JSON file) or an EAGLE-2 shape "DxKxN"; suffix_cache_tokens / suffix_alpha / suffix_min_prob /
    suffix_min_match: suffix decoding's cache budget (tokens), drafts per matched token, least continuation
    share and least match for the suffix chain (None: the strategy's defaults).

    ``checked`` fills a named draft model's ``draft_quantization`` and ``draft_p_min`` left None from its
    ``Preset`` when the target runs on GGML blocks (``quantization`` gguf / q4_0), where they were measured."""

    draft: str = "none"
    draft_path: str | None = None
    draft_model: str | None = None
    k: int | None = None
    fused: bool = False
    adaptive_k: bool = False
    gate: bool = False
    draft_quantization: str | None = None
    draft_vocab: int | None = None
    draft_p_min: float | None = None
    draft_window: int | None = None
    tree: str | None = None
    suffix_cache_tokens: int | None = None
    suffix_alpha: float | None = None
    suffix_min_prob: float | None = None
    suffix_min_match: int | None = None

    def checked(self, target: ModelOptions) -> SpeculationOptions:
        """These options with ``draft_model`` resolved and a named draft model's preset applied (see the class),
        after checking their combinations (and the ``target``'s model, for shipped weights) against the strategy
        registry before any model loads; raises ``OptionError``. ``draft_model X`` becomes ``draft model,
        draft_path X``, or the model part of ``lookup+model`` / ``suffix+model``; suffix options need a suffix
        strategy."""
        spec = self
        if self.draft_model is not None:
            if self.draft_path is not None:
                raise OptionError("give --draft-model or --draft-path, not both")
            takes = _strategies(lambda s: s.part == "model")
            if self.draft not in ("none", *takes):
                raise OptionError(f"--draft-model is a draft model: use it alone, or with --draft {_or(takes)} "
                                  f"(not {self.draft})")
            spec = replace(self, draft="model" if self.draft == "none" else self.draft, draft_path=self.draft_model,
                           draft_model=None)
        spec = spec._with_preset(target)
        spec._check(target.model)
        return spec

    def _with_preset(self, target: ModelOptions) -> SpeculationOptions:
        """A named draft model's preset for what is left unset, when ``target`` runs on GGML blocks."""
        preset = draft_preset(self.draft_path, target.quantization) if REGISTRY[self.draft].part == "model" else None
        if preset is None:
            return self
        p_min = preset.draft_p_min if self.draft_p_min is None and not self.fused else self.draft_p_min
        return replace(self, draft_quantization=self.draft_quantization or preset.draft_quantization, draft_p_min=p_min)

    def _check(self, model: str | None) -> None:
        s = REGISTRY[self.draft]
        loaders = _strategies(lambda s: s.part == s.name)    # the strategies that load a draft network
        if not s.speculative and self.k is not None:
            raise OptionError(f"--k needs --draft ({_or(_strategies(lambda s: s.speculative))})")
        if self.adaptive_k and (not s.adaptive or self.fused):
            raise OptionError(f"--adaptive-k needs an unfused chain --draft "
                              f"({', '.join(_strategies(lambda s: s.adaptive))})")
        if self.gate and (not s.gate or self.fused):
            raise OptionError("--gate needs a --draft and runs unfused (not with --fused)")
        if self.draft_path is not None and s.part is None:
            raise OptionError(f"--draft-path needs --draft {_or(loaders)} (or lookup+ / suffix+ them; not "
                              f"{self.draft})")
        if self.draft_path is not None and s.part != "model" and is_named_model(self.draft_path):
            raise OptionError(f"--draft-path {self.draft_path} (a named model) is a draft model: use it with --draft "
                              f"{_or(_strategies(lambda s: s.part == 'model'))}")
        given = self._suffix_given()
        if given and s.suffix is None:
            raise OptionError(f"--{next(iter(given)).replace('_', '-')} is for --draft "
                              f"{_or(_strategies(lambda s: s.suffix is not None))}")
        if "suffix_min_match" in given and s.suffix != "switch":
            raise OptionError(f"--suffix-min-match chooses between the suffix chain and a model draft: it is for "
                              f"--draft {_or(_strategies(lambda s: s.suffix == 'switch'))}")
        if self.draft_quantization is not None and not s.quantizable:
            own = [name for name in loaders if REGISTRY[name].quantizable]
            raise OptionError(f"--draft-quantization is for --draft {_or(own)} (and lookup+ / suffix+ them); Medusa "
                              "heads follow --quantization")
        if self.draft_vocab is not None and s.part != "model":
            raise OptionError(f"--draft-vocab restricts a draft model's LM head: it is for --draft "
                              f"{_or(_strategies(lambda s: s.part == 'model'))}")
        if self.draft_vocab is not None and self.draft_quantization in ("int8", "int4"):
            raise OptionError(f"--draft-vocab keeps the draft's own LM head; --draft-quantization "
                              f"{self.draft_quantization} re-quantizes it to int8: use none, gguf or q4_0")
        if self.draft_p_min and (s.part != "model" or self.fused):
            raise OptionError(f"--draft-p-min stops a draft model's chain early: it is for an unfused --draft "
                              f"{_or(_strategies(lambda s: s.part == 'model'))}")
        if self.draft_p_min is not None and not 0 <= self.draft_p_min < 1:
            raise OptionError(f"--draft-p-min must be in [0, 1) (0: off), got {self.draft_p_min}")
        if self.draft_window is not None and (s.part != "model" or self.fused):
            raise OptionError(f"--draft-window bounds what a draft model encodes at once: it is for an unfused "
                              f"--draft {_or(_strategies(lambda s: s.part == 'model'))}")
        if self.draft_window is not None and self.draft_window < 1:
            raise OptionError(f"--draft-window must be >= 1, got {self.draft_window}")
        if self.tree is not None and s.tree is None:
            trees = sorted((name for name in loaders if REGISTRY[name].tree),
                           key=lambda n: REGISTRY[n].tree != "static")
            raise OptionError(f"--tree is for --draft {_or(trees)} (and lookup+ them)")
        if self.tree is not None and s.tree == "dynamic":
            from .eagle.tree import DynamicTree
            try:
                DynamicTree.parse(self.tree)
            except ValueError as e:
                raise OptionError(f"--tree: {e}") from None
        if s.part is not None and self.draft_path is None and not is_embedded(model):
            raise OptionError(f"--draft {self.draft} without --draft-path uses the shipped weights, trained for the "
                              f"embedded model ({EMBEDDED_NAME}); for --model {model} give --draft-path DIR (a "
                              "checkpoint trained for it)")

    def _suffix_given(self) -> dict[str, object]:
        """The suffix fields set (name → value)."""
        return {name: value for name in SUFFIX_SETTINGS if (value := getattr(self, name)) is not None}

    def suffix_settings(self) -> dict[str, object] | None:
        """The suffix settings asked for (None: none given), ``suffix_cache_tokens`` as a new ``SuffixCache``
        (one per proposer: a server's one cache, shared by every request it serves)."""
        from .suffix import SuffixCache
        given = self._suffix_given()
        if "suffix_cache_tokens" in given:
            given["suffix_cache_tokens"] = SuffixCache(max_tokens=given["suffix_cache_tokens"])
        return {SUFFIX_SETTINGS[name]: value for name, value in given.items()} or None

    @property
    def default_k(self) -> int | None:
        """``k``, else the strategy's default (None for a tree: its depth)."""
        return REGISTRY[self.draft].default_k if self.k is None else self.k

    def draft_overrides(self) -> dict[str, Any]:
        """The draft network's loading arguments these options set: ``quantization`` (``draft_quantization``),
        ``output_vocab_size`` (``draft_vocab``), ``p_min`` (``draft_p_min``), ``window`` (``draft_window``); unset
        ones are left out, except a draft model's ``p_min`` (None when unset or 0: ``checked`` already applied its
        preset, which ``DraftModel.from_pretrained``'s "auto" would apply again)."""
        given = {"quantization": self.draft_quantization, "output_vocab_size": self.draft_vocab,
                 "p_min": self.draft_p_min or None, "window": self.draft_window}
        kept = {name: value for name, value in given.items() if value is not None}
        return {"p_min": None} | kept if REGISTRY[self.draft].part == "model" else kept

    def make_proposer(self, target: DecoderModel):
        """The proposer these options ask for (None for ``draft`` "none"), built by the strategy registry."""
        options = {} if self.tree is None else {"tree": self.tree}
        return REGISTRY[self.draft].build(target, self.draft_path, suffix=self.suffix_settings(), **options,
                                          **self.draft_overrides())

    def make_generator(self, proposer, target: DecoderModel) -> SpeculativeGenerator | None:
        """``SpeculativeGenerator`` over ``proposer`` (``make_proposer``'s; None: target only → None)."""
        if proposer is None:
            return None
        return SpeculativeGenerator(proposer, target, self.default_k, fused=self.fused, adaptive=self.adaptive_k,
                                    gate=self.gate)


# ---------------------------------------------------------------------------------------------------
# sampling

@dataclass(frozen=True)
class SamplingOptions:
    """How a request samples: temperature (0 = greedy), top_k (0 = off), top_p (1 = off), repetition_penalty
    (1 = off; transformers' rule) and the seed of the sampling noise."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0

    @property
    def config(self) -> SamplingConfig:
        """The target's sampling defaults (``DecoderModel.from_pretrained(sampling=...)``)."""
        return SamplingConfig(do_sample=self.temperature > 0, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p)


# ---------------------------------------------------------------------------------------------------
# graphs

def precompile(target: DecoderModel, gen: SpeculativeGenerator | None, prompt_length: int, max_new_tokens: int,
               progress: bool = True, single_row: bool = False, penalty: bool = False,
               defer: bool = False) -> list[GraphCache]:
    """Build the graphs a request needs before it runs (and is timed): the target's context, decode
    and verify graphs and a draft network's (``gen.proposer``'s, as declared; ``gen`` None: target only).
    For the compiling backends (compiled: graphs cached on disk).
    ``defer``: a model whose graphs are saved (``GraphCache.saves_graphs``) loads the saved ones now and runs
    the others eagerly until ``GraphCache.compile_deferred`` (a first run answers without waiting for the
    compiler); the ``GraphCache``s with deferred graphs are returned. Otherwise everything is built now and
    the list is empty.
    ``single_row``: also the context graphs of requests joining a running batch (serving).
    ``penalty``: the target's graphs apply a repetition penalty (drafts never do). Adaptive k and "padded"
    proposers verify 2 .. k + 1 tokens; a draft model re-reads up to k + 1 tokens after steps that skipped it
    (a ``MatchOrDraft``'s source drafted, or the gate's plain steps) and encodes prompts one row at a time."""
    from .eagle.proposer import EagleDraft
    from .eagle.tree import EagleTreeDraft
    from .fused import FusedSpeculator
    from .speculation.combined import MatchOrDraft
    proposer = None if gen is None else gen.proposer     # declared (speculation.proposer): abilities are attributes
    width = 1
    if proposer is not None:    # tree proposers say how many tokens a step verifies; a chain verifies k + 1
        width = proposer.verify_size or gen.k + 1
    # the last verify step may write up to width - 1 positions past the budget
    max_length = min(target.n_positions, prompt_length + max_new_tokens + width - 1)
    sampled = target.settings.sampling.do_sample

    def keys(model, spec: tuple[int, ...], step_probs: bool, rows: bool = single_row):
        # graph_keys marks multi-token steps as returning probabilities; speculation asks for them only
        # when sampling (verify; a draft model's steps too)
        out = model.graph_keys(spec_tokens=spec, prompt_length=prompt_length, max_length=max_length, single_row=rows)
        return [replace(k, return_probs=sampled) if k.n_logits == k.n_tokens and (k.n_tokens > 1 or step_probs)
                else k for k in out]

    def row_context(graph_keys):    # a draft model encodes each row's prompt alone (DraftModel.flush)
        return [k for k in graph_keys if k.single_row or k.n_logits == k.n_tokens]

    fused = gen is not None and isinstance(gen.speculator, FusedSpeculator)
    verify = (width,) if gen is not None and not fused else ()
    if gen is not None and not fused and (gen.speculator.adaptive is not None or "padded" in proposer.abilities):
        verify = tuple(range(2, width + 1))      # a step verifies 1 .. k drafts
    tree = proposer is not None and proposer.depth is not None     # verify compacts up to depth accepted slots
    todo = [(target, [replace(k, penalty=penalty) for k in keys(target, verify, False)],
             (proposer.depth,) if tree else ())]
    # a draft model skipped by its source (MatchOrDraft) or by the gate's plain steps catches up k + 1 tokens a step
    resyncs = isinstance(proposer, MatchOrDraft) or (gen is not None and gen.speculator.gate is not None)
    if proposer is not None and proposer.draft is not None:    # a combination: its model proposer's graphs
        proposer = proposer.draft
    draft = None if proposer is None else proposer.model
    if isinstance(proposer, EagleTreeDraft):   # greedy re-read and tree expansion steps
        todo.append((draft, proposer.draft_graph_keys(prompt_length, max_length, single_row), ()))
    elif fused:   # the draft's context graphs; its steps run inside the fused graphs, built below
        todo.append((draft, [k for k in row_context(draft.graph_keys(prompt_length=prompt_length, single_row=True))
                             if k.n_tokens > 1], ()))
    elif isinstance(proposer, EagleDraft):   # its own graph_keys: the k + 1 position re-read step
        todo.append((draft, draft.graph_keys(spec_tokens=(gen.k,), prompt_length=prompt_length,
                                             max_length=max_length, single_row=single_row), ()))
    elif isinstance(draft, DecoderModel):  # a draft model re-reads the last two tokens, then drafts one at a time
        todo.append((draft, row_context(keys(draft, tuple(range(2, gen.k + 2)) if resyncs else (2,), True, True)), ()))
    deferred = []
    for model, graph_keys, compaction_slots in todo:
        graph_keys = list(dict.fromkeys(graph_keys))
        later, verb = [], "compiling"
        if defer and not fused and model.graphs.saves_graphs:
            later = [k for k in graph_keys if not is_saved(model.graph_module(k), model.batch_size)]
            graph_keys, verb = [k for k in graph_keys if k not in later], "loading saved graphs"
        model._warm(graph_keys, f"{verb} ({model.settings.backend})", progress, compaction_slots)
        if later:
            model.graphs.defer(later)
            deferred.append(model.graphs)
    if fused:
        gen.speculator.compile(prompt_length + max_new_tokens, penalty=penalty, progress=progress)
    return deferred

