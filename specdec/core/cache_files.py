"""The cache directory (``$SPECDEC_CACHE``, default ``~/.cache/specdec``) and the bookkeeping of the files in
it: the memo of file hashes, atomic writes, and the names of temporary entries a process writes before
renaming them into place (so an entry left by a dead process can be recognised and removed).

The lowest module of the runtime that touches the disk: ``paths`` (conversions), ``named_models``
(assembled files), ``block_store`` (packed block layers), ``kernels`` (built extensions) and ``saved_graphs``
(compiled graphs) keep their files under ``cache_dir()``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path

HASH_INDEX = "hashes.json"
HASH_CHUNK = 1 << 22                    # bytes read at a time while hashing
HASH_BAR_BYTES = 1 << 30                # files at least this large show a progress bar while hashed
# a conversion in progress, by process ``pid`` on ``host``
TMP_ENTRY = re.compile(r"^\.(?P<entry>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)$")
STALE_TMP_AGE_S = 86400         # any temporary directory this old is abandoned (another host's included)


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def file_sha256(path: str | Path, progress: bool = True) -> str:
    """SHA-256 of a file's bytes, memoised in ``$SPECDEC_CACHE/gguf/hashes.json`` by (resolved path,
    size, mtime): hashed once per file version, not on every load."""
    path = Path(path).resolve()
    stat = path.stat()
    memo = _hash_index().get(str(path))
    if isinstance(memo, dict) and memo.get("size") == stat.st_size and memo.get("mtime_ns") == stat.st_mtime_ns:
        return memo["sha256"]
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=stat.st_size, unit="B", unit_scale=True, desc=f"hashing {path.name}",
                                      disable=not progress or stat.st_size < HASH_BAR_BYTES) as bar:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    sha = digest.hexdigest()
    record_sha256(path, sha)
    return sha


def record_sha256(path: str | Path, sha256: str) -> None:
    """Memoise ``sha256`` as the hash of ``path``'s current version (resolved path, size, mtime), for a
    caller that hashed the bytes while writing them (``named_models``): the next ``file_sha256(path)``
    does not read the file."""
    path = Path(path).resolve()
    stat = path.stat()
    index = {p: m for p, m in _hash_index().items() if Path(p).exists()}    # forget files that are gone
    index[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}
    write_atomic(cache_dir() / "gguf" / HASH_INDEX, json.dumps(index, indent=1))


def _hash_index() -> dict:
    """The memo of file hashes (``$SPECDEC_CACHE/gguf/hashes.json``); empty when missing or unreadable."""
    try:
        return json.loads((cache_dir() / "gguf" / HASH_INDEX).read_text())
    except (OSError, ValueError):
        return {}


def tmp_path(path: Path) -> Path:
    """Where this process writes ``path`` before renaming it into place: ``.<name>.tmp-<host>-<pid>`` beside it
    (``TMP_ENTRY``), so an entry a dead process left is recognised as such."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def write_atomic(path: Path, content: str | Callable[[Path], None]) -> None:
    """Write the file ``path`` whole or not at all: ``content`` (text, or a function that writes the file at the
    path it is given) goes to ``tmp_path(path)``, which is renamed into place; it is removed on any error or
    interrupt, and the error propagates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        if isinstance(content, str):
            tmp.write_text(content)
        else:
            content(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)         # gone after os.replace (or never made)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
