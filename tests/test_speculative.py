"""SpeculativeGenerator with a vanilla draft model: exactness (greedy), losslessness (sampling),
KV bookkeeping, statistics and validation — on tiny random models saved as real checkpoints."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import specdec.speculation.verify as verify_module
from specdec import DecoderModel, DraftModel, SpeculativeGenerator
from specdec.core.sampling import full_probs, warp

from conftest import save_reduced_vocab

VOCAB = 16


def save_tiny(tmp_path_factory, name, layers, seed, vocab=64):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=None, pad_token_id=0, initializer_range=0.3)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target_hf, target_dir = save_tiny(tmp_path_factory, "target", 2, 0)
    _, draft_dir = save_tiny(tmp_path_factory, "draft", 1, 1)

    def load(d, **kw):
        return DecoderModel.from_pretrained(d, backend="eager", progress=False, **kw)

    return dict(target_hf=target_hf, target_dir=target_dir, draft_dir=draft_dir, load=load)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equals_target_only(tiny, k):
    # kv buckets of 32/64/128 make the run cross bucket boundaries mid-generation
    target = tiny["load"](tiny["target_dir"], batch_size=3, n_positions=128, kv_buckets=[32, 64, 128])
    draft = tiny["load"](tiny["draft_dir"], batch_size=3, n_positions=128)
    reference = target.generate(PROMPTS, max_new_tokens=70, eos_token_id=[])
    hf = tiny["target_hf"].generate(torch.tensor([PROMPTS[0]]), max_new_tokens=70, do_sample=False)
    width = max(map(len, PROMPTS))  # list-of-lists prompts are right-padded in the output
    assert torch.equal(reference[0, width:], hf[0, len(PROMPTS[0]):])
    gen = SpeculativeGenerator(draft, target, k)
    out = gen.sample(PROMPTS, max_new_tokens=70, eos_token_id=[])
    assert torch.equal(out, reference)
    one = SpeculativeGenerator(draft, target, k).sample([PROMPTS[1]], max_new_tokens=70, eos_token_id=[])
    assert torch.equal(one[0, len(PROMPTS[1]):], reference[1, width:])


def test_greedy_with_good_draft_and_eos_inside_accepted_run(tiny):
    """Target as its own draft: every draft is accepted, so EOS lands inside accepted runs."""
    target = tiny["load"](tiny["target_dir"], batch_size=3, n_positions=128)
    draft = tiny["load"](tiny["target_dir"], batch_size=3, n_positions=128)
    free = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    eos = int(free[0, len(PROMPTS[2]) + 6])  # a token row 0 emits mid-way
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=eos)
    gen = SpeculativeGenerator(draft, target, 4)
    out = gen.sample(PROMPTS, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out, reference)
    assert gen.last_stats.acceptance_rate == 1.0
    assert (reference[0] == eos).any()


def test_stops_cleanly_at_n_positions(tiny):
    target = tiny["load"](tiny["target_dir"], batch_size=3, n_positions=64)
    draft = tiny["load"](tiny["target_dir"], batch_size=3, n_positions=64)
    reference = target.generate(PROMPTS, sequence_length=64, eos_token_id=[])
    out = SpeculativeGenerator(draft, target, 8).sample(PROMPTS, sequence_length=64, eos_token_id=[])
    assert torch.equal(out, reference)
    assert int(target.lengths.max()) <= 64


def test_target_kv_after_rejections_equals_target_only(tiny):
    target = tiny["load"](tiny["target_dir"], batch_size=1, n_positions=128)
    draft = tiny["load"](tiny["draft_dir"], batch_size=1, n_positions=128)
    gen = SpeculativeGenerator(draft, target, 4)
    out = gen.sample([PROMPTS[0]], max_new_tokens=30, eos_token_id=[])
    assert gen.last_stats.drafted > gen.last_stats.accepted > 0 or gen.last_stats.accepted == 0
    n = int(target.lengths[0])
    spec_kv = [(layer.self_attn.k_cache[0, :n].clone(), layer.self_attn.v_cache[0, :n].clone())
               for layer in target.lm.model.layers]
    target.generate([PROMPTS[0]], max_new_tokens=30, eos_token_id=[])
    for (k, v), layer in zip(spec_kv, target.lm.model.layers):
        torch.testing.assert_close(k, layer.self_attn.k_cache[0, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, layer.self_attn.v_cache[0, :n], rtol=1e-5, atol=1e-5)
    assert n == out.shape[1] - 1


def test_statistics_add_up(tiny):
    target = tiny["load"](tiny["target_dir"], batch_size=3, n_positions=128)
    draft = tiny["load"](tiny["draft_dir"], batch_size=3, n_positions=128)
    gen = SpeculativeGenerator(draft, target, 3)
    gen.sample(PROMPTS, max_new_tokens=20, eos_token_id=[])
    s = gen.last_stats
    assert s.accepted <= s.drafted
    assert sum(s.accepted_histogram) == s.steps
    assert s.accepted == sum(i * c for i, c in enumerate(s.accepted_histogram))
    assert s.mean_acceptance_length == pytest.approx(1 + s.accepted / s.steps)
    assert s.accepted_per_position == sorted(s.accepted_per_position, reverse=True)
    # every new token but the first (from context encoding) was emitted by a speculation step
    assert s.emitted == 3 * 20 - 3 and s.emitted <= s.accepted + s.steps
    gen.sample(PROMPTS, max_new_tokens=20, eos_token_id=[])
    assert gen.stats.steps == s.steps + gen.last_stats.steps
    d = gen.stats.to_dict()
    assert d["steps"] == gen.stats.steps and "per_position_acceptance" in d


# ---------------------------------------------------------------- lossless sampling

def exact_joint(hf, prompt, params, n_tokens, repetition_penalty=1.0):
    """Target-only distribution of the first n_tokens sampled tokens, enumerated exactly (with
    transformers' repetition penalty on the logits before warping)."""
    probs = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        seqs = list(probs)
        ids = torch.tensor([prompt + list(s) for s in seqs])
        with torch.no_grad():
            logits = hf(ids).logits[:, -1].float()
        logits = RepetitionPenaltyLogitsProcessor(float(repetition_penalty))(ids, logits).unsqueeze(1)
        p_sorted, idx = warp(logits, params.expand(len(seqs), -1), None)
        p = full_probs(p_sorted, idx, logits.shape[-1])[:, 0]
        for s, row in zip(seqs, p):
            for t in range(row.shape[0]):
                if row[t] > 0:
                    nxt[s + (t,)] = probs[s] * float(row[t])
        probs = nxt
    return probs


def sampled_joint(gen, prompt, batch, n_tokens, calls, sample_kwargs):
    counts = {}
    for c in range(calls):
        out = gen.sample([prompt] * batch, max_new_tokens=n_tokens, eos_token_id=[], do_sample=True,
                         seed=1000 + c, **sample_kwargs)
        for row in out[:, len(prompt):].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts


def lossless_pvalue(hf, target, gen, sample_kwargs, n_tokens, calls=40, prompt=(3, 1, 4)):
    """Chi-square p-value of ``gen``'s first ``n_tokens`` sampled tokens (512 rows x ``calls`` seeded
    calls) against the target-only joint distribution enumerated exactly from ``hf`` (with the
    ``repetition_penalty`` of ``sample_kwargs``, if any)."""
    params = target.sampling_params(sample_kwargs.get("top_k"), sample_kwargs.get("top_p"),
                                    sample_kwargs["temperature"], True)[:1]
    exact = exact_joint(hf, list(prompt), params, n_tokens, sample_kwargs.get("repetition_penalty", 1.0))
    return chi2_pvalue(exact, sampled_joint(gen, list(prompt), 512, n_tokens, calls, sample_kwargs))


def chi2_pvalue(exact, counts):
    total = sum(counts.values())
    keys = sorted(exact, key=lambda s: -exact[s])
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for s in keys:
        e = exact[s] * total
        if e >= 5:
            obs.append(counts.get(s, 0))
            exp.append(e)
        else:
            rest_o += counts.get(s, 0)
            rest_e += e
    unexpected = sum(v for s, v in counts.items() if s not in exact)
    obs.append(rest_o + unexpected)
    exp.append(rest_e)
    obs, exp = np.array(obs, float), np.array(exp, float)
    if exp[-1] < 1e-9:
        assert obs[-1] == 0, "sampled a sequence the target gives probability 0"
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.fixture(scope="module")
def lossless_models(tmp_path_factory):
    target_hf, target_dir = save_tiny(tmp_path_factory, "lt", 2, 3, vocab=VOCAB)
    draft_hf, draft_dir = save_tiny(tmp_path_factory, "ld", 2, 3, vocab=VOCAB)
    with torch.no_grad():  # the draft: the target's weights with a flatter, perturbed LM head
        torch.manual_seed(4)
        head = draft_hf.lm_head.weight
        head.mul_(0.5).add_(0.5 * head.std() * torch.randn_like(head))
    draft_hf.save_pretrained(draft_dir)
    reduced_dir = save_reduced_vocab(draft_dir, tmp_path_factory.mktemp("lr"), torch.arange(0, VOCAB, 2))
    kw = dict(batch_size=512, n_positions=32, context_buckets=[8], kv_buckets=[32], backend="eager", progress=False)
    return (target_hf, DecoderModel.from_pretrained(target_dir, **kw),
            {"full": DecoderModel.from_pretrained(draft_dir, **kw),
             "reduced": DecoderModel.from_pretrained(reduced_dir, **kw)})


@pytest.mark.parametrize("draft_kind,sample_kwargs", [
    ("full", dict(temperature=0.7)),
    ("full", dict(temperature=1.3, top_k=6, top_p=0.9)),
    ("reduced", dict(temperature=0.7)),  # q is 0 outside the draft's vocabulary
])
def test_sampling_is_lossless(lossless_models, draft_kind, sample_kwargs):
    target_hf, target, drafts = lossless_models
    gen = SpeculativeGenerator(drafts[draft_kind], target, 2)
    pvalue = lossless_pvalue(target_hf, target, gen, sample_kwargs, 2)  # 20,480 samples
    assert 0.05 < gen.stats.acceptance_rate < 0.95  # the draft really differs from the target
    assert pvalue > 1e-3


@pytest.mark.parametrize("sample_kwargs", [dict(temperature=0.7), dict(temperature=1.3, top_k=6, top_p=0.9)])
def test_sampling_with_the_drafts_confidence_stop_is_lossless(lossless_models, sample_kwargs):
    """``DraftModel(p_min=P)``: rows stop drafting where the draft doubts (a row's own draws), steps verify the
    longest row's drafts only and draw the noise of k (``narrowed``); the output is still the target's."""
    target_hf, target, drafts = lossless_models
    gen = SpeculativeGenerator(DraftModel(drafts["full"], p_min=0.3), target, 2)
    pvalue = lossless_pvalue(target_hf, target, gen, sample_kwargs, 4)     # 20,480 samples of 4 tokens
    assert 1.1 < gen.stats.drafted / gen.stats.steps < 1.9, gen.stats.drafted   # the stop acts (per row and step)
    assert pvalue > 1e-3


def test_sampling_with_a_windowed_draft_is_lossless(lossless_models, monkeypatch):
    """``DraftModel(window=2)``: the draft reads the 3-token prompt's last 2 tokens only, so its proposals and their
    q differ from the whole-context draft's; the output is still the target's."""
    target_hf, target, drafts = lossless_models
    draft, encoded = drafts["full"], []
    prefill = draft.prefill

    def recorded(prompts, *args, **kwargs):
        encoded.append([p.tolist() for p in prompts])
        return prefill(prompts, *args, **kwargs)
    monkeypatch.setattr(draft, "prefill", recorded)
    gen = SpeculativeGenerator(DraftModel(draft, window=2), target, 2)
    pvalue = lossless_pvalue(target_hf, target, gen, dict(temperature=0.7), 3)     # 20,480 samples of 3 tokens
    assert encoded and all(prompts == [[1, 4]] for prompts in encoded)            # the prompt's last 2 tokens
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert pvalue > 1e-3


def test_wrong_acceptor_is_detected(lossless_models, monkeypatch):
    """The same check with an acceptor that accepts every draft must fail (the test has power)."""
    target_hf, target, drafts = lossless_models
    draft = drafts["full"]
    prompt = [3, 1, 4]
    params = target.sampling_params(None, None, 0.7, True)[:1]
    exact = exact_joint(target_hf, prompt, params, 2)

    def accept_all(drafts, target_probs, draft_probs, **kw):
        n = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long)
        bonus = target_probs[:, -1].argmax(-1, keepdim=True)
        return n, torch.cat([drafts, bonus], 1)

    monkeypatch.setattr(verify_module, "accept", accept_all)
    counts = sampled_joint(SpeculativeGenerator(draft, target, 2), prompt, 512, 2, 20, dict(temperature=0.7))
    assert chi2_pvalue(exact, counts) < 1e-6


# ---------------------------------------------------------------- validation

def test_validation_errors(tiny, tmp_path_factory):
    target = tiny["load"](tiny["target_dir"], batch_size=1, n_positions=64)
    draft = tiny["load"](tiny["draft_dir"], batch_size=1, n_positions=64)
    with pytest.raises(ValueError, match="k must be an integer >= 0"):
        SpeculativeGenerator(draft, target, -1)
    with pytest.raises(ValueError, match="too large"):
        SpeculativeGenerator(draft, target, 200)
    with pytest.raises(ValueError, match="batch_size"):
        SpeculativeGenerator(tiny["load"](tiny["draft_dir"], batch_size=2, n_positions=64), target, 2)
    with pytest.raises(ValueError, match="the draft is the target object itself"):
        SpeculativeGenerator(target, target, 2)
    _, other_vocab = save_tiny(tmp_path_factory, "v", 1, 5, vocab=80)
    with pytest.raises(ValueError, match="vocab_size"):
        SpeculativeGenerator(tiny["load"](other_vocab, batch_size=1, n_positions=64), target, 2)
    gen = SpeculativeGenerator(draft, target, 2)
    with pytest.raises(ValueError, match="n_positions"):
        gen.sample([[1, 2, 3]], max_new_tokens=100)
    # a failed request leaves nothing behind: the next one is exact
    assert torch.equal(gen.sample([[1, 2, 3]], max_new_tokens=10, eos_token_id=[]),
                       target.generate([[1, 2, 3]], max_new_tokens=10, eos_token_id=[]))
