"""A CPU model's large storages (its weights) in transparent huge pages (Linux).

A decode step streams every weight once. With 4 KiB pages that is one TLB miss and one page walk per
4 KiB (≈ 270,000 for the 1.5B's 1.1 GB), and the hardware prefetchers stop at every page boundary; with
2 MiB pages both nearly vanish. PyTorch allocates with the system's default (4 KiB pages unless the kernel's
transparent-huge-page mode is ``always``; ``THP_MEM_ALLOC_ENABLE=1`` changes that only when set before
PyTorch's first allocation), so ``move_to_huge_pages`` copies every tensor storage of at least 2 MiB into
anonymous memory advised ``MADV_HUGEPAGE`` (the mode ``madvise``, the usual default, honours it), 2 MiB
aligned. Tensors sharing a storage (tied weights, views) keep sharing the new one. A no-op where the kernel
has no transparent huge pages (mode ``never``, other systems).
"""
from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this system gives memory advised ``MADV_HUGEPAGE`` huge pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` starting at a 2 MiB boundary of anonymous memory advised
    ``MADV_HUGEPAGE`` (the tensor keeps the mapping alive)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=-address % HUGE_PAGE)


def move_to_huge_pages(module: nn.Module, min_bytes: int = HUGE_PAGE) -> int:
    """Copy the storage of every CPU parameter and buffer of ``module`` holding at least ``min_bytes`` into
    huge pages, in place (parameters through ``.data``, buffers re-registered); returns the bytes moved.
    Embedding tables are left where they are unless another module shares their storage (a tied LM head): a step
    reads one row per token of them, where page size makes no difference."""
    if not huge_pages_available():
        return 0
    streamed = {t.untyped_storage().data_ptr() for sub in module.modules() if not isinstance(sub, nn.Embedding)
                for table in (sub._parameters, sub._buffers) for t in table.values()
                if t is not None and t.device.type == "cpu"}     # (an XLA storage has no data pointer)
    moved: dict[int, torch.Tensor] = {}         # old storage address → its copy in huge pages
    copies: set[int] = set()                    # the copies' addresses (a tied parameter is seen again)
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "cpu":
                    continue
                storage = t.untyped_storage()
                if storage.nbytes() < min_bytes or storage.data_ptr() in copies or \
                        storage.data_ptr() not in streamed:
                    continue
                if storage.data_ptr() not in moved:
                    copy = huge_page_bytes(storage.nbytes())
                    copy.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
                    moved[storage.data_ptr()] = copy
                    copies.add(copy.data_ptr())
                new = torch.empty(0, dtype=t.dtype).set_(moved[storage.data_ptr()].untyped_storage(),
                                                         t.storage_offset(), t.shape, t.stride())
                if isinstance(t, nn.Parameter):
                    t.data = new
                else:
                    table[name] = new
    return sum(copy.numel() for copy in moved.values())
