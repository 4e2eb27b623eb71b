"""Loading: ``RuntimeSettings`` and a decoder built from a checkpoint (``load_decoder``), or one rank's
weights read again for the Neuron program (``rank_weights``).

``load_decoder`` takes the settings as a caller asked for them, validates and normalizes them (backend
device, quantization / KV-cache dtype / GQA names, feature layers checked against the config) and returns
them with the module: a ``DecoderLM`` in eval mode, without gradients, on ``settings.device`` in ``amp``'s
dtype, holding this rank's shards (tp_degree > 1), with a KV cache of [batch_size, kv heads per rank,
n_positions, head_dim] per layer and no graph built yet.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch

from .block_layer import use_block_layers
from .block_linear import add_prompt_weights
from .checkpoint import load_weights, mapped_tensor
from .config import ModelConfig, amp_dtype
from .gguf_weights import load_gguf_blocks
from .graphs import BACKENDS, backend_device
from .huge_pages import move_to_huge_pages
from .kv_quant import parse_kv_cache_dtype
from .model import DecoderLM, check_feature_layers, check_output_vocab_size
from .named_models import GGML_BLOCK_QUANTIZATIONS, preset_of
from .parallel import shard_plan, spmd_group, tp_group
from .paths import gguf_source, resolve_model_path
from .quant import parse_quantization, quantize_and_fuse
from .sampling import SamplingConfig
from .tp_layout import head_layout, parse_gqa

RANK = frozenset({"tp_rank"})   # the rank as a parameter (neuron, tp > 1): not in checkpoints
AUTO = "auto"                   # amp / backend / quantization: the model's default (``resolve_auto``)
OFF_CPU_BACKENDS = ("xla", "neuron")    # backends whose programs do not run the block kernels (CPU kernels)


@dataclass
class RuntimeSettings:
    """Everything that fixes the compiled shapes (saved with compiled artifacts). The field names are
    ``DecoderModel.from_pretrained``'s keyword arguments (``asdict`` of them reloads a model)."""

    batch_size: int = 1
    n_positions: int = 2048
    amp: str = "f32"
    tp_degree: int = 1
    gqa_strategy: str | None = None
    context_buckets: list[int] | None = None
    kv_buckets: list[int] | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    backend: str = "compiled"
    device: str = "cpu"
    quantization: str | None = None
    kv_cache_dtype: str | None = None      # None: the compute dtype; "int8" / "fp8_e4m3" (``kv_quant``)
    feature_layers: tuple[int, ...] = ()   # layers whose input hidden states graphs also return (EAGLE-3)
    autotune: bool = False                 # compiled, CPU: weights frozen in, kernels chosen by timing
    output_vocab_size: int | None = None   # score only token ids [0, n) (``DecoderLM.restrict_output_vocab``)
    saved_graphs: bool = False             # compiled, CPU: graphs compiled ahead of time into files (``saved_graphs``)
    prompt_weights: str | None = None      # "bf16": GGML blocks also dense in bf16 for prompts (``block_linear``)
    prefix_cache: bool = False             # a prompt's encoding keeps the KV its row already holds (``prefill``)
    prefix_cache_mb: int = 1024            # prefix_cache: host memory for the prefixes rows give up (``prefix_store``)


class LoadedDecoder(NamedTuple):
    """What ``load_decoder`` built: the checkpoint directory (a GGUF file's converted one), what a saved
    model reloads from (that directory, or the GGUF file), the config (its output vocabulary restricted
    when asked), the module and the normalized settings."""

    path: Path
    source: Path
    config: ModelConfig
    lm: DecoderLM
    settings: RuntimeSettings


def load_decoder(path: str | Path | None, requested: RuntimeSettings, progress: bool) -> LoadedDecoder:
    """Build the decoder of ``path`` (see ``DecoderModel.from_pretrained``) with the ``requested`` settings
    (as the caller gave them: ``device`` None = the backend's default, ``feature_layers`` any sequence, ``amp`` /
    ``backend`` / ``quantization`` "auto": ``resolve_auto``). ValueError for settings the backend, the checkpoint
    or the process group cannot run."""
    requested = resolve_auto(path, requested)
    gqa = parse_gqa(requested.gqa_strategy)
    backend, tp_degree, autotune = requested.backend, requested.tp_degree, requested.autotune
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; use one of {', '.join(BACKENDS)}")
    device = backend_device(backend, requested.device)
    if not isinstance(autotune, bool):
        raise ValueError(f"autotune must be True or False, got {autotune!r}")
    if autotune and (backend != "compiled" or torch.device(device).type != "cpu"):
        raise ValueError(f"autotune=True tunes the 'compiled' backend's CPU kernels; this model is "
                         f"backend={backend!r} on device={device!r}: use backend='compiled' on the CPU, "
                         "or autotune=False")
    quantization = parse_quantization(requested.quantization)
    output_vocab_size = requested.output_vocab_size
    if output_vocab_size is not None and quantization not in (None, *GGML_BLOCK_QUANTIZATIONS):
        raise ValueError(f"output_vocab_size restricts a float LM head or GGML blocks; quantization="
                         f"{quantization!r} re-quantizes the head to int8: use None, 'gguf' or 'q4_0'")
    kv_cache_dtype = parse_kv_cache_dtype(requested.kv_cache_dtype)
    check_prompt_weights(requested.prompt_weights, quantization, backend, device)
    mb = requested.prefix_cache_mb
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
        raise ValueError(f"prefix_cache_mb must be an int >= 0 (MiB of host memory for stored prefixes; 0: none), "
                         f"got {mb!r}")
    if requested.prefix_cache and backend == "neuron":
        raise ValueError("prefix_cache=True encodes the rest of a prompt after a kept prefix in graphs the neuron "
                         "backend's program does not hold: use prefix_cache=False on neuron")
    dtype = amp_dtype(requested.amp)
    if backend == "neuron":   # one process traces for every NeuronCore (SPMD)
        from .neuron import check_tp_degree
        tp = spmd_group(tp_degree)
        check_tp_degree(tp_degree)
        if tp.size > 1 and quantization is not None:
            raise ValueError(f"quantization={quantization!r} with backend='neuron' runs at tp_degree=1 only "
                             f"(got {tp_degree}): the row-parallel scales of int8 / int4 are not built per "
                             "rank for the Neuron program yet")
    else:
        tp = tp_group(tp_degree, device)   # validates tp_degree against the running processes
    batch_size, n_positions = requested.batch_size, requested.n_positions
    if batch_size < 1 or n_positions < 2:
        raise ValueError(f"batch_size must be >= 1 and n_positions >= 2 (got {batch_size}, {n_positions})")
    gguf = gguf_source(path, progress=progress and tp.rank == 0)
    if quantization == "gguf" and gguf is None:
        raise ValueError(f"quantization='gguf' keeps a GGUF file's own quantized tensors, but {path} is a "
                         "checkpoint directory, not a .gguf file: use 'int8' or 'int4'")
    path = resolve_model_path(path, progress=progress and tp.rank == 0)
    config = ModelConfig.from_dir(path)
    if n_positions > config.max_position_embeddings:
        raise ValueError(f"n_positions={n_positions} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings}")
    if config.sliding_window is not None and n_positions > config.sliding_window:
        raise ValueError(f"n_positions={n_positions} exceeds sliding_window={config.sliding_window}; "
                         "sliding-window attention is not implemented")
    if output_vocab_size is not None:
        check_output_vocab_size(output_vocab_size, config, tp.size)
    layout = head_layout(config.num_heads, config.num_kv_heads, tp_degree, gqa)
    settings = replace(requested, gqa_strategy=gqa and gqa.value, device=device, quantization=quantization,
                       kv_cache_dtype=kv_cache_dtype,
                       feature_layers=check_feature_layers(requested.feature_layers, config.num_layers))
    with torch.device("meta"):
        lm = DecoderLM(config, batch_size, n_positions, dtype, tp, layout, kv_cache_dtype, settings.feature_layers)
    shards = shard_plan(config, layout, tp.rank)
    if quantization is not None and gguf is not None:   # the file's blocks first: their float weights never exist
        load_gguf_blocks(lm, gguf, quantization, shards, dtype)
    on_host = runs_on_host(device, backend)
    if on_host and "model.embed_tokens.weight" not in shards:
        map_embedding(lm, path, dtype)
    from_file = frozenset(name for name, t in lm.state_dict().items() if not t.is_meta)
    materialize(lm, device, dtype)
    lm.init_buffers()
    load_weights(lm, path, progress=progress and tp.rank == 0, shards=shards, optional=RANK, skip=from_file)
    quantize_and_fuse(lm, quantization, backend, tp)
    if output_vocab_size is not None:
        lm.restrict_output_vocab(output_vocab_size)
        config = lm.config
    lm.eval().requires_grad_(False)
    # a CPU decode step streams every weight: 2 MiB pages, not 4 KiB; first, since the block layers' runners hold
    # the tensors they are given (a buffer moved later would leave them computing on the old copy)
    move_to_huge_pages(lm)
    if on_host:
        use_block_layers(lm)        # a GGUF file's blocks in f32: each layer in five kernel calls
    if settings.prompt_weights is not None:
        add_prompt_weights(lm.model.layers, progress=progress and tp.rank == 0)
        lm.prompt_weights = True
    return LoadedDecoder(path, gguf or path, config, lm, settings)


PROMPT_WEIGHTS = (None, "bf16")


def runs_on_host(device: str | None, backend: str) -> bool:
    """Whether a model's layers run on the host CPU (``device`` None: the CPU), where the block kernels, the
    mapped embedding tables and the named models' presets apply; not on another device nor in a program of
    ``OFF_CPU_BACKENDS``."""
    return (device is None or torch.device(device).type == "cpu") and backend not in OFF_CPU_BACKENDS


def resolve_auto(path: str | Path | None, requested: RuntimeSettings, other_amp: str = "f32") -> RuntimeSettings:
    """``requested`` with its "auto" ``amp``, ``backend`` and ``quantization`` filled: a named model's ``Preset``
    (``named_models``: its fastest measured runtime, the file's own GGML blocks in f32 on regional graphs) where it
    runs on the host (``runs_on_host``: the block kernels are CPU kernels), else ``other_amp`` (the command line's:
    bf16), compiled and None (no quantization) — the embedded model, a path, or a named model on ``xla``,
    ``neuron`` or another device."""
    preset = preset_of(path)
    backend = requested.backend
    if backend == AUTO:
        backend = "compiled"
        if preset is not None and runs_on_host(requested.device, preset.backend):
            backend = preset.backend
    if not runs_on_host(requested.device, backend):
        preset = None
    amp, quantization = requested.amp, requested.quantization
    if amp == AUTO:
        amp = other_amp if preset is None else preset.amp
    if quantization == AUTO:
        quantization = None if preset is None else preset.quantization
    return replace(requested, amp=amp, backend=backend, quantization=quantization)


def check_prompt_weights(prompt_weights: str | None, quantization: str | None, backend: str, device: str) -> None:
    """ValueError unless ``prompt_weights`` (None or "bf16") can apply: GGML blocks ("gguf", "q4_0") on the CPU,
    run by a backend that calls the layers' own forward for a prompt (eager, regional)."""
    if prompt_weights not in PROMPT_WEIGHTS:
        raise ValueError(f"prompt_weights must be None or 'bf16', got {prompt_weights!r}")
    if prompt_weights is None:
        return
    if quantization not in GGML_BLOCK_QUANTIZATIONS or not runs_on_host(device, backend) or \
            backend not in ("eager", "regional"):
        raise ValueError(f"prompt_weights={prompt_weights!r} gives GGML blocks (quantization 'gguf' or 'q4_0') on the "
                         f"CPU a dense copy for prompts, with backend 'eager' or 'regional'; this model is "
                         f"quantization={quantization!r}, backend={backend!r}, device={device!r}")


def map_embedding(lm: DecoderLM, path: Path, dtype: torch.dtype) -> None:
    """Make ``lm``'s embedding table the checkpoint file's own bytes (``checkpoint.mapped_tensor``) where it is only
    looked up: not tied to a float LM head, and stored in ``dtype``. A step reads its tokens' rows, so the table is
    never read nor copied whole (the 1.5B's f32 table: 0.93 GB; ``move_to_huge_pages`` leaves it too) and its
    memory is the page cache's. Elsewhere the table stays to be loaded into memory of its own."""
    table = lm.model.embed_tokens
    if isinstance(lm.lm_head, torch.nn.Linear) and lm.lm_head.weight is table.weight:
        return
    mapped = mapped_tensor(path, "model.embed_tokens.weight")
    if mapped is not None and mapped.dtype == dtype and mapped.shape == table.weight.shape:
        table.weight = torch.nn.Parameter(mapped, requires_grad=False)


def materialize(lm: torch.nn.Module, device: str, dtype: torch.dtype) -> None:
    """Allocate ``lm``'s meta tensors on ``device``, uninitialized, floating ones in ``dtype`` (what
    ``to_empty(device).to(dtype)`` does); tensors already real (a GGUF file's blocks) are left as they are."""
    def allocate(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        return torch.empty_like(t, device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    lm._apply(allocate)


def rank_weights(lm: DecoderLM, path: Path, config: ModelConfig,
                 graph: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """What the Neuron program of ``graph`` (a graph module over ``lm``, read from checkpoint ``path``)
    loads: one ``neuron_weights`` state dict per rank. Rank r's holds the shards ``shard_plan`` gives rank r
    (the tensors a torch.distributed rank r loads) and ``tp_rank = [r]``; each rank is read from the
    checkpoint into ``lm`` in turn, which ends holding rank 0's again."""
    from .neuron import neuron_weights
    if lm.tp.size == 1:
        return [neuron_weights(graph)]
    weights = []
    for rank in [*range(1, lm.tp.size), 0]:
        load_weights(lm, path, progress=False, shards=shard_plan(config, lm.layout, rank), optional=RANK)
        with torch.no_grad():
            lm.tp_rank.fill_(rank)
        weights.append({name: t.clone() for name, t in neuron_weights(graph).items()})
    return weights[-1:] + weights[:-1]
