"""Prompt-lookup drafting: greedy identity with target-only (prompts with and without repeats, batch 1
and 3, mixed lengths, EOS inside accepted runs), chi-square losslessness of sampling, and the n-gram
matching itself; the same for ``LookupOrDraft`` (lookup where an n-gram matches, a draft model or EAGLE
elsewhere), plus both sources really used and the draft model's cache tracking verified lookup tokens."""
import pytest
import torch

import specdec.speculation.verify as verify_module
from specdec import DraftModel, EagleDraft, LookupOrDraft, PromptLookup, SpeculativeGenerator
from specdec.speculation.combined import MatchOrDraft

from conftest import load, prompt_ids
from test_eagle import load_target, saved_target_and_eagle
from test_speculative import chi2_pvalue, exact_joint, lossless_models, lossless_pvalue, sampled_joint  # noqa: F401

REPEATING = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]          # a cycle: lookups find continuations
PROMPTS = [REPEATING, prompt_ids(7, 5), prompt_ids(11, 6) + prompt_ids(11, 6)[:6]]
# "1 11" is the lossless target's likeliest start after "3 1 4 3 1": lookups that find it get accepted
LOSSLESS_PROMPT = (1, 11, 3, 1, 4, 3, 1)


def test_lookup_finds_the_latest_longest_match():
    lookup = PromptLookup.__new__(PromptLookup)
    lookup.max_ngram, lookup.min_ngram = 3, 1
    assert lookup.lookup([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2) == [8, 1]     # latest occurrence of [1, 2, 3]
    assert lookup.lookup([5, 6, 7, 5, 6], 3) == [7, 5, 6]
    assert lookup.lookup([4, 9, 9, 4], 4) == [9, 9, 4, 9]      # 1-gram match; then continued from S + [9, 9, 4]
    assert lookup.lookup([1, 2, 3], 2) == [3, 3]                              # no match: S[-1]
    # a repeating stretch: 2 tokens follow the latest [8, 24, 8]; the third continues from S + [24, 8]
    assert lookup.lookup([7, 24, 8, 24, 8, 24, 8], 3) == [24, 8, 24]
    assert lookup.match([5, 6, 7, 5, 6], 3) == ([7, 5, 6], 2)                 # with the matched n-gram's length
    assert lookup.match([4, 9, 9, 4], 4) == ([9, 9, 4, 9], 1)
    assert lookup.match([1, 2, 3], 2) == ([3, 3], 0)


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


def record_widths(gen: SpeculativeGenerator, target, source) -> list[tuple[list[bool], list[int], int]]:
    """Per speculation step: (active rows, each row's real drafts from ``source`` — a padded proposer's
    ``drafted``, -1 where it did not propose —, tokens the target's step was fed)."""
    steps, step, run = [], gen.speculator.step, target.step
    fed = []

    def counted(tokens, *args, **kwargs):
        fed.append(tokens.shape[1])
        return run(tokens, *args, **kwargs)

    def recorded(tail, lengths, active, params, rng, stats):
        source.drafted = torch.full((target.batch_size,), -1)
        result = step(tail, lengths, active, params, rng, stats)
        steps.append((active.tolist(), source.drafted.tolist(), fed.pop()))
        return result
    target.step, gen.speculator.step = counted, recorded
    return steps


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_step_verifies_only_the_drafts_found(checkpoint, batch_size):
    """Lookups that find fewer than k tokens are padded ("padded"): a step feeds the target S[-1] and the
    longest active row's real drafts, a plain decode step when no row found any; the statistics count
    real drafts only, and greedy output stays target-only's."""
    target = load(checkpoint("llama"), batch_size=batch_size)
    prompts = PROMPTS[:batch_size]
    reference = target.generate(prompts, max_new_tokens=40, eos_token_id=[])
    lookup = PromptLookup(target)
    gen = SpeculativeGenerator(lookup, target, 5)
    steps = record_widths(gen, target, lookup)
    assert torch.equal(gen.generate(prompts, max_new_tokens=40, eos_token_id=[]), reference)
    for active, found, width in steps:
        assert min(found) >= 0 and width == 1 + max(f for f, a in zip(found, active) if a)
    assert {1, 6} <= {width for _, _, width in steps}           # decode steps and verifies
    assert gen.last_stats.drafted == sum(f for active, found, _ in steps for f, a in zip(found, active) if a)


@pytest.mark.parametrize("sample_kwargs", [dict(temperature=0.7), dict(temperature=1.3, top_k=6, top_p=0.9)])
def test_sampling_is_lossless(lossless_models, sample_kwargs):
    target_hf, target, _ = lossless_models
    gen = SpeculativeGenerator(PromptLookup(target), target, 2)
    pvalue = lossless_pvalue(target_hf, target, gen, sample_kwargs, 2, prompt=LOSSLESS_PROMPT)  # 20,480 samples
    assert 0.01 < gen.stats.acceptance_rate < 0.99     # proposals are really tested, not all rejected
    assert pvalue > 1e-3


def test_a_wrong_acceptor_is_detected(lossless_models, monkeypatch):
    target_hf, target, _ = lossless_models
    prompt = list(LOSSLESS_PROMPT)
    exact = exact_joint(target_hf, prompt, target.sampling_params(None, None, 0.7, True)[:1], 2)

    def accept_all(drafts, target_probs, draft_probs, *, num_drafts=None, **kw):
        n = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long) if num_drafts is None else num_drafts
        return n, torch.cat([drafts, target_probs[:, -1].argmax(-1, keepdim=True)], 1)

    monkeypatch.setattr(verify_module, "accept", accept_all)
    counts = sampled_joint(SpeculativeGenerator(PromptLookup(target), target, 2), prompt, 512, 2, 20,
                           dict(temperature=0.7))
    assert chi2_pvalue(exact, counts) < 1e-6


# ---------------------------------------------------------------- LookupOrDraft

def record_sources(combined: MatchOrDraft, counts: dict) -> None:
    """Count, per row, the steps whose proposal came from the lookup (or another ``MatchOrDraft`` source:
    "lookup") / the model (rows with a sequence:
    ``lengths`` > 2, the engine's dummy length for free and finished rows, which these tests never reach)."""
    propose = combined.propose

    def recorded(tail, lengths, k, params, rng):
        proposal = propose(tail, lengths, k, params, rng)
        for r, (n, lookup) in enumerate(zip(lengths.tolist(), combined.from_source.tolist())):
            if n > 2:
                counts["lookup" if lookup else "model"][r] = counts["lookup" if lookup else "model"].get(r, 0) + 1
        return proposal
    combined.propose = recorded


def combined(target, draft_model, **kw) -> LookupOrDraft:
    return LookupOrDraft(PromptLookup(target), DraftModel(draft_model), **kw)


@pytest.mark.parametrize("k", [2, 4])
def test_lookup_or_draft_greedy_equals_target_only_and_uses_both_sources(checkpoint, k):
    target = load(checkpoint("llama"), batch_size=3)
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    proposer = combined(target, load(checkpoint("llama-draft"), batch_size=3))
    counts = {"lookup": {}, "model": {}}
    record_sources(proposer, counts)
    gen = SpeculativeGenerator(proposer, target, k)
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=40, eos_token_id=[]), reference)
    assert set(counts["model"]) == {0, 1, 2} and len(counts["lookup"]) >= 2   # rows switch between the sources
    single = load(checkpoint("llama"), batch_size=1)
    alone = SpeculativeGenerator(combined(single, load(checkpoint("llama-draft"), batch_size=1), min_match=1),
                                 single, k).generate([PROMPTS[1]], max_new_tokens=40, eos_token_id=[])
    width = max(map(len, PROMPTS))
    assert torch.equal(alone[0, len(PROMPTS[1]):], reference[1, width:])


def test_lookup_or_draft_eos_inside_accepted_runs(checkpoint):
    """The target's own weights as the model draft: its proposals are accepted, so an EOS that greedy
    decoding emits lands inside accepted runs, between steps that took the lookup's proposals."""
    target = load(checkpoint("llama"), batch_size=3)
    free = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    proposer = combined(target, load(checkpoint("llama"), batch_size=3), min_match=1)
    counts = {"lookup": {}, "model": {}}
    record_sources(proposer, counts)
    gen = SpeculativeGenerator(proposer, target, 4)
    width = max(map(len, PROMPTS))
    eos = int(free[0, width + 11])
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=40, eos_token_id=eos), reference)
    assert gen.last_stats.acceptance_rate > 0.5 and counts["lookup"] and counts["model"]


def test_lookup_or_eagle_greedy_equals_target_only(tmp_path):
    target_dir, eagle_dir = saved_target_and_eagle(tmp_path)
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    target = load_target(target_dir)
    reference = target.generate(prompts, max_new_tokens=40, eos_token_id=[])
    proposer = LookupOrDraft(PromptLookup(target), EagleDraft.from_pretrained(eagle_dir, target, progress=False))
    counts = {"lookup": {}, "model": {}}
    record_sources(proposer, counts)
    for k in (2, 4):
        gen = SpeculativeGenerator(proposer, target, k)
        assert torch.equal(gen.generate(prompts, max_new_tokens=40, eos_token_id=[]), reference)
    assert counts["lookup"] and counts["model"]


def test_the_draft_model_tracks_the_verified_sequence(checkpoint, monkeypatch):
    """Where lookup tokens were verified, the draft model's cache held its own drafts: every proposal it
    makes must still be the draft's greedy continuation of the row's real sequence (recomputed here from
    scratch). With the old assumption (cache valid up to S[-2]: accepted tokens are the draft's own) the
    check fails."""
    target = load(checkpoint("llama"), batch_size=3)
    draft = load(checkpoint("llama-draft"), batch_size=3)
    fresh = load(checkpoint("llama-draft"), batch_size=1, context_buckets=[16, 32, 64])

    def mismatches() -> int:
        proposer = combined(target, draft)
        seen = []
        propose = proposer.draft.propose

        def recorded(tail, lengths, k, params, rng):
            proposal = propose(tail, lengths, k, params, rng)
            seen.extend((proposer.lookup.seqs[r][:n], proposal.tokens[r].tolist())
                        for r, n in enumerate(lengths.tolist()) if n > 2)
            return proposal
        proposer.draft.propose = recorded
        SpeculativeGenerator(proposer, target, 4).generate(PROMPTS, max_new_tokens=30, eos_token_id=[])
        return sum(fresh.generate([seq], max_new_tokens=len(drafts), eos_token_id=[])[0, len(seq):].tolist() != drafts
                   for seq, drafts in seen)

    assert mismatches() == 0

    def old_accepted(self, lengths, verified):     # slots up to n' - 2 taken as valid, whatever was verified
        self.synced = lengths.cpu() + verified.num_accepted.cpu() - 1
    monkeypatch.setattr(DraftModel, "accepted", old_accepted)
    assert mismatches() > 0


def test_a_skipped_draft_model_catches_up(checkpoint):
    """Steps where every row takes the lookup skip the draft model ("resyncs"); when it next proposes it
    first re-reads what it missed, k + 1 tokens a step (graphs a combination already has), and each
    proposal is still the draft's greedy continuation of the real sequence (recomputed from scratch);
    greedy output stays target-only's."""
    target = load(checkpoint("llama"), batch_size=1)
    draft = load(checkpoint("llama-draft"), batch_size=1)
    fresh = load(checkpoint("llama-draft"), batch_size=1, context_buckets=[16, 32, 64, 128])
    prompt = PROMPTS[0]            # a cycle the target continues for a while: lookups drafting run after run
    proposer = LookupOrDraft(PromptLookup(target), DraftModel(draft), min_match=2)
    model, seen, stale = proposer.draft, [], []
    propose, catch_up = model.propose, model.catch_up

    def recorded(tail, lengths, k, params, rng):
        proposal = propose(tail, lengths, k, params, rng)
        seen.append((proposer.lookup.seqs[0][:int(lengths[0])], proposal.tokens[0].tolist()))
        return proposal

    def measured(n, most, params):
        if not model.pending[0]:        # (the first propose encodes the prompt: DraftModel.flush)
            stale.append(int(n[0] - model.synced[0]) - most)
        catch_up(n, most, params)
    model.propose, model.catch_up = recorded, measured
    widths, run = [], draft.step

    def counted_step(tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return run(tokens, *args, **kwargs)
    draft.step = counted_step
    combined_steps = []
    propose_both = proposer.propose

    def counted(tail, lengths, k, params, rng):
        combined_steps.append(k)
        return propose_both(tail, lengths, k, params, rng)
    proposer.propose = counted
    gen = SpeculativeGenerator(proposer, target, 4)
    out = gen.generate([prompt], max_new_tokens=60, eos_token_id=[])
    assert torch.equal(out, target.generate([prompt], max_new_tokens=60, eos_token_id=[]))
    assert max(stale) > 0, stale                       # the model missed more than one re-read's width
    assert max(widths) == 5                             # and re-read it k + 1 tokens at a time
    assert 0 < len(seen) < len(combined_steps)          # steps that skipped it
    assert all(fresh.generate([seq], max_new_tokens=4, eos_token_id=[])[0, len(seq):].tolist() == drafts
               for seq, drafts in seen)


def test_lookup_or_draft_validation(checkpoint):
    target = load(checkpoint("llama"), batch_size=1)
    draft = load(checkpoint("llama-draft"), batch_size=1)
    with pytest.raises(ValueError, match="min_match=4"):
        combined(target, draft, min_match=4)
    with pytest.raises(TypeError, match="DraftModel"):
        LookupOrDraft(PromptLookup(target), draft)
    with pytest.raises(ValueError, match="batch"):
        combined(target, load(checkpoint("llama-draft"), batch_size=2))
    with pytest.raises(ValueError, match="needs a chain proposer"):
        SpeculativeGenerator(combined(target, draft), target, 2, fused=True)


def test_lookup_or_draft_sampling_is_lossless(lossless_models):
    target_hf, target, drafts = lossless_models
    proposer = combined(target, drafts["full"], min_match=1)
    counts = {"lookup": {}, "model": {}}
    record_sources(proposer, counts)
    gen = SpeculativeGenerator(proposer, target, 2)
    pvalue = lossless_pvalue(target_hf, target, gen, dict(temperature=0.7), 3, prompt=(3, 1, 4, 3, 1))  # 20,480
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert sum(counts["lookup"].values()) > 1000 and sum(counts["model"].values()) > 1000   # rows of both kinds
    assert pvalue > 1e-3


def test_lookup_rows_verified_with_the_models_q_are_detected(lossless_models, monkeypatch):
    """Lookup proposals checked against the model's q (not one-hot) bias the output: caught (power check)."""
    target_hf, target, drafts = lossless_models
    prompt = [3, 1, 4, 3, 1]
    exact = exact_joint(target_hf, prompt, target.sampling_params(None, None, 0.7, True)[:1], 3)
    monkeypatch.setattr(LookupOrDraft, "one_hot_rows", staticmethod(lambda probs, tokens, rows: probs))
    gen = SpeculativeGenerator(combined(target, drafts["full"], min_match=1), target, 2)
    assert chi2_pvalue(exact, sampled_joint(gen, prompt, 512, 3, 20, dict(temperature=0.7))) < 1e-6
