"""A decoder layer of a GGUF file's blocks as five kernel calls (``specdec.core.block_layer``): ``block_mm``'s
prologue (RMSNorm, the SiLU gate) and epilogue (bias, residual) equal the layer's own math, ``cache_attention``
equals RoPE + cache writes + masked softmax attention, both are row-invariant (a row's bits do not depend on
how many rows or slots a call has), bad inputs fail clearly, the one-call ``block_layer`` gives the five calls'
bits, and a GGUF model runs its layers so: the same logits as the unfused layers, in every backend."""
from dataclasses import replace
from functools import partial

import pytest
import torch

from specdec.core.block_layer import BlockStack, block_layers_apply, run_block_layer, runs_block_layers
from specdec.core.block_linear import BlockLinear, pack_prompt_weight, packs_prompt_weights, prompt_matmul
from specdec.core.buckets import default_buckets, fine_buckets
from specdec.core.graphs import compile_layers
from specdec.core.kernels import block_mm_isa, load_block_mm, reference_block_mm, reference_cache_attention

from conftest import load, prompt_ids
from test_block_mm import blocks
from tiny_gguf import VOCAB, write_tiny_gguf

pytestmark = pytest.mark.skipif(load_block_mm() or block_mm_isa() == "reference",
                                reason="the C++ kernels did not build (the Python reference runs)")
ROWS = (1, 2, 5, 9, 16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny GGUF model (``tiny_gguf``: Q4_0 / Q4_1 / Q8_0 layers, head dim 16)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "target.gguf", seed=0)


def layer(qtype: str, n: int = 48, k: int = 256, bias: bool = True) -> BlockLinear:
    g = torch.Generator().manual_seed(1)
    return BlockLinear.from_blocks(blocks(qtype, n, k), torch.float32,
                                   torch.randn(n, generator=g) if bias else None)


def reference(lin: BlockLinear, x: torch.Tensor, **fused) -> torch.Tensor:
    lay = lin.layout
    return reference_block_mm(x, lin.qs, lin.d, lin.dmin, lin.sc, lin.mn, lin.out_features, lay.group,
                              lay.superblock, lay.kind, lay.offset, lay.mins, bias=lin.bias, **fused)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q6_K", "Q8_0"])
def test_the_prologue_and_epilogue_are_the_layers_math(qtype):
    lin = layer(qtype)
    g = torch.Generator().manual_seed(2)
    x, gated = torch.randn(9, 256, generator=g), torch.randn(9, 512, generator=g) * 3
    norm, residual = torch.rand(256, generator=g) + 0.5, torch.randn(9, 48, generator=g)
    for fused, inputs in ((dict(norm=norm, eps=1e-6), x), (dict(gated=True, residual=residual), gated),
                          (dict(residual=residual), x)):
        ours, expected = lin.fused(inputs, **fused), reference(lin, inputs, **fused)
        # the quantized activations may round one value the other way: a few units of the last place at most
        assert torch.allclose(ours, expected, rtol=1e-4, atol=1e-3 * float(expected.abs().max())), fused
    plain = lin.fused(x)
    assert torch.equal(plain, lin(x))            # no prologue or epilogue: forward's numbers, bias included


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0"])
def test_the_fused_steps_are_row_invariant(qtype):
    lin = layer(qtype)
    g = torch.Generator().manual_seed(3)
    x, gated = torch.randn(16, 256, generator=g), torch.randn(16, 512, generator=g)
    norm, residual = torch.rand(256, generator=g) + 0.5, torch.randn(16, 48, generator=g)
    full = (lin.fused(x, norm=norm, eps=1e-6), lin.fused(gated, gated=True, residual=residual))
    for m in ROWS:
        assert torch.equal(lin.fused(x[:m], norm=norm, eps=1e-6), full[0][:m]), m
        assert torch.equal(lin.fused(gated[:m], gated=True, residual=residual[:m]), full[1][:m]), m


def attention_case(b=2, n=5, heads=6, kv_heads=2, dim=32, slots=40, length=32, seed=0):
    """Random inputs of ``cache_attention``: row r's first 8 + 4 r slots committed, n new tokens after them,
    causal among themselves; rows read cache rows in reverse order."""
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(b, slots, kv_heads, dim, generator=g) for _ in range(2)]
    q = torch.randn(b, n, heads * dim, generator=g)
    k, v = (torch.randn(b, n, kv_heads * dim, generator=g) for _ in range(2))
    angle = torch.rand(b, n, dim, generator=g) * 6
    rows = torch.arange(b).flip(0)
    lengths = 8 + 4 * torch.arange(b)
    new = lengths.unsqueeze(1) + torch.arange(n)
    mask = torch.arange(length).view(1, 1, length) < lengths.view(b, 1, 1)
    mask = mask.expand(b, n, length).clone()
    mask[torch.arange(b).view(b, 1, 1), torch.arange(n).view(1, n, 1), new.unsqueeze(1)] = \
        torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0).expand(b, n, n)
    return q, k, v, angle.cos(), angle.sin(), *caches, rows, new, mask


def test_cache_attention_equals_rope_writes_and_masked_softmax():
    for dims in (dict(), dict(heads=4, kv_heads=4, dim=64), dict(n=1, heads=14, kv_heads=2, dim=128)):
        case = attention_case(**dims)
        ours_caches, expected_caches = [t.clone() for t in case[5:7]], [t.clone() for t in case[5:7]]
        ours = torch.ops.specdec.cache_attention(*case[:5], *ours_caches, *case[7:])
        expected = reference_cache_attention(*case[:5], *expected_caches, *case[7:])
        assert torch.allclose(ours, expected, atol=1e-5, rtol=1e-4), dims
        assert torch.equal(ours_caches[1], expected_caches[1])                   # the values, as they came
        assert torch.allclose(ours_caches[0], expected_caches[0], atol=1e-6)     # the rotated keys
        untouched = torch.ones_like(ours_caches[0], dtype=torch.bool)
        untouched[case[7].view(-1, 1), case[8]] = False
        assert torch.equal(ours_caches[0][untouched], case[5][untouched])       # no other slot written


def test_cache_attention_is_row_invariant():
    """Token i's output is the same bits alone (n = 1, after the earlier tokens were written) as among n, and
    with a longer KV bucket (more masked slots)."""
    q, k, v, cos, sin, kc, vc, rows, slots, mask = attention_case(n=5)
    together = torch.ops.specdec.cache_attention(q, k, v, cos, sin, kc.clone(), vc.clone(), rows, slots, mask)
    kc1, vc1 = kc.clone(), vc.clone()
    wider = torch.cat([mask, torch.zeros(*mask.shape[:2], 8, dtype=torch.bool)], 2)
    for i in range(5):
        part = [t[:, i:i + 1].contiguous() for t in (q, k, v, cos, sin)]
        alone = torch.ops.specdec.cache_attention(*part, kc1, vc1, rows, slots[:, i:i + 1].contiguous(),
                                                  wider[:, i:i + 1].contiguous())
        assert torch.equal(alone[:, 0], together[:, i]), i


def test_a_tree_node_attends_like_the_decode_step_of_its_path():
    """A tree node attends to the cache and its ancestors, whose slots have gaps (its earlier siblings' slots);
    the decode step of the same token attends to the same keys in contiguous slots. The attended keys are
    numbered by rank, not slot, so the two give the same bits (it differed before: the last bits of the softmax
    sums, which the next layer's 8-bit activations turned into logits 0.25 apart on the real pair)."""
    g = torch.Generator().manual_seed(3)
    H, Hkv, D, S, cached = 4, 2, 32, 64, 37
    for gap in (1, 3, 16):
        keys, values = (torch.randn(1, S, Hkv, D, generator=g) for _ in range(2))
        q = torch.randn(1, 1, H * D, generator=g)
        k, v = (torch.randn(1, 1, Hkv * D, generator=g) for _ in range(2))
        angle = torch.rand(1, 1, D, generator=g) * 6
        outs = []
        for slot in (cached, cached + gap):            # contiguous (decode) and after `gap` sibling slots (tree)
            mask = torch.zeros(1, 1, S, dtype=torch.bool)
            mask[0, 0, :cached] = True
            mask[0, 0, slot] = True
            kc, vc = keys.clone(), values.clone()
            outs.append(torch.ops.specdec.cache_attention(q, k, v, angle.cos(), angle.sin(), kc, vc,
                                                          torch.tensor([0]), torch.tensor([[slot]]), mask))
        assert torch.equal(*outs), gap


def test_cache_attention_rejects_bad_inputs():
    q, k, v, cos, sin, kc, vc, rows, slots, mask = attention_case()
    with pytest.raises(RuntimeError, match="slot 99 is outside"):
        torch.ops.specdec.cache_attention(q, k, v, cos, sin, kc, vc, rows, torch.full_like(slots, 99), mask)
    with pytest.raises(RuntimeError, match="row 7 is outside"):
        torch.ops.specdec.cache_attention(q, k, v, cos, sin, kc, vc, torch.full_like(rows, 7), slots, mask)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        torch.ops.specdec.cache_attention(q, k, v, cos, sin, kc, vc, rows, slots, mask.float())
    with pytest.raises(RuntimeError, match="head dim must be a multiple of 16"):
        odd = torch.zeros(*kc.shape[:3], 24)
        torch.ops.specdec.cache_attention(q[..., :144], k[..., :48], v[..., :48], cos[..., :24], sin[..., :24],
                                          odd, odd.clone(), rows, slots, mask)


def five_calls(layer, x, cos, sin, slots, mask):
    """``block_layer``'s module docstring, call by call from Python."""
    attn, mlp = layer.self_attn, layer.mlp
    b, n, hidden = x.shape
    flat = x.reshape(b * n, hidden)
    norm = layer.input_layernorm
    parts = [attn.qkv_proj] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
    qkv = torch.cat([p.fused(flat, norm=norm.weight, eps=norm.eps) for p in parts], -1)
    q, k, v = (t.reshape(b, n, -1) for t in qkv.split(attn.qkv_sizes, -1))
    out = torch.ops.specdec.cache_attention(q, k, v, cos, sin, attn.k_cache, attn.v_cache, torch.arange(b), slots,
                                            mask[:, 0])
    flat = attn.o_proj.fused(out.reshape(b * n, -1), residual=flat)
    norm = layer.post_attention_layernorm
    parts = [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
    gate_up = torch.cat([p.fused(flat, norm=norm.weight, eps=norm.eps) for p in parts], -1)
    return mlp.down_proj.fused(gate_up, gated=True, residual=flat).view(b, n, hidden)


def test_one_layer_call_is_the_five_kernel_calls(tiny):
    """``block_layer`` (C++) gives the bits of its five kernels called one by one, output and KV cache, on both
    tiny layers (one with separate q / k / v and gate / up, one fused)."""
    from specdec.core.model import new_token_slots, rope_tables

    model = load(tiny, quantization="gguf")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 3, 64, generator=g)
    lengths = torch.tensor([6])
    cos, sin = rope_tables(lengths.view(1, 1) + torch.arange(3), model.lm.inv_freq, model.lm.rope_scaling, x.dtype)
    slots, mask = new_token_slots(lengths, torch.ones(3, 3, dtype=torch.bool).tril().unsqueeze(0), 32)
    for layer in model.lm.model.layers:
        attn = layer.self_attn
        for cache in attn.cache_buffers():
            cache.copy_(torch.randn(cache.shape, generator=g))
        before = [t.clone() for t in attn.cache_buffers()]
        one = run_block_layer(layer, x, cos, sin, slots, mask, 32)
        after = [t.clone() for t in attn.cache_buffers()]
        for cache, saved in zip(attn.cache_buffers(), before):
            cache.copy_(saved)
        assert torch.equal(one, five_calls(layer, x, cos, sin, slots, mask))
        assert all(torch.equal(a, b) for a, b in zip(after, attn.cache_buffers()))


@pytest.mark.parametrize("backend", ["eager", "regional", "compiled"])
def test_a_gguf_model_runs_its_layers_as_kernel_calls(tiny, backend):
    """Every layer of the tiny GGUF model runs as ``run_block_layer`` and gives the unfused layers' logits
    (up to the f32 summation order of the norm, SiLU and softmax) on a prefill and a 4-token verify."""
    target = tiny
    fused = load(target, quantization="gguf", backend=backend)
    assert block_layers_apply(fused.lm) and len(fused.lm.layer_runners) == 2
    for layer, runner in zip(fused.lm.model.layers, fused.lm.layer_runners):   # each with its own layer's weights
        assert runner.func is run_block_layer and runner.keywords["args"].weights[-1] is \
            layer.post_attention_layernorm.weight
    plain = load(target, quantization="gguf", backend="eager")
    plain.lm.layer_runners = plain.lm.stack_runner = None     # the layers' own forward: RMSNorm, SDPA, ...
    params = fused.sampling_params(do_sample=False)
    prompt = torch.tensor(prompt_ids(11, 4, VOCAB))
    outs = [m.prefill([prompt], params).logits[0, -1] for m in (fused, plain)]
    assert torch.allclose(*outs, atol=2e-3 * float(outs[1].abs().max()))
    tokens = torch.tensor([prompt_ids(4, 5, VOCAB)])
    outs = [m.step(tokens, params).logits[0] for m in (fused, plain)]
    assert torch.allclose(*outs, atol=2e-3 * float(outs[1].abs().max()))


def test_the_layer_stack_gives_the_per_layer_calls_bits(tiny):
    """``BlockStack`` (all layers in one ``block_layers`` call) replaces the per-layer loop of a block-layer model:
    a prefill and a 4-token verify give the same logits and KV caches, bit for bit, as ``run_block_layer`` layer by
    layer; a forward that returns feature layers (EAGLE-3 targets) keeps the loop; bad lists fail clearly."""
    stacked, looped = (load(tiny, quantization="gguf", backend="eager") for _ in range(2))
    assert isinstance(stacked.lm.stack_runner, BlockStack)
    looped.lm.stack_runner = None
    params = stacked.sampling_params(do_sample=False)
    prompt, tokens = torch.tensor(prompt_ids(11, 4, VOCAB)), torch.tensor([prompt_ids(4, 5, VOCAB)])
    outs = [(m.prefill([prompt], params).logits, m.step(tokens, params).logits) for m in (stacked, looped)]
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    for a, b in zip(stacked.lm.model.layers, looped.lm.model.layers):
        assert torch.equal(a.self_attn.k_cache, b.self_attn.k_cache) and torch.equal(a.self_attn.v_cache,
                                                                                      b.self_attn.v_cache)
    featured = load(tiny, quantization="gguf", backend="eager", feature_layers=(1,))

    def unused(*args):
        raise AssertionError("a forward returning feature layers ran the stack")
    featured.lm.stack_runner = unused
    assert torch.equal(featured.prefill([prompt], params).logits, outs[0][0])
    stack = stacked.lm.stack_runner
    x = torch.zeros(1, 1, stacked.config.hidden_size)
    with pytest.raises(RuntimeError, match="block_layers: "):
        torch.ops.specdec.block_layers(x, x, x, [], [stacked.lm.model.layers[0].self_attn.v_cache], x, x, x,
                                       stack.weights, stack.layout, stack.eps)


def test_padding_tokens_are_skipped_and_change_no_real_bit(tiny):
    """Tokens marked padding (``model.causal_mask`` of row lengths: a diagonal entry cleared) are not computed
    by the layer kernels: a verify's padded positions and a prompt's bucket padding come out as zero hidden states
    and zero cache slots, while every real token's logits and cache slots keep the bits of the same call without
    padding; the layers' own forward (no kernels) gives the real tokens the same values up to f32 rounding."""
    from specdec.core.model import causal_mask

    skipping, full, plain = (load(tiny, quantization="gguf", backend="eager", batch_size=2) for _ in range(3))
    looped = load(tiny, quantization="gguf", backend="eager", batch_size=2)
    looped.lm.stack_runner = None                                     # the per-layer block_layer calls
    plain.lm.layer_runners = plain.lm.stack_runner = None             # RMSNorm, SDPA, ...
    params = skipping.sampling_params(do_sample=False)
    prompts = [torch.tensor(prompt_ids(11, 4, VOCAB)), torch.tensor(prompt_ids(7, 9, VOCAB))]
    models = (skipping, full, looped, plain)
    pre = [m.prefill(prompts, params) for m in models]
    assert pre[0].hidden.shape[1] == 16                               # both prompts padded to the 16 bucket
    assert not pre[0].hidden[0, 11:].any() and not pre[0].hidden[1, 7:].any() and pre[0].hidden[1, :7].any(-1).all()
    assert torch.equal(pre[0].logits, pre[1].logits) and torch.equal(pre[0].logits, pre[2].logits)
    tokens = torch.tensor([prompt_ids(5, 5, VOCAB), prompt_ids(5, 6, VOCAB)])
    causal, padded = causal_mask(5), causal_mask(5, torch.tensor([3, 5]))
    real = torch.tensor([[True] * 3 + [False] * 2, [True] * 5])
    assert torch.equal(padded.diagonal(dim1=1, dim2=2), real) and torch.equal(causal, torch.ones(5, 5).tril().bool())
    assert torch.equal(padded | torch.eye(5, dtype=torch.bool), causal.expand(2, 5, 5))   # only diagonals differ
    masks = (padded, causal, padded, padded)
    outs = [m.step(tokens, params, token_mask=mask, advance=False) for m, mask in zip(models, masks)]
    assert not outs[0].hidden[0, 3:].any() and outs[0].hidden[0, :3].any(-1).all()
    for out in outs[1:3]:
        assert torch.equal(outs[0].logits[0, :3], out.logits[0, :3]) and torch.equal(outs[0].logits[1], out.logits[1])
    assert torch.allclose(outs[0].logits[real], outs[3].logits[real], atol=2e-3 * float(outs[3].logits.abs().max()))
    for a, b in zip(skipping.lm.model.layers, full.lm.model.layers):
        for mine, theirs in ((a.self_attn.k_cache, b.self_attn.k_cache), (a.self_attn.v_cache, b.self_attn.v_cache)):
            assert torch.equal(mine[0, :14], theirs[0, :14]) and torch.equal(mine[1, :12], theirs[1, :12])
            assert not mine[0, 14:16].any() and theirs[0, 14:16].any()


def test_rows_that_are_not_active_are_not_computed(tiny):
    """A decode step computes the active rows only (``engine.decode_step``: the others' tokens are padding), a
    speculation step verifies none of their drafts (``speculative.narrowed``), and the active rows keep their
    bits."""
    from specdec.core.engine import decode_step
    from specdec.speculation.proposer import Proposal
    from specdec.speculation.speculative import narrowed

    model = load(tiny, quantization="gguf", backend="eager", batch_size=3)
    params = model.sampling_params(do_sample=False)
    model.prefill([torch.tensor(prompt_ids(9, s, VOCAB)) for s in (1, 2, 3)], params)
    tail = torch.tensor([[1, 5], [1, 6], [1, 7]])
    everyone = decode_step(model, tail, params, None, torch.tensor([True, True, True]))
    some = decode_step(model, tail, params, None, torch.tensor([True, False, True]))
    assert not some.hidden[1].any() and everyone.hidden[1].any(-1).all()
    assert torch.equal(some.logits[[0, 2]], everyone.logits[[0, 2]])
    chain = Proposal(torch.zeros(3, 4, dtype=torch.long), num_drafts=torch.tensor([2, 4, 1]))
    proposal, k = narrowed(chain, 4, None, torch.tensor([True, False, True]))
    assert k == 2 and proposal.num_drafts.tolist() == [2, 0, 1] and proposal.tokens.shape == (3, 2)
    proposal, k = narrowed(Proposal(chain.tokens), 4, None, torch.tensor([False, True, True]), sampled=True)
    assert k == 4 and proposal.num_drafts.tolist() == [0, 4, 4] and proposal.draw_width is None
    # sampling: cut to the longest active row but never below one draft, drawing the noise of 4
    proposal, k = narrowed(chain, 4, None, torch.tensor([True, False, True]), sampled=True)
    assert k == 2 and proposal.draw_width == 4 and proposal.num_drafts.tolist() == [2, 0, 1]
    proposal, k = narrowed(replace(chain, num_drafts=torch.tensor([0, 4, 0])), 4, None,
                           torch.tensor([True, False, True]), sampled=True)
    assert k == 1 and proposal.draw_width == 4 and proposal.num_drafts.tolist() == [0, 0, 0]
    proposal, k = narrowed(chain, 4, None, torch.tensor([True, False, True]), sampled=True, split_draws=False)
    assert k == 4 and proposal.draw_width is None       # streams that cannot split their draws keep k


def test_suffix_trees_padding_is_skipped_and_greedy_output_is_target_only(tiny):
    """A suffix tree's unused slots are padding (``tree.row_trees``): the layer kernels skip them (their zero
    logits would be garbage), no rule accepts them, and greedy speculation stays target-only's, cold and with
    the cache holding the first outputs."""
    from specdec import SpeculativeGenerator
    from specdec.suffix import SuffixCache, SuffixDraft

    target = load(tiny, quantization="gguf", backend="eager", batch_size=2)
    prompts = [prompt_ids(5, 1, VOCAB) * 3, prompt_ids(9, 2, VOCAB)]
    reference = target.generate(prompts, max_new_tokens=24, eos_token_id=[])
    gen = SpeculativeGenerator(SuffixDraft(target, SuffixCache(), depth=4, num_nodes=6), target)
    for _ in range(2):
        assert torch.equal(gen.generate(prompts, max_new_tokens=24, eos_token_id=[]), reference)
    assert gen.last_stats.mean_acceptance_length > 1.5


def test_uncompiled_block_layer_models_default_to_fine_context_buckets(tiny):
    """Layers run as block kernels on eager / regional compile nothing per prompt bucket, so those models
    default to ``fine_buckets`` (a 20-token prompt runs in the 32-row graph, not the 128-row one); the
    kernels are row-invariant, so the bucket changes no logit bit. Compiled graphs, float layers and a
    given list keep their buckets."""
    prompt = torch.tensor(prompt_ids(20, 6, VOCAB))
    logits = {}
    for backend, quantization, buckets, expected in (
            ("regional", "gguf", None, fine_buckets(256)), ("eager", "gguf", None, fine_buckets(256)),
            ("eager", "gguf", [128, 256], [128, 256]), ("compiled", "gguf", None, default_buckets(256)),
            ("eager", None, None, default_buckets(256))):
        model = load(tiny, quantization=quantization, backend=backend, n_positions=256, context_buckets=buckets)
        assert model.context_buckets == expected, (backend, quantization, buckets)
        assert runs_block_layers(model.lm) == (quantization == "gguf")
        if quantization and backend != "compiled":
            logits[tuple(expected)] = model.prefill([prompt], model.sampling_params(do_sample=False)).logits[0, -1]
    assert torch.equal(*logits.values())       # bucket 32 and bucket 128: the same bits


def test_bf16_and_sharded_models_keep_the_layers_forward(tiny):
    target = tiny
    model = load(target, quantization="gguf", amp="bf16", backend="regional")
    assert not block_layers_apply(model.lm) and model.lm.layer_runners is None
    compile_layers(model.lm)
    assert not isinstance(model.lm.layer_runners[0], partial)


def test_prompt_weights_encode_prompts_in_bf16_and_leave_steps_alone(tiny):
    """``prompt_weights="bf16"``: each decoder layer's blocks also as a dense bf16 matrix (GGML's dequantization,
    rounded), which a prompt's encoding multiplies with — its logits are the float model's up to bf16 rounding,
    and not the 8-bit kernel path's bits — while steps keep the blocks (the same bits as without it), so greedy
    speculation still gives target-only's output."""
    from specdec import SpeculativeGenerator
    from specdec.lookup import PromptLookup

    kernel = load(tiny, quantization="gguf")
    dense = load(tiny, quantization="gguf", prompt_weights="bf16", batch_size=2)
    floats = load(tiny)                                       # the GGUF's weights dequantized to f32
    blocks = [m for m in dense.lm.model.layers.modules() if isinstance(m, BlockLinear)]
    assert len(blocks) == sum(isinstance(m, BlockLinear) for m in kernel.lm.model.layers.modules()) > 0
    assert dense.lm.lm_head.prompt_weight is None             # a prompt's logits: one position
    for m in blocks:
        assert m.prompt_weight.is_mkldnn == packs_prompt_weights()
        weight = m.prompt_weight.to_dense() if m.prompt_weight.is_mkldnn else m.prompt_weight
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, m.dequantized().bfloat16())
    params = kernel.sampling_params(do_sample=False)
    prompt = torch.tensor(prompt_ids(14, 8, VOCAB))
    logits = {name: m.prefill([prompt], m.sampling_params(do_sample=False)).logits[0, -1]
              for name, m in (("kernel", kernel), ("dense", dense), ("floats", floats))}
    error = {name: float((logits[name] - logits["floats"]).abs().max()) for name in ("kernel", "dense")}
    assert error["dense"] <= 1.5 * error["kernel"]           # bf16 activations: no further from f32 than 8-bit ones
    assert not torch.equal(logits["dense"], logits["kernel"])        # the prompt did not run the kernels
    tokens = torch.tensor([prompt_ids(5, 9, VOCAB)])
    steps = []
    for m in (kernel, dense):                                 # a 5-token step on an empty cache: the blocks' bits
        m.reset()
        steps.append(m.step(tokens.expand(m.batch_size, 5), params[:1].expand(m.batch_size, 4)).logits[0])
    assert torch.equal(*steps)
    prompts = [prompt_ids(6, 1, VOCAB) * 3, prompt_ids(9, 2, VOCAB)]
    reference = dense.generate(prompts, max_new_tokens=20, eos_token_id=[])
    gen = SpeculativeGenerator(PromptLookup(dense), dense, 4)
    assert torch.equal(gen.generate(prompts, max_new_tokens=20, eos_token_id=[]), reference)


@pytest.mark.parametrize("rows", [1, 5, 96, 300])
def test_a_prepacked_prompt_weight_multiplies_to_the_plain_matmuls_bits(rows):
    """``pack_prompt_weight`` (oneDNN's blocked layout where PyTorch has it) changes how the GEMM reads the
    weight, not its products: the plain bf16 matmul's bits, at a decode's and a prompt's numbers of rows, for a
    [b, n, K] input too."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    packed = pack_prompt_weight(weight)
    assert torch.equal(prompt_matmul(x, packed), x @ weight.T)
    assert torch.equal(prompt_matmul(x.view(1, rows, 96), packed), (x @ weight.T).view(1, rows, 200))


def test_prompt_weights_are_refused_where_they_do_not_apply(tiny):
    for kw, words in (({"quantization": None}, "quantization=None"), ({"backend": "compiled"}, "backend='compiled'"),
                      ({"prompt_weights": "f16"}, "must be None or 'bf16'")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            load(tiny, **{"quantization": "gguf", "prompt_weights": "bf16", **kw})
