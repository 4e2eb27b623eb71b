"""Tree acceptance rules: hand-derived greedy outcomes, greedy == brute force == target-only greedy
decoding, chi-square losslessness of the sampled rule (first token and the joint of the first two
tokens) with negative controls that must fail the same test, typical acceptance detectably lossy,
and torch.export (strict) of the rules."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from torch import nn

from specdec.medusa.tree import load_tree
from specdec.speculation.acceptance import (
    accept_tree_greedy,
    accept_tree_sampled,
    accept_tree_typical,
    draw_tree_uniforms,
)
from specdec.speculation.tree import TokenTree, row_trees, tree_buffers

PAD = -1
SMALL = TokenTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
# nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0]


pytestmark = pytest.mark.usefixtures("single_thread")


def greedy(tokens, targets, tree=SMALL):
    b = tree_buffers(tree)
    return accept_tree_greedy(torch.tensor(tokens), torch.tensor(targets), b.parent, b.ancestors)


# ----------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("targets, n, best, out", [
    ([4, 0, 7, 0, 0, 11], 2, 5, [4, 7, 11]),     # root -> [1] (token 4) -> [1,0] (token 7), bonus 11
    ([3, 8, 0, 0, 0, 0], 1, 1, [3, 8, PAD]),     # [0] accepted, neither child (5, 6) matches 8
    ([0, 0, 0, 0, 0, 0], 0, 0, [0, PAD, PAD]),   # nothing matches: correction = argmax at the root
    ([3, 6, 0, 0, 12, 0], 2, 4, [3, 6, 12]),     # the rank-1 grandchild
    ([4, 5, 9, 0, 0, 0], 1, 2, [4, 9, PAD]),     # node 3 matches its parent's argmax but node 1 does not
])
def test_greedy_hand_derived(targets, n, best, out):
    tokens = [[9, 3, 4, 5, 6, 7]]
    gn, gbest, gout = greedy(tokens, [targets])
    assert gn.tolist() == [n] and gbest.tolist() == [best] and gout.tolist() == [out]


def test_greedy_duplicate_siblings():
    tokens = [[9, 3, 3, 5, 6, 7]]                          # nodes 1 and 2 both propose 3
    # both subtrees reach depth 2: the lowest index (lowest ranks) wins
    assert greedy(tokens, [[3, 5, 7, 20, 0, 21]])[1].tolist() == [3]
    # only the rank-1 sibling's subtree goes deeper: the longest path wins
    n, best, out = greedy(tokens, [[3, 99, 7, 0, 0, 21]])
    assert (n.tolist(), best.tolist(), out.tolist()) == ([2], [5], [[3, 7, 21]])
    # equal depth 1 only: rank 0
    assert greedy(tokens, [[3, 99, 98, 0, 0, 0]])[1].tolist() == [1]


def test_padding_nodes_are_not_computed_and_never_accepted():
    """``row_trees``' padding (a row's unused slots: leaves) has its mask
    diagonal cleared, is no node's child, and no rule accepts it even where its token is the target's choice."""
    parent = torch.tensor([[0, 0, 1, 0, 0]])                 # root -> 1 -> 2; nodes 3, 4 pad the width
    real = torch.tensor([[True, True, True, False, False]])
    trees = row_trees(parent, 2, 4, real)
    assert trees.mask.diagonal(dim1=1, dim2=2).tolist() == real.tolist()
    assert trees.mask[0, 3].tolist() == [True, False, False, False, False]      # it still attends to the root
    assert trees.child_nodes[0, 0].tolist() == [1, PAD, PAD, PAD]
    tokens = torch.tensor([[9, 3, 4, 7, 7]])
    targets = torch.tensor([[7, 0, 0, 5, 5]])                  # the root's argmax is the padding's token 7
    assert accept_tree_greedy(tokens, targets, trees.parent, trees.ancestors)[0].tolist() == [1]   # unmarked
    n, best, out = accept_tree_greedy(tokens, targets, trees.parent, trees.ancestors, real=real)
    assert (n.tolist(), best.tolist(), out.tolist()) == ([0], [0], [[7, PAD, PAD]])
    probs = torch.nn.functional.one_hot(targets, 10).float()
    u, v = draw_tree_uniforms(1, 2, 4, torch.Generator().manual_seed(0))
    assert accept_tree_sampled(tokens, probs, trees.child_nodes, u, v)[0].tolist() == [0]
    for bad in ([[True, False, True, False, False]], [[False] + [True] * 4]):   # a padding parent; the root
        with pytest.raises(ValueError, match="the root must be real and padding nodes leaves"):
            row_trees(parent, 2, 4, torch.tensor(bad))


def lm_next(seq, V):
    """A deterministic 'greedy language model': the argmax token after the token sequence ``seq``."""
    h = 0
    for t in seq:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return (h * 2_654_435_761 >> 11) % V


def consistent_inputs(tree, B, V, p_correct, seed):
    """Tree tokens (each node right with prob p_correct) and the target argmax of ``lm_next`` at every node."""
    g = torch.Generator().manual_seed(seed)
    nodes = [(), *tree.paths]
    index = {p: i for i, p in enumerate(nodes)}
    tokens = torch.zeros(B, len(nodes), dtype=torch.long)
    targets = torch.zeros_like(tokens)
    tokens[:, 0] = torch.randint(0, V, (B,), generator=g)
    right = torch.rand(B, len(nodes), generator=g) < p_correct
    rand = torch.randint(0, V, (B, len(nodes)), generator=g)
    seqs = [[None] * len(nodes) for _ in range(B)]
    for b in range(B):
        for i, p in enumerate(nodes):
            if i:
                parent = index[p[:-1]]
                tokens[b, i] = int(targets[b, parent]) if right[b, i] else int(rand[b, i])
                seqs[b][i] = seqs[b][parent] + [int(tokens[b, i])]
            else:
                seqs[b][i] = [int(tokens[b, 0])]
            targets[b, i] = lm_next(seqs[b][i], V)
    return tokens, targets


def brute_force_greedy(tree, tokens, targets):
    nodes = [(), *tree.paths]
    index = {p: i for i, p in enumerate(nodes)}
    ns, bests, outs = [], [], []
    for b in range(tokens.shape[0]):
        best = 0
        for i, p in enumerate(nodes):
            ok = all(int(tokens[b, index[p[:d]]]) == int(targets[b, index[p[:d - 1]]]) for d in range(1, len(p) + 1))
            if ok and len(p) > len(nodes[best]):
                best = i
        p = nodes[best]
        row = [int(tokens[b, index[p[:d]]]) for d in range(1, len(p) + 1)] + [int(targets[b, best])]
        ns.append(len(p))
        bests.append(best)
        outs.append(row + [PAD] * (tree.depth + 1 - len(row)))
    return torch.tensor(ns), torch.tensor(bests), torch.tensor(outs)


@pytest.mark.parametrize("name, p_correct", [("mc_sim_7b_63", 0.7), ("small_8", 0.5), ("chain_4", 0.8)])
def test_greedy_matches_brute_force_and_target_only_decoding(name, p_correct):
    tree = load_tree(name)
    b = tree_buffers(tree)
    V = 4                                                  # tiny vocab: duplicate siblings are common
    tokens, targets = consistent_inputs(tree, 150, V, p_correct, seed=len(name))
    n, best, out = accept_tree_greedy(tokens, targets, b.parent, b.ancestors)
    ref = brute_force_greedy(tree, tokens, targets)
    assert torch.equal(n, ref[0]) and torch.equal(best, ref[1]) and torch.equal(out, ref[2])
    assert (n == tree.depth).any() and (n < tree.depth).any()
    for row in range(tokens.shape[0]):                     # = target-only greedy decoding
        seq = [int(tokens[row, 0])]
        for _ in range(int(n[row]) + 1):
            seq.append(lm_next(seq, V))
        assert out[row, :int(n[row]) + 1].tolist() == seq[1:]


def test_sampled_with_one_hot_targets_is_greedy_decoding():
    tree = load_tree("mc_sim_7b_63")
    b = tree_buffers(tree)
    V = 4
    tokens, targets = consistent_inputs(tree, 150, V, 0.7, seed=3)
    probs = torch.nn.functional.one_hot(targets, V).float()
    u, v = draw_tree_uniforms(150, b.max_depth, b.max_children, torch.Generator().manual_seed(0))
    n, best, out = accept_tree_sampled(tokens, probs, b.child_nodes, u, v)
    gn, _, gout = accept_tree_greedy(tokens, targets, b.parent, b.ancestors)
    assert (n <= gn).all() and (n > 0).any()
    for row in range(150):                                 # a prefix of greedy decoding, ending in a correction
        k = int(n[row]) + 1
        seq = [int(tokens[row, 0])]
        for _ in range(k):
            seq.append(lm_next(seq, V))
        assert out[row, :k].tolist() == seq[1:]
        assert (out[row, k:] == PAD).all()
    assert torch.equal(b.depth[best], n)


# ----------------------------------------------------------------------------- losslessness
V = 5
# tree: root children [0] [1] [2] (tokens 0, 1, 1: a repeated sibling token), grandchildren [0,0] [0,1] [1,0]
TREE = TokenTree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
NODE_TOKENS = [0, 1, 1, 2, 3, 4]               # nodes 1..6; node 5 proposes 3, impossible after 0 (below)
P0 = torch.tensor([0.35, 0.25, 0.2, 0.12, 0.08])


def lm_tables():
    """Target next-token tables: P1[a] = p(. | a), P2[a, b], P3[a, b, c]; p(3 | 0) = 0 (a warped-out token)."""
    g = torch.Generator().manual_seed(7)
    P1 = torch.softmax(torch.randn(V, V, generator=g), -1)
    P1[0, 3] = 0.0
    P1 = P1 / P1.sum(-1, keepdim=True)
    P2 = torch.softmax(torch.randn(V, V, V, generator=g), -1)
    P3 = torch.softmax(torch.randn(V, V, V, V, generator=g), -1)
    return P1, P2, P3


def tree_step_inputs(root_probs, child_probs, grandchild_probs):
    """tokens [B, 7], probs [B, 7, V] for TREE, given per-row distributions as functions of the path."""
    B = root_probs.shape[0]
    nodes = [(), *TREE.paths]
    tokens = torch.tensor([0] + NODE_TOKENS).expand(B, -1).clone()
    probs = torch.empty(B, len(nodes), V)
    for i, p in enumerate(nodes):
        toks = [NODE_TOKENS[nodes.index(p[:d]) - 1] for d in range(1, len(p) + 1)]
        if not toks:
            probs[:, i] = root_probs
        elif len(toks) == 1:
            probs[:, i] = child_probs(*toks)
        else:
            probs[:, i] = grandchild_probs(*toks)
    return tokens, probs


def sample_two_tokens(rule, B=24_000, seed=0, wrong_child_probs=False):
    """Emit the first two tokens after the root with ``rule`` (one step, and a second step from y1 for the
    rows whose first step emitted one token) → (y1 [B], y2 [B])."""
    P1, P2, P3 = lm_tables()
    g = torch.Generator().manual_seed(seed)
    b = tree_buffers(TREE)
    # the wrong variant gives the draft token 1 the distribution after token 2 (no zero-probability change)
    child = (lambda a: P1[2 if a == 1 else a].expand(B, V)) if wrong_child_probs else (lambda a: P1[a].expand(B, V))
    tokens, probs = tree_step_inputs(P0.expand(B, V), child, lambda a, c: P2[a, c].expand(B, V))
    n, _, out = rule(tokens, probs, b, g)
    y1 = out[:, 0]
    # second step, rooted at y1 (only its first emitted token is used)
    tokens2, probs2 = tree_step_inputs(P1[y1], lambda a: P2[y1, a], lambda a, c: P3[y1, a, c])
    tokens2[:, 0] = y1
    _, _, out2 = rule(tokens2, probs2, b, g)
    return y1, torch.where(n >= 1, out[:, 1], out2[:, 0])


def sampled_rule(tokens, probs, b, g):
    u, v = draw_tree_uniforms(tokens.shape[0], b.max_depth, b.max_children, g)
    return accept_tree_sampled(tokens, probs, b.child_nodes, u, v)


def always_accept_rule(tokens, probs, b, g):
    """Negative control: every child with p > 0 is accepted (u = 0), i.e. acceptance probability 1."""
    u, v = draw_tree_uniforms(tokens.shape[0], b.max_depth, b.max_children, g)
    return accept_tree_sampled(tokens, probs, b.child_nodes, torch.zeros_like(u), v)


def typical_rule(tokens, probs, b, g):
    _, v = draw_tree_uniforms(tokens.shape[0], b.max_depth, b.max_children, g)
    return accept_tree_typical(tokens, probs, b.parent, b.ancestors, v)


def chi2_pvalues(y1, y2):
    """p-values of the first-token and joint two-token counts against the exact target distribution
    (the joint p-value is 0 if a zero-probability pair was emitted)."""
    P1, _, _ = lm_tables()
    N = y1.shape[0]
    first = torch.bincount(y1, minlength=V).double()
    joint_expected = (P0.view(V, 1) * P1).flatten().double() * N
    joint = torch.bincount(y1 * V + y2, minlength=V * V).double()
    zero = joint_expected == 0
    assert joint_expected[~zero].min() > 5
    p_first = chisquare(first.numpy(), (P0.double() * N).numpy()).pvalue
    if (joint[zero] > 0).any():
        return p_first, 0.0
    return p_first, chisquare(joint[~zero].numpy(), joint_expected[~zero].numpy()).pvalue


def test_sampled_tree_rule_is_lossless():
    y1, y2 = sample_two_tokens(sampled_rule)
    p_first, p_joint = chi2_pvalues(y1, y2)
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


def test_sampled_tree_rule_accepts_drafts():
    """The tree really is used: depth-2 paths, the repeated rank-2 token never (its p is 0 by then)."""
    P1, P2, _ = lm_tables()
    B = 4000
    b = tree_buffers(TREE)
    tokens, probs = tree_step_inputs(P0.expand(B, V), lambda a: P1[a].expand(B, V),
                                     lambda a, c: P2[a, c].expand(B, V))
    u, v = draw_tree_uniforms(B, b.max_depth, b.max_children, torch.Generator().manual_seed(1))
    n, best, out = accept_tree_sampled(tokens, probs, b.child_nodes, u, v)
    assert set(best.tolist()) == {0, 1, 2, 4, 6}         # node 3 (repeat of token 1) and node 5 (p = 0) never
    assert torch.equal(b.depth[best], n)
    assert ((out == PAD).sum(1) == 2 - n).all()
    # P(n = 2) = P(node 1) P1[0](2) + P(node 2) P1[1](4), P(node 1) = 0.35, P(node 2) = 0.65 * 0.25 / 0.65
    expected = 0.35 * P1[0, 2] + 0.25 * P1[1, 4]
    assert abs((n == 2).double().mean() - expected) < 4 * (expected * (1 - expected) / B) ** 0.5


def test_chi_square_detects_a_wrong_rule():
    y1, y2 = sample_two_tokens(always_accept_rule)
    p_first, p_joint = chi2_pvalues(y1, y2)
    assert p_first < 1e-3 and p_joint < 1e-3
    # the joint test alone also catches a wrong distribution after an accepted draft
    y1, y2 = sample_two_tokens(sampled_rule, wrong_child_probs=True)
    p_first, p_joint = chi2_pvalues(y1, y2)
    assert p_first > 1e-3 and p_joint < 1e-3


def test_typical_acceptance_is_lossy():
    y1, y2 = sample_two_tokens(typical_rule)
    p_first, _ = chi2_pvalues(y1, y2)
    assert p_first < 1e-3
    # the rank-0 root candidate (p = 0.35 > min(0.09, 0.3 exp(-H))) is emitted every time, not 35%
    assert (y1 == NODE_TOKENS[0]).all()
    assert "LOSSY" in accept_tree_typical.__doc__ and "NOT lossless" in accept_tree_typical.__doc__


def test_typical_hand_derived_and_one_hot_is_greedy():
    b = tree_buffers(SMALL)
    tokens = torch.tensor([[9, 3, 4, 5, 6, 7]])
    probs = torch.full((1, 6, 10), 0.01)
    probs[0, 0, 3], probs[0, 0, 4] = 0.5, 0.42              # both root children plausible
    probs[0, 1, 5], probs[0, 1, 6] = 0.46, 0.46             # both grandchildren under node 1 plausible
    probs[0, 2, 7] = 0.92
    # depth-2 candidates 3, 4, 5: log-likelihoods .5*.46, .5*.46, .42*.92 -> node 5 (0.386 > 0.23)
    n, best, out = accept_tree_typical(tokens, probs, b.parent, b.ancestors, torch.tensor([0.0]))
    assert (n.tolist(), best.tolist(), out[0, :2].tolist()) == ([2], [5], [4, 7])
    assert out[0, 2] == 0                                   # u = 0 draws the first token with p > 0
    probs[0, 2, 7] = 0.05                                   # now implausible: tie 3 vs 4 -> lowest index
    n, best, out = accept_tree_typical(tokens, probs, b.parent, b.ancestors, torch.tensor([0.0]))
    assert best.tolist() == [3] and out[0, :2].tolist() == [3, 5]
    tree = load_tree("mc_sim_7b_63")
    bb = tree_buffers(tree)
    tokens, targets = consistent_inputs(tree, 60, 4, 0.7, seed=5)
    one_hot = torch.nn.functional.one_hot(targets, 4).float()
    tn, _, tout = accept_tree_typical(tokens, one_hot, bb.parent, bb.ancestors, torch.rand(60))
    gn, _, gout = accept_tree_greedy(tokens, targets, bb.parent, bb.ancestors)
    assert torch.equal(tn, gn) and torch.equal(tout, gout)


# ----------------------------------------------------------------------------- tracing
class _Rules(nn.Module):
    def __init__(self, b, rule):
        super().__init__()
        self.rule = rule
        for name in ("parent", "ancestors", "child_nodes"):
            self.register_buffer(name, getattr(b, name))

    def forward(self, tokens, probs, u, v):
        if self.rule == "greedy":
            return accept_tree_greedy(tokens, probs.argmax(-1), self.parent, self.ancestors)
        if self.rule == "sampled":
            return accept_tree_sampled(tokens, probs, self.child_nodes, u, v)
        return accept_tree_typical(tokens, probs, self.parent, self.ancestors, v)


@pytest.mark.parametrize("rule", ["greedy", "sampled", "typical"])
def test_tree_rules_export_strict(rule):
    tree = load_tree("small_8")
    b = tree_buffers(tree)
    g = torch.Generator().manual_seed(2)
    B, Vs = 3, 11
    tokens = torch.randint(0, Vs, (B, tree.verify_size), generator=g)
    probs = torch.softmax(3 * torch.randn(B, tree.verify_size, Vs, generator=g), -1)
    u, v = draw_tree_uniforms(B, b.max_depth, b.max_children, g)
    module = _Rules(b, rule)
    ep = torch.export.export(module, (tokens, probs, u, v), strict=True)
    for seed in range(3):  # the exported graph is not specialised to the example values
        g.manual_seed(10 + seed)
        tokens = torch.randint(0, Vs, (B, tree.verify_size), generator=g)
        probs = torch.softmax(3 * torch.randn(B, tree.verify_size, Vs, generator=g), -1)
        tokens[:, 1] = probs[:, 0].argmax(-1)
        u, v = draw_tree_uniforms(B, b.max_depth, b.max_children, g)
        for got, want in zip(ep.module()(tokens, probs, u, v), module(tokens, probs, u, v)):
            assert torch.equal(got, want)


def test_draw_tree_uniforms():
    u, v = draw_tree_uniforms(4, 3, 2, torch.Generator().manual_seed(0))
    u2, v2 = draw_tree_uniforms(4, 3, 2, torch.Generator().manual_seed(0))
    assert u.shape == (4, 3, 2) and v.shape == (4,)
    assert torch.equal(u, u2) and torch.equal(v, v2)
    assert ((u >= 0) & (u < 1)).all()
