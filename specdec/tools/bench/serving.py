"""Serving benchmark in the style of vLLM's ``benchmark_serving``: the HTTP server in this process,
streaming ``/v1/completions`` requests from a closed loop of C concurrent clients.

For each ``--strategies`` entry (``none`` = target only, or a shipped proposer: ``model``, ``eagle``,
``medusa``, ``lookup``) the server is built once (same runtime settings, graphs compiled before the
clock starts) and for each concurrency C of ``--concurrency`` the same ``--num-prompts`` prompts are
sent, C at a time, greedy or at ``--temperature``, ``--max-tokens`` new tokens each (EOS ignored, so
every request has the same length). Per run: request and output-token throughput, TTFT, ITL (the
gap between streamed chunks; a speculative chunk may carry several tokens), TPOT ((end − first
token) / (tokens − 1)) and end-to-end latency, p50 and p99; the speedup of each strategy over
``none`` at the same C. JSON on stdout (``--output`` also writes it), a markdown table on stderr.

    specdec bench-serve [--strategies none,model] [--concurrency 1,4,8,16] [--batch-size 4]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
from tqdm.auto import tqdm

from ...core.chat import chat_ids
from ...options import ModelOptions, SpeculationOptions
from ...registry import name_list
from ..arguments import int_list
from . import runtime
from .prompts import add_prompt_arguments, load_prompts, resolve_prompts
from .runtime import machine_info


@dataclass(frozen=True)
class ServeBenchOptions:
    """What ``run`` measures (the flags of ``add_arguments``, same names): ``prompts`` / ``num_prompts``,
    ``strategies`` (registry names, "none" = target only), ``concurrency`` levels (clients), ``batch_size``
    rows of the server's batch, ``max_tokens`` per request (EOS ignored) at ``temperature``; the runtime:
    ``backend``, ``amp``, ``quantization``, ``n_positions``, ``threads`` (None: torch's); ``output``: also write
    the JSON there."""

    prompts: str | None = None
    num_prompts: int = 16
    strategies: list[str] = field(default_factory=lambda: ["none", "model"])
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    batch_size: int = 4
    max_tokens: int = 96
    temperature: float = 0.0
    backend: str = "compiled"
    amp: str = "bf16"
    quantization: str | None = None
    n_positions: int = 512
    threads: int | None = None
    output: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_prompt_arguments(parser, num_prompts=16)
    parser.add_argument("--strategies", default=["none", "model"], type=name_list(),
                        help="comma list of strategy names (specdec.registry): none (target only), model, eagle, "
                             "medusa, lookup, ... (the shipped proposers)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 8, 16], help="concurrent clients")
    parser.add_argument("--batch-size", type=int, default=4, help="rows of the static batch")
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens per request (EOS ignored)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--backend", default="compiled", choices=["eager", "compiled", "regional"])
    parser.add_argument("--amp", default="bf16", choices=["f32", "bf16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"], help="weight-only projections")
    parser.add_argument("--n-positions", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--output", default=None, help="also write the JSON result here")


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50": statistics.median(values), "p99": q[98], "mean": statistics.fmean(values)}


async def one_request(client, base: str, prompt: list[int], options: ServeBenchOptions) -> dict:
    """Stream one completion → its timings (seconds) and token count."""
    body = {"prompt": prompt, "max_tokens": options.max_tokens, "temperature": options.temperature, "seed": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    chunks, tokens = [], 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                n = len(json.loads(line[6:])["choices"][0]["token_ids"])
                if n:
                    chunks.append(time.perf_counter())
                    tokens += n
    end = time.perf_counter()
    ttft = chunks[0] - start
    return {"ttft": ttft, "e2e": end - start, "tokens": tokens, "itl": [b - a for a, b in zip(chunks, chunks[1:])],
            "tpot": (chunks[-1] - chunks[0]) / (tokens - 1) if tokens > 1 else None}


async def run_load(base: str, prompts: list[list[int]], concurrency: int, options: ServeBenchOptions) -> dict:
    """A closed loop: ``concurrency`` clients, each sending the next prompt when its last one ends."""
    import httpx

    queue = list(prompts)
    results: list[dict] = []

    async def client_loop(client):
        while queue:
            prompt = queue.pop(0)
            results.append(await one_request(client, base, prompt, options))

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall, "output_tokens": tokens,
            "request_throughput": len(results) / wall, "output_tokens_per_s": tokens / wall,
            "ttft_s": percentiles([r["ttft"] for r in results]),
            "itl_s": percentiles([x for r in results for x in r["itl"]]),
            "tpot_s": percentiles([r["tpot"] for r in results if r["tpot"] is not None]),
            "e2e_s": percentiles([r["e2e"] for r in results])}


def run(options: ServeBenchOptions) -> dict:
    from ...serving.app import create_app
    from ...serving.server import ServeOptions, load_engine, running_server, serving_engine

    if options.threads:
        torch.set_num_threads(options.threads)
    strategies = options.strategies
    texts = load_prompts(resolve_prompts(options.prompts), options.num_prompts)
    result = {"benchmark": "serving", "machine": machine_info(), "threads": torch.get_num_threads(),
              "settings": asdict(options), "runs": {}}
    model = ModelOptions(amp=options.amp, quantization=options.quantization, backend=options.backend,
                         n_positions=options.n_positions)
    for strategy in strategies:
        serve = ServeOptions(model=model, speculation=SpeculationOptions(draft=strategy),
                             batch_size=options.batch_size, max_waiting=max(options.concurrency) + 1)
        start = time.perf_counter()
        engine = serving_engine(load_engine(serve, progress=True), serve.max_waiting)
        build_s = time.perf_counter() - start
        prompts = [chat_ids(engine.tokenizer, t) for t in texts]
        runs = []
        with running_server(create_app(engine, "bench")) as base:
            asyncio.run(run_load(base, prompts[:1], 1, options))     # warm-up (lazily built graphs)
            for c in tqdm(options.concurrency, desc=f"serving {strategy}", unit="level", file=sys.stderr):
                stats_before = engine.engine.stats.copy()
                run_result = asyncio.run(run_load(base, prompts, c, options))
                s = engine.engine.stats
                steps = s.steps - stats_before.steps
                run_result["tau"] = 1 + (s.accepted - stats_before.accepted) / steps if steps else None
                runs.append(run_result)
        result["runs"][strategy] = {"build_s": build_s, "levels": runs}
    base_runs = {r["concurrency"]: r for r in result["runs"].get("none", {}).get("levels", [])}
    result["speedup_vs_none"] = {
        s: {str(r["concurrency"]): r["output_tokens_per_s"] / base_runs[r["concurrency"]]["output_tokens_per_s"]
            for r in v["levels"] if r["concurrency"] in base_runs}
        for s, v in result["runs"].items() if s != "none"}
    return result


def table(result: dict) -> str:
    rows = ["| strategy | C | req/s | out tok/s | τ | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 (ms) |",
            "|---|---|---|---|---|---|---|---|"]
    ms = lambda x: "–" if x is None else f"{1000 * x:.0f}"   # noqa: E731
    for strategy, v in result["runs"].items():
        for r in v["levels"]:
            tau = "–" if r["tau"] is None else f"{r['tau']:.2f}"
            rows.append(f"| {strategy} | {r['concurrency']} | {r['request_throughput']:.2f} | "
                        f"{r['output_tokens_per_s']:.1f} | {tau} | "
                        f"{ms(r['ttft_s']['p50'])} / {ms(r['ttft_s']['p99'])} | "
                        f"{ms(r['itl_s']['p50'])} / {ms(r['itl_s']['p99'])} | {ms(r['tpot_s']['p50'])} |")
    return "\n".join(rows)


print_result = partial(runtime.print_result, table=table)      # JSON to stdout (and --output), the table to stderr
