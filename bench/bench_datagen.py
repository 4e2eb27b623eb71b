"""Draft-training data generation: answers per second with finished rows refilled (``answer_stream``,
what ``generate_data`` runs) against one batch ``generate`` call per batch (rows idle from their EOS until
the batch's longest answer ends: the pipeline before), same requests, same process, alternating.

    python bench/bench_datagen.py --batches 2 --threads 2 [--prompts written --seed 2 --max-prompt-tokens 512]

Prints JSON: per method and repeat the wall time and answer tokens, then answer tokens/s medians and the
ratio (refill / batch). Each method's first call (repeat -1, on the same requests) compiles and warms
its graphs and is not counted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=1, help="batches of --batch-size requests per call")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--prompts", default="written")
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=None, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specdec.tools.bench import emit_json
    from specdec.tools.train.data import DataConfig, answer_stream, generation_model, plan_batch

    cfg = DataConfig(num_prompts=10**6 if args.prompts != "written" else args.batches * args.batch_size,
                     batch_size=args.batch_size, prompts=args.prompts, seed=args.seed,
                     max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens)
    model = generation_model(cfg)
    plans = [plan_batch(model, cfg, i) for i in range(args.batches)]

    def batch_calls(plans) -> int:
        n = 0
        eos = set(model.config.eos_token_ids)
        for p in plans:
            temps = [cfg.answer_temperature if s else 0.0 for s in p.sampled]
            out = model.generate(p.prompts, max_new_tokens=cfg.max_new_tokens, do_sample=any(p.sampled),
                                 temperature=temps + [0.0] * (model.batch_size - len(temps)), seed=p.seeds)
            width = max(len(q) for q in p.prompts)
            for i in range(len(p.prompts)):
                ans = out[i, width:].tolist()
                n += next((j + 1 for j, t in enumerate(ans) if t in eos), len(ans))
        return n

    def refill(plans) -> int:
        jobs = [job for p in plans for job in p.jobs(cfg)]
        return sum(len(a) for _, a in answer_stream(model, jobs, cfg.max_new_tokens))

    methods = {"batch": batch_calls, "refill": refill}
    runs = []
    for r in range(-1, args.repeats):
        for name, fn in methods.items():
            start = time.perf_counter()
            tokens = fn(plans)
            runs.append({"method": name, "repeat": r, "seconds": round(time.perf_counter() - start, 1),
                         "answer_tokens": tokens})
            print(json.dumps(runs[-1]), flush=True)
    rate = {m: statistics.median(x["answer_tokens"] / x["seconds"]
                                 for x in runs if x["method"] == m and x["repeat"] >= 0)
            for m in methods}
    result = {"config": {**vars(args), "backend": cfg.backend, "amp": cfg.amp}, "runs": runs,
              "answer_tokens_per_s": {m: round(v, 1) for m, v in rate.items()},
              "refill_vs_batch": round(rate["refill"] / rate["batch"], 3)}
    emit_json(result, args.output)


if __name__ == "__main__":
    main()
