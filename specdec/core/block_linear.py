"""``BlockLinear``: a linear layer holding a GGUF file's quantized blocks, run by the ``block_mm`` CPU kernel.

Every GGML type the loader keeps (``gguf_weights.BlockWeights``: Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0) is one
formula over per-group integers and per-superblock floats,

    w[n, k] = (d[n, k/SB] · sc[n, k/G]) · q[n, k] − dmin[n, k/SB] · mn[n, k/G]      (f32, in this order)

which is GGML's own dequantization bit for bit. The layer packs the codes in one of two ways:

- ``u4`` (Q4_0, Q4_1, Q4_K; G = 32): two codes per byte, ``qs`` uint8 [N, K/2]; byte b of group g holds
  weight 32g + b (low nibble) and 32g + 16 + b (high nibble). Q4_K costs 4.75 bits a weight (the file: 4.5).
- ``s8`` (Q5_0 as q − 16, Q6_K as q − 32, Q8_0; G = 16 or 32): one signed byte a weight, ``qs`` int8 [N, K]
  (Q6_K: 8.6 bits against the file's 6.6; Q5_0: 9 against 5.5).

``d`` / ``dmin`` are f32 [N, K/SB] and ``sc`` / ``mn`` int8 [N, K/G]. Activations are not quantized: the
kernel computes in f32 whatever the model's dtype (bf16 inputs are widened, outputs rounded back), so a
model's projections compute with exactly the file's weights. A row's output does not depend on how many
rows the call has (``kernels``: row invariance), and a call of up to 12 rows reads the weights once.
"""
from __future__ import annotations

import torch
from torch import nn

from .kernels import dequantize, load_block_mm

U4_TYPES = ("Q4_0", "Q4_1", "Q4_K")     # unsigned 4-bit codes in groups of 32: packed two to a byte


class BlockLinear(nn.Module):
    """x [..., K] → [..., N] with a block-quantized weight [N, K] (buffers ``qs``, ``d``, ``dmin``, ``sc``,
    ``mn``; see the module docstring) and an optional ``bias`` in the compute dtype ``dtype``."""

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
                 group: int, superblock: int, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        load_block_mm()
        self.out_features = qs.shape[0]
        self.in_features = qs.shape[1] * (2 if qs.dtype == torch.uint8 else 1)
        self.group, self.superblock, self._dtype = group, superblock, dtype
        for name, t in (("qs", qs), ("d", d), ("dmin", dmin), ("sc", sc), ("mn", mn)):
            self.register_buffer(name, t.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def from_blocks(cls, weights, dtype: torch.dtype, bias: torch.Tensor | None = None) -> BlockLinear:
        """The layer computing with ``weights`` (a ``gguf_weights.BlockWeights``) exactly."""
        codes = weights.codes
        n, k = codes.shape
        if weights.qtype in U4_TYPES:
            halves = codes.to(torch.uint8).view(n, k // 32, 2, 16)
            qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)
        else:
            qs = codes.to(torch.int8)
        return cls(qs, weights.d.float(), weights.dmin.float(), weights.sc.to(torch.int8),
                   weights.mn.to(torch.int8), weights.group, weights.superblock, bias, dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations in and out, bias)."""
        return self._dtype

    @property
    def layout(self) -> tuple[bool, int, int, int]:
        """(u4, group, superblock, in features): layers of one layout concatenate (``cat_rows``)."""
        return self.qs.dtype == torch.uint8, self.group, self.superblock, self.in_features

    @classmethod
    def cat_rows(cls, layers: list[BlockLinear]) -> BlockLinear:
        """One layer whose output is the layers' outputs concatenated (one ``layout``)."""
        if len({layer.layout for layer in layers}) != 1:
            raise ValueError("BlockLinear.cat_rows needs layers of one layout (GGML type family, group, "
                             "superblock, in features)")
        from .quant import cat_biases

        first = layers[0]
        return cls(*(torch.cat([getattr(layer, name) for layer in layers]) for name in ("qs", "d", "dmin", "sc", "mn")),
                   first.group, first.superblock, cat_biases(layers), first.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] f32 the layer computes with."""
        return dequantize(self.qs, self.d, self.dmin, self.sc, self.mn, self.group, self.superblock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.ops.specdec.block_mm(flat, self.qs, self.d, self.dmin, self.sc, self.mn, self.group,
                                       self.superblock)
        y = y.to(self._dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias
