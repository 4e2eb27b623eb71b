"""Batched generation with mixed prompt lengths (padding layouts), per-row stopping, output format,
streamers, and KV-cache rollback — each row checked against the same prompt run alone and against
``transformers``."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, hf_logits, load, prompt_ids

N_NEW = 24
LENGTHS = (5, 13, 9)   # all in the 16-token context bucket; 13 + 24 crosses KV bucket 32


@pytest.fixture(scope="module")
def prompts():
    return [prompt_ids(n, seed=10 + i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def alone(model3, prompts, ckpt):
    """Each prompt run alone (one prompt on the batch-3 model), checked against HF greedy."""
    rows = []
    for p in prompts:
        out = model3.generate([p], max_new_tokens=N_NEW, eos_token_id=[])
        assert out.shape == (1, len(p) + N_NEW)
        rows.append(out[0, len(p):].tolist())
        assert rows[-1] == hf_greedy(ckpt.hf, p, N_NEW)
    return rows


def right_padded(prompts, pad=0):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
        mask[i, :len(p)] = 1
    return ids, mask


def left_padded(prompts, pad=0):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


@pytest.mark.parametrize("form", ["right", "left", "lists"])
def test_mixed_lengths_match_single_runs(model3, prompts, alone, form):
    if form == "lists":
        ids, mask, width = prompts, None, max(map(len, prompts))
    else:
        # pad with a real (non-zero) token id so a padding leak would change the result
        ids, mask = (right_padded if form == "right" else left_padded)(prompts, pad=7)
        width = ids.shape[1]
    out = model3.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, eos_token_id=[])
    assert out.shape == (3, width + N_NEW)
    if form != "lists":
        assert torch.equal(out[:, :width], ids)   # the caller's input (with its padding) comes first
    assert out[:, width:].tolist() == alone


def test_fewer_prompts_than_batch_size(model3, prompts, alone):
    out = model3.generate([prompts[2], prompts[0]], max_new_tokens=N_NEW, eos_token_id=[])
    assert out.shape[0] == 2
    width = max(LENGTHS[2], LENGTHS[0])
    assert out[:, width:].tolist() == [alone[2], alone[0]]


def test_sequence_length_gives_per_row_budgets(model3, prompts, alone):
    total = 20
    out = model3.generate(prompts, sequence_length=total, eos_token_id=[], pad_token_id=0)
    width = max(LENGTHS)
    for i, n in enumerate(LENGTHS):
        k = total - n
        assert out[i, width:width + k].tolist() == alone[i][:k]
        assert out[i, width + k:].tolist() == [0] * (out.shape[1] - width - k)


def test_eos_stops_rows_independently(model3, prompts, alone):
    # choose as EOS a token that row 1 emits mid-way; every row must stop at its own first occurrence
    eos = alone[1][N_NEW // 2]
    pad = 1
    out = model3.generate(prompts, max_new_tokens=N_NEW, eos_token_id=eos, pad_token_id=pad)
    width = max(LENGTHS)
    stops = []
    for i in range(3):
        ref = alone[i]
        k = ref.index(eos) + 1 if eos in ref else N_NEW
        stops.append(k)
        expected = ref[:k] + [pad] * (out.shape[1] - width - k)
        assert out[i, width:].tolist() == expected
    assert out.shape[1] == width + max(stops)
    assert min(stops) < N_NEW  # EOS actually triggered


def test_default_eos_comes_from_checkpoint(model3, prompts, alone):
    assert model3.config.eos_token_ids == (2,)
    out = model3.generate([prompts[0]], max_new_tokens=N_NEW)
    ref = alone[0][: alone[0].index(2) + 1] if 2 in alone[0] else alone[0]
    assert out[0, LENGTHS[0]:LENGTHS[0] + len(ref)].tolist() == ref


def test_stopping_criteria_and_streamer(model3, prompts, alone):
    p = prompts[1]

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.clone())

        def end(self):
            self.ended = True

    def five_new(input_ids, scores):
        return input_ids.shape[1] >= len(p) + 5

    rec = Recorder()
    out = model3.generate([p], max_new_tokens=N_NEW, eos_token_id=[], stopping_criteria=[five_new],
                          streamer=rec)
    assert out[0, len(p):].tolist() == alone[1][:5]
    assert rec.ended
    assert rec.puts[0].tolist() == [p]
    assert [int(t[0]) for t in rec.puts[1:]] == alone[1][:5]


def test_rollback_masks_stale_slots(ckpt):
    """Write junk tokens, roll the length back, then feed the true continuation: the logits equal HF
    (stale cache slots are masked and overwritten), also for two rows at different lengths."""
    model = load(ckpt, batch_size=2)
    prompts = [prompt_ids(6, seed=3), prompt_ids(10, seed=4)]
    conts = [hf_greedy(ckpt.hf, p, 8) for p in prompts]
    params = model.sampling_params(do_sample=False)
    model.prefill([torch.tensor(p) for p in prompts], params)
    start = model.lengths.clone()
    junk = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    model.step(junk, params)                        # 4 junk tokens per row, chain mask
    assert torch.equal(model.lengths, start + 4)
    model.set_lengths(start)                        # reject all of them
    for i in range(8):
        out = model.step(torch.tensor([[conts[0][i]], [conts[1][i]]]), params)
        for r, p in enumerate(prompts):
            ref = hf_logits(ckpt.hf, p + conts[r][: i + 1])[-1]
            torch.testing.assert_close(out.logits[r, -1], ref, atol=1e-4, rtol=1e-4)
    # rows advance independently: only row 1 moves
    before = model.lengths.clone()
    model.step(torch.tensor([[3], [4]]), params, rows=torch.tensor([False, True]))
    assert model.lengths.tolist() == [before[0].item(), before[1].item() + 1]


def test_multi_token_chain_equals_single_steps(ckpt):
    """A 4-token causal step writes the same cache and gives the same logits as 4 single steps (HF)."""
    model = load(ckpt)
    p = prompt_ids(9, seed=5)
    cont = hf_greedy(ckpt.hf, p, 6)
    params = model.sampling_params(do_sample=False)
    model.prefill([torch.tensor(p)], params)
    out = model.step(torch.tensor([cont[:4]]), params)
    ref = hf_logits(ckpt.hf, p + cont)
    torch.testing.assert_close(out.logits[0], ref[len(p):len(p) + 4], atol=1e-4, rtol=1e-4)
    assert out.tokens[0].tolist() == cont[1:5]
    out = model.step(torch.tensor([[cont[4]]]), params)
    torch.testing.assert_close(out.logits[0, 0], ref[len(p) + 4], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("b,H,Hkv,n,L,mask_dims", [(3, 9, 3, 1, 40, 4), (2, 8, 2, 5, 17, 4), (1, 6, 3, 7, 7, 2),
                                                   (2, 4, 4, 3, 11, 4)])
def test_grouped_query_attention_is_repeat_kv_attention(b, H, Hkv, n, L, mask_dims):
    """The grouped form (query heads of a KV head as extra query rows) equals attention over K / V repeated
    to every query head (HF's repeat_kv), f32, for per-row [b, 1, n, L] and shared [n, L] masks."""
    from specdec.core.model import grouped_query_attention
    g = torch.Generator().manual_seed(b * 100 + n)
    q, k, v = (torch.randn(b, h, m, 16, generator=g) for h, m in ((H, n), (Hkv, L), (Hkv, L)))
    mask = torch.rand(b if mask_dims == 4 else 1, 1, n, L, generator=g) > 0.4
    mask[..., 0] = True
    if mask_dims == 2:
        mask = mask[0, 0]
    rep = H // Hkv
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / 16 ** 0.5
    expected = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(rep, 1)
    torch.testing.assert_close(grouped_query_attention(q, k, v, mask), expected, atol=1e-5, rtol=1e-5)
