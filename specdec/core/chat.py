"""Prompt formatting shared by the CLI, the server, the benchmarks and draft training."""
from __future__ import annotations


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as a user turn with the generation prompt (chat template if any,
    else plain tokenisation)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return list(tokenizer(text)["input_ids"])
    return conversation_ids(tokenizer, [{"role": "user", "content": text}])


def conversation_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat ``messages`` ({"role", "content"} dicts) through the tokenizer's chat template,
    with the generation prompt. Raises ValueError when the tokenizer has no chat template. Handles
    transformers 5's BatchEncoding return type."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template: use a plain-text completion instead")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(t) for t in out]
