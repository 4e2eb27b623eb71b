"""The benchmarks' prompt data ships inside the package, and the bench CLIs start (no model is loaded)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec.bench
from specdec.bench.prompts import default_prompts_path, load_prompts, load_questions
from specdec.core.config import module_bytes

REPO = Path(__file__).resolve().parents[1]
DATA = Path(specdec.bench.__file__).resolve().parent / "data"


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
    patterns = pyproject["tool"]["setuptools"]["package-data"]["specdec.bench"]
    shipped = {p.relative_to(DATA.parent).as_posix() for pat in patterns for p in DATA.parent.glob(pat)}
    assert {"data/mt_bench_questions.jsonl", "data/NOTICE"} <= shipped


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
