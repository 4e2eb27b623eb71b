#!/usr/bin/env python
"""``specdec bench-spec`` at two commits in the same run: a speed-regression check of a change.

Each commit is checked out into a temporary git worktree and imported from there (``PYTHONPATH``: this
environment's packages, that commit's ``specdec``); the runs alternate old, new, new, old, ... (``--rounds``
pairs, so a drift of the machine's speed falls on both), each a fresh process. A system's figure is the median
over its runs of bench-spec's own median tokens/s (and of its per-step time inside and outside graph calls);
systems are matched by position (``--old-strategy`` names
the old commit's strategies where the names changed). Prints (and with ``--output`` writes) JSON with the
command, the machine, both commits and the new / old ratio of every system.

    python bench/bench_commits.py --old 2cce165 --old-strategy draft,eagle --strategy model,eagle \\
        --rounds 2 --output bench/results/commits_bench_spec.json -- --ks 4 --num-prompts 10 --max-new-tokens 64 \\
        --temperatures 0 --no-hf --threads 2
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

from specdec.tools.bench.runtime import git_commit, machine_info

ROOT = Path(__file__).resolve().parents[1]
RUN = "import sys; from specdec.cli import main; sys.exit(main(sys.argv[1:]))"


def resolve(commit: str) -> str:
    """``commit``'s short hash."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", commit], capture_output=True, text=True,
                          check=True).stdout.strip()


def worktree(commit: str, parent: Path) -> Path:
    """A detached worktree of ``commit`` under ``parent``."""
    path = parent / commit.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), commit], check=True)
    return path


def bench_spec(tree: Path, argv: list[str]) -> dict:
    """bench-spec's JSON, run from ``tree``'s sources in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", RUN, "bench-spec", *argv], capture_output=True, text=True,
                          env=env, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"bench-spec at {tree.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


SPLIT = ("graph_ms_per_step", "outside_graphs_ms_per_step")
"""bench-spec's per-step split of a system's time: inside graph calls and outside them (host work)."""


def systems(result: dict) -> list[tuple[str, float, dict]]:
    """(name, tokens/s, the per-step split) of target-only decoding, then of every system, in bench-spec's
    order."""
    runs = result["runs"]
    names = ["specdec-target", *result["config"]["systems"]]
    return [(name, runs[key]["tokens_per_s"], {k: runs[key].get(k) for k in SPLIT})
            for name in names for key in runs if key.split("@")[0] == name]


def table(result: dict) -> str:
    """Markdown: each system's tokens/s at both commits, the ratio, and its per-step time inside / outside
    graph calls."""
    old, new = result["commits"]["old"], result["commits"]["new"]
    rows = [f"| system | tok/s at `{old}` | tok/s at `{new}` | new / old | graph ms a step (old, new) "
            "| host ms a step (old, new) |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["systems"]:
        graph = ", ".join(f"{r[f'{side}_graph_ms_per_step']:.1f}" for side in ("old", "new"))
        host = ", ".join(f"{r[f'{side}_outside_graphs_ms_per_step']:.2f}" for side in ("old", "new"))
        name = r["system"] if r["system"] == r["old_system"] else f"{r['system']} (old: {r['old_system']})"
        rows.append(f"| {name} | {r['old_tokens_per_s']:.2f} | {r['new_tokens_per_s']:.2f} | {r['ratio']:.3f} | "
                    f"{graph} | {host} |")
    rounds = len(result["order"]) // 2
    rows += ["", f"Medians of {rounds} run(s) per commit, alternating ({', '.join(result['order'])}); each run "
                 "is bench-spec's median over its prompts."]
    return "\n".join(rows)


def commit_arguments(p: argparse.ArgumentParser) -> None:
    """The two commits' options: ``--old`` (required) and ``--new`` (default HEAD)."""
    p.add_argument("--old", required=True, help="the old commit")
    p.add_argument("--new", default="HEAD", help="the new commit (default: HEAD)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commit_arguments(p)
    p.add_argument("--strategy", required=True, help="bench-spec --strategy at the new commit")
    p.add_argument("--old-strategy", default=None, help="bench-spec --strategy at the old commit (default: the same)")
    p.add_argument("--rounds", type=int, default=2, help="old/new pairs, alternating (default: 2)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then bench-spec's other arguments (both commits)")
    options = p.parse_args(argv)
    common = [a for a in options.args if a != "--"]
    commits = {"old": resolve(options.old), "new": resolve(options.new)}
    argv_of = {"old": ["--strategy", options.old_strategy or options.strategy, *common],
               "new": ["--strategy", options.strategy, *common]}
    order = [side for i in range(options.rounds) for side in (("old", "new") if i % 2 == 0 else ("new", "old"))]
    found: dict[str, list[list[tuple[str, float, dict]]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {side: worktree(commit, Path(tmp)) for side, commit in commits.items()}
        try:
            for i, side in enumerate(order, 1):
                print(f"[{i}/{len(order)}] bench-spec at {side} ({commits[side][:10]})", file=sys.stderr, flush=True)
                found[side].append(systems(bench_spec(trees[side], argv_of[side])))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    old, new = found["old"][0], found["new"][0]
    if len(old) != len(new):
        raise SystemExit(f"the commits ran {len(old)} and {len(new)} systems: match --old-strategy to --strategy")
    rows = []
    for j, (old_name, new_name) in enumerate(zip((s[0] for s in old), (s[0] for s in new))):
        row = {"system": new_name, "old_system": old_name}
        for side in ("old", "new"):
            row[f"{side}_tokens_per_s"] = statistics.median(run[j][1] for run in found[side])
            row[f"{side}_runs"] = [run[j][1] for run in found[side]]
            for k in SPLIT:
                values = [run[j][2][k] for run in found[side] if run[j][2][k] is not None]
                row[f"{side}_{k}"] = statistics.median(values) if values else None
        row["ratio"] = row["new_tokens_per_s"] / row["old_tokens_per_s"]
        rows.append(row)
    result = {"command": "python bench/bench_commits.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "commit": git_commit(), "commits": commits, "machine": machine_info(), "order": order,
              "systems": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if options.output:
        Path(options.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
