"""One target graph call, timed: a decode step (n = 1) or a verify step (n tokens, causal) at a batch size
and KV bucket, on the embedded model (compiled bf16 by default) or ``--model`` (a named model such as
``qwen2.5-coder-1.5b-instruct``, a GGUF file, a checkpoint) with ``--quantization``.
For comparing runtime changes: run it under each version (e.g. ``PYTHONPATH=<other checkout>``) back to back on
an idle machine.

    python bench/bench_decode_step.py --shapes 1x1x384,1x9x384,4x1x384,4x9x384,128x1x640 --threads 2

A shape is BATCHxNxKV. Every row holds KV - n - 1 cached tokens (so the step fills the bucket); the step is
run ``--warmup`` times, then timed ``--repeats`` times (median, min in ms). Shapes of one batch size and KV
bucket share a model and are timed in turn, repeat after repeat, so that each one's median ratio to the first
of them (``vs_n<n>_median``: e.g. a verify in decode steps) is measured under the same memory bandwidth.
The A/B variants below are called in alternating order (A B, then B A), so that neither always runs right
after the other with its weights possibly still in the last-level cache. Prints JSON.

``--ab-split-projections``: A/B in one process — each shape also runs on a second copy of the model whose
q/k/v and gate/up are separate layers again (``split_projections``: the layout before
``quant.fuse_projections`` fused float projections), the two called in turn; adds the split copy's
median and the median of the per-pair ratios split / fused.

``--ab-quantization Q``: A/B in one process — each shape also runs on a second copy of the model loaded with
``quantization=Q`` (e.g. a ``q4_0`` draft against its ``gguf`` blocks), the two called in turn; adds the copy's
median (``<Q>_median_ms``) and the median of the per-pair ratios (``<Q>_over_fused_median``: Q ÷ the first).

``--ab-unfused-layers`` (a ``gguf`` model in f32 on the CPU, whose layers run as ``block_layer``'s five kernel
calls): A/B in one process and on one copy of the weights — each shape also runs with the layers' own forward
(RMSNorm, SDPA and the element-wise steps between the matmuls; on ``regional``, compiled per layer), the two
called in turn; adds that variant's median and the median of the per-pair ratios unfused / fused.

``--ab-layer-loop`` (such a model): A/B in one process and on one copy of the weights — each shape also runs
with the layers' ``block_layer`` calls one by one from Python instead of all of them in one ``block_layers`` call
(``block_layer.BlockStack``); adds that variant's median and the median of the per-pair ratios loop / stack.

``--ab-prefetch BYTES:MIN_ROWS`` (such a model): A/B in one process and on one copy of the weights — each shape
also runs with ``block_mm``'s software prefetch set so (``set_block_mm_prefetch``: BYTES ahead, in calls of at
least MIN_ROWS rows; the kernel's default for the first); adds that variant's median
(``prefetch<BYTES>r<MIN_ROWS>_median_ms``) and the median of the per-pair ratios variant / default.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn


def split_projections(model) -> None:
    """Undo ``quant.fuse_projections`` on a float model: q/k/v and gate/up as separate layers again (row
    blocks of the fused weight, in ``quant.FUSED`` order)."""
    from specdec.core.quant import FUSED, linear_of
    for block in list(model.lm.modules()):
        for fused_name, names in FUSED.items():
            fused = getattr(block, fused_name, None)
            if type(fused) is not nn.Linear:
                continue
            sizes = block.qkv_sizes if fused_name == "qkv_proj" else [fused.out_features // 2] * 2
            biases = [None] * len(sizes) if fused.bias is None else fused.bias.split(sizes)
            for name, rows, bias in zip(names, fused.weight.split(sizes), biases):
                setattr(block, name, linear_of(rows.clone(), None if bias is None else bias.clone()))
            setattr(block, fused_name, None)


def prefetch_setting(text: str) -> str:
    """``--ab-prefetch``'s BYTES:MIN_ROWS (bytes >= 0, min_rows >= 1), checked."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[1]) < 1:
        raise argparse.ArgumentTypeError(f"expected BYTES:MIN_ROWS (e.g. 4096:3, min_rows >= 1), got {text!r}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x1x384,1x9x384,4x1x384,4x9x384,128x1x640")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf", "q4_0"])
    ap.add_argument("--backend", default="compiled")
    ap.add_argument("--amp", default="bf16")
    ap.add_argument("--autotune", action="store_true",
                    help="Inductor freezing + max_autotune (docs/backends.md, Autotuned graphs)")
    ap.add_argument("--output-vocab-size", type=int, default=None,
                    help="score only token ids [0, N) (a draft's reduced LM head: DecoderLM.restrict_output_vocab)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--ab-split-projections", action="store_true",
                    help="also time a copy with q/k/v and gate/up split (paired, in turn)")
    ap.add_argument("--ab-unfused-layers", action="store_true",
                    help="also time the layers' own forward instead of block_layer's kernel calls (in turn)")
    ap.add_argument("--ab-layer-loop", action="store_true",
                    help="also time the block_layer calls one layer at a time instead of one block_layers call")
    ap.add_argument("--ab-quantization", default=None, choices=["int8", "int4", "gguf", "q4_0"],
                    help="also time a copy loaded with this quantization (paired, in turn)")
    ap.add_argument("--ab-prefetch", default=None, metavar="BYTES:MIN_ROWS", type=prefetch_setting,
                    help="A/B against block_mm's software prefetch set to BYTES ahead from MIN_ROWS rows")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if sum(map(bool, (args.ab_split_projections, args.ab_unfused_layers, args.ab_layer_loop,
                      args.ab_quantization, args.ab_prefetch))) > 1:
        ap.error("--ab-split-projections, --ab-unfused-layers, --ab-layer-loop, --ab-quantization and --ab-prefetch "
                 "are different A/B runs: pass one")
    torch.set_num_threads(args.threads)
    from specdec import DecoderModel
    from specdec.core.graphs import compile_layers
    from specdec.core.kernels import block_mm_prefetch, set_block_mm_prefetch
    from specdec.tools.bench import emit_json

    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    # --ab-prefetch: the kernel's default, then the setting asked for (read once: a call leaves its own set)
    prefetch = [block_mm_prefetch(), tuple(int(v) for v in args.ab_prefetch.split(":"))] if args.ab_prefetch else None
    results = []
    for b, kv in dict.fromkeys((b, kv) for b, _, kv in shapes):      # one model per (batch, KV bucket)
        models = []
        quantizations = [args.quantization] + ([args.ab_quantization] if args.ab_quantization else [])
        for split in (False, True)[:1 + args.ab_split_projections]:
            for quantization in quantizations:
                model = DecoderModel.from_pretrained(args.model, batch_size=b, n_positions=kv, amp=args.amp,
                                                     quantization=quantization,
                                                     backend=args.backend, kv_buckets=[kv], context_buckets=[kv],
                                                     progress=False, autotune=args.autotune,
                                                     output_vocab_size=args.output_vocab_size)
                if split:
                    split_projections(model)
                models.append(model)
        runners = [(models[0].lm.layer_runners, models[0].lm.stack_runner)]
        one_copy = args.ab_unfused_layers or args.ab_layer_loop or args.ab_prefetch
        if one_copy and runners[0][1] is None:
            ap.error("--ab-unfused-layers / --ab-layer-loop / --ab-prefetch need a model whose layers run as kernel "
                     "calls (gguf or q4_0, f32, CPU)")
        if args.ab_unfused_layers:      # the same weights, run by the layers' own forward
            models[0].lm.layer_runners = models[0].lm.stack_runner = None
            if args.backend == "regional":
                compile_layers(models[0].lm)
            runners.append((models[0].lm.layer_runners, None))
            models.append(models[0])
        elif args.ab_layer_loop:        # the same kernels, one block_layer call a layer
            runners.append((runners[0][0], None))
            models.append(models[0])
        elif args.ab_prefetch:          # the same kernels and weights, another prefetch setting
            runners.append(runners[0])
            models.append(models[0])
        ns = [n for b_, n, kv_ in shapes if (b_, kv_) == (b, kv)]
        params = models[0].sampling_params(do_sample=False)
        tokens = {n: torch.randint(100, 20000, (b, n), generator=torch.Generator().manual_seed(0)) for n in ns}
        times = {n: [[] for _ in models] for n in ns}
        for i in range(args.warmup + args.repeats):      # the shapes (and models) in turn, repeat after repeat
            for n in ns:
                # the variants in turn, in alternating order (ABBA), so that neither always runs right after the
                # other (a call can find the previous call's weights still in the last-level cache)
                order = list(enumerate(zip(models, times[n])))
                for j, (model, timed) in (order if i % 2 == 0 else order[::-1]):
                    if one_copy:
                        model.lm.layer_runners, model.lm.stack_runner = runners[j]
                    if prefetch:
                        set_block_mm_prefetch(*prefetch[j])
                    model.set_lengths(torch.full((b,), kv - n - 1))
                    start = time.perf_counter()
                    model.step(tokens[n], params, advance=False).tokens.cpu()
                    if i >= args.warmup:
                        timed.append((time.perf_counter() - start) * 1000)
        for n in ns:
            timed = times[n]
            results.append({"batch": b, "n": n, "kv": kv, "median_ms": round(statistics.median(timed[0]), 2),
                            "min_ms": round(min(timed[0]), 2)})
            if n != ns[0]:
                ratios = [t / t0 for t, t0 in zip(timed[0], times[ns[0]][0])]
                results[-1][f"vs_n{ns[0]}_median"] = round(statistics.median(ratios), 3)
            if len(models) > 1:
                ratios = [other / fused for other, fused in zip(timed[1], timed[0])]
                name = ("unfused" if args.ab_unfused_layers else "loop" if args.ab_layer_loop
                        else "prefetch{}r{}".format(*prefetch[1]) if prefetch
                        else args.ab_quantization or "split")
                results[-1] |= {f"{name}_median_ms": round(statistics.median(timed[1]), 2),
                                f"{name}_over_fused_median": round(statistics.median(ratios), 3)}
            print(json.dumps(results[-1]), flush=True)
    out = {"config": {k: v for k, v in vars(args).items() if k != "output"}, "torch": torch.__version__,
           "results": results}
    emit_json(out, args.output)


if __name__ == "__main__":
    main()
