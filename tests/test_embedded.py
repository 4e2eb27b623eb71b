"""The embedded SmolLM2-135M-Instruct (GGUF → safetensors by ``specdec.core.paths``, cached under
``~/.cache/specdec``) against ``transformers`` loading the same converted checkpoint."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec import DecoderModel

pytestmark = pytest.mark.slow

N_NEW = 64
N_STEPS = 6


@pytest.fixture(scope="module")
def model():
    return DecoderModel.from_pretrained(None, n_positions=256, backend="eager", progress=False)


@pytest.fixture(scope="module")
def hf(model):
    return AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(model):
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert 10 < len(ids) < 128
    return ids


@pytest.fixture(scope="module")
def reference(hf, prompt):
    """HF greedy continuation (no early stop) and HF logits over prompt + continuation."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW,
                          eos_token_id=None, pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    assert len(tokens) == N_NEW
    return tokens, logits


def test_embedded_checkpoint(model, hf):
    assert model.config.model_type == "llama"
    assert model.config.num_layers == hf.config.num_hidden_layers == 30
    assert model.config.tie_word_embeddings
    assert (model.path / "model.safetensors").is_file()
    assert model.kv_buckets == [128, 256] and model.context_buckets == [128, 256]


def test_embedded_logits_match_transformers(model, prompt, reference):
    tokens, ref = reference
    L = len(prompt)
    params = model.sampling_params(do_sample=False)
    out = model.prefill([torch.tensor(prompt)], params)
    scale = float(ref.abs().max())
    torch.testing.assert_close(out.logits[0, -1], ref[L - 1], atol=1e-4 * scale, rtol=1e-4)
    assert int(out.tokens[0, 0]) == tokens[0]
    for i in range(N_STEPS):
        out = model.step(torch.tensor([[tokens[i]]]), params)
        torch.testing.assert_close(out.logits[0, -1], ref[L + i], atol=1e-4 * scale, rtol=1e-4)
        assert int(out.tokens[0, 0]) == tokens[i + 1]


def test_embedded_greedy_matches_transformers(model, prompt, reference):
    tokens, _ = reference
    out = model.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[])
    assert out[0, len(prompt):].tolist() == tokens
    assert len(set(tokens)) > 10   # a real continuation, not a degenerate loop
