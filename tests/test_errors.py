"""Invalid checkpoints, settings and requests fail with clear messages, and a following valid
request still gives the correct (transformers-equal) output: no corrupted state."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config

from specdec import DecoderModel, SamplingConfig

from conftest import VOCAB, hf_greedy, hf_logits, load, prompt_ids

N_NEW = 12
N_POS = 64


@pytest.fixture(scope="module")
def good(ckpt):
    """(prompts, HF greedy continuations) of a valid two-row request."""
    prompts = [prompt_ids(6, seed=51), prompt_ids(9, seed=52)]
    return prompts, [hf_greedy(ckpt.hf, p, N_NEW) for p in prompts]


@pytest.fixture(scope="module")
def model(ckpt):
    return load(ckpt, batch_size=2, n_positions=N_POS, context_buckets=[16, 32], kv_buckets=[32, 64])


def assert_still_correct(model, good):
    prompts, refs = good
    out = model.generate(prompts, max_new_tokens=N_NEW, eos_token_id=[])
    width = max(map(len, prompts))
    assert out[:, width:].tolist() == refs


# ----------------------------------------------------------------------------- checkpoints
def broken_copy(src, dst, edit):
    """Copy a safetensors checkpoint and rewrite its weights with ``edit(state) -> state``."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    save_file(edit(state), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_unsupported_model_type(tmp_path, ckpt, good):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; supported: llama, mistral, qwen2"):
        load(tmp_path)
    assert_still_correct(load(ckpt, batch_size=2), good)


def test_missing_weight_file(tmp_path, ckpt, good):
    shutil.copy(ckpt.path / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no weights in .*expected one of model\.safetensors\.index\.json"):
        load(tmp_path)
    assert_still_correct(load(ckpt, batch_size=2), good)


def test_missing_shard(tmp_path, checkpoint, good):
    src = checkpoint("llama", "bin-sharded").path
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    index = json.loads((dst / "pytorch_model.bin.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (dst / victim).unlink()
    with pytest.raises(FileNotFoundError, match=rf"lists shard\(s\) that do not exist: {victim}"):
        load(dst)
    assert_still_correct(load(src, batch_size=2), good)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"has no config.json"):
        load(tmp_path)


def test_missing_tensor(tmp_path, ckpt, good):
    name = "model.layers.1.mlp.up_proj.weight"
    dst = broken_copy(ckpt.path, tmp_path / "ckpt", lambda s: {k: v for k, v in s.items() if k != name})
    with pytest.raises(KeyError, match=rf"missing tensor\(s\): {name}"):
        load(dst)
    assert_still_correct(load(ckpt, batch_size=2), good)


def test_wrong_tensor_shape(tmp_path, ckpt, good):
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(state):
        state[name] = state[name][:16].contiguous()
        return state
    dst = broken_copy(ckpt.path, tmp_path / "ckpt", edit)
    with pytest.raises(ValueError,
                       match=rf"tensor '{name}' .* has shape \(16, 64\), but the config implies \(32, 64\)"):
        load(dst)
    assert_still_correct(load(ckpt, batch_size=2), good)


def test_sliding_window_shorter_than_n_positions(tmp_path, checkpoint):
    src = checkpoint("mistral").path
    shutil.copytree(src, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["sliding_window"] = 64
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError,
                       match=r"n_positions=128 exceeds sliding_window=64; sliding-window attention is not implemented"):
        load(tmp_path / "ckpt")
    assert load(tmp_path / "ckpt", n_positions=64, kv_buckets=[64]).config.sliding_window == 64


@pytest.mark.parametrize("kwargs,match", [
    ({"backend": "tpu"}, r"backend='tpu' is not supported; use one of eager, compiled, regional, xla, neuron"),
    ({"backend": "xla", "device": "cpu"}, r"backend='xla' runs on an XLA device, not device='cpu'"),
    ({"backend": "eager", "device": "xla"}, r"device='xla' needs backend='xla'"),
    ({"amp": "int8"}, r"amp='int8' is not supported"),
    ({"tp_degree": 0}, r"tp_degree must be an integer >= 1, got 0"),
    ({"n_positions": 512}, r"n_positions=512 exceeds the model's max_position_embeddings=256"),
    ({"kv_buckets": [16, 256]}, r"kv_buckets=\[16, 256\]: buckets must be positive and at most n_positions=128"),
    ({"batch_size": 0}, r"batch_size must be >= 1"),
])
def test_invalid_settings(ckpt, kwargs, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        load(ckpt, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"top_p": 0.0}, r"top_p=0.0 is invalid: must be in \(0, 1\]"),
    ({"temperature": -1.0}, r"temperature=-1.0 is invalid"),
    ({"top_k": -2}, r"top_k=-2 is invalid"),
    ({"global_topk": 0}, r"global_topk must be None or >= 1"),
])
def test_invalid_sampling_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


# ----------------------------------------------------------------------------- requests
REQUEST_ERRORS = [
    # (input_ids, generate kwargs, exception message)
    ("long", {"max_new_tokens": 40}, r"prompt 0 has 30 tokens; with the requested new tokens it needs 70 "
                                     r"positions, but n_positions=64"),
    ("long", {"sequence_length": 65}, r"sequence_length=65 exceeds n_positions=64"),
    ("too_long_prompt", {"max_new_tokens": 1}, r"prompt 0 has 40 tokens; the largest context bucket is 32"),
    ("three", {"max_new_tokens": 4}, r"batch of 3 prompts exceeds the compiled batch_size=2"),
    ("ok", {"max_new_tokens": 4, "do_sample": True, "top_p": 0.0}, r"top_p=0.0 is invalid: must be in \(0, 1\]"),
    ("ok", {"max_new_tokens": 4, "do_sample": True, "top_p": 1.5}, r"top_p=1.5 is invalid: must be in \(0, 1\]"),
    ("ok", {"max_new_tokens": 4, "do_sample": True, "top_p": [0.5, -0.1]}, r"top_p=\[0.5, -0.1\] is invalid"),
    ("ok", {"max_new_tokens": 4, "do_sample": True, "temperature": -0.5}, r"temperature=-0.5 is invalid: must be >= 0"),
    ("ok", {"max_new_tokens": 4, "temperature": float("nan")}, r"temperature=nan is invalid"),
    ("ok", {"max_new_tokens": 4, "do_sample": True, "top_k": -1}, r"top_k=-1 is invalid: must be >= 0"),
    ("ok", {"max_new_tokens": 4, "do_sample": True, "top_k": 2.5}, r"top_k=2.5 is invalid: must be an integer"),
    ("ok", {"max_new_tokens": 4, "do_sample": True, "top_k": [1, 2, 3]},
     r"top_k has 3 values; give one value or one per row \(2\)"),
    ("ok", {"max_new_tokens": 0}, r"max_new_tokens must be >= 1, got 0"),
    ("ok", {}, r"give max_new_tokens or sequence_length"),
    ([[]], {"max_new_tokens": 4}, r"prompt 0 is empty"),
    ([], {"max_new_tokens": 4}, r"empty"),
    ([[5, 6], []], {"max_new_tokens": 4}, r"prompt 1 is empty"),
    (torch.zeros(1, 0, dtype=torch.long), {"max_new_tokens": 4}, r"prompt 0 is empty"),
    (torch.zeros(0, 3, dtype=torch.long), {"max_new_tokens": 4}, r"input_ids is empty"),
    ([[5, 6], [7, VOCAB]], {"max_new_tokens": 4},
     rf"prompt 1 has token id {VOCAB} outside the vocabulary \[0, {VOCAB}\)"),
    ([[5, -1]], {"max_new_tokens": 4}, rf"prompt 0 has token id -1 outside the vocabulary \[0, {VOCAB}\)"),
    ([5, 10**9], {"max_new_tokens": 4}, r"token id 1000000000 outside the vocabulary"),
    (torch.tensor([[5.0, 6.0]]), {"max_new_tokens": 4}, r"input_ids must be integer token ids"),
    ([[5, 6], [7.5]], {"max_new_tokens": 4}, r"prompt 1 must be integer token ids, got dtype torch.float32"),
    (torch.ones(1, 2, 3, dtype=torch.long), {"max_new_tokens": 4}, r"input_ids must be \[batch, length\]"),
    ("hello", {"max_new_tokens": 4}, r"input_ids must be token ids, got text: tokenize it first"),
    (["hello", "world"], {"max_new_tokens": 4}, r"input_ids must be token ids, got text"),
    ([["hello"]], {"max_new_tokens": 4}, r"prompt 0 must be token ids, got text"),
    (None, {"max_new_tokens": 4}, r"input_ids must be token ids \(a LongTensor, or lists of ints\), got NoneType"),
    ([object()], {"max_new_tokens": 4}, r"got list of object"),
    (torch.tensor([[True, False]]), {"max_new_tokens": 4}, r"integer token ids, got dtype torch.bool"),
    ({"ids": [5, 6]}, {"max_new_tokens": 4}, r"a mapping without an 'input_ids' entry \(keys: \['ids'\]\)"),
]


def request_input(kind):
    if kind in ("long", "too_long_prompt", "three", "ok"):
        return {"long": [prompt_ids(30, seed=1)], "too_long_prompt": [prompt_ids(40, seed=1)],
                "three": [[5, 6]] * 3, "ok": [[5, 6, 7]]}[kind]
    return kind


@pytest.mark.parametrize("input_ids,kwargs,match", REQUEST_ERRORS,
                         ids=[f"{i}-{m[:30]}" for i, (_, _, m) in enumerate(REQUEST_ERRORS)])
def test_invalid_request_then_valid_request(model, good, input_ids, kwargs, match):
    with pytest.raises(ValueError, match=match):
        model.generate(request_input(input_ids), eos_token_id=[], **kwargs)
    assert_still_correct(model, good)


def test_tokenizer_output_is_accepted(model, good):
    """A tokenizer's output (a mapping such as BatchEncoding, lists or tensors) gives what its ids give; its
    attention mask strips left padding as an explicit one does."""
    from transformers import BatchEncoding
    ids = [[5, 6, 7]]
    expect = model.generate(ids, max_new_tokens=4, eos_token_id=[])
    for enc in (BatchEncoding({"input_ids": ids}), BatchEncoding({"input_ids": torch.tensor(ids)}, tensor_type="pt"),
                {"input_ids": [[0, 5, 6, 7]], "attention_mask": [[0, 1, 1, 1]]}):
        out = model.generate(enc, max_new_tokens=4, eos_token_id=[])
        assert out[0, -4:].tolist() == expect[0, -4:].tolist(), enc
    assert_still_correct(model, good)


def test_attention_mask_errors(model, good):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"attention_mask shape \(1, 2\) != input_ids shape \(1, 3\)"):
        model.generate(ids, attention_mask=torch.ones(1, 2), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"attention_mask is only accepted with input_ids of one length per row"):
        model.generate([[5, 6, 7], [5, 6]], attention_mask=[[1, 1, 1], [1, 1, 0]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 0 is empty"):
        model.generate(ids, attention_mask=torch.zeros(1, 3), max_new_tokens=2)
    assert_still_correct(model, good)


def test_error_mid_decoding_leaves_state_intact(model, ckpt, good):
    """Graph-level errors (wrong rows, past n_positions, bad rollback) change nothing: the next valid
    step continues exactly as transformers does."""
    prompts, refs = good
    params = model.sampling_params(do_sample=False)
    model.prefill([torch.tensor(p) for p in prompts], params)
    lengths = model.lengths.clone()
    with pytest.raises(ValueError, match=r"step expects 2 rows, got 1"):
        model.step(torch.tensor([[refs[0][0]]]), params)
    with pytest.raises(ValueError, match=r"a row would reach 69 positions; n_positions=64"):
        model.step(torch.zeros(2, 60, dtype=torch.long), params)
    with pytest.raises(ValueError, match=r"lengths must be \[2\] in \[0, 64\]"):
        model.set_lengths(torch.tensor([3, 65]))
    with pytest.raises(ValueError, match=r"lengths must be \[2\]"):
        model.set_lengths(torch.tensor([3]))
    assert torch.equal(model.lengths, lengths)
    out = model.step(torch.tensor([[refs[0][0]], [refs[1][0]]]), params)
    for r, p in enumerate(prompts):
        torch.testing.assert_close(out.logits[r, 0], hf_logits(ckpt.hf, p + refs[r][:1])[-1], atol=1e-4, rtol=1e-4)
        assert int(out.tokens[r, 0]) == refs[r][1]
    assert_still_correct(model, good)


def test_load_saved_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds no saved specdec model \(specdec.json missing\)"):
        DecoderModel.load(tmp_path)
