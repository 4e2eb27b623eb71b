"""Capacity planning: does a model (and its draft) fit a platform, and at which tensor-parallel degree?

Everything is computed from a Hugging Face ``config.json`` — no weights are read. Units: bytes, printed
in GB = 10^9 bytes (the unit the Neuron documentation uses for its 16 GB-per-core rule).

**Weights.** The model is built with ``transformers`` on the ``meta`` device (no memory is allocated)
and its unique parameters are counted (tied embeddings once), so any causal-LM architecture
transformers knows (llama, mistral, qwen2, opt, gpt2, ...) is counted exactly. Total weight bytes =
parameters × dtype bytes (``amp``: f32 = 4, bf16 / f16 = 2). Buffers (RoPE tables) are not counted.

**KV cache** (what the static-shape runtime preallocates)::

    kv_bytes = 2 (K and V) × layers × batch_size × n_positions × kv_heads × head_dim × dtype bytes

With ``kv_cache_dtype`` ("int8" / "fp8_e4m3", ``specdec.core.kv_quant``) each element takes 1 byte and
each (slot, KV head) of K and of V a 4-byte f32 scale: ``kv_bytes = kv_elems + kv_elems / head_dim × 4``.
``n_positions`` is the whole cache: prompt + generated tokens + the k speculative positions a
verification step writes (the runtime shrinks k near the end rather than reserving more), so k adds
no memory of its own. Sliding windows do not shrink the cache (the runtime allocates n_positions).

**Per core at tensor-parallel degree tp** (what one NeuronCore / GPU / rank holds)::

    weights/core = q_heads/core × (q_proj + o_proj per head) + kv_heads/core × (k_proj + v_proj per head)
                 + Σ ceil(rows / tp) × cols         # MLP and other 2-D weights: column/row parallel
                 + Σ ceil(vocab / tp) × hidden      # embeddings and LM head: vocab-parallel (default)
                 + 1-D parameters                   # norms, biases: replicated (a small upper bound)
    kv/core      = 2 × layers × batch_size × n_positions × kv_heads/core × head_dim × dtype bytes
                   (quantized KV: 1 byte per element + 4 bytes per (slot, head), as above)
    total/core   = weights/core + kv/core (+ the draft's, see below)

Heads per core come from the runtime's GQA layout for the architectures it runs (``llama``,
``mistral``, ``qwen2``: :func:`specdec.core.tp_layout.head_layout`): replicated or padded KV heads
raise KV memory per core, padded query heads raise q/o weights per core. A 2-D weight is split along
its larger dimension (the MLP's intermediate size, the vocabulary), zero-padded up to a multiple of tp
as the runtime does (``specdec.core.parallel.per_rank``). Other architectures (opt,
gpt2) follow the reference rule of transformers-neuronx: no padding, the attention heads must be
divisible by tp, each core holds heads / tp of them (their attention matrices are split evenly).

**Draft (speculation).** A draft model is planned like the target (same batch_size, n_positions and
amp). It runs at ``draft_tp_degree`` (default: the target's degree, as NxD Inference's fused
speculation does) on the first cores of the target's, so the fullest core holds
target/core + draft/core. The runtime runs a draft either replicated on every core
(``draft_tp_degree=1``) or sharded like the target (the same degree); nothing in between.

**Capacity rule.** A degree fits when total/core ≤ memory_fraction × memory per core, default
memory_fraction = 0.9. Per-core memory: 16 GB per NeuronCore on Inf2 / Trn1, 24 GB per logical
NeuronCore on Trn2 with LNC=2 (12 GB per physical core with LNC=1), the given size on a GPU, the host
RAM on CPU (where all ranks share it, so tp × total/core must fit). The 10 % reserve is for what the
Neuron runtime allocates per core besides weights and KV: model code (including 96 MB of micro-code
per physical core), the shared scratchpad (allocated in 512 MB pages), DMA rings, I/O tensors and
collective buffers (Neuron runtime "device memory" guide). It is also what the seed case needs: a
Mistral-7B bf16 load of 15.9 GB on one 16 GB Inf2 core failed with RESOURCE_EXHAUSTED, while tp=2
(about 8 GB per core) works.

**Valid degrees.** A degree is valid when it is supported by the platform (Inf2 {1, 2, 4, 8, 24},
Trn1 {1, 2, 8, 16, 32}, Trn2 LNC=2 {1, 2, 4, ..., 64}, LNC=1 up to 128; CPU / GPU any degree), is not
larger than the cores available, the heads can be laid out (see above), and the memory fits.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..core.neuron import TP_DEGREES
from ..options import options_from

GB = 10**9
DEFAULT_MEMORY_FRACTION = 0.9
DEFAULT_GPU_COUNT = 8           # one node, when --cores is not given for a GPU platform


# ----------------------------------------------------------------------------------------------
# Platforms
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Platform:
    """Where the model runs: memory per core, the tp degrees the platform supports, cores available."""

    name: str                          # "inf2", "trn1", "trn2", "cpu", "gpu"
    bytes_per_core: int                # device memory of one (logical) core; CPU: host RAM
    degrees: tuple[int, ...] | None    # tp degrees the platform supports; None = any degree <= cores
    cores: int                         # cores (world size) available
    lnc: int | None = None             # Trn2 logical NeuronCore config
    shared_memory: bool = False        # CPU: all ranks share one pool (tp × per-rank must fit)
    instance: str | None = None        # e.g. "trn1.32xlarge" when given by instance name

    @property
    def label(self) -> str:
        s = self.instance or self.name
        if self.lnc is not None:
            s += f" (LNC={self.lnc})"
        return s

    def candidate_degrees(self) -> list[int]:
        """Degrees the report lists: the supported ones plus the powers of two up to the largest
        (so that e.g. tp=4 on Trn1 shows up as unsupported); CPU / GPU: powers of two up to the
        core count, and the core count."""
        if self.degrees is None:
            return sorted({2**i for i in range(self.cores.bit_length()) if 2**i <= self.cores} | {self.cores})
        top = max(self.degrees)
        return sorted(set(self.degrees) | {2**i for i in range(top.bit_length()) if 2**i <= top})


@dataclass(frozen=True)
class _NeuronFamily:
    bytes_per_core: int
    degrees: tuple[int, ...]
    max_cores: int
    instances: dict[str, int]          # instance -> NeuronCores


# Per-core memory (the Neuron docs: transformers-neuronx developer guide, NxD Inference, Trn2 LNC
# pages) and supported degrees (``core.neuron.TP_DEGREES``, which the neuron backend checks). Core
# counts: the EC2 instance pages.
_NEURON: dict[tuple[str, int], _NeuronFamily] = {
    ("inf2", 1): _NeuronFamily(16 * GB, TP_DEGREES[("inf2", 1)], 24,
                               {"inf2.xlarge": 2, "inf2.8xlarge": 2, "inf2.24xlarge": 12, "inf2.48xlarge": 24}),
    ("trn1", 1): _NeuronFamily(16 * GB, TP_DEGREES[("trn1", 1)], 32,
                               {"trn1.2xlarge": 2, "trn1.32xlarge": 32, "trn1n.32xlarge": 32}),
    ("trn2", 2): _NeuronFamily(24 * GB, TP_DEGREES[("trn2", 2)], 64,
                               {"trn2.3xlarge": 4, "trn2.48xlarge": 64}),
    ("trn2", 1): _NeuronFamily(12 * GB, TP_DEGREES[("trn2", 1)], 128,
                               {"trn2.3xlarge": 8, "trn2.48xlarge": 128}),
}
_DEFAULT_LNC = {"inf2": 1, "trn1": 1, "trn2": 2}
_INSTANCES = {inst: fam for (fam, _), f in _NEURON.items() for inst in f.instances}
PLATFORM_HELP = ("inf2, trn1, trn2 (with lnc=1 or 2), an instance name such as inf2.48xlarge or "
                 "trn1.32xlarge, cpu, cpu:<GB of host RAM>, or gpu:<GB per GPU> (e.g. gpu:80)")


def _parse_size(text: str, what: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gb|gib)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{what}: expected a positive memory size such as 80, 80GB or 80GiB, got {text!r}")
    unit = 2**30 if (m.group(2) or "").lower() == "gib" else GB
    return int(float(m.group(1)) * unit)


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_platform(platform: str, *, cores: int | None = None, lnc: int | None = None) -> Platform:
    """Parse ``platform`` (see :data:`PLATFORM_HELP`) with the cores available and, on Trn2, the LNC."""
    if not isinstance(platform, str) or not platform.strip():
        raise ValueError(f"platform={platform!r} is not known; use {PLATFORM_HELP}")
    spec = platform.strip().lower()
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise ValueError(f"cores must be an integer >= 1 (the cores available), got {cores!r}")
    family, instance = (_INSTANCES[spec], spec) if spec in _INSTANCES else (spec, None)

    if family in _DEFAULT_LNC:
        lnc_value = _DEFAULT_LNC[family] if lnc is None else lnc
        if (family, lnc_value) not in _NEURON:
            allowed = sorted(v for (f, v) in _NEURON if f == family)
            raise ValueError(f"lnc={lnc!r} is not available on {family}; use {' or '.join(map(str, allowed))}"
                             + ("" if family == "trn2" else " (logical NeuronCores with LNC=2 exist on Trn2 only)"))
        fam = _NEURON[(family, lnc_value)]
        limit, where = (fam.instances[instance], instance) if instance else (fam.max_cores, f"any {family} instance")
        if cores is not None and cores > limit:
            raise ValueError(f"cores={cores} exceeds the {limit} NeuronCores of {where}"
                             + (f" at LNC={lnc_value}" if family == "trn2" else ""))
        return Platform(family, fam.bytes_per_core, fam.degrees, cores or limit,
                        lnc=lnc_value if family == "trn2" else None, instance=instance)

    if lnc is not None:
        raise ValueError(f"lnc={lnc!r} only applies to trn2 (logical NeuronCores), not to {platform!r}")
    if family == "cpu" or family.startswith("cpu:"):
        memory = _parse_size(family[4:], "cpu:<GB>") if family.startswith("cpu:") else _host_memory_bytes()
        return Platform("cpu", memory, None, cores or os.cpu_count() or 1, shared_memory=True)
    if family.startswith("gpu:"):
        return Platform("gpu", _parse_size(family[4:], "gpu:<GB>"), None, cores or DEFAULT_GPU_COUNT)
    if family == "gpu":
        raise ValueError("platform='gpu' needs the memory of one GPU: gpu:<GB>, e.g. gpu:80 or gpu:24GiB")
    raise ValueError(f"platform={platform!r} is not known; use {PLATFORM_HELP}")


# ----------------------------------------------------------------------------------------------
# Model footprint from config.json
# ----------------------------------------------------------------------------------------------

def load_hf_config(config: Any):
    """A ``transformers`` config from a ``config.json`` path, a checkpoint directory, a dict (with
    ``model_type``) or a config object."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, Mapping):
        d = dict(config)
        model_type = d.pop("model_type", None)
        if model_type is None:
            raise ValueError("a config dict needs 'model_type' (e.g. 'llama', 'opt', 'gpt2')")
        if model_type not in CONFIG_MAPPING:
            raise ValueError(f"model_type={model_type!r} is not known to transformers")
        return CONFIG_MAPPING[model_type].from_dict(d)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir() and not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist (expected a config.json or a checkpoint directory)")
        return AutoConfig.from_pretrained(path)
    raise TypeError(f"config must be a path, a dict or a transformers config, got {type(config).__name__}")


@dataclass(frozen=True)
class ModelFootprint:
    """Parameter counts of one model, grouped by how tensor parallelism splits them.

    For the architectures the runtime runs (``runtime_gqa``), the attention projections are counted
    per head (``q_elems_per_head``: q_proj + o_proj weights and the q bias of one query head, over all
    layers; ``kv_elems_per_head``: k_proj + v_proj of one KV head) because GQA layouts replicate or pad
    heads; for the others they are part of ``matrix_shapes``.
    """

    name: str
    model_type: str
    runtime_gqa: bool
    num_parameters: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int | None
    sliding_window: int | None
    q_elems_per_head: int
    kv_elems_per_head: int
    matrix_shapes: tuple[tuple[int, int], ...]     # (split dimension, the rest) of other 2-D weights
    embedding_shapes: tuple[tuple[int, int], ...]  # (vocab or positions, hidden): embeddings, LM head
    vector_elems: int
    lm_head_rows: int = 0                          # the LM head's vocabulary rows (0: no LM head)
    tied_lm_head: bool = False                     # the LM head is the input embedding's table

    def layout(self, tp_degree: int, gqa_strategy: str | None = None):
        """The runtime's head layout at ``tp_degree`` (None for reference architectures)."""
        if not self.runtime_gqa:
            return None
        from ..core.tp_layout import head_layout
        return head_layout(self.num_heads, self.num_kv_heads, tp_degree, gqa_strategy)

    def weight_elems_per_core(self, tp_degree: int, q_heads: int, kv_heads: int, *,
                              replicate_embeddings: bool = False) -> int:
        """Weights one core holds with ``q_heads`` / ``kv_heads`` head slots (padding included)."""
        from ..core.parallel import per_rank
        attention = q_heads * self.q_elems_per_head + kv_heads * self.kv_elems_per_head

        def split(shapes):
            return sum(per_rank(rows, tp_degree) * rest for rows, rest in shapes)

        matrices = split(self.matrix_shapes)
        embeddings = sum(r * c for r, c in self.embedding_shapes) if replicate_embeddings else \
            split(self.embedding_shapes)
        return attention + matrices + embeddings + self.vector_elems

    def weight_bytes_per_core(self, tp_degree: int, q_heads: int, kv_heads: int, nbytes: int, *,
                              quantization: str | None = None, replicate_embeddings: bool = False) -> int:
        """Bytes of one core's weights at ``nbytes`` per element; with ``quantization`` ("int8", "int4")
        the attention and other weight matrices as ``specdec.core.quant`` stores them (int8: 1 byte and a
        scale per output row; int4: half a byte and a scale and zero per 32 weights) and the LM head in
        int8 (a tied embedding's table stays beside it), embeddings and vectors at ``nbytes``."""
        total = self.weight_elems_per_core(tp_degree, q_heads, kv_heads, replicate_embeddings=replicate_embeddings)
        if quantization is None:
            return total * nbytes
        from ..core.config import quantized_bytes
        from ..core.parallel import per_rank
        quantized = q_heads * self.q_elems_per_head + kv_heads * self.kv_elems_per_head + \
            sum(per_rank(rows, tp_degree) * rest for rows, rest in self.matrix_shapes)
        out_rows = self.num_layers * ((q_heads + 2 * kv_heads) * self.head_dim + self.hidden_size) + \
            sum(per_rank(rows, tp_degree) for rows, _ in self.matrix_shapes)
        head_rows = self.lm_head_rows if replicate_embeddings else per_rank(self.lm_head_rows, tp_degree)
        float_head = 0 if self.tied_lm_head else head_rows * self.hidden_size
        return quantized_bytes(quantized, out_rows, nbytes, quantization) + \
            quantized_bytes(head_rows * self.hidden_size, head_rows, nbytes, "int8") + \
            (total - quantized - float_head) * nbytes

    def kv_elems(self, batch_size: int, n_positions: int, kv_heads: int | None = None) -> int:
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return 2 * self.num_layers * batch_size * n_positions * heads * self.head_dim

    def kv_bytes(self, batch_size: int, n_positions: int, nbytes: int, kv_cache_dtype: str | None = None,
                 kv_heads: int | None = None) -> int:
        """Bytes of the KV cache (``kv_heads`` per core, default all): ``nbytes`` per element, or with
        ``kv_cache_dtype`` 1 byte per element + a 4-byte scale per (slot, head) (``kv_quant.kv_cache_bytes``)."""
        from ..core.kv_quant import kv_cache_bytes
        return kv_cache_bytes(self.kv_elems(batch_size, n_positions, kv_heads), self.head_dim, nbytes, kv_cache_dtype)


_FOOTPRINTS: dict[str, ModelFootprint] = {}
_EMBEDDING_MODULES = {"embed_tokens", "embed_positions", "wte", "wpe", "lm_head", "embed_out", "word_embeddings"}


def model_footprint(config: Any) -> ModelFootprint:
    """Count the parameters of ``config`` (a path, dict or transformers config) on the meta device."""
    from transformers import AutoModelForCausalLM

    from ..core.config import SUPPORTED_MODEL_TYPES

    hf = load_hf_config(config)
    key = json.dumps(hf.to_dict(), sort_keys=True, default=str)
    if key in _FOOTPRINTS:
        return _FOOTPRINTS[key]
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
    except ValueError as e:
        raise ValueError(f"model_type={hf.model_type!r}: transformers has no causal-LM model for it ({e})") from None

    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    runtime_gqa = hf.model_type in SUPPORTED_MODEL_TYPES
    draft_vocab = getattr(hf, "draft_vocab_size", None)   # specdec drafts: reduced LM head

    q_per_head = kv_per_head = vectors = total = 0
    matrices: list[tuple[int, int]] = []
    embeddings: list[tuple[int, int]] = []
    for name, p in model.named_parameters():                  # unique: tied weights once
        n = p.numel()
        parts = name.split(".")
        if draft_vocab and parts[-2:] == ["lm_head", "weight"]:
            n = draft_vocab * p.shape[1]
        total += n
        proj = parts[-2] if len(parts) >= 3 and parts[-3] == "self_attn" else None
        if runtime_gqa and proj in ("q_proj", "o_proj") and not (proj == "o_proj" and parts[-1] == "bias"):
            q_per_head += n // heads
        elif runtime_gqa and proj in ("k_proj", "v_proj"):
            kv_per_head += n // kv_heads
        elif p.dim() == 1:
            vectors += n
        else:
            rows = max(p.shape[0], p.shape[1]) if parts[-2:] != ["lm_head", "weight"] or not draft_vocab \
                else draft_vocab
            shape = (rows, n // rows)                         # split along the larger dimension
            (embeddings if any(part in _EMBEDDING_MODULES for part in parts) else matrices).append(shape)
    name = str(getattr(hf, "_name_or_path", "") or hf.model_type)
    name = name[:-len("/config.json")] if name.endswith("/config.json") else name
    fp = ModelFootprint(
        name=str(name), model_type=hf.model_type, runtime_gqa=runtime_gqa, num_parameters=total,
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=hf.vocab_size,
        max_position_embeddings=getattr(hf, "max_position_embeddings", None),
        sliding_window=getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None,
        q_elems_per_head=q_per_head, kv_elems_per_head=kv_per_head, matrix_shapes=tuple(matrices),
        embedding_shapes=tuple(embeddings), vector_elems=vectors,
        lm_head_rows=(draft_vocab or hf.vocab_size) if model.get_output_embeddings() is not None else 0,
        tied_lm_head=bool(getattr(hf, "tie_word_embeddings", False)) and not draft_vocab)
    assert q_per_head * heads + kv_per_head * kv_heads + vectors + \
        sum(r * c for r, c in matrices + embeddings) == total
    _FOOTPRINTS[key] = fp
    return fp


# ----------------------------------------------------------------------------------------------
# Request, report
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CapacityRequest:
    """What to plan for (validated by :func:`plan_capacity`)."""

    batch_size: int
    n_positions: int
    amp: str
    platform: str
    cores: int | None = None
    lnc: int | None = None
    k: int = 0
    tp_degree: int | None = None          # None: consider every candidate degree
    draft_tp_degree: int | None = None    # None: the target's degree
    gqa_strategy: str | None = None       # runtime architectures only; None = automatic
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    replicate_embeddings: bool = False    # True: embeddings / LM head whole on every core
    quantization: str | None = None       # "int8" / "int4": weight-only projections (DecoderModel's option)
    kv_cache_dtype: str | None = None     # "int8" / "fp8_e4m3": 8-bit KV cache + scales (DecoderModel's option)


@dataclass(frozen=True)
class DegreeReport:
    """One tensor-parallel degree: per-core bytes (fullest core) and why it is or is not usable."""

    tp_degree: int
    valid: bool                            # every check passed: this degree can be used
    supported: bool                        # the platform supports this degree
    within_cores: bool                     # tp_degree <= cores available
    heads_ok: bool                         # target (and draft) heads can be laid out at this degree
    fits_memory: bool | None               # None when the heads cannot be laid out
    reasons: tuple[str, ...]               # why not (empty when valid)
    q_heads_per_core: int | None
    kv_heads_per_core: int | None
    gqa_strategy: str | None
    weight_bytes_per_core: int | None
    kv_bytes_per_core: int | None
    draft_bytes_per_core: int              # draft weights + KV on the fullest core (0 without a draft)
    total_bytes_per_core: int | None


@dataclass(frozen=True)
class ModelSummary:
    name: str
    model_type: str
    num_parameters: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int                      # all weights, unsharded
    kv_bytes: int                          # the whole KV cache, unsharded

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class CapacityPlan:
    """The planner's answer; ``smallest_fitting_tp`` is None when nothing fits."""

    request: CapacityRequest
    platform: Platform
    dtype_bytes: int
    model: ModelSummary
    draft: ModelSummary | None
    usable_bytes_per_core: int
    degrees: tuple[DegreeReport, ...]
    smallest_fitting_tp: int | None
    notes: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return self.smallest_fitting_tp is not None

    def degree(self, tp_degree: int) -> DegreeReport:
        for d in self.degrees:
            if d.tp_degree == tp_degree:
                return d
        raise KeyError(f"tp_degree={tp_degree} is not in this plan ({[d.tp_degree for d in self.degrees]})")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"]["total_bytes"] = self.model.total_bytes
        if self.draft is not None:
            d["draft"]["total_bytes"] = self.draft.total_bytes
        d["platform"]["label"] = self.platform.label
        d["fits"] = self.fits
        return d

    def format_table(self) -> str:
        return format_plan(self)


class NoFitError(ValueError):
    """Nothing fits; ``plan`` holds the full report (every degree and why it fails)."""

    def __init__(self, message: str, plan: CapacityPlan):
        super().__init__(message)
        self.plan = plan


# ----------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------

def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_degree_allowed(what: str, tp: Any, platform: Platform) -> None:
    _check_int(what, tp, 1)
    if platform.degrees is not None and tp not in platform.degrees:
        raise ValueError(f"{what}={tp} is not supported on {platform.label}; supported tensor-parallel degrees: "
                         f"{', '.join(map(str, platform.degrees))}")
    if tp > platform.cores:
        raise ValueError(f"{what}={tp} exceeds the {platform.cores} cores available (world size; cores="
                         f"{platform.cores}); use a degree <= {platform.cores} or more cores")


def _dtype_bytes(amp: Any) -> int:
    from ..core.config import amp_dtype
    return torch.finfo(amp_dtype(amp)).bits // 8


def _summary(fp: ModelFootprint, req: CapacityRequest, nbytes: int) -> ModelSummary:
    weights = fp.num_parameters * nbytes if req.quantization is None else \
        fp.weight_bytes_per_core(1, fp.num_heads, fp.num_kv_heads, nbytes, quantization=req.quantization)
    return ModelSummary(fp.name, fp.model_type, fp.num_parameters, fp.num_layers, fp.num_heads, fp.num_kv_heads,
                        fp.head_dim, weights, fp.kv_bytes(req.batch_size, req.n_positions, nbytes, req.kv_cache_dtype))


def _per_core(fp: ModelFootprint, tp: int, req: CapacityRequest, nbytes: int, strategy: str | None):
    """(q heads, kv heads, layout strategy, weight bytes, kv bytes) per core, or the layout error."""
    try:
        lay = fp.layout(tp, strategy)
    except ValueError as e:
        return str(e)
    if lay is not None:
        q, kv = lay.q_per_rank, lay.kv_per_rank
    else:   # reference architectures: heads divide tp (else _head_reasons rejects the degree)
        q, kv = math.ceil(fp.num_heads / tp), math.ceil(fp.num_kv_heads / tp)
    weights = fp.weight_bytes_per_core(tp, q, kv, nbytes, quantization=req.quantization,
                                       replicate_embeddings=req.replicate_embeddings)
    return q, kv, (lay.strategy.value if lay is not None else None), weights, \
        fp.kv_bytes(req.batch_size, req.n_positions, nbytes, req.kv_cache_dtype, kv)


def _head_reasons(fp: ModelFootprint, tp: int, who: str) -> list[str]:
    """The reference rule for architectures the runtime does not run: heads divisible by tp."""
    if fp.runtime_gqa:
        return []
    out = []
    if fp.num_heads % tp:
        out.append(f"{who}{fp.num_heads} attention heads are not divisible by tp={tp} "
                   f"({fp.model_type} is not padded: only the runtime's llama/mistral/qwen2 layouts pad heads)")
    elif fp.num_kv_heads % tp:
        out.append(f"{who}{fp.num_kv_heads} KV heads are not divisible by tp={tp}")
    return out


def _gb(n: int | float | None) -> str:
    return "-" if n is None else f"{n / GB:.2f} GB"


def _evaluate(tp: int, target: ModelFootprint, draft: ModelFootprint | None, req: CapacityRequest,
              platform: Platform, nbytes: int, usable: int) -> DegreeReport:
    reasons: list[str] = []
    supported = platform.degrees is None or tp in platform.degrees
    if not supported:
        allowed = ", ".join(map(str, platform.degrees))
        reasons.append(f"not a supported degree on {platform.name} (supported: {allowed})")
    within_cores = tp <= platform.cores
    if not within_cores:
        reasons.append(f"needs {tp} cores, {platform.cores} available")
    head_reasons = _head_reasons(target, tp, "")
    t = _per_core(target, tp, req, nbytes, req.gqa_strategy)
    if isinstance(t, str):
        reasons += head_reasons + [t]
        return DegreeReport(tp, False, supported, within_cores, False, None, tuple(reasons), None, None,
                            req.gqa_strategy, None, None, 0, None)
    q, kv, strategy, weights, kv_bytes = t

    draft_bytes = 0
    layout_ok = True
    if draft is not None:
        dtp = req.draft_tp_degree or tp
        if dtp not in (1, tp):
            head_reasons.append(f"draft tp_degree={dtp} is neither 1 (replicated) nor the target's tp={tp}")
        head_reasons += _head_reasons(draft, dtp, "draft: ")
        d = _per_core(draft, dtp, req, nbytes, None)
        if isinstance(d, str):
            head_reasons.append(f"draft: {d}")
            layout_ok = False
        else:
            draft_bytes = d[3] + d[4]
    reasons += head_reasons
    total = weights + kv_bytes + draft_bytes
    fits = None
    if layout_ok:
        if platform.shared_memory:
            fits = tp * total <= usable
            if not fits:
                reasons.append(f"{tp} ranks × {_gb(total)} = {_gb(tp * total)} > {_gb(usable)} usable host memory")
        else:
            fits = total <= usable
            if not fits:
                reasons.append(f"{_gb(total)} per core > {_gb(usable)} usable "
                               f"({_gb(platform.bytes_per_core)} × {req.memory_fraction:g})")
    return DegreeReport(tp, not reasons, supported, within_cores, not head_reasons, fits, tuple(reasons), q, kv,
                        strategy, weights, kv_bytes, draft_bytes, total)


def plan_capacity(config: Any, *, batch_size: int, n_positions: int, amp: str, platform: str,
                  cores: int | None = None, lnc: int | None = None, draft_config: Any = None, k: int = 0,
                  tp_degree: int | None = None, draft_tp_degree: int | None = None,
                  gqa_strategy: str | None = None, memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                  replicate_embeddings: bool = False, quantization: str | None = None,
                  kv_cache_dtype: str | None = None, require_fit: bool = True) -> CapacityPlan:
    """Plan memory for ``config`` (a ``config.json`` path, checkpoint directory, dict or transformers
    config) and an optional ``draft_config`` on ``platform`` (see :data:`PLATFORM_HELP`).

    Reports weight and KV bytes, and for each candidate tensor-parallel degree (or only ``tp_degree``)
    the bytes per core, whether it is valid and why not; ``smallest_fitting_tp`` is the smallest valid
    degree. ``quantization`` / ``kv_cache_dtype``: weights / KV cache as ``DecoderModel.from_pretrained``
    stores them with those options. The formulas and the capacity rule are in this module's docstring.

    Raises ``ValueError`` for bad input (batch_size / n_positions < 1, unknown amp or platform,
    tp_degree < 1, not supported on the platform or larger than ``cores``, ...), and
    :class:`NoFitError` (a ``ValueError`` carrying the plan) when no degree fits and ``require_fit``.
    """
    from ..core.kv_quant import parse_kv_cache_dtype
    from ..core.quant import parse_quantization
    from ..core.tp_layout import parse_gqa

    _check_int("batch_size", batch_size, 1)
    _check_int("n_positions", n_positions, 1)
    _check_int("k", k, 0)
    if k >= n_positions:
        raise ValueError(f"k={k} draft tokens per step must be smaller than n_positions={n_positions}")
    if draft_config is not None and k == 0:
        raise ValueError("k must be >= 1 (draft tokens per step) when a draft config is given")
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) \
            or not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    nbytes = _dtype_bytes(amp)
    strategy = parse_gqa(gqa_strategy)
    plat = resolve_platform(platform, cores=cores, lnc=lnc)
    if tp_degree is not None:
        _check_degree_allowed("tp_degree", tp_degree, plat)
    if draft_tp_degree is not None:
        if draft_config is None:
            raise ValueError("draft_tp_degree is given but there is no draft_config")
        _check_degree_allowed("draft_tp_degree", draft_tp_degree, plat)
        if tp_degree is not None and draft_tp_degree not in (1, tp_degree):
            raise ValueError(f"draft_tp_degree={draft_tp_degree} is not supported with tp_degree={tp_degree}: a "
                             f"draft is replicated (1) or sharded like the target ({tp_degree})")

    if parse_quantization(quantization) == "gguf":
        raise ValueError("the planner counts quantization='int8' or 'int4'; a GGUF file's own mix of block types "
                         "is not modelled (plan a Q4_0 / Q4_1 file as 'int4')")
    req = CapacityRequest(batch_size, n_positions, str(amp), platform, cores, lnc, k, tp_degree, draft_tp_degree,
                          strategy.value if strategy else None, float(memory_fraction), replicate_embeddings,
                          parse_quantization(quantization), parse_kv_cache_dtype(kv_cache_dtype))
    target = model_footprint(config)
    draft = model_footprint(draft_config) if draft_config is not None else None
    usable = int(plat.bytes_per_core * memory_fraction)

    notes = []
    for who, fp in (("model", target), ("draft", draft)):
        if fp is None:
            continue
        if fp.max_position_embeddings and n_positions > fp.max_position_embeddings:
            notes.append(f"{who}: n_positions={n_positions} exceeds max_position_embeddings="
                         f"{fp.max_position_embeddings}")
        if fp.runtime_gqa and fp.sliding_window and n_positions > fp.sliding_window:
            notes.append(f"{who}: n_positions={n_positions} exceeds sliding_window={fp.sliding_window}; the "
                         "runtime does not implement sliding-window attention")
        if not fp.runtime_gqa:
            notes.append(f"{who}: model_type {fp.model_type!r} is not run by specdec's runtime; planned with the "
                         "reference rule (heads divisible by tp, no padding)")
    if draft is not None and draft.vocab_size != target.vocab_size:
        notes.append(f"draft vocab_size={draft.vocab_size} differs from the target's {target.vocab_size}: "
                     "speculation needs the same tokenizer")
    if strategy is not None and not target.runtime_gqa:
        notes.append(f"gqa_strategy is ignored for {target.model_type!r}")

    everything = [_evaluate(tp, target, draft, req, plat, nbytes, usable) for tp in plat.candidate_degrees()]
    degrees = [d for d in everything if d.tp_degree == tp_degree] if tp_degree is not None else everything
    if tp_degree is not None and not degrees:
        degrees = [_evaluate(tp_degree, target, draft, req, plat, nbytes, usable)]
    fitting = [d.tp_degree for d in degrees if d.valid]
    plan = CapacityPlan(req, plat, nbytes, _summary(target, req, nbytes),
                        _summary(draft, req, nbytes) if draft is not None else None, usable,
                        tuple(degrees), min(fitting) if fitting else None, tuple(notes))
    if require_fit and not plan.fits:
        raise NoFitError(_no_fit_message(plan, everything), plan)
    return plan


def _no_fit_message(plan: CapacityPlan, everything: list[DegreeReport]) -> str:
    req, plat = plan.request, plan.platform
    what = f"{plan.model.name}" + (f" + draft {plan.draft.name}" if plan.draft else "")
    head = (f"tp_degree={req.tp_degree} does not fit" if req.tp_degree is not None else "nothing fits") + \
        f": {what} at batch_size={req.batch_size}, n_positions={req.n_positions}, amp={req.amp} on {plat.label}"
    lines = [head]
    if req.tp_degree is not None:
        lines += [f"  {r}" for r in plan.degrees[0].reasons]
    else:
        usable_here = [d for d in everything if d.supported and d.within_cores and d.heads_ok]
        if usable_here:
            best = usable_here[-1]
            lines.append(f"  the largest usable degree, tp={best.tp_degree}, needs {_gb(best.total_bytes_per_core)} "
                         f"per core; usable per core: {_gb(plan.usable_bytes_per_core)}")
        else:
            lines.append(f"  no degree up to the {plat.cores} cores available is supported with these heads")
    suggestions = []
    other = [d for d in everything if d.valid and d.tp_degree != req.tp_degree]
    if other:
        return "\n".join(lines + [f"suggestion: use tp_degree={other[0].tp_degree} "
                                  f"({_gb(other[0].total_bytes_per_core)} per core)"])
    more_cores = [d for d in everything if d.fits_memory and d.supported and d.heads_ok and not d.within_cores]
    if more_cores:
        tp = more_cores[0].tp_degree
        inst = ""
        if plat.degrees is not None:
            fam = _NEURON[(plat.name, plat.lnc or 1)]
            fitting = sorted((c, i) for i, c in fam.instances.items() if c >= tp)
            inst = f", e.g. {fitting[0][1]}" if fitting else ""
        suggestions.append(f"a larger platform: tp={tp} fits with {tp} cores "
                           f"({_gb(more_cores[0].total_bytes_per_core)} per core{inst})")
    else:
        suggestions.append("a larger platform (more memory per core or more cores)")
    kv_share = plan.model.kv_bytes + (plan.draft.kv_bytes if plan.draft else 0)
    suggestions.append(f"fewer positions or a smaller batch (n_positions={req.n_positions}, batch_size="
                       f"{req.batch_size}: the KV cache is {_gb(kv_share)} in all)")
    if plan.dtype_bytes > 2:
        suggestions.append("a lower-precision amp: bf16 halves weights and KV cache")
    if req.kv_cache_dtype is None:
        suggestions.append("an 8-bit KV cache (kv_cache_dtype int8 or fp8_e4m3: 1 byte per element + scales)")
    return "\n".join(lines + ["suggestions: " + "; ".join(suggestions)])


# ----------------------------------------------------------------------------------------------
# Output, command line
# ----------------------------------------------------------------------------------------------

def format_plan(plan: CapacityPlan) -> str:
    """A readable report: the model(s), the platform, one row per degree, the answer."""
    req, plat = plan.request, plan.platform
    projections = f", {req.quantization} projections" if req.quantization else ""
    kv_format = f"{req.kv_cache_dtype} + scales, " if req.kv_cache_dtype else ""
    out = []
    for who, m in (("model", plan.model), ("draft", plan.draft)):
        if m is None:
            continue
        heads = f"{m.num_heads} heads" + (f" / {m.num_kv_heads} KV" if m.num_kv_heads != m.num_heads else "")
        out.append(f"{who}: {m.name} ({m.model_type}, {m.num_parameters / 1e9:.3f} B parameters, {m.num_layers} "
                   f"layers, {heads})")
        out.append(f"  weights {_gb(m.weight_bytes)} ({req.amp}{projections}) + KV cache {_gb(m.kv_bytes)} "
                   f"({kv_format}batch {req.batch_size} × {req.n_positions} positions) = {_gb(m.total_bytes)}")
    if plan.draft is not None:
        out.append(f"speculation: k={req.k}; draft tp_degree: "
                   f"{req.draft_tp_degree if req.draft_tp_degree else 'same as the target'}")
    mem = "host memory shared by all ranks" if plat.shared_memory else "per core"
    out.append(f"platform: {plat.label}, {plat.cores} cores available, {_gb(plat.bytes_per_core)} {mem}, usable "
               f"{_gb(plan.usable_bytes_per_core)} ({req.memory_fraction:.0%})")
    cols = ["tp", "q/kv heads per core", "weights/core", "KV/core"] + (["draft/core"] if plan.draft else []) + \
        ["total/core", "result"]
    rows = []
    for d in plan.degrees:
        heads = "-" if d.q_heads_per_core is None else f"{d.q_heads_per_core}/{d.kv_heads_per_core}"
        row = [str(d.tp_degree), heads, _gb(d.weight_bytes_per_core), _gb(d.kv_bytes_per_core)]
        if plan.draft:
            row.append(_gb(d.draft_bytes_per_core))
        row += [_gb(d.total_bytes_per_core), "fits" if d.valid else "no: " + "; ".join(d.reasons)]
        rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols[:-1])]

    def fmt(r):
        return "  ".join(v.rjust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1]

    out += ["", fmt(cols), *(fmt(r) for r in rows), ""]
    out.append(f"smallest fitting tp_degree: {plan.smallest_fitting_tp}" if plan.fits
               else "smallest fitting tp_degree: none")
    out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a config.json, or a checkpoint directory containing one")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--n-positions", type=int, default=2048, help="KV-cache length (prompt + new tokens + k)")
    p.add_argument("--amp", default="bf16", help="weights/KV dtype: f32, bf16 or f16")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="weight-only quantized projections (from_pretrained(quantization=...)): int8 1 byte, "
                        "int4 half a byte per weight; the LM head int8 under both")
    p.add_argument("--kv-cache-dtype", default=None, choices=["int8", "fp8_e4m3"],
                   help="8-bit KV cache (from_pretrained(kv_cache_dtype=...)): 1 byte per element + a 4-byte "
                        "scale per (slot, KV head)")
    p.add_argument("--platform", required=True, help=PLATFORM_HELP)
    p.add_argument("--cores", type=int, default=None,
                   help="cores available (world size); default: the largest instance / all CPUs / 8 GPUs")
    p.add_argument("--lnc", type=int, default=None, help="Trn2 logical NeuronCore config (1 or 2; default 2)")
    p.add_argument("--tp-degree", type=int, default=None, help="check only this degree")
    p.add_argument("--draft-config", default=None, help="the draft's config.json or checkpoint directory")
    p.add_argument("--draft-tp-degree", type=int, default=None, help="default: the target's degree")
    p.add_argument("--k", type=int, default=0, help="draft tokens per step")
    p.add_argument("--gqa-strategy", default=None, help="replicate-to-tp-degree or convert-to-mha (default: automatic)")
    p.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION,
                   help="usable share of each core's memory (default 0.9: the rest is the runtime's)")
    p.add_argument("--replicate-embeddings", action="store_true",
                   help="embeddings and LM head whole on every core (default: vocab-parallel)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


@dataclass(frozen=True)
class PlanOptions:
    """``specdec plan``: the target's ``config`` (a config.json or a checkpoint directory), the ``request``, the
    draft's ``draft_config`` (None: no draft) and ``json`` (print the plan as JSON, else as a table)."""

    config: str
    request: CapacityRequest
    draft_config: str | None = None
    json: bool = False


def run(options: PlanOptions) -> int:
    """``specdec plan``: print the plan; exit 0 if something fits, 2 if nothing does or the input is bad."""
    def plan_for(request: CapacityRequest) -> CapacityPlan:
        return plan_capacity(options.config, draft_config=options.draft_config, require_fit=False, **asdict(request))

    try:
        plan = plan_for(options.request)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"specdec plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if options.json else plan.format_table())
    if not plan.fits:
        everything = plan.degrees
        if plan.request.tp_degree is not None:     # suggestions consider every degree
            everything = plan_for(replace(options.request, tp_degree=None)).degrees
        print(f"specdec plan: {_no_fit_message(plan, list(everything))}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec plan", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(options_from(PlanOptions, parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
