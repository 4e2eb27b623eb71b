"""The decoder as plain math over tensors, with a static KV cache.

One forward serves every graph (context encoding, token generation, multi-token verify):

    forward(input_ids [B, n], position_ids [B, n], cache_lengths [B], token_mask [B, n, n],
            logit_index [B, m], kv_len: static int, seq_ids [b] | None) -> (logits [B, m, V] f32, hidden [B, n, H])

With ``feature_layers`` (EAGLE-3 targets) ``hidden`` is [B, n, H·(1+A)]: the final-norm hidden state,
then the A auxiliary hidden states, in layer order — aux of layer i = the residual stream entering
layer i (i = num_layers: the last layer's output, before the final norm), i.e. transformers'
``hidden_states[i]`` for i < num_layers. ``split_hidden`` separates them.

With ``seq_ids`` the inputs hold b rows (usually 1) that read and write cache rows ``seq_ids`` and no
other (NxD Inference's ``seq_ids``: context encoding of one request into its slot of a running batch).

Invariants:
- row b's committed tokens live in cache slots ``[0, cache_lengths[b])``; the n new tokens are
  written to slots ``cache_lengths[b] + i`` (i < n) — the caller guarantees ``cache_lengths + n <= kv_len``;
- ``position_ids`` are RoPE positions (``cache_lengths + i`` for a chain, ``cache_lengths + depth``
  for a tree), independent of the slot a token is written to;
- a new token i attends to all committed slots of its row and to new token j iff ``token_mask[b, i, j]``;
- a new token i with ``token_mask[b, i, i]`` False is padding (``padding_mask``: a prompt's bucket padding, a
  verify's positions past a row's real drafts): its logits, hidden state and cache slot are unspecified and
  no real token may attend to it; kernels may skip it (``block_layer`` computes only the real tokens);
- attention reads only the first ``kv_len`` slots (the KV bucket); stale slots past a row's length
  are masked, so rollback is just lowering ``cache_lengths``;
- with ``kv_cache_dtype`` ("int8" / "fp8_e4m3", ``kv_quant``) each slot holds 8-bit K/V and f32 scales
  per KV head (``k_scale`` / ``v_scale`` [B, S, Hkv]), written together; the n new tokens are written
  first, so they too attend to their own dequantized K/V, as every later step sees them.
Parameter names equal the Hugging Face ``LlamaForCausalLM`` state-dict keys.

Tensor parallelism (``tp.size > 1``, see ``parallel``): every module holds its rank's shard — head
slots from the ``HeadLayout``, ``ceil(intermediate / tp)`` MLP rows, ``ceil(vocab / tp)`` embedding
and LM-head rows; the KV cache holds the rank's KV slots. Collectives: all-reduce after the
embedding, o_proj and down_proj, all-gather of the logits; every rank returns the same full logits
and hidden states. At ``tp.size == 1`` no collective is traced. The rank is data, not a Python
constant: the vocab-parallel embedding reads it from the ``[1]`` int32 tensor ``tp_rank``, so one
traced program serves every rank given that rank's weights and rank value (``backend='neuron'``:
an ``nn.Parameter``, as NxD's ``SPMDRank`` holds it, so the tracer keeps it a per-rank weight input;
otherwise a non-persistent buffer, outside the checkpoint's names and the parameter count); the
collectives are ``tp.collectives``' (``parallel``).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .block_linear import prompt_weights
from .config import ModelConfig
from .kv_quant import dequantize_kv, quantize_kv, storage_dtype
from .parallel import NXD, TPGroup, all_gather_last, all_reduce, per_rank
from .tp_layout import HeadLayout, head_layout

# a one-logit call of at least this many new tokens encodes (the rest of) a prompt: on the dense prompt weights
# where the model holds them (decode steps have one token, verify steps fewer and one logit per token)
PROMPT_ROWS = 32


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies [head_dim/2] and attention scaling, as transformers computes them."""
    hf = config.hf_config
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        dim = config.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, yarn)")
    with torch.device("cpu"):  # also when the module is being built under a meta-device context
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.float(), float(scaling)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalised in f32, cast back to x's dtype, then scaled by ``weight``."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., D] with cos/sin broadcastable to it."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Column-parallel q/k/v over the rank's head slots, row-parallel o_proj (+ all-reduce).

    KV cache of the rank's KV heads: ``k_cache`` / ``v_cache`` [B, S, Hkv per rank, D] in the compute
    dtype, or with ``kv_cache_dtype`` ("int8" / "fp8_e4m3") in 8 bits plus f32 scales ``k_scale`` /
    ``v_scale`` [B, S, Hkv per rank], one per (row, slot, head) (``kv_quant``: format, error bound)."""

    functional_state = False     # True (per instance) while a graph is traced for Neuron: see ``store``

    def __init__(self, c: ModelConfig, batch_size: int, n_positions: int, dtype: torch.dtype,
                 layout: HeadLayout, tp: TPGroup, kv_cache_dtype: str | None = None, in_features: int | None = None):
        """``in_features``: width of the input q/k/v read (default ``hidden_size``; EAGLE-3 drafts: 2H)."""
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.tp = layout.q_per_rank, layout.kv_per_rank, c.head_dim, tp
        width = in_features or c.hidden_size
        self.q_proj = nn.Linear(width, self.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(width, self.n_kv * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(width, self.n_kv * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, c.hidden_size, bias=False)
        self.qkv_proj = None     # q, k and v in one layer (``quant.fuse_projections``)
        self.qkv_sizes = (self.n_heads * c.head_dim, self.n_kv * c.head_dim, self.n_kv * c.head_dim)
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_shape = (batch_size, n_positions, self.n_kv, c.head_dim)  # [B, S, Hkv per rank, D]
        self.cache_dtype = dtype if kv_cache_dtype is None else storage_dtype(kv_cache_dtype)
        for name, buffer_dtype, shape in self._cache_specs():
            self.register_buffer(name, torch.zeros(shape, dtype=buffer_dtype), persistent=False)

    def _cache_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of each per-slot buffer: the caches and, quantized, their scales."""
        specs = [("k_cache", self.cache_dtype, self.cache_shape), ("v_cache", self.cache_dtype, self.cache_shape)]
        if self.kv_cache_dtype is not None:
            specs += [(f"{kv}_scale", torch.float32, self.cache_shape[:3]) for kv in "kv"]
        return specs

    def cache_buffers(self) -> list[torch.Tensor]:
        """The per-slot buffers, each [B, S, ...] (rows, slots first): what KV compaction moves."""
        return [getattr(self, name) for name, _, _ in self._cache_specs()]

    def init_cache(self) -> None:
        """Zero the per-slot buffers, restoring their dtypes (a module-wide ``.to(dtype)`` casts the fp8
        caches and the f32 scales)."""
        for name, dtype, _ in self._cache_specs():
            setattr(self, name, getattr(self, name).to(dtype).zero_())

    def store(self, name: str, index: tuple[torch.Tensor, torch.Tensor], values: torch.Tensor) -> torch.Tensor:
        """Write ``values`` to per-slot buffer ``name`` at ``index`` (rows, slots) and return the buffer:
        in place, or with ``functional_state`` as a new tensor bound to the buffer's name (the form of
        state update neuronx-distributed's tracer turns into an aliased output; ``neuron``)."""
        buffer = getattr(self, name)
        if not self.functional_state:
            return buffer.index_put_(index, values)
        setattr(self, name, buffer.index_put(index, values))
        return getattr(self, name)

    def move_slots(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot src[b, i] of every per-slot buffer to slot dst[b, i] (rows [B, 1], src / dst [B, m];
        every slot is read before any is written)."""
        for name, _, _ in self._cache_specs():
            self.store(name, (rows, dst), index_slots(getattr(self, name), (rows, src)))

    def _write_read(self, kv: str, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, kv_len: int,
                    seq_ids: torch.Tensor | None) -> torch.Tensor:
        """Write x [b, n, Hkv, D] (``kv``: "k" keys, "v" values) to cache slots (rows [b, 1], slots [b, n]);
        return the first ``kv_len`` slots of the input rows' cache rows, [b, kv_len, Hkv, D] in x's dtype
        (dequantized when the cache is quantized)."""
        name = f"{kv}_cache"
        if self.kv_cache_dtype is None:
            cache = self.store(name, (rows, slots), x.to(getattr(self, name).dtype))
            return read_slots(cache, seq_ids, kv_len)
        q, s = quantize_kv(x, getattr(self, name).dtype)
        cache = self.store(name, (rows, slots), q)
        scale = self.store(f"{kv}_scale", (rows, slots), s)
        return dequantize_kv(read_slots(cache, seq_ids, kv_len), read_slots(scale, seq_ids, kv_len), x.dtype)

    def forward(self, x, cos, sin, slots, mask, kv_len: int, seq_ids=None):
        """x [b, n, H]; cos/sin [b, n, D]; slots [b, n] cache slots to write; mask [b, 1, n, kv_len];
        seq_ids [b]: the cache row of each input row (None: input row i is cache row i, b = batch)."""
        b, n, _ = x.shape
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.reshape(b, n, self.n_heads, self.head_dim)
        k = k.reshape(b, n, self.n_kv, self.head_dim)
        v = v.reshape(b, n, self.n_kv, self.head_dim)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rows = (torch.arange(b, device=x.device) if seq_ids is None else seq_ids).unsqueeze(1)
        keys = self._write_read("k", k, rows, slots, kv_len, seq_ids).transpose(1, 2)  # [b, Hkv, kv_len, D]
        values = self._write_read("v", v, rows, slots, kv_len, seq_ids).transpose(1, 2)
        out = grouped_query_attention(q.transpose(1, 2), keys, values, mask).transpose(1, 2)
        out = self.o_proj(out.reshape(b, n, self.n_heads * self.head_dim))
        return all_reduce(out, self.tp) if self.tp.size > 1 else out


def grouped_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            mask: torch.Tensor) -> torch.Tensor:
    """Attention of q [b, H, n, D] over keys / values [b, Hkv, L, D] (H a multiple of Hkv: query head h
    reads KV head h // (H / Hkv), as HF's ``repeat_kv``) under a boolean mask [b or 1, 1, n, L] or [n, L]
    (True = attend) → [b, H, n, D].

    The g = H / Hkv query heads of a KV head go through SDPA as g·n query rows of that one head (the
    mask repeated for each), not through SDPA's ``enable_gqa``, which on CPU first copies K / V out to H
    heads: per layer, a batch-128 decode step at 640 KV slots took 63 ms that way and 17 ms this way, a
    batch-1 decode step 0.28 and 0.14 ms, a batch-4 one 1.25 and 0.31 ms (bf16, 2 threads)."""
    b, H, n, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    g = H // Hkv
    if g == 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    m = mask if mask.dim() == 4 else mask.view(1, 1, n, L)
    m = m.unsqueeze(2).expand(m.shape[0], 1, g, n, L).reshape(m.shape[0], 1, g * n, L)
    out = F.scaled_dot_product_attention(q.reshape(b, Hkv, g * n, D), keys, values, attn_mask=m)
    return out.reshape(b, H, n, D)


def read_slots(buffer: torch.Tensor, seq_ids: torch.Tensor | None, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` slots of a per-slot buffer [B, S, ...]: every row (seq_ids None) or rows
    ``seq_ids`` [b] → [b, kv_len, ...]."""
    return buffer[:, :kv_len] if seq_ids is None else index_slots(buffer, (seq_ids,))[:, :kv_len]


def index_slots(buffer: torch.Tensor, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``buffer[index]`` (advanced indexing over the leading dims); an fp8 buffer is indexed as bytes
    (torch 2.9's CPU indexing has no float8 kernel)."""
    if buffer.dtype.is_floating_point and buffer.element_size() == 1:
        return buffer.view(torch.uint8)[index].view(buffer.dtype)
    return buffer[index]


class MLP(nn.Module):
    """Column-parallel gate/up, row-parallel down (+ all-reduce); intermediate zero-padded to tp."""

    def __init__(self, c: ModelConfig, tp: TPGroup):
        super().__init__()
        inter, self.tp = per_rank(c.intermediate_size, tp.size), tp
        self.gate_proj = nn.Linear(c.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, c.hidden_size, bias=False)
        self.gate_up_proj = None     # gate and up in one layer (``quant.fuse_projections``)

    def forward(self, x):
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return all_reduce(out, self.tp) if self.tp.size > 1 else out


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, batch_size: int, n_positions: int, dtype: torch.dtype,
                 layout: HeadLayout, tp: TPGroup, kv_cache_dtype: str | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, batch_size, n_positions, dtype, layout, tp, kv_cache_dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c, tp)

    def forward(self, x, cos, sin, slots, mask, kv_len: int, seq_ids=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, mask, kv_len, seq_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig, batch_size: int, n_positions: int, dtype: torch.dtype,
                 layout: HeadLayout, tp: TPGroup, kv_cache_dtype: str | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(per_rank(c.vocab_size, tp.size), c.hidden_size)  # vocab-parallel
        self.layers = nn.ModuleList(DecoderLayer(c, batch_size, n_positions, dtype, layout, tp, kv_cache_dtype)
                                    for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def padding_mask(token_mask: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """token_mask [n, n] or [B, n, n] with token i of row b marked padding where ``real`` [B, n] bool is False
    (its diagonal entry cleared) → [B, n, n]. A padding token must come after every real token that attends to
    its slot's position in the mask (e.g. a causal mask's tail), and token 0 must stay real: a padding token
    still attends to the tokens before it, so no attention row is empty."""
    b, n = real.shape
    mask = token_mask.expand(b, n, n).clone()
    mask.diagonal(dim1=1, dim2=2).logical_and_(real)
    return mask


def causal_mask(n: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The causal token mask of n new tokens: [n, n]; with ``lengths`` [B] (each ≥ 1), [B, n, n] with row b's
    tokens from lengths[b] on marked padding (``padding_mask``: a prompt's bucket padding, a verify's positions
    past a row's real drafts), so kernels that skip padding compute each row's real tokens only."""
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if lengths is None:
        return causal
    return padding_mask(causal, torch.arange(n) < lengths.cpu().view(-1, 1))


def attention_mask(cache_lengths: torch.Tensor, token_mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean mask [B, 1, n, kv_len]: committed slots of the row, plus new tokens per ``token_mask``."""
    b, n, _ = token_mask.shape
    offset = torch.arange(kv_len, device=cache_lengths.device).unsqueeze(0) - cache_lengths.unsqueeze(1)
    past = (offset < 0).unsqueeze(1)                                     # [B, 1, kv]
    is_new = ((offset >= 0) & (offset < n)).unsqueeze(1)                 # [B, 1, kv]
    index = offset.clamp(0, n - 1).unsqueeze(1).expand(b, n, kv_len)
    new = torch.gather(token_mask, 2, index)                             # [B, n, kv]
    return (past | (is_new & new)).unsqueeze(1)


class DecoderLM(nn.Module):
    """Llama-family causal LM with a preallocated KV cache of ``n_positions`` slots per row.

    ``tp``: this rank's tensor-parallel group (default: not sharded); ``layout``: the head slots
    (default: ``head_layout`` with the automatic GQA strategy for ``tp.size``); ``kv_cache_dtype``:
    None (the cache in ``dtype``), "int8" or "fp8_e4m3" (``kv_quant``); ``feature_layers``: the layers
    whose input hidden states ``forward`` also returns (``check_feature_layers``; EAGLE-3 targets).
    """

    def __init__(self, config: ModelConfig, batch_size: int, n_positions: int, dtype: torch.dtype,
                 tp: TPGroup = TPGroup(), layout: HeadLayout | None = None, kv_cache_dtype: str | None = None,
                 feature_layers: tuple[int, ...] = ()):
        super().__init__()
        self.config, self.tp = config, tp
        self.feature_layers = check_feature_layers(feature_layers, config.num_layers)
        # per layer, a callable run(layer, *inputs) replacing layer(*inputs): ``graphs.compile_layers`` (regional),
        # ``block_layer.run_block_layer`` (a GGUF file's blocks in f32 on the CPU)
        self.layer_runners: list[Callable] | None = None
        # all the layers in one call, run(x, cos, sin, slots, mask, seq_ids), instead of the per-layer loop when
        # the forward returns no feature layers: ``block_layer.BlockStack``
        self.stack_runner: Callable | None = None
        # the decoder layers' GGML blocks also held as dense bf16 matrices, which a prompt's encoding multiplies
        # with (``block_linear.add_prompt_weights``; ``forward``)
        self.prompt_weights = False
        self.layout = layout or head_layout(config.num_heads, config.num_kv_heads, tp.size)
        self.model = Backbone(config, batch_size, n_positions, dtype, self.layout, tp, kv_cache_dtype)
        self.out_vocab = config.output_vocab_size or config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, per_rank(self.out_vocab, tp.size), bias=False)  # vocab-parallel
        if config.output_vocab_size:
            # reduced output vocabulary (small drafts): lm_head row i scores token output_token_ids[i];
            # every other token gets logit -inf, i.e. probability 0 (rejection sampling stays lossless);
            # the ids are replicated (the logits are gathered before they are scattered)
            self.register_buffer("output_token_ids", torch.empty(config.output_vocab_size, dtype=torch.long))
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, self.rope_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if tp.size > 1:   # the rank as data (a weight of the graph, not a constant in it)
            if tp.collectives == NXD:
                self.tp_rank = nn.Parameter(rank_value(tp.rank), requires_grad=False)
            else:
                self.register_buffer("tp_rank", rank_value(tp.rank), persistent=False)

    def init_buffers(self) -> None:
        """Restore what ``to_empty``/dtype casts lose: weight tying, f32 RoPE frequencies, zero caches
        (and scales) in their storage dtypes."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):   # not a quantized head
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq = rope_inv_freq(self.config)[0].to(self.model.norm.weight.device)
        if self.tp.size > 1:
            with torch.no_grad():
                self.tp_rank.fill_(self.tp.rank)
        for layer in self.model.layers:
            layer.self_attn.init_cache()

    def restrict_output_vocab(self, n: int) -> None:
        """Score only the token ids [0, n) (a draft's reduced LM head, as FR-Spec / SGLang's speculative token
        map do with frequent tokens: byte-pair ids are numbered in merge order, so the first ids are the common
        ones): the head keeps its first n rows — a ``BlockLinear`` its first tiles of blocks, a float head
        (tied or not) a view of its first rows — and every other token gets logit -inf (probability 0), so a
        draft restricted this way only ever proposes ids below n and rejection sampling stays lossless.
        Once per model, before any graph is built; tensor parallelism is not supported."""
        from dataclasses import replace

        from .block_linear import BlockLinear

        check_output_vocab_size(n, self.config, self.tp.size)
        head = self.lm_head
        if isinstance(head, BlockLinear):
            self.lm_head = head.first_rows(n)
        elif isinstance(head, nn.Linear):     # a view of the first rows (of the embedding, if tied: now untied)
            head.weight = nn.Parameter(head.weight.detach()[:n], requires_grad=False)
            head.out_features = n
        else:
            raise ValueError(f"output_vocab_size needs a float LM head or a GGUF file's own blocks "
                             f"(quantization=None or 'gguf'); this model's head is a {type(head).__name__}")
        self.config = replace(self.config, output_vocab_size=n)
        self.out_vocab = n
        self.register_buffer("output_token_ids", torch.arange(n, device=self.inv_freq.device))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, n] → [B, n, H]; vocab-parallel: the owning rank's row, summed over ranks."""
        table = self.model.embed_tokens
        if self.tp.size == 1:
            return table(input_ids)
        local = input_ids - self.tp_rank * table.num_embeddings
        inside = (local >= 0) & (local < table.num_embeddings)
        x = table(local.clamp(0, table.num_embeddings - 1)).masked_fill(~inside.unsqueeze(-1), 0)
        return all_reduce(x, self.tp)

    def forward(self, input_ids, position_ids, cache_lengths, token_mask, logit_index, kv_len: int,
                seq_ids=None):
        x = self.embed(input_ids)
        cos, sin = rope_tables(position_ids, self.inv_freq, self.rope_scaling, x.dtype)
        slots, mask = new_token_slots(cache_lengths, token_mask, kv_len)
        aux = []
        # a prompt's encoding (the context-encoding graphs: the new tokens fill the KV bucket, or, after a kept
        # prefix, at least PROMPT_ROWS of them; one logit) runs the layers' own forward on the dense prompt weights,
        # where the model holds them
        n = input_ids.shape[1]
        dense = self.prompt_weights and (n == kv_len or n >= PROMPT_ROWS) and logit_index.shape[1] == 1
        if self.stack_runner is not None and not self.feature_layers and not dense:
            x = self.stack_runner(x, cos, sin, slots, mask, seq_ids)
        else:
            with prompt_weights() if dense else nullcontext():
                for i, layer in enumerate(self.model.layers):
                    if i in self.feature_layers:
                        aux.append(x)
                    if self.layer_runners is None or dense:
                        x = layer(x, cos, sin, slots, mask, kv_len, seq_ids)
                    else:
                        x = self.layer_runners[i](layer, x, cos, sin, slots, mask, kv_len, seq_ids)
        if len(self.model.layers) in self.feature_layers:
            aux.append(x)
        hidden = self.model.norm(x)
        logits = self.lm_head(pick_positions(hidden, logit_index))
        if self.tp.size > 1:
            logits = all_gather_last(logits, self.tp)[..., :self.out_vocab]   # drop the vocab padding
        logits = full_vocab_logits(logits, self.config, getattr(self, "output_token_ids", None))
        return logits, torch.cat([hidden, *aux], -1) if aux else hidden


def check_output_vocab_size(n: int, config: ModelConfig, tp_size: int) -> None:
    """ValueError unless ``DecoderLM.restrict_output_vocab(n)`` can apply to a model of ``config`` on ``tp_size``
    ranks (checked before any weight loads)."""
    if config.output_vocab_size is not None:
        raise ValueError(f"this model already scores a reduced vocabulary of {config.output_vocab_size} tokens")
    if not 1 <= n <= config.vocab_size:
        raise ValueError(f"output_vocab_size must be in [1, {config.vocab_size}] (the vocabulary), got {n}")
    if tp_size > 1:
        raise ValueError("output_vocab_size is not supported with tensor parallelism (tp_degree > 1)")


def check_feature_layers(layers, num_layers: int) -> tuple[int, ...]:
    """``layers`` (ints in [0, num_layers], no repeats) as a sorted tuple: the order their hidden states
    are returned in (vLLM / SGLang collect them in layer order); ValueError naming the bad entry."""
    layers = tuple(int(i) for i in layers)
    for i in layers:
        if not 0 <= i <= num_layers:
            raise ValueError(f"feature layer {i} does not exist: the target has {num_layers} layers "
                             f"(feature layers 0 .. {num_layers})")
    if len(set(layers)) != len(layers):
        raise ValueError(f"feature layers {list(layers)} repeat a layer")
    return tuple(sorted(layers))


def split_hidden(hidden: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A graph's hidden output [..., H·(1+A)] → (final-norm hidden [..., H], aux hidden states
    [..., A·H] in layer order, or None when the model has no ``feature_layers``)."""
    if hidden.shape[-1] == hidden_size:
        return hidden, None
    return hidden[..., :hidden_size], hidden[..., hidden_size:]


def rank_value(rank: int) -> torch.Tensor:
    """``tp_rank``'s value for ``rank``: [1] int32 (NxD's ``SPMDRank.rank``)."""
    return torch.tensor([rank], dtype=torch.int32, device="cpu")


def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin [B, n, head_dim] for position_ids [B, n] (computed in f32, returned in ``dtype``)."""
    freqs = position_ids.unsqueeze(-1).float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def new_token_slots(cache_lengths: torch.Tensor, token_mask: torch.Tensor,
                    kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots [B, n] the n new tokens are written to (``cache_lengths + i``) and the attention
    mask [B, 1, n, kv_len] (``attention_mask``)."""
    n = token_mask.shape[1]
    slots = cache_lengths.unsqueeze(1) + torch.arange(n, device=cache_lengths.device)
    return slots, attention_mask(cache_lengths, token_mask, kv_len)


def pick_positions(hidden: torch.Tensor, logit_index: torch.Tensor) -> torch.Tensor:
    """hidden [B, n, H] at logit_index [B, m] → [B, m, H]."""
    return torch.gather(hidden, 1, logit_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def full_vocab_logits(logits: torch.Tensor, config: ModelConfig, output_token_ids: torch.Tensor | None) -> torch.Tensor:
    """f32 logits over the whole vocabulary: a reduced output vocabulary's logits [B, m, N] are
    scattered to their token ids; every other token gets -inf (probability 0)."""
    logits = logits.float()
    if output_token_ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], config.vocab_size), float("-inf"))
    return full.scatter(-1, output_token_ids.expand_as(logits), logits)
