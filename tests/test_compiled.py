"""backend="compiled" (torch.compile, fullgraph, static shapes): same greedy tokens as eager, and
``save`` → ``DecoderModel.load`` in a fresh process (empty caches) reproduces the outputs from the
saved compile artifacts. Compiling is slow on small CPUs: one tiny model, one context bucket, one
KV bucket (two graphs), compiled once for the module."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.compiler._cache import CacheArtifactManager

from specdec.core.graphs import configure_compile_cache

from conftest import hf_greedy, load, prompt_ids

SHAPES = dict(n_positions=64, context_buckets=[16], kv_buckets=[64])
N_NEW = 40


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    ckpt = checkpoint("llama")
    prompts = [prompt_ids(9, seed=81), prompt_ids(14, seed=82)]
    refs = [hf_greedy(ckpt.hf, p, N_NEW) for p in prompts]
    cache = tmp_path_factory.mktemp("specdec-cache")   # isolated: a cold compile, nothing reused
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_CACHE", str(cache))
        mp.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        torch._dynamo.reset()
        with CacheArtifactManager.with_fresh_cache():   # save() stores what this process compiled: these graphs only
            model = load(ckpt, backend="compiled", **SHAPES)
            outs = [model.generate([p], max_new_tokens=N_NEW, eos_token_id=[]) for p in prompts]
            inductor_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
            saved = tmp_path_factory.mktemp("saved")
            model.save(saved)
        yield dict(ckpt=ckpt, model=model, prompts=prompts, refs=refs, outs=outs, saved=saved,
                   cache=cache, inductor_dir=inductor_dir)


def test_compiled_greedy_equals_eager_and_transformers(setup):
    eager = load(setup["ckpt"], **SHAPES)
    model = setup["model"]
    for p, ref, out in zip(setup["prompts"], setup["refs"], setup["outs"]):
        assert out[0, len(p):].tolist() == ref
        assert torch.equal(out, eager.generate([p], max_new_tokens=N_NEW, eos_token_id=[]))
    # the graphs really are compiled callables, one per (context bucket, KV bucket)
    assert sorted((k.n_tokens, k.kv_len) for k in model.graphs.built) == [(1, 64), (16, 16)]
    for g in model.graphs.built.values():
        assert hasattr(g, "_torchdynamo_orig_callable")        # torch.compile's wrapper
    # step logits agree with eager to float tolerance
    params = model.sampling_params(do_sample=False)
    p = torch.tensor(setup["prompts"][0])
    a, b = model.prefill([p], params), eager.prefill([p], params)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
    tok = torch.tensor([[setup["refs"][0][0]]])
    torch.testing.assert_close(model.step(tok, params).logits, eager.step(tok, params).logits, atol=1e-4, rtol=1e-4)


def test_compile_cache_lives_under_specdec_cache(setup):
    """Inductor's on-disk cache went to $SPECDEC_CACHE/inductor (even though importing transformers'
    models had already made torch set its own default for TORCHINDUCTOR_CACHE_DIR)."""
    assert Path(setup["inductor_dir"]) == setup["cache"] / "inductor"
    assert any((setup["cache"] / "inductor").rglob("*")), "nothing was written to the compile cache"


def test_configure_compile_cache_respects_user_choice(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())     # torch's own default
    configure_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's
    configure_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


LOAD_SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(1)   # same as the parent: the thread count is part of Inductor's cache key
from torch._dynamo.utils import counters
from specdec import DecoderModel
model = DecoderModel.load(sys.argv[1], progress=False)
hits = dict(counters["inductor"])
prompts = json.loads(sys.argv[2])
outs = [model.generate([p], max_new_tokens=int(sys.argv[3]), eos_token_id=[]).tolist() for p in prompts]
print(json.dumps({"outs": outs, "counters": hits, "backend": model.settings.backend,
                  "graphs": len(model.graphs.built), "counters_after": dict(counters["inductor"])}))
"""


def test_saved_artifacts_hold_both_graphs(setup):
    info = torch.compiler.load_cache_artifacts((setup["saved"] / "compile_cache.bin").read_bytes())
    assert info is not None and len(info.inductor_artifacts) == 2, info


def test_save_then_load_in_second_process(setup):
    """A second process loads the saved model and skips Inductor compilation (cache hits for both
    graphs), reproducing the outputs. (It shares $SPECDEC_CACHE with this process: loading only from
    the artifacts into an empty cache also works but recompiles the C++ kernels, too slow here.)"""
    saved = setup["saved"]
    meta = json.loads((saved / "specdec.json").read_text())
    assert meta["settings"]["backend"] == "compiled"
    assert meta["checkpoint"] == str(setup["ckpt"].path.resolve())
    assert len(meta["graphs"]) == 2
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["SPECDEC_CACHE"] = str(setup["cache"])
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(saved), json.dumps(setup["prompts"]), str(N_NEW)],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "compiled" and result["graphs"] == 2
    assert result["outs"] == [o.tolist() for o in setup["outs"]]
    # both graphs came from the cache: no Inductor compilation from scratch, before or during generation
    assert result["counters"].get("fxgraph_cache_hit", 0) == 2, result["counters"]
    assert result["counters"].get("fxgraph_cache_miss", 0) == 0, result["counters"]
    assert result["counters_after"].get("fxgraph_cache_miss", 0) == 0, result["counters_after"]


def test_no_recompilation_between_warm_up_and_generation(setup):
    """``compile()`` warms every graph with example inputs and ``generate`` must hit the same compiled
    code: the runtime passes inputs with standard strides (a [B, 1] slice of a wider tensor keeps its
    parent's stride on the size-1 dim, which a compiled graph is specialised on)."""
    from torch._dynamo.utils import counters
    model, p = setup["model"], setup["prompts"][1]
    before = counters["stats"]["unique_graphs"]
    model.compile(progress=False, prompt_length=len(p), max_length=len(p) + N_NEW)
    out = model.generate([p], max_new_tokens=N_NEW, eos_token_id=[])
    assert counters["stats"]["unique_graphs"] == before
    assert out[0, len(p):].tolist() == setup["refs"][1]
