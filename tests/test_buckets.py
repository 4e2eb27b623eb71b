"""Bucket lists and choice, and generation across context/KV bucket boundaries."""
from __future__ import annotations

import pytest
import torch

from specdec.core.buckets import check_buckets, default_buckets, fine_buckets, pick_bucket

from conftest import hf_greedy, load, prompt_ids


@pytest.mark.parametrize("buckets,needed", [([16, 32, 64, 128], n) for n in (1, 15, 16, 17, 32, 33, 100, 128)]
                         + [([5], 5), ([3, 7, 100], 8), ([1, 2], 1)])
def test_pick_bucket_is_smallest_that_fits(buckets, needed):
    b = pick_bucket(buckets, needed)
    assert b >= needed
    assert b in buckets
    assert all(x < needed for x in buckets if x < b)


def test_pick_bucket_too_long():
    with pytest.raises(ValueError, match=r"KV length 129 exceeds the largest bucket 128"):
        pick_bucket([16, 128], 129, "KV length")


@pytest.mark.parametrize("n_positions,smallest", [(2048, 128), (128, 128), (100, 128), (300, 128), (64, 16),
                                                  (4096, 128), (17, 16)])
def test_default_buckets(n_positions, smallest):
    b = default_buckets(n_positions, smallest)
    assert b[-1] == n_positions
    assert b == sorted(set(b))
    inner = b[:-1]
    # powers of two starting at `smallest`, each doubling, all below n_positions
    assert inner == [smallest * 2 ** i for i in range(len(inner))]
    assert all(x < n_positions for x in inner)
    assert not inner or inner[-1] * 2 >= n_positions


@pytest.mark.parametrize("n_positions", [16, 32, 40, 48, 64, 100, 256, 1000, 1024, 4096])
def test_fine_buckets_pad_a_prompt_by_less_than_half(n_positions):
    b = fine_buckets(n_positions)
    assert b[-1] == n_positions and b == sorted(set(b)) and b[0] == min(32, n_positions)
    for length in range(b[0] + 1, n_positions + 1):      # every length the smallest bucket does not hold
        assert pick_bucket(b, length) < 1.5 * length
    assert fine_buckets(1024) == [32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]


def test_check_buckets():
    assert check_buckets("kv", [64, 16, 32, 16], 64) == [16, 32, 64]
    assert check_buckets("kv", None, 512) == default_buckets(512)
    assert check_buckets("context", None, 512, fine=True) == fine_buckets(512)
    assert check_buckets("context", [64, 16], 512, fine=True) == [16, 64]      # a given list wins
    for bad in ([], [0, 16], [16, 65]):
        with pytest.raises(ValueError, match=r"kv=.*buckets must be positive and at most n_positions=64"):
            check_buckets("kv", bad, 64)


PROMPT_LEN, N_NEW = 10, 60


@pytest.fixture(scope="module")
def setup(checkpoint):
    ckpt = checkpoint("llama")
    prompt = prompt_ids(PROMPT_LEN, seed=31)
    return ckpt, prompt, hf_greedy(ckpt.hf, prompt, N_NEW)


def test_generation_across_kv_buckets(setup):
    ckpt, prompt, ref = setup
    multi = load(ckpt, context_buckets=[16, 128], kv_buckets=[16, 32, 64, 128])
    single = load(ckpt, context_buckets=[128], kv_buckets=[128])
    a = multi.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[])
    b = single.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[])
    assert a[0, PROMPT_LEN:].tolist() == ref
    assert b[0, PROMPT_LEN:].tolist() == ref
    # the bucketed run really used every KV bucket (and the small context bucket), the other just one
    assert {k.kv_len for k in multi.graphs.built if k.n_tokens == 1} == {16, 32, 64, 128}
    assert {k.n_tokens for k in multi.graphs.built if k.n_tokens > 1} == {16}
    assert {k.kv_len for k in single.graphs.built} == {128}


def test_step_picks_bucket_for_length_plus_n(setup):
    """A multi-token step needs room for lengths + n: the KV bucket is chosen for that."""
    ckpt, prompt, ref = setup
    model = load(ckpt, context_buckets=[16], kv_buckets=[16, 32, 64, 128])
    params = model.sampling_params(do_sample=False)
    model.prefill([torch.tensor(prompt)], params)          # length 10
    model.step(torch.tensor([ref[:6]]), params)            # 10 + 6 = 16 → bucket 16
    model.step(torch.tensor([ref[6:7]]), params)           # 16 + 1 = 17 → bucket 32
    kvs = [k.kv_len for k in model.graphs.built if k.n_tokens < 16]
    assert kvs == [16, 32]


@pytest.mark.parametrize("length", [1, 15, 16, 17, 40])
def test_context_bucket_choice_does_not_change_results(setup, length):
    ckpt, _, _ = setup
    prompt = prompt_ids(length, seed=40 + length)
    ref = hf_greedy(ckpt.hf, prompt, 8)
    model = load(ckpt, context_buckets=[16, 32, 64, 128])
    out = model.generate([prompt], max_new_tokens=8, eos_token_id=[])
    assert out[0, length:].tolist() == ref
    (ctx,) = [k.n_tokens for k in model.graphs.built if k.n_tokens > 1]
    assert ctx == pick_bucket([16, 32, 64, 128], length)


def test_graph_keys_limited_to_what_a_request_needs(setup):
    ckpt = setup[0]
    model = load(ckpt, context_buckets=[16, 32, 64, 128], kv_buckets=[16, 32, 64, 128])
    keys = model.graph_keys(do_sample=False, prompt_length=20, max_length=40)
    assert sorted(k.n_tokens for k in keys if k.n_logits == 1 and k.n_tokens > 1) == [16, 32]
    assert sorted(k.kv_len for k in keys if k.n_tokens == 1) == [16, 32, 64]
    assert len(model.graph_keys(do_sample=False)) == 8
    with pytest.raises(ValueError, match="max_length"):
        model.graph_keys(max_length=200)
