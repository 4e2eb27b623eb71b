"""EAGLE-2 dynamic trees: per-row tree buffers from parent arrays, the rerank, greedy exactness,
losslessness (chi-square) and the gain over chains, on tiny random models."""
import pytest
import torch

from specdec import EagleDraft, SpeculativeGenerator
from specdec.eagle.tree import DynamicTree, EagleTreeDraft, _rerank
from specdec.speculation.tree import PAD_NODE, TokenTree, row_trees, tree_buffers

from test_eagle import (  # noqa: F401 (fixture)
    PROMPTS,
    assert_true_pairs,
    load_target,
    lossless_setup,
    perfect,
    record_true_pairs,
    saved_target_and_eagle,
)
from test_speculative import lossless_pvalue


# ---------------------------------------------------------------- tree buffers
def random_parents(g: torch.Generator, B: int, n1: int) -> torch.Tensor:
    parent = torch.zeros(B, n1, dtype=torch.long)
    for i in range(1, n1):
        parent[:, i] = torch.randint(0, i, (B,), generator=g)
    return parent


def test_row_trees_match_brute_force():
    g = torch.Generator().manual_seed(0)
    parent = random_parents(g, 4, 12)
    D, C = 11, 11
    t = row_trees(parent, D, C)
    for b in range(4):
        for i in range(12):
            path = [i]
            while path[-1] != 0:
                path.append(int(parent[b, path[-1]]))
            path = path[::-1]                                   # root .. i
            assert int(t.depth[b, i]) == len(path) - 1
            assert t.ancestors[b, i].tolist() == path + [PAD_NODE] * (D + 1 - len(path))
            assert set(torch.nonzero(t.mask[b, i]).flatten().tolist()) == set(path)
            kids = [j for j in range(1, 12) if int(parent[b, j]) == i]
            assert t.child_nodes[b, i].tolist() == kids + [PAD_NODE] * (C - len(kids))


def test_static_tree_buffers_come_from_row_trees():
    tree = TokenTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    buf = tree_buffers(tree)
    assert buf.parent.tolist() == [0, 0, 0, 1, 1, 2, 3]
    assert buf.ancestors[6].tolist() == [0, 1, 3, 6]
    assert buf.child_nodes[1].tolist() == [3, 4]
    assert buf.leaves.tolist() == [4, 5, 6]
    rows = buf.per_row(2)
    assert rows.mask.shape == (2, 7, 7) and rows.max_depth == 3 and rows.max_children == 2


def test_rerank_picks_the_best_scored_prefix_closed_nodes():
    g = torch.Generator().manual_seed(1)
    K, D, N, B = 3, 4, 10, 5
    scores = [(-torch.rand(B, K, generator=g) * 3)]
    parents = [torch.full((B, K), -1)]
    frontier = torch.arange(K).expand(B, K)
    frontier_scores = scores[0]
    offset = K
    for _ in range(D - 1):
        child = frontier_scores.unsqueeze(-1) - torch.rand(B, K, K, generator=g) * 3
        scores.append(child.flatten(1))
        parents.append(frontier.repeat_interleave(K, 1))
        frontier_scores, best = child.flatten(1).topk(K, -1)
        frontier = offset + best
        offset += K * K
    pool_scores, pool_parent = torch.cat(scores, 1), torch.cat(parents, 1)
    tokens = torch.arange(pool_scores.shape[1]).expand(B, -1)          # token = pool index
    nodes, parent = _rerank(tokens, pool_scores, pool_parent, K, N)
    for b in range(B):
        chosen = nodes[b].tolist()
        assert sorted(chosen) == sorted(pool_scores[b].topk(N).indices.tolist())   # the N best
        for i, c in enumerate(chosen, start=1):
            p = int(pool_parent[b, c])
            assert int(parent[b, i]) == (0 if p < 0 else chosen.index(p) + 1)       # parent kept, earlier
    depth = row_trees(parent, D, K * K).depth
    assert (depth[:, 1:].diff(dim=1) >= 0).all()                                    # ordered by depth


def test_dynamic_tree_validates_its_shape():
    with pytest.raises(ValueError, match="num_nodes=30 exceeds the 14 candidates"):
        DynamicTree(depth=4, top_k=2, num_nodes=30)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        DynamicTree(top_k=0)


# ---------------------------------------------------------------- exactness
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_target_and_eagle(tmp_path_factory.mktemp("eagle-tree"))


@pytest.mark.parametrize("tree", [DynamicTree(3, 4, 8), DynamicTree(5, 3, 12), DynamicTree(1, 4, 4)])
def test_greedy_equals_target_only(saved, tree):
    target_dir, eagle_dir = saved
    target = load_target(target_dir)
    reference = target.generate(PROMPTS, max_new_tokens=70, eos_token_id=[])
    gen = SpeculativeGenerator(EagleTreeDraft.from_pretrained(eagle_dir, target, tree=tree, progress=False), target)
    assert gen.k == tree.depth
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=70, eos_token_id=[]), reference)   # runs to n_positions
    one = gen.sample([PROMPTS[2]], max_new_tokens=70, eos_token_id=[])
    width = max(map(len, PROMPTS))
    assert torch.equal(one[0, len(PROMPTS[2]):], reference[2, width:])


def test_perfect_draft_accepts_whole_depth_and_stops_at_eos(perfect):
    eagle_dir, target_dir = perfect
    target = load_target(target_dir)
    tree = DynamicTree(4, 3, 9)
    gen = SpeculativeGenerator(EagleTreeDraft.from_pretrained(eagle_dir, target, tree=tree, progress=False), target)
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=40, eos_token_id=[]), reference)
    assert gen.last_stats.per_position_acceptance[-1] > 0.9      # every depth accepted
    width = max(map(len, PROMPTS))
    eos = reference[0, width + 7].item()
    out = gen.sample(PROMPTS, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out, target.generate(PROMPTS, max_new_tokens=40, eos_token_id=eos))
    assert gen.last_stats.acceptance_rate > 0.9


def test_features_after_tree_steps_are_the_targets(saved, monkeypatch):
    """Every (feature, token) pair the re-read step reads as true equals transformers' final hidden
    state at that position and the next token of the final sequence (the accepted path's features)."""
    from transformers import LlamaForCausalLM
    target_dir, eagle_dir = saved
    target = load_target(target_dir)
    draft = EagleTreeDraft.from_pretrained(eagle_dir, target, tree=DynamicTree(3, 4, 8), progress=False)
    gen = SpeculativeGenerator(draft, target)
    fed, seqs = record_true_pairs(gen, monkeypatch)
    hf = LlamaForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        hidden = [hf(torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0] for s in seqs]
    assert_true_pairs(fed, seqs, hidden)


# ---------------------------------------------------------------- losslessness and gain


@pytest.fixture(scope="module")
def lossless(tmp_path_factory):
    return lossless_setup(tmp_path_factory.mktemp("eagle-tree-lossless"))


@pytest.mark.parametrize("sample_kwargs", [dict(temperature=0.7), dict(temperature=1.3, top_k=6, top_p=0.9)])
def test_sampling_is_lossless(lossless, sample_kwargs):
    hf, target, eagle = lossless
    gen = SpeculativeGenerator(EagleTreeDraft.from_pretrained(eagle, target, tree=DynamicTree(3, 3, 6),
                                                              progress=False), target)
    pvalue = lossless_pvalue(hf, target, gen, sample_kwargs, 3)      # 20,480 samples of 3 tokens
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert gen.stats.per_position_acceptance[1] > 0.01
    assert pvalue > 1e-3


def test_broken_tree_acceptor_is_detected(lossless, monkeypatch):
    """Power check: accepting the root's best child whatever the target says must fail the test."""
    import specdec.speculation.verify as verify
    hf, target, eagle = lossless
    real = verify.accept_tree_sampled

    def accept_first_child(tokens, probs, child_nodes, uniform, residual):
        return real(tokens, probs, child_nodes, torch.zeros_like(uniform), residual)   # u = 0: always accept

    monkeypatch.setattr(verify, "accept_tree_sampled", accept_first_child)
    gen = SpeculativeGenerator(EagleTreeDraft.from_pretrained(eagle, target, tree=DynamicTree(3, 3, 6),
                                                              progress=False), target)
    assert lossless_pvalue(hf, target, gen, dict(temperature=0.7), 3, calls=10) < 1e-6


def test_tree_accepts_more_than_the_chain(lossless):
    """The same head: a tree of 3 candidates per depth accepts clearly more tokens per step than a chain."""
    hf, target, eagle = lossless
    prompts = [[3, 1, 4]] * 512
    chain = SpeculativeGenerator(EagleDraft.from_pretrained(eagle, target, progress=False), target, 3)
    chain.sample(prompts, max_new_tokens=12, temperature=0.7, seed=0)
    tree = SpeculativeGenerator(EagleTreeDraft.from_pretrained(eagle, target, tree=DynamicTree(3, 3, 9),
                                                               progress=False), target)
    tree.sample(prompts, max_new_tokens=12, temperature=0.7, seed=0)
    assert tree.last_stats.mean_acceptance_length > 1.2 * chain.last_stats.mean_acceptance_length


# ---------------------------------------------------------------- errors
def test_errors(saved):
    target_dir, eagle_dir = saved
    target = load_target(target_dir)
    draft = EagleTreeDraft.from_pretrained(eagle_dir, target, tree=DynamicTree(2, 4, 8), progress=False)
    with pytest.raises(ValueError, match="fused speculation needs a chain proposer"):
        SpeculativeGenerator(draft, target, fused=True)
    with pytest.raises(ValueError, match="k=3 but a EagleTree step drafts the tree's depth 2"):
        SpeculativeGenerator(draft, target, 3)
    with pytest.raises(ValueError, match="top_k=100 exceeds the draft's 64-token vocabulary"):
        EagleTreeDraft.from_pretrained(eagle_dir, target, tree=DynamicTree(2, 100, 8), progress=False)
    small = load_target(target_dir, n_positions=32, kv_buckets=[16, 32])
    big = EagleTreeDraft.from_pretrained(eagle_dir, small, tree=DynamicTree(4, 8, 40), progress=False)
    with pytest.raises(ValueError, match="needs 41 verify slots"):
        SpeculativeGenerator(big, small)


def test_bench_spec_builds_tree_systems_from_a_strategy_list(saved, monkeypatch):
    import specdec
    from specdec import LookupBranch
    from specdec.tools.bench import speculative as bench

    target_dir, eagle_dir = saved
    target = load_target(target_dir, batch_size=1)

    def stand_in(kind, target, tree=None):      # the shipped head's stand-in: the random tiny one
        if kind == "eagle-tree":
            return EagleTreeDraft.from_pretrained(eagle_dir, target, tree=tree, progress=False)
        return EagleDraft.from_pretrained(eagle_dir, target, progress=False)

    monkeypatch.setattr(specdec, "shipped", stand_in)
    args = bench.parse_options(["--strategy", "eagle,eagle-tree,lookup+eagle-tree", "--ks", "3",
                                "--dynamic-trees", "3x2x4"])
    systems, module = bench.speculative_systems(args, target)
    assert list(systems) == ["specdec-eagle-k3", "specdec-eagle-tree-3x2x4", "specdec-lookup+eagle-tree-3x2x4"]
    assert [s.width for s in systems.values()] == [4, 5, 8]
    assert isinstance(systems["specdec-lookup+eagle-tree-3x2x4"].make().proposer, LookupBranch)
    with pytest.raises(SystemExit):
        bench.parse_options(["--strategy", "eagle,nope"])
    # --eagle DIR: that head for every EAGLE strategy (a loadable checkpoint is used as it is)
    monkeypatch.setattr(specdec, "shipped", None)
    args = bench.parse_options(["--strategy", "eagle3-tree,lookup+eagle3", "--ks", "2", "--dynamic-trees", "3x2x4",
                                "--eagle", str(eagle_dir)])
    systems, _ = bench.speculative_systems(args, target)
    assert list(systems) == ["specdec-eagle3-tree-3x2x4", "specdec-lookup+eagle3-k2"]
    assert isinstance(systems["specdec-eagle3-tree-3x2x4"].make().proposer, EagleTreeDraft)
    # --draft-quantization: the head's own scheme, the target untouched; Medusa refuses it by name
    from specdec.core.quant import Int8Linear
    args = bench.parse_options(["--strategy", "eagle3-tree", "--dynamic-trees", "3x2x4", "--eagle", str(eagle_dir),
                                "--draft-quantization", "int8"])
    systems, module = bench.speculative_systems(args, target)
    assert isinstance(module.lm_head, Int8Linear) and target.settings.quantization is None
    with pytest.raises(ValueError, match="--draft-quantization applies to the draft model and EAGLE heads"):
        bench.speculative_systems(bench.parse_options(["--strategy", "medusa", "--draft-quantization", "int8"]),
                                  target)
