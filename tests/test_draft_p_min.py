"""A draft model's confidence stop (``DraftModel(model, p_min=P)``): greedy identity with target-only (draft
model, lookup + model and suffix + model, batch 1 and 3), a stop that really shortens chains and verifies
(every row at one draft when P is near 1, k when P is tiny, in between at the median confidence), sampled rows
stopping without their samples depending on their batch neighbours, refusals."""
import pytest
import torch

from specdec import DraftModel, LookupOrDraft, PromptLookup, SpeculativeGenerator
from specdec.suffix import SuffixChain, SuffixOrDraft

from conftest import load, prompt_ids
from test_engine import sampled_row

PROMPTS = [[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5], prompt_ids(7, 5), prompt_ids(11, 6)]
K = 4


def draft_confidences(draft_model, target, prompts, k) -> list[float]:
    """The draft's top probability at every draft token of a k-draft greedy run without the stop."""
    seen = []
    step = draft_model.step

    def recorded(*args, **kwargs):
        out = step(*args, **kwargs)
        seen.extend(torch.softmax(out.logits[:, -1], -1).amax(-1).tolist())
        return out
    draft_model.step = recorded
    SpeculativeGenerator(DraftModel(draft_model), target, k).generate(prompts, max_new_tokens=30, eos_token_id=[])
    del draft_model.step
    return seen


def widths(gen: SpeculativeGenerator) -> list[int]:
    """Records the tokens of every verify step the generator's target runs (wraps its step)."""
    seen, step = [], gen.target.step

    def recorded(tokens, *args, **kwargs):
        seen.append(tokens.shape[1])
        return step(tokens, *args, **kwargs)
    gen.target.step = recorded
    return seen


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("combined", [None, "lookup", "suffix"])
def test_greedy_output_is_the_targets_and_chains_stop_where_the_draft_doubts(checkpoint, batch, combined):
    target = load(checkpoint("llama"), batch_size=batch)
    draft = load(checkpoint("llama-draft"), batch_size=batch)
    prompts = PROMPTS[:batch] if batch > 1 else PROMPTS[1:2]
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    middle = float(torch.tensor(draft_confidences(draft, target, prompts, K)).median())
    drafted = {}
    for p_min in (1e-9, middle, 1 - 1e-6):
        proposer = DraftModel(draft, p_min=p_min)
        if combined == "lookup":
            proposer = LookupOrDraft(PromptLookup(target), proposer)
        elif combined == "suffix":
            proposer = SuffixOrDraft(SuffixChain(target), proposer)
        gen = SpeculativeGenerator(proposer, target, K)
        verified = widths(gen)
        assert torch.equal(gen.generate(prompts, max_new_tokens=30, eos_token_id=[]), reference), p_min
        stats = gen.last_stats
        drafted[p_min] = stats.drafted / stats.steps        # drafts per row and step
        if p_min == middle:
            assert len(set(verified) - {1}) > 1              # verify widths follow the longest row's chain
    if combined is None:    # (lookup / suffix rows draft their matches whatever the draft's confidence)
        assert drafted[1e-9] == K and drafted[1 - 1e-6] == 1
    assert drafted[1e-9] > drafted[middle] > drafted[1 - 1e-6]


def test_sampled_rows_stop_too_and_a_rows_samples_do_not_depend_on_its_neighbours(checkpoint):
    """Sampled rows stop at the same confidence (the top probability of the distribution they draw from); the
    draft steps a stopped batch skips and the verify positions a narrowed step leaves out still draw their
    noise (``DecoderModel.skip_draws``, ``Proposal.draw_width``), so a row samples the same tokens alone and
    next to rows that stop elsewhere. (Losslessness: ``test_speculative.test_sampling_is_lossless``.)"""
    target = load(checkpoint("llama"), batch_size=3)
    draft = load(checkpoint("llama-draft"), batch_size=3)
    middle = float(torch.tensor(draft_confidences(draft, target, PROMPTS, K)).median())
    gen = SpeculativeGenerator(DraftModel(draft, p_min=middle), target, K)
    verified = widths(gen)
    p, q, r = PROMPTS
    alone = sampled_row(gen, [p], [7], 0, temperature=1.0)
    assert 1 < gen.last_stats.drafted / gen.last_stats.steps < K      # the stop acts on sampled rows
    assert len(set(verified) - {1}) > 1                                 # and narrows their verifies
    assert sampled_row(gen, [q, p], [5, 7], 1, temperature=1.0) == alone
    assert sampled_row(gen, [r, q, p], [9, 8, 7], 2, temperature=1.0) == alone
    assert sampled_row(gen, [p, r], [7, 3], 0, temperature=1.0) == alone
    assert sampled_row(gen, [p], [8], 0, temperature=1.0) != alone      # the seed does matter


def test_refusals(checkpoint):
    target = load(checkpoint("llama"), batch_size=1)
    draft = load(checkpoint("llama-draft"), batch_size=1)
    for bad in (0, 1, 1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="p_min must be a probability in"):
            DraftModel(draft, p_min=bad)
    with pytest.raises(ValueError, match="fused_drafter"):
        SpeculativeGenerator(DraftModel(draft, p_min=0.5), target, K, fused=True)
    assert "fused_drafter" in DraftModel(draft).abilities and "padded" in DraftModel(draft, p_min=0.5).abilities
    from specdec.options import ModelOptions, OptionError, SpeculationOptions
    with pytest.raises(OptionError, match="--draft-p-min stops a draft model's chain early"):
        SpeculationOptions(draft="suffix", draft_p_min=0.5).checked(ModelOptions())
    with pytest.raises(OptionError, match=r"--draft-p-min must be in \[0, 1\) \(0: off\)"):
        SpeculationOptions(draft="model", draft_path="x", draft_p_min=2.0)._check("x")
