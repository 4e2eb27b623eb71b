"""The benchmarks' prompt data ships inside the package, and the bench CLIs start (no model is loaded, except
by the slow runs of the optional llamacpp-gguf system)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec.tools.bench
from specdec.core.config import module_bytes
from specdec.tools.bench.prompts import (
    categories,
    default_prompts_path,
    load_prompts,
    load_questions,
    load_records,
    resolve_prompts,
    varied_prompts_path,
)

REPO = Path(__file__).resolve().parents[1]
DATA = Path(specdec.tools.bench.__file__).resolve().parent / "data"


def test_default_prompts_path_is_package_data():
    path = default_prompts_path().resolve()
    assert path.is_file()
    assert path.parent == DATA   # inside the installed package ...
    assert "shared" not in path.parts   # ... not the sibling ../shared checkout
    assert path.name == "mt_bench_questions.jsonl"


def test_load_prompts_gives_the_80_mt_bench_first_turns():
    texts = load_prompts(default_prompts_path(), 80)
    assert len(texts) == 80
    assert all(isinstance(t, str) and t.strip() for t in texts)
    ids = [q for q, _ in load_questions(default_prompts_path(), 80)]
    assert ids == list(range(81, 161))   # MT-Bench question ids
    assert texts[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert load_prompts(default_prompts_path(), 3) == texts[:3]
    with pytest.raises(ValueError, match="holds 80 prompts"):
        load_prompts(default_prompts_path(), 81)


def test_prompts_override(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text('{"question_id": 1, "turns": ["hello", "again"]}\n\n{"turns": ["second"]}\n')
    assert load_prompts(f, 2) == ["hello", "second"]
    with pytest.raises(FileNotFoundError, match="--prompts"):
        load_prompts(tmp_path / "missing.jsonl", 1)


def test_notice_and_package_data_declared():
    notice = DATA / "NOTICE"
    assert notice.is_file()
    text = notice.read_text()
    assert "https://github.com/lm-sys/FastChat" in text and "Apache License 2.0" in text
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["specdec.tools.bench"]
    shipped = {p.relative_to(DATA.parent).as_posix() for pat in patterns for p in DATA.parent.glob(pat)}
    assert {"data/mt_bench_questions.jsonl", "data/varied_prompts.jsonl", "data/NOTICE"} <= shipped
    assert "varied_prompts.jsonl" in text


def test_varied_prompt_set():
    path = varied_prompts_path()
    assert path.parent.resolve() == DATA and resolve_prompts("varied") == path
    assert resolve_prompts(None) == resolve_prompts("mt-bench") == default_prompts_path()
    assert categories("varied") == ["translation", "summarization", "qa", "math", "rag"]
    recs = load_records("varied")
    assert len(recs) == 50 and len({q for q, _, _ in recs}) == 50
    for cat in categories("varied"):
        assert len(load_records("varied", categories=cat)) == 10
    rag = [text for _, _, text in load_records("varied", categories="rag")]
    assert all(500 <= len(t.split("Question:")[0].split()) <= 1300 and "[Document 4]" in t for t in rag)
    assert load_questions("varied", 2) == [(q, t) for q, _, t in recs[:2]]
    assert [c for _, c, _ in load_records(None, 8)] == ["writing"] * 8   # MT-Bench categories too
    spread = load_records(None, per_category=2)       # MT-Bench: 8 categories of 10, in file order
    mt_bench = load_records(None)
    assert len(spread) == 16 and [c for _, c, _ in spread][::2] == categories(None)
    assert spread[2:4] == mt_bench[10:12] and load_records(None, 3, per_category=2) == spread[:3]
    with pytest.raises(ValueError, match="per-category"):
        load_records(None, per_category=0)
    with pytest.raises(ValueError, match="no prompt of categories"):
        load_records("varied", categories="poetry")


def test_varied_prompts_fit_the_chat_template():
    from transformers import AutoTokenizer

    from specdec.core.chat import chat_ids
    from specdec.core.paths import resolve_model_path
    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    lengths = [len(chat_ids(tok, text)) for _, _, text in load_records("varied")]
    assert max(lengths) <= 1500


def test_module_bytes_counts_tied_weights_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    m = torch.nn.ModuleDict({"emb": emb, "head": head})
    assert module_bytes(m) == 2 * 10 * 4 * 4
    head.weight = emb.weight   # tied
    assert module_bytes(m) == 10 * 4 * 4
    assert module_bytes(m.to(torch.bfloat16)) == 10 * 4 * 2


def test_bench_cli_help():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    procs = {cmd: subprocess.Popen([sys.executable, "-m", "specdec.cli", cmd, "--help"], cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in ("bench", "bench-spec")}
    for cmd, p in procs.items():
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, f"specdec {cmd} --help failed:\n{err}"
        assert "--prompts" in out and "--num-prompts" in out


# --- the optional llama.cpp system (llamacpp-gguf) ---------------------------------------------
def test_bench_systems_default_excludes_the_optional_systems():
    import argparse

    from specdec.tools.bench import runtime

    parser = argparse.ArgumentParser()
    runtime.add_arguments(parser)
    default = parser.parse_args([]).systems
    assert runtime.OPTIONAL == ("specdec-xla-f32", "llamacpp-gguf", *runtime.TUNED)
    assert all(s in runtime.SYSTEMS and s not in default for s in runtime.OPTIONAL)
    assert default == [s for s in runtime.SYSTEMS if s not in runtime.OPTIONAL]
    assert parser.parse_args(["--systems", "all"]).systems == list(runtime.SYSTEMS)
    assert parser.parse_args(["--systems", "llamacpp-gguf,specdec-compiled-bf16"]).systems == \
        ["llamacpp-gguf", "specdec-compiled-bf16"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--systems", "llamacpp"])
    assert runtime.system_info("llamacpp-gguf")["impl"] == "llamacpp"
    assert runtime.system_info("specdec-xla-f32") == {"impl": "specdec", "backend": "xla", "compiled": True,
                                                      "dtype": "f32", "quantization": None, "autotune": False}
    assert runtime.system_info("specdec-tuned-int4") == {"impl": "specdec", "backend": "compiled", "compiled": True,
                                                         "dtype": "bf16", "quantization": "int4", "autotune": True}


def test_llamacpp_skipped_with_a_note_when_not_importable_or_not_gguf(monkeypatch):
    from specdec.tools.bench import runtime

    monkeypatch.setitem(sys.modules, "llama_cpp", None)   # import llama_cpp → ImportError
    res = runtime.run_worker("llamacpp-gguf", {"gguf": "m.gguf", "model": "m"}, progress=False)
    assert res == {"system": "llamacpp-gguf",
                   "skipped": "llama-cpp-python is not installed: pip install llama-cpp-python"}
    assert ".gguf" in runtime.skip_reason("llamacpp-gguf", {"gguf": None, "model": "ckpt-dir"})
    assert ".gguf" in runtime.skip_reason("specdec-compiled-gguf", {"gguf": None, "model": "ckpt-dir"})
    assert runtime.skip_reason("specdec-compiled-gguf", {"gguf": "x.gguf", "model": "x.gguf"}) is None
    assert runtime.skip_reason("hf-eager-f32", {"gguf": None}) is None
    # the parent's summary and ratios carry the note, no timings
    systems = runtime._summarize({"llamacpp-gguf": {"eager": {**res, "wall_s": 0.5}}}, 4, {})
    assert systems["llamacpp-gguf"]["skipped"] == runtime.LLAMACPP_MISSING
    assert "tokens_per_s" not in systems["llamacpp-gguf"]
    assert all("llamacpp-gguf" not in r for r in runtime._ratios(systems).values())


def test_xla_skipped_with_a_note_without_torch_xla(monkeypatch):
    from specdec.tools.bench import runtime

    monkeypatch.setitem(sys.modules, "torch_xla", None)
    res = runtime.run_worker("specdec-xla-f32", {"gguf": None, "model": "m"}, progress=False)
    assert res == {"system": "specdec-xla-f32", "skipped": runtime.XLA_MISSING}
    systems = runtime._summarize({"specdec-xla-f32": {"cold": {**res, "wall_s": 0.5}}}, 4, {})
    xla = systems["specdec-xla-f32"]
    assert xla["skipped"] == runtime.XLA_MISSING and "tokens_per_s" not in xla


def _bench_json(capsys, *args: str) -> tuple[int, dict, str]:
    from specdec.tools.bench import runtime

    rc = runtime.main(["--num-prompts", "2", "--max-new-tokens", "4", "--threads", "1", "--bandwidth-gbps", "10",
                       "--warmup-tokens", "2", "--no-progress", *args])
    out, err = capsys.readouterr()
    return rc, json.loads(out), err


@pytest.mark.slow
def test_bench_run_reports_llamacpp_skipped_and_does_not_fail(embedded_model, single_thread, tmp_path, monkeypatch,
                                                              capsys):
    """The worker finds no llama_cpp (a shadowing module that raises ImportError): a note, exit 0."""
    (tmp_path / "llama_cpp.py").write_text("raise ImportError('simulated: llama-cpp-python missing')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))   # the workers inherit it
    rc, result, table = _bench_json(capsys, "--systems", "llamacpp-gguf")
    assert rc == 0
    assert result["systems"]["llamacpp-gguf"] == {
        "impl": "llamacpp", "backend": None, "compiled": False, "dtype": "gguf", "quantization": "gguf",
        "autotune": False, "skipped": "llama-cpp-python is not installed: pip install llama-cpp-python",
        "worker_wall_s": result["systems"]["llamacpp-gguf"]["worker_wall_s"]}
    assert "| llamacpp-gguf | skipped: llama-cpp-python is not installed" in table


@pytest.mark.slow
def test_bench_llamacpp_decodes_exactly_max_new_tokens(embedded_model, single_thread, capsys):
    llama_cpp = pytest.importorskip("llama_cpp", exc_type=ImportError)
    rc, result, _ = _bench_json(capsys, "--systems", "llamacpp-gguf", "--save-tokens")
    assert rc == 0
    entry = result["systems"]["llamacpp-gguf"]
    assert [len(t) for t in entry["tokens"]] == [4, 4]
    assert entry["details"]["llama_cpp"] == llama_cpp.__version__ and entry["threads"] == 1
    assert entry["tokens_per_s"]["median"] > 0 and 0 < entry["fraction_of_bandwidth_bound"]


def test_ratios_are_taken_against_every_reference_that_ran():
    from specdec.tools.bench import runtime

    def entry(tps, dec):
        return {"tokens_per_s": {"median": tps}, "decode_tokens_per_s": {"median": dec},
                "fraction_of_bandwidth_bound": 0.1}

    systems = {"specdec-compiled-bf16": entry(50.0, 52.0), "specdec-compiled-gguf": entry(100.0, 130.0),
               "llamacpp-gguf": entry(125.0, 130.0)}
    ratios = runtime._ratios(systems)
    assert ratios["speedup_vs_specdec-compiled-bf16"]["specdec-compiled-gguf"] == 2.0
    assert ratios["speedup_vs_llamacpp-gguf"]["specdec-compiled-gguf"] == 0.8
    assert ratios["decode_speedup_vs_llamacpp-gguf"]["specdec-compiled-gguf"] == 1.0
    assert ratios["speedup_vs_hf-eager-f32"] == {}                      # the baseline did not run
    assert "speedup_vs_llamacpp-gguf" not in runtime._ratios({"specdec-compiled-bf16": entry(50.0, 52.0)})


def test_coverage_analysis_counts_oov_prompt_lookup_and_larger_vocabularies():
    from safetensors import safe_open

    from specdec.eagle.smollm2 import shipped_eagle3_dir
    from specdec.tools.bench.coverage import analyse, shipped_vocabularies, table
    vocabs = shipped_vocabularies()
    assert {k: len(v) for k, v in vocabs.items()} == {"draft": 8192, "eagle": 8192, "medusa": 8192, "eagle3": 12288}
    with safe_open(str(shipped_eagle3_dir() / "model.safetensors"), "pt") as f:
        assert torch.equal(vocabs["eagle3"], f.get_tensor("t2d").nonzero()[:, 0])   # d2t and t2d agree
    small = {"a": torch.tensor([0, 1, 2, 3]), "b": torch.tensor([3, 2, 1, 0])}
    rows = [{"set": "s", "category": "x", "prompt": [9, 7], "output": [0, 7, 8, 7, 1, 8]},
            {"set": "s", "category": "y", "prompt": [1], "output": [8, 8, 2, 6]}]
    res = analyse(rows, small, [4, 6], vocab_size=10, hidden=2)
    assert res["drafts_share_one_vocabulary"]
    assert res["lm_head_bytes_per_draft_token_bf16"] == {"4": 16, "6": 24, "10": 40}
    x = res["categories"]["s/x"]
    assert x["tokens"] == 6 and x["drafts"]["a"]["oov_tokens"] == 4          # 7, 8, 7, 8
    assert x["drafts"]["a"]["oov_in_prompt"] == 0.5                          # the two 7s
    assert x["drafts"]["a"]["oov_in_context"] == 0.75                        # + the second 8 (seen before)
    cov = x["coverage"]
    assert cov["merge_rank"]["4"] == cov["oracle"]["4"] == 2 / 6            # the base set alone
    assert cov["merge_rank"]["6"] == 2 / 6                                   # + ids 4, 5
    assert cov["oracle"]["6"] == 1.0                                         # + 7, 8 (x's own most frequent)
    assert cov["other_categories"]["6"] == 4 / 6                             # + 8, 6 (y's)
    assert cov["merge_rank"]["10"] == 1.0
    assert res["categories"]["s/ALL"]["tokens"] == 10
    wide = analyse(rows, {**small, "c": torch.tensor([0, 1, 2, 3, 7, 8])}, [4, 6], vocab_size=10, hidden=2)
    assert not wide["drafts_share_one_vocabulary"] and wide["categories"]["s/x"]["drafts"]["c"]["oov"] == 0
    header, _, row_x = table(wide).splitlines()[:3]
    assert "OOV c (6)" in header and "OOV b" not in header                 # b shares a's vocabulary
    assert row_x.startswith("| s/x | 6 | 0.667 | 0.50 | 0.75 | 0.000 | ")


def bench_script(name: str, monkeypatch):
    """The module of ``bench/<name>.py`` (the scripts are not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, bench)      # (its dataclasses look their module up)
    spec.loader.exec_module(bench)
    return bench


def test_pair_benchmark_names_its_drafts_and_refuses_unknown_variants(monkeypatch, capsys):
    """bench_pair's drafts: every combination of --draft-vocab / --draft-quantization / --draft-p-min /
    --draft-window, the p_min and window copies sharing their weights' load; --draft-variants keeps named ones and
    refuses others before loading."""
    bench = bench_script("bench_pair", monkeypatch)
    specs = bench.draft_specs(65536, "q4_0", 0.7)
    assert list(specs) == ["", "-v65536", "-q4_0", "-v65536-q4_0", "-p0.7", "-v65536-p0.7", "-q4_0-p0.7",
                           "-v65536-q4_0-p0.7"]
    assert specs["-v65536-q4_0-p0.7"] == ({"output_vocab_size": 65536, "quantization": "q4_0"}, 0.7, None)
    assert specs["-q4_0"] == ({"quantization": "q4_0"}, None, None) and specs[""] == ({}, None, None)
    assert list(bench.draft_specs(None, None, None)) == [""] and bench.variant_name("") == "base"
    windowed = bench.draft_specs(None, "q4_0", 0.7, 32)
    assert list(windowed) == ["", "-q4_0", "-p0.7", "-q4_0-p0.7", "-w32", "-q4_0-w32", "-p0.7-w32", "-q4_0-p0.7-w32"]
    assert windowed["-q4_0-p0.7-w32"] == ({"quantization": "q4_0"}, 0.7, 32) and windowed["-w32"] == ({}, None, 32)
    cfg = bench.parse_args(["--draft-p-min", "0.7", "--draft-variants", "base,p0.7"])
    assert cfg.draft_variants == ["base", "p0.7"] and not cfg.gate and bench.parse_args(["--gate"]).gate
    with pytest.raises(SystemExit):
        bench.parse_args(["--draft-p-min", "0.7", "--draft-variants", "q4_0-p0.7"])
    assert "no draft named q4_0-p0.7 (these flags make base, p0.7)" in capsys.readouterr().err


def test_suffix_benchmark_interleaves_systems_request_by_request(monkeypatch):
    """bench_suffix runs each request on every system in turn, the order alternating (A B, B A, ...), and each
    system's agent turns are built from its own outputs."""
    bench = bench_script("bench_suffix", monkeypatch)
    calls = []

    def system(name, offset):
        def generate(ids):
            calls.append((name, tuple(ids)))
            return [ids[-1] + offset]
        return generate

    wl = bench.Workload("w", prompts=[[1], [2], [3]])
    out = bench.interleaved(wl, None, {"a": system("a", 10), "b": system("b", 10)})
    assert [c[0] for c in calls] == ["a", "b", "b", "a", "a", "b"]
    assert out == {"a": [[11], [12], [13]], "b": [[11], [12], [13]]}

    class Tok:
        def decode(self, ids, skip_special_tokens):
            return str(ids[0])

    def session(texts):           # two turns; the second prompt holds the first output
        return None if len(texts) == 2 else [100 + sum(int(t) for t in texts)]

    calls.clear()
    out = bench.interleaved(bench.Workload("s", sessions=[session]), Tok(), {"a": system("a", 1), "b": system("b", 2)})
    assert out == {"a": [[101], [202]], "b": [[102], [204]]}      # b's second prompt: 100 + its own 102
    assert [c[0] for c in calls] == ["a", "b", "b", "a"]


def test_suffix_benchmark_names_its_default_output_after_the_whole_model_name(monkeypatch):
    bench = bench_script("bench_suffix", monkeypatch)
    assert bench.default_output("qwen2.5-coder-1.5b-instruct").endswith("/suffix_qwen2.5-coder-1.5b-instruct.json")
    assert bench.default_output("/models/tiny.gguf").endswith("/suffix_tiny.json")


def test_suffix_benchmark_runs_every_system_once_per_prefix_store_size(monkeypatch):
    bench = bench_script("bench_suffix", monkeypatch)
    cfg = bench.parse_args(["--strategies", "suffix", "--modes", "server", "--prefix-cache",
                            "--prefix-cache-mb", "1024,0", "--rows", "2"])
    assert bench.systems_of(cfg) == {"target": ("none", None, 1024), "suffix": ("suffix", None, 1024),
                                     "target-store0": ("none", None, 0), "suffix-store0": ("suffix", None, 0)}
    assert bench.serve_options(cfg, "none", None, 0).batch_size == 2
    assert bench.serve_options(cfg, "none", None, 0).model.prefix_cache_mb == 0
    with pytest.raises(SystemExit):         # offline systems share one target: one store size
        bench.parse_args(["--modes", "offline", "--prefix-cache", "--prefix-cache-mb", "1024,0"])


def test_decode_step_benchmark_times_another_prefetch_setting_in_turn(embedded_model, tmp_path):
    """bench_decode_step --ab-prefetch BYTES:MIN_ROWS on a model whose layers run as kernel calls: each shape also
    runs under that prefetch setting (median and per-pair ratio in the JSON); a malformed setting is refused by
    argparse."""
    script = str(REPO / "bench" / "bench_decode_step.py")
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, script, "--quantization", "gguf", "--amp", "f32", "--backend", "eager",
                    "--shapes", "1x1x64,1x2x64", "--warmup", "1", "--repeats", "2", "--threads", "1",
                    "--ab-prefetch", "0:1", "--output", str(out)], check=True, capture_output=True)
    results = json.loads(out.read_text())["results"]
    assert [r["n"] for r in results] == [1, 2]
    assert all(r["prefetch0r1_median_ms"] > 0 and r["prefetch0r1_over_fused_median"] > 0 for r in results)
    bad = subprocess.run([sys.executable, script, "--ab-prefetch", "4096"], capture_output=True, text=True)
    assert bad.returncode == 2 and "expected BYTES:MIN_ROWS" in bad.stderr


def test_pair_benchmark_warm_up_resets_both_gate_meters(embedded_model, single_thread, monkeypatch):
    """bench_pair's untimed warm-up leaves a gated combination's meters empty — the step gate's and the draft
    meter's at lookup misses — so the timed runs learn from scratch."""
    from specdec import DecoderModel
    from specdec.options import EMBEDDED_NAME
    bench = bench_script("bench_pair", monkeypatch)
    cfg = bench.parse_args(["--model", EMBEDDED_NAME, "--draft-model", EMBEDDED_NAME, "--strategies",
                            "none,lookup+model", "--ks", "4", "--gate", "--warmup-tokens", "24"])
    target = DecoderModel.from_pretrained(EMBEDDED_NAME, batch_size=1, backend="eager", progress=False)
    system = bench.our_systems(cfg, target)["specdec-lookup+model-k4-gate"]
    gen = system.reset_gate.__self__
    prompt = target.tokenizer("Write a haiku about the sea.").input_ids
    system.generate([prompt], max_new_tokens=24, eos_token_id=[])
    assert sum(gen.gate_meter.steps.values()) > 0 and sum(gen.draft_meter.steps.values()) > 0
    bench.warm_up({system.name: system}, {}, [[prompt]], [], cfg, None)
    assert gen.gate_meter.steps == gen.draft_meter.steps == {True: 0, False: 0}


def test_suffix_replay_benchmark_records_once_then_replays(monkeypatch, tmp_path, capsys):
    """bench_suffix_replay records the embedded model's greedy outputs of a workload, replays every system from
    them, and a second run reads the record and gives the same figures; chain k's oracle takes its steps, verifying
    only what they accept; a record of other requests is refused."""
    bench = bench_script("bench_suffix_replay", monkeypatch)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"results": [{"batch": 1, "n": 1, "median_ms": 10.0},
                                             {"batch": 1, "n": 9, "median_ms": 18.0}]}))
    args = ["--workloads", "extraction", "--requests", "3", "--max-new-tokens", "24", "--backend", "eager",
            "--threads", "1", "--ks", "4", "--trees", "4x4", "--record", str(tmp_path / "rec.json"),
            "--costs", str(costs), "--output", str(tmp_path / "out.json")]
    results = []
    for _ in range(2):
        assert bench.main(args) == 0
        results.append(json.loads((tmp_path / "out.json").read_text())["results"]["extraction"])
    assert "replaying the outputs recorded" in capsys.readouterr().err
    assert results[0] == results[1]
    chain, oracle = results[0]["chain-k4"], results[0]["chain-k4-oracle"]
    assert set(results[0]) == {"chain-k4", "chain-k4-oracle", "tree-4x4"}
    assert (oracle["steps"], oracle["tau"]) == (chain["steps"], chain["tau"]) and chain["tau"] > 1.0
    assert oracle["drafted"] == oracle["accepted"] == chain["accepted"] <= chain["drafted"]
    speedup = chain["modelled_speedup"][str(costs)]
    assert 1.0 < speedup <= oracle["modelled_speedup"][str(costs)]
    with pytest.raises(SystemExit, match="records other requests"):
        bench.main([a if a != "24" else "16" for a in args])
    sweep = bench.parse_args(["--ks", "4", "--alphas", "0.5,1", "--no-oracle", "--trees", ""])
    assert list(bench.systems(sweep, 100)) == ["chain-k4-a0.5-p0.1", "chain-k4-a1-p0.1"]
    for bad in (["--trees", "4x"], ["--alphas", "0"], ["--min-probs", "1.5"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
