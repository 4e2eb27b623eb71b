"""CPU kernels built as a PyTorch extension on first use, with a portable fallback.

``block_mm`` (``block_mm.cpp``): ``torch.ops.specdec.block_mm(x, qs, d, dmin, sc, mn, group, superblock)``,
y [M, N] f32 = x [M, K] f32 · Wᵀ for a GGML-block matrix W [N, K] (``core.block_linear`` packs it). Its
cost is flat in M up to 8 rows (a verify reads and unpacks the weights once, as a decode step does) and
a row's result does not depend on M (row invariance). The instruction set is chosen at run time
(AVX-512, AVX2 + FMA, portable C++); ``block_mm_isa()`` names it.

The extension is compiled once per source, torch version and Python into ``$SPECDEC_CACHE/kernels``
(about a minute; a message says so). Where it cannot be built (no compiler), the same op is defined in
Python — dequantize, then matmul: the same values up to summation order, slower, and a warning says so.
"""
from __future__ import annotations

import hashlib
import sys
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("block_mm.cpp")
_state: dict[str, str] = {}
_libraries: list[torch.library.Library] = []     # the Python definition, when used, kept alive here


def block_mm_isa() -> str:
    """The code path ``block_mm`` runs: "avx512", "avx2", "portable" (C++) or "reference" (Python)."""
    load_block_mm()
    return _state["isa"]


def set_block_mm_isa(name: str) -> None:
    """Use a lower instruction set ("avx2", "portable") or the best one ("auto"): tests and benchmarks."""
    load_block_mm()
    if _state["isa"] == "reference":
        raise RuntimeError("the block_mm extension is not built: only the Python reference runs")
    torch.ops.specdec.block_mm_set_isa(name)
    _state["isa"] = torch.ops.specdec.block_mm_isa()


def load_block_mm() -> None:
    """Register ``torch.ops.specdec.block_mm`` (build the extension on first use), once per process."""
    if _state:
        return
    try:
        _build()
        _state["isa"] = torch.ops.specdec.block_mm_isa()
    except (RuntimeError, OSError, ImportError) as e:   # no compiler, no headers: the op defined in Python
        warnings.warn(f"specdec: the block_mm CPU kernel could not be built ({type(e).__name__}: {e}); "
                      "using the slower Python reference", stacklevel=2)
        _define_reference()
        _state["isa"] = "reference"
    torch.library.register_fake("specdec::block_mm")(_fake)


def _build() -> None:
    from torch.utils import cpp_extension

    from ..paths import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]
    directory = cache_dir() / "kernels" / f"block_mm-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    if not any(directory.glob("*.so")):
        print("specdec: building the block_mm CPU kernel (once; about a minute)", file=sys.stderr, flush=True)
    cpp_extension.load(name="specdec_block_mm", sources=[str(SOURCE)], build_directory=str(directory),
                       extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)    # OpenMP: at::parallel_for's threads


def _define_reference() -> None:
    lib = torch.library.Library("specdec", "DEF")
    _libraries.append(lib)
    lib.define("block_mm(Tensor x, Tensor qs, Tensor d, Tensor dmin, Tensor sc, Tensor mn, int group, "
               "int superblock) -> Tensor")
    lib.impl("block_mm", reference_block_mm, "CPU")


def dequantize(qs: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
               group: int, superblock: int) -> torch.Tensor:
    """The weight [N, K] f32 that ``block_mm`` computes with: (d · sc) · q − dmin · mn per weight."""
    if qs.dtype == torch.uint8:
        n = qs.shape[0]
        halves = qs.view(n, -1, 16)
        codes = torch.stack([halves & 15, halves >> 4], dim=2).view(n, -1).float()
    else:
        codes = qs.float()
    k = codes.shape[1]
    a = d.repeat_interleave(superblock // group, dim=1) * sc.float()
    b = dmin.repeat_interleave(superblock // group, dim=1) * mn.float()
    return (a.repeat_interleave(group, dim=1) * codes - b.repeat_interleave(group, dim=1)).view(-1, k)


def reference_block_mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                       mn: torch.Tensor, group: int, superblock: int) -> torch.Tensor:
    """``block_mm`` in PyTorch ops (the fallback, and the tests' reference)."""
    return x @ dequantize(qs, d, dmin, sc, mn, group, superblock).t()


def _fake(x, qs, d, dmin, sc, mn, group, superblock):
    return x.new_empty(x.shape[0], qs.shape[0])
