"""Weight-only int8 and int4 quantization (``specdec.core.quant``): the formats' error bounds, the
quantized model against ``transformers`` running the dequantized weights, exactness of speculation
with respect to the quantized target (greedy identity, chi-square losslessness), TP=2 = TP=1, export,
the compiled bf16 kernels, the capacity planner's bytes, and clear errors."""
import copy

import pytest
import torch

from specdec import DecoderModel, DraftModel, PromptLookup, SpeculativeGenerator
from specdec.core.config import module_bytes
from specdec.core.parallel import launch
from specdec.core.quant import (
    INT4_GROUP,
    PROJECTIONS,
    Int4Linear,
    Int8Linear,
    parse_quantization,
    quantize_int4,
    quantize_int8,
)

from conftest import checkpoint, hf_greedy, hf_logits, load, prompt_ids  # noqa: F401  (fixture)
from test_speculative import VOCAB, lossless_pvalue, save_tiny

SCHEMES = ["int8", "int4"]
LINEAR = {"int8": Int8Linear, "int4": Int4Linear}


def dequantize(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    """The values a quantized layer computes with, [N, K] f32 (the formats' definitions)."""
    if scheme == "int8":
        q, scale = quantize_int8(weight)
        return q.float() * scale.unsqueeze(1)
    q, scale, zero = quantize_int4(weight)
    n, k = weight.shape
    groups = (q.float().view(n, -1, INT4_GROUP) - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    return groups.view(n, k)


def dequantized_hf(hf: torch.nn.Module, scheme: str = "int8") -> torch.nn.Module:
    """A copy of a transformers model whose projections hold their rounded values and whose LM head holds
    its int8 values (its own tensor: a tied embedding keeps the float table)."""
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for module in hf.modules():
            for name in PROJECTIONS:
                linear = getattr(module, name, None)
                if isinstance(linear, torch.nn.Linear):
                    linear.weight.copy_(dequantize(linear.weight, scheme))
        head = hf.get_output_embeddings()
        head.weight = torch.nn.Parameter(dequantize(head.weight, "int8"))
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


def test_int4_rounding_error_is_at_most_half_a_step_per_group():
    g = torch.Generator().manual_seed(2)
    w = 0.3 * torch.randn(32, 96, generator=g)
    w[4, :32] = 0.7                                   # a constant group
    q, scale, zero = quantize_int4(w)
    assert q.dtype == torch.int32 and int(q.min()) == 0 and int(q.max()) == 15 and scale.shape == (32, 3)
    err = (dequantize(w, "int4") - w).abs().view(32, 3, INT4_GROUP)
    assert bool((err <= scale.unsqueeze(-1) / 2 + 1e-6).all())
    assert float(err[4, 0].max()) < 1e-6              # a constant group is exact
    x = torch.randn(5, 96, generator=g)
    layer = Int4Linear.from_codes(q, scale, zero, None, torch.float32)
    torch.testing.assert_close(layer(x), x @ dequantize(w, "int4").t(), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="divisible by 16 .* use quantization='int8'"):
        Int4Linear.from_linear(torch.nn.Linear(96, 40))


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


@pytest.mark.parametrize("kind", ["int8", "int4", "q8_0"])
def test_fused_projections_compute_their_parts(kind):
    """``cat_rows`` (``fuse_projections``): one layer's output is its parts' outputs side by side, bit for
    bit (each output row is its own dot product), biases included where some parts have one."""
    from specdec.core.gguf_weights import BlockWeights
    g = torch.Generator().manual_seed(3)
    linears = [torch.nn.Linear(96, rows, bias=bias) for rows, bias in ((128, True), (64, False), (64, True))]

    def layer(linear):
        if kind == "int8":
            return Int8Linear.from_linear(linear)
        if kind == "int4":
            return Int4Linear.from_linear(linear)
        q = torch.randint(-128, 128, (linear.out_features, 96), generator=g, dtype=torch.int16)
        d = torch.rand(linear.out_features, 3, generator=g).half().float()      # f16, as a GGUF file stores it
        ones = torch.ones(linear.out_features, 3, dtype=torch.int16)
        blocks = BlockWeights("Q8_0", q, 32, 32, d, torch.zeros_like(d), ones, torch.zeros_like(ones))
        return blocks.to_module(torch.float32, linear.bias)
    parts = [layer(linear) for linear in linears]
    fused = type(parts[0]).cat_rows(parts)
    x = torch.randn(5, 96, generator=g)
    assert fused.out_features == 256 and torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_model_equals_transformers_on_the_dequantized_weights(checkpoint, scheme):
    ckpt = checkpoint("llama")
    model = load(ckpt, quantization=scheme)
    layer = model.lm.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, LINEAR[scheme]) and isinstance(layer.mlp.down_proj, LINEAR[scheme])
    # fused where every part can be concatenated: int8 always; int4 when each part's rows are a
    # multiple of 64 (gate / up: 128 rows; k / v: 32 rows, so q, k, v stay apart)
    assert isinstance(layer.mlp.gate_up_proj, LINEAR[scheme]) and not hasattr(layer.mlp, "up_proj")
    assert (layer.self_attn.qkv_proj is not None) == (scheme == "int8")
    assert isinstance(model.lm.lm_head, Int8Linear)                     # the LM head at 8 bits under both
    assert isinstance(model.lm.model.embed_tokens, torch.nn.Embedding)
    reference = dequantized_hf(ckpt.hf, scheme)
    prompt = prompt_ids(9, 5)
    out = model.generate([prompt], max_new_tokens=24, eos_token_id=[])[0, len(prompt):].tolist()
    assert out == hf_greedy(reference, prompt, 24)
    model.reset()
    logits = model.prefill([torch.tensor(prompt)], model.sampling_params()).logits[0, -1]
    torch.testing.assert_close(logits, hf_logits(reference, prompt)[-1], atol=1e-4, rtol=1e-4)
    assert (logits - hf_logits(ckpt.hf, prompt)[-1]).abs().max() > 1e-3     # rounding the weights shows
    full = load(ckpt)
    assert module_bytes(model.lm) < {"int8": 0.55, "int4": 0.45}[scheme] * module_bytes(full.lm)


@pytest.mark.parametrize("name,scheme", [("int8", "int8"), ("s8", "int8"), ("per_channel_symmetric", "int8"),
                                         ("int4", "int4"), ("s4", "int4"), ("q4_0", "q4_0")])
def test_quantization_names(name, scheme):
    assert parse_quantization(name) == scheme


@pytest.mark.parametrize("variant,name,match", [
    ("llama", "fp4", "not supported: use None, 'int8', 'int4', 'gguf' or 'q4_0'"),
    ("llama-tp-padded", "int4", "divisible by 16 .* use quantization='int8'")])
def test_unsupported_quantization_is_a_clear_error(checkpoint, variant, name, match):
    with pytest.raises(ValueError, match=match):
        load(checkpoint(variant), quantization=name)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_speculation_equals_the_quantized_target(checkpoint, scheme):
    ckpt = checkpoint("llama")
    target = load(ckpt, batch_size=3, quantization=scheme)
    prompts = [prompt_ids(5, 1), [5, 6, 7, 5, 6, 7, 5, 6], prompt_ids(12, 3)]
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    draft = DraftModel.from_pretrained(checkpoint("llama-draft").path, target)
    assert isinstance(draft.model.lm.model.layers[0].mlp.down_proj, LINEAR[scheme])   # the draft inherits it
    for proposer, k in ((draft, 3), (PromptLookup(target), 4)):
        gen = SpeculativeGenerator(proposer, target, k)
        assert torch.equal(gen.generate(prompts, max_new_tokens=30, eos_token_id=[]), reference)
        assert gen.last_stats.drafted > 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_sampling_with_quantized_target_and_draft_is_lossless(tmp_path_factory, scheme):
    target_hf, target_dir = save_tiny(tmp_path_factory, "qt", 2, 3, vocab=VOCAB)
    draft_hf, draft_dir = save_tiny(tmp_path_factory, "qd", 1, 4, vocab=VOCAB)
    kw = dict(batch_size=512, n_positions=32, context_buckets=[8], kv_buckets=[32], backend="eager",
              progress=False, quantization=scheme)
    target = DecoderModel.from_pretrained(target_dir, **kw)
    gen = SpeculativeGenerator(DecoderModel.from_pretrained(draft_dir, **kw), target, 2)
    reference = dequantized_hf(target_hf, scheme)        # the distribution of the model as quantized
    assert lossless_pvalue(reference, target, gen, dict(temperature=0.8), 2) > 1e-3   # 20,480 samples
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    # the unquantized target's distribution is a different one: the same test can fail
    assert lossless_pvalue(target_hf, target, gen, dict(temperature=0.8), 2) < 1e-3


def tp_quantized(path: str, prompts: list[list[int]]) -> dict:
    out = {}
    for scheme in SCHEMES:
        target = load(path, batch_size=2, tp_degree=2, quantization=scheme)
        o_proj = target.lm.model.layers[0].self_attn.o_proj
        out[scheme] = {"tokens": target.generate(prompts, max_new_tokens=20, eos_token_id=[]).tolist(),
                       "o_proj": {k: v.clone() for k, v in o_proj.state_dict().items()}}
    return out


def test_tp2_quantized_equals_tp1_quantized(checkpoint):
    ckpt = checkpoint("llama")
    prompts = [prompt_ids(6, 7), prompt_ids(10, 8)]
    tp2 = launch(tp_quantized, 2, str(ckpt.path), prompts, timeout_s=300)
    for scheme in SCHEMES:
        tp1 = load(ckpt, batch_size=2, quantization=scheme)
        assert tp2[scheme]["tokens"] == tp1.generate(prompts, max_new_tokens=20, eos_token_id=[]).tolist()
    # row-parallel o_proj: rank 0 holds the first K columns, quantized exactly as in the unsharded model
    o_int8 = load(ckpt, quantization="int8").lm.model.layers[0].self_attn.o_proj
    rank0 = tp2["int8"]["o_proj"]
    assert torch.equal(rank0["scale"], o_int8.scale)
    assert torch.equal(rank0["weight"], o_int8.weight[:, : rank0["weight"].shape[1]])
    half = ckpt.hf.model.layers[0].self_attn.o_proj.weight[:, :32]
    expected = Int4Linear.from_codes(*quantize_int4(half), None, torch.float32)
    assert torch.equal(tp2["int4"]["o_proj"]["weight"], expected.weight)
    assert torch.equal(tp2["int4"]["o_proj"]["scales_and_zeros"], expected.scales_and_zeros)


@pytest.mark.parametrize("scheme,kernel", [("int8", torch.ops.aten._weight_int8pack_mm.default),
                                           ("int4", torch.ops.aten._weight_int4pack_mm_for_cpu.default)])
def test_quantized_graphs_export_and_compile(checkpoint, scheme, kernel):
    ckpt = checkpoint("llama")
    eager = load(ckpt, amp="bf16", quantization=scheme)
    key = eager.graph_keys(prompt_length=16, max_length=32)[-1]
    exported = eager.export(key)
    assert any(n.target == kernel for n in exported.graph.nodes)
    compiled = load(ckpt, amp="bf16", quantization=scheme, backend="compiled")
    prompt = torch.tensor(prompt_ids(9, 2))
    a = eager.prefill([prompt], eager.sampling_params()).logits
    b = compiled.prefill([prompt], compiled.sampling_params()).logits
    torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)     # bf16: compiled fusion rounds differently
    assert float((a - b).abs().mean()) < 0.03


@pytest.mark.parametrize("variant", ["llama", "llama-tied"])
def test_bytes_a_step_reads_are_the_weights_but_the_embedding_table(checkpoint, variant):
    """``ModelConfig.bytes_read_per_token`` (the benchmark's read bound): all weights the quantized
    model holds, except the embedding table beyond one row — also when tied, since the int8 head is
    its own tensor beside the float table."""
    ckpt = checkpoint(variant)
    for scheme in SCHEMES:
        model = load(ckpt, amp="bf16", quantization=scheme)
        table = model.lm.model.embed_tokens.weight
        expected = module_bytes(model.lm) - (table.numel() - table.shape[1]) * table.element_size()
        assert model.config.bytes_read_per_token(torch.bfloat16, scheme) == expected
        assert model.config.weight_bytes(torch.bfloat16, scheme) == module_bytes(model.lm)


def test_planner_counts_quantized_bytes_as_the_runtime_holds_them(checkpoint):
    from specdec.tools.plan import plan_capacity
    ckpt = checkpoint("llama")
    for tp in (1, 2):
        plans = {q: plan_capacity(ckpt.path, batch_size=1, n_positions=64, amp="f32", platform="cpu:1",
                                  tp_degree=tp, quantization=q) for q in (None, "int8", "int4")}
        full, int8, int4 = (plans[q].degrees[0].weight_bytes_per_core for q in (None, "int8", "int4"))
        assert int4 < int8 < 0.55 * full
    # int8: exact up to the planner's scale count for down_proj (rows of the larger dimension); int4 exact
    assert abs(plans["int8"].model.weight_bytes - module_bytes(load(ckpt, quantization="int8").lm)) <= 4 * 2 * 64
    assert plans["int4"].model.weight_bytes == module_bytes(load(ckpt, quantization="int4").lm)


def test_quality_benchmark_perplexity_equals_transformers_loss(checkpoint):
    from specdec.tools.bench.quality import perplexity
    ckpt = checkpoint("llama")
    ids = prompt_ids(40, 9)
    with torch.no_grad():
        loss = ckpt.hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert perplexity(load(ckpt), ids, window=64) == pytest.approx(float(torch.exp(loss)), rel=1e-4)
    # two windows of 20: the second scored from an empty cache, so it is a different number
    assert perplexity(load(ckpt), ids, window=20) != pytest.approx(float(torch.exp(loss)), rel=1e-4)
