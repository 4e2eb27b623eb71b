"""``BlockLinear``: a linear layer holding a GGUF file's quantized blocks, run by the ``block_mm`` CPU kernel.

Every GGML type the loader keeps (``gguf_weights.BlockWeights``: Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0) is one
formula over per-group integers and per-superblock floats,

    w[n, k] = (d[n, k/SB] · sc[n, k/G]) · q[n, k] − dmin[n, k/SB] · mn[n, k/G]

which is GGML's own dequantization bit for bit. The kernel multiplies these weights with activations
quantized to 8 bits per group of G (as llama.cpp does: ``kernels``), with exact integer dot products.

The layer packs the matrix in tiles of 16 output columns (``kernels.layout``): 4-bit codes two per byte
(Q4_0, Q4_1, Q4_K), Q6_K's and Q5_0's in 6 and 5 bits, Q8_0's one byte each; d and dmin stay f16, as in the
file. A call reads 4.625 bits a weight for Q4_K (the file: 4.5) and 6.5625 for Q6_K (the same): the integer group
scales and mins take a byte each; Q4_0, Q4_1, Q5_0 and Q8_0 carry one scale (and min) a block in d (and dmin), so
a call reads what the file holds (4.5, 5, 5.5, 8.5 bits), and their sc / mn buffers (all 1) are not read. A row's
output does not depend on how many rows the call has (row invariance), and a call of up to 16 rows reads the
weights once.

Prompt weights (``add_prompt_weights``, ``DecoderModel.from_pretrained(..., prompt_weights="bf16")``): a layer may
also hold its weight as a dense bf16 matrix (GGML's dequantization, rounded to bf16: 2 more bytes a weight), which
it multiplies with inside ``prompt_weights()`` — a prompt's encoding, where a call has hundreds of rows and a
bf16 GEMM (AMX or AVX-512-BF16 through oneDNN) does the work several times faster than 8-bit dot products per group.
Decode and verify steps never use it, so their numbers (and row invariance) do not change. Where PyTorch has oneDNN
with bf16 support, the copy is held prepacked in oneDNN's own blocked layout (``pack_prompt_weight``: an opaque
MKLDNN tensor), so a GEMM does not reorder the weight on every call; the products are the plain matmul's bits.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from .kernels import dequantize, load_block_mm
from .kernels.layout import LANES, Layout, pack, tiled, unpack, untiled

U4_TYPES = ("Q4_0", "Q4_1", "Q4_K")     # unsigned 4-bit codes in groups of 32: packed two to a byte
MIN_TYPES = ("Q4_1", "Q4_K")             # weights with a subtracted minimum: dmin · mn ≠ 0
# GGML type → (kind, offset added to the signed code to store it): kinds 0 = u4, 1 = s8, 2 = u6, 3 = u5
KINDS = {"Q4_0": (0, 8), "Q4_1": (0, 0), "Q4_K": (0, 0), "Q5_0": (3, 16), "Q6_K": (2, 32), "Q8_0": (1, 0)}


_PROMPT = ContextVar("specdec_prompt_weights", default=False)


@contextmanager
def prompt_weights() -> Iterator[None]:
    """Within the block, layers holding a dense ``prompt_weight`` multiply with it (a prompt's encoding)."""
    token = _PROMPT.set(True)
    try:
        yield
    finally:
        _PROMPT.reset(token)


class BlockLinear(nn.Module):
    """x [..., K] → [..., N] with a block-quantized weight [N, K] (buffers ``qs``, ``d``, ``dmin``, ``sc``,
    ``mn`` in the tiled layout; see the module docstring) and an optional ``bias`` in the compute dtype.
    ``prompt_weight`` [N, K] bf16 or None: the dense copy ``prompt_weights()`` calls use (``add_prompt_weight``;
    prepacked by ``pack_prompt_weight``: a plain attribute, not a buffer, since an opaque tensor has no storage)."""

    BUFFERS = ("qs", "d", "dmin", "sc", "mn")
    """The blocks' buffers, in the order the constructor takes them (``blocks()``)."""

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
                 out_features: int, layout: Layout, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        load_block_mm()
        if layout.superblock == layout.group:
            check_unit_scales(untiled(sc, out_features), untiled(mn, out_features), layout.mins)
        self.out_features, self.in_features, self._layout, self._dtype = out_features, layout.in_features, layout, dtype
        for name, t in zip(self.BUFFERS, (qs, d, dmin, sc, mn)):
            self.register_buffer(name, t.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.prompt_weight: torch.Tensor | None = None

    def add_prompt_weight(self) -> None:
        """Hold the weight also as a dense bf16 [N, K] matrix for ``prompt_weights()`` (``pack_prompt_weight``)."""
        self.prompt_weight = pack_prompt_weight(self.dequantized().to(torch.bfloat16))

    @classmethod
    def from_blocks(cls, weights, dtype: torch.dtype, bias: torch.Tensor | None = None) -> BlockLinear:
        """The layer computing with ``weights`` (a ``gguf_weights.BlockWeights``)."""
        kind, offset = KINDS[weights.qtype]
        n, k = weights.codes.shape
        layout = Layout(kind, offset, weights.group, weights.superblock, k, weights.qtype in MIN_TYPES)
        d, dmin = (tiled(exact_f16(getattr(weights, name), name)) for name in ("d", "dmin"))
        return cls(pack(weights.codes, layout), d, dmin, tiled(weights.sc.to(torch.int8)),
                   tiled(weights.mn.to(torch.int8)), n, layout, bias, dtype)

    def with_bias(self, bias: torch.Tensor | None, dtype: torch.dtype) -> BlockLinear:
        """This layer's blocks (the same buffers) computing in ``dtype`` with ``bias``."""
        return BlockLinear(*self.blocks(), self.out_features, self._layout, bias, dtype)

    def blocks(self) -> tuple[torch.Tensor, ...]:
        """qs, d, dmin, sc, mn (``BUFFERS``): what the constructor takes before ``out_features``."""
        return tuple(getattr(self, name) for name in self.BUFFERS)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations in and out, bias)."""
        return self._dtype

    @property
    def layout(self) -> Layout:
        """How the codes are packed: layers of one layout concatenate (``cat_rows``)."""
        return self._layout

    @classmethod
    def cat_rows(cls, layers: list[BlockLinear]) -> BlockLinear:
        """One layer whose output is the layers' outputs concatenated (one ``layout``)."""
        if len({layer.layout for layer in layers}) != 1:
            raise ValueError("BlockLinear.cat_rows needs layers of one layout (GGML type family, group, "
                             "superblock, in features)")
        first = layers[0]
        if all(layer.out_features % LANES == 0 for layer in layers[:-1]):    # whole tiles: concatenate them
            parts = [torch.cat(buffers) for buffers in zip(*(layer.blocks() for layer in layers))]
        else:
            codes = torch.cat([unpack(layer.qs, layer.out_features, layer.layout) for layer in layers])
            parts = [pack(codes, first.layout)] + [
                tiled(torch.cat([untiled(getattr(layer, name), layer.out_features) for layer in layers]))
                for name in ("d", "dmin", "sc", "mn")]
        return cls(*parts, sum(layer.out_features for layer in layers), first.layout, cat_biases(layers), first.dtype)

    def first_rows(self, n: int) -> BlockLinear:
        """The layer computing only output features [0, n): a copy of its first ceil(n / 16) tiles."""
        tiles = -(-n // LANES)
        parts = [t[:tiles].clone() for t in self.blocks()]
        bias = None if self.bias is None else self.bias[:n]
        return BlockLinear(*parts, n, self._layout, bias, self._dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] f32 the layer computes with."""
        n, layout = self.out_features, self._layout
        d, dmin, sc, mn = (untiled(t, n).float() for t in (self.d, self.dmin, self.sc, self.mn))
        return dequantize(unpack(self.qs, n, layout), d, dmin, sc, mn, layout.group, layout.superblock)

    def kernel_weights(self) -> list[torch.Tensor]:
        """qs, d, dmin, sc, mn and the bias (an empty tensor where there is none): ``block_layer``'s weights."""
        bias = self.qs.new_empty(0, dtype=torch.float32) if self.bias is None else self.bias
        return [*self.blocks(), bias]

    def kernel_layout(self) -> list[int]:
        """n, group, superblock, kind, offset, mins: the ints ``block_mm`` and ``block_layer`` take."""
        layout = self._layout
        return [self.out_features, layout.group, layout.superblock, layout.kind, layout.offset, int(layout.mins)]

    def fused(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + (f(x) · Wᵀ + bias) on f32 rows x [M, K] ([M, 2K] ``gated``) → [M, N] f32, in one kernel
        call: f = RMSNorm with weight ``norm`` and ``eps``, or (``gated``) silu(x[:, :K]) · x[:, K:], or none;
        no residual when None (a decoder layer's steps around its matmuls: ``block_layer``)."""
        n, group, superblock, kind, offset, mins = self.kernel_layout()
        return torch.ops.specdec.block_mm(x.contiguous(), self.qs, self.d, self.dmin, self.sc, self.mn, n, group,
                                          superblock, kind, offset, bool(mins), norm, eps, gated, self.bias, residual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prompt_weight is not None and _PROMPT.get():
            y = prompt_matmul(x.to(torch.bfloat16), self.prompt_weight).to(self._dtype)
            return y if self.bias is None else y + self.bias
        flat = x.reshape(-1, self.in_features).float().contiguous()
        layout = self._layout
        y = torch.ops.specdec.block_mm(flat, self.qs, self.d, self.dmin, self.sc, self.mn, self.out_features,
                                       layout.group, layout.superblock, layout.kind, layout.offset, layout.mins)
        y = y.to(self._dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def check_unit_scales(sc: torch.Tensor, mn: torch.Tensor, mins: bool) -> None:
    """ValueError unless a layout of one group a superblock has sc = 1 (and, with mins, mn = 1): GGML's Q4_0 / Q4_1 /
    Q5_0 / Q8_0 carry one scale (and min) a block in d (and dmin), and the kernel does not read sc / mn there."""
    if not bool((sc == 1).all()) or (mins and not bool((mn == 1).all())):
        raise ValueError("BlockLinear: blocks of one group a superblock (Q4_0, Q4_1, Q5_0, Q8_0) carry their scale "
                         "and min in d and dmin: their integer scales sc (and mins mn) must all be 1")


def exact_f16(values: torch.Tensor, name: str) -> torch.Tensor:
    """``values`` as f16, which holds them exactly: GGUF stores every block's scales as f16; a value
    f16 cannot hold is an error, not a rounding."""
    half = values.to(torch.float16)
    if not torch.equal(half.float(), values.float()):
        raise ValueError(f"BlockLinear: the block {name} values must be f16 numbers (GGUF's block scales are)")
    return half


def cat_biases(layers: list[nn.Module]) -> torch.Tensor | None:
    """The layers' biases concatenated (None when none has one; a missing one counts as zeros)."""
    biases = [layer.bias for layer in layers]
    if all(b is None for b in biases):
        return None
    like = next(b for b in biases if b is not None)
    return torch.cat([like.new_zeros(layer.out_features) if b is None else b.detach()
                      for layer, b in zip(layers, biases)])


def packs_prompt_weights() -> bool:
    """Whether ``pack_prompt_weight`` prepacks: PyTorch built with oneDNN, on a CPU it runs bf16 GEMMs on."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_prompt_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 in oneDNN's blocked layout for its GEMM (``torch.ops.mkldnn._reorder_linear_weight``,
    what Inductor's CPU freezing uses), where ``packs_prompt_weights``; else ``weight`` itself. A plain matmul
    hands oneDNN the weight in PyTorch's layout, which it reorders on every call: prepacked, the GEMM of a prompt
    runs 1.1-1.6x faster (the 1.5B's projections at 96-512 rows, two cores) with the same bits."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None) if packs_prompt_weights() else weight


def prompt_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 · weightᵀ → [..., N] bf16, for a ``pack_prompt_weight`` result (packed or plain)."""
    if not weight.is_mkldnn:
        return x @ weight.T
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, None, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])


def add_prompt_weights(layers: nn.Module, progress: bool = False) -> None:
    """Give every ``BlockLinear`` under ``layers`` (a model's decoder layers: not its LM head, which a prompt's
    encoding runs on one position) its dense bf16 ``prompt_weight``."""
    from tqdm.auto import tqdm
    blocks = [m for m in layers.modules() if isinstance(m, BlockLinear)]
    for m in tqdm(blocks, desc="prompt weights (bf16)", unit="matrix", disable=not progress):
        m.add_prompt_weight()
