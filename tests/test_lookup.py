"""Prompt-lookup drafting: greedy identity with target-only (prompts with and without repeats, batch 1
and 3, mixed lengths, EOS inside accepted runs), chi-square losslessness of sampling, and the n-gram
matching itself."""
import pytest
import torch

from conftest import load, prompt_ids
from test_speculative import chi2_pvalue, exact_joint, lossless_models, lossless_pvalue, sampled_joint  # noqa: F401

import specdec.verify as verify_module
from specdec import PromptLookup, SpeculativeGenerator

REPEATING = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]          # a cycle: lookups find continuations
PROMPTS = [REPEATING, prompt_ids(7, 5), prompt_ids(11, 6) + prompt_ids(11, 6)[:6]]


def test_lookup_finds_the_latest_longest_match():
    lookup = PromptLookup.__new__(PromptLookup)
    lookup.max_ngram, lookup.min_ngram = 3, 1
    assert lookup.lookup([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2) == [8, 1]     # latest occurrence of [1, 2, 3]
    assert lookup.lookup([5, 6, 7, 5, 6], 3) == [7, 5, 6]
    assert lookup.lookup([4, 9, 9, 4], 4) == [9, 9, 4, 9]      # 1-gram match; then continued from S + [9, 9, 4]
    assert lookup.lookup([1, 2, 3], 2) == [3, 3]                              # no match: S[-1]
    # a repeating stretch: 2 tokens follow the latest [8, 24, 8]; the third continues from S + [24, 8]
    assert lookup.lookup([7, 24, 8, 24, 8, 24, 8], 3) == [24, 8, 24]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_target_only(checkpoint, k):
    target = load(checkpoint("llama"), batch_size=3)
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    gen = SpeculativeGenerator(PromptLookup(target), target, k)
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=40, eos_token_id=[]), reference)
    width = max(map(len, PROMPTS))
    single = load(checkpoint("llama"), batch_size=1)
    alone = SpeculativeGenerator(PromptLookup(single), single, k).generate([PROMPTS[2]], max_new_tokens=40,
                                                                           eos_token_id=[])
    assert torch.equal(alone[0, len(PROMPTS[2]):], reference[2, width:])


def test_repeats_get_accepted_and_eos_inside_runs_cuts_like_target_only(checkpoint):
    """A target that loops (greedy on a repeated prompt) is where lookup pays: drafts get accepted,
    and an EOS inside an accepted run stops the row exactly where target-only decoding stops."""
    target = load(checkpoint("llama"), batch_size=3)
    free = target.generate(PROMPTS, max_new_tokens=60, eos_token_id=[])
    gen = SpeculativeGenerator(PromptLookup(target), target, 4)
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=60, eos_token_id=[]), free)
    assert gen.last_stats.accepted > 0
    width = max(map(len, PROMPTS))
    eos = int(free[0, width + 30])                     # a token row 0 emits late, inside its loop
    reference = target.generate(PROMPTS, max_new_tokens=60, eos_token_id=eos)
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=60, eos_token_id=eos), reference)


@pytest.mark.parametrize("sample_kwargs", [dict(temperature=0.7), dict(temperature=1.3, top_k=6, top_p=0.9)])
def test_sampling_is_lossless(lossless_models, sample_kwargs):
    target_hf, target, _ = lossless_models
    gen = SpeculativeGenerator(PromptLookup(target), target, 2)
    pvalue = lossless_pvalue(target_hf, target, gen, sample_kwargs, 2, prompt=(3, 1, 4, 3, 1))  # 20,480 samples
    assert 0.01 < gen.stats.acceptance_rate < 0.99     # proposals are really tested, not all rejected
    assert pvalue > 1e-3


def test_a_wrong_acceptor_is_detected(lossless_models, monkeypatch):
    target_hf, target, _ = lossless_models
    prompt = [3, 1, 4, 3, 1]
    exact = exact_joint(target_hf, prompt, target.sampling_params(None, None, 0.7, True)[:1], 2)

    def accept_all(drafts, target_probs, draft_probs, **kw):
        n = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long)
        return n, torch.cat([drafts, target_probs[:, -1].argmax(-1, keepdim=True)], 1)

    monkeypatch.setattr(verify_module, "accept", accept_all)
    counts = sampled_joint(SpeculativeGenerator(PromptLookup(target), target, 2), prompt, 512, 2, 20,
                           dict(temperature=0.7))
    assert chi2_pvalue(exact, counts) < 1e-6
