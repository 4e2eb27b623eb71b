"""A draft model proposes token ids, so its tokenizer must map tokens to the target's ids: ``DraftModel`` refuses a
draft whose vocabulary differs, and reads neither tokenizer when both checkpoints hold the same tokenizer files
(byte for byte: the Qwen2.5-Coder pair's, whose loading took ~1 s each)."""
from __future__ import annotations

import json
import shutil

import pytest

from specdec import DraftModel
from specdec.draft import proposer

from conftest import load
from test_serving_http import byte_tokenizer


def test_a_draft_needs_the_targets_token_ids(checkpoint, tmp_path, monkeypatch):
    source = checkpoint("llama-text").path
    paths = {name: shutil.copytree(source, tmp_path / name) for name in ("target", "draft")}
    for path in paths.values():
        byte_tokenizer(path)
    target = load(paths["target"])
    loaded = []
    real = proposer._tokenizer_or_none
    monkeypatch.setattr(proposer, "_tokenizer_or_none", lambda model: loaded.append(model) or real(model))

    DraftModel.from_pretrained(paths["draft"], target)             # the same files: no tokenizer read
    assert loaded == []

    tokenizer_file = paths["draft"] / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text())
    tokenizer_file.write_text(json.dumps(spec, indent=1))         # other bytes, the same vocabulary
    DraftModel.from_pretrained(paths["draft"], target)
    assert len(loaded) == 2

    vocab = spec["model"]["vocab"]
    a, b = [token for token, i in vocab.items() if i in (10, 11)]
    vocab[a], vocab[b] = vocab[b], vocab[a]                       # two tokens with each other's ids
    tokenizer_file.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="differs from the target's"):
        DraftModel.from_pretrained(paths["draft"], target)
