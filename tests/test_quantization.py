"""Weight-only int8 quantization (``specdec.core.quant``): the format's error bound, the quantized
model against ``transformers`` running the dequantized weights, exactness of speculation with
respect to the quantized target (greedy identity, chi-square losslessness), TP=2 = TP=1, export,
the compiled bf16 kernel, the capacity planner's bytes, and clear errors."""
import copy

import pytest
import torch
from test_speculative import VOCAB, lossless_pvalue, save_tiny

from conftest import checkpoint, hf_greedy, hf_logits, load, prompt_ids  # noqa: F401  (fixture)
from specdec import DecoderModel, DraftModel, PromptLookup, SpeculativeGenerator
from specdec.core.config import module_bytes
from specdec.core.parallel import launch
from specdec.core.quant import PROJECTIONS, Int8Linear, parse_quantization, quantize_int8


def dequantized_hf(hf: torch.nn.Module) -> torch.nn.Module:
    """A copy of a transformers model whose projections hold their int8-rounded values (q · scale)."""
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for module in hf.modules():
            for name in PROJECTIONS:
                linear = getattr(module, name, None)
                if isinstance(linear, torch.nn.Linear):
                    q, scale = quantize_int8(linear.weight)
                    linear.weight.copy_(q.float() * scale.unsqueeze(1))
    return hf


def test_int8_rounding_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = 0.3 * torch.randn(64, 96, generator=g)
    w[5] = 0                                          # an all-zero (padding) row
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and scale.shape == (64,)
    err = (q.float() * scale.unsqueeze(1) - w).abs()
    assert bool((err <= scale.unsqueeze(1) / 2 + 1e-7).all())
    assert bool((q[5] == 0).all())
    half, half_scale = quantize_int8(w[:, :48], row_max=w.abs().amax(1))   # a K-shard: the full rows' scales
    assert torch.equal(half, q[:, :48]) and torch.equal(half_scale, scale)


def test_int8_linear_computes_with_the_dequantized_weight():
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(0.2 * torch.randn(40, 96, generator=g))
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(2, 3, 96, generator=g)
    ref = torch.nn.functional.linear(x, layer.dequantized(), linear.bias)
    torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
    bf16 = Int8Linear.from_linear(copy.deepcopy(linear).to(torch.bfloat16))     # the CPU int8 kernel
    torch.testing.assert_close(bf16(x.bfloat16()).float(), ref, atol=0.05, rtol=0.02)
    assert not torch.equal(layer.dequantized(), linear.weight)                  # it is rounded


def test_quantized_model_equals_transformers_on_the_dequantized_weights(checkpoint):
    ckpt = checkpoint("llama")
    model = load(ckpt, quantization="int8")
    layer = model.lm.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Int8Linear) and isinstance(layer.mlp.down_proj, Int8Linear)
    assert isinstance(model.lm.lm_head, torch.nn.Linear)               # the LM head stays as loaded
    reference = dequantized_hf(ckpt.hf)
    prompt = prompt_ids(9, 5)
    out = model.generate([prompt], max_new_tokens=24, eos_token_id=[])[0, len(prompt):].tolist()
    assert out == hf_greedy(reference, prompt, 24)
    model.reset()
    logits = model.prefill([torch.tensor(prompt)], model.sampling_params()).logits[0, -1]
    torch.testing.assert_close(logits, hf_logits(reference, prompt)[-1], atol=1e-4, rtol=1e-4)
    assert (logits - hf_logits(ckpt.hf, prompt)[-1]).abs().max() > 1e-3     # rounding the weights shows
    full = load(ckpt)
    assert module_bytes(model.lm) < 0.55 * module_bytes(full.lm)      # projections: 1 byte instead of 4


@pytest.mark.parametrize("name", ["int8", "s8", "per_channel_symmetric"])
def test_quantization_names(name):
    assert parse_quantization(name) == "int8"


@pytest.mark.parametrize("name,match", [("int4", "not implemented yet: use 'int8'"),
                                        ("fp4", "not supported: use None or 'int8'")])
def test_unsupported_quantization_is_a_clear_error(checkpoint, name, match):
    with pytest.raises(ValueError, match=match):
        load(checkpoint("llama"), quantization=name)


def test_greedy_speculation_equals_the_quantized_target(checkpoint):
    ckpt = checkpoint("llama")
    target = load(ckpt, batch_size=3, quantization="int8")
    prompts = [prompt_ids(5, 1), [5, 6, 7, 5, 6, 7, 5, 6], prompt_ids(12, 3)]
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    draft = DraftModel.from_pretrained(checkpoint("llama-draft").path, target)
    assert isinstance(draft.model.lm.model.layers[0].mlp.up_proj, Int8Linear)   # the draft inherits int8
    for proposer, k in ((draft, 3), (PromptLookup(target), 4)):
        gen = SpeculativeGenerator(proposer, target, k)
        assert torch.equal(gen.generate(prompts, max_new_tokens=30, eos_token_id=[]), reference)
        assert gen.last_stats.drafted > 0


def test_sampling_with_quantized_target_and_draft_is_lossless(tmp_path_factory):
    target_hf, target_dir = save_tiny(tmp_path_factory, "qt", 2, 3, vocab=VOCAB)
    draft_hf, draft_dir = save_tiny(tmp_path_factory, "qd", 1, 4, vocab=VOCAB)
    kw = dict(batch_size=512, n_positions=32, context_buckets=[8], kv_buckets=[32], backend="eager",
              progress=False, quantization="int8")
    target = DecoderModel.from_pretrained(target_dir, **kw)
    gen = SpeculativeGenerator(DecoderModel.from_pretrained(draft_dir, **kw), target, 2)
    reference = dequantized_hf(target_hf)                # the distribution of the model as quantized
    assert lossless_pvalue(reference, target, gen, dict(temperature=0.8), 2) > 1e-3   # 20,480 samples
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    # the unquantized target's distribution is a different one: the same test can fail
    assert lossless_pvalue(target_hf, target, gen, dict(temperature=0.8), 2) < 1e-3


def tp_quantized_tokens(path: str, prompts: list[list[int]]) -> dict:
    target = load(path, batch_size=2, tp_degree=2, quantization="int8")
    out = target.generate(prompts, max_new_tokens=20, eos_token_id=[])
    layer = target.lm.model.layers[0]
    return {"tokens": out.tolist(), "o_scale": layer.self_attn.o_proj.scale.clone(),
            "o_q": layer.self_attn.o_proj.weight.clone(), "rank": target.tp.rank}


def test_tp2_quantized_equals_tp1_quantized(checkpoint):
    ckpt = checkpoint("llama")
    prompts = [prompt_ids(6, 7), prompt_ids(10, 8)]
    tp2 = launch(tp_quantized_tokens, 2, str(ckpt.path), prompts, timeout_s=300)
    tp1 = load(ckpt, batch_size=2, quantization="int8")
    assert tp2["tokens"] == tp1.generate(prompts, max_new_tokens=20, eos_token_id=[]).tolist()
    o_proj = tp1.lm.model.layers[0].self_attn.o_proj          # row-parallel: rank 0 holds the first K columns
    assert torch.equal(tp2["o_scale"], o_proj.scale)
    assert torch.equal(tp2["o_q"], o_proj.weight[:, : tp2["o_q"].shape[1]])


def test_quantized_graphs_export_and_compile(checkpoint):
    ckpt = checkpoint("llama")
    eager = load(ckpt, amp="bf16", quantization="int8")
    key = eager.graph_keys(prompt_length=16, max_length=32)[-1]
    exported = eager.export(key)
    assert any(n.target == torch.ops.aten._weight_int8pack_mm.default for n in exported.graph.nodes)
    compiled = load(ckpt, amp="bf16", quantization="int8", backend="compiled")
    prompt = torch.tensor(prompt_ids(9, 2))
    a = eager.prefill([prompt], eager.sampling_params()).logits
    b = compiled.prefill([prompt], compiled.sampling_params()).logits
    torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)


def test_planner_counts_int8_bytes_as_the_runtime_holds_them(checkpoint):
    from specdec.plan import plan_capacity
    ckpt = checkpoint("llama")
    for tp in (1, 2):
        plans = {q: plan_capacity(ckpt.path, batch_size=1, n_positions=64, amp="f32", platform="cpu:1",
                                  tp_degree=tp, quantization=q) for q in (None, "int8")}
        full, int8 = (plans[q].degrees[0].weight_bytes_per_core for q in (None, "int8"))
        assert int8 < 0.55 * full
    model = load(ckpt, quantization="int8")
    planned = plans["int8"].model.weight_bytes
    # exact up to the planner's scale count for down_proj (rows of the larger dimension)
    assert abs(planned - module_bytes(model.lm)) <= 4 * 2 * (128 - 64)


def test_quality_benchmark_perplexity_equals_transformers_loss(checkpoint):
    from specdec.bench.quality import perplexity
    ckpt = checkpoint("llama")
    ids = prompt_ids(40, 9)
    with torch.no_grad():
        loss = ckpt.hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert perplexity(load(ckpt), ids, window=64) == pytest.approx(float(torch.exp(loss)), rel=1e-4)
    # two windows of 20: the second scored from an empty cache, so it is a different number
    assert perplexity(load(ckpt), ids, window=20) != pytest.approx(float(torch.exp(loss)), rel=1e-4)
