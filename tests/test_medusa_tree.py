"""Medusa trees: hand-derived static buffers, validation messages, built-in trees, greedy tree
construction, accuracy measurement and the JSON round trip."""
from __future__ import annotations

import json

import pytest
import torch

from specdec.medusa.tree import (
    build_tree,
    builtin_trees,
    expected_accept_length,
    gather_tree_tokens,
    load_tree,
    measure_head_accuracy,
    save_tree,
)
from specdec.speculation.tree import PAD_NODE, TokenTree, tree_buffers

SMALL = [[0], [1], [0, 0], [0, 1], [1, 0]]


def test_small_tree_buffers_hand_derived():
    # given out of order: node order is (depth, lexicographic)
    tree = TokenTree.from_paths([[1, 0], [0], [0, 1], [1], [0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert (tree.num_heads, tree.top_k, tree.num_nodes, tree.verify_size, tree.depth) == (2, 2, 5, 6, 2)
    b = tree_buffers(tree)
    # nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0]
    T, F = True, False
    assert b.mask.tolist() == [
        [T, F, F, F, F, F],
        [T, T, F, F, F, F],
        [T, F, T, F, F, F],
        [T, T, F, T, F, F],
        [T, T, F, F, T, F],
        [T, F, T, F, F, T],
    ]
    assert b.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert b.parent.tolist() == [0, 0, 0, 1, 1, 2]
    assert b.candidate_index.tolist() == [0, 1, 2, 3, 2]   # head h rank r at h * top_k + r, top_k = 2
    assert b.ancestors.tolist() == [[0, -1, -1], [0, 1, -1], [0, 2, -1], [0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert b.child_nodes.tolist() == [[1, 2], [3, 4], [5, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert b.leaves.tolist() == [3, 4, 5]
    assert b.retrieve.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert (b.max_depth, b.max_children) == (2, 2)
    assert all(t.dtype == torch.long for t in (b.depth, b.parent, b.candidate_index, b.ancestors,
                                                 b.child_nodes, b.leaves, b.retrieve))
    assert b.to("cpu").retrieve.tolist() == b.retrieve.tolist()


def test_candidate_index_with_explicit_top_k_and_gather():
    tree = TokenTree.from_paths(SMALL, num_heads=3, top_k=4)
    b = tree_buffers(tree)
    assert b.candidate_index.tolist() == [0, 1, 4, 5, 4]
    # head h's rank-r candidate token = 100 * h + r
    cands = (100 * torch.arange(3).view(3, 1) + torch.arange(4)).expand(2, 3, 4)
    tokens = gather_tree_tokens(torch.tensor([7, 8]), cands, b.candidate_index)
    assert tokens.tolist() == [[7, 0, 1, 100, 101, 100], [8, 0, 1, 100, 101, 100]]
    flat = gather_tree_tokens(torch.tensor([7, 8]), cands.reshape(2, 12), b.candidate_index)
    assert torch.equal(flat, tokens)


def test_mask_matches_ancestors_on_builtin_trees():
    for name in builtin_trees():
        tree = load_tree(name)
        b = tree_buffers(tree)
        n1 = tree.verify_size
        assert b.mask.shape == (n1, n1) and b.ancestors.shape == (n1, tree.depth + 1)
        ref = torch.zeros(n1, n1, dtype=torch.bool)
        for i in range(n1):
            row = b.ancestors[i][b.ancestors[i] != PAD_NODE]
            ref[i, row] = True
            assert row[-1] == i and len(row) == b.depth[i] + 1
            assert all(b.parent[row[k + 1]] == row[k] for k in range(len(row) - 1))
        assert torch.equal(b.mask, ref)
        assert (b.parent[1:] < torch.arange(1, n1)).all()          # parents first
        assert (b.depth[1:] >= b.depth[:-1]).all()
        kids = b.child_nodes[b.child_nodes != PAD_NODE]
        assert sorted(kids.tolist()) == list(range(1, n1))          # every node once
        for i in range(n1):                                         # children in rank order
            row = b.child_nodes[i][b.child_nodes[i] != PAD_NODE]
            assert (row[1:] > row[:-1]).all()
            assert all(b.parent[c] == i for c in row)


def test_builtin_trees():
    assert {"mc_sim_7b_63", "chain_4", "small_8"} <= set(builtin_trees())
    mc = load_tree("mc_sim_7b_63")
    assert (mc.num_nodes, mc.depth, mc.num_heads, mc.top_k, mc.verify_size) == (63, 4, 4, 10, 64)
    assert max(max(p) for p in mc.paths) < 10
    assert mc.paths[:3] == ((0,), (1,), (2,))
    chain = load_tree("chain_4")
    assert chain.paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    b = tree_buffers(chain)
    assert b.retrieve.tolist() == [[0, 1, 2, 3, 4]] and b.max_children == 1
    assert load_tree("small_8").num_nodes == 8
    assert load_tree("mc_sim_7b_63", max_verify_size=64) == mc


@pytest.mark.parametrize("paths, kwargs, message", [
    ([], {}, "at least one path"),
    ([[0], []], {}, "path #1 is empty"),
    ([[0], [0, 0], [1, 1]], {}, "path [1, 1] has no parent [1]"),
    ([[0], [1], [0]], {}, "path [0] appears more than once"),
    ([[0], [0, 0], [0, 0, 0]], {"num_heads": 2}, "path [0, 0, 0] has depth 3 > num_heads 2"),
    ([[0], [3]], {"top_k": 3}, "path [3] uses rank 3 >= top_k 3"),
    ([[0], [0, -1]], {}, "path [0, -1] has a negative rank"),
    ([[0], [0.5]], {}, "integer ranks"),
    ([[0], [1], [0, 0]], {"max_verify_size": 3},
     "3 nodes + root = 4 tokens to verify, more than the max verify size 3"),
])
def test_validation_errors_name_the_problem(paths, kwargs, message):
    with pytest.raises(ValueError) as e:
        TokenTree.from_paths(paths, **kwargs)
    assert message in str(e.value)


def test_load_tree_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="mc_sim_7b_63"):
        load_tree("no_such_tree")
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [1")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_tree(bad)


def test_json_round_trip(tmp_path):
    for name in builtin_trees():
        tree = load_tree(name)
        save_tree(tree, tmp_path / f"{name}.json")
        again = load_tree(tmp_path / f"{name}.json")
        assert again == tree
        assert json.loads((tmp_path / f"{name}.json").read_text()) == tree.to_list()


def test_build_tree_hand_derived():
    acc = torch.tensor([[0.6, 0.2, 0.1],
                        [0.5, 0.3, 0.1]])
    # candidates: [0] .6 -> take; its children [0,0] .30, [0,1] .18, [0,2] .06; [1] .2, [2] .1
    # take [0,0] .30, then [1] .2 (children [1,0] .10 ...), then [0,1] .18
    tree = build_tree(acc, 4)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1))
    assert (tree.num_heads, tree.top_k) == (2, 3)
    assert expected_accept_length(tree, acc) == pytest.approx(0.6 + 0.2 + 0.3 + 0.18)
    assert build_tree(acc, 1).paths == ((0,),)
    assert build_tree(acc, 12).num_nodes == 12        # all 3 + 9 nodes
    # ties: lower depth first ([1] = .5 beats [0,0] = .5)
    assert build_tree(torch.tensor([[1.0, 0.5], [0.5, 0.5]]), 2).paths == ((0,), (1,))
    with pytest.raises(ValueError, match=r"num_nodes must be in \[1, 12\]"):
        build_tree(acc, 13)
    with pytest.raises(ValueError, match="probabilities"):
        build_tree(acc * 2, 3)


def test_build_tree_is_optimal_against_brute_force():
    from itertools import combinations
    g = torch.Generator().manual_seed(0)
    acc = torch.sort(torch.rand(2, 3, generator=g), dim=1, descending=True).values
    all_paths = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    for n in range(1, 7):
        best = max(expected_accept_length(TokenTree(c, 2, 3), acc)
                   for c in combinations(all_paths, n)
                   if all(len(p) == 1 or p[:1] in c for p in c))
        assert expected_accept_length(build_tree(acc, n), acc) == pytest.approx(best)


def test_measure_head_accuracy():
    # T = 3 positions, 2 heads, top-2
    topk = torch.tensor([[[5, 6], [7, 8]],
                         [[5, 6], [9, 7]],
                         [[1, 2], [3, 4]]])
    targets = torch.tensor([[5, 7],
                            [6, 7],
                            [9, -1]])            # head 1 has no target at the last position
    acc = measure_head_accuracy(topk, targets)
    assert acc.dtype == torch.float32
    assert torch.allclose(acc, torch.tensor([[1 / 3, 1 / 3],
                                             [1 / 2, 1 / 2]]))
    assert measure_head_accuracy(topk, torch.full((3, 2), -1)).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_truncated_tree_keeps_the_shallow_paths():
    tree = TokenTree.from_paths(SMALL, num_heads=3, top_k=4)
    cut = tree.truncated(1)
    assert cut.to_list() == [[0], [1]] and (cut.num_heads, cut.top_k) == (3, 4)
    assert tree.truncated(5) == tree
    with pytest.raises(ValueError, match="depth must be >= 1"):
        tree.truncated(0)
