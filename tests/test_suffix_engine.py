"""Suffix decoding wired in (issue 41): the engine's "finished" hook (each request once, cut where the engine
stopped it), the registry's ``suffix`` / ``suffix+model`` giving target-only greedy output at batch 1 and at
batch 3 with rows joining, chi-square losslessness of ``suffix+model`` (suffix and model rows mixed), a cache
updated by another thread while the async engine serves, the CLI, the server (its ``/metrics``), the sweeps
and ``bench-spec`` — all on tiny models."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from specdec import BaseProposer, DraftModel, Proposal, SpeculativeGenerator
from specdec.registry import REGISTRY
from specdec.serving import AsyncEngine
from specdec.suffix import SuffixCache, SuffixChain, SuffixDraft, SuffixOrDraft

from conftest import load, prompt_ids
from test_cli import REPEATS, generate_args, new_ids, run
from test_lookup import record_sources
from test_serving_engine import check
from test_serving_engine import offline as offline_outputs
from test_serving_engine import requests as mixed_requests
from test_serving_http import httpx, metrics, text_model  # noqa: F401  (fixture)
from test_speculative import lossless_models, lossless_pvalue  # noqa: F401  (fixture)

NEW = 30


class Recorder(BaseProposer):
    """Proposes the last token k times and records every "finished" call."""

    abilities = frozenset({"finished"})

    def __init__(self, target):
        self.vocab_size, self.batch_size = target.vocab_size, target.batch_size
        self.calls: list[tuple[list[int], list[int]]] = []

    def start(self, rows, prompts, params, rng, target_out):
        pass

    def propose(self, tail, lengths, k, params, rng):
        return Proposal(tail[:, 1:].expand(-1, k).clone())

    def accepted(self, lengths, verified):
        pass

    def max_draft_tokens(self, length):
        return 1000

    def finished(self, rows, lengths=None):
        self.calls.append((list(rows), list(lengths)))


def test_the_engine_tells_the_proposer_when_each_request_ends(checkpoint):
    target = load(checkpoint("llama"), batch_size=3)
    prompts = [prompt_ids(5, 1), prompt_ids(8, 2), prompt_ids(6, 3)]
    free = target.generate(prompts, max_new_tokens=20, eos_token_id=[])
    eos = int(free[1, 8 + 6])                      # row 1 stops at its 7th new token at the latest
    reference = target.generate(prompts, max_new_tokens=20, eos_token_id=eos)
    recorder = Recorder(target)
    gen = SpeculativeGenerator(recorder, target, 3)
    assert torch.equal(gen.generate(prompts, max_new_tokens=20, eos_token_id=eos), reference)
    ends = {r: n for rows, lengths in recorder.calls for r, n in zip(rows, lengths)}
    assert sorted(r for rows, _ in recorder.calls for r in rows) == [0, 1, 2]       # each request once
    assert ends == {r: row.length for r, row in enumerate(gen.engine.rows)} and ends[1] <= 8 + 7
    engine, recorder.calls = gen.engine, []
    for r in range(3):
        engine.release(r)                          # finished rows: nothing more to tell
    row = engine.add(prompts[0], max_new_tokens=4, eos_token_id=[])
    while engine.active_rows:
        engine.step()
    aborted = engine.add(prompts[1], max_new_tokens=20, eos_token_id=[])
    engine.step()
    length = engine.rows[aborted].length
    engine.release(aborted)                        # released unfinished: it ends here, with what it emitted
    engine.release(row)
    assert recorder.calls == [([row], [5 + 4]), ([aborted], [length])]


def test_finished_outputs_enter_the_cache_cut_at_eos(checkpoint):
    """Tokens a final step accepted past an EOS never reach the cache: the engine passes the final lengths."""
    target = load(checkpoint("llama"), batch_size=3)
    prompts = [prompt_ids(5, 1) * 3, prompt_ids(7, 2), prompt_ids(11, 3) + prompt_ids(11, 3)[:6]]
    free = target.generate(prompts, max_new_tokens=NEW, eos_token_id=[])
    eos = int(free[0, 17 + 12])                    # row 0 stops at its 13th new token at the latest
    reference = target.generate(prompts, max_new_tokens=NEW, eos_token_id=eos)
    proposer = REGISTRY["suffix"].build(target)
    gen = SpeculativeGenerator(proposer, target, 4)
    assert torch.equal(gen.generate(prompts, max_new_tokens=NEW, eos_token_id=eos), reference)
    outputs = sorted(row.new for row in gen.engine.rows)
    assert sorted(list(s) for s in proposer.cache.index.seqs.values()) == outputs
    assert any(new[-1] == eos and len(new) < NEW for new in outputs) and gen.last_stats.accepted > 0


def build(name: str, target, checkpoint):
    """The registry's ``name`` for ``target`` (``suffix+model``: the tiny llama draft, the suffix chain from
    matches of 2 tokens)."""
    if REGISTRY[name].part is None:
        return REGISTRY[name].build(target)
    return REGISTRY[name].build(target, checkpoint("llama-draft").path, suffix={"min_match": 2})


def requests(reference_of) -> list[list[int]]:
    """Prompts that repeat each other and re-send earlier outputs (as agents do): the cache has matches."""
    p0, p1 = prompt_ids(9, 11), prompt_ids(6, 12)
    return [p0, p1, p0[:4] + reference_of(p0)[:12], p1, p0]


@pytest.mark.parametrize("name", ["suffix", "suffix+model"])
def test_greedy_equals_target_only_at_batch_1_and_3_with_rows_joining(checkpoint, name):
    one, three = load(checkpoint("llama"), batch_size=1), load(checkpoint("llama"), batch_size=3)
    refs: dict[tuple[int, ...], list[int]] = {}

    def reference_of(p: list[int]) -> list[int]:
        if tuple(p) not in refs:
            refs[tuple(p)] = one.generate([p], max_new_tokens=NEW, eos_token_id=[])[0, len(p):].tolist()
        return refs[tuple(p)]

    prompts = requests(reference_of)
    gen = SpeculativeGenerator(build(name, one, checkpoint), one, 4)
    sources = {"lookup": {}, "model": {}}
    if isinstance(gen.proposer, SuffixOrDraft):
        record_sources(gen.proposer, sources)
    for p in prompts:
        assert gen.generate([p], max_new_tokens=NEW, eos_token_id=[])[0, len(p):].tolist() == reference_of(p)
    assert gen.proposer.cache.stats()["added"] == len(prompts) and gen.proposer.cache.stats()["hits"] > 0
    assert gen.stats.mean_acceptance_length > 1.5             # repeated requests: their outputs are in the cache
    if isinstance(gen.proposer, SuffixOrDraft):           # both sources drafted (record_sources: "lookup" = suffix)
        assert sources["lookup"] and sources["model"]

    gen = SpeculativeGenerator(build(name, three, checkpoint), three, 4)
    engine, kw = gen.engine, dict(max_new_tokens=NEW, eos_token_id=[])
    pending = list(prompts)
    rows = {engine.add(pending.pop(0), **kw): prompts[0], engine.add(pending.pop(0), **kw): prompts[1]}
    for _ in range(2):
        engine.step()
    p = pending.pop(0)
    rows[engine.add(p, **kw)] = p                  # joins a running batch
    done = 0
    while engine.active_rows or pending:
        engine.step()
        for r in [r for r in rows if engine.rows[r] is not None and engine.rows[r].done]:
            assert engine.rows[r].new == reference_of(rows.pop(r)), (name, r)
            engine.release(r)
            done += 1
            if pending:                            # the next request takes the freed row
                p = pending.pop(0)
                rows[engine.add(p, row=r, **kw)] = p
    assert done == len(prompts) and gen.stats.accepted > 0
    assert gen.proposer.cache.stats()["added"] == len(prompts)


def test_suffix_plus_model_sampling_is_lossless(lossless_models):
    """Rows of both sources in every call (suffix rows verified with a one-hot q, model rows with the
    model's q): the first 3 sampled tokens follow the target's distribution (10,240 samples)."""
    target_hf, target, drafts = lossless_models
    proposer = SuffixOrDraft(SuffixChain(target, SuffixCache(max_candidates=8), cache_prompts=True),
                             DraftModel(drafts["full"]), min_match=2)
    sources = {"lookup": {}, "model": {}}
    record_sources(proposer, sources)
    gen = SpeculativeGenerator(proposer, target, 2)
    pvalue = lossless_pvalue(target_hf, target, gen, dict(temperature=0.7), 3, calls=20, prompt=(3, 1, 4, 3, 1))
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert sum(sources["lookup"].values()) > 1000 and sum(sources["model"].values()) > 1000
    assert proposer.cache.stats()["hits"] > 0
    assert pvalue > 1e-3


def test_a_cache_updated_by_another_thread_while_the_async_engine_serves(checkpoint):
    """The engine thread adds finished requests and looks up while a writer thread adds and a reader thread
    looks up the same cache: every output is target-only greedy and the cache's books balance."""
    ckpt = checkpoint("llama")
    reqs = mixed_requests(ckpt.vocab_size, 6)
    reqs += reqs[:3]                                  # repeated requests: the cache holds their outputs
    cache = SuffixCache(max_tokens=3_000)
    target = load(ckpt.path, batch_size=3)
    engine = AsyncEngine(SpeculativeGenerator(REGISTRY["suffix"].build(target, suffix={"cache": cache}), target,
                                              4).engine)
    outputs = offline_outputs(ckpt.path, reqs[:3])
    stop, errors = threading.Event(), []

    def writer() -> None:
        rng = random.Random(0)
        try:
            while not stop.is_set():
                out = list(rng.choice(outputs))
                out[rng.randrange(len(out))] = rng.randrange(ckpt.vocab_size)
                cache.add(out)
                cache.candidates(out[:rng.randrange(1, len(out))])
                time.sleep(0.001)                 # (let the engine thread run: it holds the GIL less)
        except BaseException as e:      # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        check(engine, ckpt.path, reqs)
    finally:
        stop.set()
        thread.join()
    stats = cache.stats()
    assert not errors and stats["added"] > len(reqs) and stats["tokens"] <= 3_000
    assert stats["tokens"] == sum(len(s) for s in cache.index.seqs.values())
    assert set(cache._lru) == set(cache.index.seqs)
    assert engine.engine.stats.accepted > 0


# ---------------------------------------------------------------- the CLI, the server, sweeps, bench-spec
def test_cli_suffix_strategies(checkpoint, capsys):
    target, draft = checkpoint("llama").path, checkpoint("llama-draft").path
    rc, out, err = run(generate_args(target, REPEATS), capsys)
    assert rc == 0, err
    reference = new_ids(out)
    for extra in (["--draft", "suffix", "--suffix-cache-tokens", "4096", "--suffix-alpha", "2", "--stats"],
                  ["--draft", "suffix", "--adaptive-k", "--gate"],
                  ["--draft", "suffix+model", "--draft-path", draft, "--suffix-min-match", "2", "--suffix-min-prob",
                   "0.2", "--stats"],
                  ["--draft", "suffix-tree", "--suffix-alpha", "2", "--stats"]):
        rc, out, err = run(generate_args(target, REPEATS, 20, 64, *extra), capsys)
        assert rc == 0, err
        assert new_ids(out) == reference, extra
        assert f"--draft {extra[1]} k={8 if extra[1] == 'suffix-tree' else 4}" in err     # a tree's k: its depth
    for extra, message in ((["--draft", "model", "--draft-path", draft, "--suffix-alpha", "2"],
                            "--suffix-alpha is for --draft suffix, suffix-tree, suffix+model, suffix+eagle or "
                            "suffix+eagle3"),
                           (["--draft", "suffix", "--suffix-min-match", "3"], "--suffix-min-match chooses between"),
                           (["--draft", "suffix", "--suffix-cache-tokens", "1"], "must be >= 2, got 1"),
                           (["--draft", "suffix+model", "--draft-path", draft, "--suffix-min-match", "17"],
                            "min_match=17 exceeds the longest match the suffix cache measures")):
        rc, out, err = run(generate_args(target, REPEATS, 20, 64, *extra), capsys)
        assert rc == 2 and message in err and "Traceback" not in err, err


def test_server_with_suffix_decoding_exports_its_cache(text_model):
    """``specdec serve --draft suffix``'s engine (built from the serve command's arguments) over HTTP: outputs
    equal offline greedy, the one cache learns across requests, /metrics exports its size and hit rate."""
    from specdec.cli import build_parser
    from specdec.options import options_from
    from specdec.serving import create_app
    from specdec.serving.server import ServeOptions, load_engine, running_server, serving_engine

    path, _ = text_model
    args = build_parser().parse_args(["serve", "--model", str(path), "--backend", "eager", "--amp", "f32",
                                      "--n-positions", "256", "--batch-size", "2", "--draft", "suffix",
                                      "--suffix-cache-tokens", "5000"])
    options = options_from(ServeOptions, args)
    engine = serving_engine(load_engine(options), options.max_waiting)
    ids = [40 + i % 7 for i in range(15)]
    one = load(path, batch_size=1, n_positions=256, context_buckets=[16, 64], kv_buckets=[64, 128, 256])
    expected = one.generate([ids], max_new_tokens=40, eos_token_id=[])[0, len(ids):].tolist()
    with running_server(create_app(engine, "tiny")) as base:
        for _ in range(3):
            r = httpx.post(f"{base}/v1/completions", json={"prompt": ids, "max_tokens": 40, "temperature": 0,
                                                           "ignore_eos": True}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected, r.text
        m = metrics(base)
    assert m["specdec_suffix_cache_max_tokens"] == 5000 and m["specdec_suffix_cache_sequences"] == 3
    assert m["specdec_suffix_cache_tokens"] == 3 * 40 and m["specdec_suffix_cache_added_total"] == 3
    assert m["specdec_suffix_cache_hits_total"] > 0 and 0 < m["specdec_suffix_cache_hit_rate"] <= 1
    assert m["specdec_suffix_cache_lookups_total"] >= m["specdec_suffix_cache_hits_total"]


def test_sweeps_and_bench_spec_run_suffix(checkpoint, monkeypatch):
    """The sweep builds suffix from the registry and starts every configuration with an empty cache (the
    second configuration's first prompt drafts as from scratch); bench-spec runs suffix and suffix+model."""
    pytest.importorskip("pandas")
    import specdec
    from specdec.tools.bench import speculative as bench
    from specdec.tools.experiments import Config, Prompt, sweep

    target = load(checkpoint("llama"), batch_size=1, amp="f32")
    p = prompt_ids(9, 11)
    prompts = [Prompt("a", "x", ids=p), Prompt("b", "x", ids=p)]          # b finds a's output in the cache
    df = sweep(target, [Config("suffix", 3, 0.0), Config("suffix", 4, 0.0)], prompts, max_new_tokens=NEW,
               progress=False)
    reference = target.generate([p], max_new_tokens=NEW, eos_token_id=[])[0, len(p):].tolist()
    assert all(out == reference for out in df["output_ids"])
    fresh = SpeculativeGenerator(SuffixChain(target), target, 4)
    fresh.generate([p], max_new_tokens=NEW, eos_token_id=[])
    second = df[df["config"] == "suffix|4|0.0"].set_index("prompt_id")["tau"]
    assert second["a"] == pytest.approx(fresh.last_stats.mean_acceptance_length) and second["b"] > second["a"]

    draft = DraftModel(load(checkpoint("llama-draft"), batch_size=1, amp="f32"))
    monkeypatch.setattr(specdec, "shipped", lambda kind, target: draft)
    systems, _ = bench.speculative_systems(bench.parse_options(["--strategy", "suffix,suffix+model", "--ks", "3"]),
                                           target)
    assert list(systems) == ["specdec-suffix-k3", "specdec-suffix+model-k3"]
    for system in systems.values():
        gen = system.make()
        assert gen.generate([p], max_new_tokens=NEW, eos_token_id=[])[0, len(p):].tolist() == reference
        assert gen.proposer.cache.stats()["added"] == 1


def test_bad_suffix_or_draft_arguments(checkpoint):
    target = load(checkpoint("llama"), batch_size=1)
    draft = DraftModel(load(checkpoint("llama-draft"), batch_size=1))
    with pytest.raises(ValueError, match="min_match must be an int >= 1"):
        SuffixOrDraft(SuffixChain(target), draft, min_match=0)
    with pytest.raises(ValueError, match="batch"):
        SuffixOrDraft(SuffixChain(target), DraftModel(load(checkpoint("llama-draft"), batch_size=2)))
    with pytest.raises(ValueError, match="combines chain proposals; SuffixDraft proposes trees"):
        SuffixOrDraft(SuffixChain(target), SuffixDraft(target))
