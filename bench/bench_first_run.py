#!/usr/bin/env python
"""Time to first token of the README's main command (``specdec generate "..."``), cold and warm.

``cold``: an empty cache directory (``$SPECDEC_CACHE``: no GGUF conversion, no compiled graph, no packed blocks,
no built kernel), as on a fresh machine with the packages installed; ``warm``: the same directory afterwards
(what the cold run converted, packed and compiled is loaded). Each run is a fresh process; the time to the
first byte of text on stdout is the first-token time, the time to exit the whole command (a cold run on the
compiled backend compiles after answering). ``--model`` / ``--draft-model`` time the command on other models
(the real pair: ``--model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct``, with their
presets). Prints (and with ``--output`` writes) JSON with the command, the machine and the commit.

    python bench/bench_first_run.py --warm-runs 3 --output bench/results/first_run.json
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from specdec.tools.bench.runtime import git_commit, machine_info

PROMPT = "Explain speculative decoding in two sentences."


def timed_run(argv: list[str], env: dict[str, str]) -> dict:
    """Run ``argv``: seconds to the first non-blank stdout bytes and to exit, the summary line (stderr)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    first = None
    while chunk := proc.stdout.read1(4096):
        if first is None and chunk.strip():
            first = time.perf_counter() - start
    rc = proc.wait()
    total = time.perf_counter() - start
    reader.join()
    text = err[0].decode(errors="replace") if err else ""
    if rc != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({rc}):\n{text[-3000:]}")
    summary = next((line for line in reversed(text.splitlines()) if line.startswith("[")), "")
    return {"first_token_s": round(first, 2), "total_s": round(total, 2), "summary": summary}


def how(summary: str) -> str:
    """A run's speed and what it ran, from its summary line (``[N tokens in S s, R tok/s, STRATEGY, BACKEND AMP,
    ...]``)."""
    fields = summary.strip("[]").split(", ")
    return ", ".join(fields[1:4]) if len(fields) >= 4 else "—"


def table(result: dict) -> str:
    """Markdown: cold and warm first-token and total seconds (warm: medians) and what the runs generated with."""
    cold, warm = result["cold"], result["warm"]
    rows = ["| run | first token (s) | command done (s) | tok/s, how it generated |", "|---|---:|---:|---|"]
    rows.append(f"| cold (empty cache) | {cold['first_token_s']:.1f} | {cold['total_s']:.1f} | "
                f"{how(cold['summary'])} |")
    rows.append(f"| warm (median of {len(warm)}) | {statistics.median(r['first_token_s'] for r in warm):.1f} | "
                f"{statistics.median(r['total_s'] for r in warm):.1f} | "
                f"{how(sorted(warm, key=lambda r: r['total_s'])[len(warm) // 2]['summary'])} (the median run) |")
    models = " ".join(f"--{flag} {result[key]}" for flag, key in (("model", "model"), ("draft-model", "draft_model"))
                      if result.get(key))
    defaults = "their presets" if models else "defaults: the embedded model, compiled backend, bf16"
    rows += ["", f"`specdec generate \"{result.get('prompt', PROMPT)}\"{' ' + models if models else ''}` ({defaults}, "
                 f"{result['threads']} threads); {result['machine'].get('cpu_model')}, commit {result['commit']}."]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warm-runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--model", default=None, help="--model of the command (default: the embedded model)")
    p.add_argument("--draft-model", default=None, help="--draft-model of the command (default: none)")
    p.add_argument("--prompt", default=PROMPT)
    args = p.parse_args(argv)
    specdec = shutil.which("specdec") or sys.exit("the specdec command is not installed (pip install -e .)")
    command = [specdec, "generate", args.prompt, "--threads", str(args.threads)]
    for flag, value in (("--model", args.model), ("--draft-model", args.draft_model)):
        command += [flag, value] if value else []
    cache = Path(tempfile.mkdtemp(prefix="specdec-first-run-"))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["SPECDEC_CACHE"] = str(cache)
    try:
        print("cold run (empty cache) ...", file=sys.stderr, flush=True)
        cold = timed_run(command, env)
        warm = []
        for i in range(args.warm_runs):
            print(f"warm run {i + 1}/{args.warm_runs} ...", file=sys.stderr, flush=True)
            warm.append(timed_run(command, env))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    result = {"command": shlex.join([sys.executable, *sys.argv]), "commit": git_commit(),
              "machine": machine_info(), "threads": args.threads, "model": args.model, "draft_model": args.draft_model,
              "prompt": args.prompt, "cold": cold, "warm": warm}
    print(json.dumps(result, indent=1))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
