"""Checkpoint loading (four HF layouts, three architectures, tied embeddings, Llama-3 RoPE scaling)
and exact parity with ``transformers``: context-encoding logits/hidden states, every decoding
step's logits, and 64 greedy tokens."""
from __future__ import annotations

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conftest import LAYOUTS, fused_names, hf_greedy, load, prompt_ids

N_NEW = 64
PROMPT_LEN = 11
ATOL = RTOL = 1e-4

CASES = ([(arch, layout) for arch in ("llama", "mistral", "qwen2") for layout in LAYOUTS]
         + [("llama-tied", "safetensors"), ("llama-tied", "bin-sharded"),
            ("llama3-rope", "safetensors"), ("llama3-rope", "safetensors-sharded")])


@pytest.fixture(scope="module")
def reference(hf_models):
    """variant → (prompt, HF greedy tokens, HF logits [L+N, V], HF final hidden [L+N, H]); once per variant."""
    cache = {}

    def get(variant):
        if variant not in cache:
            hf = hf_models(variant)
            prompt = prompt_ids(PROMPT_LEN, seed=1)
            tokens = hf_greedy(hf, prompt, N_NEW)
            with torch.no_grad():
                out = hf(torch.tensor([prompt + tokens]), output_hidden_states=True)
                hidden = hf.model(torch.tensor([prompt + tokens])).last_hidden_state[0]
            cache[variant] = prompt, tokens, out.logits[0].float(), hidden.float()
        return cache[variant]
    return get


@pytest.mark.parametrize("variant,layout", CASES, ids=[f"{v}-{lay}" for v, lay in CASES])
def test_logits_and_greedy_match_transformers(checkpoint, reference, variant, layout):
    ckpt = checkpoint(variant, layout)
    prompt, ref_tokens, ref_logits, ref_hidden = reference(variant)
    L = len(prompt)
    model = load(ckpt)
    params = model.sampling_params(do_sample=False)

    # context encoding: logits of the last prompt token, final hidden states of every prompt token
    out = model.prefill([torch.tensor(prompt)], params)
    torch.testing.assert_close(out.logits[0, -1], ref_logits[L - 1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.hidden[0, :L].float(), ref_hidden[:L], atol=ATOL, rtol=RTOL)
    assert model.lengths.tolist() == [L]

    # token generation, teacher-forced with HF's tokens: every step's logits (crosses KV buckets 32/64/128)
    seq = prompt + ref_tokens
    for i in range(N_NEW - 1):
        out = model.step(torch.tensor([[seq[L + i]]]), params)
        torch.testing.assert_close(out.logits[0, -1], ref_logits[L + i], atol=ATOL, rtol=RTOL,
                                   msg=lambda m: f"step {i}: {m}")  # noqa: B023  (called at once)
        torch.testing.assert_close(out.hidden[0, -1].float(), ref_hidden[L + i], atol=ATOL, rtol=RTOL)
        assert int(out.tokens[0, -1]) == ref_tokens[i + 1]
    assert model.lengths.tolist() == [L + N_NEW - 1]

    # free-running greedy generation: identical tokens for all 64 steps
    gen = model.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[])
    assert gen.shape == (1, L + N_NEW)
    assert gen[0, :L].tolist() == prompt
    assert gen[0, L:].tolist() == ref_tokens


def test_reference_is_not_degenerate(reference):
    """Guard for the parity test's strength: the greedy reference is not one repeated token and the
    argmax margins are far above fp32 noise."""
    for variant in ("llama", "qwen2", "llama-tied", "llama3-rope"):
        _, tokens, logits, _ = reference(variant)
        assert len(set(tokens)) > 8
        top2 = logits[PROMPT_LEN - 1:].topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4 * 5


def test_tied_embeddings_share_storage(checkpoint):
    ckpt = checkpoint("llama-tied", "safetensors")
    model = load(ckpt)
    assert model.config.tie_word_embeddings
    assert model.lm.lm_head.weight.data_ptr() == model.lm.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(model.lm.lm_head.weight, ckpt.hf.lm_head.weight, atol=0, rtol=0)


def test_llama3_rope_scaling_is_applied(checkpoint):
    """The Llama-3 frequencies equal transformers' and differ from unscaled RoPE (so the parity test
    above exercises the scaling)."""
    ckpt = checkpoint("llama3-rope", "safetensors")
    model = load(ckpt)
    hf_cfg = ckpt.hf.config
    assert hf_cfg.rope_parameters["rope_type"] == "llama3"
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(model.lm.inv_freq, expected.float())
    torch.testing.assert_close(model.lm.inv_freq, ckpt.hf.model.rotary_emb.inv_freq.float())
    dim = model.config.head_dim
    plain = 1.0 / (hf_cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    changed = ~torch.isclose(model.lm.inv_freq, plain)
    assert 0 < int(changed.sum()) < dim // 2  # high frequencies kept, low ones scaled


def test_qwen2_biases_loaded(checkpoint):
    ckpt = checkpoint("qwen2", "bin")
    model = load(ckpt)
    attn, ref = model.lm.model.layers[1].self_attn, ckpt.hf.model.layers[1].self_attn
    biases = attn.qkv_proj.bias.split(attn.qkv_sizes)           # q/k/v fused (quant.fuse_projections)
    for name, bias in zip(("q_proj", "k_proj", "v_proj"), biases):
        assert bool(bias.abs().sum() > 0)
        torch.testing.assert_close(bias, getattr(ref, name).bias, atol=0, rtol=0)
    assert attn.o_proj.bias is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_weight_loaded_exactly(checkpoint, layout):
    ckpt = checkpoint("llama", layout)
    model = load(ckpt)
    ours = dict(model.lm.named_parameters())
    theirs = fused_names(dict(ckpt.hf.named_parameters()))
    assert set(ours) == set(theirs)
    for name, p in theirs.items():
        torch.testing.assert_close(ours[name], p, atol=0, rtol=0, msg=name)
