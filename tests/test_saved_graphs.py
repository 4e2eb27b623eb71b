"""Saved graphs (``core.saved_graphs``): compiled ahead of time into files named by a fingerprint, loaded by
a later process without compiling, and deferred compilation (a first run generating eagerly)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdec.core.graphs import GraphKey, StepGraph
from specdec.core.saved_graphs import fingerprint, graphs_dir, is_saved

from conftest import hf_greedy, load, prompt_ids

SHAPES = dict(n_positions=64, context_buckets=[16], kv_buckets=[64], amp="f32")
DECODE = GraphKey(1, 1, 64, False)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_fingerprint_names_structure_not_instance(checkpoint):
    """Two loads of one checkpoint share a fingerprint; another key, batch size, dtype or thread count
    does not; an attribute whose repr holds a memory address makes the graph unsavable (None)."""
    a, b = load(checkpoint("llama"), **SHAPES), load(checkpoint("llama"), **SHAPES)
    name = fingerprint(StepGraph(a.lm, DECODE, None), 1)
    assert name is not None and name == fingerprint(StepGraph(b.lm, DECODE, None), 1)
    assert fingerprint(StepGraph(a.lm, GraphKey(1, 1, 64, True), None), 1) != name
    assert fingerprint(StepGraph(a.lm, DECODE, None), 2) != name
    assert fingerprint(StepGraph(load(checkpoint("llama"), **{**SHAPES, "amp": "bf16"}).lm, DECODE, None), 1) != name
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert fingerprint(StepGraph(a.lm, DECODE, None), 1) != name
    finally:
        torch.set_num_threads(threads)
    a.lm.model.layers[0].opaque = object()
    assert fingerprint(StepGraph(a.lm, DECODE, None), 1) is None


LOAD_SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(int(sys.argv[3]))
from torch._dynamo.utils import counters
from specdec import DecoderModel
model = DecoderModel.from_pretrained(sys.argv[1], n_positions=64, context_buckets=[16], kv_buckets=[64], amp="f32",
                                     backend="compiled", saved_graphs=True, progress=False)
prompt = json.loads(sys.argv[2])
out = model.generate([prompt], max_new_tokens=12, eos_token_id=[])[0, len(prompt):].tolist()
print(json.dumps({"out": out, "frames": counters["stats"]["unique_graphs"], "graphs": len(model.graphs.built)}))
"""


@pytest.mark.slow
def test_deferred_then_saved_then_loaded_by_another_process(checkpoint, cache):
    """A deferred graph runs eagerly (nothing built, output = transformers' greedy tokens); compiling the
    deferred graphs saves one file each; the compiled graphs give the same tokens; a second process
    loads both files and generates the same tokens without tracing a single graph (Dynamo's counter)."""
    ckpt = checkpoint("llama")
    prompt = prompt_ids(9, seed=3)
    ref = hf_greedy(ckpt.hf, prompt, 12)
    model = load(ckpt, backend="compiled", saved_graphs=True, **SHAPES)
    keys = model.graph_keys(prompt_length=len(prompt), max_length=len(prompt) + 12)
    assert len(keys) == 2 and not any(is_saved(model.graph_module(k), 1) for k in keys)
    model.graphs.defer(keys)
    assert model.generate([prompt], max_new_tokens=12, eos_token_id=[])[0, len(prompt):].tolist() == ref
    assert not model.graphs.built and set(model.graphs.pending) == set(keys)
    model.graphs.compile_deferred(progress=False)
    assert set(model.graphs.built) == set(keys) and not model.graphs.pending
    assert all(is_saved(model.graph_module(k), 1) for k in keys)
    assert len(list(graphs_dir().glob("*.bin"))) == 2
    assert model.generate([prompt], max_new_tokens=12, eos_token_id=[])[0, len(prompt):].tolist() == ref
    env = {**os.environ, "SPECDEC_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(ckpt.path), json.dumps(prompt),
                           str(torch.get_num_threads())], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"out": ref, "frames": 0, "graphs": 2}, result


def test_defer_needs_saved_graphs(checkpoint):
    model = load(checkpoint("llama"), backend="compiled", **SHAPES)      # saved_graphs off
    with pytest.raises(ValueError, match="saved_graphs=True"):
        model.graphs.defer([DECODE])


@pytest.mark.slow
def test_cli_first_run_generates_eagerly_then_later_runs_load(checkpoint, cache, capsys):
    """``specdec generate --backend compiled --draft lookup`` with nothing saved: says so, prints the eager
    run's tokens (transformers' greedy ones), then compiles and saves the graphs (context, decode and the
    2- to 5-token verify graphs: lookup is "padded"); the next run loads them (its summary names the
    compiled backend) and prints the same tokens."""
    from specdec.cli import main
    ckpt = checkpoint("llama")
    prompt = prompt_ids(9, seed=8)
    argv = ["generate", "--prompt-ids", ",".join(map(str, prompt)), "--model", str(ckpt.path), "--backend",
            "compiled", "--amp", "f32", "--n-positions", "64", "--max-new-tokens", "10", "--ignore-eos",
            "--threads", str(torch.get_num_threads()), "--draft", "lookup"]
    ref = hf_greedy(ckpt.hf, prompt, 10)
    runs = []
    for _ in range(2):
        assert main(argv) == 0
        out, err = capsys.readouterr()
        runs.append(([int(t) for t in out.strip().splitlines()[-1].split(",")], err))
    (first, first_err), (second, second_err) = runs
    assert first == second == ref
    assert "graphs are not compiled yet" in first_err and "(eager this run)" in first_err, first_err[-2000:]
    assert "not compiled yet" not in second_err and "compiled f32" in second_err, second_err[-2000:]
    assert len(list(graphs_dir().glob("*.bin"))) == 6
