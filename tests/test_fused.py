"""Fused speculation (``specdec.fused``): one graph per step — draft loop, verification, acceptance —
for the draft model and EAGLE chains. Greedy output equals unfused and target-only output, sampling is
lossless (chi-square, 20,480 samples; a broken rule fails), a seed gives the same tokens fused and
unfused, the graph exports with torch.export (strict), rows join a running batch, on tiny models."""
import time

import pytest
import torch

import specdec.fused.step as fused_step
from specdec import DecoderModel, EagleDraft, PromptLookup, SpeculativeGenerator
from specdec.fused import FusedKey, FusedSpeculator, FusedStep

from test_eagle import matched_eagle, saved_target_and_eagle, tiny_target, write_eagle
from test_speculative import VOCAB, chi2_pvalue, exact_joint, lossless_pvalue, sampled_joint, save_tiny

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
WIDTH = max(map(len, PROMPTS))


def load(path, **kw) -> DecoderModel:
    kw = {"batch_size": 3, "n_positions": 128, "kv_buckets": [32, 64, 128], "context_buckets": [16, 32],
          "backend": "eager", "progress": False, **kw}
    return DecoderModel.from_pretrained(path, **kw)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    _, target_dir = save_tiny(tmp_path_factory, "fused-target", 2, 0)
    _, draft_dir = save_tiny(tmp_path_factory, "fused-draft", 1, 1)
    eagle_target, eagle = saved_target_and_eagle(tmp_path_factory.mktemp("fused-eagle"))
    root = tmp_path_factory.mktemp("fused-perfect")     # an EAGLE draft that is always right
    hf = tiny_target(5, layers=1)
    with torch.no_grad():
        hf.model.layers[0].self_attn.o_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
    hf.save_pretrained(root / "target")
    perfect = write_eagle(root / "eagle", hf, matched_eagle(hf))
    return dict(target=target_dir, draft=draft_dir, eagle_target=eagle_target, eagle=eagle,
                perfect_target=root / "target", perfect=perfect)


def pair(dirs, kind: str, **kw):
    """(target, proposer) for ``kind``: 'draft' (a random 1-layer draft), 'self' (the target's own
    checkpoint as the draft: every draft accepted), 'eagle' (a random EAGLE head), 'perfect-eagle'."""
    if kind in ("draft", "self"):
        target = load(dirs["target"], **kw)
        return target, load(dirs["target" if kind == "self" else "draft"], **kw)
    target = load(dirs["eagle_target" if kind == "eagle" else "perfect_target"], **kw)
    return target, EagleDraft.from_pretrained(dirs["eagle" if kind == "eagle" else "perfect"], target, progress=False)


# ---------------------------------------------------------------- greedy: fused == unfused == target-only
@pytest.mark.parametrize("kind", ["draft", "self", "eagle", "perfect-eagle"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_equals_unfused_and_target_only(dirs, kind, k):
    target, draft = pair(dirs, kind)
    reference = target.generate(PROMPTS, max_new_tokens=50, eos_token_id=[])
    unfused = SpeculativeGenerator(draft, target, k).sample(PROMPTS, max_new_tokens=50, eos_token_id=[])
    gen = SpeculativeGenerator(draft, target, k, fused=True)
    assert isinstance(gen.speculator, FusedSpeculator)
    assert torch.equal(unfused, reference)
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=50, eos_token_id=[]), reference)
    one = gen.sample([PROMPTS[2]], max_new_tokens=50, eos_token_id=[])          # batch 1 of a batch-3 model
    assert torch.equal(one[0, len(PROMPTS[2]):], reference[2, WIDTH:])
    if kind in ("self", "perfect-eagle"):
        assert gen.last_stats.acceptance_rate > 0.95


@pytest.mark.parametrize("kind", ["self", "perfect-eagle"])
def test_eos_inside_accepted_runs_cuts_like_target_only(dirs, kind):
    target, draft = pair(dirs, kind)
    free = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    eos = int(free[0, WIDTH + 6])                    # a token row 0 emits mid-way
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=eos)
    gen = SpeculativeGenerator(draft, target, 4, fused=True)
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=40, eos_token_id=eos), reference)
    assert gen.last_stats.acceptance_rate > 0.95      # so the EOS was an accepted draft, not a correction


@pytest.mark.parametrize("kind", ["self", "eagle"])
def test_runs_to_the_n_positions_end(dirs, kind):
    target, draft = pair(dirs, kind, n_positions=64, kv_buckets=[32, 64])
    reference = target.generate(PROMPTS, sequence_length=64, eos_token_id=[])
    out = SpeculativeGenerator(draft, target, 6, fused=True).sample(PROMPTS, sequence_length=64, eos_token_id=[])
    assert torch.equal(out, reference)
    assert int(target.lengths.max()) <= 64


def test_device_outputs_chain_the_steps(dirs, monkeypatch):
    """While the rows stay as the last step left them, a step's inputs are the previous graph call's
    outputs (no host copy); the output is still target-only's."""
    target, draft = pair(dirs, "self")
    gen = SpeculativeGenerator(draft, target, 3, fused=True)
    spec, chained = gen.speculator, []
    real = FusedSpeculator._chained_inputs

    def spy(self, tail, lengths, active):
        out = real(self, tail, lengths, active)
        chained.append(self._chain is not None and out[1] is self._chain[3])
        return out

    monkeypatch.setattr(FusedSpeculator, "_chained_inputs", spy)
    out = gen.sample(PROMPTS, max_new_tokens=30, eos_token_id=[])
    assert torch.equal(out, target.generate(PROMPTS, max_new_tokens=30, eos_token_id=[]))
    assert chained[0] is False and sum(chained) >= len(chained) - 2 >= 3
    assert spec._chain is not None


def test_rows_join_a_running_batch(dirs):
    target, draft = pair(dirs, "eagle")
    reference = target.generate(PROMPTS, max_new_tokens=20, eos_token_id=[])
    engine = SpeculativeGenerator(draft, target, 3, fused=True).engine
    a = engine.add(PROMPTS[0], max_new_tokens=20, eos_token_id=[])
    for _ in range(3):
        engine.step()
    b = engine.add(PROMPTS[2], max_new_tokens=20, eos_token_id=[])
    while engine.active_rows:
        engine.step()
    assert engine.rows[a].new == reference[0, WIDTH:].tolist()
    assert engine.rows[b].new == reference[2, WIDTH:].tolist()


# ---------------------------------------------------------------- sampling
@pytest.mark.parametrize("kind", ["draft", "eagle"])
@pytest.mark.parametrize("k", [1, 3])
def test_same_seed_same_tokens_as_unfused(dirs, kind, k):
    """The fused step draws the unfused step's random numbers in the same order: same tokens (one KV
    bucket, so both run the same shapes)."""
    target, draft = pair(dirs, kind, kv_buckets=[128])
    kw = dict(max_new_tokens=30, eos_token_id=[], do_sample=True, temperature=0.8, top_k=20, seed=5)
    unfused = SpeculativeGenerator(draft, target, k).sample(PROMPTS, **kw)
    fused = SpeculativeGenerator(draft, target, k, fused=True).sample(PROMPTS, **kw)
    assert torch.equal(fused, unfused)
    other = SpeculativeGenerator(draft, target, k, fused=True).sample(PROMPTS, **{**kw, "seed": 6})
    assert not torch.equal(other, fused)


@pytest.fixture(scope="module")
def lossless(tmp_path_factory):
    """A 16-token target, a draft that differs from it, and an EAGLE head that approximates it, at
    batch 512 (``test_speculative`` / ``test_eagle``'s constructions)."""
    target_hf, target_dir = save_tiny(tmp_path_factory, "fl-target", 2, 3, vocab=VOCAB)
    draft_hf, draft_dir = save_tiny(tmp_path_factory, "fl-draft", 2, 3, vocab=VOCAB)
    with torch.no_grad():
        torch.manual_seed(4)
        head = draft_hf.lm_head.weight
        head.mul_(0.5).add_(0.5 * head.std() * torch.randn_like(head))
    draft_hf.save_pretrained(draft_dir)
    eagle_hf = tiny_target(3, vocab=VOCAB, layers=1)
    with torch.no_grad():
        eagle_hf.model.layers[0].self_attn.o_proj.weight.mul_(0.5)
    root = tmp_path_factory.mktemp("fl-eagle")
    eagle_hf.save_pretrained(root / "target")
    eagle_dir = write_eagle(root / "eagle", eagle_hf, matched_eagle(eagle_hf, feature_weight=0.3))
    kw = dict(batch_size=512, n_positions=32, context_buckets=[8], kv_buckets=[32], backend="eager", progress=False)
    target = DecoderModel.from_pretrained(target_dir, **kw)
    eagle_target = DecoderModel.from_pretrained(root / "target", **kw)
    return {"draft": (target_hf, target, DecoderModel.from_pretrained(draft_dir, **kw)),
            "eagle": (eagle_hf, eagle_target, EagleDraft.from_pretrained(eagle_dir, eagle_target, progress=False))}


@pytest.mark.parametrize("kind,sample_kwargs", [
    ("draft", dict(temperature=0.7)),
    ("draft", dict(temperature=1.3, top_k=6, top_p=0.9)),
    ("eagle", dict(temperature=0.7)),
])
def test_sampling_is_lossless(lossless, kind, sample_kwargs):
    hf, target, draft = lossless[kind]
    gen = SpeculativeGenerator(draft, target, 2, fused=True)
    pvalue = lossless_pvalue(hf, target, gen, sample_kwargs, 3)      # 20,480 samples of 3 tokens
    assert 0.05 < gen.stats.acceptance_rate < 0.95                   # the draft really differs
    assert gen.stats.per_position_acceptance[1] > 0.01               # second drafts get accepted too
    assert pvalue > 1e-3


def test_a_broken_rule_is_detected(lossless, monkeypatch):
    """The same check fails when the fused graph's acceptance takes every draft (the test has power)."""
    hf, target, draft = lossless["draft"]

    def accept_all(drafts, target_probs, draft_probs, **kw):
        n = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long)
        return n, torch.cat([drafts, target_probs[:, -1].argmax(-1, keepdim=True)], 1)

    monkeypatch.setattr(fused_step, "accept", accept_all)
    params = target.sampling_params(None, None, 0.7, True)[:1]
    exact = exact_joint(hf, [3, 1, 4], params, 2)
    counts = sampled_joint(SpeculativeGenerator(draft, target, 2, fused=True), [3, 1, 4], 512, 2, 20,
                           dict(temperature=0.7))
    assert chi2_pvalue(exact, counts) < 1e-6


# ---------------------------------------------------------------- graphs and errors
@pytest.mark.parametrize("kind", ["draft", "eagle"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_fused_graph_exports_strict_and_matches_eager(dirs, kind, do_sample):
    target, draft = pair(dirs, kind)
    proposer = draft if kind == "eagle" else SpeculativeGenerator(draft, target, 3).proposer
    key = FusedKey(3, 32, 32, do_sample, width=4 if kind == "eagle" else 0)
    module = FusedStep(target.lm, proposer.fused_drafter(key), key, None)
    inputs = module.example_inputs(target.batch_size)
    exported = torch.export.export(module, inputs, strict=True)
    eager = module(*inputs)
    for a, b in zip(exported.module()(*inputs), eager):
        assert torch.equal(a, b)
    mutated = set(exported.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert sum(".k_cache" in m or ".v_cache" in m for m in mutated) == 2 * (target.config.num_layers + 1)
    if kind == "eagle":
        assert {"drafter.features", "drafter.next_tokens"} <= mutated


def test_compiled_backend_equals_eager(dirs):
    target, draft = pair(dirs, "eagle", backend="compiled", kv_buckets=[64], batch_size=1)
    eager_target, eager_draft = pair(dirs, "eagle", kv_buckets=[64], batch_size=1)
    kw = dict(max_new_tokens=20, eos_token_id=[])
    reference = eager_target.generate([PROMPTS[0]], **kw)
    assert torch.equal(SpeculativeGenerator(draft, target, 3, fused=True).sample([PROMPTS[0]], **kw), reference)


def test_unfusable_proposers_and_penalty(dirs):
    target, draft = pair(dirs, "draft")
    with pytest.raises(ValueError, match="fused speculation needs a chain proposer.*PromptLookup.*fused=False"):
        SpeculativeGenerator(PromptLookup(target), target, 3, fused=True)
    # the repetition penalty is applied by the fused graph's verification: still target-only's output
    kw = dict(max_new_tokens=30, eos_token_id=[], repetition_penalty=1.5)
    reference = target.generate(PROMPTS, **kw)
    gen = SpeculativeGenerator(draft, target, 3, fused=True)
    assert torch.equal(gen.sample(PROMPTS, **kw), reference)
    assert all(key.penalty for key in gen.speculator.graphs)


def test_bench_graph_clock_times_graph_calls_without_touching_the_graph_tables(dirs):
    """bench-spec's GraphClock: steps counted, graph time inside the wall time, and the speculator's and
    models' graph tables untouched (a later generator must find the graphs built under the clock)."""
    from specdec.tools.bench.speculative import GraphClock
    target, draft = pair(dirs, "eagle")
    gen = SpeculativeGenerator(draft, target, 3, fused=True)
    tables = (target.graphs.built, gen.speculator.graphs)
    clock = GraphClock()
    clock.watch(gen.engine, [target, gen.proposer.model, gen.speculator])
    start = time.perf_counter()
    gen.generate(PROMPTS, max_new_tokens=12, eos_token_id=[])
    clock.add_wall(time.perf_counter() - start)
    timing = clock.per_step()
    assert 0 < timing["steps"] <= 11 and timing["graph_ms_per_step"] > 0 and timing["outside_graphs_ms_per_step"] > 0
    assert target.graphs.built is tables[0] and gen.speculator.graphs is tables[1] and tables[1]
    assert SpeculativeGenerator(draft, target, 3, fused=True).speculator.graphs is gen.speculator.graphs
