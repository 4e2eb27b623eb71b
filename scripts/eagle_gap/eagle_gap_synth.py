"""EAGLE gap, part 2: the training metric vs the runtime on fresh synthesised prompts (the training data's
generator, ``specdec.tools.train.data.generate_batch``, at a batch index the training never used).

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/eagle_gap/eagle_gap_synth.py --rows 24 --index 777 --runtime-rows 8
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--index", type=int, default=777)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--runtime-rows", type=int, default=8)
    ap.add_argument("--out", default="/tmp/eagle_gap_synth.pt")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from specdec import DecoderModel, SpeculativeGenerator, shipped
    from specdec.core.paths import resolve_model_path
    from specdec.core.sampling import SamplingConfig
    from specdec.eagle.smollm2 import embedded_eagle_path
    from specdec.tools.train.data import DataConfig, generate_batch
    from specdec.tools.train.distill import load_target_state
    from specdec.tools.train.eagle import EagleTrainConfig, EagleTrainer, evaluate
    from specdec.tools.train.features import compute_features

    out = Path(args.out)
    cfg = DataConfig(batch_size=args.rows, num_prompts=10**6, max_new_tokens=args.max_new_tokens, backend="eager")
    if out.is_file():
        batch = torch.load(out, weights_only=False)
    else:
        t0 = time.time()
        model = DecoderModel.from_pretrained(None, batch_size=args.rows, n_positions=256 + args.max_new_tokens,
                                             amp="bf16", backend="eager", progress=False,
                                             sampling=SamplingConfig(global_topk=cfg.global_topk))
        batch = generate_batch(model, cfg, args.index)
        torch.save(batch, out)
        print(f"generated {args.rows} rows in {time.time() - t0:.0f}s", flush=True)
        del model
    rows = [{"tokens": t, "prompt_len": p, "sampled": s} for t, p, s in
            zip(batch["tokens"], batch["prompt_lens"].tolist(), batch["sampled"].tolist())]
    rows = [r for r in rows if len(r["tokens"]) > r["prompt_len"] + 1]
    target_dir = Path(resolve_model_path(None))
    feats = compute_features(rows, target_dir, out.with_suffix(".features.pt"), progress=False)
    tcfg = json.loads((target_dir / "config.json").read_text())
    tstate = load_target_state(target_dir)
    ship = load_file(str(embedded_eagle_path() / "model.safetensors"))
    token_ids = ship["output_token_ids"].long()
    embed = tstate["model.embed_tokens.weight"]
    head = tstate.get("lm_head.weight", embed)
    trainer = EagleTrainer(tcfg, {k: v.float() for k, v in ship.items() if k.startswith(("fc.", "layers."))},
                           embed, head[token_ids]).eval()
    ecfg = EagleTrainConfig()
    res = {}
    greedy = [i for i, r in enumerate(rows) if not r["sampled"]]
    sampled = [i for i, r in enumerate(rows) if r["sampled"]]
    res["training_evaluate_all_rows"] = evaluate(trainer, rows, feats, list(range(len(rows))), ecfg)
    res["training_evaluate_greedy_rows"] = evaluate(trainer, rows, feats, greedy, ecfg)
    if sampled:
        res["training_evaluate_sampled_rows"] = evaluate(trainer, rows, feats, sampled, ecfg)
    # full-vocabulary, per token: draft step-1 argmax (reduced head) vs the target's full argmax at i+1
    in_vocab = torch.zeros(head.shape[0], dtype=torch.bool)
    in_vocab[token_ids] = True
    per = {"greedy": [0, 0, 0], "sampled": [0, 0, 0]}
    answer_len = []
    with torch.no_grad():
        for r, f in zip(rows, feats):
            t, p = r["tokens"], r["prompt_len"]
            f = f.float()
            x = trainer(t[1:].unsqueeze(0), f[:-1].unsqueeze(0), 1)[0][0]
            pred = token_ids[(x @ head[token_ids].T).argmax(-1)]
            tgt = (f @ head.T).argmax(-1)            # target argmax at i predicts t_{i+1}
            L = len(t)
            ii = torch.arange(max(p - 2, 0), L - 2)   # pair i predicts token i+2 (an answer token)
            hit = (pred[ii] == tgt[ii + 1])
            key = "sampled" if r["sampled"] else "greedy"
            per[key][0] += int(hit.sum())
            per[key][1] += len(ii)
            per[key][2] += int((~in_vocab[tgt[ii + 1]]).sum())
            answer_len.append(L - p)
    res["fullvocab_agreement_step1"] = {k: {"agree": v[0] / max(v[1], 1), "positions": v[1],
                                            "target_argmax_oov": v[2] / max(v[1], 1)} for k, v in per.items()}
    res["answer_len_mean"] = sum(answer_len) / len(answer_len)
    res["answer_ends_with_eos_share"] = sum(int(r["tokens"][-1] == 2) for r in rows) / len(rows)
    print(json.dumps(res, indent=1), flush=True)

    # runtime: greedy rows' prompts, k=1, EOS on (as the training rows) and EOS off (as the benchmarks)
    target = DecoderModel.from_pretrained(None, batch_size=1, n_positions=640, amp="bf16", backend="eager",
                                          progress=False)
    eagle = shipped("eagle", target, progress=False)
    for eos in ("on", "off"):
        acc = drafted = 0
        for i in greedy[: args.runtime_rows]:
            prompt = rows[i]["tokens"][: rows[i]["prompt_len"]]
            gen = SpeculativeGenerator(eagle, target, k=1)
            kw = {} if eos == "on" else {"eos_token_id": []}
            gen.generate([prompt], max_new_tokens=args.max_new_tokens, **kw)
            st = gen.last_stats.to_dict()
            acc += st["accepted"]
            drafted += st["drafted"]
        res[f"runtime_k1_eos_{eos}"] = {"accepted": acc, "drafted": drafted, "rate": acc / max(drafted, 1)}
        print(eos, res[f"runtime_k1_eos_{eos}"], flush=True)
    Path(out.with_suffix(".json")).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
