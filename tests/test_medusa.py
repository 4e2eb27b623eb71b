"""Medusa speculation end to end on tiny models: greedy exactness over several trees (batch 1 and 3,
mixed prompt lengths, EOS inside accepted paths), KV compaction, lossless sampling on trees
(chi-square; float, and int8 / int4 targets with heads quantized as the target), the lossy typical
rule, and errors at the API boundary."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import DecoderModel, SpeculativeGenerator, shipped
from specdec.medusa import MedusaHeads, load_tree, save_heads
from specdec.medusa.draft import MedusaDraft
from specdec.speculation.tree import TokenTree

from test_quantization import dequantized_hf
from test_speculative import lossless_pvalue

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
TREES = ["chain_4", "small_8", "mc_sim_7b_63"]


def token_map_target(seed: int, vocab: int, hidden: int) -> LlamaForCausalLM:
    """One layer whose attention output is zero: the final hidden state, hence the next token, is a
    function of the current token only (g: token -> next token), whatever the context."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=None, pad_token_id=None, initializer_range=0.3, tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.model.layers[0].self_attn.o_proj.weight.mul_(0.0)
    return hf


def oracle_heads(hf: LlamaForCausalLM, num_heads: int, noise: float, seed: int) -> MedusaHeads:
    """Heads whose logits are 3 * one-hot(g^(h+2)(token)) + noise * N(0, 1): the right continuation,
    at rank 0 without noise and at varying ranks with it. Solved exactly (hidden >= vocab size: the
    tokens' final hidden states [V, H] have full row rank; least squares = the exact solution);
    ResBlocks stay the identity."""
    V, H = hf.config.vocab_size, hf.config.hidden_size
    with torch.no_grad():
        out = hf(torch.arange(V).view(V, 1), output_hidden_states=True)
    hidden = out.hidden_states[-1][:, 0].double()                         # [V, H] final-norm states
    nxt = out.logits[:, 0].argmax(-1)                                      # g
    g = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(H, V, num_heads)
    token = nxt.clone()
    for h in range(num_heads):
        token = nxt[token]                                                 # g^(h+2)
        want = 3.0 * torch.nn.functional.one_hot(token, V).double() + noise * torch.randn(V, V, generator=g).double()
        with torch.no_grad():
            heads.heads[h][-1].weight.copy_(torch.linalg.lstsq(hidden, want).solution.T.float())
    return heads


def load_target(path, **kw) -> DecoderModel:
    kw = {"batch_size": 3, "n_positions": 160, "kv_buckets": [64, 160], "context_buckets": [16, 32],
          "backend": "eager", "progress": False, **kw}
    return DecoderModel.from_pretrained(path, **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    hf = token_map_target(0, 64, 64)
    hf.save_pretrained(root / "target")
    return hf, root


def draft_for(target, heads, tree, **kw) -> MedusaDraft:
    return MedusaDraft(heads, load_tree(tree, num_heads=heads.num_heads) if isinstance(tree, str) else tree,
                       target, **kw)


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("noise", [0.0, 2.5])
def test_greedy_equals_target_only(models, tree, noise):
    hf, root = models
    target = load_target(root / "target")
    gen = SpeculativeGenerator(draft_for(target, oracle_heads(hf, 4, noise, seed=2), tree), target)
    reference = target.generate(PROMPTS, max_new_tokens=60, eos_token_id=[])
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    stats = gen.last_stats
    if noise == 0.0:
        assert stats.acceptance_rate > 0.9            # perfect heads: (almost) the whole depth is accepted
    one = gen.sample([PROMPTS[2]], max_new_tokens=60, eos_token_id=[])
    width = max(map(len, PROMPTS))
    assert torch.equal(one[0, len(PROMPTS[2]):], reference[2, width:])


def test_random_heads_greedy_equals_target_only(models):
    hf, root = models
    target = load_target(root / "target")
    torch.manual_seed(3)
    heads = MedusaHeads(64, 64, 4)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    gen = SpeculativeGenerator(draft_for(target, heads, "mc_sim_7b_63"), target)
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=40, eos_token_id=[]), reference)


def test_branches_beyond_rank_zero_are_accepted(models):
    """With noisy heads the right token is often at rank > 0: the 63-node tree (up to top-10 per
    depth) must then accept more than the rank-0 chain does."""
    hf, root = models
    target = load_target(root / "target")
    heads = oracle_heads(hf, 4, 2.5, seed=2)
    rates = {}
    for tree in ("chain_4", "mc_sim_7b_63"):
        gen = SpeculativeGenerator(draft_for(target, heads, tree), target)
        gen.sample(PROMPTS, max_new_tokens=60, eos_token_id=[])
        rates[tree] = gen.last_stats.mean_acceptance_length
    assert rates["mc_sim_7b_63"] > rates["chain_4"] + 0.3, rates


@pytest.mark.parametrize("tree", ["chain_4", "mc_sim_7b_63"])
def test_eos_inside_accepted_path(models, tree):
    hf, root = models
    target = load_target(root / "target")
    gen = SpeculativeGenerator(draft_for(target, oracle_heads(hf, 4, 0.0, seed=1), tree), target)
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    width = max(map(len, PROMPTS))
    eos = reference[0, width + 6].item()
    ref_eos = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=40, eos_token_id=eos), ref_eos)
    assert gen.last_stats.acceptance_rate > 0.9   # the EOS was an accepted draft, not a correction


def test_kv_compaction_matches_target_only(models):
    """After Medusa decoding, every committed cache slot holds what a target-only run wrote there.
    (One prompt per call: a finished row's slots are scratch while other rows go on.)"""
    hf, root = models
    n_new = 50
    target = load_target(root / "target")
    target.generate(PROMPTS, max_new_tokens=n_new, eos_token_id=[])
    spec_target = load_target(root / "target")
    gen = SpeculativeGenerator(draft_for(spec_target, oracle_heads(hf, 4, 2.5, seed=2), "mc_sim_7b_63"), spec_target)
    for b, p in enumerate(PROMPTS):
        gen.sample([p], max_new_tokens=n_new, eos_token_id=[])
        assert gen.last_stats.mean_acceptance_length > 1.5   # paths other than the first nodes were moved
        used = len(p) + n_new - 1
        for ref, spec in zip(target.lm.model.layers, spec_target.lm.model.layers):
            assert torch.allclose(spec.self_attn.k_cache[0, :used], ref.self_attn.k_cache[b, :used], atol=1e-5)
            assert torch.allclose(spec.self_attn.v_cache[0, :used], ref.self_attn.v_cache[b, :used], atol=1e-5)


def test_near_n_positions_falls_back_to_plain_steps(models):
    hf, root = models
    target = load_target(root / "target", n_positions=96, kv_buckets=[96])
    gen = SpeculativeGenerator(draft_for(target, oracle_heads(hf, 4, 0.0, seed=1), "mc_sim_7b_63"), target)
    reference = target.generate(PROMPTS, eos_token_id=[], sequence_length=96)
    assert torch.equal(gen.sample(PROMPTS, eos_token_id=[], sequence_length=96), reference)


# ---------------------------------------------------------------- sampling
VOCAB = 16
SMALL_TREE = TokenTree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0]], num_heads=2)


LOSSLESS_HIDDEN = {None: VOCAB, "int8": VOCAB, "int4": 32}   # int4's kernel: in features divisible by 32


@pytest.fixture(scope="module", params=[None, "int8", "int4"])
def lossless(request, tmp_path_factory):
    """(reference, target at batch 512, heads, float target): the target quantized with the parameter
    (None: float), the reference the transformers model holding the values it computes with, and
    oracle heads for it saved in the FasterDecoding layout and loaded by ``MedusaDraft.from_pretrained``
    (quantized as the target)."""
    scheme, hidden = request.param, LOSSLESS_HIDDEN[request.param]
    root = tmp_path_factory.mktemp("medusa-lossless")
    hf = token_map_target(3, VOCAB, hidden)
    with torch.no_grad():   # attention matters again: the heads are only approximately right
        hf.model.layers[0].self_attn.o_proj.weight.copy_(0.15 * torch.randn(hidden, hidden))
    hf.save_pretrained(root / "target")
    kw = dict(batch_size=512, n_positions=32, context_buckets=[8], kv_buckets=[32], backend="eager", progress=False)
    target = DecoderModel.from_pretrained(root / "target", quantization=scheme, **kw)
    reference = hf if scheme is None else dequantized_hf(hf, scheme)
    save_heads(oracle_heads(reference, 2, 0.5, seed=2), root / "heads")
    heads = MedusaDraft.from_pretrained(root / "heads", target, tree=SMALL_TREE).heads
    assert heads.quantized == (scheme is not None)
    return reference, target, heads, hf


@pytest.mark.parametrize("sample_kwargs", [dict(temperature=0.7), dict(temperature=1.3, top_k=6, top_p=0.9)])
def test_sampling_is_lossless(lossless, sample_kwargs):
    reference, target, heads, hf = lossless
    gen = SpeculativeGenerator(MedusaDraft(heads, SMALL_TREE, target), target)
    pvalue = lossless_pvalue(reference, target, gen, sample_kwargs, 3)   # 20,480 samples of 3 tokens
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert gen.stats.per_position_acceptance[1] > 0.01       # depth-2 nodes get accepted too
    assert pvalue > 1e-3
    if target.settings.quantization == "int4" and "top_k" not in sample_kwargs:
        # the test tells the quantized target from the float one (int4's rounding shows; int8's, on this
        # 16-wide model, is below the resolution of 20,480 samples)
        assert lossless_pvalue(hf, target, gen, sample_kwargs, 3) < 1e-3


def test_typical_acceptance_is_not_lossless(lossless):
    """The typical rule accepts any plausible candidate outright: at a high temperature its output
    distribution is measurably not the target's (why it is offered only as an explicit lossy option)."""
    reference, target, heads, _ = lossless
    gen = SpeculativeGenerator(MedusaDraft(heads, SMALL_TREE, target, acceptance="typical"), target)
    assert lossless_pvalue(reference, target, gen, dict(temperature=1.5), 3, calls=10) < 1e-6


# ---------------------------------------------------------------- loading and errors
def test_tied_heads_round_trip_through_from_pretrained(models, tmp_path):
    hf, root = models
    target = load_target(root / "target")
    token_ids = torch.arange(0, 64, 2)
    lm_head = hf.lm_head.weight.detach()
    heads = MedusaHeads(64, 32, 4, 1, lm_head[token_ids], tied=True, token_ids=token_ids)
    torch.manual_seed(0)
    for block in heads.heads:
        torch.nn.init.normal_(block[0].linear.weight, std=0.1)
    save_heads(heads, tmp_path / "heads")
    draft = MedusaDraft.from_pretrained(tmp_path / "heads", target, tree="small_8")
    x = torch.randn(3, 64)
    assert torch.equal(draft.heads.candidates(x, 5), heads.candidates(x, 5))
    assert bool((draft.heads.candidates(x, 5) % 2 == 0).all())      # only the reduced vocabulary
    reference = target.generate(PROMPTS, max_new_tokens=30, eos_token_id=[])
    assert torch.equal(SpeculativeGenerator(draft, target).sample(PROMPTS, max_new_tokens=30, eos_token_id=[]),
                       reference)


def test_errors(models):
    hf, root = models
    target = load_target(root / "target", n_positions=48, kv_buckets=[16, 48])
    heads = oracle_heads(hf, 4, 0.0, seed=1)
    with pytest.raises(ValueError, match="acceptance='exact' is not supported"):
        draft_for(target, heads, "chain_4", acceptance="exact")
    with pytest.raises(ValueError, match="tree depth 4 exceeds the 2 Medusa heads"):
        MedusaDraft(MedusaHeads(64, 64, 2), load_tree("chain_4"), target)
    with pytest.raises(ValueError, match="hidden size 32 but the target 64"):
        MedusaDraft(MedusaHeads(32, 64, 4), load_tree("chain_4"), target)
    small = load_target(root / "target", n_positions=48, kv_buckets=[32])
    with pytest.raises(ValueError, match="needs 64 verify slots .* allows 32"):
        draft_for(small, heads, "mc_sim_7b_63")
    draft = draft_for(target, heads, "chain_4")
    with pytest.raises(ValueError, match="k=2 but a Medusa step drafts the tree's depth 4"):
        SpeculativeGenerator(draft, target, 2)
    with pytest.raises(ValueError, match="loaded for another target"):
        SpeculativeGenerator(draft, load_target(root / "target"))
    with pytest.raises(ValueError, match="k .* is required"):
        SpeculativeGenerator(load_target(root / "target"), target)
    # a failed request leaves the generator usable
    gen = SpeculativeGenerator(draft, target)
    with pytest.raises(ValueError):
        gen.sample([[1, 2, 99]], max_new_tokens=5)
    reference = target.generate(PROMPTS, max_new_tokens=10, eos_token_id=[])
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=10, eos_token_id=[]), reference)


# ---------------------------------------------------------------- the shipped heads
@pytest.mark.slow
def test_shipped_smollm2_medusa_is_exact():
    pytest.importorskip("gguf")
    from specdec.core.chat import chat_ids
    from specdec.core.paths import embedded_gguf_path
    from specdec.medusa.smollm2 import shipped_medusa_dir
    try:
        embedded_gguf_path()
    except FileNotFoundError:
        pytest.skip("embedded model not installed")
    size = sum(f.stat().st_size for f in shipped_medusa_dir().iterdir())
    assert size <= 15 * 2**20, size
    # f32: bf16 near-ties flip between the decode and verify graphs (rounding, not speculation)
    target = DecoderModel.from_pretrained(None, batch_size=3, n_positions=256, amp="f32", backend="eager",
                                          progress=False)
    tok = target.tokenizer
    questions = ["Give me three tips for learning to cook.", "What is 17 times 23?", "Write a haiku about the sea."]
    prompts = [chat_ids(tok, q) for q in questions]
    reference = target.generate(prompts, max_new_tokens=48)
    for tree in ("chain_4", "mc_sim_7b_63", None):          # None: the tree shipped with the heads
        gen = SpeculativeGenerator(shipped("medusa", target, tree=tree), target)
        assert torch.equal(gen.sample(prompts, max_new_tokens=48), reference)
        assert gen.last_stats.mean_acceptance_length > 1.2, (tree, gen.last_stats)
    assert torch.equal(gen.sample([prompts[0]], max_new_tokens=48), target.generate([prompts[0]], max_new_tokens=48))
