#!/usr/bin/env python
"""Suffix decoding replayed on the target's recorded greedy outputs: τ, drafts and the decode phase's modelled
speedup of suffix chains (k = ``--ks``), suffix trees (``--trees``) and the oracle bound, per workload.

A greedy run's steps are a function of the target-only outputs alone (``specdec.suffix.replay``), so this
records them once (the target, batch 1, over ``bench_suffix.py``'s workloads, agent sessions turn by turn;
``--record``: reused when the file exists for the same model and workloads) and then replays each system in
milliseconds: ``steps``, ``tau`` (tokens a step, each request's first token, from its prompt, left out),
``drafted``, ``accepted``. ``chain-k<k>-oracle`` is chain k verifying only the drafts the target accepts: no
rule choosing how many proposed tokens to verify (a cost-aware chain length, a confidence cut) does better.
The modelled speedup of the decode phase (target-only decode steps / the steps' verify calls, one cost per
call size) uses each ``--costs`` file, a ``bench_decode_step.py`` result with batch-1 shapes 1xN (median ms);
it is a model, not a measurement: the end-to-end ratios come from ``bench_suffix.py``.

Command::

    python bench/bench_decode_step.py --model qwen2.5-coder-1.5b-instruct --quantization gguf --amp f32 \\
        --backend regional --shapes 1x1x256,1x2x256,1x3x256,1x5x256,1x9x256,1x17x256 --output costs.json
    python bench/bench_suffix_replay.py --model qwen2.5-coder-1.5b-instruct --quantization gguf --costs costs.json

The JSON (stdout and ``--output``): ``command``, ``commit``, ``machine``, ``config``, ``costs`` ({file: its sizes,
median ms, machine and commit}) and ``results`` ({workload: {system: {steps, tau, drafted, accepted,
modelled_speedup: {costs file: ratio}}}}).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_suffix import EMBEDDED_NAME, WORKLOADS, interleaved, log, name_list_of, workload  # noqa: E402

from specdec import DecoderModel, Engine  # noqa: E402
from specdec.suffix import SuffixCache, SuffixChain, SuffixDraft, SuffixProposer  # noqa: E402
from specdec.suffix.replay import Replay, VerifyCost, replay  # noqa: E402
from specdec.tools.arguments import int_list  # noqa: E402
from specdec.tools.bench import emit_json  # noqa: E402
from specdec.tools.bench.runtime import git_commit, machine_info  # noqa: E402


@dataclass
class ReplayBenchOptions:
    """The target and workloads recorded (as ``bench_suffix.py``'s), the systems replayed (chains of ``ks``
    drafts, with their oracles unless ``oracle`` is off; trees ``depth x nodes`` of ``trees``; each for every
    ``alphas`` × ``min_probs``), the cost curves."""

    model: str = EMBEDDED_NAME
    workloads: list[str] = field(default_factory=lambda: ["agent", "extraction", "refactor", "mt-bench"])
    requests: int = 12
    turns: int = 3
    max_new_tokens: int = 96
    seed: int = 0
    backend: str = "regional"
    amp: str = "f32"
    quantization: str | None = None
    n_positions: int = 1024
    threads: int = 2
    record: str | None = None
    ks: list[int] = field(default_factory=lambda: [4, 8, 16])
    trees: list[tuple[int, int]] = field(default_factory=lambda: [(4, 4), (8, 8)])
    alphas: list[float] = field(default_factory=lambda: [1.0])
    min_probs: list[float] = field(default_factory=lambda: [0.1])
    oracle: bool = True
    costs: list[str] = field(default_factory=list)
    output: str | None = None

    def recorded(self) -> dict:
        """What a record depends on (a reused record must match it): the target's weights and the requests."""
        return {name: getattr(self, name)
                for name in ("model", "amp", "quantization", "requests", "turns", "max_new_tokens", "seed")}


def record(cfg: ReplayBenchOptions) -> dict[str, list[tuple[list[int], list[int]]]]:
    """{workload: [(prompt ids, target-only greedy output ids)], in the order they ran}, from ``cfg.record``
    when it holds them, else generated (and saved there)."""
    path = Path(cfg.record) if cfg.record else None
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        if saved["config"] == cfg.recorded() and set(cfg.workloads) <= set(saved["workloads"]):
            log(f"replaying the outputs recorded in {path}")
            return {w: [tuple(r) for r in saved["workloads"][w]] for w in cfg.workloads}
        raise SystemExit(f"{path} records other requests ({saved['config']}, workloads {list(saved['workloads'])}): "
                         "give another --record path")
    log(f"loading {cfg.model} ...")
    target = DecoderModel.from_pretrained(cfg.model, batch_size=1, n_positions=cfg.n_positions, amp=cfg.amp,
                                          backend=cfg.backend, quantization=cfg.quantization, progress=False)
    engine, out = Engine(target), {}
    for name in cfg.workloads:
        log(f"recording {name} (target-only greedy)")
        runs: list[tuple[list[int], list[int]]] = []

        def generate(ids: list[int], runs: list = runs) -> list[int]:
            engine.generate([ids], max_new_tokens=cfg.max_new_tokens)
            runs.append((ids, list(engine.rows[0].new)))
            return runs[-1][1]
        interleaved(workload(name, target.tokenizer, cfg.requests, cfg.turns, cfg.seed), target.tokenizer,
                    {"target": generate})
        out[name] = runs
    if path is not None:
        path.write_text(json.dumps({"config": cfg.recorded(), "workloads": out}) + "\n")
    return out


def systems(cfg: ReplayBenchOptions, vocab_size: int) -> dict[str, tuple[Callable[[], SuffixProposer], int, bool]]:
    """{name: (a factory of its proposer, with an empty cache; k; oracle)} for every system replayed: per
    (alpha, min_prob) of ``cfg.alphas`` × ``cfg.min_probs`` (named ``-a<alpha>-p<min_prob>`` when there are
    several), the chains of ``cfg.ks`` (and their oracles with ``cfg.oracle``), then the trees of ``cfg.trees``."""
    target = ReplayTarget(vocab_size=vocab_size, n_positions=cfg.n_positions)
    out: dict[str, tuple[Callable[[], SuffixProposer], int, bool]] = {}
    sweep = len(cfg.alphas) * len(cfg.min_probs) > 1
    for alpha, min_prob in itertools.product(cfg.alphas, cfg.min_probs):
        kw = dict(alpha=alpha, min_prob=min_prob)
        tag = f"-a{alpha:g}-p{min_prob:g}" if sweep else ""
        for k in cfg.ks:
            for oracle in (False, True)[:1 + cfg.oracle]:
                name = f"chain-k{k}{tag}" + ("-oracle" if oracle else "")
                out[name] = (lambda kw=kw: SuffixChain(target, SuffixCache(), **kw), k, oracle)
        for depth, nodes in cfg.trees:
            out[f"tree-{depth}x{nodes}{tag}"] = (
                lambda d=depth, n=nodes, kw=kw: SuffixDraft(target, SuffixCache(), depth=d, num_nodes=n, **kw),
                depth, False)
    return out


@dataclass
class ReplayTarget:
    """What a suffix proposer reads of its target (batch 1), for a replay without one."""

    vocab_size: int
    n_positions: int
    batch_size: int = 1
    device: str = "cpu"


def entry(r: Replay, costs: dict[str, VerifyCost]) -> dict:
    return {"steps": len(r.steps), "tokens": r.tokens, "tau": r.tau, "drafted": r.drafted, "accepted": r.accepted,
            "modelled_speedup": {name: r.modelled_speedup(cost) for name, cost in costs.items()}}


def table(result: dict) -> str:
    """Markdown: per workload and system, steps, τ, drafted and accepted tokens, and the modelled decode speedup
    under each cost curve (named by its file, with its 5- and 9-token calls in decode steps)."""
    costs = {path: VerifyCost(tuple(c["sizes"]), tuple(c["median_ms"])) for path, c in result["costs"].items()}
    names = [f"× decode, {Path(path).stem} (5 / 9 tokens: {c(5) / c(1):.2f} / {c(9) / c(1):.2f})"
             for path, c in costs.items()]
    rows = ["| workload | system | steps | τ | drafted | accepted | " + " | ".join(names) + " |",
            "|---|---|---:|---:|---:|---:|" + "---:|" * len(names)]
    for workload_name, systems_ in result["results"].items():
        for system, e in systems_.items():
            speedups = " | ".join(f"{e['modelled_speedup'][path]:.2f}" for path in costs)
            rows.append(f"| {workload_name} | {system} | {e['steps']} | {e['tau']:.2f} | {e['drafted']} | "
                        f"{e['accepted']} | {speedups} |")
    cfg = result["config"]
    rows += ["", f"{cfg['model']}: target-only greedy outputs of {cfg['requests']} requests a workload (agent: "
                 f"sessions of {cfg['turns']} turns), at most {cfg['max_new_tokens']} new tokens each, replayed; "
                 f"alpha {', '.join(map(str, cfg['alphas']))}, min_prob {', '.join(map(str, cfg['min_probs']))}. "
                 "The speedups are modelled (the decode phase "
                 "only, from each file's call costs), not measured."]
    return "\n".join(rows)


def sweep_table(result: dict) -> str:
    """Markdown: a row per system, a column per workload, each cell the modelled decode speedups under the cost
    curves (in ``table``'s order) and τ."""
    workloads = list(result["results"])
    costs = list(result["costs"])
    rows = ["| system | " + " | ".join(workloads) + " |", "|---|" + "---:|" * len(workloads)]
    for system in result["results"][workloads[0]]:
        cells = []
        for w in workloads:
            e = result["results"][w][system]
            cells.append(" · ".join(f"{e['modelled_speedup'][c]:.2f}" for c in costs) + f" (τ {e['tau']:.2f})")
        rows.append(f"| {system} | " + " | ".join(cells) + " |")
    curves, cfg = "; ".join(f"{Path(c).stem}" for c in costs), result["config"]
    rows += ["", f"Each cell: the decode phase's modelled speedup under {curves} (in that order), and τ. "
                 f"{cfg['model']}, {cfg['requests']} requests a workload (agent: sessions of {cfg['turns']} turns), "
                 f"at most {cfg['max_new_tokens']} new tokens each."]
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> ReplayBenchOptions:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = ReplayBenchOptions()
    p.add_argument("--model", default=d.model, help="the target (as bench_suffix.py's --model)")
    p.add_argument("--workloads", type=name_list_of(WORKLOADS), default=d.workloads, help="comma list")
    p.add_argument("--requests", type=int, default=d.requests, help="per workload (agent: sessions)")
    p.add_argument("--turns", type=int, default=d.turns, help="agent: turns per session")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--seed", type=int, default=d.seed, help="the workloads' generator seed")
    p.add_argument("--backend", choices=("eager", "compiled", "regional"), default=d.backend)
    p.add_argument("--amp", choices=("f32", "bf16"), default=d.amp)
    p.add_argument("--quantization", default=None, choices=("int8", "int4", "gguf"))
    p.add_argument("--n-positions", type=int, default=d.n_positions)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (recording)")
    p.add_argument("--record", default=None, help="the recorded outputs' JSON (reused when it exists)")
    p.add_argument("--ks", type=int_list, default=d.ks, help="chain lengths")
    p.add_argument("--trees", type=tree_list, default=d.trees, help="tree shapes DEPTHxNODES, comma list")
    p.add_argument("--alphas", type=float_list, default=d.alphas, help="max_spec = alpha * match length (comma list)")
    p.add_argument("--min-probs", type=float_list, default=d.min_probs,
                   help="a drafted token's least frequency (comma list)")
    p.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=d.oracle,
                   help="replay each chain's oracle too")
    p.add_argument("--costs", nargs="+", default=[], metavar="JSON", help="bench_decode_step.py results")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if min(args.requests, args.turns, args.max_new_tokens, *args.ks) < 1:
        p.error("--requests, --turns, --max-new-tokens and --ks must be >= 1")
    if max(args.min_probs) > 1:
        p.error("--min-probs are frequencies: at most 1")
    return ReplayBenchOptions(**vars(args))


def float_list(text: str) -> list[float]:
    """An argparse type: "0.5,1" → [0.5, 1.0] (each > 0)."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"a comma list of numbers > 0, got {text!r}")
    return list(dict.fromkeys(values))


def tree_list(text: str) -> list[tuple[int, int]]:
    """An argparse type: "4x4,8x8" → [(4, 4), (8, 8)] (depth, nodes); "" → none."""
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]
    except ValueError:
        shapes = None
    if shapes is None or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"tree shapes are DEPTHxNODES (>= 1), comma separated, got {text!r}")
    return shapes


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    costs_json = {path: json.loads(Path(path).read_text()) for path in cfg.costs}
    costs = {path: VerifyCost.from_decode_steps(c) for path, c in costs_json.items()}
    with torch.no_grad():
        records = record(cfg)
    vocab_size = 1 + max(t for runs in records.values() for prompt, out in runs for t in prompt + out)
    result: dict = {"command": " ".join([sys.executable, *sys.argv]), "commit": git_commit(),
                    "machine": machine_info(), "config": asdict(cfg),
                    "costs": {path: {"sizes": list(costs[path].sizes), "median_ms": list(costs[path].ms),
                                     "machine": c.get("machine"), "commit": c.get("commit")}
                              for path, c in costs_json.items()},
                    "results": {}}
    for name, runs in records.items():
        result["results"][name] = {}
        for system, (make, k, oracle) in systems(cfg, vocab_size).items():
            result["results"][name][system] = entry(replay(make(), runs, k, oracle=oracle), costs)
    emit_json(result, cfg.output)
    log(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
