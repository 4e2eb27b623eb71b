#!/usr/bin/env python
"""One model's graph calls (decode and verify steps) at two commits, side by side: a kernel change's A/B.

Each commit is checked out into a temporary git worktree, and a worker process per commit (that commit's
``specdec``, this environment's packages) loads the model once per (batch, KV bucket). The two workers then run
bursts of ``--steps`` calls of one shape in turn (old, new, then new, old, ...), ``--rounds`` bursts each per
shape, so both commits see the machine in the same state within seconds: on a shared host a step's time drifts by
20-30 % over minutes and between processes, and separate processes run one after the other do not compare. Per
shape: each commit's median over its bursts of the burst's median ms, and the median (min, max) of the per-round
ratios new / old. Prints (and with ``--output`` writes) JSON with the command, the machine and both commits.
The workers call ``DecoderModel.from_pretrained``, ``set_lengths`` and ``step`` as this commit does: commits
whose API differs do not compare.

    python bench/bench_commits_steps.py --old ff14a0e --model qwen2.5-coder-0.5b-instruct --quantization q4_0 \\
        --output-vocab-size 65536 --shapes 1x1x256,1x5x256 --output bench/results/commits_steps_draft.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_commits import ROOT, commit_arguments, resolve, worktree

from specdec.tools.bench import emit_json

WORKER = """
import statistics, sys, time, torch
from specdec import DecoderModel
model, quantization, amp, backend, vocab, b, kv, threads = sys.argv[1:9]
b, kv = int(b), int(kv)
torch.set_num_threads(int(threads))
torch.set_grad_enabled(False)
m = DecoderModel.from_pretrained(model, quantization=None if quantization == "none" else quantization, amp=amp,
                                 backend=backend, batch_size=b, n_positions=kv, kv_buckets=[kv], context_buckets=[kv],
                                 progress=False, **({} if vocab == "none" else {"output_vocab_size": int(vocab)}))
params = m.sampling_params(do_sample=False)
print("ready", flush=True)
for line in sys.stdin:
    n, steps = map(int, line.split())
    tokens = torch.randint(100, 20000, (b, n), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(steps + 1):                       # the first call warms up
        m.set_lengths(torch.full((b,), kv - n - 1))
        start = time.perf_counter()
        m.step(tokens, params, advance=False).tokens.cpu()
        if i:
            times.append(time.perf_counter() - start)
    print(statistics.median(times) * 1e3, flush=True)
"""


class Worker:
    """A worker process at one commit's tree with the model loaded for one (batch, KV bucket)."""

    def __init__(self, tree: Path, options: argparse.Namespace, b: int, kv: int):
        argv = [options.model, options.quantization, options.amp, options.backend, str(options.output_vocab_size),
                str(b), str(kv), str(options.threads)]
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, *argv], cwd=tree, text=True,
                                     env={**os.environ, "PYTHONPATH": str(tree)}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the worker at {tree.name} did not load the model (exit {self.proc.wait()})")

    def burst(self, n: int, steps: int) -> float:
        """The median ms of ``steps`` calls of n tokens a row."""
        self.proc.stdin.write(f"{n} {steps}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker stopped (exit {self.proc.wait()})")
        return float(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def table(*results: dict) -> str:
    """Markdown: per model and shape, each commit's median ms and the median (min, max) of the per-round ratios
    (the results' commits: the first's)."""
    old, new = results[0]["commits"]["old"], results[0]["commits"]["new"]
    rows = [f"| model | batch × tokens | ms at `{old}` | ms at `{new}` | new / old (min, max) |",
            "|---|---|---:|---:|---:|"]
    notes = []
    for result in results:
        c = result["config"]
        for r in result["results"]:
            rows.append(f"| {c['model']} `{c['quantization']}` | {r['batch']} × {r['n']} | {r['old_ms']:.2f} | "
                        f"{r['new_ms']:.2f} | {r['ratio']:.3f} ({r['ratio_min']:.3f}, {r['ratio_max']:.3f}) |")
        notes.append(f"{c['model']}: {c['rounds']} bursts of {c['steps']} calls per commit and shape")
    c = results[0]["config"]
    rows += ["", f"KV bucket {results[0]['results'][0]['kv']}; {c['backend']} {c['amp']}, {c['threads']} threads; "
                 f"{'; '.join(notes)}, the commits' workers in turn."]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commit_arguments(p)
    p.add_argument("--model", required=True, help="a named model, a .gguf file or a checkpoint directory")
    p.add_argument("--quantization", default="none")
    p.add_argument("--amp", default="f32")
    p.add_argument("--backend", default="regional")
    p.add_argument("--output-vocab-size", default="none", help="score only token ids [0, N) (a draft's LM head)")
    p.add_argument("--shapes", default="1x1x256", help="comma list of BATCHxTOKENSxKV (default: 1x1x256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20, help="bursts per commit and shape (default: 20)")
    p.add_argument("--steps", type=int, default=20, help="calls per burst (default: 20)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    options = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in options.shapes.split(",")]
    commits = {"old": resolve(options.old), "new": resolve(options.new)}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {side: worktree(commit, Path(tmp)) for side, commit in commits.items()}
        try:
            for b, kv in dict.fromkeys((b, kv) for b, _, kv in shapes):
                workers = {side: Worker(tree, options, b, kv) for side, tree in trees.items()}
                for n in [n for b_, n, kv_ in shapes if (b_, kv_) == (b, kv)]:
                    ms: dict[str, list[float]] = {"old": [], "new": []}
                    for i in range(options.rounds):
                        for side in (("old", "new") if i % 2 == 0 else ("new", "old")):
                            ms[side].append(workers[side].burst(n, options.steps))
                    ratios = [a / b_ for a, b_ in zip(ms["new"], ms["old"])]
                    results.append({"batch": b, "n": n, "kv": kv, "old_ms": statistics.median(ms["old"]),
                                    "new_ms": statistics.median(ms["new"]), "ratio": statistics.median(ratios),
                                    "ratio_min": min(ratios), "ratio_max": max(ratios), "old_runs": ms["old"],
                                    "new_runs": ms["new"]})
                    print(json.dumps({k: v for k, v in results[-1].items() if not k.endswith("_runs")}),
                          file=sys.stderr, flush=True)
                for worker in workers.values():
                    worker.close()
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    config = {k: v for k, v in vars(options).items() if k not in ("old", "new", "output")}
    emit_json({"commits": commits, "config": config, "results": results}, options.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
