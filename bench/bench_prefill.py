#!/usr/bin/env python
"""A prompt's encoding (prefill) with and without dense bf16 prompt weights, in one process.

Two copies of ``--model`` with ``--quantization`` (GGML blocks: gguf or q4_0): one encodes prompts on the
blocks' 8-bit kernel (``block_layers``), the other with ``prompt_weights="bf16"`` (the decoder layers' weights
also as dense bf16 matrices: ``specdec.core.block_linear``). For each prompt length of ``--lengths``, a prompt
of that many chat-templated MT-Bench tokens (questions concatenated, cut to the length) is encoded by both copies
in turn, ``--repeats`` times after ``--warmup`` (alternating which goes first: neither always finds the other's
weights in the last-level cache). Reported per length: each copy's median seconds and tokens/s, the median of
the per-pair ratios blocks / bf16 (the speed-up), and whether both encodings pick the same first token.

    python bench/bench_prefill.py --model qwen2.5-coder-1.5b-instruct --lengths 64,128,256,512 --threads 2 \\
        --output bench/results/prefill_qwen.json

The JSON (stdout and ``--output``): ``config``, ``results`` (one entry per length) and the provenance
(command, commit, machine).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import DecoderModel
from specdec.core.chat import chat_ids
from specdec.tools.arguments import int_list
from specdec.tools.bench import emit_json
from specdec.tools.bench.prompts import load_records


def prompt_of(model: DecoderModel, n: int) -> torch.Tensor:
    """``n`` tokens of chat-templated MT-Bench questions, one after another."""
    ids: list[int] = []
    for _, _, text in load_records("mt-bench", 80):
        ids += chat_ids(model.tokenizer, text)
        if len(ids) >= n:
            return torch.tensor(ids[:n])
    raise SystemExit(f"the MT-Bench questions hold fewer than {n} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quantization", default="gguf", choices=["gguf", "q4_0"])
    ap.add_argument("--backend", default="regional", choices=["eager", "regional"])
    ap.add_argument("--lengths", type=int_list, default=[64, 128, 256, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    n_positions = max(args.lengths) + 1
    models = {name: DecoderModel.from_pretrained(args.model, quantization=args.quantization, amp="f32",
                                                 backend=args.backend, n_positions=n_positions,
                                                 context_buckets=sorted(set(args.lengths)), prompt_weights=weights,
                                                 progress=True)
              for name, weights in (("blocks", None), ("bf16", "bf16"))}
    params = models["blocks"].sampling_params(do_sample=False)
    results = []
    for n in args.lengths:
        prompt = prompt_of(models["blocks"], n)
        times: dict[str, list[float]] = {name: [] for name in models}
        first: dict[str, int] = {}
        for i in range(args.warmup + args.repeats):
            for name in (list(models) if i % 2 == 0 else list(models)[::-1]):
                start = time.perf_counter()
                first[name] = int(models[name].prefill([prompt], params).tokens[0, -1])
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        entry = {"prompt_tokens": n}
        for name, ts in times.items():
            entry[f"{name}_median_s"] = round(statistics.median(ts), 4)
            entry[f"{name}_tok_s"] = round(n / statistics.median(ts), 1)
        entry["speedup_median"] = round(statistics.median(b / d for b, d in zip(times["blocks"], times["bf16"])), 3)
        entry["same_first_token"] = first["blocks"] == first["bf16"]
        print(entry, file=sys.stderr, flush=True)
        results.append(entry)
    emit_json({"config": {k: v for k, v in vars(args).items() if k != "output"}, "torch": torch.__version__,
               "results": results}, args.output)


if __name__ == "__main__":
    main()
