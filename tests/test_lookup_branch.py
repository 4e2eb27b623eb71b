"""Prompt lookup grafted onto EAGLE-2 dynamic trees (``LookupBranch``): the graft, greedy exactness,
losslessness, and that repeats in the prompt are accepted through the lookup branch."""
import pytest
import torch

from specdec import PromptLookup, SpeculativeGenerator
from specdec.eagle import copy_lm_head
from specdec.eagle.tree import DynamicTree, EagleTreeDraft
from specdec.lookup.branch import LookupBranch, graft
from specdec.speculation.tree import row_trees

from test_eagle import load_target, lossless_setup, random_eagle, saved_target_and_eagle, tiny_target, write_eagle
from test_speculative import lossless_pvalue

REPEATS = [[5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1, 2], [20, 21, 22, 23]]


def test_graft_follows_matching_children_then_adds_new_nodes():
    # root -> 1:a(10) -> 3:c(12);  root -> 2:b(11)
    tokens = torch.tensor([[10, 11, 12]] * 3)
    parent = torch.tensor([[0, 0, 0, 1]] * 3)
    chain = torch.tensor([[10, 12, 13],     # follows a, c, then 13 is new below c
                          [10, 99, 98],     # follows a, then a new branch below a
                          [77, 10, 12]])    # no match at the root: a new chain below the root
    t, p, spare = graft(tokens, parent, chain)
    assert spare.tolist() == [[True, True, False], [True, False, False], [False, False, False]]
    assert t[0].tolist() == [10, 11, 12, 10, 10, 13] and p[0].tolist() == [0, 0, 0, 1, 0, 0, 3]
    assert t[1].tolist() == [10, 11, 12, 10, 99, 98] and p[1].tolist() == [0, 0, 0, 1, 0, 1, 5]
    assert t[2].tolist() == [10, 11, 12, 77, 10, 12] and p[2].tolist() == [0, 0, 0, 1, 0, 4, 5]
    trees = row_trees(p, 3, 5)
    assert trees.depth[0].tolist() == [0, 1, 1, 2, 1, 1, 3]
    assert trees.depth[2].tolist() == [0, 1, 1, 2, 1, 2, 3]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_target_and_eagle(tmp_path_factory.mktemp("lookup-branch"))


def branch_generator(target, eagle_dir, tree=DynamicTree(3, 3, 6), length=3):
    draft = EagleTreeDraft.from_pretrained(eagle_dir, target, tree=tree, progress=False)
    return SpeculativeGenerator(LookupBranch(PromptLookup(target), draft, length), target)


@pytest.mark.parametrize("length", [1, 3])
def test_greedy_equals_target_only(saved, length):
    target_dir, eagle_dir = saved
    target = load_target(target_dir)
    gen = branch_generator(target, eagle_dir, length=length)
    assert gen.k == 3
    for prompts in (REPEATS, [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]):
        reference = target.generate(prompts, max_new_tokens=60, eos_token_id=[])
        assert torch.equal(gen.sample(prompts, max_new_tokens=60, eos_token_id=[]), reference)


def test_lookup_branch_accepts_copied_runs(tmp_path):
    """A target whose next token depends only on the current one (no attention output) falls into a
    cycle, which the lookup branch proposes exactly; with a random head the tree alone cannot."""
    hf = tiny_target(5, layers=1)
    with torch.no_grad():
        hf.model.layers[0].self_attn.o_proj.weight.zero_()
    hf.save_pretrained(tmp_path / "target")
    eagle_dir = copy_lm_head(write_eagle(tmp_path / "eagle1", hf, random_eagle(hf, 1)), tmp_path / "target",
                             tmp_path / "eagle")
    target = load_target(tmp_path / "target")
    prompts = [[5, 6, 7], [30, 31], [40]]
    reference = target.generate(prompts, max_new_tokens=60, eos_token_id=[])
    plain = SpeculativeGenerator(EagleTreeDraft.from_pretrained(eagle_dir, target, tree=DynamicTree(3, 3, 6),
                                                                progress=False), target)
    plain.sample(prompts, max_new_tokens=60, eos_token_id=[])
    gen = branch_generator(target, eagle_dir)
    assert torch.equal(gen.sample(prompts, max_new_tokens=60, eos_token_id=[]), reference)
    assert gen.last_stats.mean_acceptance_length > plain.last_stats.mean_acceptance_length + 1.0
    assert gen.last_stats.per_position_acceptance[-1] > 0.5     # whole-depth runs from the branch


@pytest.fixture(scope="module")
def lossless(tmp_path_factory):
    return lossless_setup(tmp_path_factory.mktemp("lookup-branch-lossless"))


def test_sampling_is_lossless(lossless):
    hf, target, eagle = lossless
    gen = branch_generator(target, eagle, tree=DynamicTree(3, 2, 4), length=3)
    pvalue = lossless_pvalue(hf, target, gen, dict(temperature=0.7), 3, prompt=(3, 1, 3, 1))  # 20,480 samples
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert pvalue > 1e-3


def test_errors(saved):
    target_dir, eagle_dir = saved
    target = load_target(target_dir)
    draft = EagleTreeDraft.from_pretrained(eagle_dir, target, tree=DynamicTree(3, 3, 6), progress=False)
    with pytest.raises(ValueError, match=r"length must be an int in \[1, 3\]"):
        LookupBranch(PromptLookup(target), draft, 4)
    with pytest.raises(ValueError, match="grafts onto a dynamic tree proposer"):
        LookupBranch(PromptLookup(target), PromptLookup(target))


def test_bench_clock_times_the_draft_graphs_behind_the_lookup_branch(saved):
    """bench-spec's graph clock finds the EAGLE network behind a LookupBranch (its draft graphs count as
    graph time, not host time) and nothing behind prompt lookup alone."""
    from specdec.tools.bench.speculative import GraphClock, drafting_model
    target_dir, eagle_dir = saved
    target = load_target(target_dir)
    gen = branch_generator(target, eagle_dir)
    assert drafting_model(gen.proposer) is gen.proposer.draft.model
    assert drafting_model(PromptLookup(target)) is None
    clock = GraphClock()
    clock.watch(gen.engine, [drafting_model(gen.proposer)])        # the draft network alone
    gen.generate(REPEATS, max_new_tokens=12, eos_token_id=[])
    assert clock.steps > 0 and clock.graph_s > 0
