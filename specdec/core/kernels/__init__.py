"""CPU kernels built as a PyTorch extension on first use, with a portable fallback.

``block_mm`` (``block_mm.cpp``): ``torch.ops.specdec.block_mm(x, qs, d, dmin, sc, mn, n, group, superblock,
kind, offset, mins)``, y [M, n] f32 = x [M, K] f32 · Wᵀ for a GGML-block matrix W [n, K] packed as
``layout`` describes (``core.block_linear`` packs it). As llama.cpp does, the activations are quantized to
int8 with one f32 scale (max |x| / 127, round to nearest even) per superblock of the weight: per group of 32
for Q4_0 / Q4_1 / Q5_0 / Q8_0, per 256 for the K-quants (llama.cpp's Q8_K). The weight · activation dot
products are exact integers (``vpmaddubsw`` / ``vpmaddwd``; ``vpdpbusd`` / ``vpdpwssd`` with AVX512-VNNI), a
K-quant's integer group scales and mins are applied to integer sums, and the f32 scales once per superblock.
Its cost is flat in M up to 16 rows (a verify reads and unpacks the weights once, as a decode step does) and a
row's result does not depend on M (row invariance). The instruction set is chosen at run time (AVX-512 with
VNNI, AVX-512, AVX2 + FMA, portable C++; all give the same bits); ``block_mm_isa()`` names it.

Optional arguments fuse a decoder layer's steps around the matmul: ``norm`` (RMSNorm weight, with ``eps``)
or ``gated`` (x = [gate | up] → silu(gate) · up) before it, ``bias`` and ``residual`` after it
(``core.block_layer``).

``cache_attention`` (``attention.cpp``): ``torch.ops.specdec.cache_attention(q, k, v, cos, sin, k_cache,
v_cache, rows, slots, mask)`` — RoPE on the new tokens, their K / V written into the static cache (in place),
and each query's masked softmax attention over its cache row, row-invariant, in one call.

The extension is compiled once per source, torch version and Python into ``$SPECDEC_CACHE/kernels``
(about a minute; a message says so; a build killed midway leaves nothing that blocks the next: ``_build``).
Where it cannot be built (no compiler), the same op is defined in Python — quantize the activations, dequantize
the weight, matmul: the same values up to summation order, slower, and a warning says so.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from .layout import Layout, unpack, untiled

SOURCE = Path(__file__).with_name("block_mm.cpp")
COMPILED = tuple(SOURCE.with_name(name) for name in ("block_mm.cpp", "attention.cpp", "block_layer.cpp"))
SOURCES = (*COMPILED, *(SOURCE.with_name(name) for name in ("block_mm_avx512.h", "vec.h", "kernels.h")))
_state: dict[str, str] = {}
_libraries: list[torch.library.Library] = []     # the Python definition, when used, kept alive here


def block_mm_isa() -> str:
    """The code path ``block_mm`` runs: "avx512vnni", "avx512", "avx2", "portable" (C++) or "reference" (Python)."""
    load_block_mm()
    return _state["isa"]


def set_block_mm_isa(name: str) -> None:
    """Use a lower instruction set ("avx512", "avx2", "portable") or the best one ("auto"): tests and benchmarks."""
    load_block_mm()
    if _state["isa"] == "reference":
        raise RuntimeError("the block_mm extension is not built: only the Python reference runs")
    torch.ops.specdec.block_mm_set_isa(name)
    _state["isa"] = torch.ops.specdec.block_mm_isa()


def block_mm_prefetch() -> tuple[int, int]:
    """(bytes, min_rows): calls of at least ``min_rows`` rows prefetch their weight stream ``bytes`` ahead into
    L2 (0 bytes: none). Defaults: 4096 bytes from 1 row: every call (see ``block_mm.cpp``)."""
    load_block_mm()
    if _state["isa"] == "reference":
        return 0, 1
    nbytes, min_rows = torch.ops.specdec.block_mm_prefetch()
    return nbytes, min_rows


def set_block_mm_prefetch(nbytes: int, min_rows: int | None = None) -> None:
    """Prefetch ``nbytes`` ahead of the weight stream (0: no software prefetch) in calls of at least
    ``min_rows`` rows (None: unchanged); the defaults were measured with ``bench/bench_block_mm.py
    --prefetch``: benchmarks and tests."""
    load_block_mm()
    if _state["isa"] == "reference":
        raise RuntimeError("the block_mm extension is not built: only the Python reference runs")
    torch.ops.specdec.block_mm_set_prefetch(nbytes, block_mm_prefetch()[1] if min_rows is None else min_rows)


def load_block_mm() -> None:
    """Register ``torch.ops.specdec.block_mm`` (build the extension on first use), once per process."""
    if _state:
        return
    try:
        _build()
        _state["isa"] = torch.ops.specdec.block_mm_isa()
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:   # no compiler, no headers
        warnings.warn(f"specdec: the block_mm CPU kernel could not be built ({type(e).__name__}: {e}); "
                      "using the slower Python reference", stacklevel=2)
        _define_reference()
        _state["isa"] = "reference"
    torch.library.register_fake("specdec::block_mm")(_fake)
    torch.library.register_fake("specdec::cache_attention")(_fake_attention)
    if _state["isa"] != "reference":     # the Python definition has no block_layer (``core.block_layer``)
        torch.library.register_fake("specdec::block_layer")(_fake_layer)
        torch.library.register_fake("specdec::block_layers")(_fake_layer)


def build_directory() -> Path:
    """Where the extension is built: one directory per source (its contents and its folder: the build records
    absolute paths, so two checkouts sharing one directory would rebuild it in turn), torch version and Python."""
    from ..cache_files import cache_dir

    code = b"".join(path.read_bytes() for path in SOURCES) + str(SOURCE.parent).encode()
    key = hashlib.sha256(code + torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"block_mm-{key}"


def _build() -> None:
    """Build (once) and load the extension. A process builds under an ``fcntl`` lock of the build directory, which
    the OS releases when the process ends however it ends; holding it, the lock file that ``cpp_extension.load``
    itself waits on (a ``FileBaton``, left behind by a build that was killed: every later load would wait on it
    forever) can only be stale, and is removed."""
    import fcntl

    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        if not any(directory.glob("*.so")):
            print("specdec: building the block_mm CPU kernel (once; about a minute)", file=sys.stderr, flush=True)
        cpp_extension.load(name="specdec_block_mm", sources=[str(path) for path in COMPILED],
                           build_directory=str(directory), extra_ldflags=["-fopenmp"],  # OpenMP: at::parallel_for's
                           extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp", "-Wno-psabi"],
                           is_python_module=False, verbose=False)


def _define_reference() -> None:
    lib = torch.library.Library("specdec", "DEF")
    _libraries.append(lib)
    lib.define("block_mm(Tensor x, Tensor qs, Tensor d, Tensor dmin, Tensor sc, Tensor mn, int n, int group, "
               "int superblock, int kind, int offset, bool mins, Tensor? norm=None, float eps=0., "
               "bool gated=False, Tensor? bias=None, Tensor? residual=None) -> Tensor")
    lib.define("cache_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
               "Tensor(b!) v_cache, Tensor rows, Tensor slots, Tensor mask) -> Tensor")
    lib.impl("block_mm", reference_block_mm, "CPU")
    lib.impl("cache_attention", reference_cache_attention, "CPU")


def dequantize(codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
               group: int, superblock: int) -> torch.Tensor:
    """The weight [N, K] f32 of signed ``codes`` [N, K] with d, dmin [N, K/SB] and sc, mn [N, K/G]:
    (d · sc) · q − dmin · mn per weight."""
    n, k = codes.shape
    a = d.repeat_interleave(superblock // group, dim=1) * sc.float()
    b = dmin.repeat_interleave(superblock // group, dim=1) * mn.float()
    return a.repeat_interleave(group, dim=1) * codes.float() - b.repeat_interleave(group, dim=1)


def quantize_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] f32 as ``block_mm`` sees it: every group of ``group`` values (the weight's superblock: 32 or
    256) quantized to int8 with the scale max |x| / 127 (round to nearest even), returned dequantized [M, K]."""
    m, k = x.shape
    v = x.view(m, k // group, group)
    scale = v.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(v * inverse).clamp(-127, 127) * scale).view(m, k)


def reference_block_mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                       mn: torch.Tensor, n: int, group: int, superblock: int, kind: int, offset: int,
                       mins: bool, norm: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                       bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``block_mm`` in PyTorch ops (the fallback, and the tests' reference): the layer's own math around the
    matmul — RMSNorm (``norm``) or silu(gate) · up (``gated``) before it, bias and residual after it."""
    if norm is not None:
        x = norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    elif gated:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    layout = Layout(kind, offset, group, superblock, x.shape[1], mins)
    params = (untiled(t, n).float() for t in (d, dmin, sc, mn))
    y = quantize_activations(x, superblock) @ dequantize(unpack(qs, n, layout), *params, group, superblock).t()
    y = y if bias is None else y + bias
    return y if residual is None else residual + y


def reference_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                              slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``cache_attention`` in PyTorch ops (the fallback, and the tests' reference; ``attention.cpp`` gives the
    shapes): RoPE, the K / V writes, then softmax attention under ``mask`` with query head h on KV head
    h // (H / Hkv)."""
    b, n, _ = q.shape
    hkv, dim = k_cache.shape[2], k_cache.shape[3]
    heads = q.shape[2] // dim

    def rope(x: torch.Tensor) -> torch.Tensor:       # [b, n, heads, D]: ``model.apply_rope``'s formula (kernels
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)     # may not import model: model's layers import kernels)
        return x * c + torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), -1) * s

    r = rows.view(b, 1)
    k_cache[r, slots] = rope(k.reshape(b, n, hkv, dim))
    v_cache[r, slots] = v.reshape(b, n, hkv, dim)
    length = mask.shape[2]
    keys = k_cache[rows, :length].repeat_interleave(heads // hkv, dim=2).transpose(1, 2)     # [b, H, L, D]
    values = v_cache[rows, :length].repeat_interleave(heads // hkv, dim=2).transpose(1, 2)
    queries = rope(q.reshape(b, n, heads, dim)).transpose(1, 2)
    scores = (queries @ keys.transpose(-1, -2)) / dim ** 0.5
    weights = scores.masked_fill(~mask.unsqueeze(1), float("-inf")).softmax(-1)
    return (weights @ values).transpose(1, 2).reshape(b, n, heads * dim)


def _fake(x, qs, d, dmin, sc, mn, n, group, superblock, kind, offset, mins, norm=None, eps=0.0, gated=False,
          bias=None, residual=None):
    return x.new_empty(x.shape[0], n)


def _fake_attention(q, k, v, cos, sin, k_cache, v_cache, rows, slots, mask):
    return q.new_empty(q.shape)


def _fake_layer(x, cos, sin, k_cache, v_cache, rows, slots, mask, weights, layout, eps):
    return x.new_empty(x.shape)
