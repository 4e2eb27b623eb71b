"""SpecStats: counts add up, derived values follow vLLM's definitions, merge/reset/to_dict."""
from __future__ import annotations

import json

import pytest
import torch

from specdec import SpecStats
from specdec.speculation.acceptance import accept_rejection, draw_uniforms


def _random_steps(seed, steps=30, B=8, k=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        drafted = torch.randint(0, k + 1, (B,), generator=g)
        accepted = (torch.rand(B, generator=g) * (drafted + 1)).long().clamp(max=drafted)
        active = torch.rand(B, generator=g) < 0.8
        out.append((accepted, drafted, active))
    return out


def _check_invariants(s: SpecStats):
    assert 0 <= s.accepted <= s.drafted
    assert sum(s.accepted_histogram) == s.steps
    assert sum(m * c for m, c in enumerate(s.accepted_histogram)) == s.accepted
    assert len(s.accepted_histogram) == s.k_max + 1
    assert sum(s.accepted_per_position) == s.accepted
    if s.steps:
        tau_hist = 1 + sum(m * c for m, c in enumerate(s.accepted_histogram)) / s.steps
        assert s.mean_acceptance_length == pytest.approx(tau_hist)
        assert s.mean_acceptance_length == pytest.approx(1 + sum(s.per_position_acceptance))
        # per position i: steps that accepted more than i
        for i, a in enumerate(s.accepted_per_position):
            assert a == sum(s.accepted_histogram[i + 1:])
    ppa = s.per_position_acceptance
    assert all(a >= b for a, b in zip(ppa, ppa[1:]))  # chains: non-increasing
    assert all(0.0 <= a <= 1.0 for a in ppa)


def test_counts_add_up_by_hand():
    s = SpecStats()
    s.update(torch.tensor([0, 2, 4]), torch.tensor([4, 4, 4]))
    s.update(torch.tensor([1, 3, 3]), 4, active=torch.tensor([True, False, True]))
    assert s.steps == 5 and s.drafted == 20 and s.accepted == 0 + 2 + 4 + 1 + 3
    assert s.emitted == s.accepted + s.steps
    assert s.accepted_histogram == [1, 1, 1, 1, 1]
    assert s.accepted_per_position == [4, 3, 2, 1]
    assert s.mean_acceptance_length == pytest.approx(1 + 10 / 5)
    assert s.acceptance_rate == pytest.approx(10 / 20)
    assert s.per_position_acceptance == pytest.approx([0.8, 0.6, 0.4, 0.2])
    _check_invariants(s)
    assert "tau=3.000" in str(s)


def test_empty_and_plain_decoding():
    s = SpecStats()
    assert s.mean_acceptance_length == 1.0 and s.acceptance_rate == 0.0 and s.per_position_acceptance == []
    s.update(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))  # no drafts: plain steps
    assert s.steps == 4 and s.mean_acceptance_length == 1.0 and s.acceptance_rate == 0.0
    assert s.accepted_histogram == [4] and s.emitted == 4
    _check_invariants(s)


def test_random_updates_invariants_and_growth():
    s = SpecStats()
    for i, (a, d, m) in enumerate(_random_steps(0)):
        if i == 10:  # k grows mid-run
            d = d + 2
        s.update(a, d, m)
        _check_invariants(s)
    assert s.k_max == 7
    s.update([1], [1], emitted=[0])  # a row that stopped (emitted override)
    _check_invariants(s)


def test_rejects_inconsistent_counts():
    with pytest.raises(ValueError):
        SpecStats().update(torch.tensor([3]), torch.tensor([2]))
    with pytest.raises(ValueError):
        SpecStats().update(torch.tensor([1, 1]), torch.tensor([2, 2, 2]))


def test_merge_add_reset_and_round_trip():
    steps = _random_steps(1)
    whole, a, b = SpecStats(), SpecStats(), SpecStats()
    for i, (acc, dr, act) in enumerate(steps):
        whole.update(acc, dr, act)
        (a if i < 10 else b).update(acc, dr[:], act)
    a.add_time(draft_s=1.0, verify_s=2.0)
    b.add_time(other_s=0.5)
    whole.add_time(1.0, 2.0, 0.5)
    assert (a + b).to_dict() == whole.to_dict()
    assert sum([a, b]).to_dict() == whole.to_dict()
    c = SpecStats().merge(a).merge(b)
    assert c == whole
    assert a.steps + b.steps == whole.steps  # __add__ did not modify its operands

    d = whole.to_dict()
    json.dumps(d)
    for key in ("steps", "drafted", "accepted", "emitted", "accepted_per_position", "accepted_histogram",
                "draft_s", "verify_s", "other_s", "mean_acceptance_length", "acceptance_rate",
                "per_position_acceptance", "total_s", "tokens_per_s"):
        assert key in d
    assert SpecStats.from_dict(d) == whole
    assert SpecStats.from_dict(json.loads(json.dumps(d))) == whole

    whole.reset()
    assert whole == SpecStats()


def test_timer():
    s = SpecStats()
    with s.timer("verify"):
        sum(range(1000))
    assert s.verify_s > 0 and s.draft_s == 0 and s.total_s == s.verify_s
    with pytest.raises(ValueError):
        with s.timer("bogus"):
            pass


def test_stats_from_real_acceptance_chain():
    """Feeding the acceptor's outputs: accepted <= drafted and per-position acceptance decreases."""
    g = torch.Generator().manual_seed(3)
    B, k, V = 2000, 4, 6
    s = SpecStats()
    for _ in range(3):
        p = torch.softmax(torch.randn(B, k + 1, V, generator=g), -1)
        q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
        draft = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, k)
        nd = torch.randint(0, k + 1, (B,), generator=g)
        u, v = draw_uniforms(B, k, g)
        n, _ = accept_rejection(draft, q, p, u, v, nd)
        s.update(n, nd)
    _check_invariants(s)
    assert s.per_position_acceptance[0] > s.per_position_acceptance[-1] > 0
    assert 1.0 < s.mean_acceptance_length < 1 + k
