"""A tiny random Llama written as a GGUF file with GGML's block types (Q4_0, Q4_1, Q8_0 mixed over the
layers, tied Q8_0 embedding, f32 norms) and a 256-token byte-level tokenizer, the layout llama.cpp's
converter writes (``attn_q`` / ``attn_k`` rows permuted for its RoPE)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import quantize

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 64, 128, 4, 2, 16, 2, 256
# layer i's (q, k, v, o, gate, up, down) types
LAYER_TYPES = [(T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_1, T.Q4_0, T.Q8_0, T.Q4_1),
               (T.Q8_0, T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_1, T.Q4_0, T.Q8_0)]
GGUF_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HF_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: one token per byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    table = dict(zip(printable, printable)) | {b: 256 + i for i, b in enumerate(extra)}
    return [chr(table[b]) for b in range(256)]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter stores q / k in."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str | Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_tokens())
    w.add_token_types([1] * VOCAB)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    def matrix(name: str, shape: tuple[int, int], qtype: T, heads: int | None = None) -> None:
        x = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        w.add_tensor(name, quantize(llama_cpp_permute(x, heads) if heads else x, qtype), raw_dtype=qtype)

    matrix("token_embd.weight", (VOCAB, HIDDEN), T.Q8_0)
    norm("output_norm.weight")
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = [(q, HIDDEN), (kv, HIDDEN), (kv, HIDDEN), (HIDDEN, q), (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    for i, types in enumerate(LAYER_TYPES):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for name, shape, qtype, heads in zip(GGUF_PROJECTIONS, shapes, types, (HEADS, KV_HEADS, *[None] * 5)):
            matrix(f"blk.{i}.{name}.weight", shape, qtype, heads)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
