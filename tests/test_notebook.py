"""examples/acceptance_experiments.ipynb: stored without outputs, and it runs (nbclient, the small
configuration ``SPECDEC_NOTEBOOK_SMALL=1``) on the embedded model: every code cell runs without error
and the figures come out as image/png outputs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "acceptance_experiments.ipynb"
FIGURES = 4
TIMEOUT_S = 600   # per cell


def read():
    nbformat = pytest.importorskip("nbformat")
    return nbformat, nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_stored_clean():
    nbformat, nb = read()
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "no code cells"
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, "store the notebook without outputs"
    assert "SPECDEC_NOTEBOOK_SMALL" in code[0].source, "the first code cell holds the parameters"
    for name in ("NUM_PROMPTS", "MAX_NEW_TOKENS", "KS", "TEMPERATURES"):
        assert name in code[0].source, name


@pytest.mark.slow
def test_notebook_runs(embedded_model, tmp_path, monkeypatch):  # noqa: F811
    nbformat, nb = read()
    nbclient = pytest.importorskip("nbclient")
    for module in ("ipykernel", "pandas", "matplotlib"):
        pytest.importorskip(module)
    # the kernel inherits the environment: the small configuration, one thread (a shared machine)
    monkeypatch.setenv("SPECDEC_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()   # raises CellExecutionError (with the cell's traceback) when a cell fails
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert all(c.execution_count is not None for c in code), "a code cell did not run"
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= FIGURES, f"{len(images)} figures, expected {FIGURES}"
    assert list(tmp_path.glob("*.jsonl")), "the sweep wrote no result file"
