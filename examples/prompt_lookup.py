"""Speculative decoding with prompt lookup (n-gram drafting, no draft model): the k=4 tokens that
followed the latest earlier occurrence of the last few tokens are proposed. It pays when the output
copies its input: here the model is asked to repeat a passage. Greedy output is token for token the
target's own.

    python examples/prompt_lookup.py
"""
import time

import torch

from specdec import DecoderModel, PromptLookup, SpeculativeGenerator
from specdec.core.chat import chat_ids

target = DecoderModel.from_pretrained(None, n_positions=512, amp="f32", backend="eager")   # None = embedded model
passage = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, "
           "and the fox runs back into the forest.")
ids = torch.tensor([chat_ids(target.tokenizer, f"Repeat this text exactly: {passage}")])

start = time.perf_counter()
reference = target.generate(ids, max_new_tokens=48)                # target-only greedy
target_s = time.perf_counter() - start

gen = SpeculativeGenerator(PromptLookup(target, max_ngram=3), target, k=4)
start = time.perf_counter()
out = gen.generate(ids, max_new_tokens=48)
spec_s = time.perf_counter() - start

# Speed: no draft forward, only the verify step, so it pays when the output repeats the prompt (as
# here) and costs little when it does not. The tokens are the same either way.
assert torch.equal(out, reference), "greedy speculation must reproduce target-only output"
print(target.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print(f"target-only {target_s:.2f} s, prompt lookup k=4 {spec_s:.2f} s: identical tokens")
print(gen.last_stats)        # tau = tokens emitted per target step, acceptance per draft position, timings
