"""Every ``examples/*.py`` runs as a user runs it: ``python examples/X.py`` in a fresh process
(one intra-op thread), exit code 0, its greedy-equality assertion passed, the statistics printed.
They load the embedded model (slow; skipped when it is not installed)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
STRATEGIES = {"draft_model.py": "draft model", "eagle.py": "EAGLE", "medusa.py": "Medusa",
              "prompt_lookup.py": "prompt lookup"}
TIMEOUT_S = 240


def test_one_example_per_strategy():
    assert set(STRATEGIES) | {"quickstart.py"} <= set(EXAMPLES), EXAMPLES
    for name in EXAMPLES:
        code = (ROOT / "examples" / name).read_text()
        compile(code, name, "exec")
        assert code.startswith('"""') and f"python examples/{name}" in code, f"{name}: docstring with its command"


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name, embedded_model, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SpecStats(" in proc.stdout, proc.stdout[-2000:]
    if name in STRATEGIES:
        assert f"{STRATEGIES[name]}" in proc.stdout and "identical tokens" in proc.stdout, proc.stdout[-2000:]
