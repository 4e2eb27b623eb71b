"""A GGUF file's quantized tensors kept as the file stores them (no second rounding).

GGML's block formats hold a row's (K = in features) consecutive weights in blocks (f16 fields, codes):

    type  weights  bytes  layout                                                   ggml's weight
    Q4_0    32      18    d, 16 B: 4-bit q (q_j, q_j+16 share byte j: low, high)   d · (q − 8)
    Q4_1    32      20    d, m, 16 B: 4-bit q as Q4_0                              d · q + m
    Q5_0    32      22    d, qh (u32: bit j = q_j's bit 4), 16 B: q's low 4 bits   d · (q − 16)
                          as Q4_0
    Q8_0    32      34    d, 32 signed bytes q                                     d · q
    Q4_K   256     144    d, dmin, 12 B: 8 packed 6-bit (sc_j, m_j) (ggml's        (d · sc_j) · q − (dmin · m_j)
                          ``get_scale_min_k4``), 128 B: 4 chunks of 32 bytes,
                          chunk i = sub-blocks 2i (low nibbles), 2i + 1 (high)
    Q6_K   256     210    ql 128 B, qh 64 B, 16 int8 sc_j, d; 16 sub-blocks of     (d · sc_j) · (q − 32)
                          16; weight 128h + 32c + l (h < 2, c < 4, l < 32):
                          low 4 bits = ql[64h + 32 (c mod 2) + l]'s low (c < 2)
                          or high nibble, bits 4-5 = qh[32h + l]'s bits 2c, 2c + 1

``BlockWeights`` holds every type in one form: codes [N, K] int16, per sub-block (G weights) integer
``sc`` / ``mn``, per super-block (SB weights) f32 ``d`` / ``dmin``, and

    weight = (d · sc) · code − (dmin · mn)          (each product and the difference in f32, in this order)

    type  code            G   SB   sc     mn   dmin
    Q4_0  q − 8           32  32   1      0    0
    Q4_1  q in [0, 15]    32  32   1      1    −m      (d q − (−m) = d q + m)
    Q5_0  q − 16          32  32   1      0    0
    Q8_0  q               32  32   1      0    0
    Q4_K  q in [0, 15]    32  256  sc_j   m_j  dmin
    Q6_K  q − 32          16  256  sc_j   0    0

which is ``gguf.quants.dequantize``'s value for every weight. ``to_module`` puts every type on
``block_linear.BlockLinear`` (the ``block_mm`` CPU kernel), which computes with exactly these weights (4-, 5- and
6-bit codes packed, Q8_0's one signed byte each). llama.cpp's converter stores the rows of ``attn_q`` / ``attn_k``
permuted for its RoPE layout for llama-family models only (llama, mistral: a GGUF
``general.architecture`` "llama"; not qwen2); they are permuted back (whole rows, so blocks are
untouched), as transformers does when it dequantizes. The tensors are found with ``gguf_index`` (the
file's tensor table, read in well under a second) and their bytes mapped from the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .block_linear import U4_TYPES, BlockLinear
from .block_store import stored_layers
from .gguf_index import tensor_bytes, tensor_index
from .parallel import Shard

# GGML type name → (SB weights per block, bytes per block, G weights per sub-block)
FORMATS = {"Q4_0": (32, 18, 32), "Q4_1": (32, 20, 32), "Q5_0": (32, 22, 32), "Q8_0": (32, 34, 32),
           "Q4_K": (256, 144, 32), "Q6_K": (256, 210, 16)}
KEPT_TYPES = tuple(FORMATS)
# GGUF tensor name suffix → (HF module path within a layer, RoPE row permutation by "heads" / "kv_heads")
LAYER_TENSORS = {"attn_q": ("self_attn.q_proj", "heads"), "attn_k": ("self_attn.k_proj", "kv_heads"),
                 "attn_v": ("self_attn.v_proj", None), "attn_output": ("self_attn.o_proj", None),
                 "ffn_gate": ("mlp.gate_proj", None), "ffn_up": ("mlp.up_proj", None),
                 "ffn_down": ("mlp.down_proj", None)}
# GGUF tensor name outside the layers → Hugging Face name; a layer's norms
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
LAYER_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
ROPE_PERMUTED = ("llama", "mistral")     # model types whose GGUF q / k rows llama.cpp's converter permutes
DECODE_WEIGHTS = 1 << 18                 # ``from_bytes`` decodes about this many weights at a time


def _nibbles(packed: np.ndarray, chunk: int) -> np.ndarray:
    """[R, B, c · chunk] uint8 → [R, B, 2 · c · chunk]: per chunk of bytes its low nibbles, then its high."""
    r, b, size = packed.shape
    packed = packed.reshape(r, b, size // chunk, 1, chunk)
    out = np.empty((r, b, size // chunk, 2, chunk), np.uint8)
    np.bitwise_and(packed, 15, out=out[..., :1, :])
    np.right_shift(packed, 4, out=out[..., 1:, :])
    return out.reshape(r, b, 2 * size)


def _decode(blocks: np.ndarray, qtype: str, codes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rows of blocks [R, B, block bytes] uint8: their codes written to ``codes`` [R, B, SB] int16, and
    (d, dmin [R, B] f32, sc, mn [R, B, SB/G] int16) returned."""
    r, b, _ = blocks.shape
    sb, _, g = FORMATS[qtype]

    def f16(at: int) -> np.ndarray:             # the f16 field at byte ``at`` of every block, as f32 [R, B]
        return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    def signed(q: np.ndarray, offset: int) -> None:     # uint8 q (overwritten) → codes q − offset
        q -= np.uint8(offset)                           # wraps to the int8 value of q − offset
        np.copyto(codes, q.view(np.int8).reshape(codes.shape), casting="unsafe")

    d = f16(208 if qtype == "Q6_K" else 0)
    dmin, sc, mn = np.zeros_like(d), np.ones((r, b, sb // g), np.int16), np.zeros((r, b, sb // g), np.int16)
    if qtype == "Q4_0":                         # d, 16 bytes: codes j, j + 16 in byte j's nibbles
        signed(_nibbles(blocks[..., 2:], 16), 8)
    elif qtype == "Q4_1":                       # d, m, 16 bytes as Q4_0
        codes[...] = _nibbles(blocks[..., 4:], 16)
        dmin, mn = -f16(2), np.ones_like(mn)
    elif qtype == "Q8_0":
        codes[...] = blocks[..., 2:].view(np.int8)
    elif qtype == "Q5_0":                       # d, qh: bit j of the little-endian u32 = code j's bit 4
        q = _nibbles(blocks[..., 6:], 16)
        high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")
        high <<= 4
        q |= high
        signed(q, 16)
    elif qtype == "Q4_K":                       # d, dmin, 12 bytes of 6-bit scales and mins, 4 × 32 bytes
        codes[...] = _nibbles(blocks[..., 16:], 32)
        dmin, s = f16(2), blocks[..., 4:16]     # ggml's get_scale_min_k4
        sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
        sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    else:                                       # Q6_K: halves h of 128 weights, 4 runs c of 32 in each
        ql = blocks[..., :128].reshape(r, b, 2, 1, 64)
        q = np.empty((r, b, 2, 2, 64), np.uint8)    # (h, nibble, 64 bytes of ql) = (h, c, 32)
        np.bitwise_and(ql, 15, out=q[..., :1, :])
        np.right_shift(ql, 4, out=q[..., 1:, :])
        q = q.reshape(r, b, 2, 4, 32)
        high = blocks[..., 128:192].reshape(r, b, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        high &= 3                               # run c: qh's bits 2c, 2c + 1 = its codes' bits 4, 5
        high <<= 4
        q |= high
        signed(q, 32)
        sc[...] = blocks[..., 192:208].view(np.int8)
    return d, dmin, sc, mn


@dataclass
class BlockWeights:
    """One quantized matrix [N, K] (see the module docstring): ``codes`` [N, K] int16, ``group`` G and
    ``superblock`` SB, ``d`` / ``dmin`` [N, K/SB] f32, ``sc`` / ``mn`` [N, K/G] int16, ``qtype`` the GGML
    type name; weight = (d · sc) · code − (dmin · mn) in f32."""

    qtype: str
    codes: torch.Tensor
    group: int
    superblock: int
    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor

    @classmethod
    def from_bytes(cls, raw: np.ndarray, qtype: str) -> BlockWeights:
        """raw [N, K/SB · block bytes] uint8, a tensor's bytes (``gguf_index.tensor_bytes``; decoded a few
        hundred thousand weights at a time, so that the intermediates stay in cache)."""
        if qtype not in FORMATS:
            raise ValueError(f"GGML type {qtype} is not kept as blocks; kept: {', '.join(KEPT_TYPES)}")
        sb, size, g = FORMATS[qtype]
        if raw.ndim != 2 or raw.shape[1] % size:
            raise ValueError(f"{qtype} rows are whole blocks of {size} bytes; got raw bytes {tuple(raw.shape)}")
        n, b = raw.shape[0], raw.shape[1] // size
        blocks = raw.view(np.uint8).reshape(n, b, size)
        codes = np.empty((n, b, sb), np.int16)
        step = max(1, DECODE_WEIGHTS // (b * sb))
        parts = [_decode(blocks[i:i + step], qtype, codes[i:i + step]) for i in range(0, n, step)]
        d, dmin, sc, mn = (torch.from_numpy(np.concatenate(p).reshape(n, -1)) for p in zip(*parts))
        return cls(qtype, torch.from_numpy(codes.reshape(n, b * sb)), g, sb, d, dmin, sc, mn)

    def group_parameters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d · sc, dmin · mn) [N, K/G] f32: every sub-block's scale and offset."""
        per = self.superblock // self.group
        d, dmin = (t.repeat_interleave(per, dim=1) if per > 1 else t for t in (self.d, self.dmin))
        return d * self.sc, dmin * self.mn

    def dequantize(self) -> torch.Tensor:
        """[N, K] f32, (d · sc) · code − (dmin · mn): what ``gguf.quants.dequantize`` computes."""
        n, k = self.codes.shape
        scale, offset = self.group_parameters()
        w = scale.unsqueeze(-1) * self.codes.view(n, k // self.group, self.group)
        return w.sub_(offset.unsqueeze(-1)).view(n, k)

    def take(self, dim: int, index: list[int] | torch.Tensor) -> BlockWeights:
        """Rows (dim 0) or columns (dim 1) ``index`` of the matrix; -1 gives zero weights. Columns must
        come in whole, aligned super-blocks of SB (a tensor-parallel split along K at a block boundary)."""
        index = torch.as_tensor(index, dtype=torch.long)
        pad = index < 0
        source = index.clamp(min=0)
        fields = (self.codes, self.d, self.dmin, self.sc, self.mn)
        if dim == 0:
            codes, d, dmin, sc, mn = (t[source].masked_fill(pad.unsqueeze(1), 0) for t in fields)
            return BlockWeights(self.qtype, codes, self.group, self.superblock, d, dmin, sc, mn)
        sb, per = self.superblock, self.superblock // self.group
        aligned = len(index) % sb == 0
        if aligned:
            blocks = index.view(-1, sb)
            first = blocks[:, 0]
            aligned = bool(torch.where(first[:, None] < 0, blocks < 0, (blocks == first[:, None] + torch.arange(sb))
                                       & (first[:, None] % sb == 0)).all())
        if not aligned:
            raise ValueError(f"a GGUF {self.qtype} matrix can be split along its input dimension only at "
                             f"multiples of {sb} columns; this tensor-parallel layout splits inside a block: "
                             "use quantization='int8' / 'int4' or another tp_degree")
        block_pad = first < 0
        block = torch.where(block_pad, 0, first // sb)
        groups = (block[:, None] * per + torch.arange(per)).view(-1)
        group_pad = block_pad.repeat_interleave(per).unsqueeze(0)
        codes = self.codes[:, source].masked_fill(pad.unsqueeze(0), 0)
        d, dmin = (t[:, block].masked_fill(block_pad.unsqueeze(0), 0) for t in (self.d, self.dmin))
        sc, mn = (t[:, groups].masked_fill(group_pad, 0) for t in (self.sc, self.mn))
        return BlockWeights(self.qtype, codes, self.group, self.superblock, d, dmin, sc, mn)

    def to_module(self, dtype: torch.dtype, bias: torch.Tensor | None = None) -> BlockLinear:
        """The kernel-backed layer computing x · Wᵀ (+ ``bias``) with exactly these weights, activations and
        outputs in ``dtype`` (``block_linear``)."""
        return BlockLinear.from_blocks(self, dtype, bias)


QUANTIZE_WEIGHTS = 1 << 22                  # ``quantize_q4_0`` works on about this many weights at a time


def quantize_q4_0(weight: torch.Tensor) -> BlockWeights:
    """weight [N, K] (K divisible by 32) → GGML Q4_0 blocks (``gguf_weights.BlockWeights``), as llama.cpp's
    reference quantizer makes them: per group of 32 with m its weight of largest magnitude, d = f16(m / -8) and
    q = round(w / d) clamped to [-8, 7] (0 where d = 0), w ≈ d · q. (llama.cpp rounds with the f32 m / -8 and
    stores its f16: the codes here are those of the stored d.)"""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"Q4_0 needs in features divisible by 32; this layer is [{n}, {k}]: use 'int8'")
    codes, scales = torch.empty(n, k, dtype=torch.int16), torch.empty(n, k // 32)
    step = max(1, QUANTIZE_WEIGHTS // k)
    for r in range(0, n, step):
        w = weight[r:r + step].detach().float().reshape(-1, k // 32, 32)
        d = (w.gather(-1, w.abs().argmax(-1, keepdim=True)) / -8).half().float()     # [R, K/32, 1]
        q = torch.where(d == 0, 0, torch.round(w / d)).clamp_(-8, 7)
        codes[r:r + step], scales[r:r + step] = q.view(-1, k).to(torch.int16), d[..., 0]
    zeros, ones = torch.zeros_like(scales), torch.ones(n, k // 32, dtype=torch.int16)
    return BlockWeights("Q4_0", codes, 32, 32, scales, zeros, ones, torch.zeros_like(ones))


def hf_name(gguf_name: str) -> tuple[str | None, str | None]:
    """(Hugging Face name, RoPE row permutation "heads" / "kv_heads" / None) of a GGUF tensor name; (None,
    None) for a tensor the runtime does not read (e.g. llama 3's ``rope_freqs``)."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name], None
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        return None, None
    _, layer, kind, param = parts
    prefix = f"model.layers.{layer}"
    if kind in LAYER_TENSORS:
        module, permute = LAYER_TENSORS[kind]
        return f"{prefix}.{module}.{param}", permute
    if kind in LAYER_NORMS:
        return f"{prefix}.{LAYER_NORMS[kind]}.{param}", None
    return None, None


def rope_row_order(rows: int, heads: int) -> torch.Tensor:
    """Row i of the Hugging Face matrix is row ``order[i]`` of llama.cpp's (whose converter interleaves the
    two rotary halves of every head)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def gguf_quantized_tensors(path: str | Path, config, keep: tuple[str, ...],
                           head_keep: tuple[str, ...] | None = None) -> dict[str, BlockWeights]:
    """HF weight name → ``BlockWeights`` for every projection tensor of ``path`` whose GGML type is in
    ``keep`` and its LM-head tensor if its type is in ``head_keep`` (default: ``keep``; () for none),
    rows in Hugging Face order (q / k rows permuted back for llama-family models only, ``ROPE_PERMUTED``).
    The tied embedding's blocks, if quantized, appear as ``lm_head.weight`` when the config ties the LM
    head to it."""
    head_keep = keep if head_keep is None else head_keep
    found = {}
    for tensor in tensor_index(path):
        qtype = tensor.qtype
        name, permute = hf_name(tensor.name)
        projection = name is not None and name.endswith("_proj.weight")
        head = name == "lm_head.weight" or (name == "model.embed_tokens.weight" and config.tie_word_embeddings)
        if head and qtype in head_keep:
            name, permute = "lm_head.weight", None
        elif not (projection and qtype in keep):
            continue
        weights = BlockWeights.from_bytes(tensor_bytes(path, tensor), qtype)
        if permute and config.model_type in ROPE_PERMUTED:
            heads = config.num_heads if permute == "heads" else config.num_kv_heads
            weights = weights.take(0, rope_row_order(weights.codes.shape[0], heads))
        found[name] = weights
    return found


# GGML types each scheme keeps as the file stores them (the rest is quantized by ``quant``, or for
# "gguf" left in the compute dtype): (projections, LM head); int8 and int4 hold the head at up to 8 bits.
# "q4_0" takes every block tensor and re-quantizes the other types' to Q4_0 from their exact values (what
# ``quant`` would do from the float checkpoint's f32 weights), so their float weights are never loaded.
KEEP = {"gguf": (KEPT_TYPES, KEPT_TYPES), "int4": (U4_TYPES, ("Q8_0", "Q6_K")),
        "int8": (("Q8_0",), ("Q8_0", "Q6_K")), "q4_0": (KEPT_TYPES, KEPT_TYPES)}


def load_gguf_blocks(lm: nn.Module, path: str | Path, scheme: str, shards: dict[str, Shard],
                     dtype: torch.dtype) -> None:
    """Replace the layers of ``lm`` (a ``DecoderLM``, typically still on the meta device: the replaced
    layers' float weights are then never allocated) whose GGUF tensors are of a type ``scheme`` keeps
    (``KEEP``) by kernel-backed layers holding the file's blocks, computing in ``dtype`` (the LM head's own,
    not a reduced vocabulary's); each tensor-parallel rank takes its ``shards`` (scales follow their rows).
    A replaced layer keeps its bias tensor (still to be loaded if it is on the meta device). Unsharded, the
    packed layers are built once per file and scheme and read back from ``block_store`` by later loads."""
    config = lm.config
    projections, head = KEEP[scheme]
    head = () if config.output_vocab_size else head

    def build() -> dict[str, BlockLinear]:
        layers = {}
        for name, weights in gguf_quantized_tensors(path, config, projections, head).items():
            shard = shards.get(name)
            if name == "lm_head.weight" and config.tie_word_embeddings:
                shard = shards.get("model.embed_tokens.weight")
            if shard is not None:
                weights = weights.take(shard.dim, list(shard.index))
            if scheme == "q4_0" and weights.qtype != "Q4_0":
                weights = quantize_q4_0(weights.dequantize())
            layers[name] = weights.to_module(torch.float32)
        return layers

    layers = build() if shards else stored_layers(Path(path), scheme if head else f"{scheme}-no-head", build)
    for name, layer in layers.items():
        *parents, attr, _ = name.split(".")
        parent = lm.get_submodule(".".join(parents))
        setattr(parent, attr, layer.with_bias(getattr(parent, attr).bias, dtype))
