"""The ``block_mm`` CPU kernel alone, on a stack of layers shaped like the Qwen2.5-Coder-1.5B's (28 layers of
Q4_K projections and a Q6_K LM head, random codes, about 1 GB: every call reads its weights from memory, as in
a forward pass): milliseconds per layer kind and per whole forward pass for M rows (1 = a decode step, 5 / 9
= a verify of k = 4 / 8), and each M's cost relative to one row (flat = 1), for each instruction-set path of
``--isas`` in turn (e.g. ``avx512vnni,avx512``: the same CPU with and without VNNI). Prints JSON with the CPU,
the command and the commit, and (with AVX512-VNNI) the CPU's peak rate of ``vpdpbusd`` on all threads, from
which it derives the least time a row can cost: every row needs one ``vpdpbusd`` per 64 weight ·
activation products. To compare kernel versions, run it under each checkout back to back on an idle
machine (``PYTHONPATH=<checkout>``; each source builds its own extension).

    python bench/bench_block_mm.py --threads 2 --rows 1,5,9,16 [--isas avx512vnni,avx512]
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
from specdec.core.kernels import block_mm_isa, set_block_mm_isa  # noqa: E402
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
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    stack = {name: [random_layer(n, k, qtype, g) for _ in range(layers)]
             for name, (n, k, qtype, layers) in SHAPES.items()}
    results = []
    for isa in a.isas.split(","):
        set_block_mm_isa(isa)
        results += forward_passes(stack, [int(v) for v in a.rows.split(",")], a.repeats, g)
    report = {"command": "python " + " ".join(sys.argv), "machine": machine_info(), "threads": a.threads,
              "commit": git_commit(), "results": results, "int8_peak": int8_peak(stack, a.threads)}
    text = json.dumps(report, indent=2)
    if a.output:
        Path(a.output).write_text(text + "\n")
    print(text)


def forward_passes(stack: dict[str, list[BlockLinear]], rows: list[int], repeats: int,
                   g: torch.Generator) -> list[dict]:
    """For each M of ``rows``: milliseconds per layer kind (median of ``repeats`` passes after one warm-up)
    and per forward pass on the current code path, and the pass's cost relative to the first M."""
    results, base = [], None
    for m in rows:
        xs = {name: torch.randn(m, k, generator=g) for name, (_, k, _, _) in SHAPES.items()}
        per_kind: dict[str, list[float]] = {name: [] for name in SHAPES}
        for _ in range(repeats + 1):                  # the first pass warms up
            for name, layers in stack.items():
                start = time.perf_counter()
                for layer in layers:
                    layer(xs[name])
                per_kind[name].append(time.perf_counter() - start)
        kinds = {name: round(statistics.median(t[1:]) * 1e3, 2) for name, t in per_kind.items()}
        forward = round(sum(kinds.values()), 1)
        base = base or forward
        results.append({"isa": block_mm_isa(), "rows": m, "forward_ms": forward, "vs_one_row": round(forward / base, 2),
                        "ms": kinds})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


PEAK_SOURCE = r"""
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <chrono>
// vpdpbusd on 8 independent accumulators per thread, every thread: instructions a second (the CPU's peak)
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static int64_t chains(int64_t iters) {
  __m512i a[8];
  const __m512i b = _mm512_set1_epi32(0x01020304), c = _mm512_set1_epi32(0x01010101);
  for (int i = 0; i < 8; ++i) a[i] = _mm512_set1_epi32(i);
  for (int64_t n = 0; n < iters; ++n) {
    for (int i = 0; i < 8; ++i) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
    __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]));   // keep the chains
    __asm__ volatile("" : "+v"(a[4]), "+v"(a[5]), "+v"(a[6]), "+v"(a[7]));
  }
  int64_t s = 0;
  for (int i = 0; i < 8; ++i) s += _mm512_reduce_add_epi32(a[i]);
  return s;
}
double peak(int64_t iters) {
  const int threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) { for (int64_t t = b; t < e; ++t) chains(iters); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 8.0 * iters * threads / s;
}
"""


def int8_peak(stack: dict[str, list[BlockLinear]], threads: int) -> dict | None:
    """The CPU's ``vpdpbusd`` rate on ``threads`` threads (best of 5 runs of 0.2 G instructions a thread) and
    the least time one activation row of the stack can cost at it (None without AVX512-VNNI)."""
    from torch.utils.cpp_extension import load_inline

    if "avx512vnni" not in block_mm_isa():
        return None
    module = load_inline("specdec_int8_peak", cpp_sources=PEAK_SOURCE, functions=["peak"],
                         extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"])
    rate = max(module.peak(25_000_000) for _ in range(5))
    weights = sum(layer.out_features * layer.in_features for layers in stack.values() for layer in layers)
    instructions = weights / 64                   # 64 products a vpdpbusd
    return {"vpdpbusd_per_s": round(rate), "threads": threads, "vpdpbusd_per_row": round(instructions),
            "least_ms_per_row": round(instructions / rate * 1e3, 2)}


if __name__ == "__main__":
    main()
