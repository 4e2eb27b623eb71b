"""A GGUF file's quantized tensors kept as the file stores them (no second rounding).

GGML's block formats hold 32 consecutive weights of a row (K = in features) per block:

    Q4_0: d (f16), 16 bytes of 4-bit codes q in [0, 15]:     w = d · (q − 8)
    Q4_1: d (f16), m (f16), 16 bytes of codes q in [0, 15]:  w = d · q + m
    Q8_0: d (f16), 32 signed bytes q in [−128, 127]:          w = d · q

(codes j and j + 16 of a block share byte j: low and high nibble). They map exactly onto PyTorch's CPU
int4 kernel (``quant.Int4Linear``: w = (u − 8) · scale + zero per group of 32):

    Q4_0: u = q, scale = d, zero = 0        Q4_1: u = q, scale = d, zero = m + 8d
    Q8_0: q = 16 h + l with l = q & 15 in [0, 15], h = q >> 4 in [−8, 7]; two int4 groups read the same
          inputs, (u = h + 8, scale = 16 d, zero = 0) and (u = l, scale = d, zero = 8 d), and their sum is
          d · q (``Q8Linear``: the kernel runs over the input twice, K' = 2K).

The codes are the file's; scale and zero are held in the compute dtype, as the kernel requires: exact
in f32, in bf16 rounded to bf16 as every bf16 weight is. llama.cpp's converter stores the rows of
``attn_q`` / ``attn_k`` permuted for its RoPE layout; they are permuted back (whole rows, so blocks are
untouched), as transformers does when it dequantizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .parallel import Shard
from .quant import INT4_GROUP, Int4Linear

BLOCK = INT4_GROUP      # GGML's blocks of 32 weights are the int4 kernel's groups
KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
# GGUF tensor name suffix → (HF module path within a layer, RoPE row permutation by "heads" / "kv_heads")
LAYER_TENSORS = {"attn_q": ("self_attn.q_proj", "heads"), "attn_k": ("self_attn.k_proj", "kv_heads"),
                 "attn_v": ("self_attn.v_proj", None), "attn_output": ("self_attn.o_proj", None),
                 "ffn_gate": ("mlp.gate_proj", None), "ffn_up": ("mlp.up_proj", None),
                 "ffn_down": ("mlp.down_proj", None)}


@dataclass
class BlockWeights:
    """One quantized matrix [N, K] as codes and per-block parameters: ``codes`` [N, K] int16 (the file's
    q), ``d`` / ``m`` [N, K/32] f32 (``m`` zero for Q4_0 and Q8_0), ``qtype`` the GGML type name."""

    qtype: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @classmethod
    def from_bytes(cls, raw: np.ndarray, qtype: str) -> BlockWeights:
        """raw [N, K/32 · block bytes] uint8, as ``gguf.GGUFReader`` gives a tensor's data."""
        n = raw.shape[0]
        blocks = np.ascontiguousarray(raw).reshape(n, -1, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype])
        def f16(at: int) -> np.ndarray:         # the f16 field at byte ``at`` of every block, as f32
            return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)

        d = f16(0)
        if qtype == "Q8_0":
            codes = blocks[..., 2:].copy().view(np.int8).astype(np.int16)
            return cls(qtype, torch.from_numpy(codes.reshape(n, -1)), torch.from_numpy(d), torch.zeros(d.shape))
        m = f16(2) if qtype == "Q4_1" else np.zeros_like(d)
        packed = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int16)
        return cls(qtype, torch.from_numpy(codes.reshape(n, -1)), torch.from_numpy(d), torch.from_numpy(m))

    def dequantize(self) -> torch.Tensor:
        """[N, K] f32, GGML's formula (what ``gguf.quants.dequantize`` computes)."""
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // BLOCK, BLOCK)
        if self.qtype == "Q4_0":
            q = q - 8
        return (self.d.unsqueeze(-1) * q + self.m.unsqueeze(-1)).view(n, k)

    def take(self, dim: int, index: list[int] | torch.Tensor) -> BlockWeights:
        """Rows (dim 0) or columns (dim 1) ``index`` of the matrix; -1 gives zero weights. Columns must
        come in whole, aligned blocks of 32 (a tensor-parallel split along K at a block boundary)."""
        index = torch.as_tensor(index, dtype=torch.long)
        pad = index < 0
        zero_code = 8 if self.qtype == "Q4_0" else 0
        source = index.clamp(min=0)
        if dim == 0:
            codes = self.codes[source].masked_fill(pad.unsqueeze(1), zero_code)
            d, m = (t[source].masked_fill(pad.unsqueeze(1), 0) for t in (self.d, self.m))
            return BlockWeights(self.qtype, codes, d, m)
        groups = index.view(-1, BLOCK)
        first = groups[:, 0]
        aligned = torch.where(first[:, None] < 0, groups < 0,
                              (groups == first[:, None] + torch.arange(BLOCK)) & (first[:, None] % BLOCK == 0))
        if not bool(aligned.all()):
            raise ValueError("a GGUF block-quantized matrix can be split along its input dimension only at "
                             f"multiples of {BLOCK} columns; this tensor-parallel layout splits inside a block: "
                             "use quantization='int8' / 'int4' or another tp_degree")
        block_index = torch.where(first < 0, -1, first // BLOCK)
        keep = (block_index >= 0).unsqueeze(0)
        codes = self.codes[:, source].masked_fill(pad.unsqueeze(0), zero_code)
        d, m = (t[:, block_index.clamp(min=0)] * keep for t in (self.d, self.m))
        return BlockWeights(self.qtype, codes, d, m)

    def to_module(self, dtype: torch.dtype, bias: torch.Tensor | None = None) -> nn.Module:
        """The kernel-backed layer computing x · Wᵀ (+ ``bias``) with exactly these weights (see the module
        docstring)."""
        if self.qtype == "Q8_0":
            return Q8Linear.from_blocks(self, dtype, bias)
        zero = self.m + 8 * self.d if self.qtype == "Q4_1" else torch.zeros_like(self.d)
        return Int4Linear.from_codes(self.codes, self.d, zero, bias, dtype)


class Q8Linear(nn.Module):
    """A Q8_0 matrix [N, K] on the int4 kernel: codes split into high and low nibbles (two groups of 32
    per block, K' = 2K), the input read twice. x [..., K] → [..., N]."""

    def __init__(self, inner: Int4Linear):
        """``inner``: the int4 layer over the doubled input [x, x] (K' = 2K)."""
        super().__init__()
        self.inner = inner
        self.out_features, self.in_features = inner.out_features, inner.in_features // 2

    @classmethod
    def from_blocks(cls, weights: BlockWeights, dtype: torch.dtype, bias: torch.Tensor | None = None) -> Q8Linear:
        q, d = weights.codes, weights.d
        codes = torch.cat([(q >> 4) + 8, q & 15], dim=1)
        return cls(Int4Linear.from_codes(codes, torch.cat([16 * d, d], 1),
                                         torch.cat([torch.zeros_like(d), 8 * d], 1), bias, dtype))

    @classmethod
    def cat_rows(cls, layers: list[Q8Linear]) -> Q8Linear:
        """One layer whose output is the layers' outputs concatenated (``Int4Linear.cat_rows``)."""
        return cls(Int4Linear.cat_rows([layer.inner for layer in layers]))

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.cat([x, x], dim=-1))


def rope_row_order(rows: int, heads: int) -> torch.Tensor:
    """Row i of the Hugging Face matrix is row ``order[i]`` of llama.cpp's (whose converter interleaves the
    two rotary halves of every head)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def gguf_quantized_tensors(path: str | Path, config, keep: tuple[str, ...],
                           head_keep: tuple[str, ...] | None = None) -> dict[str, BlockWeights]:
    """HF weight name → ``BlockWeights`` for every projection tensor of ``path`` whose GGML type is in
    ``keep`` and its LM-head tensor if its type is in ``head_keep`` (default: ``keep``; () for none),
    rows in Hugging Face order. The tied embedding's blocks, if quantized, appear as ``lm_head.weight``
    when the config ties the LM head to it."""
    from gguf import GGUFReader

    head_keep = keep if head_keep is None else head_keep
    found = {}
    for tensor in GGUFReader(str(path)).tensors:
        qtype = tensor.tensor_type.name
        parts = tensor.name.split(".")
        if parts[0] == "blk" and parts[2] in LAYER_TENSORS and qtype in keep:
            module, permute = LAYER_TENSORS[parts[2]]
            name = f"model.layers.{parts[1]}.{module}.weight"
        elif qtype in head_keep and (tensor.name == "output.weight" or
                                     (tensor.name == "token_embd.weight" and config.tie_word_embeddings)):
            name, permute = "lm_head.weight", None
        else:
            continue
        weights = BlockWeights.from_bytes(np.asarray(tensor.data), qtype)
        if permute:
            heads = config.num_heads if permute == "heads" else config.num_kv_heads
            weights = weights.take(0, rope_row_order(weights.codes.shape[0], heads))
        found[name] = weights
    return found


# GGML types each scheme keeps as the file stores them (the rest is quantized by ``quant``, or for
# "gguf" left in the compute dtype): (projections, LM head); int8 and int4 hold the head at 8 bits
KEEP = {"gguf": (KEPT_TYPES, KEPT_TYPES), "int4": (("Q4_0", "Q4_1"), ("Q8_0",)), "int8": (("Q8_0",), ("Q8_0",))}


def load_gguf_blocks(lm: nn.Module, path: str | Path, scheme: str, shards: dict[str, Shard]) -> None:
    """Replace the layers of ``lm`` (a ``DecoderLM`` whose float weights are loaded) whose GGUF tensors
    are of a type ``scheme`` keeps (``KEEP``) by kernel-backed layers holding the file's blocks (the LM
    head's own, not a reduced vocabulary's); each tensor-parallel rank takes its ``shards`` (scales follow
    their rows)."""
    config = lm.config
    projections, head = KEEP[scheme]
    found = gguf_quantized_tensors(path, config, projections, () if config.output_vocab_size else head)
    dtype = lm.model.norm.weight.dtype
    for name, weights in found.items():
        shard = shards.get(name)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            shard = shards.get("model.embed_tokens.weight")
        if shard is not None:
            weights = weights.take(shard.dim, list(shard.index))
        *parents, attr, _ = name.split(".")
        parent = lm.get_submodule(".".join(parents))
        setattr(parent, attr, weights.to_module(dtype, getattr(parent, attr).bias))
