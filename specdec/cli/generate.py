"""``specdec generate``: generate from a prompt, target-only or speculative; text streams to stdout (token ids
with ``--prompt-ids``), a one-line summary (and ``--stats``) to stderr."""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..options import (
    ModelOptions,
    OptionError,
    SamplingOptions,
    SpeculationOptions,
    available_cores,
    default_threads,
    options_from,
    precompile,
)
from ..tools.arguments import (
    add_model_arguments,
    add_speculation_arguments,
    non_negative_int,
    positive_int,
    repetition_penalty_value,
    temperature_value,
    token_ids,
    top_p_value,
)
from .command import Command

NAME = "generate"
HELP = "generate from a prompt (chat template applied), target-only or speculative"
# OpenMP wait policy for `generate` when the user sets none. libgomp's default lets idle threads spin at
# every barrier; when another process holds one of the cores, every parallel region waits for the thread
# that shares it: measured on 2 cores (docs/cli.md, "Threads"), 2 spinning threads fell from 53 tok/s to 17
# beside one busy process and to 0.5-3 beside another OpenMP process; PASSIVE stays at 28-32 (but 31,
# not 53, on an idle machine: a thread wake-up per parallel region).
WAIT_POLICY = "PASSIVE"
STARTUP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")   # torch (imported above) has read it


@dataclass(frozen=True)
class GenerateOptions:
    """One ``generate`` request: the target (``model``), the proposer (``speculation``), how it samples
    (``sampling``), the prompt (text, chat template applied unless ``raw``; or ``prompt_ids``, the new ids
    printed instead of text), ``max_new_tokens``, ``ignore_eos``, ``stats`` (print the speculation
    statistics) and the intra-op ``threads`` (None: ``default_threads()``), split over the tp processes."""

    model: ModelOptions = field(default_factory=ModelOptions)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 128
    ignore_eos: bool = False
    raw: bool = False
    stats: bool = False
    threads: int | None = None


def add_arguments(g: argparse.ArgumentParser) -> None:
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


def checked_options(args: argparse.Namespace) -> GenerateOptions:
    """The parsed arguments as ``GenerateOptions``, their combinations checked before any model loads
    (``OptionError``); ``--draft-model`` resolved (``SpeculationOptions.checked``)."""
    found = options_from(GenerateOptions, args)
    if (found.prompt is None) == (found.prompt_ids is None):
        raise OptionError("give a prompt text or --prompt-ids (one of them)")
    if found.prompt_ids is not None and found.raw:
        raise OptionError("--raw applies to a text prompt, not to --prompt-ids")
    return replace(found, speculation=found.speculation.checked(found.model))


def run(args: argparse.Namespace) -> int:
    """The ``generate`` command: one process, or one per rank at ``--tp-degree`` > 1 (rank 0 prints)."""
    found = checked_options(args)
    found = replace(found, threads=found.threads or default_threads())
    warning = oversubscribed(found.threads)
    if warning:
        print(warning, file=sys.stderr)
    if found.model.tp_degree > 1 and found.model.backend != "neuron":   # neuron: one process for all cores
        from ..core.parallel import launch
        return launch(generate_on_rank, found.model.tp_degree, found, timeout_s=24 * 3600.0)
    return generate_on_rank(found)


def prompt_ids_of(options: GenerateOptions, target) -> list[int]:
    """The prompt's token ids: ``prompt_ids``, or the text through the target's tokenizer (and chat template)."""
    if options.prompt_ids is not None:
        return list(options.prompt_ids)
    from ..core.chat import chat_ids
    try:
        tok = target.tokenizer
    except (OSError, ValueError) as e:
        raise OptionError(f"cannot load a tokenizer for {target.path} ({str(e).splitlines()[0]}): "
                          "give the prompt as --prompt-ids") from None
    return list(tok(options.prompt)["input_ids"]) if options.raw else chat_ids(tok, options.prompt)


def generate_on_rank(options: GenerateOptions) -> int:
    """Load, compile what the request needs, generate (streaming text on rank 0) and print the summary."""
    from transformers import TextStreamer

    model, sampling = options.model, options.sampling
    torch.set_num_threads(model.threads_per_process(options.threads))
    target = model.load(sampling=sampling.config)
    rank0 = target.tp.rank == 0
    ids = prompt_ids_of(options, target)
    n_pos = model.n_positions
    if len(ids) >= n_pos:
        raise OptionError(f"the prompt has {len(ids)} tokens: --n-positions {n_pos} leaves no room for new tokens "
                          f"(give --n-positions > {len(ids)})")
    max_new = min(options.max_new_tokens, n_pos - len(ids))
    gen = options.speculation.make_generator(options.speculation.make_proposer(target), target)
    deferred = []
    if model.backend != "eager":
        deferred = precompile(target, gen, len(ids), max_new, penalty=sampling.repetition_penalty != 1,
                              progress=rank0, defer=True)
        if rank0 and deferred:
            print(f"specdec: {sum(len(g.pending) for g in deferred)} graphs are not compiled yet: this run generates "
                  "eagerly, then compiles them for later runs", file=sys.stderr)
    text = options.prompt_ids is None
    streamer = TextStreamer(target.tokenizer, skip_prompt=True, skip_special_tokens=True) if rank0 and text else None
    eos = [] if options.ignore_eos else None
    start = time.perf_counter()
    out = (gen or target).generate([ids], max_new_tokens=max_new, streamer=streamer, seed=sampling.seed,
                                   eos_token_id=eos, repetition_penalty=sampling.repetition_penalty)
    elapsed = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    if rank0:
        report(options, target, gen, ids, new, max_new, elapsed,
               f"{model.backend} (eager this run)" if deferred else model.backend)
    for graphs in deferred:
        graphs.compile_deferred(progress=rank0)
    return 0


def report(options: GenerateOptions, target, gen, ids: list[int], new: list[int], max_new: int,
           elapsed: float, backend: str) -> None:
    """Rank 0's output after generating: the new ids (``--prompt-ids``), a warning when ``n_positions``
    cut the output, the one-line summary (``backend``: how the run ran) and (``--stats``) the speculation
    statistics."""
    model, n_pos = options.model, options.model.n_positions
    text = options.prompt_ids is None
    if not text:
        print(",".join(str(t) for t in new), flush=True)
    n = len(new)
    eos_ids = set() if options.ignore_eos else set(target.config.eos_token_ids)
    if max_new < options.max_new_tokens and n == max_new and not (new and new[-1] in eos_ids):
        print(f"specdec: warning: output stopped at --n-positions {n_pos} (prompt {len(ids)} + {n} new tokens), "
              f"before --max-new-tokens {options.max_new_tokens}: give a larger --n-positions for longer outputs",
              file=sys.stderr)
    strategy = "target only" if gen is None else f"--draft {options.speculation.draft} k={gen.k}"
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s, {strategy}, {backend} {model.amp}, "
          f"{torch.get_num_threads()} thread{'s' * (torch.get_num_threads() > 1)}, "
          f"OMP_WAIT_POLICY={wait_policy()}, tp_degree {model.tp_degree}]",
          file=sys.stderr)
    if options.stats:
        print(format_stats(gen, n, elapsed), file=sys.stderr)


def format_stats(gen, n: int, elapsed: float) -> str:
    """``--stats``: tau, the acceptance rate, per-position acceptance and the time split (target only: tau 1)."""
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
# threads

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
    return (spec is not None and spec.name == "specdec.cli.__main__") or Path(sys.argv[0]).name == "specdec"


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


COMMANDS = [Command(NAME, HELP, add_arguments, run)]
