"""Where a GGUF file's tensors lie, read from its header without parsing its metadata values.

``gguf.GGUFReader`` decodes every metadata value into numpy arrays on open: for a 151,936-token vocabulary
that takes 25-43 s on a 2-core machine, on every load. Loading the quantized blocks needs only the tensor
table, so ``tensor_index`` walks past the metadata (string arrays by their length prefixes) and reads the
table: name, GGML type, shape and byte range of every tensor (GGUF v2/v3, little-endian). ``tensor_bytes``
maps one tensor's bytes from the file without copying.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
# metadata value types: fixed sizes of the scalar ones (GGUF spec: 8 = string, 9 = array)
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


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


def tensor_index(path: str | Path) -> list[TensorEntry]:
    """The tensor table of a GGUF file, in file order; ValueError for a file that is not GGUF v2/v3."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if bytes(raw[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    _, version, n_tensors, n_kv = cur.take("4sIQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.take("I")
        if key == "general.alignment" and vtype == _UINT32:
            alignment = cur.take("I")
        else:
            cur.skip_value(vtype)
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
    return entries


def tensor_bytes(path: str | Path, entry: TensorEntry) -> np.ndarray:
    """The tensor's bytes as a read-only uint8 array [rows, row bytes] mapped from the file (no copy)."""
    rows = int(np.prod(entry.shape[:-1])) if len(entry.shape) > 1 else 1
    return np.memmap(path, dtype=np.uint8, mode="r", offset=entry.offset, shape=(rows, entry.nbytes // rows))
