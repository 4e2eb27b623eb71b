"""On-device sampling: the empirical distribution matches the warped target distribution computed
independently with transformers' TemperatureLogitsWarper → TopKLogitsWarper → TopPLogitsWarper
(chi-square), directly and through the model's graphs; seeds reproduce; per-row parameters."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec import SamplingConfig
from specdec.core.sampling import needs_filter, sample, sampling_params, warp

from conftest import load, prompt_ids

V = 24
N = 20_000
P_MIN = 1e-3


def hf_warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
              prefilter: int | None = None) -> torch.Tensor:
    """Target distribution [V] (float64) by transformers' own warpers, in HF's order."""
    scores = logits.double().reshape(1, -1).clone()
    dummy = torch.zeros(1, 1, dtype=torch.long)
    if prefilter is not None:
        scores = TopKLogitsWarper(prefilter)(dummy, scores)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(dummy, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(dummy, scores)
    if top_p < 1.0:
        # guard: the nucleus boundary is not within float noise of top_p (else the target is ambiguous)
        sorted_p = torch.softmax(scores, -1).sort(descending=True).values.cumsum(-1)
        assert float((sorted_p - top_p).abs().min()) > 1e-4
        scores = TopPLogitsWarper(top_p)(dummy, scores)
    return torch.softmax(scores, dim=-1)[0]


def chi2_pvalue(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness of fit of sampled ``tokens`` to ``expected`` [V]. Tokens outside the
    support make the fit fail outright; cells with expected count < 5 are pooled."""
    counts = torch.bincount(tokens.flatten(), minlength=expected.numel()).double()
    n = counts.sum()
    if float(counts[expected == 0].sum()) > 0:
        return 0.0
    exp = expected[expected > 0] * n
    obs = counts[expected > 0]
    small = exp < 5
    if bool(small.any()):
        exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
        obs = torch.cat([obs[~small], obs[small].sum().reshape(1)])
    exp = exp * (obs.sum() / exp.sum())
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.fixture(scope="module")
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, generator=g) * 1.5


def draw(logits, top_k, top_p, temperature, global_topk=None, seed=0, n=N, top_filter=True):
    """n samples from ``sample`` for one row whose m=n positions share ``logits``."""
    params = sampling_params(1, top_k, top_p, temperature)
    uniform = torch.rand(1, n, generator=torch.Generator().manual_seed(seed))
    return sample(logits.expand(1, n, V).contiguous(), params, uniform, global_topk, top_filter=top_filter)


CASES = [  # temperature, top_k, top_p, global_topk
    (1.0, 0, 1.0, None),
    (0.6, 0, 1.0, None),
    (1.5, 5, 1.0, None),
    (0.8, 0, 0.7, None),
    (1.2, 10, 0.85, None),
    (0.9, 6, 0.9, 12),    # prefilter wider than top_k: exact
    (1.0, 0, 1.0, 8),     # prefilter alone acts as top-8
]


@pytest.mark.parametrize("temperature,top_k,top_p,global_topk", CASES)
def test_sample_matches_warped_distribution(logits, temperature, top_k, top_p, global_topk):
    tokens = draw(logits, top_k, top_p, temperature, global_topk)
    expected = hf_warped(logits, temperature, top_k, top_p, prefilter=global_topk)
    assert chi2_pvalue(tokens, expected) > P_MIN
    # the probabilities the sampler reports (used by speculative acceptance) are the same target
    params = sampling_params(1, top_k, top_p, temperature)
    _, probs = sample(logits.view(1, 1, V), params, torch.zeros(1, 1), global_topk, return_probs=True)
    torch.testing.assert_close(probs[0, 0].double(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_temperature_only_path_matches_warped_distribution(logits, temperature):
    """Without top-k / top-p the graphs skip the vocabulary sort (``top_filter=False``): same target
    distribution for the samples and for the probabilities returned to speculative acceptance."""
    params = sampling_params(1, 0, 1.0, temperature)
    assert not needs_filter(params, None)
    assert needs_filter(sampling_params(2, [0, 3], 1.0, temperature), None)
    assert needs_filter(sampling_params(1, 0, 0.9, temperature), None) and needs_filter(params, 8)
    expected = hf_warped(logits, temperature, 0, 1.0)
    assert chi2_pvalue(draw(logits, 0, 1.0, temperature, top_filter=False), expected) > P_MIN
    _, probs = sample(logits.view(1, 1, V), params, torch.zeros(1, 1), None, return_probs=True, top_filter=False)
    torch.testing.assert_close(probs[0, 0].double(), expected, atol=1e-6, rtol=1e-5)
    # a greedy row in the same call is the argmax, with a one-hot distribution
    both = sampling_params(2, 0, 1.0, [temperature, 0.0])
    tokens, probs = sample(logits.expand(2, 1, V).contiguous(), both, torch.rand(2, 1), None, True, top_filter=False)
    assert int(tokens[1, 0]) == int(logits.argmax()) and float(probs[1, 0, logits.argmax()]) == 1.0


@pytest.mark.parametrize("wrong", ["temperature", "top_k", "top_p"])
def test_chi_square_detects_a_wrong_distribution(logits, wrong):
    """The statistical check has power: samples at one setting do not fit another setting's target."""
    tokens = draw(logits, top_k=0, top_p=1.0, temperature=1.0)
    other = {"temperature": (0.7, 0, 1.0), "top_k": (1.0, 12, 1.0), "top_p": (1.0, 0, 0.9)}[wrong]
    assert chi2_pvalue(tokens, hf_warped(logits, *other)) < 1e-6
    assert chi2_pvalue(tokens, hf_warped(logits, 1.0, 0, 1.0)) > P_MIN


def test_greedy_rows_and_top_k_one_are_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, V, generator=g)
    params = sampling_params(4, [0, 1, 0, 1], [1.0, 1.0, 0.5, 0.3], [0.0, 1.0, 0.0, 2.0])
    tokens = sample(logits, params, torch.rand(4, 3, generator=g), None)
    assert torch.equal(tokens, logits.argmax(-1))
    # per-row warping: each row's probs equal HF for that row's own parameters
    params = sampling_params(3, [0, 4, 0], [1.0, 1.0, 0.6], [0.5, 1.0, 1.7])
    probs, ids = warp(logits[:3], params, None)
    full = torch.zeros(3, 3, V).scatter(-1, ids, probs)
    for r, (t, k, p) in enumerate([(0.5, 0, 1.0), (1.0, 4, 1.0), (1.7, 0, 0.6)]):
        for j in range(3):
            torch.testing.assert_close(full[r, j].double(), hf_warped(logits[r, j], t, k, p), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- through the graphs
ROWS = 2500       # 2 parameter groups × 1250 rows × 16 steps = 20k samples per group
STEPS = 16


@pytest.fixture(scope="module")
def wide(checkpoint):
    """A tiny model with many batch rows, so one graph call draws thousands of samples."""
    return load(checkpoint("llama"), batch_size=ROWS, n_positions=16, context_buckets=[8], kv_buckets=[16])


def test_graph_sampling_matches_warped_distribution(wide):
    group = [(0.7, 0, 0.9), (1.3, 6, 1.0)]   # (temperature, top_k, top_p) for rows [:1250], [1250:]
    half = ROWS // 2
    rep = lambda i: [group[0][i]] * half + [group[1][i]] * half  # noqa: E731
    params = wide.sampling_params(top_k=rep(1), top_p=rep(2), temperature=rep(0), do_sample=True)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.tensor(prompt_ids(5, seed=2))
    wide.prefill([prompt] * ROWS, params, gen)
    token = torch.full((ROWS, 1), 17)
    samples, ref_logits = [], None
    for _ in range(STEPS):
        out = wide.step(token, params, gen, advance=False)
        samples.append(out.tokens[:, 0])
        if ref_logits is None:
            ref_logits = out.logits[0, 0]
        torch.testing.assert_close(out.logits[:, 0], ref_logits.expand(ROWS, -1), atol=1e-5, rtol=1e-5)
    samples = torch.stack(samples, 1)                 # [ROWS, STEPS]
    assert wide.lengths.tolist() == [5] * ROWS
    expected = [hf_warped(ref_logits, *g) for g in group]
    assert chi2_pvalue(samples[:half], expected[0]) > P_MIN
    assert chi2_pvalue(samples[half:], expected[1]) > P_MIN
    assert chi2_pvalue(samples[:half], expected[1]) < 1e-6   # the groups really differ
    # the graph's returned warped probabilities equal the reference target
    out = wide.step(token, params, gen, advance=False, return_probs=True)
    torch.testing.assert_close(out.probs[0, 0].double(), expected[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.probs[-1, 0].double(), expected[1], atol=1e-6, rtol=1e-5)


def test_graph_without_top_filter_is_chosen_and_exact(wide):
    """Temperature-only requests run the sort-free graph, with the same target distribution."""
    half = ROWS // 2
    params = wide.sampling_params(temperature=[0.7] * half + [1.3] * half, do_sample=True)
    gen = torch.Generator().manual_seed(1)
    wide.prefill([torch.tensor(prompt_ids(5, seed=2))] * ROWS, params, gen)
    token = torch.full((ROWS, 1), 17)
    samples = torch.stack([wide.step(token, params, gen, advance=False).tokens[:, 0] for _ in range(STEPS)], 1)
    assert any(k.do_sample and not k.top_filter for k in wide.graphs.built)
    ref_logits = wide.step(token, params, gen, advance=False).logits[0, 0]
    assert chi2_pvalue(samples[:half], hf_warped(ref_logits, 0.7, 0, 1.0)) > P_MIN
    assert chi2_pvalue(samples[half:], hf_warped(ref_logits, 1.3, 0, 1.0)) > P_MIN
    assert chi2_pvalue(samples[:half], hf_warped(ref_logits, 1.3, 0, 1.0)) < 1e-6


# ----------------------------------------------------------------------------- generate()
N_NEW = 32


@pytest.fixture(scope="module")
def prompt():
    return prompt_ids(7, seed=21)


def test_seed_reproduces_and_different_seeds_differ(model3, prompt):
    kw = dict(max_new_tokens=N_NEW, eos_token_id=[], do_sample=True, temperature=1.0)
    a = model3.generate([prompt, prompt], seed=123, **kw)
    b = model3.generate([prompt, prompt], seed=123, **kw)
    c = model3.generate([prompt, prompt], seed=124, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a[:, 7:], c[:, 7:])
    assert a[0, 7:].tolist() != a[1, 7:].tolist()   # rows draw independent noise


def test_per_row_parameters(model3, prompt):
    greedy = model3.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[])[0, 7:].tolist()
    out = model3.generate([prompt] * 3, max_new_tokens=N_NEW, eos_token_id=[], do_sample=True, seed=5,
                          temperature=[0.0, 1.0, 1.0], top_k=[0, 0, 1], top_p=[1.0, 1.0, 1.0])
    assert out[0, 7:].tolist() == greedy          # temperature 0 → greedy
    assert out[1, 7:].tolist() != greedy          # sampled
    assert out[2, 7:].tolist() == greedy          # top_k = 1 → argmax


def test_do_sample_false_ignores_sampling_values(model3, prompt):
    greedy = model3.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[])
    out = model3.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[], do_sample=False,
                          temperature=1.5, top_k=3, seed=9)
    assert torch.equal(out, greedy)


def test_sampling_config_defaults_equal_explicit_arguments(checkpoint, model3, prompt):
    cfg = SamplingConfig(do_sample=True, temperature=0.8, top_k=5, top_p=0.9)
    configured = load(checkpoint("llama"), batch_size=3, sampling=cfg)
    a = configured.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[], seed=7)
    b = model3.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[], seed=7, do_sample=True,
                        temperature=0.8, top_k=5, top_p=0.9)
    assert torch.equal(a, b)
    greedy = model3.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[])
    assert not torch.equal(a, greedy)
