"""The first run: GGUF conversion once per model FILE (content-keyed cache, atomic, with progress),
and compiled graphs reused by a later process.

A tiny Llama GGUF (2 layers, byte-level BPE vocabulary of 258 tokens) is written with the ``gguf``
package's ``GGUFWriter`` and converted by ``specdec.core.paths`` exactly as the embedded model is.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")

from specdec.core import cache_files, paths  # noqa: E402
from specdec.core.cache_files import HASH_INDEX, file_sha256  # noqa: E402
from specdec.core.paths import convert_gguf, gguf_cache_path, write_safetensors  # noqa: E402

from conftest import prompt_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, context=256)


def write_tiny_gguf(path: Path, seed: int = 0, arch: str = "llama") -> Path:
    """A small random-weight GGUF (``arch`` llama, or qwen2: q / k / v biases) with a byte-level BPE tokenizer
    (what transformers reads)."""
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    tokens = list(bytes_to_unicode().values()) + ["he", "<|endoftext|>"]
    types = [1] * (len(tokens) - 1) + [3]           # 3 = control
    h, f, v = TINY["hidden"], TINY["ffn"], len(tokens)
    kv = h // TINY["heads"] * TINY["kv_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(TINY["context"])
    w.add_embedding_length(h)
    w.add_block_count(TINY["layers"])
    w.add_feed_forward_length(f)
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["h e"])
    w.add_bos_token_id(v - 1)
    w.add_eos_token_id(v - 1)

    def tensor(name, *shape):
        w.add_tensor(name, (0.15 * rng.standard_normal(shape)).astype(np.float32))
    tensor("token_embd.weight", v, h)
    for i in range(TINY["layers"]):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(h, np.float32))
        tensor(b + "attn_q.weight", h, h)
        tensor(b + "attn_k.weight", kv, h)
        tensor(b + "attn_v.weight", kv, h)
        if arch == "qwen2":
            for name, rows in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
                tensor(b + name + ".bias", rows)
        tensor(b + "attn_output.weight", h, h)
        tensor(b + "ffn_gate.weight", f, h)
        tensor(b + "ffn_up.weight", f, h)
        tensor(b + "ffn_down.weight", h, f)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    tensor("output.weight", v, h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


N_TENSORS = 2 + 9 * TINY["layers"] + 1


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-src") / "tiny-llama.Q0.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty $SPECDEC_CACHE."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def install_copy(src: Path, where: Path, mtime: float) -> Path:
    """A copy of ``src`` at another path with another modification time (a reinstall)."""
    where.mkdir(parents=True)
    dst = where / src.name
    shutil.copyfile(src, dst)
    os.utime(dst, (mtime, mtime))
    return dst


def entries(cache: Path) -> list[str]:
    """What the GGUF cache holds besides the hash index."""
    root = cache / "gguf"
    return sorted(p.name for p in root.iterdir() if p.name != HASH_INDEX) if root.is_dir() else []


# ---------------------------------------------------------------------- conversion cache
def test_conversion_is_cached_once_per_file_content(tiny_gguf, cache, tmp_path, capfd):
    """Two installs of the same file (different paths and mtimes): one conversion, one entry."""
    first = install_copy(tiny_gguf, tmp_path / "site-packages-1", 1_700_000_000)
    second = install_copy(tiny_gguf, tmp_path / "site-packages-2", 1_800_000_000)
    out = paths.resolve_model_path(first)
    err = capfd.readouterr().err
    assert f"converting {first.name} to safetensors (once per model file; cached at {out})" in err
    assert "writing model.safetensors" in err and f"{N_TENSORS}/{N_TENSORS}" in err     # the bar over tensors
    assert "specdec: converted" in err
    assert out == gguf_cache_path(first) == cache / "gguf" / f"tiny-llama.Q0-{file_sha256(first)[:16]}"
    assert entries(cache) == [out.name]

    again = paths.resolve_model_path(second)      # the "reinstall": same content, another path
    assert again == out
    assert "converting" not in capfd.readouterr().err
    assert entries(cache) == [out.name]
    source = json.loads((out / paths.SOURCE_FILE).read_text())
    assert source["sha256"] == file_sha256(tiny_gguf) and source["size"] == tiny_gguf.stat().st_size

    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)   # different content: its own entry
    assert paths.resolve_model_path(other) != out
    assert len(entries(cache)) == 2


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-blocks"])
def test_converted_checkpoint_matches_transformers(kind, tmp_path, cache):
    """The cache entry holds the config, the tensors and the tokenizer transformers builds from the same file
    (its own GGUF reader and dequantization), loadable by the runtime: f32 llama and qwen2 files, and a llama
    file of GGML blocks (Q4_0 / Q4_1 / Q8_0) whose q / k rows llama.cpp's converter permuted."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specdec.core.config import ModelConfig
    from specdec.core.model import rope_inv_freq

    from conftest import hf_greedy, load
    from tiny_gguf import write_tiny_gguf as write_block_gguf

    path = tmp_path / f"tiny-{kind}.gguf"
    if kind == "llama-blocks":
        write_block_gguf(path, seed=2)
    else:
        write_tiny_gguf(path, arch=kind)
    out = convert_gguf(path, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    state = load_file(out / "model.safetensors")
    assert set(state) == set(hf.state_dict()) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    for name, t in state.items():
        assert torch.equal(t, hf.state_dict()[name]), name
    config, reference = ModelConfig.from_dir(out), ModelConfig.from_hf(AutoConfig.from_pretrained(path.parent,
                                                                                                gguf_file=path.name))
    assert replace(config, hf_config=None) == replace(reference, hf_config=None)
    (freq, scale), (ref_freq, ref_scale) = rope_inv_freq(config), rope_inv_freq(reference)
    assert torch.equal(freq, ref_freq) and scale == ref_scale
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "hello there, the 3 heh"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"] and ours.eos_token_id == theirs.eos_token_id
    model = load(out)
    p = prompt_ids(7, seed=3, vocab=250)
    assert model.generate([p], max_new_tokens=8, eos_token_id=[])[0, len(p):].tolist() == \
        hf_greedy(hf, p, 8)


def test_hash_is_memoised_by_path_size_and_mtime(tiny_gguf, cache, tmp_path, monkeypatch):
    copy = install_copy(tiny_gguf, tmp_path / "a", 1_700_000_000)
    sha = file_sha256(copy)
    index = json.loads((cache / "gguf" / HASH_INDEX).read_text())
    assert index[str(copy.resolve())]["sha256"] == sha

    def no_hashing(*a, **k):
        raise AssertionError("hashed again")
    monkeypatch.setattr(cache_files.hashlib, "sha256", no_hashing)
    assert file_sha256(copy) == sha                          # memo hit: the file is not read
    os.utime(copy, (1_750_000_000, 1_750_000_000))           # a new version of the file: hashed again
    with pytest.raises(AssertionError, match="hashed again"):
        file_sha256(copy)


def test_interrupted_conversion_leaves_no_entry(tiny_gguf, cache, monkeypatch):
    """Ctrl-C while the weights are written: no cache entry, no temporary directory; the next run
    converts from scratch."""
    real = paths.write_safetensors

    def interrupted(state, path, *a, **k):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt
    monkeypatch.setattr(paths, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny_gguf, progress=False)
    assert entries(cache) == []
    monkeypatch.setattr(paths, "write_safetensors", real)
    out = convert_gguf(tiny_gguf, progress=False)
    assert entries(cache) == [out.name]
    assert len(load_file(out / "model.safetensors")) == N_TENSORS


SIGINT_SCRIPT = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)   # also when started in the background (SIGINT ignored)
from specdec.core import paths
real = paths.write_safetensors
def write(state, path, *a, **k):
    real(dict(list(state.items())[:3]), path, *a, **k)     # part of the weights on disk, then Ctrl-C
    os.kill(os.getpid(), signal.SIGINT)
paths.write_safetensors = write
paths.convert_gguf(sys.argv[1])
"""


def test_ctrl_c_in_a_real_process_leaves_no_entry(tiny_gguf, cache):
    env = {**os.environ, "SPECDEC_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SIGINT_SCRIPT, str(tiny_gguf)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr, proc.stderr[-2000:]
    assert entries(cache) == []


def test_leftovers_are_cleaned(tiny_gguf, cache, capfd):
    """A conversion removes what dead conversions left (a temporary directory of a process of this
    host that no longer runs, or a day old) and the old install-keyed (size-mtime) copies of the same
    model; it keeps a running process's temporary directory, another host's recent one, a legacy
    copy written in the last minutes (an older specdec may be reading it) and other models' entries."""
    import socket
    import time
    root = cache / "gguf"
    host, now = socket.gethostname(), time.time()
    dead = 2 ** 22 + 12345                               # above the default pid_max: never a live process
    assert not cache_files.pid_alive(dead)
    hour_ago, two_days_ago = now - 3600, now - 2 * 86400
    stale = {root / f".tiny-llama.Q0-0123456789abcdef.tmp-{host}-{dead}": now,
             root / ".tiny-llama.Q0-0123456789abcdef.tmp-other-host-7": two_days_ago,
             root / "tiny-llama.Q0-98362432-1795435876": hour_ago,
             root / "tiny-llama.Q0-98362432-1795438543.tmp": hour_ago}
    kept = {root / f".other-0123456789abcdef.tmp-{host}-{os.getppid()}": hour_ago,
            root / ".other-0123456789abcdef.tmp-other-host-7": hour_ago,
            root / "tiny-llama.Q0-98362432-1795439999": now,
            root / "other-model-98362432-1795435876": hour_ago}
    for d, mtime in {**stale, **kept}.items():
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 1000)
        os.utime(d, (mtime, mtime))
    out = convert_gguf(tiny_gguf)
    assert "superseded or unfinished GGUF conversions" in capfd.readouterr().err
    assert sorted(entries(cache)) == sorted([out.name] + [d.name for d in kept])


def test_write_safetensors_round_trip(tmp_path, capfd):
    state = {"w": torch.randn(3, 5), "b16": torch.randn(4, 2).bfloat16(), "h": torch.randn(7).half(),
             "ids": torch.arange(6).reshape(2, 3), "mask": torch.tensor([True, False, True]),
             "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "strided": torch.randn(4, 6)[:, ::2],
             "i32": torch.arange(5, dtype=torch.int32), "u8": torch.arange(9, dtype=torch.uint8)}
    write_safetensors(state, tmp_path / "m.safetensors", {"format": "pt"}, desc="writing m")
    assert "writing m: 100%" in capfd.readouterr().err
    back = load_file(tmp_path / "m.safetensors")
    assert set(back) == set(state)
    for k, t in state.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    from safetensors import safe_open
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


# ---------------------------------------------------------------------- compilation progress / reuse
def test_lazy_compile_says_so_once_per_graph(checkpoint, monkeypatch, capfd):
    """A compiled-backend graph built on first use (not by compile()) prints one line with its time."""
    import specdec.core.graph_cache as graph_cache

    from conftest import load

    monkeypatch.setattr(graph_cache, "build_graph",
                        lambda graph, backend, batch_size, name, autotune: graph)   # no real compile
    model = load(checkpoint("llama"), backend="compiled", progress=True)
    p = prompt_ids(9, seed=5)
    model.generate([p], max_new_tokens=4, eos_token_id=[])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "on first use" in line]
    assert len(lines) == 2, err                           # the context graph and the decode graph
    assert all(line.startswith("specdec: compiling graph ") and line.endswith(" s") for line in lines), lines
    assert set(model.compile_seconds) == {k.describe() for k in model.graphs.built}
    model.generate([p], max_new_tokens=4, eos_token_id=[])
    assert "on first use" not in capfd.readouterr().err   # built once
    quiet = load(checkpoint("llama"), backend="compiled", progress=False)
    quiet.generate([p], max_new_tokens=4, eos_token_id=[])
    assert "on first use" not in capfd.readouterr().err


COMPILE_SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(1)   # the thread count is part of Inductor's cache key (CPU kernels are specialised on it)
from torch._dynamo.utils import counters
from specdec import DecoderModel
model = DecoderModel.from_pretrained(sys.argv[1], n_positions=64, context_buckets=[16], kv_buckets=[64],
                                     backend="compiled", progress=False)
prompt = json.loads(sys.argv[2])
model.compile(progress=True, prompt_length=len(prompt), max_length=64)
out = model.generate([prompt], max_new_tokens=12, eos_token_id=[])[0, len(prompt):].tolist()
print(json.dumps({"out": out, "counters": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"])}))
"""


@pytest.mark.slow
def test_second_process_reuses_compiled_graphs(checkpoint, tmp_path):
    """Process 1 compiles both graphs into an empty cache; process 2 loads both from the FX-graph and
    AOTAutograd caches (no recompilation; its bar says so) and gives transformers' greedy tokens."""
    from conftest import hf_greedy
    ckpt = checkpoint("llama")
    prompt = prompt_ids(9, seed=11)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(SPECDEC_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    runs, bars = [], []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(ckpt.path), json.dumps(prompt)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        bars.append(proc.stderr)
    cold, warm = runs
    assert cold["counters"].get("fxgraph_cache_miss") == 2, cold
    assert warm["counters"].get("fxgraph_cache_hit") == 2 and "fxgraph_cache_miss" not in warm["counters"], warm
    assert warm["aot"].get("autograd_cache_hit") == 2, warm
    assert "2/2" in bars[0] and "0 from cache" in bars[0], bars[0][-1000:]
    assert "2 from cache" in bars[1], bars[1][-1000:]
    assert cold["out"] == warm["out"] == hf_greedy(ckpt.hf, prompt, 12)
