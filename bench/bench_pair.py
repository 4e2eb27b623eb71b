#!/usr/bin/env python
"""Same-run benchmark of the Qwen2.5-Coder pair: specdec against llama.cpp, on one machine, in one process run.

What it measures. Batch 1, greedy decoding with EOS ignored (every system generates exactly
``--max-new-tokens`` N new tokens; llama-speculative may overshoot by up to k and says how many it made), on
the chat-templated prompts of a prompt set, the target Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) and the
draft Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF):

- ``specdec-target``: ``DecoderModel.generate`` (the GGUF file's own Q4_K/Q6_K blocks on ``block_mm``);
- ``specdec-<strategy>-k<k>``: ``SpeculativeGenerator`` with ``model`` (``DraftModel`` of the draft GGUF),
  ``lookup`` (``PromptLookup``) or ``lookup+model`` (``LookupOrDraft``), for every k of ``--ks``; with
  ``--gate`` each of them also as ``...-gate``, with the cost gate (``gate=True``: a step speculates only while
  speculative steps emit tokens faster than plain ones); its meter starts afresh when timing starts (the warm-up
  runs do not teach it) and then learns over the prompts in turn, as a server's generator would;
- ``llamacpp-target``: ``llama-completion`` on the target GGUF;
- ``llamacpp-spec-k<k>``: ``llama-speculative`` with the draft GGUF, ``--spec-draft-n-max k`` (its greedy
  draft sampler gives every draft token p = 1, so each round drafts k tokens).

``--temperature T`` samples (temperature T, no top-k / top-p, seed = the prompt's index) and
``--batch-size B`` generates B prompts per call (``--num-prompts`` in groups of B; tok/s counts every row):
both measure specdec against its own target-only, so the llama.cpp systems run only greedy at batch 1, and
``identical_to_target`` is checked only greedy (sampled outputs differ by design; losslessness is the tests').

Every system runs on every prompt, prompt after prompt (all systems on prompt 1, then on prompt 2, ...), so
a slow spell of the machine hits every system alike. Each system first does untimed warm-up generations:
eagerly one of ``--warmup-tokens`` on the first prompt; with ``--backend compiled`` / ``regional`` one on
every prompt for ``--max-new-tokens``, so that no graph is compiled (or loaded from the compile cache) while
a run is timed; llama.cpp's warm-up runs fill the page cache with its GGUF files.
specdec systems are timed as a user waits: wall clock around the ``generate`` call (prefill included),
``e2e_tok_s`` = N / seconds; ``decode_tok_s`` = (N - 1) / (time of the last token - time of the first),
taken from a streamer in the same call. llama.cpp's figures are its own timing lines (``LlamaCppRun``):
``e2e_tok_s`` = generated tokens / (prefill + decoding), model loading excluded.
τ (mean acceptance length) = 1 + accepted / speculation steps, pooled over prompts; for llama-speculative
the steps are its draft rounds, gen_tokens - 1 - n_accept (each round emits its accepted tokens + 1, the
first token comes from the prefill).

llama.cpp gets the same templated text (``tokenizer.decode(chat ids)``; it parses the special tokens) and
the number of prompt tokens it reports is recorded next to ours (``prompt_tokens_match``). Greedy outputs:
every speculative specdec system must equal ``specdec-target`` token for token (``identical_to_target``);
llama.cpp's text is compared with specdec-target's decoded text (``text_equal_to_specdec``,
``common_prefix_chars``): llama.cpp's numerics differ, so that comparison is only informational.

llama.cpp runs as its users run it: the inherited environment (OpenMP threads spin at barriers; run on an
idle machine), plus any ``--llamacpp-env KEY=VALUE`` (e.g. ``OMP_WAIT_POLICY=PASSIVE`` on a busy one);
``config.llamacpp_setup.env`` records both.

Command (the full run; progress lines go to stderr, the JSON to stdout and ``--output``)::

    python bench/bench_pair.py --prompts code --num-prompts 16 --max-new-tokens 96 --threads 2 --ks 4 \\
        --strategies none,model,lookup,lookup+model --output bench/results/pair_code.json

JSON keys: ``command`` (argv), ``commit`` (short hash, ``+dirty`` with uncommitted changes), ``machine``
(``specdec.tools.bench.runtime.machine_info``), ``config`` (settings, model and GGUF paths, prompt ids and
token counts, ``llamacpp_setup``: llama.cpp's build, GGUF files and env), ``systems`` (per system: medians
over prompts of ``e2e_tok_s`` and ``decode_tok_s``, pooled ``tau`` and ``acceptance``, ``by_category``
medians, the output checks), ``per_prompt`` (each prompt's raw numbers per system: seconds, rates, stats,
our tokens; llama.cpp's timings, text and command line) and ``ratios`` (every system's median e2e tok/s ÷
``llamacpp-target``'s and ÷ ``specdec-target``'s, decode likewise, and the best speculative specdec system ÷
the best ``llamacpp-spec-k*``). ``bench_pair.py --table RESULT.json`` prints a result's markdown table (the
docs' table is generated so). Ctrl-C abandons the generation under way and prints what was measured so far
(``interrupted: true``, exit code 130).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specdec import DecoderModel, DraftModel, SpecStats, SpeculativeGenerator
from specdec.core.chat import chat_ids
from specdec.core.named_models import is_named_model, named_model_path
from specdec.registry import REGISTRY, name_list
from specdec.speculation.gate import GateMeter
from specdec.tools.arguments import draft_p_min_value, int_list, positive_int
from specdec.tools.bench import emit_json
from specdec.tools.bench.llamacpp import (
    LlamaCppRun,
    llamacpp_bin_dir,
    run_completion,
    run_speculative,
)
from specdec.tools.bench.prompts import load_records, resolve_prompts
from specdec.tools.bench.runtime import git_commit, machine_info

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
STRATEGIES = tuple(name for name, s in REGISTRY.items()
                   if s.kind != "tree" and s.part in (None, "model") and s.suffix is None)
"""The registry's strategies the pair runs: target only, the draft model, prompt lookup, both (none, model,
lookup, lookup+model): the 0.5B is the pair's one draft network. (Suffix decoding learns across requests:
``bench/bench_suffix.py`` measures it on workloads that repeat.)"""
SPECDEC_TARGET, LLAMACPP_TARGET = "specdec-target", "llamacpp-target"
ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "GGML_", "LLAMA_")   # inherited variables that can change llama.cpp


# ---------------------------------------------------------------------------------------------- config
@dataclass
class Config:
    """The parsed command line."""

    prompts: str
    num_prompts: int
    per_category: int | None
    max_new_tokens: int
    threads: int
    ks: list[int]
    strategies: list[str]
    model: str
    draft_model: str
    draft_vocab: int | None
    draft_quantization: str | None
    draft_p_min: float | None
    draft_window: int | None
    draft_variants: list[str] | None
    gate: bool
    temperature: float
    batch_size: int
    backend: str
    amp: str
    quantization: str | None
    n_positions: int
    context_buckets: list[int] | None
    prompt_weights: str | None
    warmup_tokens: int
    llamacpp: bool
    llamacpp_env: dict[str, str]
    output: str | None


def _env_pair(text: str) -> tuple[str, str]:
    """argparse type: ``"KEY=VALUE"`` -> ``("KEY", "VALUE")``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line as a ``Config``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", default="code", help="prompt set ('code', 'mt-bench', 'varied') or an MT-Bench jsonl")
    p.add_argument("--num-prompts", type=int, default=16, help="the first N prompts of the set")
    p.add_argument("--per-category", type=int, default=None, metavar="N",
                   help="the first N prompts of every category of the set (in file order) instead of --num-prompts")
    p.add_argument("--max-new-tokens", type=int, default=96, help="N: new tokens per prompt (EOS ignored)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads and llama.cpp -t/-tb (default: the CPUs this process may use)")
    p.add_argument("--ks", type=int_list, default=[4], help="draft lengths, comma-separated")
    p.add_argument("--strategies", type=name_list(STRATEGIES), default=list(STRATEGIES),
                   help=f"specdec strategies, comma-separated, of {', '.join(STRATEGIES)} "
                        "(none = no speculative system; specdec-target always runs)")
    p.add_argument("--model", default=TARGET, help="target: a named model, a .gguf file or a checkpoint directory")
    p.add_argument("--draft-model", default=DRAFT, help="draft: a named model, a .gguf file or a checkpoint")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="also run every draft-model strategy with a second copy of the draft that scores only token "
                        "ids [0, N) (output_vocab_size; systems named ...-v<N>)")
    p.add_argument("--draft-quantization", default=None, metavar="Q",
                   help="also run every draft-model strategy with a copy of each draft loaded with quantization Q "
                        "(e.g. q4_0; systems named ...-<Q>)")
    p.add_argument("--draft-p-min", type=draft_p_min_value, default=None, metavar="P",
                   help="also run every draft-model strategy with the draft's confidence stop at P (DraftModel's "
                        "p_min, on the same weights; systems named ...-p<P>)")
    p.add_argument("--draft-window", type=positive_int, default=None, metavar="W",
                   help="also run each of those drafts encoding at most W tokens of a row at once (DraftModel's "
                        "window, on the same weights; systems named ...-w<W>)")
    p.add_argument("--draft-variants", type=lambda text: text.split(","), default=None, metavar="NAMES",
                   help="run only these drafts of the ones above, comma-separated by their system-name suffix "
                        "('base' for the plain draft; e.g. q4_0-p0.7,v65536-q4_0-p0.7); default: all")
    p.add_argument("--gate", action="store_true",
                   help="also run every speculative system with the cost gate (gate=True), named ...-gate")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; T > 0: sample at temperature T (specdec systems only: implies --no-llamacpp)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts per generate call (B > 1: specdec systems only, implies --no-llamacpp)")
    p.add_argument("--backend", choices=("eager", "compiled", "regional"), default="eager")
    p.add_argument("--amp", choices=("f32", "bf16"), default="f32")
    p.add_argument("--quantization", default="gguf", help="DecoderModel quantization ('none' for None)")
    p.add_argument("--n-positions", type=int, default=1024, help="KV positions (also llama.cpp's -c)")
    p.add_argument("--context-buckets", type=int_list, default=None,
                   help="prompt-length buckets, comma-separated (default: the runtime's powers of two from 128; "
                        "eager graphs cost nothing per bucket, so fine buckets waste no padding)")
    p.add_argument("--prompt-weights", default=None, choices=["bf16"],
                   help="every specdec model (target and drafts) encodes prompts with dense bf16 copies of its GGML "
                        "blocks (DecoderModel.from_pretrained(prompt_weights=...))")
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="new tokens of the untimed warm-up generation on the eager backend (compiling backends warm "
                        "up on every prompt for --max-new-tokens)")
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="skip the llama.cpp systems")
    p.add_argument("--llamacpp-env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for llama.cpp's runs (repeatable; default: the inherited env)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if a.max_new_tokens < 2 or min(a.num_prompts, a.per_category or 1, a.threads, a.warmup_tokens, a.batch_size,
                                    *a.ks) < 1:
        p.error("--max-new-tokens must be >= 2, --num-prompts, --per-category, --threads, --warmup-tokens, "
                "--batch-size and every k >= 1")
    if a.temperature < 0:
        p.error("--temperature must be >= 0 (0: greedy)")
    if a.draft_variants is not None:
        known = [variant_name(suffix) for suffix in draft_specs(a.draft_vocab, a.draft_quantization, a.draft_p_min,
                                                                a.draft_window)]
        unknown = [name for name in a.draft_variants if name not in known]
        if unknown:
            p.error(f"--draft-variants: no draft named {', '.join(unknown)} (these flags make {', '.join(known)})")
    if a.temperature > 0 or a.batch_size > 1:
        a.llamacpp = False      # llama.cpp's systems are the greedy batch-1 comparison
    return Config(prompts=a.prompts, num_prompts=a.num_prompts, per_category=a.per_category,
                  max_new_tokens=a.max_new_tokens, threads=a.threads,
                  ks=list(dict.fromkeys(a.ks)), strategies=a.strategies, model=a.model, draft_model=a.draft_model,
                  draft_vocab=a.draft_vocab, draft_quantization=a.draft_quantization, draft_p_min=a.draft_p_min,
                  draft_window=a.draft_window, draft_variants=a.draft_variants, gate=a.gate,
                  temperature=a.temperature, batch_size=a.batch_size,
                  backend=a.backend, amp=a.amp, quantization=None if a.quantization == "none" else a.quantization,
                  n_positions=a.n_positions, context_buckets=a.context_buckets, prompt_weights=a.prompt_weights,
                  warmup_tokens=a.warmup_tokens,
                  llamacpp=a.llamacpp, llamacpp_env=dict(a.llamacpp_env), output=a.output)


def log(message: str) -> None:
    """A progress line on stderr."""
    print(message, file=sys.stderr, flush=True)


def gguf_file(name_or_path: str) -> Path:
    """The GGUF file llama.cpp reads for a named model or a ``.gguf`` path (ValueError otherwise)."""
    if is_named_model(name_or_path):
        return named_model_path(name_or_path)
    if str(name_or_path).endswith(".gguf") and Path(name_or_path).is_file():
        return Path(name_or_path)
    raise ValueError(f"llama.cpp reads GGUF files only: {name_or_path!r} is neither a named model nor a .gguf "
                     "file (pass --no-llamacpp)")


# ---------------------------------------------------------------------------------------------- systems
@dataclass
class OurSystem:
    """A specdec system: its generate call and, for speculative ones, the last call's ``SpecStats``."""

    name: str
    strategy: str
    k: int | None
    generate: Callable[..., torch.Tensor]
    last_stats: Callable[[], SpecStats] | None = None
    gate_meter: GateMeter | None = None       # the cost gate's measurements (``-gate`` systems)
    reset_gate: Callable[[], None] | None = None     # forgets them (and a combination's draft meter)


@dataclass
class LlamaSystem:
    """A llama.cpp system: ``k`` None is ``llama-completion``, else ``llama-speculative`` drafting k."""

    name: str
    k: int | None


def load_target(cfg: Config) -> DecoderModel:
    """The target model, loaded once."""
    return DecoderModel.from_pretrained(cfg.model, quantization=cfg.quantization, amp=cfg.amp, backend=cfg.backend,
                                        batch_size=cfg.batch_size, n_positions=cfg.n_positions,
                                        context_buckets=cfg.context_buckets, prompt_weights=cfg.prompt_weights)


def our_systems(cfg: Config, target: DecoderModel) -> dict[str, OurSystem]:
    """``specdec-target`` and one ``specdec-<strategy>-k<k>`` per strategy (not none) and k; one draft model
    (loaded only if a strategy needs it) serves every system that drafts with it. With ``draft_vocab`` N, every
    draft-model strategy also runs as ``specdec-<strategy>-k<k>-v<N>`` on a draft scoring ids [0, N) only; with
    ``draft_quantization`` Q, each of those drafts also as ``...-<Q>``, loaded with ``quantization=Q``; with
    ``draft_p_min`` P, each of those also as ``...-p<P>`` (the same weights, ``DraftModel(model, p_min=P)``); with
    ``draft_window`` W, each of those also as ``...-w<W>`` (``DraftModel(model, p_min, window=W)``)."""
    systems = {SPECDEC_TARGET: OurSystem(SPECDEC_TARGET, "none", None, target.generate)}
    drafts: dict[str, DraftModel | None] = {"": None}
    if any(REGISTRY[s].part == "model" for s in cfg.strategies):
        specs = draft_specs(cfg.draft_vocab, cfg.draft_quantization, cfg.draft_p_min, cfg.draft_window)
        if cfg.draft_variants is not None:
            specs = {suffix: spec for suffix, spec in specs.items() if variant_name(suffix) in cfg.draft_variants}
        models: dict[tuple, DecoderModel] = {}     # one copy of the weights per load, shared by its variants
        drafts = {}
        for suffix, (overrides, p_min, window) in specs.items():
            key = tuple(sorted(overrides.items()))
            if key not in models:
                log(f"loading the draft {cfg.draft_model}{f' {overrides}' if overrides else ''} ...")
                # (the target's scheme unless a variant gives one: no named draft's preset, as the names say)
                models[key] = REGISTRY["model"].build(target, cfg.draft_model,
                                                      **{"quantization": cfg.quantization, **overrides}).model
            drafts[suffix] = DraftModel(models[key], p_min=p_min, window=window)
    for strategy in cfg.strategies:
        if strategy == "none":
            continue
        for k in cfg.ks:
            for suffix, draft in drafts.items() if REGISTRY[strategy].part == "model" else [("", None)]:
                for gate in (False, True)[:1 + cfg.gate]:
                    gen = SpeculativeGenerator(REGISTRY[strategy].build(target, part=draft), target, k, gate=gate)
                    name = f"specdec-{strategy}-k{k}{suffix}{'-gate' if gate else ''}"
                    systems[name] = OurSystem(name, strategy, k, gen.generate, lambda gen=gen: gen.last_stats,
                                              gen.gate_meter, gen.reset_gate)
    return systems


def draft_specs(vocab: int | None, quantization: str | None, p_min: float | None,
                window: int | None = None) -> dict[str, tuple[dict[str, object], float | None, int | None]]:
    """The drafts of ``--draft-vocab`` / ``--draft-quantization`` / ``--draft-p-min`` / ``--draft-window``, by
    system-name suffix ("": the plain draft; ``-v<N>``, ``-<Q>``, ``-p<P>``, ``-w<W>`` and their combinations) →
    (``from_pretrained`` overrides, ``p_min``, ``window``)."""
    loads: dict[str, dict[str, object]] = {"": {}}
    if vocab is not None:
        loads[f"-v{vocab}"] = {"output_vocab_size": vocab}
    if quantization is not None:
        loads |= {f"{name}-{quantization}": kw | {"quantization": quantization} for name, kw in list(loads.items())}
    specs = {name: (kw, None, None) for name, kw in loads.items()}
    if p_min is not None:
        specs |= {f"{name}-p{p_min:g}": (kw, p_min, None) for name, kw in loads.items()}
    if window is not None:
        specs |= {f"{name}-w{window}": (kw, p, window) for name, (kw, p, _) in list(specs.items())}
    return specs


def variant_name(suffix: str) -> str:
    """``--draft-variants``' name of a draft's system-name suffix (``base``: the plain draft)."""
    return suffix.lstrip("-") or "base"


def llama_systems(cfg: Config) -> dict[str, LlamaSystem]:
    """``llamacpp-target`` and one ``llamacpp-spec-k<k>`` per k (none with ``--no-llamacpp``)."""
    if not cfg.llamacpp:
        return {}
    systems = {LLAMACPP_TARGET: LlamaSystem(LLAMACPP_TARGET, None)}
    systems |= {f"llamacpp-spec-k{k}": LlamaSystem(f"llamacpp-spec-k{k}", k) for k in cfg.ks}
    return systems


# ---------------------------------------------------------------------------------------------- runs
class TokenClock:
    """HF streamer protocol: the first ``put`` is the prompt, then one per emitted token; records the times."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def sampling(cfg: Config, seed: int) -> dict:
    """The generate arguments of ``cfg``'s decoding: greedy, or temperature sampling seeded with ``seed``."""
    if cfg.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": cfg.temperature, "top_k": 0, "top_p": 1.0, "seed": seed}


def run_ours(system: OurSystem, group: list[list[int]], n_new: int, decoding: dict) -> dict:
    """One timed generation of a group of prompts (one row each): the new tokens per row, wall seconds, e2e and
    decode tok/s over every row, (speculative) the stats and (gated) the gate's speculative and plain steps."""
    clock = TokenClock()
    meter = system.gate_meter
    before = dict(meter.steps) if meter is not None else {}
    start = time.perf_counter()
    out = system.generate(group, max_new_tokens=n_new, eos_token_id=[], streamer=clock, **decoding)
    seconds = time.perf_counter() - start
    width = max(len(ids) for ids in group)
    tokens = [row[width:].tolist() for row in out]
    if any(len(t) != n_new for t in tokens):
        raise RuntimeError(f"{system.name} generated {[len(t) for t in tokens]} tokens, not {n_new} per row")
    decode_s = clock.times[-1] - clock.times[1] if len(clock.times) > 2 else 0.0
    rows = len(group)
    result = {"tokens": tokens if rows > 1 else tokens[0], "seconds": seconds, "e2e_tok_s": rows * n_new / seconds,
              "decode_tok_s": rows * (n_new - 1) / decode_s if decode_s > 0 else None}
    if system.last_stats is not None:
        st = system.last_stats()
        result |= {"steps": st.steps, "drafted": st.drafted, "accepted": st.accepted,
                   "tau": st.mean_acceptance_length, "acceptance": st.acceptance_rate}
    if meter is not None:      # the gate's choices in this call: speculative and plain steps
        result["gate_steps"] = {kind: meter.steps[speculated] - before[speculated]
                                for kind, speculated in (("speculative", True), ("plain", False))}
    return result


def run_llama(system: LlamaSystem, bin_dir: Path, target_gguf: Path, draft_gguf: Path | None, text: str,
              n_new: int, cfg: Config) -> LlamaCppRun:
    """One llama.cpp run of ``text`` (the templated prompt) with EOS ignored."""
    kw = {"threads": cfg.threads, "ctx": cfg.n_positions, "ignore_eos": True, "env": cfg.llamacpp_env or None}
    if system.k is None:
        return run_completion(bin_dir, target_gguf, text, n_new, **kw)
    assert draft_gguf is not None
    return run_speculative(bin_dir, target_gguf, draft_gguf, text, n_new, n_draft=system.k, **kw)


def llama_entry(run: LlamaCppRun, n_new: int, our_text: str | None) -> dict:
    """A llama.cpp run's numbers for ``per_prompt``: its rates, τ (speculative) and the text comparison."""
    entry = {"prompt_tokens": run.prompt_tokens, "gen_tokens": run.gen_tokens, "prompt_ms": run.prompt_ms,
             "gen_ms": run.gen_ms, "e2e_tok_s": run.e2e_tok_s, "decode_tok_s": run.decode_tok_s,
             "wall_s_with_load": run.wall_s, "text": run.text, "command": run.command}
    if run.n_accept is not None:
        rounds = run.gen_tokens - 1 - run.n_accept
        entry |= {"steps": rounds, "drafted": run.n_drafted, "accepted": run.n_accept,
                  "tau": 1 + run.n_accept / rounds if rounds > 0 else None, "acceptance": run.acceptance}
    if our_text is not None:
        entry |= compare_text(our_text, run.text, overshoot=run.gen_tokens > n_new)
    return entry


def compare_text(ours: str, theirs: str, overshoot: bool) -> dict:
    """Whether llama.cpp's text equals ours (a prefix of it when llama.cpp generated more than N tokens), and the
    length of the common prefix in characters."""
    prefix = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        prefix += 1
    equal = theirs == ours or (overshoot and theirs.startswith(ours))
    return {"text_equal_to_specdec": equal, "common_prefix_chars": prefix, "specdec_text_chars": len(ours)}


def warm_up(ours: dict[str, OurSystem], llamas: dict[str, LlamaSystem], groups: list[list[list[int]]],
            texts: list[str], cfg: Config, llama_files: tuple[Path, Path, Path | None] | None) -> None:
    """One untimed generation of every system. On a compiling backend our systems run every prompt for the
    full ``max_new_tokens``, so every graph the timed runs use (prompt bucket, KV buckets, verify widths) is
    compiled or loaded before timing starts; eagerly, one short generation warms the kernels."""
    compiling = cfg.backend != "eager"
    warm = groups if compiling else groups[:1]
    n_new = cfg.max_new_tokens if compiling else cfg.warmup_tokens
    for name, system in ours.items():
        start = time.perf_counter()
        for i, group in enumerate(warm):
            system.generate(group, max_new_tokens=n_new, eos_token_id=[], **sampling(cfg, i))
        if system.reset_gate is not None:
            system.reset_gate()             # the timed runs teach the gate from scratch
        log(f"warm-up {name}: {time.perf_counter() - start:.1f} s")
    for name, system in llamas.items():
        assert llama_files is not None
        start = time.perf_counter()
        run_llama(system, *llama_files, texts[0], cfg.warmup_tokens, cfg)
        log(f"warm-up {name}: {time.perf_counter() - start:.1f} s")


def bench_prompt(group: list[list[int]], text: str, ours: dict[str, OurSystem], llamas: dict[str, LlamaSystem],
                 cfg: Config, tokenizer, llama_files, entry: dict, where: str, seed: int) -> None:
    """Run every system on one group of prompts (one prompt at batch 1; ``text``: its templated text, for
    llama.cpp), filling ``entry["systems"]`` as results come (kept if interrupted)."""
    n_new = cfg.max_new_tokens
    reference: list[int] | None = None
    our_text: str | None = None
    for name, system in ours.items():
        res = run_ours(system, group, n_new, sampling(cfg, seed))
        if name == SPECDEC_TARGET:
            reference = res["tokens"]
            if len(group) == 1:
                our_text = tokenizer.decode(reference, skip_special_tokens=True).strip("\n")
                res["text"] = our_text
        elif reference is not None and cfg.temperature == 0:
            res["identical_to_target"] = res["tokens"] == reference
        entry["systems"][name] = res
        log(f"{where} {name}: {_describe(res)}")
    for name, system in llamas.items():      # batch 1: group is one prompt
        run = run_llama(system, *llama_files, text, n_new, cfg)
        res = llama_entry(run, n_new, our_text)
        res["prompt_tokens_match"] = run.prompt_tokens == len(group[0])
        if not res["prompt_tokens_match"]:
            log(f"{where} WARNING: llama.cpp read {run.prompt_tokens} prompt tokens, specdec {len(group[0])}")
        entry["systems"][name] = res
        log(f"{where} {name}: {_describe(res)}")


def _describe(res: dict) -> str:
    """A result as one progress line."""
    parts = [f"e2e {res['e2e_tok_s']:.2f} tok/s"]
    if res.get("decode_tok_s"):
        parts.append(f"decode {res['decode_tok_s']:.2f} tok/s")
    if res.get("tau") is not None:
        parts.append(f"tau {res['tau']:.2f}")
    if "identical_to_target" in res:
        parts.append("identical" if res["identical_to_target"] else "DIFFERS from specdec-target")
    if "text_equal_to_specdec" in res:
        parts.append(f"text {'equal' if res['text_equal_to_specdec'] else 'differs'} "
                     f"({res['common_prefix_chars']}/{res['specdec_text_chars']} chars in common)")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------- summary
def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _pooled_tau(results: list[dict]) -> dict:
    """τ = 1 + Σ accepted / Σ steps and acceptance = Σ accepted / Σ drafted over ``results`` (speculative only)."""
    spec = [r for r in results if "steps" in r]
    if not spec:
        return {}
    steps, drafted, accepted = (sum(r[key] for r in spec) for key in ("steps", "drafted", "accepted"))
    return {"tau": 1 + accepted / steps if steps else None, "acceptance": accepted / drafted if drafted else None}


def summarize_system(name: str, per_prompt: list[dict], kind: str, strategy: str | None, k: int | None) -> dict:
    """One system's summary: medians over prompts, pooled τ, per-category medians and the output checks."""
    rows = [(p["category"], p["systems"][name]) for p in per_prompt if name in p["systems"]]
    results = [r for _, r in rows]
    summary = {"kind": kind, "strategy": strategy, "k": k, "prompts": len(results),
               "e2e_tok_s": _median([r["e2e_tok_s"] for r in results]),
               "decode_tok_s": _median([r.get("decode_tok_s") for r in results]), **_pooled_tau(results)}
    by_category: dict[str, list[dict]] = {}
    for category, r in rows:
        by_category.setdefault(category, []).append(r)
    summary["by_category"] = {c: {"prompts": len(rs), "e2e_tok_s": _median([r["e2e_tok_s"] for r in rs]),
                                  "decode_tok_s": _median([r.get("decode_tok_s") for r in rs]), **_pooled_tau(rs)}
                              for c, rs in by_category.items()}
    for key in ("identical_to_target", "text_equal_to_specdec", "prompt_tokens_match"):
        flags = [r[key] for r in results if key in r]
        if flags:
            summary[key] = all(flags)
            summary[f"{key}_count"] = sum(flags)
    return summary


def ratios(systems: dict[str, dict]) -> dict:
    """Median e2e (and decode) tok/s of each system ÷ both targets', and best speculative ÷ best llama.cpp spec."""
    out: dict[str, object] = {}
    for metric, prefix in (("e2e_tok_s", ""), ("decode_tok_s", "decode_")):
        for base in (LLAMACPP_TARGET, SPECDEC_TARGET):
            ref = systems.get(base, {}).get(metric)
            if ref:
                out[f"{prefix}vs_{base}"] = {n: s[metric] / ref for n, s in systems.items() if s.get(metric)}
    ours = {n: s["e2e_tok_s"] for n, s in systems.items()
            if s["kind"] == "specdec" and s["strategy"] != "none" and s["e2e_tok_s"]}
    theirs = {n: s["e2e_tok_s"] for n, s in systems.items() if n.startswith("llamacpp-spec-") and s["e2e_tok_s"]}
    if ours and theirs:
        best, best_llama = max(ours, key=ours.get), max(theirs, key=theirs.get)
        out["best_speculative_vs_best_llamacpp_spec"] = {
            "specdec": best, "specdec_e2e_tok_s": ours[best], "llamacpp": best_llama,
            "llamacpp_e2e_tok_s": theirs[best_llama], "ratio": ours[best] / theirs[best_llama]}
    return out


def summarize(per_prompt: list[dict], ours: dict[str, OurSystem], llamas: dict[str, LlamaSystem]) -> dict:
    """Every system's summary (``systems`` in the JSON)."""
    systems = {n: summarize_system(n, per_prompt, "specdec", s.strategy, s.k) for n, s in ours.items()}
    systems |= {n: summarize_system(n, per_prompt, "llamacpp", None if s.k is None else "model", s.k)
                for n, s in llamas.items()}
    return systems


def llama_config(cfg: Config, bin_dir: Path, files: tuple[Path, Path, Path | None]) -> dict:
    """llama.cpp's build, GGUF files and environment (the inherited variables that matter plus ``--llamacpp-env``)."""
    build_info = bin_dir.parent / "build.json"
    inherited = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    return {"bin_dir": str(bin_dir), "build": json.loads(build_info.read_text()) if build_info.is_file() else None,
            "target_gguf": str(files[1]), "draft_gguf": str(files[2]),
            "env": {"inherited": inherited, "added": cfg.llamacpp_env}, "threads": cfg.threads,
            "ctx": cfg.n_positions, "ignore_eos": True}


def decoding_label(cfg: dict) -> str:
    """"greedy" or "T = t" for a result's config (results written before sampling runs existed are greedy)."""
    return f"T = {cfg['temperature']}" if cfg.get("temperature") else "greedy"


def markdown_table(result: dict) -> str:
    """The README / docs table of a result JSON: one line per system, medians over prompts."""
    systems, machine = result["systems"], result["machine"]
    vs_llama = result["ratios"].get(f"vs_{LLAMACPP_TARGET}", {})
    vs_ours = result["ratios"].get(f"vs_{SPECDEC_TARGET}", {})
    lines = ["| system | e2e tok/s | decode tok/s | τ | × llama.cpp target | × specdec target | greedy output |",
             "|---|---|---|---|---|---|---|"]
    for name, s in systems.items():
        check = ""
        for key, label in (("identical_to_target", "tokens = specdec-target"),
                           ("text_equal_to_specdec", "text = specdec-target")):
            if key in s:
                check = f"{s[f'{key}_count']}/{s['prompts']} {label}"
        tau, llama, own = (f"{v:.2f}" if v else "—" for v in (s.get("tau"), vs_llama.get(name), vs_ours.get(name)))
        lines.append(f"| {name} | {s['e2e_tok_s']:.2f} | {s['decode_tok_s'] or 0:.2f} | {tau} | {llama} | {own} | "
                     f"{check} |")
    cfg = result["config"]
    lines.append("")
    batch, prompts = cfg.get("batch_size", 1), len(cfg["question_ids"])
    over = f"{prompts} prompts" if batch == 1 else f"{-(-prompts // batch)} calls of {batch} prompts ({prompts} in all)"
    family = f", family/model {machine['cpu_family_model']}" if machine.get("cpu_family_model") else ""
    if cfg.get("per_category"):
        per = cfg["per_category"]
        over += f" (the first {'' if per == 1 else f'{per} '}of each category)"
    lines.append(f"Medians over {over} of `{Path(cfg['prompt_file']).stem}`, "
                 f"{cfg['max_new_tokens']} new tokens (EOS ignored), {decoding_label(cfg)}, "
                 f"batch {batch}, {cfg['threads']} threads, "
                 f"{cfg['backend']} {cfg['amp']} `{cfg['quantization']}`"
                 f"{' with bf16 prompt weights' if cfg.get('prompt_weights') else ''}; {machine['cpu_model']} "
                 f"({machine['cpu_capability']}{family}), commit {result['commit']}.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Load, warm up, run every system on every prompt, print the JSON; 0, or 130 when interrupted.
    ``--table RESULT.json``: print that result's markdown table instead."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--table"]:
        if len(argv) != 2:
            raise SystemExit("usage: bench_pair.py --table RESULT.json")
        print(markdown_table(json.loads(Path(argv[1]).read_text())))
        return 0
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    torch.set_grad_enabled(False)
    result: dict = {"command": " ".join([sys.executable, *sys.argv]), "commit": git_commit(),
                    "machine": machine_info()}
    records = load_records(cfg.prompts, None if cfg.per_category else cfg.num_prompts, per_category=cfg.per_category)
    log(f"loading the target {cfg.model} ({cfg.quantization}, {cfg.amp}, {cfg.backend}) ...")
    target = load_target(cfg)
    tokenizer = target.tokenizer
    prompts = [chat_ids(tokenizer, text) for _, _, text in records]
    texts = [tokenizer.decode(ids) for ids in prompts]
    groups = [prompts[i:i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
    needed = max(len(p) for p in prompts) + cfg.max_new_tokens + max(cfg.ks) + 1
    if needed > cfg.n_positions:
        raise SystemExit(f"--n-positions {cfg.n_positions} is too small: the longest prompt + N + a verify step "
                         f"needs {needed}")
    ours, llamas = our_systems(cfg, target), llama_systems(cfg)
    llama_files = None
    config = {**asdict(cfg), "prompt_file": str(resolve_prompts(cfg.prompts)),
              "question_ids": [q for q, _, _ in records], "categories": [c for _, c, _ in records],
              "prompt_tokens": [len(p) for p in prompts], "model_path": str(target.path),
              "systems": [*ours, *llamas], "torch_threads": torch.get_num_threads(),
              "decoding": f"{decoding_label(asdict(cfg))}, EOS ignored"}
    if llamas:
        bin_dir = llamacpp_bin_dir(build=False)
        draft_gguf = gguf_file(cfg.draft_model) if len(llamas) > 1 else None
        llama_files = (bin_dir, gguf_file(cfg.model), draft_gguf)
        config["llamacpp_setup"] = llama_config(cfg, bin_dir, llama_files)
    result["config"] = config
    per_prompt: list[dict] = []
    interrupted = False
    try:
        warm_up(ours, llamas, groups, texts, cfg, llama_files)
        for i, group in enumerate(groups):
            first = i * cfg.batch_size
            batch = records[first:first + len(group)]
            categories = {c for _, c, _ in batch}
            entry = {"id": batch[0][0] if len(batch) == 1 else [q for q, _, _ in batch],
                     "category": categories.pop() if len(categories) == 1 else "mixed",
                     "prompt_tokens": len(group[0]) if len(group) == 1 else [len(ids) for ids in group],
                     "systems": {}}
            per_prompt.append(entry)
            where = f"[{i + 1}/{len(groups)} q={entry['id']} {entry['category']}, {entry['prompt_tokens']} prompt " \
                    "tokens]"
            bench_prompt(group, texts[first], ours, llamas, cfg, tokenizer, llama_files, entry, where, seed=i)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: reporting what was measured so far")
    result["systems"] = summarize(per_prompt, ours, llamas)
    result["per_prompt"] = per_prompt
    result["ratios"] = ratios(result["systems"])
    if interrupted:
        result["interrupted"] = True
    emit_json(result, cfg.output)
    return 130 if interrupted else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:       # during loading, before anything was measured
        log("interrupted")
        sys.exit(130)
