"""The one request loop (``specdec.core.engine``) and per-row state: a strategy the loop has never seen,
rows joining and leaving a running batch (each row = its batch-1 output, for target-only, the draft
model, EAGLE and Medusa), and per-row seeds (a row's samples do not depend on its neighbours)."""
import pytest
import torch

from specdec import DraftModel, EagleDraft, Engine, Proposal, SpeculativeGenerator

from conftest import VOCAB, checkpoint, load, prompt_ids  # noqa: F401  (fixture)
from test_eagle import saved_target_and_eagle
from test_medusa import draft_for, oracle_heads, token_map_target

BUDGETS = [40, 14, 30, 20]


def joining_prompts(vocab: int = VOCAB) -> list[list[int]]:
    return [prompt_ids(n, seed, vocab) for n, seed in ((5, 1), (9, 2), (3, 3), (12, 4))]


PROMPTS = joining_prompts()


# ---------------------------------------------------------------- a strategy the loop has never seen
class RepeatLastToken:
    """Proposes the last token k times (deterministic: the one-hot rule); defined only here."""

    def __init__(self, target):
        self.vocab_size, self.batch_size = target.vocab_size, target.batch_size
        self.calls = 0

    def start(self, rows, prompts, params, rng, target_out):
        pass

    def propose(self, tail, lengths, k, params, rng):
        self.calls += 1
        return Proposal(tail[:, 1:].expand(-1, k).clone())

    def accepted(self, lengths, verified):
        pass

    def max_draft_tokens(self, length):
        return 1000


def test_unknown_proposer_runs_without_touching_the_loop(checkpoint):
    target = load(checkpoint("llama"), batch_size=3)
    prompts = [PROMPTS[0], [5, 5, 5, 5], PROMPTS[2]]        # a repeated token gets drafts accepted
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    proposer = RepeatLastToken(target)
    gen = SpeculativeGenerator(proposer, target, 3)
    assert torch.equal(gen.generate(prompts, max_new_tokens=30, eos_token_id=[]), reference)
    assert proposer.calls > 0 and gen.last_stats.drafted > 0
    sampled = gen.generate(prompts, max_new_tokens=10, do_sample=True, temperature=0.8, seed=0)
    assert sampled.shape[0] == 3 and bool((sampled >= 0).all())


def test_a_proposer_missing_a_method_is_refused(checkpoint):
    target = load(checkpoint("llama"), batch_size=3)

    class NoAccepted(RepeatLastToken):
        accepted = None

    with pytest.raises(TypeError, match="has no accepted"):
        SpeculativeGenerator(NoAccepted(target), target, 2)


# ---------------------------------------------------------------- rows joining a running batch
def run_joining(engine: Engine, prompts: list[list[int]] = PROMPTS) -> dict[int, list[int]]:
    """Rows 0 and 1 start; after 3 steps prompt 2 joins; when a row finishes it is released and
    prompt 3 takes its place. Returns prompt index → its new tokens."""
    kw = dict(eos_token_id=[])
    rows = {engine.add(prompts[i], max_new_tokens=BUDGETS[i], **kw): i for i in (0, 1)}
    for _ in range(3):
        engine.step()
    assert all(0 < len(engine.rows[r].new) < BUDGETS[i] for r, i in rows.items())   # mid-generation
    rows[engine.add(prompts[2], max_new_tokens=BUDGETS[2], **kw)] = 2
    done: dict[int, list[int]] = {}
    while engine.active_rows or len(done) < len(prompts):
        engine.step()
        for r in [r for r in rows if engine.rows[r] is not None and engine.rows[r].done]:
            done[rows.pop(r)] = engine.rows[r].new
            engine.release(r)
            if 3 not in done and 3 not in rows.values():
                rows[engine.add(prompts[3], row=r, max_new_tokens=BUDGETS[3], **kw)] = 3
    return done


def batch1_references(path, prompts: list[list[int]] = PROMPTS) -> dict[int, list[int]]:
    one = load(path, batch_size=1)
    return {i: one.generate([p], max_new_tokens=BUDGETS[i], eos_token_id=[])[0, len(p):].tolist()
            for i, p in enumerate(prompts)}


def test_rows_join_target_only(checkpoint):
    ckpt = checkpoint("llama")
    assert run_joining(Engine(load(ckpt, batch_size=3))) == batch1_references(ckpt)


def test_rows_join_draft_model(checkpoint):
    ckpt = checkpoint("llama")
    target = load(ckpt, batch_size=3)
    draft = DraftModel.from_pretrained(checkpoint("llama-draft").path, target)
    assert draft.model.batch_size == 3 and draft.model.settings.kv_buckets == target.settings.kv_buckets
    gen = SpeculativeGenerator(draft, target, 3)
    assert run_joining(gen.engine) == batch1_references(ckpt)
    assert gen.stats.accepted > 0


def test_rows_join_eagle(tmp_path):
    _, eagle = saved_target_and_eagle(tmp_path)
    prompts = joining_prompts(64)
    target = load(tmp_path / "target", batch_size=3)
    gen = SpeculativeGenerator(EagleDraft.from_pretrained(eagle, target, progress=False), target, 3)
    assert run_joining(gen.engine, prompts) == batch1_references(tmp_path / "target", prompts)


def test_rows_join_medusa(tmp_path):
    hf = token_map_target(0, 64, 64)
    hf.save_pretrained(tmp_path / "target")
    prompts = joining_prompts(64)
    target = load(tmp_path / "target", batch_size=3)
    gen = SpeculativeGenerator(draft_for(target, oracle_heads(hf, 4, 2.5, seed=2), "small_8"), target)
    assert run_joining(gen.engine, prompts) == batch1_references(tmp_path / "target", prompts)
    assert gen.stats.accepted > 0


def test_add_errors_leave_the_batch_intact(checkpoint):
    ckpt = checkpoint("llama")
    engine = Engine(load(ckpt, batch_size=2))
    r = engine.add(PROMPTS[0], max_new_tokens=BUDGETS[0], eos_token_id=[])
    engine.step()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add([1, VOCAB + 5], max_new_tokens=4)
    with pytest.raises(ValueError, match=f"row {r} is not free"):
        engine.add(PROMPTS[1], row=r, max_new_tokens=4)
    with pytest.raises(ValueError, match="add starts one request: its tokenizer output holds 2 prompts"):
        engine.add({"input_ids": [PROMPTS[1], PROMPTS[1]]}, max_new_tokens=4)
    with pytest.raises(ValueError, match="must be token ids, got text"):
        engine.add("some text", max_new_tokens=4)
    r2 = engine.add({"input_ids": [PROMPTS[1]]}, max_new_tokens=4, eos_token_id=[])   # a tokenizer's output
    with pytest.raises(RuntimeError, match="all 2 rows are in use"):
        engine.add(PROMPTS[2], max_new_tokens=4)
    while engine.active_rows:
        engine.step()
    assert engine.rows[r].new == batch1_references(ckpt)[0]
    assert engine.rows[r2].new == batch1_references(ckpt)[1][:4]


# ---------------------------------------------------------------- per-row seeds
def sampled_row(gen, prompts, seeds, row, temperature=0.9):
    out = gen.generate(prompts, max_new_tokens=24, eos_token_id=[], do_sample=True, temperature=temperature,
                       seed=seeds)
    width = max(map(len, prompts))
    return out[row, width:].tolist()


@pytest.mark.parametrize("strategy", ["target", "draft"])
def test_a_rows_samples_do_not_depend_on_its_neighbours(checkpoint, strategy):
    target = load(checkpoint("llama"), batch_size=3)
    if strategy == "target":
        gen = Engine(target)
    else:
        gen = SpeculativeGenerator(DraftModel.from_pretrained(checkpoint("llama-draft").path, target), target, 3)
    p, q, r = PROMPTS[0], PROMPTS[1], PROMPTS[3]
    alone = sampled_row(gen, [p], [7], 0)
    assert sampled_row(gen, [q, p], [5, 7], 1) == alone
    assert sampled_row(gen, [r, q, p], [9, 8, 7], 2) == alone
    assert sampled_row(gen, [p, r], [7, 3], 0) == alone
    assert sampled_row(gen, [p], [8], 0) != alone            # the seed does matter
    # an int seed gives every row its own stream: identical prompts sample differently
    twins = gen.generate([p, p], max_new_tokens=24, eos_token_id=[], do_sample=True, temperature=0.9, seed=1)
    assert not torch.equal(twins[0], twins[1])


def test_compile_builds_the_graphs_of_joining_rows(checkpoint):
    """``compile(single_row=True)`` builds the single-row context graphs up front: adding a row to a
    running batch then builds no graph (and each single-row graph exports, static shapes)."""
    target = load(checkpoint("llama"), batch_size=2)
    target.compile(progress=False, single_row=True)
    built = set(target.graphs.built)
    assert any(k.single_row for k in built)
    engine = Engine(target)
    engine.add(PROMPTS[0], max_new_tokens=5)
    engine.step()
    engine.add(PROMPTS[3], max_new_tokens=5)
    while engine.active_rows:
        engine.step()
    assert set(target.graphs.built) == built
    key = next(k for k in built if k.single_row)
    assert len(target.export(key).graph_signature.user_inputs) == 8   # the runtime inputs + seq_ids
