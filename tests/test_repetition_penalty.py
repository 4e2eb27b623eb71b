"""Per-row ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``), applied on device
inside the target's graphs: target-only greedy equals transformers, per-row penalties are independent,
the verify graph penalises each position by its own prefix (chain and tree), speculation stays exact
(greedy: every strategy; sampling: chi-square against the exact penalised distribution), rows joining a
running batch, validation, the command line, export and the compiled backend."""
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from specdec import DraftModel, EagleDraft, Engine, MedusaDraft, PromptLookup, SpeculativeGenerator
from specdec.core.graphs import GraphKey, StepGraph, build_graph

from conftest import hf_logits, load, prompt_ids
from test_cli import generate_args, new_ids, restore_threads, run  # noqa: F401  (autouse fixture)
from test_eagle import matched_eagle, tiny_target, write_eagle
from test_export import TREES, tree_inputs
from test_medusa import SMALL_TREE, draft_for, lossless, oracle_heads, token_map_target  # noqa: F401
from test_speculative import chi2_pvalue, exact_joint, lossless_models, lossless_pvalue, sampled_joint  # noqa: F401

N_NEW = 24
REPEATING = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]          # prompt lookup finds continuations
PROMPTS = [REPEATING, prompt_ids(7, 5, 64), prompt_ids(12, 6, 64)]   # valid for vocabularies 64 and 160


@torch.no_grad()
def hf_generate(hf, prompt: list[int], n: int, penalty: float) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_penalised(hf, ids: list[int], penalty: float) -> torch.Tensor:
    """transformers' logits [V] after ``ids``, with its repetition penalty over ``ids``."""
    logits = hf_logits(hf, ids)[-1:]
    return RepetitionPenaltyLogitsProcessor(float(penalty))(torch.tensor([ids]), logits)[0]


# ---------------------------------------------------------------- target only
@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_equals_transformers(ckpt, model3, penalty):
    for prompt in (prompt_ids(9, seed=1), REPEATING):
        out = model3.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[], repetition_penalty=penalty)
        new = out[0, len(prompt):].tolist()
        assert new == hf_generate(ckpt.hf, prompt, N_NEW, penalty)
        plain = model3.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[])[0, len(prompt):].tolist()
        assert new != plain                          # the penalty changes the output
    assert any(k.penalty for k in model3.graphs.built)


def test_penalty_one_runs_the_plain_graphs(ckpt):
    model = load(ckpt)
    prompt = prompt_ids(9, seed=1)
    out = model.generate([prompt], max_new_tokens=N_NEW, eos_token_id=[], repetition_penalty=1.0)
    assert out[0, len(prompt):].tolist() == hf_generate(ckpt.hf, prompt, N_NEW, 1.0)
    assert model.graphs.built and not any(k.penalty for k in model.graphs.built)


def test_mixed_per_row_penalties_match_single_runs(model3):
    prompts = [prompt_ids(5, seed=11), REPEATING, prompt_ids(9, seed=12)]
    penalties = [1.3, 1.0, 0.8]
    out = model3.generate(prompts, max_new_tokens=N_NEW, eos_token_id=[], repetition_penalty=penalties)
    width = max(map(len, prompts))
    for i, (p, penalty) in enumerate(zip(prompts, penalties)):
        alone = model3.generate([p], max_new_tokens=N_NEW, eos_token_id=[], repetition_penalty=penalty)
        assert out[i, width:].tolist() == alone[0, len(p):].tolist()
    plain = model3.generate(prompts, max_new_tokens=N_NEW, eos_token_id=[])
    assert torch.equal(out[1], plain[1]) and not torch.equal(out[0], plain[0])


def test_verify_graph_penalises_each_tree_node_by_its_own_path(ckpt):
    """A multi-token step with a tree mask: node i's logits are transformers' logits after prompt +
    the path root..i, penalised over exactly those tokens (not over siblings' or other branches')."""
    model = load(ckpt, batch_size=2, n_positions=32, context_buckets=[16], kv_buckets=[32])
    model.track_presence()
    prompts = [prompt_ids(5, seed=61), prompt_ids(11, seed=62)]
    penalties = [1.5, 0.7]
    params = model.sampling_params(do_sample=False, repetition_penalty=penalties)
    for r, p in enumerate(prompts):
        model.reset_presence(r, p)
    model.prefill([torch.tensor(p) for p in prompts], params)
    # node tokens from a small pool (two prompt tokens, two new ones): branches repeat each other
    g = torch.Generator().manual_seed(5)
    pools = [torch.tensor(p[:2] + [150, 151]) for p in prompts]
    tokens = torch.stack([pool[torch.randint(4, (len(TREES[0]),), generator=g)] for pool in pools])
    masks, depths = zip(*[tree_inputs(t)[:2] for t in TREES])
    out = model.step(tokens, params, token_mask=torch.stack(masks),
                     position_ids=model.lengths.unsqueeze(1) + torch.stack(depths), advance=False)
    for r, (prompt, parents) in enumerate(zip(prompts, TREES)):
        for path in tree_inputs(parents)[2]:
            for d, node in enumerate(path):
                ref = hf_penalised(ckpt.hf, prompt + tokens[r, path[:d + 1]].tolist(), penalties[r])
                torch.testing.assert_close(out.logits[r, node], ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(out.tokens, out.logits.argmax(-1))
    model.presence = None                         # not tracked: the same step runs the plain graph
    raw = model.step(tokens, params, token_mask=torch.stack(masks),
                     position_ids=model.lengths.unsqueeze(1) + torch.stack(depths), advance=False)
    assert not torch.allclose(raw.logits, out.logits, atol=1e-3)


# ---------------------------------------------------------------- speculation: greedy
@pytest.fixture(scope="module")
def strategies(checkpoint, tmp_path_factory):
    """strategy → (target loader for a batch size, proposer for a target, k)."""
    root = tmp_path_factory.mktemp("penalty-strategies")
    eagle_hf = tiny_target(5, layers=1)      # next token = f(current token), which the EAGLE draft computes
    with torch.no_grad():
        eagle_hf.model.layers[0].self_attn.o_proj.weight.zero_()
        eagle_hf.model.norm.weight.fill_(1.0)
    eagle_hf.save_pretrained(root / "eagle-target")
    eagle = write_eagle(root / "eagle", eagle_hf, matched_eagle(eagle_hf))
    medusa_hf = token_map_target(0, 64, 64)
    medusa_hf.save_pretrained(root / "medusa-target")
    heads = oracle_heads(medusa_hf, 4, 2.5, seed=2)
    big = dict(n_positions=160, kv_buckets=[64, 160])
    llama = checkpoint("llama").path
    # every proposer proposes the unpenalised continuation well: drafts get accepted and, where the
    # penalty changes the target's choice, rejected
    return {
        "draft": (lambda b: load(llama, batch_size=b), lambda t: DraftModel.from_pretrained(llama, t), 3),
        "eagle": (lambda b: load(root / "eagle-target", batch_size=b),
                  lambda t: EagleDraft.from_pretrained(eagle, t, progress=False), 3),
        "medusa": (lambda b: load(root / "medusa-target", batch_size=b, **big),
                   lambda t: draft_for(t, heads, "mc_sim_7b_63"), None),
        "lookup": (lambda b: load(llama, batch_size=b), PromptLookup, 3),
    }


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("strategy", ["draft", "eagle", "medusa", "lookup"])
def test_greedy_speculation_equals_target_only(strategies, strategy, batch):
    make_target, make_proposer, k = strategies[strategy]
    target = make_target(batch)
    prompts = PROMPTS if batch == 3 else [REPEATING]
    penalty = [1.3, 0.8, 1.2] if batch == 3 else 0.7
    kw = dict(max_new_tokens=40, eos_token_id=[])
    reference = target.generate(prompts, repetition_penalty=penalty, **kw)
    assert not torch.equal(reference, target.generate(prompts, **kw))
    gen = SpeculativeGenerator(make_proposer(target), target, k)
    assert torch.equal(gen.generate(prompts, repetition_penalty=penalty, **kw), reference)
    stats = gen.last_stats                       # drafts were verified under the penalty: some accepted,
    assert 0 < stats.accepted < stats.drafted    # some rejected where the penalty changed the target's choice
    assert any(key.penalty and key.n_tokens > 1 and key.n_logits > 1 for key in target.graphs.built)


# ---------------------------------------------------------------- speculation: lossless sampling
PENALISED = dict(temperature=0.9, repetition_penalty=1.8)


def check_lossless(hf, target, gen, prompt=(3, 1, 4)) -> None:
    """Chi-square of 3 sampled tokens (20,480 samples) against the exact penalised distribution; the
    same samples are far from the unpenalised one, so a penalty left out would be detected."""
    assert lossless_pvalue(hf, target, gen, PENALISED, 3, prompt=prompt) > 1e-3
    params = target.sampling_params(None, None, PENALISED["temperature"], True)[:1]
    counts = sampled_joint(gen, list(prompt), 512, 3, 10, PENALISED)
    assert chi2_pvalue(exact_joint(hf, list(prompt), params, 3), counts) < 1e-6


def test_chain_sampling_is_lossless(lossless_models):
    hf, target, drafts = lossless_models
    gen = SpeculativeGenerator(drafts["full"], target, 2)
    check_lossless(hf, target, gen)
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert gen.stats.per_position_acceptance[1] > 0.01    # second drafts: penalised after the first


def test_tree_sampling_is_lossless(lossless):
    """Medusa trees with a penalty, for float, int8 and int4 targets (``test_medusa.lossless``: the
    reference holds the values the quantized target computes with)."""
    hf, target, heads, _ = lossless
    gen = SpeculativeGenerator(MedusaDraft(heads, SMALL_TREE, target), target)
    check_lossless(hf, target, gen)
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert gen.stats.per_position_acceptance[1] > 0.01


# ---------------------------------------------------------------- rows joining a running batch
@pytest.mark.parametrize("strategy", ["target", "draft"])
def test_row_added_with_penalty_equals_its_solo_output(checkpoint, strategy):
    ckpt = checkpoint("llama")
    target = load(ckpt, batch_size=2)
    if strategy == "target":
        engine = Engine(target)
    else:
        engine = SpeculativeGenerator(DraftModel.from_pretrained(checkpoint("llama-draft").path, target),
                                      target, 3).engine
    first, second = prompt_ids(9, seed=21), REPEATING
    a = engine.add(first, max_new_tokens=30, eos_token_id=[])
    for _ in range(3):
        engine.step()
    b = engine.add(second, max_new_tokens=20, eos_token_id=[], repetition_penalty=1.3)
    while engine.active_rows:
        engine.step()
    solo = load(ckpt, batch_size=1)
    assert engine.rows[a].new == solo.generate([first], max_new_tokens=30, eos_token_id=[])[0, 9:].tolist()
    alone = solo.generate([second], max_new_tokens=20, eos_token_id=[], repetition_penalty=1.3)
    assert engine.rows[b].new == alone[0, len(second):].tolist()
    assert engine.rows[b].new == hf_generate(ckpt.hf, second, 20, 1.3)
    # presence holds each row's prompt + emitted tokens
    for r, p in ((a, first), (b, second)):
        seq = torch.tensor(p + engine.rows[r].new)
        assert torch.equal(target.presence[r].nonzero().flatten(), seq.unique())


# ---------------------------------------------------------------- validation and the command line
@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_invalid_penalty_is_refused_before_anything_changes(ckpt, bad):
    engine = Engine(load(ckpt, batch_size=2))
    prompt = prompt_ids(9, seed=21)
    r = engine.add(prompt, max_new_tokens=12, eos_token_id=[], repetition_penalty=1.3)
    engine.step()
    before = (engine.target.presence.clone(), engine.target.lengths.clone(), engine.params.clone(),
              list(engine.rows[r].new), engine.free_rows)
    message = rf"repetition_penalty={bad!r} is invalid: must be a finite number > 0"
    with pytest.raises(ValueError, match=message):
        engine.add(REPEATING, max_new_tokens=4, repetition_penalty=bad)
    with pytest.raises(ValueError, match=message):
        engine.generate([REPEATING], max_new_tokens=4, repetition_penalty=bad)
    after = (engine.target.presence, engine.target.lengths, engine.params, engine.rows[r].new, engine.free_rows)
    for x, y in zip(before, after):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    while engine.active_rows:
        engine.step()
    assert engine.rows[r].new == hf_generate(ckpt.hf, prompt, 12, 1.3)


def test_per_row_values_must_match_the_batch(model3):
    with pytest.raises(ValueError, match=r"repetition_penalty has 2 values; give one value or one per row \(3\)"):
        model3.generate([REPEATING], max_new_tokens=4, repetition_penalty=[1.2, 1.3])


def test_command_line(ckpt, capsys):
    prompt = prompt_ids(9, seed=3)
    rc, out, err = run(generate_args(ckpt.path, prompt, 20, 64, "--repetition-penalty", 1.3), capsys)
    assert rc == 0, err
    assert new_ids(out) == hf_generate(ckpt.hf, prompt, 20, 1.3)
    rc, out, err = run(generate_args(ckpt.path, prompt, 20, 64, "--repetition-penalty", 0), capsys)
    assert rc == 2 and "--repetition-penalty: must be > 0 (1 = off), got 0" in err


# ---------------------------------------------------------------- the compiled backend
def test_compiled_penalty_graph_matches_eager(ckpt, tmp_path, monkeypatch):
    """One verify-shaped penalty graph (4 tokens, sampling, probabilities) through torch.compile."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = load(ckpt, batch_size=2, n_positions=32, context_buckets=[16], kv_buckets=[32])
    key = GraphKey(4, 4, 32, True, True, penalty=True)
    eager = StepGraph(model.lm, key, None)
    inputs = list(eager.example_inputs(model.batch_size))
    inputs[0] = torch.randint(3, 8, (2, 4), generator=torch.Generator().manual_seed(0))   # repeats
    with torch.no_grad():
        expected = eager(*inputs)
        got = build_graph(eager, "compiled", model.batch_size)(*inputs)
        plain = StepGraph(model.lm, GraphKey(4, 4, 32, True, True), None)(*inputs[:-1])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(plain[2], expected[2], atol=1e-3)   # the penalty was applied
