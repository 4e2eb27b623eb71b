"""Runtime benchmark: target-only greedy decoding, batch 1, specdec vs ``transformers``.

Every system runs in its own subprocess (``python -m specdec.tools.bench.runtime --worker SYSTEM ...``), which
gives each a clean peak RSS and lets compiled systems be timed with an empty Inductor cache (cold)
and again reusing it (cached). The parent tokenizes the prompts once (so every system decodes the
same token ids), measures the machine's memory read bandwidth, starts the workers one after the
other, and computes the ratios and the bandwidth bound.

Systems:
  hf-eager-f32           transformers ``generate`` (dynamic cache, eager), float32
  hf-compile-f32         transformers ``generate`` with a static cache and its ``compile_config``
                         mechanism (decode step compiled by ``torch.compile``), float32
  specdec-eager-f32/bf16 specdec ``DecoderModel.generate``, eager backend
  specdec-compiled-f32/bf16  specdec, ``compiled`` backend (one graph per bucket)
  specdec-compiled-int8/int4 the same, bf16 activations, weight-only int8 / int4 projections
  specdec-compiled-gguf  the same, ``quantization="gguf"``: the GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks,
                         LM head included (skipped with a note when ``--model`` is no .gguf file)
  specdec-tuned-bf16/int8/int4/gguf  the compiled systems with ``autotune=True`` (weights frozen into
                         the graphs, each matmul's kernel chosen by timing); run only when named or ``all``
                         (minutes of autotuning per cold compile)
  specdec-xla-f32        specdec, ``xla`` backend on the process's PJRT device (XLA:CPU unless PJRT_DEVICE says
                         otherwise): needs torch-xla (``pip install "specdec[xla]"``, the ``.venv-xla`` of
                         ``.ci/run``), run only when named or ``all``; skipped with a note without torch_xla.
                         Its compile time is XLA's first compilation of each graph (no on-disk cache)
  llamacpp-gguf          llama.cpp (``llama-cpp-python``, optional: not installed with specdec, not run unless
                         named or ``all``) on the ``--model``'s GGUF file, its quantized weights as they are;
                         skipped with a note when ``llama_cpp`` is missing or ``--model`` is no .gguf file

Usage: ``python bench/bench_runtime.py [--systems a,b] [--num-prompts N] [--max-new-tokens N]
[--output FILE]`` or ``specdec bench ...``; JSON on stdout, a markdown table on stderr. The prompts
are the MT-Bench questions shipped with the package (:mod:`specdec.tools.bench.prompts`) unless ``--prompts``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...core.chat import chat_ids
from ...options import options_from
from ..arguments import int_list
from .prompts import add_prompt_arguments, load_questions, resolve_prompts

SYSTEMS = ("hf-eager-f32", "hf-compile-f32", "specdec-eager-f32", "specdec-eager-bf16",
           "specdec-compiled-f32", "specdec-compiled-bf16", "specdec-compiled-int8", "specdec-compiled-int4",
           "specdec-compiled-gguf", "specdec-tuned-bf16", "specdec-tuned-int8", "specdec-tuned-int4",
           "specdec-tuned-gguf", "specdec-xla-f32", "llamacpp-gguf")
GGUF_SYSTEMS = ("specdec-compiled-gguf", "specdec-tuned-gguf", "llamacpp-gguf")   # they read the --model's GGUF file
TUNED = ("specdec-tuned-bf16", "specdec-tuned-int8", "specdec-tuned-int4", "specdec-tuned-gguf")
# run only when named (or with ``all``): they need packages specdec does not install, or (TUNED) minutes of
# autotuning per cold compile
OPTIONAL = ("specdec-xla-f32", "llamacpp-gguf", *TUNED)
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in OPTIONAL)
LLAMACPP_MISSING = "llama-cpp-python is not installed: pip install llama-cpp-python"
XLA_MISSING = ("torch_xla is not installed: pip install 'specdec[xla]' (torch==2.9.0, torch-xla==2.9.0), "
               "then run the benchmark with that environment's python")
BASELINE = "hf-eager-f32"
# systems timed twice, in fresh processes: empty Inductor cache (cold), then reusing it (cached)
COLD_CACHED = ("specdec-compiled-f32", "specdec-compiled-bf16", "specdec-compiled-int8", "specdec-compiled-int4",
               "specdec-compiled-gguf", *TUNED)


def package_parent() -> Path:
    """The directory holding the ``specdec`` package (put on the workers' ``PYTHONPATH``)."""
    return Path(__file__).resolve().parents[3]


def system_info(name: str) -> dict:
    """{"impl": "hf"|"specdec"|"llamacpp", "backend": "eager"|"compiled"|"xla"|None, "compiled": bool,
    "dtype": "f32"|"bf16"|"gguf", "quantization": None|"int8"|"int4"|"gguf", "autotune": bool}
    (``backend``: specdec's; ``tuned``: the compiled backend with ``autotune=True``; ``int8`` / ``int4``:
    bf16 activations, weight-only quantized projections; ``gguf``: the GGUF file's own tensor types, in
    specdec or llama.cpp)."""
    if name == "llamacpp-gguf":
        return {"impl": "llamacpp", "backend": None, "compiled": False, "dtype": "gguf", "quantization": "gguf",
                "autotune": False}
    impl, mode, dtype = name.split("-")
    quantization = dtype if dtype in ("int8", "int4", "gguf") else None
    backend = "compiled" if mode == "tuned" else mode
    return {"impl": impl, "backend": backend if impl == "specdec" else None,
            "compiled": backend in ("compile", "compiled", "xla"), "dtype": "bf16" if quantization else dtype,
            "quantization": quantization, "autotune": mode == "tuned"}


# ---------------------------------------------------------------------------------------- CLI
def _systems_arg(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["all"]:
        return list(SYSTEMS)
    bad = [s for s in names if s not in SYSTEMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)} or 'all'")
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class RuntimeBenchOptions:
    """What ``run`` measures (the flags of ``add_arguments``, same names): ``systems`` (names of ``SYSTEMS``, or a
    comma string, "all" for every one), ``model`` (None: the embedded model), ``prompts`` / ``num_prompts``,
    ``max_new_tokens`` per prompt (EOS disabled); specdec's ``n_positions`` (None: the smallest power of two
    that fits), ``context_buckets`` / ``kv_buckets`` (None: the runtime's), ``kv_cache_dtype``, ``compile_all``
    (every bucket); ``threads`` (None: torch's), ``warmup_tokens``; the bandwidth test: ``bandwidth_gb``,
    ``bandwidth_runs``, or ``bandwidth_gbps`` given; ``timeout`` per worker (seconds), ``work_dir`` (None: a
    temporary one), ``output``, ``save_tokens`` (every system's token ids in the JSON), ``no_progress``."""

    systems: list[str] | str = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    model: str | None = None
    prompts: str | None = None
    num_prompts: int = 10
    max_new_tokens: int = 128
    n_positions: int | None = None
    context_buckets: list[int] | None = None
    kv_buckets: list[int] | None = None
    kv_cache_dtype: str | None = None
    compile_all: bool = False
    threads: int | None = None
    warmup_tokens: int = 16
    bandwidth_gb: float = 1.0
    bandwidth_runs: int = 9
    bandwidth_gbps: float | None = None
    timeout: float | None = None
    work_dir: str | None = None
    output: str | None = None
    save_tokens: bool = False
    no_progress: bool = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the benchmark (used by ``specdec bench`` and ``python -m specdec.tools.bench.runtime``)."""
    parser.add_argument("--systems", type=_systems_arg, default=list(DEFAULT_SYSTEMS),
                        help=f"comma-separated subset of {', '.join(SYSTEMS)}, or 'all' (default: all but the "
                             f"optional {', '.join(OPTIONAL)})")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory, .gguf or a named model, e.g. qwen2.5-coder-1.5b-instruct "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    add_prompt_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="tokens generated per prompt; EOS is disabled so every prompt makes exactly this many")
    parser.add_argument("--n-positions", type=int, default=None,
                        help="specdec KV length / HF static cache length (default: the smallest power of two "
                             ">= longest prompt + max-new-tokens, at least 128)")
    parser.add_argument("--context-buckets", type=int_list, default=None,
                        help="specdec context buckets, e.g. 128,256 (default: the runtime's powers of two)")
    parser.add_argument("--kv-buckets", type=int_list, default=None,
                        help="specdec KV buckets (default: the runtime's powers of two)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["int8", "fp8_e4m3"],
                        help="every specdec system's KV cache in 8 bits (from_pretrained(kv_cache_dtype=...))")
    parser.add_argument("--compile-all", action="store_true",
                        help="specdec-compiled: compile every bucket (DecoderModel.compile()) instead of only "
                             "the graphs these prompts use")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads in every worker and for the bandwidth test (default: torch's default)")
    parser.add_argument("--warmup-tokens", type=int, default=16,
                        help="tokens of the untimed warm-up generate on the first prompt (default 16)")
    parser.add_argument("--bandwidth-gb", type=float, default=1.0,
                        help="size of the float32 tensor summed to measure read bandwidth (default 1.0 GB)")
    parser.add_argument("--bandwidth-runs", type=int, default=9, help="timed sums, median taken (default 9)")
    parser.add_argument("--bandwidth-gbps", type=float, default=None,
                        help="skip the bandwidth measurement and use this value (GB/s)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per worker process")
    parser.add_argument("--work-dir", default=None,
                        help="where job files and the Inductor caches of the workers go (default: a temporary "
                             "directory, removed at the end)")
    parser.add_argument("--output", default=None, help="also write the JSON result to this file")
    parser.add_argument("--save-tokens", action="store_true",
                        help="include every system's generated token ids in the JSON (systems.<name>.tokens)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


# ---------------------------------------------------------------------------------------- helpers
def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "mean": statistics.fmean(values),
            "min": min(values), "max": max(values)}


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def _peak_rss_mb(who=resource.RUSAGE_SELF) -> float:
    # ru_maxrss is in KiB on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(who).ru_maxrss * scale / 2**20


def measure_bandwidth(gb: float = 1.0, runs: int = 9) -> dict:
    """Memory read bandwidth: time ``x.sum()`` over a ``gb``-GB float32 tensor (torch's threads)."""
    import torch

    n = max(int(gb * 1e9) // 4, 1 << 20)
    x = torch.empty(n, dtype=torch.float32)
    x.fill_(1.0)  # touch every page before timing
    for _ in range(2):
        x.sum()
    times = []
    for _ in range(max(runs, 1)):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    del x
    rates = [n * 4 / t / 1e9 for t in times]
    return {"gbps": statistics.median(rates), "max_gbps": max(rates), "min_gbps": min(rates),
            "bytes": n * 4, "runs": len(times), "threads": torch.get_num_threads(),
            "method": "median over runs of bytes / time of torch.sum over a float32 tensor"}


def bytes_per_token(config, dtype_name: str, mean_context: float, quantization: str | None = None,
                    weight_bytes: int | None = None) -> dict:
    """Bytes a decode step must read: the weights (``ModelConfig.bytes_read_per_token``: quantized as
    ``quantization`` stores them, one embedding row; ``weight_bytes`` if given) + the K/V of the context
    (in ``dtype_name``)."""
    from ...core.config import amp_dtype

    dtype = amp_dtype(dtype_name)
    weights = weight_bytes if weight_bytes is not None else config.bytes_read_per_token(dtype, quantization)
    itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else dtype.bits // 8
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * mean_context * itemsize
    return {"weight_bytes": weights, "kv_bytes": kv, "bytes_per_token": weights + kv}


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file llama.cpp loads for ``--model`` (``paths.gguf_source``); None for a checkpoint
    directory (llama.cpp reads only GGUF)."""
    from ...core.paths import gguf_source

    return gguf_source(model)


# ---------------------------------------------------------------------------------------- worker
class _TimingStreamer:
    """HF streamer protocol: first ``put`` is the prompt, then one per step; records times."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


class _HFRunner:
    def __init__(self, job: dict, compiled: bool):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.compiled = compiled
        self.model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
        gc = self.model.generation_config
        gc.eos_token_id = None  # EOS disabled: exactly max_new_tokens per prompt
        gc.pad_token_id = job["pad_token_id"]
        gc.do_sample = False
        gc.temperature = gc.top_p = gc.top_k = None
        if compiled:
            from transformers import CompileConfig

            cc = CompileConfig(fullgraph=True, dynamic=False, mode="default")
            cc._compile_all_devices = True  # transformers only auto-compiles on accelerators otherwise
            gc.cache_implementation = "static"
            gc.max_cache_len = job["n_positions"]  # one cache shape for every prompt → no recompiles
            gc.compile_config = cc
        self.describe = {"attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                         "cache": "static" if compiled else "dynamic",
                         "compile_config": "CompileConfig(fullgraph=True, dynamic=False, mode='default')"
                         if compiled else None}

    def generate(self, ids: list[int], n: int, streamer=None) -> list[int]:
        import torch

        x = torch.tensor([ids], dtype=torch.long)
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                  streamer=streamer)
        return out[0, len(ids):].tolist()

    def compile(self, prompt_ids, n, compile_all) -> tuple[float | None, dict]:
        if not self.compiled:
            return None, {}
        # transformers compiles the decode step inside the first generate that runs one
        t = time.perf_counter()
        self.generate(prompt_ids[0], min(4, max(n, 2)))
        return time.perf_counter() - t, {}


class _SpecdecRunner:
    def __init__(self, job: dict, amp: str, backend: str, quantization: str | None = None, autotune: bool = False):
        from ...core.decoder import DecoderModel

        self.compiled = backend != "eager"
        source = job["gguf"] if quantization == "gguf" else job["model"]      # "gguf" reads the file itself
        self.model = DecoderModel.from_pretrained(
            source, n_positions=job["n_positions"], amp=amp, context_buckets=job["context_buckets"],
            kv_buckets=job["kv_buckets"], backend=backend, progress=False,
            quantization=quantization, kv_cache_dtype=job.get("kv_cache_dtype"), autotune=autotune)
        self.describe = {"context_buckets": self.model.context_buckets, "kv_buckets": self.model.kv_buckets,
                         "n_positions": self.model.n_positions, "backend": self.model.settings.backend}

    def generate(self, ids: list[int], n: int, streamer=None) -> list[int]:
        import torch

        x = torch.tensor([ids], dtype=torch.long)
        out = self.model.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=[], streamer=streamer)
        return out[0, len(ids):].tolist()

    def needed_keys(self, prompt_ids, n):
        """The greedy graphs generate() will use for these prompts: the context bucket of each
        prompt and the KV buckets of its decode steps (needs L+1 … L+n-1 slots)."""
        from ...core.buckets import pick_bucket
        from ...core.graphs import GraphKey

        keys = {}
        for ids in prompt_ids:
            L = len(ids)
            c = pick_bucket(self.model.context_buckets, L)
            keys[GraphKey(c, 1, c, False)] = None
            for need in range(L + 1, L + n):
                kv = pick_bucket(self.model.kv_buckets, need)
                keys[GraphKey(1, 1, kv, False)] = None
        return sorted(keys, key=lambda k: (k.n_tokens == 1, k.kv_len))

    def compile(self, prompt_ids, n, compile_all) -> tuple[float | None, dict]:
        if not self.compiled:
            return None, {}
        import torch

        m = self.model
        t0 = time.perf_counter()
        if compile_all:
            m.compile(progress=False)
            per_graph = dict(m.compile_seconds)
        else:
            per_graph = {}
            for key in self.needed_keys(prompt_ids, n):
                t = time.perf_counter()
                with torch.no_grad():
                    m.graph(key)(*m.graph_module(key).example_inputs(m.batch_size))
                per_graph[key.describe()] = time.perf_counter() - t
            m.reset()
        return time.perf_counter() - t0, per_graph


class _LlamaCppRunner:
    """llama.cpp (``llama-cpp-python``) on the GGUF file: ``Llama.generate`` with the greedy sampler
    (temperature 0, no penalties). That generator never stops by itself (EOS is checked only by the
    completion API), so EOS is ignored and exactly ``n`` tokens are taken. The KV cache is cleared before
    every call, so each one prefills its whole prompt as the other systems do (no prefix reuse)."""

    def __init__(self, job: dict, threads: int):
        import llama_cpp

        self.compiled = False
        n_ctx = job["n_positions"]   # >= longest prompt + max_new_tokens, as the others' KV length
        self.llm = llama_cpp.Llama(job["gguf"], n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   verbose=False)
        self.describe = {"llama_cpp": llama_cpp.__version__, "gguf": job["gguf"], "n_ctx": n_ctx,
                         "n_threads": threads, "sampler": "greedy (temp 0), EOS ignored"}

    def generate(self, ids: list[int], n: int, streamer=None) -> list[int]:
        self.llm.reset()
        if streamer is not None:
            streamer.put(ids)   # the prompt, as transformers' streamers get it
        out = []
        for token in self.llm.generate(ids, temp=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if streamer is not None:
                streamer.put(token)
            if len(out) == n:
                break
        return out

    def compile(self, prompt_ids, n, compile_all) -> tuple[float | None, dict]:
        return None, {}


def skip_reason(system: str, job: dict) -> str | None:
    """Why ``system`` cannot run here (a one-line note), or None: the ``GGUF_SYSTEMS`` need a GGUF
    ``--model``, llamacpp-gguf also ``llama_cpp`` importable; specdec-xla-f32 needs ``torch_xla``."""
    if system == "specdec-xla-f32":
        try:
            import torch_xla  # noqa: F401
        except ImportError:
            return XLA_MISSING
        return None
    if system not in GGUF_SYSTEMS:
        return None
    if not job.get("gguf"):
        return f"{system} needs a .gguf file as --model ({job.get('model')} is not one)"
    if system != "llamacpp-gguf":
        return None
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return LLAMACPP_MISSING
    return None


def _counters() -> dict:
    """torch.compile's counters and, where torch_xla is loaded, XLA's compile count (group "xla")."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # pragma: no cover
        return {}
    out = {group: {k: int(v) for k, v in c.items()} for group, c in counters.items()
           if group in ("stats", "inductor", "aot_autograd") and c}
    if "torch_xla" in sys.modules:
        import torch_xla.debug.metrics as met
        compiled = met.metric_data("CompileTime")
        out["xla"] = {"compiles": 0 if compiled is None else int(compiled[0])}
    return out


def run_worker(system: str, job: dict, compile_only: bool = False, progress: bool = True) -> dict:
    """Load, compile, warm up, then time every prompt: one ``generate(max_new_tokens=1)`` (TTFT)
    and one full ``generate`` with a timing streamer. Runs inside the worker process. A system that
    cannot run here returns only ``{"system", "skipped": note}`` (see :func:`skip_reason`)."""
    skipped = skip_reason(system, job)
    if skipped:
        return {"system": system, "skipped": skipped}
    import torch
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    torch.set_grad_enabled(False)
    info = system_info(system)
    prompt_ids, n = job["prompt_ids"], job["max_new_tokens"]
    res: dict = {"system": system, "phase": "compile-only" if compile_only else "measure",
                 "threads": torch.get_num_threads(),
                 "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}

    t = time.perf_counter()
    if info["impl"] == "hf":
        runner = _HFRunner(job, info["compiled"])
    elif info["impl"] == "llamacpp":
        runner = _LlamaCppRunner(job, torch.get_num_threads())
    else:
        runner = _SpecdecRunner(job, info["dtype"], info["backend"], info["quantization"], info["autotune"])
    res["load_s"] = time.perf_counter() - t
    res["rss_after_load_mb"] = _rss_mb()
    res["peak_rss_load_mb"] = _peak_rss_mb()
    res["details"] = runner.describe

    c0 = _counters()
    compile_s, per_graph = runner.compile(prompt_ids, n, job.get("compile_all", False))
    res["compile_s"] = compile_s
    res["compile_graphs"] = per_graph
    res["counters_compile"] = _diff_counters(c0, _counters())
    if compile_only:
        res["peak_rss_mb"] = _peak_rss_mb()
        res["peak_rss_children_mb"] = _peak_rss_mb(resource.RUSAGE_CHILDREN)
        res["worker_s"] = time.perf_counter() - t_start
        return res

    t = time.perf_counter()
    runner.generate(prompt_ids[0], max(1, min(job.get("warmup_tokens", 16), n)))
    res["warmup_s"] = time.perf_counter() - t

    c1 = _counters()
    ttft, e2e, decode, tokens = [], [], [], []
    bar = tqdm(prompt_ids, desc=f"{system}", unit="prompt", leave=False, file=sys.stderr,
               disable=not progress)
    for ids in bar:
        t = time.perf_counter()
        runner.generate(ids, 1)
        ttft.append(time.perf_counter() - t)
        streamer = _TimingStreamer()
        t = time.perf_counter()
        new = runner.generate(ids, n, streamer)
        end = time.perf_counter()
        e2e.append(end - t)
        if len(new) != n:
            raise RuntimeError(f"{system} generated {len(new)} tokens instead of {n} (EOS not disabled?)")
        # streamer times: [prompt, token 1, ..., token n]
        if len(streamer.times) == n + 1 and n > 1:
            decode.append(streamer.times[-1] - streamer.times[1])
        tokens.append(new)
        bar.set_postfix_str(f"{n / e2e[-1]:.1f} tok/s")
    bar.close()
    res["counters_measure"] = _diff_counters(c1, _counters())
    res["recompiles_during_measurement"] = (res["counters_measure"].get("stats", {}).get("unique_graphs", 0)
                                            + res["counters_measure"].get("xla", {}).get("compiles", 0))
    res["ttft_s"] = ttft
    res["e2e_s"] = e2e
    res["decode_s"] = decode
    res["tokens"] = tokens
    res["peak_rss_mb"] = _peak_rss_mb()
    res["peak_rss_children_mb"] = _peak_rss_mb(resource.RUSAGE_CHILDREN)
    res["rss_end_mb"] = _rss_mb()
    res["worker_s"] = time.perf_counter() - t_start
    return res


def _diff_counters(a: dict, b: dict) -> dict:
    out = {}
    for group, c in b.items():
        d = {k: v - a.get(group, {}).get(k, 0) for k, v in c.items()}
        d = {k: v for k, v in d.items() if v}
        if d:
            out[group] = d
    return out


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.runtime --worker",
                                description="one benchmark worker")
    p.add_argument("--worker", required=True, choices=SYSTEMS)
    p.add_argument("--job", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    job = json.loads(Path(a.job).read_text())
    res = run_worker(a.worker, job, a.compile_only, progress=not a.no_progress)
    tmp = Path(a.result + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.replace(a.result)
    return 0


# ---------------------------------------------------------------------------------------- parent
def _kill_group(proc: subprocess.Popen) -> None:
    """Terminate a worker and everything it started (its own session/process group)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _spawn_worker(system: str, job_file: Path, result_file: Path, cache_dir: Path, compile_only: bool,
                  timeout: float | None, progress: bool) -> dict:
    cmd = [sys.executable, "-m", "specdec.tools.bench.runtime", "--worker", system, "--job", str(job_file),
           "--result", str(result_file)]
    if compile_only:
        cmd.append("--compile-only")
    if not progress:
        cmd.append("--no-progress")
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONPATH"] = os.pathsep.join([str(package_parent())]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    result_file.unlink(missing_ok=True)
    t = time.perf_counter()
    # own session: Ctrl-C reaches only the parent, which then kills the whole worker group
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return {"error": f"timed out after {timeout} s", "wall_s": time.perf_counter() - t}
    except BaseException:
        _kill_group(proc)
        raise
    wall = time.perf_counter() - t
    if rc != 0 or not result_file.is_file():
        return {"error": f"worker exited with status {rc} (see its traceback above)", "wall_s": wall}
    res = json.loads(result_file.read_text())
    res["wall_s"] = wall
    return res


class _Interrupted(KeyboardInterrupt):
    pass


def _raise_interrupt(signum, frame):
    raise _Interrupted(f"signal {signum}")


def git_commit() -> str:
    """``git rev-parse --short HEAD`` of the checkout specdec runs from, ``+dirty`` when ``git status --porcelain``
    lists anything; "unknown" outside a repository."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=package_parent(), capture_output=True, text=True,
                              check=False).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain") else "")


def machine_info() -> dict:
    import torch
    import transformers

    fields = {}     # the first processor's: "model name", and family / model (a masked name's generation)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = fields.get("model name")
    family = "/".join(fields[k] for k in ("cpu family", "model") if k in fields) or None
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        mem_gb = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {"cpu_count": os.cpu_count(), "cpu_affinity": affinity, "cpu_model": cpu, "cpu_family_model": family,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "memory_gb": mem_gb,
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "loadavg_start": list(os.getloadavg())}


def _prefix_len(a: list[int], b: list[int]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def _agreement(tokens: list[list[int]], ref: list[list[int]]) -> dict:
    prefixes = [_prefix_len(a, b) for a, b in zip(tokens, ref)]
    n = len(ref[0]) if ref else 0
    return {"exact_match": sum(p == len(r) for p, r in zip(prefixes, ref)) / len(ref),
            "first_token_match": sum(p >= 1 for p in prefixes) / len(ref),
            "mean_prefix_fraction": statistics.fmean(p / max(len(r), 1) for p, r in zip(prefixes, ref)),
            "common_prefix_tokens": prefixes, "max_new_tokens": n}


def run(options: RuntimeBenchOptions) -> dict:
    """Run the benchmark ``options`` describe; returns the result dict and prints progress and a markdown
    table to stderr."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from ...core.buckets import default_buckets
    from ...core.config import ModelConfig
    from ...core.paths import resolve_model_path

    progress = not options.no_progress
    systems = options.systems if isinstance(options.systems, list) else _systems_arg(options.systems)
    n_new = options.max_new_tokens
    if n_new < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {n_new}")
    if options.threads:
        torch.set_num_threads(options.threads)

    old_handlers = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old_handlers[sig] = signal.signal(sig, _raise_interrupt)
        except (ValueError, OSError):  # not the main thread
            pass
    work_dir = Path(options.work_dir) if options.work_dir else Path(tempfile.mkdtemp(prefix="specdec-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        prompts_path = resolve_prompts(options.prompts)
        questions = load_questions(prompts_path, options.num_prompts)
        texts = [t for _, t in questions]
        model_path = resolve_model_path(options.model)
        config = ModelConfig.from_dir(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        prompt_ids = [chat_ids(tokenizer, t) for t in texts]
        lengths = [len(p) for p in prompt_ids]
        need = max(lengths) + n_new
        n_positions = options.n_positions
        if n_positions is None:  # smallest power of two that fits, capped at the model's maximum
            n_positions = 128
            while n_positions < need:
                n_positions *= 2
            n_positions = min(n_positions, max(need, config.max_position_embeddings))
        if n_positions < need:
            raise ValueError(f"--n-positions={n_positions} is too small: the longest prompt has {max(lengths)} "
                             f"tokens + {n_new} new tokens = {need}")
        gguf = gguf_file(options.model) if set(GGUF_SYSTEMS) & set(systems) else None
        pad = config.pad_token_id if config.pad_token_id is not None else \
            (config.eos_token_ids[0] if config.eos_token_ids else 0)
        job = {"model": str(model_path), "prompt_ids": prompt_ids, "max_new_tokens": n_new,
               "n_positions": n_positions, "context_buckets": options.context_buckets, "kv_buckets": options.kv_buckets,
               "compile_all": options.compile_all, "threads": options.threads, "warmup_tokens": options.warmup_tokens,
               "pad_token_id": pad, "gguf": str(gguf) if gguf else None, "kv_cache_dtype": options.kv_cache_dtype}
        job_file = work_dir / "job.json"
        job_file.write_text(json.dumps(job))

        result: dict = {"config": {
            **machine_info(), "model": str(options.model or "smollm2-135m-instruct (embedded)"),
            "model_path": str(model_path), "prompts_file": str(prompts_path), "num_prompts": len(texts),
            "question_ids": [q for q, _ in questions],
            "prompt_tokens": lengths, "max_new_tokens": n_new, "n_positions": n_positions,
            "context_buckets": options.context_buckets or default_buckets(n_positions),
            "kv_buckets": options.kv_buckets or default_buckets(n_positions),
            "compile_all": options.compile_all, "systems": systems, "batch_size": 1, "decoding": "greedy, EOS disabled",
            "kv_cache_dtype": options.kv_cache_dtype}}

        # ---- bandwidth and the bound
        if options.bandwidth_gbps:
            bw = {"gbps": options.bandwidth_gbps, "method": "given with --bandwidth-gbps"}
        else:
            if progress:
                tqdm.write(f"measuring read bandwidth ({options.bandwidth_gb:g} GB float32 sum) ...", file=sys.stderr)
            bw = measure_bandwidth(options.bandwidth_gb, options.bandwidth_runs)
        result["bandwidth_gbps"] = bw["gbps"]
        result["bandwidth"] = bw
        mean_ctx = statistics.fmean(L + (n_new - 1) / 2 for L in lengths)
        bound = {}
        for name, dt, quant in (("f32", "f32", None), ("bf16", "bf16", None), ("int8", "bf16", "int8"),
                                ("int4", "bf16", "int4")):
            bound[name] = {**bytes_per_token(config, dt, mean_ctx, quant), "mean_context": mean_ctx}
        if gguf:  # the GGUF file's bytes (its tensors + ~2% metadata), a 16-bit KV cache
            bound["gguf"] = {**bytes_per_token(config, "f16", mean_ctx, weight_bytes=gguf.stat().st_size),
                             "mean_context": mean_ctx}
        _fill_bound(bound, bw["gbps"])
        result["bandwidth_bound"] = bound

        # ---- workers
        plan = []
        for s in systems:
            if s in COLD_CACHED:
                plan += [(s, "cold", True), (s, "cached", False)]
            else:
                plan.append((s, "cold" if system_info(s)["compiled"] else "eager", False))
        raw: dict[str, dict] = {}
        bar = tqdm(plan, desc="bench", unit="run", file=sys.stderr, disable=not progress)
        for s, phase, compile_only in bar:
            bar.set_postfix_str(f"{s} ({phase}{', compile only' if compile_only else ''})")
            tqdm.write(f"[bench] {s}: {phase}{' compile-only' if compile_only else ''} run", file=sys.stderr)
            cache = work_dir / f"inductor-{s}"
            if phase == "cold" or phase == "eager":
                shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True, exist_ok=True)
            r = _spawn_worker(s, job_file, work_dir / f"result-{s}-{phase}.json", cache, compile_only,
                              options.timeout, progress)
            raw.setdefault(s, {})[phase] = r
            if "error" in r:
                tqdm.write(f"[bench] {s} ({phase}) failed: {r['error']}", file=sys.stderr)
            elif "skipped" in r:
                tqdm.write(f"[bench] {s} skipped: {r['skipped']}", file=sys.stderr)
        bar.close()
        result["config"]["loadavg_end"] = list(os.getloadavg())
        if not options.bandwidth_gbps:  # measured again after the workers: the higher median counts
            bw_after = measure_bandwidth(options.bandwidth_gb, options.bandwidth_runs)
            bw["gbps_before"], bw["gbps_after"] = bw["gbps"], bw_after["gbps"]
            bw["max_gbps"] = max(bw["max_gbps"], bw_after["max_gbps"])
            bw["min_gbps"] = min(bw["min_gbps"], bw_after["min_gbps"])
            bw["gbps"] = max(bw["gbps_before"], bw["gbps_after"])
            bw["method"] = ("median of bytes / time of torch.sum over a float32 tensor, measured before and "
                            "after the workers; the higher median is used")
            result["bandwidth_gbps"] = bw["gbps"]
            _fill_bound(bound, bw["gbps"])
        result["systems"] = _summarize(raw, n_new, bound)
        _agreements(result["systems"], raw)
        if options.save_tokens:
            for s, phases in raw.items():
                main = phases.get("cached") or phases.get("cold") or phases.get("eager")
                if main.get("tokens"):
                    result["systems"][s]["tokens"] = main["tokens"]
        result["ratios"] = _ratios(result["systems"])
        print(markdown_table(result), file=sys.stderr)
        return result
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        if not options.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)


def _fill_bound(bound: dict, gbps: float) -> None:
    for b in bound.values():
        b["tokens_per_s"] = gbps * 1e9 / b["bytes_per_token"]


def _summarize(raw: dict, n_new: int, bound: dict) -> dict:
    out = {}
    for s, phases in raw.items():
        info = system_info(s)
        main = phases.get("cached") or phases.get("cold") or phases.get("eager")
        entry: dict = {**info}
        errors = {p: r["error"] for p, r in phases.items() if "error" in r}
        if errors:
            entry["error"] = errors
        if "skipped" in main:
            entry["skipped"] = main["skipped"]
        elif "error" not in main:
            e2e, dec, ttft = main["e2e_s"], main["decode_s"], main["ttft_s"]
            entry["tokens_per_s"] = _stats([n_new / t for t in e2e])
            entry["decode_tokens_per_s"] = _stats([(n_new - 1) / t for t in dec if t > 0])
            entry["ttft_s"] = _stats(ttft)
            entry["generate_s"] = _stats(e2e)
            entry["load_s"] = main["load_s"]
            entry["warmup_s"] = main["warmup_s"]
            entry["compile_s"] = main["compile_s"]
            entry["peak_rss_mb"] = main["peak_rss_mb"]
            entry["peak_rss_compile_workers_mb"] = main["peak_rss_children_mb"] or None
            entry["rss_after_load_mb"] = main["rss_after_load_mb"]
            entry["peak_rss_load_mb"] = main.get("peak_rss_load_mb")
            entry["rss_end_mb"] = main.get("rss_end_mb")
            entry["recompiles_during_measurement"] = main["recompiles_during_measurement"]
            entry["threads"] = main["threads"]
            entry["details"] = main["details"]
            tps = entry["tokens_per_s"]["median"]
            limit = bound[info["quantization"] or info["dtype"]]["tokens_per_s"]
            entry["fraction_of_bandwidth_bound"] = tps / limit
            if entry["decode_tokens_per_s"]:
                entry["decode_fraction_of_bandwidth_bound"] = entry["decode_tokens_per_s"]["median"] / limit
        if info["compiled"]:
            comp = {}
            for p in ("cold", "cached"):
                r = phases.get(p)
                if r and "error" not in r and "skipped" not in r:
                    comp[f"{p}_s"] = r["compile_s"]
                    comp[f"{p}_graphs"] = r["compile_graphs"]
                    comp[f"{p}_counters"] = r["counters_compile"]
                    comp[f"{p}_peak_rss_mb"] = r["peak_rss_mb"]
                    comp[f"{p}_load_s"] = r["load_s"]
            if comp.get("cold_s") and comp.get("cached_s") is not None:
                comp["cached_over_cold"] = comp["cached_s"] / comp["cold_s"]
            entry["compile"] = comp
        entry["worker_wall_s"] = {p: r.get("wall_s") for p, r in phases.items()}
        out[s] = entry
    return out


def _agreements(systems: dict, raw: dict) -> None:
    toks = {s: (p.get("cached") or p.get("cold") or p.get("eager")).get("tokens") for s, p in raw.items()}
    toks = {s: t for s, t in toks.items() if t}
    if not toks:
        return
    ref = BASELINE if BASELINE in toks else next((s for s in toks if system_info(s)["dtype"] == "f32"),
                                                 next(iter(toks)))
    for s, t in toks.items():
        systems[s]["agreement"] = {"reference": ref, **_agreement(t, toks[ref])}


# references of the speed ratios, each used when it ran: transformers, our bf16, llama.cpp
REFERENCES = (BASELINE, "specdec-compiled-bf16", "llamacpp-gguf")


def _ratios(systems: dict) -> dict:
    """tok/s and decode tok/s of every system over each reference in ``REFERENCES`` that ran (medians),
    the fraction of the bandwidth bound, compile cached / cold."""
    def tps(s, key="tokens_per_s"):
        e = systems.get(s)
        return e[key]["median"] if e and e.get(key) else None

    ratios = {"fraction_of_bandwidth_bound": {}, "compile_cached_over_cold": {}}
    for ref in REFERENCES:
        for key, prefix in (("tokens_per_s", "speedup_vs_"), ("decode_tokens_per_s", "decode_speedup_vs_")):
            if ref == BASELINE or tps(ref, key):
                ratios[prefix + ref] = {s: tps(s, key) / tps(ref, key) for s in systems
                                        if tps(s, key) and tps(ref, key)}
    for s, e in systems.items():
        if tps(s) is None:
            continue
        ratios["fraction_of_bandwidth_bound"][s] = e["fraction_of_bandwidth_bound"]
        if e.get("compile", {}).get("cached_over_cold") is not None:
            ratios["compile_cached_over_cold"][s] = e["compile"]["cached_over_cold"]
    return ratios


def _fmt(x, spec=".1f", none="–"):
    return none if x is None else format(x, spec)


def markdown_table(result: dict) -> str:
    cfg, bound = result["config"], result["bandwidth_bound"]
    lines = [
        f"model {cfg['model']}, {cfg['num_prompts']} MT-Bench prompts, {cfg['max_new_tokens']} new tokens, "
        f"batch 1 greedy; {cfg['cpu_count']} CPUs ({cfg['cpu_model']}), torch {cfg['torch']}, "
        f"{cfg['torch_threads']} threads; read bandwidth {result['bandwidth_gbps']:.1f} GB/s → bound "
        f"{bound['f32']['tokens_per_s']:.1f} tok/s f32, {bound['bf16']['tokens_per_s']:.1f} tok/s bf16"
        + (f", {bound['int8']['tokens_per_s']:.1f} / {bound['int4']['tokens_per_s']:.1f} tok/s int8 / int4 "
           "projections" if "int4" in bound else "")     # results from before the quantized systems lack them
        + (f", {bound['gguf']['tokens_per_s']:.1f} tok/s the GGUF file" if "gguf" in bound else ""),
        "",
        "| system | tok/s (median) | decode tok/s | TTFT ms | compile s (cold / cached) | peak RSS MB "
        f"| × {BASELINE} | % of BW bound | same tokens as ref |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    speed = result["ratios"].get(f"speedup_vs_{BASELINE}", {})
    for s, e in result["systems"].items():
        if "tokens_per_s" not in e:
            why = f"skipped: {e['skipped']}" if "skipped" in e else f"error: {e.get('error')}"
            lines.append(f"| {s} | {why} | | | | | | | |")
            continue
        comp = e.get("compile", {})
        if "cold_s" in comp and "cached_s" in comp:
            c = f"{comp['cold_s']:.1f} / {comp['cached_s']:.1f}"
        elif "cold_s" in comp:
            c = f"{comp['cold_s']:.1f} (cold)"
        else:
            c = f"– (warm-up {e['warmup_s']:.2f})"
        a = e.get("agreement")
        agree = f"{a['exact_match'] * 100:.0f}% ({a['mean_prefix_fraction'] * 100:.0f}% prefix)" if a else "–"
        dec = e.get("decode_tokens_per_s")
        lines.append(
            f"| {s} | {e['tokens_per_s']['median']:.1f} | {_fmt(dec['median'] if dec else None)} | "
            f"{e['ttft_s']['median'] * 1000:.0f} | {c} | {e['peak_rss_mb']:.0f} | {_fmt(speed.get(s), '.2f')} | "
            f"{e['fraction_of_bandwidth_bound'] * 100:.0f}% | {agree} |")
    return "\n".join(lines)


def command_line() -> str:
    """How this process was started, as a user would type it again: ``specdec ARGS`` for the console
    script, else ``python SCRIPT ARGS``."""
    script = Path(sys.argv[0]).name if Path(sys.argv[0]).name == "specdec" else f"python {sys.argv[0]}"
    return " ".join([script, *sys.argv[1:]])


def with_provenance(result: dict) -> dict:
    """``result`` led by ``command``, ``commit`` and ``machine`` (this process's), where it lacks them:
    every result JSON under bench/results/ carries them (``scripts/results_tables.py`` checks)."""
    missing = [key for key in ("command", "commit", "machine") if key not in result]
    if not missing:
        return result
    known = {"command": command_line, "commit": git_commit, "machine": machine_info}
    return {**{key: known[key]() for key in missing}, **result}


def print_result(result: dict, output: str | None = None, table=None) -> int:
    """JSON to stdout (and to the file ``output``), ``table(result)`` (a markdown table) to stderr if given; exit
    status 1 if any system failed, else 0. Every benchmark module's ``print_result`` is this one; the JSON
    carries the command, commit and machine (``with_provenance``)."""
    result = with_provenance(result)
    if table is not None:
        print(table(result), file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text + "\n")
    return 1 if any("error" in e for e in result.get("systems", {}).values()) else 0


def parse_options(argv: list[str]) -> RuntimeBenchOptions:
    """``python bench/bench_runtime.py``'s arguments as options."""
    parser = argparse.ArgumentParser(prog="bench_runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return options_from(RuntimeBenchOptions, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return _worker_main(argv)
    options = parse_options(argv)
    try:
        return print_result(run(options), options.output)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
