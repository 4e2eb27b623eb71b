"""The packed layout of a block matrix for the ``block_mm`` kernel (``block_mm.cpp`` documents the bytes).

Tiles of 16 output columns, each tile's groups of G weights one after the other, so that the kernel reads one
contiguous stream and one 64-byte vector holds the same group of 16 columns. Codes are GGML's signed codes
(``gguf_weights.BlockWeights``): ``pack`` stores them by kind (u4: plus an offset, two per byte; u6 / u5: plus
an offset; s8 as they are) and ``unpack`` gives them back; per-column parameters [N, P] become [T, P, 16] (``tiled``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LANES = 16                               # output columns per tile


@dataclass(frozen=True)
class Layout:
    """How a ``BlockLinear``'s codes are packed: ``kind`` (0 u4, 1 s8, 2 u6, 3 u5), the ``offset`` stored
    codes carry (Q4_0 8, Q6_K 32, Q5_0 16), the group G, the superblock SB, the input features K, and whether
    the layer has mins (dmin · mn ≠ 0: Q4_1 / Q4_K)."""

    kind: int
    offset: int
    group: int
    superblock: int
    in_features: int
    mins: bool

    def group_bytes(self) -> int:
        """Bytes of one (tile, group) of codes."""
        return LANES * self.group * (4, 8, 6, 5)[self.kind] // 8


def pack(codes: torch.Tensor, layout: Layout) -> torch.Tensor:
    """codes [N, K] (signed codes, int) → qs uint8 [T, K/G, group bytes] (the kernel's layout; ``kernels``)."""
    n, k = codes.shape
    tiles, g = -(-n // LANES), layout.group
    c = torch.nn.functional.pad(codes.to(torch.int16), (0, 0, 0, tiles * LANES - n))
    if layout.kind == 0:    # vector v, lane j, byte i: codes + offset 8v + i (low nibble) and 8v + 4 + i (high)
        c = (c + layout.offset).to(torch.uint8).view(tiles, LANES, k // 32, 4, 2, 4)
        qs = c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)
    elif layout.kind in (2, 3):  # codes c + offset: G/8 vectors of low nibbles, 1 of the high bits (6 / 5 bits)
        v = g // 4
        c = (c + layout.offset).to(torch.uint8).view(tiles, LANES, k // g, v, 4)           # (v, i)
        low = (c & 15).view(tiles, LANES, k // g, v // 2, 2, 4)                             # (w, nibble, i)
        low = (low[:, :, :, :, 0] | (low[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)      # [T, g, w, j, i]
        high = ((c >> 4) << _high_shifts(layout)).sum(3, dtype=torch.uint8)                # [T, j, g, i]
        return torch.cat([low.reshape(tiles, k // g, 32 * v), high.permute(0, 2, 1, 3).reshape(tiles, k // g, 64)],
                         dim=2).contiguous()
    else:                   # vector v of 32 bytes, lane j, byte i: code 2v + i
        qs = c.to(torch.int8).view(torch.uint8).view(tiles, LANES, k // g, g // 2, 2)
    return qs.permute(0, 2, 3, 1, 4).reshape(tiles, k // g, layout.group_bytes()).contiguous()


def unpack(qs: torch.Tensor, n: int, layout: Layout) -> torch.Tensor:
    """``pack``'s inverse: the signed codes [N, K] int16."""
    tiles, k, g = qs.shape[0], layout.in_features, layout.group
    if layout.kind == 0:
        q = qs.view(tiles, k // 32, 4, LANES, 4).permute(0, 3, 1, 2, 4)
        c = torch.stack([q & 15, q >> 4], dim=4).to(torch.int16) - layout.offset
    elif layout.kind in (2, 3):
        v = g // 4
        low = qs[:, :, :32 * v].reshape(tiles, k // g, v // 2, LANES, 4).permute(0, 3, 1, 2, 4)   # [T, j, g, w, i]
        low = torch.stack([low & 15, low >> 4], dim=4).reshape(tiles, LANES, k // g, v, 4)        # (v, i)
        high = qs[:, :, 32 * v:].reshape(tiles, k // g, LANES, 1, 4).permute(0, 2, 1, 3, 4)
        high = (high >> _high_shifts(layout)) & (3 if layout.kind == 2 else 1)                    # (v, i)
        c = (low | (high << 4)).to(torch.int16) - layout.offset
    else:
        c = qs.view(torch.int8).view(tiles, k // g, g // 2, LANES, 2).permute(0, 3, 1, 2, 4).to(torch.int16)
    return c.reshape(tiles * LANES, k)[:n]


def tiled(t: torch.Tensor) -> torch.Tensor:
    """Per-column parameters [N, P] → [T, P, 16] (zero columns padding the last tile)."""
    n = t.shape[0]
    tiles = -(-n // LANES)
    t = torch.nn.functional.pad(t, (0, 0, 0, tiles * LANES - n))
    return t.view(tiles, LANES, -1).transpose(1, 2).contiguous()


def untiled(t: torch.Tensor, n: int) -> torch.Tensor:
    """``tiled``'s inverse: [T, P, 16] → [N, P]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


def _high_shifts(layout: Layout) -> torch.Tensor:
    """[G/4, 1] uint8: the bit at which vector v's high bits sit in the high-bit vector (u6: 2v, u5: v)."""
    bits = 2 if layout.kind == 2 else 1
    return (torch.arange(layout.group // 4, dtype=torch.uint8) * bits).view(-1, 1)
