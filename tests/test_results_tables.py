"""Results are data: every JSON under bench/results/ says what wrote it (command, commit, machine), and every
results table of README.md and docs/ is what ``scripts/results_tables.py`` generates from those files — so a
table can never disagree with its JSON. A failure names the stale table; ``python scripts/results_tables.py``
rewrites it."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("results_tables", ROOT / "scripts" / "results_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_result_says_what_wrote_it(path):
    result = json.loads(path.read_text())
    assert {"command", "commit", "machine"} <= result.keys(), f"{path.name} lacks command, commit or machine"


def test_one_current_file_per_benchmark():
    """Runs are history (git), not files: no version, date, run number or before / after in a name."""
    history = re.compile(r"_v\d|\d{4}-\d\d-\d\d|_run\d|_r\d|_(old|new|before|after)(_|$)")
    assert [p.name for p in RESULTS.iterdir() if history.search(p.stem)] == []
    assert [p.name for p in RESULTS.iterdir() if p.suffix != ".json"] == []


def test_tables_match_their_json(generator, capsys):
    assert generator.main(["--check"]) == 0, capsys.readouterr().err


def test_check_names_a_stale_table(generator, tmp_path, monkeypatch, capsys):
    page = tmp_path / "page.md"
    page.write_text("<!-- results:decode_step start -->\n| stale |\n<!-- results:decode_step end -->\n")
    monkeypatch.setattr(generator, "pages", lambda: [page])
    monkeypatch.setattr(generator, "ROOT", tmp_path)
    monkeypatch.setattr(generator, "TABLES", {"decode_step": generator.TABLES["decode_step"]})
    with pytest.raises(SystemExit, match="unknown table 'nope'"):
        generator.update("<!-- results:nope start -->\n<!-- results:nope end -->\n", "page.md")
    assert generator.main(["--check"]) == 1 and "| stale |" in page.read_text()
    assert "page.md: table 'decode_step' is stale" in capsys.readouterr().err
    assert generator.main([]) == 0 and "| stale |" not in page.read_text()
    assert generator.main(["--check"]) == 0
