"""Adaptive speculation length (``specdec.speculation.adaptive``): the policy, greedy identity with target-only (draft
model, prompt lookup, their combination; batch 1 and 3, mixed prompt lengths), per-row k that really
grows and shrinks, per-row drafted counts in the statistics, chi-square losslessness of capped steps
and a broken cap that the chi-square test catches."""
import pytest
import torch

import specdec.speculation.verify as verify_module
from specdec import AdaptiveK, DraftModel, LookupOrDraft, PromptLookup, SpeculativeGenerator

from conftest import load, prompt_ids
from test_speculative import chi2_pvalue, exact_joint, lossless_models, lossless_pvalue, sampled_joint  # noqa: F401

REPEATING = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]
PROMPTS = [REPEATING, prompt_ids(7, 5), prompt_ids(11, 6) + prompt_ids(11, 6)[:6]]
LOSSLESS_PROMPT = (3, 1, 4, 3, 1)     # a repeat: the lookup proposes from the first step on
SAMPLED_TOKENS = 5                    # rows that rejected a draft in their first step are capped in the second


def proposer(kind: str, target, draft_model):
    if kind == "draft":
        return DraftModel(draft_model)
    if kind == "lookup":
        return PromptLookup(target)
    return LookupOrDraft(PromptLookup(target), DraftModel(draft_model))


def record_steps(gen: SpeculativeGenerator, lookup: PromptLookup | None = None) -> list[tuple]:
    """Wrap the generator's step: per step, (every row's k_r before it, drafted per row, active rows), and
    with ``lookup`` (the generator's proposer) each row's real drafts (its lookups found; -1: no lookup)."""
    steps, spec = [], gen.speculator
    step = spec.step

    def recorded(tail, lengths, active, params, rng, stats):
        row_k = spec.row_k.tolist()
        if lookup is not None:
            lookup.drafted = torch.full((len(row_k),), -1)
        result = step(tail, lengths, active, params, rng, stats)
        steps.append((row_k, result.drafted.tolist(), active.tolist())
                     + (() if lookup is None else (lookup.drafted.tolist(),)))
        return result
    spec.step = recorded
    return steps


# ---------------------------------------------------------------- the policy

def test_policy_grows_by_two_after_full_acceptance_and_shrinks_by_one():
    policy = AdaptiveK(min_k=2)
    row_k = torch.tensor([4, 4, 2, 5, 3, 4])
    drafted = torch.tensor([4, 4, 2, 5, 3, 2])      # the last row was capped at 2 drafts this step
    accepted = torch.tensor([4, 1, 0, 5, 0, 2])
    assert policy.next_k(row_k, drafted, accepted, 6).tolist() == [6, 3, 2, 6, 2, 6]
    assert AdaptiveK(max_k=3).next_k(torch.tensor([3, 1]), torch.tensor([3, 1]), torch.tensor([3, 0]), 6).tolist() \
        == [3, 1]


def test_policy_bounds_and_validation():
    assert AdaptiveK().bounds(5) == (1, 5)
    assert AdaptiveK(min_k=2, max_k=3).bounds(5) == (2, 3)
    for kw in [dict(min_k=0), dict(max_k=0), dict(min_k=3, max_k=2), dict(min_k=1.5), dict(max_k=True)]:
        with pytest.raises(ValueError, match="AdaptiveK"):
            AdaptiveK(**kw)
    with pytest.raises(ValueError, match="does not fit k=4"):
        AdaptiveK(max_k=5).bounds(4)
    with pytest.raises(ValueError, match="does not fit k=2"):
        AdaptiveK(min_k=3).bounds(2)


def test_generator_validation(checkpoint):
    target = load(checkpoint("llama"), batch_size=1)
    draft = load(checkpoint("llama-draft"), batch_size=1)
    with pytest.raises(ValueError, match="fused=False"):
        SpeculativeGenerator(draft, target, 3, fused=True, adaptive=True)
    with pytest.raises(ValueError, match="must be True, False or an AdaptiveK"):
        SpeculativeGenerator(draft, target, 3, adaptive="heuristic")
    with pytest.raises(ValueError, match="does not fit k=3"):
        SpeculativeGenerator(draft, target, 3, adaptive=AdaptiveK(max_k=4))

    class Tree(PromptLookup):      # a tree proposer: k is its depth
        depth = 2
    with pytest.raises(ValueError, match="chain drafts"):
        SpeculativeGenerator(Tree(target), target, adaptive=True)
    assert SpeculativeGenerator(draft, target, 3, adaptive=AdaptiveK(min_k=2)).speculator.row_k.tolist() == [3]


# ---------------------------------------------------------------- greedy identity

@pytest.mark.parametrize("kind", ["draft", "lookup", "lookup+draft"])
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_equals_target_only(checkpoint, kind, k):
    target = load(checkpoint("llama"), batch_size=3)
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    gen = SpeculativeGenerator(proposer(kind, target, load(checkpoint("llama-draft"), batch_size=3)), target, k,
                               adaptive=True)
    steps = record_steps(gen)
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=40, eos_token_id=[]), reference)
    assert any(min(k_r) < k for k_r, _, _ in steps)            # k adapted
    single = load(checkpoint("llama"), batch_size=1)
    alone = SpeculativeGenerator(proposer(kind, single, load(checkpoint("llama-draft"), batch_size=1)), single, k,
                                 adaptive=AdaptiveK(min_k=1, max_k=k))
    width = max(map(len, PROMPTS))
    out = alone.generate([PROMPTS[2]], max_new_tokens=40, eos_token_id=[])
    assert torch.equal(out[0, len(PROMPTS[2]):], reference[2, width:])


def test_k_grows_and_shrinks_per_row_and_stats_count_each_rows_drafts(checkpoint):
    """Prompt lookup on a target that falls into loops: rows start with rejected lookups (k shrinks), then
    copy their own loop (k grows); a row's drafted count is its own k_r, capped by the step's k and by the
    drafts its lookup found (a padded proposer)."""
    target = load(checkpoint("llama"), batch_size=3)
    lookup = PromptLookup(target)
    gen = SpeculativeGenerator(lookup, target, 6, adaptive=True)
    steps = record_steps(gen, lookup)
    reference = target.generate(PROMPTS, max_new_tokens=60, eos_token_id=[])
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    grew = shrank = capped = 0
    for (before, drafted, active, found), (after, *_) in zip(steps, steps[1:]):
        k_step = max(k for k, a in zip(before, active) if a)
        for r in range(3):
            if active[r]:
                assert found[r] >= 0 and drafted[r] == min(before[r], k_step, found[r])
                capped += drafted[r] < k_step
                grew += after[r] > before[r]
                shrank += after[r] < before[r]
    assert grew and shrank and capped
    assert {max(k for k, a in zip(before, active) if a) for before, _, active, _ in steps} > {6}   # smaller graphs too
    stats = gen.last_stats
    assert stats.drafted == sum(d for _, drafted, active, _ in steps for d, a in zip(drafted, active) if a)
    assert stats.steps == sum(sum(active) for _, _, active, _ in steps)
    assert 0 < stats.accepted <= stats.drafted


def test_rows_restart_at_max_k(checkpoint):
    target = load(checkpoint("llama"), batch_size=2)
    gen = SpeculativeGenerator(PromptLookup(target), target, 4, adaptive=AdaptiveK(max_k=3))
    gen.generate([PROMPTS[1], PROMPTS[2]], max_new_tokens=30, eos_token_id=[])
    gen.speculator.row_k[:] = 1
    engine = gen.engine
    engine.release(0)
    row = engine.add(PROMPTS[0], row=0, max_new_tokens=5)
    assert gen.speculator.row_k.tolist() == [3, 1]
    while engine.active_rows:
        engine.step()
    assert engine.rows[row].new == target.generate([PROMPTS[0]], max_new_tokens=5)[0, len(PROMPTS[0]):].tolist()


# ---------------------------------------------------------------- lossless sampling

@pytest.mark.parametrize("kind", ["draft", "lookup"])
def test_sampling_is_lossless(lossless_models, kind):
    target_hf, target, drafts = lossless_models
    gen = SpeculativeGenerator(proposer(kind, target, drafts["full"]), target, 2, adaptive=True)
    steps = record_steps(gen)
    pvalue = lossless_pvalue(target_hf, target, gen, dict(temperature=0.7), SAMPLED_TOKENS,
                             prompt=LOSSLESS_PROMPT)            # 20,480 samples of 4 tokens
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    capped = sum(d < max(drafted) for _, drafted, active in steps for d, a in zip(drafted, active) if a)
    assert capped > 1000                                       # capped rows are really in the sample
    assert pvalue > 1e-3


@pytest.mark.parametrize("kind", ["draft", "lookup"])
def test_a_cap_that_drops_the_correction_token_is_detected(lossless_models, monkeypatch, kind):
    """A capped row that emits the draft at its cut (the rejected one, or the next, untested one after
    all its drafts were accepted) instead of the target's correction / bonus token must fail the test."""
    target_hf, target, drafts = lossless_models
    prompt = list(LOSSLESS_PROMPT)
    exact = exact_joint(target_hf, prompt, target.sampling_params(None, None, 0.7, True)[:1], SAMPLED_TOKENS)
    real = verify_module.accept

    def broken(drafts, target_probs=None, draft_probs=None, *, num_drafts=None, **kw):
        n, out = real(drafts, target_probs, draft_probs, num_drafts=num_drafts, **kw)
        at, cut = n.clamp(max=drafts.shape[1] - 1).unsqueeze(1), n.unsqueeze(1)
        capped = (num_drafts < drafts.shape[1]).unsqueeze(1)
        return n, out.scatter(1, cut, torch.where(capped, drafts.gather(1, at), out.gather(1, cut)))

    monkeypatch.setattr(verify_module, "accept", broken)
    gen = SpeculativeGenerator(proposer(kind, target, drafts["full"]), target, 2, adaptive=True)
    counts = sampled_joint(gen, prompt, 512, SAMPLED_TOKENS, 20, dict(temperature=0.7))
    assert chi2_pvalue(exact, counts) < 1e-6


def test_bench_spec_builds_adaptive_and_lookup_plus_model_systems(checkpoint, monkeypatch):
    import specdec
    from specdec.tools.bench import speculative as bench

    target = load(checkpoint("llama"), batch_size=1)
    draft = DraftModel(load(checkpoint("llama-draft"), batch_size=1))
    monkeypatch.setattr(specdec, "shipped", lambda kind, target: draft)     # the embedded model's draft stand-in
    systems, module = bench.speculative_systems(bench.parse_options(["--strategy", "lookup", "--adaptive",
                                                                     "--ks", "2,3"]), target)
    assert list(systems) == ["specdec-lookup-adaptive-k2", "specdec-lookup-adaptive-k3"] and module is None
    assert systems["specdec-lookup-adaptive-k3"].make().speculator.adaptive == AdaptiveK()
    systems, module = bench.speculative_systems(bench.parse_options(["--strategy", "lookup+model", "--ks", "4"]),
                                                target)
    gen = systems["specdec-lookup+model-k4"].make()
    assert isinstance(gen.proposer, LookupOrDraft) and gen.proposer.draft is draft and gen.speculator.adaptive is None
    assert module is draft.module
    for argv in (["--strategy", "medusa", "--adaptive"], ["--strategy", "model", "--adaptive", "--fused", "on"]):
        with pytest.raises(ValueError, match="--adaptive applies to chain strategies"):
            bench.speculative_systems(bench.parse_options(argv), target)
