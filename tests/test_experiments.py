"""specdec.tools.experiments: sweeps as DataFrames (numbers = the runs' SpecStats), resumable result files,
plots, SpecStats.to_frame — on tiny random models."""
from __future__ import annotations

import json
import sys

import pytest
import torch

pd = pytest.importorskip("pandas")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from specdec import DraftModel, SpecStats  # noqa: E402
from specdec.core.engine import Engine  # noqa: E402
from specdec.tools.experiments import (  # noqa: E402
    COLUMNS,
    Config,
    Prompt,
    frame,
    grid,
    load_results,
    mt_bench_prompts,
    plots,
    row_seed,
    stats_of,
    summarize,
    sweep,
)

from conftest import load, prompt_ids  # noqa: E402

COUNT_FIELDS = ["steps", "drafted", "accepted", "emitted", "accepted_per_position", "accepted_histogram"]
CONFIGS = [Config("none", 0, 0.0), Config("model", 2, 0.0), Config("lookup", 3, 0.0),
           Config("none", 0, 0.8), Config("model", 3, 0.8), Config("lookup", 2, 0.8)]
PROMPTS = [Prompt(f"p{i}", "abc"[i % 2], ids=prompt_ids(6 + 3 * i, seed=40 + i)) for i in range(3)]
NEW = 12


@pytest.fixture(scope="module")
def models(checkpoint):
    """batch size -> (target, strategies) on the tiny llama with the tiny llama draft."""
    draft_path = checkpoint("llama-draft").path
    cache = {}

    def get(batch_size: int):
        if batch_size not in cache:
            target = load(checkpoint("llama"), batch_size=batch_size, amp="f32")
            cache[batch_size] = target, {"model": lambda t, k: DraftModel.from_pretrained(draft_path, t)}
        return cache[batch_size]
    return get


@pytest.fixture
def recorded(monkeypatch):
    """Every Engine.generate call's last_stats (a copy) and its prompts, in call order."""
    calls = []
    original = Engine.generate

    def generate(self, input_ids, *args, **kwargs):
        out = original(self, input_ids, *args, **kwargs)
        calls.append((list(input_ids), self.last_stats.copy()))
        return out
    monkeypatch.setattr(Engine, "generate", generate)
    return calls


def run(models, batch_size=1, **kwargs):
    target, strategies = models(batch_size)
    kwargs = {"max_new_tokens": NEW, "strategies": strategies, "progress": False, "seed": 7, **kwargs}
    return sweep(target, kwargs.pop("configs", CONFIGS), kwargs.pop("prompts", PROMPTS), **kwargs)


def counts(df: pd.DataFrame) -> pd.DataFrame:
    """The columns that do not depend on timing or on which batch a row ran in."""
    return df[["config", "prompt_id", "category", "prompt_tokens", "new_tokens"] + COUNT_FIELDS
              + ["tau", "acceptance_rate", "per_position_acceptance", "output_ids"]].reset_index(drop=True)


def test_frame_equals_the_runs_specstats(models, recorded, single_thread):
    df = run(models, warmup=False)
    assert list(df.columns[:len(COLUMNS)]) == COLUMNS
    assert len(df) == len(CONFIGS) * len(PROMPTS) == len(recorded)
    assert [c for c in df.columns if c.startswith("acc_pos_")] == ["acc_pos_0", "acc_pos_1", "acc_pos_2"]
    for (_, row), (prompts, stats) in zip(df.iterrows(), recorded):
        assert prompts == [list(PROMPTS[[p.id for p in PROMPTS].index(row["prompt_id"])].ids)]
        d = stats.to_dict()   # batch size 1: a row IS the call's SpecStats, timings included
        for name in COUNT_FIELDS + ["draft_s", "verify_s", "other_s", "total_s", "tokens_per_s", "acceptance_rate",
                                    "per_position_acceptance"]:
            assert row[name] == d[name], name
        assert row["tau"] == d["mean_acceptance_length"]
        assert stats_of(row) == stats
        pos = d["per_position_acceptance"]
        for i in range(3):
            value = row[f"acc_pos_{i}"]
            assert value == pos[i] if i < len(pos) else pd.isna(value)
        assert row["new_tokens"] == NEW == len(row["output_ids"])
        assert row["emitted"] == NEW - 1            # the first token comes from the context encoding
        assert row["batch_size"] == 1
    target_rows = df[df["strategy"] == "none"]
    assert (target_rows["drafted"] == 0).all() and (target_rows["tau"] == 1.0).all()
    assert (df[df["strategy"] == "model"]["drafted"] > 0).all()
    assert df[df["strategy"] == "lookup"]["drafted"].sum() > 0     # real drafts only: a prompt may find none
    # greedy: every strategy emits the target's tokens; sampled rows use their prompt's seed
    greedy = df[df["temperature"] == 0].groupby("prompt_id")["output_ids"].apply(lambda s: {tuple(x) for x in s})
    assert (greedy.map(len) == 1).all()
    target, _ = models(1)
    row = df[(df["config"] == Config("none", 0, 0.8).key) & (df["prompt_id"] == "p1")].iloc[0]
    out = target.generate([list(PROMPTS[1].ids)], max_new_tokens=NEW, eos_token_id=[], do_sample=True,
                          temperature=0.8, top_k=0, top_p=1.0, seed=[row_seed(7, "p1")])
    assert out[0, len(PROMPTS[1].ids):].tolist() == row["output_ids"]


def test_batched_rows_add_up_and_match_single_rows(models, recorded, single_thread):
    """Batch size 2: each batch's rows sum to the call's SpecStats (times: the batch's); a row's counts
    equal the same prompt run alone (rows are independent)."""
    df = run(models, batch_size=2, warmup=False)
    assert len(recorded) == len(CONFIGS) * 2                        # 3 prompts → batches of 2 and 1
    assert sorted(df["batch_size"].unique()) == [1, 2]
    batches = list(dict.fromkeys(df["batch_id"]))
    assert len(batches) == len(recorded)
    for batch_id, (prompts, stats) in zip(batches, recorded):
        rows = df[df["batch_id"] == batch_id]
        assert len(rows) == len(prompts)
        pooled = sum(stats_of(r) for _, r in rows.iterrows())
        for name in COUNT_FIELDS[:4]:
            assert getattr(pooled, name) == getattr(stats, name), name
        for name in ("accepted_per_position", "accepted_histogram"):
            a, b = getattr(pooled, name), getattr(stats, name)
            assert a + [0] * (len(b) - len(a)) == b + [0] * (len(a) - len(b)), name
        for name in ("draft_s", "verify_s", "other_s"):
            assert (rows[name] == getattr(stats, name)).all(), name
    single = run(models, batch_size=1, warmup=False)
    pd.testing.assert_frame_equal(counts(df), counts(single))
    # summarize pools counts over prompts and times over batches
    s = summarize(df)
    assert list(s["config"]) == [c.key for c in CONFIGS]
    for c, (_, r) in zip(CONFIGS, s.iterrows()):
        g = df[df["config"] == c.key]
        assert r["steps"] == g["steps"].sum() and r["accepted"] == g["accepted"].sum()
        assert r["tau"] == pytest.approx(1 + g["accepted"].sum() / g["steps"].sum())
        assert r["total_s"] == pytest.approx(g.drop_duplicates("batch_id")["total_s"].sum())
    assert (s[s["strategy"] == "none"]["speedup"] == 1.0).all()


def test_resume_skips_finished_work(models, tmp_path, single_thread):
    out = tmp_path / "sweep.jsonl"
    batches = []
    first = run(models, output=out, on_batch=batches.append)
    assert len(batches) == len(CONFIGS) * len(PROMPTS)
    assert len(out.read_text().splitlines()) == len(first)
    again = []
    second = run(models, output=out, on_batch=again.append)
    assert again == []                                    # nothing ran
    pd.testing.assert_frame_equal(first, second)
    pd.testing.assert_frame_equal(first, load_results(out))
    # other settings are other rows: nothing reused, both kept in the file
    third = run(models, output=out, configs=CONFIGS[:1], max_new_tokens=NEW - 4, on_batch=again.append)
    assert len(again) == len(PROMPTS) and (third["new_tokens"] == NEW - 4).all()
    assert len(load_results(out)) == len(first) + len(PROMPTS)
    # a subset of a finished sweep is read back, not rerun
    sub = run(models, output=out, configs=CONFIGS[2:4], prompts=PROMPTS[1:], on_batch=again.append)
    assert len(again) == len(PROMPTS) and len(sub) == 4


def test_an_interrupted_sweep_resumes(models, tmp_path, single_thread):
    out = tmp_path / "sweep.jsonl"

    def interrupt(records):
        raise KeyboardInterrupt   # Ctrl-C right after the first batch was written

    with pytest.raises(KeyboardInterrupt):
        run(models, batch_size=2, output=out, on_batch=interrupt)
    assert len(load_results(out)) == 2                    # the first batch (2 prompts) is in the file
    with open(out, "a") as f:
        f.write('{"strategy": "model", "k": 2, "tempera')   # and a torn line, as if killed mid-write
    ran = []
    resumed = run(models, batch_size=2, output=out, on_batch=ran.append)
    assert sum(len(b) for b in ran) == len(CONFIGS) * len(PROMPTS) - 2
    lines = out.read_text().splitlines()
    assert len(lines) == len(CONFIGS) * len(PROMPTS) and all(json.loads(line) for line in lines)
    fresh = run(models, batch_size=2)
    pd.testing.assert_frame_equal(counts(resumed), counts(fresh))


def test_an_interrupt_inside_a_batch_writes_nothing_of_it(models, tmp_path, monkeypatch, single_thread):
    out = tmp_path / "sweep.jsonl"
    step, calls = Engine.step, []

    def interrupted_step(self):
        calls.append(1)
        if len(calls) == NEW + 3:     # the second batch's third step (the first batch took NEW - 1)
            raise KeyboardInterrupt
        return step(self)
    monkeypatch.setattr(Engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        run(models, batch_size=2, output=out, warmup=False)
    monkeypatch.setattr(Engine, "step", step)
    assert len(load_results(out)) == 2 and out.read_text().endswith("\n")   # only the finished batch
    resumed = run(models, batch_size=2, output=out, warmup=False)
    pd.testing.assert_frame_equal(counts(resumed), counts(run(models, batch_size=2, warmup=False)))


def test_plots_write_png_files(models, tmp_path, single_thread):
    df = run(models, batch_size=2, warmup=False)
    paths = plots.save_all(df, tmp_path / "plots")
    assert set(paths) == {"per_position_acceptance", "tau_and_speed", "accepted_histogram", "tau_by_category"}
    for path in paths.values():
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, path
    from matplotlib.figure import Figure
    for fn in (plots.per_position_acceptance, plots.tau_and_speed, plots.accepted_histogram):
        fig = fn(df)
        assert isinstance(fig, Figure) and fig.axes
    for k in ("best", "all", 2):
        assert plots.tau_by_category(df, k=k).axes
    only_target = df[df["strategy"] == "none"]       # nothing drafted: still figures, no errors
    for path in plots.save_all(only_target, tmp_path / "target").values():
        assert path.stat().st_size > 0


def test_to_frame(monkeypatch):
    stats = SpecStats()
    stats.update(torch.tensor([2, 0, 1]), 3)
    stats.add_time(0.1, 0.2, 0.05)
    df = stats.to_frame()
    d = stats.to_dict()
    assert len(df) == 1 and list(df.columns) == list(d)
    row = df.iloc[0]
    assert row["accepted_per_position"] == d["accepted_per_position"] == [2, 1, 0]
    assert row["per_position_acceptance"] == d["per_position_acceptance"]
    assert row["mean_acceptance_length"] == d["mean_acceptance_length"] == 2.0
    assert pd.concat([df, SpecStats().to_frame()], ignore_index=True).shape == (2, len(d))
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"pip install 'specdec\[experiments\]'"):
        stats.to_frame()


def test_configs_grid_and_prompts():
    configs = grid(["none", "model", "medusa"], ks=[2, 4], temperatures=[0, 0.7])
    assert [c.key for c in configs] == ["none|0|0.0", "model|2|0.0", "model|4|0.0", "medusa|2|0.0",
                                        "none|0|0.7", "model|2|0.7", "model|4|0.7", "medusa|2|0.7"]
    assert Config("none").k == 0 and Config("eagle", 3, 1).temperature == 1.0
    for bad in (dict(strategy="none", k=2), dict(strategy="eagle", k=0), dict(strategy="eagle", k=2, temperature=-1)):
        with pytest.raises(ValueError):
            Config(**bad)
    with pytest.raises(ValueError, match="unknown strategy"):
        grid(["nope"], [1])
    for old, new in (("target", "none"), ("draft", "model")):     # the earlier sweep names: refused by the new one
        with pytest.raises(ValueError, match=f"strategy '{old}' is called '{new}' now"):
            grid([old], [1])
    mt = mt_bench_prompts(8)
    assert len({p.category for p in mt}) == 8 and all(p.text for p in mt)
    assert [p.category for p in mt_bench_prompts(3, categories=["math"])] == ["math"] * 3
    assert frame([]).columns.tolist() == COLUMNS


def test_sweep_rejects_bad_input(models):
    target, strategies = models(1)
    with pytest.raises(ValueError, match="n_positions"):
        sweep(target, CONFIGS[:1], [("long", None, prompt_ids(100, 1))], max_new_tokens=64, progress=False)
    with pytest.raises(ValueError, match="unique"):
        sweep(target, CONFIGS[:1], [("a", None, [5, 6]), ("a", None, [7, 8])], progress=False)
    with pytest.raises(ValueError, match="k .*required"):
        sweep(target, [Config("model")], PROMPTS, strategies=strategies, progress=False)
