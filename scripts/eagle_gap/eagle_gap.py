"""Diagnose the EAGLE gap: runtime first-draft-token acceptance vs the training forward's agreement.

For each prompt: the target's greedy output (runtime, EOS off); then
  (a) the training forward (``EagleTrainer`` with the shipped weights, features = the target's
      final-norm hidden states of one teacher-forced forward over prompt + output), step-1
      prediction at every position;
  (b) the runtime EAGLE proposer at k=1 inside ``SpeculativeGenerator`` (every proposal recorded
      with its row length), and optionally at k=5.
Both compared position by position with the target's next token (its greedy argmax).

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/eagle_gap/eagle_gap.py --num-prompts 10 --amp f32 --out /tmp/gap.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--amp", default="f32")
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--ks", default="1,5")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from specdec import DecoderModel, SpeculativeGenerator, shipped
    from specdec.core.chat import chat_ids
    from specdec.core.paths import resolve_model_path
    from specdec.eagle.smollm2 import embedded_eagle_path
    from specdec.tools.bench.prompts import default_prompts_path, load_prompts
    from specdec.tools.train.distill import load_target_state
    from specdec.tools.train.eagle import EagleTrainer

    target = DecoderModel.from_pretrained(None, batch_size=1, n_positions=768, amp=args.amp, backend=args.backend,
                                          progress=False)
    tok = target.tokenizer
    texts = load_prompts(args.prompts or default_prompts_path(), args.num_prompts)
    prompts = [torch.tensor(chat_ids(tok, t)) for t in texts]
    eagle = shipped("eagle", target, progress=False)

    # ---- training forward with the shipped weights
    target_dir = Path(resolve_model_path(None))
    tcfg = json.loads((target_dir / "config.json").read_text())
    tstate = load_target_state(target_dir)
    ship = load_file(str(embedded_eagle_path() / "model.safetensors"))
    token_ids = ship["output_token_ids"].long()
    trainable = {k: v.float() for k, v in ship.items() if k.startswith(("fc.", "layers."))}
    embed = tstate["model.embed_tokens.weight"]
    full_head = tstate.get("lm_head.weight", embed)
    trainer = EagleTrainer(tcfg, trainable, embed, full_head[token_ids]).eval()
    in_vocab = torch.zeros(full_head.shape[0], dtype=torch.bool)
    in_vocab[token_ids] = True

    def train_forward(seq: torch.Tensor, prefix: str) -> dict:
        """Teacher-forced target features over seq (same amp as the runtime) → the training forward's
        step-1 prediction at every position (pair (f_i, t_{i+1}) at i predicts t_{i+2})."""
        L = len(seq)
        ids = seq.unsqueeze(0).to(target.device)
        mask = torch.ones(L, L, dtype=torch.bool).tril().unsqueeze(0)
        with torch.no_grad():
            logits, hidden = target.lm(ids, torch.arange(L).unsqueeze(0), torch.zeros(1, dtype=torch.long), mask,
                                       torch.arange(L).unsqueeze(0), kv_len=L)
            feats = hidden[0].float()
            x = trainer(seq[1:].unsqueeze(0), feats[:-1].unsqueeze(0), 1)[0][0]
            pred_red = token_ids[(x @ full_head[token_ids].T).argmax(-1)]
            pred_full = (x @ full_head.T).argmax(-1)
            tgt_red = token_ids[(feats[1:] @ full_head[token_ids].T).argmax(-1)]
        return {f"{prefix}L": L, f"{prefix}seq": seq.tolist(), f"{prefix}train_pred": pred_red.tolist(),
                f"{prefix}train_pred_fullvocab": pred_full.tolist(), f"{prefix}train_target_reduced": tgt_red.tolist(),
                f"{prefix}teacher_forced_argmax": logits[0].argmax(-1).tolist()}

    records = []
    for pi, p in enumerate(prompts):
        t0 = time.time()
        out = target.generate([p], max_new_tokens=args.new, eos_token_id=[])[0]
        P = len(p)
        rec = {"prompt": pi, "P": P, **train_forward(out, "")}
        # (b) runtime at k
        for k in [int(x) for x in args.ks.split(",")]:
            props = []
            orig = eagle.propose

            def rec_propose(tail, lengths, kk, params, rng, orig=orig, props=props):
                prop = orig(tail, lengths, kk, params, rng)
                props.append((int(lengths[0]), prop.tokens[0].tolist()))
                return prop
            eagle.propose = rec_propose
            gen = SpeculativeGenerator(eagle, target, k=k)
            sout = gen.generate([p], max_new_tokens=args.new, eos_token_id=[])[0]
            eagle.propose = orig
            rec[f"k{k}_same_output"] = bool(torch.equal(sout, out))
            # the runtime's own output (in bf16 it may leave the target-only output): compare on it
            rec.update(train_forward(sout, f"k{k}_"))
            rec[f"k{k}_props"] = props
            rec[f"k{k}_stats"] = gen.last_stats.to_dict()
        records.append(rec)
        print(f"prompt {pi}: P={P} {time.time() - t0:.1f}s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "in_vocab_ids": token_ids.tolist(),
                                              "records": records}))
    analyse(records, token_ids, in_vocab)


def analyse(records, token_ids, in_vocab) -> None:
    tot = {}

    def add(name, hits, n):
        a = tot.setdefault(name, [0, 0])
        a[0] += hits
        a[1] += n

    for r in records:
        seq, P, L = r["seq"], r["P"], r["L"]
        pred = r["train_pred"]                      # index i predicts seq[i+2]
        tr = r["train_target_reduced"]              # index i: reduced argmax on f_{i+1}
        # answer positions: predicted token seq[j], j in [P, L): i = j - 2
        for j in range(P, L):
            i = j - 2
            add("train_fwd_all_answer_positions", int(pred[i] == seq[j]), 1)
            add("train_fwd_vs_reduced_target(training metric)", int(pred[i] == tr[i]), 1)
            add("oov_answer_tokens", int(not in_vocab[seq[j]]), 1)
        for key in [k for k in r if k.endswith("_props")]:
            k = key[:-6]
            seq, L, pred = r[f"{k}_seq"], r[f"{k}_L"], r[f"{k}_train_pred"]
            tf = r[f"{k}_teacher_forced_argmax"]
            for n, toks in r[key]:
                j = n                                 # x_1 predicts S[n] (len(S) = n)
                if j >= L:
                    continue
                add(f"{k}_runtime_first_token", int(toks[0] == seq[j]), 1)
                add(f"{k}_train_fwd_same_positions", int(pred[j - 2] == seq[j]), 1)
                add(f"{k}_runtime_eq_train_fwd", int(toks[0] == pred[j - 2]), 1)
                add(f"{k}_runtime_vs_teacher_forced_argmax", int(toks[0] == tf[j - 1]), 1)
    for name, (h, n) in tot.items():
        print(f"{name:55s} {h:5d}/{n:5d} = {h / max(n, 1):.3f}")


if __name__ == "__main__":
    main()
