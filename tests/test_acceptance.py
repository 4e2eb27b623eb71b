"""Acceptance rules: exactness of the greedy rule, losslessness of the sampling rules (chi-square
against target-only sampling, with deliberately wrong acceptors that must fail the same check),
num_drafts handling, edge cases, and traceability with torch.export."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.speculation import acceptance as acc_mod
from specdec.speculation.acceptance import (
    accept,
    accept_greedy,
    accept_one_hot,
    accept_rejection,
    draw_uniforms,
    last_tokens,
)

PAD = -1


pytestmark = pytest.mark.usefixtures("single_thread")


# ----------------------------------------------------------------------------- greedy
def ref_greedy(draft, target, num_drafts):
    """Brute-force host loop: the reference for the greedy rule."""
    B, k = draft.shape
    ns, outs = [], []
    for b in range(B):
        row = []
        n = 0
        for j in range(int(num_drafts[b])):
            if int(draft[b, j]) != int(target[b, j]):
                break
            row.append(int(draft[b, j]))
            n += 1
        row.append(int(target[b, n]))
        row += [PAD] * (k + 1 - len(row))
        ns.append(n)
        outs.append(row)
    return torch.tensor(ns), torch.tensor(outs)


@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_greedy_matches_reference_loop(k):
    g = torch.Generator().manual_seed(100 + k)
    B, V = 400, 3  # tiny vocab: long matching prefixes are common
    target = torch.randint(0, V, (B, k + 1), generator=g)
    draft = torch.randint(0, V, (B, k), generator=g)
    # force some all-accepted rows and some none-accepted rows
    draft[:50] = target[:50, :k]
    if k:
        draft[50:100, 0] = (target[50:100, 0] + 1) % V
    num_drafts = torch.randint(0, k + 1, (B,), generator=g)
    num_drafts[:25] = k
    for nd in (None, num_drafts):
        n, out = accept_greedy(draft, target, nd)
        ref_n, ref_out = ref_greedy(draft, target, torch.full((B,), k) if nd is None else nd)
        assert torch.equal(n, ref_n)
        assert torch.equal(out, ref_out)
    # the crafted cases really occurred
    n, _ = accept_greedy(draft, target, num_drafts)
    assert (n[:25] == k).all()
    if k:
        assert (n[50:100] == 0).all()
        assert ((num_drafts < k) & (n == num_drafts)).any()


def test_greedy_through_dispatcher_and_probs():
    g = torch.Generator().manual_seed(1)
    B, k, V = 64, 4, 6
    logits = torch.randn(B, k + 1, V, generator=g)
    target = logits.argmax(-1)
    draft = torch.where(torch.rand(B, k, generator=g) < 0.7, target[:, :k], torch.randint(0, V, (B, k), generator=g))
    ref = accept_greedy(draft, target)
    assert all(torch.equal(a, b) for a, b in zip(accept(draft, target_tokens=target), ref))
    assert all(torch.equal(a, b) for a, b in zip(accept(draft, torch.softmax(logits, -1), greedy_rows=True), ref))
    # greedy rows in a sampled batch are exact; others come from the sampled rule with the same noise
    probs = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    u, v = draw_uniforms(B, k, torch.Generator().manual_seed(5))
    greedy_rows = torch.arange(B) % 2 == 0
    n, out = accept(draft, probs, q, target_tokens=target, greedy_rows=greedy_rows, uniform=u, residual_uniform=v)
    sn, sout = accept_rejection(draft, q, probs, u, v)
    assert torch.equal(n[greedy_rows], ref[0][greedy_rows]) and torch.equal(out[greedy_rows], ref[1][greedy_rows])
    assert torch.equal(n[~greedy_rows], sn[~greedy_rows]) and torch.equal(out[~greedy_rows], sout[~greedy_rows])


def test_one_hot_target_reduces_to_greedy():
    """A temperature-0 row after warping has p one-hot on the argmax: the sampled rules must then
    behave exactly like the greedy rule, whatever the noise."""
    g = torch.Generator().manual_seed(2)
    B, k, V = 256, 5, 4
    target = torch.randint(0, V, (B, k + 1), generator=g)
    p = torch.nn.functional.one_hot(target, V).float()
    draft = torch.where(torch.rand(B, k, generator=g) < 0.8, target[:, :k], torch.randint(0, V, (B, k), generator=g))
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    nd = torch.randint(0, k + 1, (B,), generator=g)
    u, v = draw_uniforms(B, k, g)
    ref = accept_greedy(draft, target, nd)
    for res in (accept_rejection(draft, q, p, u, v, nd), accept_one_hot(draft, p, u, v, nd)):
        assert torch.equal(res[0], ref[0]) and torch.equal(res[1], ref[1])


# ----------------------------------------------------------------------------- sampling: structure
def test_output_structure_and_num_drafts():
    g = torch.Generator().manual_seed(3)
    B, k, V = 500, 4, 7
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    draft = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, k)
    nd = torch.randint(0, k + 1, (B,), generator=g)
    u, v = draw_uniforms(B, k, g)
    for n, out in (accept_rejection(draft, q, p, u, v, nd), accept_one_hot(draft, p, u, v, nd)):
        assert n.dtype == torch.long and out.shape == (B, k + 1)
        assert (n >= 0).all() and (n <= nd).all()
        pos = torch.arange(k + 1)
        assert ((out == PAD) == (pos > n[:, None])).all()                 # pad exactly after n
        assert torch.equal(torch.where(pos[:k] < n[:, None], out[:, :k], draft), draft)  # accepted = drafts
        y = last_tokens(out, n)
        assert ((y >= 0) & (y < V)).all()
    # num_drafts = 0 is a plain sampling step from p_0
    n, out = accept_rejection(draft, q, p, u, v, torch.zeros(B, dtype=torch.long))
    assert (n == 0).all() and (out[:, 1:] == PAD).all()


def test_reproducible_with_seeded_generator():
    g = torch.Generator().manual_seed(4)
    B, k, V = 32, 3, 9
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    draft = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, k)
    a = accept(draft, p, q, generator=torch.Generator().manual_seed(7))
    b = accept(draft, p, q, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_inverse_cdf_never_picks_zero_probability_tokens():
    B, V = 6, 8
    p = torch.zeros(B, 1, V)
    p[:, 0, 2] = 0.25
    p[:, 0, 5] = 0.75  # leading, middle and trailing zeros
    draft = torch.zeros(B, 0, dtype=torch.long)
    v = torch.tensor([0.0, 1e-12, 0.25, 0.2499999, 1.0 - 2**-24, 0.9999])
    n, out = accept_one_hot(draft, p, torch.zeros(B, 0), v)
    assert out[:, 0].tolist() == [2, 2, 5, 2, 5, 5]


def test_residual_zero_falls_back_to_p():
    """p == q and the drafted token has q(x) = p(x) = 0: rejected, residual max(p-q,0) is all zero,
    so the correction must come from p (valid token, distributed as p)."""
    g = torch.Generator().manual_seed(6)
    N, V = 20000, 5
    p1 = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4])
    p = p1.expand(N, 2, V).clone()
    q = p[:, :1].clone()
    draft = torch.zeros(N, 1, dtype=torch.long)  # q(0) = 0
    u, v = draw_uniforms(N, 1, g)
    n, out = accept_rejection(draft, q, p, u, v)
    assert (n == 0).all()
    counts = torch.bincount(out[:, 0], minlength=V)
    assert counts[0] == 0
    assert chisquare(counts[1:].numpy(), (p1[1:] * N).numpy()).pvalue > 1e-3
    # and a p == q draft with positive probability is always accepted
    n, _ = accept_rejection(torch.full((N, 1), 3), q, p, u, v)
    assert (n == 1).all()


# ----------------------------------------------------------------------------- sampling: lossless
V_CHAIN, K_CHAIN, T_CHAIN, N_CHAIN, C0 = 5, 3, 3, 60000, 0


def _chain_matrices():
    """Target P[prev] and a deliberately different draft Q[prev] over V tokens (Markov chains)."""
    g = torch.Generator().manual_seed(1234)
    V = V_CHAIN
    P = 0.5 * torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64), -1) + 0.5 / V
    P[torch.arange(V), (torch.arange(V) + 2) % V] = 0.0  # warping-style zeros in the target
    P = P / P.sum(-1, keepdim=True)
    Q = torch.softmax(3.0 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    Q[torch.arange(V), (torch.arange(V) + 1) % V] = 0.0  # tokens the draft never proposes
    Q = Q / Q.sum(-1, keepdim=True)
    return P.double(), Q.double()


def run_chain(acceptor, P, Q, *, one_hot, seed, vary_num_drafts=True, use_num_drafts=True):
    """Generate T tokens per row by speculation on a Markov target P with draft Q; returns [N, T].

    Rows draft ``num_drafts`` <= k real tokens per step; positions beyond hold garbage (token 0,
    q = p = one-hot(0)) that would be accepted if num_drafts were ignored. Deterministic proposals
    use the draft's argmax.
    """
    N, V, k, T = N_CHAIN, V_CHAIN, K_CHAIN, T_CHAIN
    g = torch.Generator().manual_seed(seed)
    prev = torch.full((N,), C0)
    emitted = torch.full((N, T), -1)
    count = torch.zeros(N, dtype=torch.long)
    garbage = torch.nn.functional.one_hot(torch.zeros(N, dtype=torch.long), V).double()
    rows = torch.arange(N)
    while bool((count < T).any()):
        nd = torch.randint(0, k + 1, (N,), generator=g) if vary_num_drafts else torch.full((N,), k)
        xs, qs, ps = [], [], []
        cur = prev
        for j in range(k + 1):
            real = (j <= nd).view(N, 1)
            ps.append(torch.where(real, P[cur], garbage))  # p_j conditioned on the real drafts before j
            if j == k:
                break
            qj = Q[cur]
            xj = qj.argmax(-1) if one_hot else torch.multinomial(qj, 1, generator=g).squeeze(1)
            real = j < nd
            xj = torch.where(real, xj, torch.zeros_like(xj))
            qs.append(torch.where(real.view(N, 1), qj, garbage))
            xs.append(xj)
            cur = xj
        draft, q, p = torch.stack(xs, 1), torch.stack(qs, 1), torch.stack(ps, 1)
        u, v = draw_uniforms(N, k, g, dtype=torch.float64)
        n, out = acceptor(draft, None if one_hot else q, p, u, v, nd if use_num_drafts else None)
        for i in range(k + 1):
            slot = count + i
            write = (i <= n) & (slot < T)
            emitted[rows[write], slot[write]] = out[write, i]
        count = count + n + 1
        prev = last_tokens(out, n)
    return emitted


def chain_pvalues(emitted, P):
    """Chi-square p-values of (first token, joint of the first T tokens) against target-only sampling."""
    V, T = V_CHAIN, T_CHAIN
    assert (emitted >= 0).all()
    first_exp = P[C0]
    joint_exp = torch.ones([V] * T, dtype=torch.float64)
    prev = torch.full([V] * T, C0)
    for t in range(T):
        tok = torch.arange(V).view([V if s == t else 1 for s in range(T)]).expand([V] * T)
        joint_exp = joint_exp * P[prev, tok]
        prev = tok
    out = []
    joint_idx = emitted @ (V ** torch.arange(T - 1, -1, -1))
    for obs_idx, exp in ((emitted[:, 0], first_exp), (joint_idx, joint_exp.flatten())):
        obs = torch.bincount(obs_idx, minlength=exp.numel()).double()
        zero = exp == 0
        if bool((obs[zero] > 0).any()):
            out.append(0.0)  # a token the target can never produce
            continue
        exp = exp[~zero] * obs.sum() / exp[~zero].sum()
        out.append(float(chisquare(obs[~zero].numpy(), exp.numpy()).pvalue))
    return out


def _rejection(draft, q, p, u, v, nd):
    return accept_rejection(draft, q, p, u, v, nd)


def _one_hot(draft, q, p, u, v, nd):
    return accept_one_hot(draft, p, u, v, nd)


def _dispatch(draft, q, p, u, v, nd):
    return accept(draft, p, q, num_drafts=nd, uniform=u, residual_uniform=v)


@pytest.mark.parametrize("acceptor,one_hot,vary", [(_rejection, False, True), (_one_hot, True, True),
                                                   (_dispatch, False, False), (_dispatch, True, False)])
def test_lossless_chain(acceptor, one_hot, vary):
    """Joint law of the first T emitted tokens (over several speculation steps, rows drafting a
    random 0..k tokens when ``vary``) equals target-only sampling from the Markov chain P."""
    P, Q = _chain_matrices()
    emitted = run_chain(acceptor, P, Q, one_hot=one_hot, seed=11, vary_num_drafts=vary)
    p_first, p_joint = chain_pvalues(emitted, P)
    assert p_first > 1e-3, p_first
    assert p_joint > 1e-3, p_joint


def test_lossless_single_step_first_token_float32():
    """First emitted token ~ p_0 for a single step with float32 probabilities, full k drafts."""
    g = torch.Generator().manual_seed(21)
    N, k, V = 40000, 2, 6
    p0 = torch.tensor([0.05, 0.30, 0.0, 0.25, 0.15, 0.25])
    q0 = torch.tensor([0.50, 0.05, 0.20, 0.0, 0.05, 0.20])
    p = torch.softmax(torch.randn(k + 1, V, generator=g), -1)
    p[0] = p0
    q = torch.softmax(torch.randn(k, V, generator=g), -1)
    q[0] = q0
    p, q = p.expand(N, -1, -1), q.expand(N, -1, -1)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(N, k)
    u, v = draw_uniforms(N, k, g)
    for _n, out in (accept_rejection(draft, q, p, u, v), accept_one_hot(draft, p, u, v)):
        counts = torch.bincount(out[:, 0], minlength=V)
        assert counts[2] == 0
        keep = p0 > 0
        assert chisquare(counts[keep].numpy(), (p0[keep] / p0[keep].sum() * N).numpy()).pvalue > 1e-3


# ----------------------------------------------------------------------------- the test has power
def _always_accept(draft, q, p, u, v, nd):
    return accept_rejection(draft, q, p, torch.zeros_like(u), v, nd)


def _one_hot_always_accept(draft, q, p, u, v, nd):
    return accept_one_hot(draft, p, torch.zeros_like(u), v, nd)


def _bonus_from_draft(draft, q, p, u, v, nd):
    """Wrong: treats the draft distribution as the target when sampling the correction token."""
    qp = torch.cat([q, p[:, -1:]], 1)
    return accept_rejection(draft, q, qp, u, v, nd)


@pytest.mark.parametrize("wrong,one_hot", [(_always_accept, False), (_one_hot_always_accept, True),
                                           (_bonus_from_draft, False)])
def test_wrong_acceptors_fail(wrong, one_hot):
    P, Q = _chain_matrices()
    p_first, p_joint = chain_pvalues(run_chain(wrong, P, Q, one_hot=one_hot, seed=11), P)
    assert min(p_first, p_joint) < 1e-8, (p_first, p_joint)


@pytest.mark.parametrize("acceptor,one_hot", [(_rejection, False), (_one_hot, True)])
def test_resampling_from_p_instead_of_residual_fails(monkeypatch, acceptor, one_hot):
    monkeypatch.setattr(acc_mod, "_correction_distribution", lambda p_n, q_n, x_n, is_bonus: p_n)
    P, Q = _chain_matrices()
    p_first, p_joint = chain_pvalues(run_chain(acceptor, P, Q, one_hot=one_hot, seed=11), P)
    assert min(p_first, p_joint) < 1e-8, (p_first, p_joint)


@pytest.mark.parametrize("acceptor,one_hot", [(_rejection, False), (_one_hot, True)])
def test_ignoring_num_drafts_fails(acceptor, one_hot):
    P, Q = _chain_matrices()
    emitted = run_chain(acceptor, P, Q, one_hot=one_hot, seed=11, use_num_drafts=False)
    p_first, p_joint = chain_pvalues(emitted, P)
    assert min(p_first, p_joint) < 1e-8, (p_first, p_joint)


# ----------------------------------------------------------------------------- graph friendliness
def test_exports_strict_static_shapes():
    class Step(torch.nn.Module):
        def forward(self, draft, q, p, target, u, v, nd):
            a = accept_rejection(draft, q, p, u, v, nd)
            b = accept_one_hot(draft, p, u, v, nd)
            c = accept_greedy(draft, target, nd)
            return a + b + c

    g = torch.Generator().manual_seed(9)
    B, k, V = 4, 3, 11
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    draft = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, k)
    u, v = draw_uniforms(B, k, g)
    args = (draft, q, p, p.argmax(-1), u, v, torch.tensor([3, 2, 0, 1]))
    ep = torch.export.export(Step(), args, strict=True)
    for got, want in zip(ep.module()(*args), Step()(*args)):
        assert torch.equal(got, want)
