"""Generate with the embedded SmolLM2-135M-Instruct, then run speculative decoding with an
early-exit-free stand-in draft (the target itself, k=4) to show the API and its statistics.

    python examples/quickstart.py
"""
import torch

from specdec import DecoderModel
from specdec.speculative import SpeculativeGenerator

model = DecoderModel.from_pretrained(None, n_positions=512, amp="f32", backend="eager")
tok = model.tokenizer
ids = tok.apply_chat_template([{"role": "user", "content": "Name three uses of a paperclip."}],
                              add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
out = model.generate(ids, max_new_tokens=64)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))

# Any DecoderModel with the same tokenizer can draft; a real draft is a much smaller model.
draft = DecoderModel.from_pretrained(None, n_positions=512, amp="f32", backend="eager", progress=False)
gen = SpeculativeGenerator(draft, model, k=4)
spec = gen.sample(ids, max_new_tokens=64)
assert torch.equal(spec, out), "greedy speculation must reproduce target-only output"
print(gen.last_stats)
