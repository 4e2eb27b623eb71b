"""A GGUF file's header: its metadata values and where its tensors lie, read in well under a second.

``gguf.GGUFReader`` decodes every metadata value into numpy arrays on open: for a 151,936-token vocabulary
that takes 25-43 s on a 2-core machine, on every load. ``read_header`` reads the scalar and string values
and the numeric arrays, walks past string arrays (the vocabulary, the merges: by their length prefixes),
and reads the tensor table: name, GGML type, shape and byte range of every tensor (GGUF v2/v3,
little-endian). ``tensor_bytes`` maps one tensor's bytes from the file without copying.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
# metadata value types: fixed sizes of the scalar ones (GGUF spec: 8 = string, 9 = array)
_SCALAR_FORMAT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_SIZE = {t: struct.calcsize("<" + f) for t, f in _SCALAR_FORMAT.items()}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file: ``shape`` as numpy / PyTorch order (rows first), ``qtype`` the GGML type
    name, bytes [offset, offset + nbytes) of the file."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class _Cursor:
    def __init__(self, data: bytes | memoryview):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        self.at += n
        return bytes(self.data[self.at - n:self.at]).decode("utf-8")

    def value(self, vtype: int):
        """A scalar, a string or a list of numbers; None for an array of strings or arrays (skipped)."""
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR_FORMAT:
            return self.take(_SCALAR_FORMAT[vtype])
        item, count = self.take("I"), self.take("Q")
        if item in _SCALAR_FORMAT:
            values = list(struct.unpack_from(f"<{count}{_SCALAR_FORMAT[item]}", self.data, self.at))
            self.at += _SCALAR_SIZE[item] * count
            return values
        self.at -= 12
        self.skip_value(vtype)
        return None

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            n = self.take("Q")
            self.at += n
        elif vtype == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALAR_SIZE:
                self.at += _SCALAR_SIZE[item] * count
            elif item == _STRING:          # the vocabulary: 10^5 length-prefixed strings
                for _ in range(count):
                    n = struct.unpack_from("<Q", self.data, self.at)[0]
                    self.at += 8 + n
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            self.at += _SCALAR_SIZE[vtype]


@dataclass(frozen=True)
class GGUFHeader:
    """``metadata``: key → value (scalars, strings, numeric arrays as lists; string arrays as None);
    ``tensors``: the tensor table in file order."""

    metadata: dict
    tensors: list[TensorEntry]


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file; ValueError for a file that is not GGUF v2/v3."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if bytes(raw[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    _, version, n_tensors, n_kv = cur.take("4sIQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    metadata = {}
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.take("I")
        metadata[key] = cur.value(vtype)
    alignment = metadata.get("general.alignment", 32)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("I")
        dims = [cur.take("Q") for _ in range(n_dims)]
        qtype, offset = GGMLQuantizationType(cur.take("I")), cur.take("Q")
        infos.append((name, qtype, tuple(reversed(dims)), offset))
    start = -(-cur.at // alignment) * alignment
    entries = []
    for name, qtype, shape, offset in infos:
        block, type_bytes = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * type_bytes
        entries.append(TensorEntry(name, qtype.name, shape, start + offset, nbytes))
    return GGUFHeader(metadata, entries)


def tensor_index(path: str | Path) -> list[TensorEntry]:
    """The tensor table of a GGUF file, in file order (``read_header``)."""
    return read_header(path).tensors


def tensor_bytes(path: str | Path, entry: TensorEntry) -> np.ndarray:
    """The tensor's bytes as a read-only uint8 array [rows, row bytes] mapped from the file (no copy)."""
    rows = int(np.prod(entry.shape[:-1])) if len(entry.shape) > 1 else 1
    return np.memmap(path, dtype=np.uint8, mode="r", offset=entry.offset, shape=(rows, entry.nbytes // rows))
