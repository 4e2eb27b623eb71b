"""One target graph call, timed: a decode step (n = 1) or a verify step (n tokens, causal) at a batch size
and KV bucket, on the embedded model (compiled bf16 by default). For comparing runtime changes: run it
under each version (e.g. ``PYTHONPATH=<other checkout>``) back to back on an idle machine.

    python bench/bench_decode_step.py --shapes 1x1x384,1x9x384,4x1x384,4x9x384,128x1x640 --threads 2

A shape is BATCHxNxKV. Every row holds KV - n - 1 cached tokens (so the step fills the bucket); the step is
run ``--warmup`` times, then timed ``--repeats`` times (median, min in ms). Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x1x384,1x9x384,4x1x384,4x9x384,128x1x640")
    ap.add_argument("--backend", default="compiled")
    ap.add_argument("--amp", default="bf16")
    ap.add_argument("--autotune", action="store_true", help="Inductor freezing + max_autotune (README, Autotuned graphs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specdec.bench import emit_json
    from specdec import DecoderModel

    results = []
    for shape in args.shapes.split(","):
        b, n, kv = (int(x) for x in shape.split("x"))
        model = DecoderModel.from_pretrained(None, batch_size=b, n_positions=kv, amp=args.amp, backend=args.backend,
                                             kv_buckets=[kv], context_buckets=[kv], progress=False,
                                             autotune=args.autotune)
        model.set_lengths(torch.full((b,), kv - n - 1))
        tokens = torch.randint(100, 20000, (b, n), generator=torch.Generator().manual_seed(0))
        params = model.sampling_params(do_sample=False)
        times = []
        for i in range(args.warmup + args.repeats):
            start = time.perf_counter()
            model.step(tokens, params, advance=False).tokens.cpu()
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1000)
        results.append({"batch": b, "n": n, "kv": kv, "median_ms": round(statistics.median(times), 2),
                        "min_ms": round(min(times), 2)})
        print(json.dumps(results[-1]), flush=True)
    out = {"config": {k: v for k, v in vars(args).items() if k != "output"}, "torch": torch.__version__,
           "results": results}
    emit_json(out, args.output)


if __name__ == "__main__":
    main()
