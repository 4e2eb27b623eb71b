"""Capacity planner (``specdec.tools.plan`` / ``specdec plan``).

Every model config is written here from its published dimensions (model cards / config.json on the
Hub). Expected figures are derived independently of the planner: parameter counts by hand-written
per-architecture formulas (cross-checked against the published parameter counts), KV bytes and
per-core bytes by the formulas written out in each test, and the published Neuron examples
(transformers-neuronx developer guide, "Tensor-parallelism support"; the Mistral-7B seed case of
issue 6) are compared within PUBLISHED_TOL, with their fit / no-fit conclusions asserted exactly.
"""
from __future__ import annotations

import json

import pytest

from specdec.tools.plan import GB, NoFitError, plan_capacity, resolve_platform

PUBLISHED_TOL = 0.10      # the published figures are "≈ N GB"; we accept ±10 %
USABLE = 0.9 * 16 * GB    # default capacity rule on Inf2 / Trn1: 90 % of 16 GB per NeuronCore

# --- configs from published dimensions -------------------------------------------------------

OPT_13B = dict(model_type="opt", vocab_size=50272, hidden_size=5120, ffn_dim=20480, num_hidden_layers=40,
               num_attention_heads=40, max_position_embeddings=2048, word_embed_proj_dim=5120)
OPT_30B = dict(model_type="opt", vocab_size=50272, hidden_size=7168, ffn_dim=28672, num_hidden_layers=48,
               num_attention_heads=56, max_position_embeddings=2048, word_embed_proj_dim=7168)
GPT2_XL = dict(model_type="gpt2", vocab_size=50257, n_embd=1600, n_layer=48, n_head=25, n_positions=1024)
LLAMA_31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                   max_position_embeddings=131072, tie_word_embeddings=False)
LLAMA_31_70B = dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                    max_position_embeddings=131072, tie_word_embeddings=False)
LLAMA_32_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                   num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                   max_position_embeddings=131072, tie_word_embeddings=True)
MISTRAL_7B = dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  max_position_embeddings=32768, sliding_window=4096, tie_word_embeddings=False)
SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    max_position_embeddings=8192, tie_word_embeddings=True)
QWEN2_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 max_position_embeddings=32768, tie_word_embeddings=True, use_sliding_window=False)


# --- independent parameter counts -----------------------------------------------------------

def llama_params(c: dict) -> int:
    """Llama / Mistral / Qwen2: q,k,v,o (+ q/k/v bias for Qwen2), gate/up/down, two norms per layer."""
    h, i, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    hd = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    bias = q + 2 * kv if c["model_type"] == "qwen2" else 0
    layer = 2 * h * q + 2 * h * kv + bias + 3 * h * i + 2 * h
    return layers * layer + v * h * (1 if c["tie_word_embeddings"] else 2) + h


def opt_params(c: dict) -> int:
    """OPT: biased q,k,v,out, fc1, fc2, two LayerNorms (weight+bias) per layer; learned positions
    with an offset of 2; final LayerNorm; LM head tied to the token embedding."""
    h, f, layers = c["hidden_size"], c["ffn_dim"], c["num_hidden_layers"]
    layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    return layers * layer + c["vocab_size"] * h + (c["max_position_embeddings"] + 2) * h + 2 * h


def gpt2_params(c: dict) -> int:
    """GPT-2: c_attn (h→3h), c_proj, c_fc (h→4h), c_proj, two LayerNorms per layer; tied head."""
    h, layers = c["n_embd"], c["n_layer"]
    return layers * (12 * h * h + 13 * h) + (c["vocab_size"] + c["n_positions"]) * h + 2 * h


def kv_bytes(c: dict, batch: int, positions: int, kv_heads: int, nbytes: int) -> int:
    layers = c.get("num_hidden_layers", c.get("n_layer"))
    heads = c.get("num_attention_heads", c.get("n_head"))
    hidden = c.get("hidden_size", c.get("n_embd"))
    head_dim = c.get("head_dim", hidden // heads)
    return 2 * layers * batch * positions * kv_heads * head_dim * nbytes


@pytest.mark.parametrize("config,count,published", [
    (LLAMA_31_8B, llama_params, 8_030_261_248),
    (LLAMA_31_70B, llama_params, 70_553_706_496),
    (LLAMA_32_1B, llama_params, 1_235_814_400),
    (MISTRAL_7B, llama_params, 7_241_732_096),
    (SMOLLM2_135M, llama_params, 134_515_008),
    (QWEN2_05B, llama_params, 494_032_768),
    (OPT_13B, opt_params, None),
    (OPT_30B, opt_params, None),
    (GPT2_XL, gpt2_params, None),
], ids=["llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "mistral-7b", "smollm2-135m", "qwen2-0.5b",
        "opt-13b", "opt-30b", "gpt2-xl"])
def test_parameter_count_from_config_alone(config, count, published):
    plan = plan_capacity(config, batch_size=1, n_positions=128, amp="bf16", platform="gpu:1000", cores=1)
    if published is not None:
        assert count(config) == published          # the hand formula reproduces the published count
    assert plan.model.num_parameters == count(config)
    assert plan.model.weight_bytes == 2 * count(config)


# --- the published Neuron examples ------------------------------------------------------------

def _close(value: float, published_gb: float) -> bool:
    return abs(value / GB - published_gb) <= PUBLISHED_TOL * published_gb


def test_opt_13b_fits_trn1_2xlarge():
    """opt-13b, 40 heads, batch 1, fp16: ~29 GB, so a trn1.2xlarge (2 cores, 32 GB) is sufficient."""
    plan = plan_capacity(OPT_13B, batch_size=1, n_positions=2048, amp="f16", platform="trn1.2xlarge")
    assert plan.model.kv_bytes == kv_bytes(OPT_13B, 1, 2048, 40, 2)
    assert _close(plan.model.total_bytes, 29)
    assert plan.platform.cores == 2 and plan.smallest_fitting_tp == 2
    assert not plan.degree(1).fits_memory
    d2 = plan.degree(2)
    assert d2.valid and d2.kv_bytes_per_core == kv_bytes(OPT_13B, 1, 2048, 20, 2)
    # MHA, no padding: half of everything, plus the replicated 1-D parameters (biases, LayerNorms)
    assert abs(d2.total_bytes_per_core - plan.model.total_bytes / 2) < 0.01 * GB


def test_opt_30b_needs_8_cores_of_trn1_32xlarge():
    """opt-30b, 56 heads, batch 1, fp16: ~66 GB, runs on 8 NeuronCores of a trn1.32xlarge."""
    plan = plan_capacity(OPT_30B, batch_size=1, n_positions=2048, amp="f16", platform="trn1.32xlarge")
    assert plan.model.total_bytes == 2 * opt_params(OPT_30B) + kv_bytes(OPT_30B, 1, 2048, 56, 2)
    assert _close(plan.model.total_bytes, 66)
    assert plan.smallest_fitting_tp == 8
    assert not plan.degree(4).supported                      # Trn1 has no tp=4
    for tp in (16, 32):                                      # 56 heads: not divisible
        d = plan.degree(tp)
        assert not d.heads_ok and any("56 attention heads" in r for r in d.reasons)
    assert plan.degree(8).total_bytes_per_core <= USABLE < plan.degree(2).total_bytes_per_core


def test_gpt2_xl_runs_at_tp_1_only():
    """gpt2-xl has 25 attention heads: it runs without tensor parallelism only."""
    for platform in ("trn1", "inf2"):
        plan = plan_capacity(GPT2_XL, batch_size=1, n_positions=1024, amp="bf16", platform=platform)
        assert [d.tp_degree for d in plan.degrees if d.valid] == [1]
        assert all(not d.heads_ok for d in plan.degrees if d.tp_degree > 1)
    # the published "~4 GB" is one significant figure; our count (weights + a 1024-position cache):
    assert plan.model.total_bytes == 2 * gpt2_params(GPT2_XL) + kv_bytes(GPT2_XL, 1, 1024, 25, 2)
    assert 3 * GB < plan.model.total_bytes < 4.5 * GB


def test_llama_31_8b_bf16_about_16_gb():
    plan = plan_capacity(LLAMA_31_8B, batch_size=1, n_positions=4096, amp="bf16", platform="trn1.2xlarge")
    assert plan.model.kv_bytes == kv_bytes(LLAMA_31_8B, 1, 4096, 8, 2)
    assert _close(plan.model.total_bytes, 16)
    assert plan.smallest_fitting_tp == 2                     # > 14.4 GB on one core


def test_llama_31_70b_needs_16_cores_of_trn1_32xlarge():
    """Llama-3.1-70B bf16: ~148 GB, 16 NeuronCores of a trn1.32xlarge."""
    c = LLAMA_31_70B
    plan = plan_capacity(c, batch_size=1, n_positions=4096, amp="bf16", platform="trn1.32xlarge")
    assert _close(plan.model.total_bytes, 148)
    assert plan.smallest_fitting_tp == 16
    assert plan.degree(8).total_bytes_per_core > USABLE
    # per core at tp=16: 4 of 64 query heads; the 8 KV heads are replicated to 16 (one per core)
    d = plan.degree(16)
    assert (d.q_heads_per_core, d.kv_heads_per_core, d.gqa_strategy) == (4, 1, "replicate-to-tp-degree")
    h, hd, layers = 8192, 128, 80
    weights = layers * (4 * 2 * h * hd + 1 * 2 * h * hd + 3 * h * 28672 // 16 + 2 * h) \
        + 2 * 128256 * h // 16 + h
    assert d.weight_bytes_per_core == 2 * weights
    assert d.kv_bytes_per_core == kv_bytes(c, 1, 4096, 1, 2)


def test_mistral_7b_seed_case_inf2_two_cores():
    """Issue 6: Mistral-7B bf16 allocated 15.9 GB on one Inf2 core and failed (RESOURCE_EXHAUSTED);
    tp_degree=2 (about 8 GB per core) works."""
    plan = plan_capacity(MISTRAL_7B, batch_size=1, n_positions=4096, amp="bf16", platform="inf2", cores=2)
    tp1, tp2 = plan.degree(1), plan.degree(2)
    assert _close(tp1.total_bytes_per_core, 15.9) and not tp1.fits_memory and not tp1.valid
    assert _close(tp2.total_bytes_per_core, 8) and tp2.valid
    assert plan.smallest_fitting_tp == 2
    assert not plan.degree(4).within_cores
    # the seed's failure does not depend on the cache length: weights alone exceed the usable share
    small = plan_capacity(MISTRAL_7B, batch_size=1, n_positions=128, amp="bf16", platform="inf2", cores=2)
    assert small.smallest_fitting_tp == 2


# --- GQA padding / replication in the runtime's layout ----------------------------------------

def test_smollm2_padding_at_tp_2():
    """9 query / 3 KV heads at tp=2: convert-to-mha, 10 q and 10 KV slots, 5 of each per core."""
    c, batch, n = SMOLLM2_135M, 4, 2048
    plan = plan_capacity(c, batch_size=batch, n_positions=n, amp="bf16", platform="inf2", cores=2)
    d = plan.degree(2)
    assert (d.q_heads_per_core, d.kv_heads_per_core, d.gqa_strategy) == (5, 5, "convert-to-mha")
    h, hd, layers, i, v = 576, 64, 30, 1536, 49152
    per_head = 2 * h * hd                                      # q+o, or k+v, per head per layer
    weights = layers * (5 * per_head + 5 * per_head + 3 * h * i // 2 + 2 * h) + v * h // 2 + h
    assert d.weight_bytes_per_core == 2 * weights
    assert d.kv_bytes_per_core == kv_bytes(c, batch, n, 5, 2)
    # padding costs memory: 5 KV heads per core instead of 3 in all
    assert d.kv_bytes_per_core > plan.model.kv_bytes
    # tp=4: convert-to-mha pads to 12 slots, 3 per core
    d4 = plan_capacity(c, batch_size=batch, n_positions=n, amp="bf16", platform="inf2", cores=4).degree(4)
    assert (d4.q_heads_per_core, d4.kv_heads_per_core) == (3, 3)
    # tp=3 (a GPU degree): KV heads split, no padding
    d3 = plan_capacity(c, batch_size=batch, n_positions=n, amp="bf16", platform="gpu:24", cores=3,
                       tp_degree=3).degree(3)
    assert (d3.q_heads_per_core, d3.kv_heads_per_core, d3.gqa_strategy) == (3, 1, "replicate-to-tp-degree")
    assert d3.kv_bytes_per_core == kv_bytes(c, batch, n, 1, 2)


def test_smollm2_forced_replication_is_invalid_at_tp_2():
    plan = plan_capacity(SMOLLM2_135M, batch_size=1, n_positions=512, amp="bf16", platform="inf2", cores=4,
                         gqa_strategy="replicate-to-tp-degree")
    d2 = plan.degree(2)
    assert not d2.valid and not d2.heads_ok and any("convert-to-mha" in r for r in d2.reasons)
    assert plan.smallest_fitting_tp == 1
    with pytest.raises(NoFitError, match="replicate-to-tp-degree"):
        plan_capacity(SMOLLM2_135M, batch_size=1, n_positions=512, amp="bf16", platform="inf2", cores=2,
                      tp_degree=2, gqa_strategy="replicate-to-tp-degree")


def test_qwen2_biases_follow_the_padded_heads():
    """Qwen2-0.5B (14 q / 2 KV heads, q/k/v biases) at tp=8: each KV head replicated 4 times, its
    7-head query group split 4 ways and padded to 2 per core (16 slots)."""
    c = QWEN2_05B
    d = plan_capacity(c, batch_size=1, n_positions=1024, amp="bf16", platform="inf2", tp_degree=8).degree(8)
    assert (d.q_heads_per_core, d.kv_heads_per_core, d.gqa_strategy) == (2, 1, "replicate-to-tp-degree")
    h, hd, layers = 896, 64, 24
    q_head = h * hd + hd + hd * h                  # q weight + q bias + o weight
    kv_head = 2 * (h * hd + hd)                    # k and v, weights + biases
    weights = layers * (2 * q_head + kv_head + 3 * h * 4864 // 8 + 2 * h) + 151936 * h // 8 + h
    assert d.weight_bytes_per_core == 2 * weights


def test_uneven_split_is_padded_like_the_runtime():
    """Llama-3.1-8B at tp=24: the 14336-row MLP is zero-padded to 24 × 598 rows; 8 KV heads are
    replicated 3 times, each 4-head query group split 3 ways and padded to 2 per core."""
    c = LLAMA_31_8B
    d = plan_capacity(c, batch_size=1, n_positions=1024, amp="bf16", platform="inf2", tp_degree=24).degree(24)
    assert (d.q_heads_per_core, d.kv_heads_per_core) == (2, 1)
    h, hd, layers = 4096, 128, 32
    weights = layers * (2 * 2 * h * hd + 1 * 2 * h * hd + 3 * h * 598 + 2 * h) + 2 * 5344 * h + h
    assert d.weight_bytes_per_core == 2 * weights


def test_replicated_embeddings_rule():
    c = LLAMA_31_8B
    kw = dict(batch_size=1, n_positions=1024, amp="bf16", platform="inf2", tp_degree=8)
    sharded = plan_capacity(c, **kw).degree(8)
    whole = plan_capacity(c, replicate_embeddings=True, **kw).degree(8)
    assert whole.weight_bytes_per_core - sharded.weight_bytes_per_core == 2 * 2 * 128256 * 4096 * 7 // 8


# --- speculation --------------------------------------------------------------------------------

def test_draft_adds_its_weights_and_kv_and_changes_the_answer():
    """Llama-3.1-8B with a Llama-3.2-1B draft, batch 8 × 8192 positions on Inf2."""
    kw = dict(batch_size=8, n_positions=8192, amp="bf16", platform="inf2", cores=8)
    alone = plan_capacity(LLAMA_31_8B, **kw)
    assert alone.smallest_fitting_tp == 2
    spec = plan_capacity(LLAMA_31_8B, draft_config=LLAMA_32_1B, k=4, **kw)
    d = LLAMA_32_1B
    h, hd, layers, i, v = 2048, 64, 16, 8192, 128256
    # draft at the target's degree (2): 16 q / 4 KV heads per core, tied embedding split
    draft_w2 = layers * (16 * 2 * h * hd + 4 * 2 * h * hd + 3 * h * i // 2 + 2 * h) + v * h // 2 + h
    draft2 = 2 * draft_w2 + kv_bytes(d, 8, 8192, 4, 2)
    assert spec.degree(2).draft_bytes_per_core == draft2
    assert spec.degree(2).total_bytes_per_core == alone.degree(2).total_bytes_per_core + draft2
    assert spec.draft.weight_bytes == 2 * llama_params(d)
    assert spec.smallest_fitting_tp == 4          # the draft pushes tp=2 over 14.4 GB per core
    # the whole draft on one core (draft_tp_degree=1): the fullest core carries all of it
    one = plan_capacity(LLAMA_31_8B, draft_config=LLAMA_32_1B, k=4, draft_tp_degree=1, **kw)
    assert one.degree(4).draft_bytes_per_core == 2 * llama_params(d) + kv_bytes(d, 8, 8192, 8, 2)


def test_draft_tp_larger_than_target_is_invalid():
    plan = plan_capacity(SMOLLM2_135M, draft_config=SMOLLM2_135M, k=4, draft_tp_degree=2, batch_size=1,
                         n_positions=512, amp="bf16", platform="inf2", cores=2)
    assert not plan.degree(1).valid and any("draft tp_degree=2" in r for r in plan.degree(1).reasons)
    assert plan.smallest_fitting_tp == 2
    with pytest.raises(ValueError, match="draft_tp_degree=2 is not supported with tp_degree=1"):
        plan_capacity(SMOLLM2_135M, draft_config=SMOLLM2_135M, k=4, draft_tp_degree=2, tp_degree=1,
                      batch_size=1, n_positions=512, amp="bf16", platform="inf2", cores=2)



def test_draft_between_replicated_and_target_degree_is_invalid():
    # the runtime replicates a draft (tp 1) or shards it like the target; tp 2 under a tp 8 target is neither
    plan = plan_capacity(SMOLLM2_135M, draft_config=SMOLLM2_135M, k=4, draft_tp_degree=2, batch_size=1,
                         n_positions=512, amp="bf16", platform="trn1", cores=32)
    assert plan.degree(2).valid
    assert not plan.degree(8).valid and any("neither 1" in r for r in plan.degree(8).reasons)


# --- platforms ---------------------------------------------------------------------------------

def test_platforms():
    trn2 = resolve_platform("trn2")
    assert (trn2.lnc, trn2.bytes_per_core, trn2.cores) == (2, 24 * GB, 64)
    assert trn2.degrees == (1, 2, 4, 8, 16, 32, 64)
    trn2_1 = resolve_platform("trn2.48xlarge", lnc=1)
    assert (trn2_1.bytes_per_core, trn2_1.cores) == (12 * GB, 128)
    assert resolve_platform("inf2.24xlarge").cores == 12
    assert resolve_platform("trn1").degrees == (1, 2, 8, 16, 32)
    assert resolve_platform("gpu:80").bytes_per_core == 80 * GB
    assert resolve_platform("gpu:24GiB", cores=2).bytes_per_core == 24 * 2**30
    # LNC changes the answer: Llama-3.1-70B needs 8 logical cores at LNC=2, 16 physical at LNC=1
    kw = dict(batch_size=1, n_positions=4096, amp="bf16")
    assert plan_capacity(LLAMA_31_70B, platform="trn2", **kw).smallest_fitting_tp == 8
    assert plan_capacity(LLAMA_31_70B, platform="trn2", lnc=1, **kw).smallest_fitting_tp == 16


def test_cpu_ranks_share_host_memory():
    kw = dict(batch_size=1, n_positions=4096, amp="bf16", cores=4)
    total = 2 * llama_params(LLAMA_31_8B) + kv_bytes(LLAMA_31_8B, 1, 4096, 8, 2)   # 16.6 GB
    assert plan_capacity(LLAMA_31_8B, platform="cpu:32", **kw).smallest_fitting_tp == 1
    with pytest.raises(NoFitError):                  # tp does not help: the ranks share 16 GB
        plan_capacity(LLAMA_31_8B, platform="cpu:16", **kw)
    assert total > 0.9 * 16 * GB


def test_nothing_fits_error_has_suggestions():
    with pytest.raises(NoFitError) as e:
        plan_capacity(LLAMA_31_70B, batch_size=1, n_positions=4096, amp="f32", platform="inf2.xlarge")
    msg = str(e.value)
    assert "nothing fits" in msg and "larger platform" in msg and "inf2.48xlarge" in msg
    assert "n_positions=4096" in msg and "bf16" in msg
    assert e.value.plan.smallest_fitting_tp is None and isinstance(e.value, ValueError)
    # a requested degree that does not fit names the one that does
    with pytest.raises(NoFitError, match="use tp_degree=2"):
        plan_capacity(MISTRAL_7B, batch_size=1, n_positions=4096, amp="bf16", platform="inf2", cores=2,
                      tp_degree=1)
    plan = plan_capacity(MISTRAL_7B, batch_size=1, n_positions=4096, amp="bf16", platform="inf2", cores=2,
                         tp_degree=1, require_fit=False)
    assert not plan.fits and [d.tp_degree for d in plan.degrees] == [1]


# --- bad input ---------------------------------------------------------------------------------

BASE = dict(batch_size=1, n_positions=1024, amp="bf16", platform="inf2", cores=2)


@pytest.mark.parametrize("override,pattern", [
    (dict(tp_degree=0), r"tp_degree must be an integer >= 1, got 0"),
    (dict(tp_degree=-2), r"tp_degree must be an integer >= 1, got -2"),
    (dict(tp_degree=8), r"tp_degree=8 exceeds the 2 cores available"),
    (dict(platform="trn1", cores=None, tp_degree=4),
     r"tp_degree=4 is not supported on trn1; supported .*1, 2, 8, 16, 32"),
    (dict(platform="inf2", cores=None, tp_degree=16), r"tp_degree=16 is not supported on inf2; .*1, 2, 4, 8, 24"),
    (dict(platform="tpu"), r"platform='tpu' is not known; use inf2, trn1, trn2"),
    (dict(platform="gpu"), r"gpu:<GB>"),
    (dict(platform="gpu:lots"), r"expected a positive memory size"),
    (dict(amp="int4"), r"amp='int4' is not supported; use one of 'f32', 'bf16', 'f16'"),
    (dict(batch_size=0), r"batch_size must be an integer >= 1, got 0"),
    (dict(n_positions=0), r"n_positions must be an integer >= 1, got 0"),
    (dict(cores=0), r"cores must be an integer >= 1"),
    (dict(platform="inf2.xlarge", cores=4), r"cores=4 exceeds the 2 NeuronCores of inf2.xlarge"),
    (dict(platform="inf2", cores=48), r"cores=48 exceeds the 24 NeuronCores"),
    (dict(lnc=2), r"lnc=2 is not available on inf2"),
    (dict(platform="trn2", cores=None, lnc=3), r"lnc=3 is not available on trn2; use 1 or 2"),
    (dict(memory_fraction=0), r"memory_fraction must be in \(0, 1\]"),
    (dict(memory_fraction=1.5), r"memory_fraction must be in \(0, 1\]"),
    (dict(k=-1), r"k must be an integer >= 0, got -1"),
    (dict(k=1024), r"k=1024 draft tokens per step must be smaller than n_positions=1024"),
    (dict(draft_config=SMOLLM2_135M), r"k must be >= 1"),
    (dict(draft_tp_degree=1), r"no draft_config"),
    (dict(gqa_strategy="sideways"), r"gqa_strategy='sideways' is not supported"),
])
def test_bad_input(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        plan_capacity(SMOLLM2_135M, **{**BASE, **override})


def test_bad_config_sources(tmp_path):
    with pytest.raises(FileNotFoundError):
        plan_capacity(tmp_path / "missing.json", **BASE)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        plan_capacity(tmp_path, **BASE)
    with pytest.raises(ValueError, match="needs 'model_type'"):
        plan_capacity({"hidden_size": 8}, **BASE)
    with pytest.raises(ValueError, match="model_type='nonesuch'"):
        plan_capacity({"model_type": "nonesuch"}, **BASE)


def test_config_sources_agree(tmp_path):
    from transformers import AutoConfig
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    plans = [plan_capacity(src, **BASE) for src in
             (SMOLLM2_135M, tmp_path, tmp_path / "config.json", AutoConfig.from_pretrained(tmp_path))]
    assert len({json.dumps([d.__dict__ for d in p.degrees]) for p in plans}) == 1


def test_to_dict_is_json():
    plan = plan_capacity(MISTRAL_7B, batch_size=1, n_positions=4096, amp="bf16", platform="inf2", cores=2)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["smallest_fitting_tp"] == 2 and d["fits"] is True
    assert d["model"]["total_bytes"] == plan.model.total_bytes
    assert [x["tp_degree"] for x in d["degrees"]] == [1, 2, 4, 8, 16, 24]
    assert "smallest fitting tp_degree: 2" in plan.format_table()


# --- command line ------------------------------------------------------------------------------

def test_cli_plan(tmp_path, capsys):
    from specdec.cli import main
    target, draft = tmp_path / "mistral", tmp_path / "draft"
    for d, c in ((target, MISTRAL_7B), (draft, SMOLLM2_135M | {"vocab_size": 32000})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))

    assert main(["plan", str(target / "config.json"), "--batch-size", "1", "--n-positions", "4096",
                 "--amp", "bf16", "--platform", "inf2", "--cores", "2"]) == 0
    out = capsys.readouterr().out
    assert "smallest fitting tp_degree: 2" in out and "needs 4 cores, 2 available" in out

    assert main(["plan", str(target), "--n-positions", "4096", "--platform", "inf2", "--cores", "2",
                 "--draft-config", str(draft), "--k", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["smallest_fitting_tp"] == 2 and d["draft"]["num_parameters"] > 0
    assert d["degrees"][1]["draft_bytes_per_core"] > 0

    assert main(["plan", str(target), "--n-positions", "4096", "--platform", "inf2", "--cores", "1"]) == 2
    captured = capsys.readouterr()
    assert "smallest fitting tp_degree: none" in captured.out
    assert "nothing fits" in captured.err and "suggestions:" in captured.err

    assert main(["plan", str(target), "--platform", "trn1", "--tp-degree", "4"]) == 2
    assert "tp_degree=4 is not supported on trn1" in capsys.readouterr().err
    assert main(["plan", str(target), "--platform", "inf2", "--tp-degree", "0"]) == 2
    assert "tp_degree must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["plan", str(target), "--platform", "inf2", "--cores", "2", "--tp-degree", "1"]) == 2
    assert "use tp_degree=2" in capsys.readouterr().err
