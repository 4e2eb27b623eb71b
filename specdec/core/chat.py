"""Prompt formatting shared by the CLI, the benchmarks and draft training."""
from __future__ import annotations


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as a user turn with the generation prompt (chat template if any,
    else plain tokenisation). Handles transformers 5's BatchEncoding return type."""
    if getattr(tokenizer, "chat_template", None) is None:
        return list(tokenizer(text)["input_ids"])
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(t) for t in out]
