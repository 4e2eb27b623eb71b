"""EAGLE gap, part 3: Medusa head 0 (top-1) and the EAGLE head, teacher-forced, on the same target outputs
(the sequences ``scripts/eagle_gap/eagle_gap.py --out`` or ``scripts/eagle_gap/eagle_gap_synth.py`` saved).

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/eagle_gap/eagle_gap_medusa.py /tmp/gap_f32.json /tmp/synth.pt
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def main() -> None:
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from specdec import DecoderModel
    from specdec.medusa.smollm2 import shipped_medusa_dir
    target = DecoderModel.from_pretrained(None, batch_size=1, n_positions=768, amp="f32", backend="eager",
                                          progress=False)
    head = target.lm.lm_head.weight.float()
    med = load_file(str(shipped_medusa_dir() / "medusa_lm_head.safetensors"))
    ids = med["token_ids"].long()
    W, b = med["0.0.linear.weight"].float(), med["0.0.linear.bias"].float()
    mt = json.loads(Path(sys.argv[1]).read_text())["records"]
    sets = {"mt-bench (eagle_gap.py rows, greedy f32)": [(torch.tensor(r["seq"]), r["P"]) for r in mt]}
    if len(sys.argv) > 2:
        bt = torch.load(sys.argv[2], weights_only=False)
        sets["fresh synthesised, greedy rows"] = [(t, p) for t, p, s in zip(bt["tokens"], bt["prompt_lens"].tolist(),
                                                                           bt["sampled"].tolist()) if not s]
    for name, seqs in sets.items():
        hit = n = 0
        for seq, P in seqs:
            L = len(seq)
            mask = torch.ones(L, L, dtype=torch.bool).tril().unsqueeze(0)
            with torch.no_grad():
                logits, hidden = target.lm(seq.unsqueeze(0), torch.arange(L).unsqueeze(0),
                                           torch.zeros(1, dtype=torch.long), mask, torch.arange(L).unsqueeze(0),
                                           kv_len=L)
                f = hidden[0].float()
                tgt = logits[0].argmax(-1)                   # at i: the target's next token t_{i+1}
                x = f + F.silu(f @ W.T + b)
                pred = ids[(x @ head[ids].T).argmax(-1)]     # head 0 at i predicts t_{i+2}
            ii = torch.arange(max(P - 2, 0), L - 2)
            hit += int((pred[ii] == tgt[ii + 1]).sum())
            n += len(ii)
        print(f"{name}: Medusa head 0 top-1 = {hit / n:.3f} over {n} positions")


if __name__ == "__main__":
    main()
