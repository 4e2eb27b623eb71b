"""The Python snippets of README.md and of the documentation (docs/*.md) run as written.

Every ```python block of README.md and of every Markdown page under docs/ is run on its own (README
first, then the pages in path order; each in a fresh interpreter: the block is written to a script and
run with ``python script.py`` in a temporary working directory, so ``if __name__ == "__main__":``
guards, ``launch``'s spawned workers and files the snippet writes behave as for a user). The runs load
the embedded model (slow, skipped when it is not installed); a fast test checks that the snippets are
there, compile, and hold no placeholders.

Convention for the documentation: a block fenced ```python is executed, so it must run as it is on
the CPU with the embedded model (and the `test` extra) within SNIPPET_TIMEOUT_S. A block that should be
shown but not executed — it needs a GPU, Neuron hardware or the Neuron SDK, a model that is not
installed, several hosts, a long training run or minutes of graph compilation — is fenced ```py instead
(``py`` highlights the same way); it is only compiled by the fast test. A ```python block that names a model of
``specdec.core.named_models`` (e.g. the Qwen2.5-Coder pair in docs/real-pair.md) runs only where that
model's part packages are installed (``pip install -e ".[qwen]"``, as CI does). Keep the number of
executed blocks small: each one costs a fresh interpreter and a model load in CI.
"""
from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from specdec.core.named_models import NAMED_MODELS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MIN_SNIPPETS = 18          # README.md and docs/ hold 19; fewer means a block lost its ```python fence
MIN_README_SNIPPETS = 1    # the README's quickstart
SNIPPET_TIMEOUT_S = 300
PLACEHOLDERS = ("path/to", "...")
RUN_FENCE, SHOW_FENCE = "```python", "```py"


def markdown_files() -> list[Path]:
    """README.md, then every Markdown page of docs/ in path order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def code_blocks(path: Path, fence: str) -> list[tuple[str, int, str]]:
    """(file relative to the repository, line number of the opening fence, code) of every block of
    ``path`` opened by exactly ``fence``, in order (an indented block is dedented by its fence's indent)."""
    name = path.relative_to(ROOT).as_posix()
    blocks, start, indent, body = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if start is None:
            if line.strip() == fence:
                start, indent, body = number, len(line) - len(line.lstrip()), []
        elif line.strip().startswith("```"):
            blocks.append((name, start, "\n".join(body) + "\n"))
            start = None
        else:
            body.append(line[indent:] if line[:indent].strip() == "" else line)
    assert start is None, f"{name} line {start}: unclosed {fence} block"
    return blocks


def python_snippets() -> list[tuple[str, int, str]]:
    """Every executed (```python) block of README.md and docs/, in order."""
    return [block for path in markdown_files() for block in code_blocks(path, RUN_FENCE)]


def snippet_id(snippet: tuple[str, int, str]) -> str:
    name, line, code = snippet
    first = next((s.strip() for s in code.splitlines() if s.strip()), "")
    return f"{name}:L{line}:{re.sub(r'[^A-Za-z0-9_.,:=()]+', '_', first)[:60]}"


def code_without_comments(code: str) -> str:
    """The snippet's tokens except comments (string literals stay: a placeholder path is one)."""
    tokens = tokenize.generate_tokens(io.StringIO(code).readline)
    return " ".join(t.string for t in tokens if t.type != tokenize.COMMENT)


def missing_named_models(code: str) -> list[str]:
    """The named models the snippet loads whose part packages are not installed."""
    return [name for name, model in NAMED_MODELS.items()
            if name in code and any(importlib.util.find_spec(pkg) is None for pkg, _ in model.packages)]


SNIPPETS = python_snippets()


def test_readme_snippets_are_complete():
    assert len(SNIPPETS) >= MIN_SNIPPETS, [f"{name}:{line}" for name, line, _ in SNIPPETS]
    assert sum(name == "README.md" for name, _, _ in SNIPPETS) >= MIN_README_SNIPPETS
    for name, line, code in SNIPPETS:
        compile(code, f"{name}:{line}", "exec")
        found = [p for p in PLACEHOLDERS if p in code_without_comments(code)]
        assert not found, f"{name} line {line}: placeholder {found} outside comments"
    shown = [block for path in markdown_files() for block in code_blocks(path, SHOW_FENCE)]
    for name, line, code in shown:           # not executed, but valid Python
        compile(code, f"{name}:{line}", "exec")


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[snippet_id(s) for s in SNIPPETS])
def test_readme_snippet_runs(snippet, embedded_model, tmp_path):
    name, line, code = snippet
    missing = missing_named_models(code)
    if missing:
        pytest.skip(f"the part packages of {missing} are not installed (pip install -e '.[qwen]')")
    script = tmp_path / f"{Path(name).stem}_line{line}.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # one thread: on a shared machine (the test suite beside it) OpenMP threads spinning against other
    # processes make these small models several times slower; launch's workers inherit it
    env["OMP_NUM_THREADS"] = "1"
    try:
        run = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=SNIPPET_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name} line {line}: the snippet ran longer than {SNIPPET_TIMEOUT_S} s\n{e.stderr or ''}")
    assert run.returncode == 0, (f"{name} line {line}: the snippet failed (exit {run.returncode})\n"
                                 f"--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-5000:]}")
