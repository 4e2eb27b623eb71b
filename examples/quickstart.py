"""Generate with the embedded SmolLM2-135M-Instruct, then speculative decoding with the draft shipped
for it (k=4): the same greedy tokens, fewer target steps, and the speculation statistics.

    python examples/quickstart.py
"""
import torch

from specdec import DecoderModel, SpeculativeGenerator, shipped

model = DecoderModel.from_pretrained(None, n_positions=512, amp="f32", backend="eager")   # None = embedded model
tok = model.tokenizer
ids = tok.apply_chat_template([{"role": "user", "content": "Name three uses of a paperclip."}],
                              add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
out = model.generate(ids, max_new_tokens=64)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))

# The shipped draft: 2 layers and a reduced output vocabulary, trained for this model
# (shipped("eagle", model) and shipped("medusa", model) plug in the same way).
draft = shipped("model", model)
gen = SpeculativeGenerator(draft, model, k=4)
spec = gen.generate(ids, max_new_tokens=64)
assert torch.equal(spec, out), "greedy speculation must reproduce target-only output"
print(gen.last_stats)
