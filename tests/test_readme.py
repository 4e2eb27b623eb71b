"""The README's Python snippets run as written.

Every ```python block of README.md is run on its own (in order, each in a fresh interpreter: the
block is written to a script and run with ``python script.py`` in a temporary working directory, so
``if __name__ == "__main__":`` guards, ``launch``'s spawned workers and files the snippet writes behave
as for a user). The runs load the embedded model (slow, skipped when it is not installed); a fast test
checks that the snippets are there, compile, and hold no placeholders.
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MIN_SNIPPETS = 10          # the README has 11; fewer means a block lost its ```python fence
SNIPPET_TIMEOUT_S = 300
PLACEHOLDERS = ("path/to", "...")


def python_snippets() -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of every ```python block of the README, in order."""
    snippets, start, body = [], None, []
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if start is None:
            if line.strip() == "```python":
                start, body = number, []
        elif line.strip().startswith("```"):
            snippets.append((start, "\n".join(body) + "\n"))
            start = None
        else:
            body.append(line)
    assert start is None, f"README.md line {start}: unclosed ```python block"
    return snippets


def snippet_id(snippet: tuple[int, str]) -> str:
    line, code = snippet
    first = next((s.strip() for s in code.splitlines() if s.strip()), "")
    return f"L{line}:{re.sub(r'[^A-Za-z0-9_.,:=()]+', '_', first)[:60]}"


def code_without_comments(code: str) -> str:
    """The snippet's tokens except comments (string literals stay: a placeholder path is one)."""
    tokens = tokenize.generate_tokens(io.StringIO(code).readline)
    return " ".join(t.string for t in tokens if t.type != tokenize.COMMENT)


SNIPPETS = python_snippets()


def test_readme_snippets_are_complete():
    assert len(SNIPPETS) >= MIN_SNIPPETS, [line for line, _ in SNIPPETS]
    for line, code in SNIPPETS:
        compile(code, f"README.md:{line}", "exec")
        found = [p for p in PLACEHOLDERS if p in code_without_comments(code)]
        assert not found, f"README.md line {line}: placeholder {found} outside comments"


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[snippet_id(s) for s in SNIPPETS])
def test_readme_snippet_runs(snippet, embedded_model, tmp_path):
    line, code = snippet
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # one thread: on a shared machine (the test suite beside it) OpenMP threads spinning against other
    # processes make these small models several times slower; launch's workers inherit it
    env["OMP_NUM_THREADS"] = "1"
    try:
        run = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=SNIPPET_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"README.md line {line}: the snippet ran longer than {SNIPPET_TIMEOUT_S} s\n{e.stderr or ''}")
    assert run.returncode == 0, (f"README.md line {line}: the snippet failed (exit {run.returncode})\n"
                                 f"--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-5000:]}")
