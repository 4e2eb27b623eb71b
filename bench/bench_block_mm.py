"""The ``block_mm`` CPU kernel alone, on the Qwen2.5-Coder-1.5B's layer shapes with random codes (Q4_K layout for
the projections, Q6_K for the LM head): milliseconds per call, cycles per 32 weights and the codes' read rate,
for M rows (1 = a decode step, 5 / 9 = a verify of k = 4 / 8), and the sum over one forward pass (28 layers +
the head). Prints JSON with the CPU, the command and the commit. To compare kernel versions, run it under each
checkout back to back on an idle machine (``PYTHONPATH=<checkout>``; each source builds its own extension).

    python bench/bench_block_mm.py --threads 1 --rows 1,5,9
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.bench.runtime import git_commit, machine_info  # noqa: E402
from specdec.core.kernels import block_mm_isa, load_block_mm  # noqa: E402

# name → (N out features, K in features, 4-bit codes (Q4_K) or int8 (Q6_K), calls per forward pass)
SHAPES = {"qkv": (2048, 1536, True, 28), "o": (1536, 1536, True, 28), "gate_up": (17920, 1536, True, 28),
          "down": (1536, 8960, True, 28), "lm_head": (151936, 1536, False, 1)}


def layer(n: int, k: int, u4: bool, g: torch.Generator) -> tuple:
    """block_mm's weight arguments for an N x K layer of random codes and scales."""
    if u4:
        qs, group = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), 32
    else:
        qs, group = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g), 16
    d, dmin = torch.rand(n, k // 256, generator=g), torch.rand(n, k // 256, generator=g)
    sc, mn = (torch.randint(0, 63, (n, k // group), dtype=torch.int8, generator=g) for _ in range(2))
    return qs, d, dmin, sc, mn, group, 256


def best_seconds(fn, reps: int, rounds: int = 3) -> float:
    fn(), fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,5,9", help="comma-separated numbers of activation rows M")
    ap.add_argument("--ghz", type=float, default=2.5, help="core clock for the cycles column")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load_block_mm()
    g = torch.Generator().manual_seed(0)
    layers = {name: layer(n, k, u4, g) for name, (n, k, u4, _) in SHAPES.items()}
    results = []
    for m in (int(v) for v in a.rows.split(",")):
        forward = 0.0
        for name, (n, k, _, calls) in SHAPES.items():
            args, x = layers[name], torch.randn(m, k, generator=g)
            seconds = best_seconds(lambda x=x, args=args: torch.ops.specdec.block_mm(x, *args),
                                   reps=max(3, int(3e8 / (n * k))))
            forward += calls * seconds
            results.append({"rows": m, "layer": name, "ms": round(seconds * 1e3, 3),
                            "cycles_per_32_weights": round(seconds * a.ghz * 1e9 * a.threads / (n * k / 32), 2),
                            "codes_gb_per_s": round(layers[name][0].numel() / seconds / 1e9, 2)})
        results.append({"rows": m, "layer": "forward (28 layers + head)", "ms": round(forward * 1e3, 1)})
    report = {"command": "python " + " ".join(sys.argv), "machine": machine_info(), "isa": block_mm_isa(),
              "threads": a.threads, "commit": git_commit(), "results": results}
    text = json.dumps(report, indent=2)
    if a.output:
        Path(a.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
