"""The ``block_mm`` CPU kernel alone, on a stack of layers shaped like the Qwen2.5-Coder-1.5B's (28 layers of
Q4_K projections and a Q6_K LM head, random codes, about 1 GB: every call reads its weights from memory, as in
a forward pass): milliseconds per layer kind and per whole forward pass for M rows (1 = a decode step, 5 / 9
= a verify of k = 4 / 8), and each M's cost relative to one row (flat = 1), for each instruction-set path of
``--isas`` in turn (e.g. ``avx512vnni,avx512``: the same CPU with and without VNNI). Prints JSON with the CPU,
the command and the commit. To compare kernel versions, run it under each checkout back to back on an idle
machine (``PYTHONPATH=<checkout>``; each source builds its own extension). ``--prefetch 4096,0`` times the
software prefetch distances given (bytes ahead of the weight stream; 0: none) in turn, pass after pass, and adds
each one's median ratio to the first; ``--prefetch-min-rows`` sets the fewest rows a call prefetches at (the
kernel's default: 1, every call).

    python bench/bench_block_mm.py --threads 2 --rows 1,5,9,16 [--isas avx512vnni,avx512] [--prefetch 4096,0]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.core.block_linear import BlockLinear  # noqa: E402
from specdec.core.gguf_weights import FORMATS, BlockWeights  # noqa: E402
from specdec.core.kernels import block_mm_isa, block_mm_prefetch, set_block_mm_isa, set_block_mm_prefetch  # noqa: E402
from specdec.tools.bench.runtime import git_commit, machine_info  # noqa: E402

# name → (N out features, K in features, GGML type, layers)
SHAPES = {"qkv": (2048, 1536, "Q4_K", 28), "o": (1536, 1536, "Q4_K", 28), "gate_up": (17920, 1536, "Q4_K", 28),
          "down": (1536, 8960, "Q4_K", 28), "lm_head": (151936, 1536, "Q6_K", 1)}


def random_layer(n: int, k: int, qtype: str, g: torch.Generator) -> BlockLinear:
    """An N x K layer of random codes and scales of ``qtype`` (Q4_K or Q6_K)."""
    sb, _, group = FORMATS[qtype]
    lo, hi = (0, 16) if qtype == "Q4_K" else (-32, 32)
    codes = torch.randint(lo, hi, (n, k), dtype=torch.int16, generator=g)
    d, dmin = ((torch.rand(n, k // sb, generator=g) * 1e-3).half() for _ in range(2))     # f16, as in GGUF
    sc, mn = (torch.randint(0, 63, (n, k // group), dtype=torch.int16, generator=g) for _ in range(2))
    if qtype == "Q6_K":
        dmin, mn = torch.zeros_like(dmin), torch.zeros_like(mn)
    return BlockLinear.from_blocks(BlockWeights(qtype, codes, group, sb, d, dmin, sc, mn), torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,5,9,16", help="comma-separated numbers of activation rows M")
    ap.add_argument("--repeats", type=int, default=5, help="forward passes timed per M (median)")
    ap.add_argument("--isas", default="auto",
                    help="comma-separated code paths to time in turn (avx512vnni, avx512, avx2, portable; "
                         "default: auto, the best this CPU runs)")
    ap.add_argument("--prefetch", default=None,
                    help="comma-separated prefetch distances in bytes, timed in turn (default: the kernel's own)")
    ap.add_argument("--prefetch-min-rows", type=int, default=None,
                    help="calls of at least this many rows prefetch (default: the kernel's own, 1)")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    stack = {name: [random_layer(n, k, qtype, g) for _ in range(layers)]
             for name, (n, k, qtype, layers) in SHAPES.items()}
    default_bytes, default_rows = block_mm_prefetch()
    prefetches = [int(v) for v in a.prefetch.split(",")] if a.prefetch else [default_bytes]
    min_rows = default_rows if a.prefetch_min_rows is None else a.prefetch_min_rows
    set_block_mm_prefetch(prefetches[0], min_rows)
    results = []
    for isa in a.isas.split(","):
        set_block_mm_isa(isa)
        results += forward_passes(stack, [int(v) for v in a.rows.split(",")], a.repeats, g, prefetches)
    report = {"command": "python " + " ".join(sys.argv), "machine": machine_info(), "threads": a.threads,
              "prefetch_min_rows": min_rows, "commit": git_commit(), "results": results}
    text = json.dumps(report, indent=2)
    if a.output:
        Path(a.output).write_text(text + "\n")
    print(text)


def forward_passes(stack: dict[str, list[BlockLinear]], rows: list[int], repeats: int, g: torch.Generator,
                   prefetches: list[int]) -> list[dict]:
    """For each M of ``rows`` and prefetch distance of ``prefetches`` (timed in turn, pass after pass):
    milliseconds per layer kind (median of ``repeats`` passes after one warm-up) and per forward pass on the
    current code path, the pass's cost relative to the first M (same distance), and the median of its per-pass
    ratios to the first distance."""
    results, base = [], {}
    for m in rows:
        xs = {name: torch.randn(m, k, generator=g) for name, (_, k, _, _) in SHAPES.items()}
        per_kind = {p: {name: [] for name in SHAPES} for p in prefetches}
        passes: dict[int, list[float]] = {p: [] for p in prefetches}
        for _ in range(repeats + 1):                  # the first pass warms up
            for p in prefetches:
                set_block_mm_prefetch(p)
                for name, layers in stack.items():
                    start = time.perf_counter()
                    for layer in layers:
                        layer(xs[name])
                    per_kind[p][name].append(time.perf_counter() - start)
                passes[p].append(sum(t[-1] for t in per_kind[p].values()))
        for p in prefetches:
            kinds = {name: round(statistics.median(t[1:]) * 1e3, 2) for name, t in per_kind[p].items()}
            forward = round(sum(kinds.values()), 1)
            base.setdefault(p, forward)
            ratio = statistics.median(a / b for a, b in zip(passes[p][1:], passes[prefetches[0]][1:]))
            results.append({"isa": block_mm_isa(), "rows": m, "prefetch": p, "forward_ms": forward,
                            "vs_one_row": round(forward / base[p], 2), "vs_first_prefetch": round(ratio, 3),
                            "ms": kinds})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    set_block_mm_prefetch(prefetches[0])
    return results


if __name__ == "__main__":
    main()
