"""Speculative decoding with Medusa: extra heads on the target guess the next few tokens, a token
tree of their top candidates is verified in one target forward (the shipped heads for the embedded
SmolLM2-135M-Instruct, with the tree built from their measured accuracy). k is the tree's depth.
Greedy output is token for token the target's own.

    python examples/medusa.py
"""
import time

import torch

from specdec import DecoderModel, SpeculativeGenerator, shipped
from specdec.core.chat import chat_ids

target = DecoderModel.from_pretrained(None, n_positions=512, amp="f32", backend="eager")   # None = embedded model
ids = torch.tensor([chat_ids(target.tokenizer, "Give two tips for writing clear emails.")])

start = time.perf_counter()
reference = target.generate(ids, max_new_tokens=48)                # target-only greedy
target_s = time.perf_counter() - start

medusa = shipped("medusa", target)         # another tree: shipped("medusa", target, tree="mc_sim_7b_63")
gen = SpeculativeGenerator(medusa, target)                         # k = the tree's depth
start = time.perf_counter()
out = gen.generate(ids, max_new_tokens=48)
spec_s = time.perf_counter() - start

# Speed: eager on a CPU the 135M target costs little per step, so drafting seldom pays here (the
# benchmark sections of docs/results.md give compiled-backend numbers). The tokens are the same either way.
assert torch.equal(out, reference), "greedy speculation must reproduce target-only output"
print(target.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print(f"target-only {target_s:.2f} s, Medusa tree of depth {gen.k} {spec_s:.2f} s: identical tokens")
print(gen.last_stats)        # tau = tokens emitted per target step, acceptance per tree depth, timings
