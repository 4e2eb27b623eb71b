"""Speculative decoding with a draft model: the shipped 2-layer draft for the embedded
SmolLM2-135M-Instruct proposes k=4 tokens a step, the target verifies them in one forward.
Greedy output is token for token the target's own.

    python examples/draft_model.py
"""
import time

import torch

from specdec import DecoderModel, SpeculativeGenerator, shipped
from specdec.core.chat import chat_ids

target = DecoderModel.from_pretrained(None, n_positions=512, amp="f32", backend="eager")   # None = embedded model
ids = torch.tensor([chat_ids(target.tokenizer, "Name three uses of a paperclip.")])

start = time.perf_counter()
reference = target.generate(ids, max_new_tokens=48)                # target-only greedy
target_s = time.perf_counter() - start

draft = shipped("model", target)           # your own: DraftModel.from_pretrained("my-draft/", target)
gen = SpeculativeGenerator(draft, target, k=4)
start = time.perf_counter()
out = gen.generate(ids, max_new_tokens=48)
spec_s = time.perf_counter() - start

# Speed: eager on a CPU the 135M target costs little per step, so drafting seldom pays here (the
# benchmark sections of docs/results.md give compiled-backend numbers). The tokens are the same either way.
assert torch.equal(out, reference), "greedy speculation must reproduce target-only output"
print(target.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print(f"target-only {target_s:.2f} s, draft model k=4 {spec_s:.2f} s: identical tokens")
print(gen.last_stats)        # tau = tokens emitted per target step, acceptance per draft position, timings
