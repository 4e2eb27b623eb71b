"""Tensor parallelism: the process group, the collectives inside the model, checkpoint shards, launching.

Sharding (Megatron style, as NxD Inference does it), for ``tp_degree`` ranks:

- q/k/v (weights and biases) and gate/up are column-parallel: a rank holds its output rows —
  its head slots from ``tp_layout.HeadLayout`` (padding slots are zeros) and its block of
  ``ceil(intermediate_size / tp)`` MLP rows (zero-padded at the end);
- o_proj and down_proj are row-parallel: a rank holds the matching input columns; the partial
  outputs are summed by ``all_reduce`` after attention and after the MLP;
- the embedding and the LM head are vocab-parallel: a rank holds a block of ``ceil(V / tp)`` vocab
  rows (``ceil(draft_vocab_size / tp)`` LM-head rows for reduced-vocabulary drafts); embedding
  lookups of other ranks' tokens give zeros and are summed by ``all_reduce``; logits are
  ``all_gather``-ed, so every rank samples from the same full logits. Tied embeddings stay tied;
- RMSNorm weights, RoPE and a reduced vocabulary's ``output_token_ids`` are replicated.

A model is either sharded over every rank of the default process group (``tp_degree`` = world
size) or replicated on each rank (``tp_degree=1``, no collectives) — e.g. a small draft next to a
sharded target. The collectives are ``torch.distributed._functional_collectives``, which run
eagerly and trace under ``torch.compile(fullgraph=True)`` and ``torch.export``.

Neuron (``backend='neuron'``, ``spmd_group``): one process drives every NeuronCore and ONE traced
program serves every rank (SPMD, as NxD Inference builds it). The model is the same ``DecoderLM``;
what changes is the group's ``collectives``: ``NXD`` routes ``all_reduce`` / ``all_gather_last`` to
neuronx-distributed's ``reduce_from_tensor_model_parallel_region`` /
``gather_from_tensor_model_parallel_region`` (lowered to collectives while traced under
``NxDParallelState``), and the rank is never a Python constant in the graph: the model reads it from
``DecoderLM.tp_rank``, [1] int32 (a parameter here, as NxD's ``SPMDRank`` holds it: rank r is handed
the value ``r`` with its weights; a buffer holding the process's rank on CPU / GPU). The weights are
the same per-rank shards ``shard_plan`` gives torch.distributed ranks, built on the host for every
rank and handed to ``NxDModel.set_weights`` as one state dict per rank (``DecoderModel.rank_weights``),
in place of NxD's ``shard_checkpoint`` over
``ColumnParallelLinear`` / ``RowParallelLinear`` / ``ParallelEmbedding`` attributes (same layout:
column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel embedding and LM head).
"""
from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

from .config import ModelConfig
from .tp_layout import HeadLayout

TORCH = "torch.distributed"     # one process per rank, collectives of torch.distributed (gloo / NCCL)
NXD = "neuronx-distributed"     # one process for every rank (SPMD trace), collectives of neuronx-distributed


@dataclass(frozen=True)
class TPGroup:
    """The ranks a model is sharded over: ``size`` = tp_degree, ``rank`` = the rank whose shards this
    process holds; ``collectives``: ``TORCH`` or ``NXD`` (``spmd_group``)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None   # None when size == 1 or with NXD collectives
    collectives: str = TORCH

    @property
    def processes(self) -> int:
        """Host processes sharing the work: one per rank (torch.distributed), or one for all (NXD)."""
        return 1 if self.collectives == NXD else self.size


def check_tp_degree(tp_degree) -> None:
    if isinstance(tp_degree, bool) or not isinstance(tp_degree, int) or tp_degree < 1:
        raise ValueError(f"tp_degree must be an integer >= 1, got {tp_degree!r}")


def tp_group(tp_degree: int, device: str | torch.device = "cpu") -> TPGroup:
    """Validate ``tp_degree`` against the running processes and return this rank's group.

    Under ``torchrun`` (``WORLD_SIZE`` set, no process group yet) the default group is initialised
    here (gloo on CPU, NCCL on CUDA).
    """
    check_tp_degree(tp_degree)
    if tp_degree == 1:
        return TPGroup()
    if not dist.is_initialized():
        launched = os.environ.get("WORLD_SIZE")
        if launched is None:
            raise RuntimeError(
                f"tp_degree={tp_degree} needs {tp_degree} processes, but torch.distributed is not initialised: "
                f"run the code with specdec.core.parallel.launch(fn, {tp_degree}, ...) (CLI: --tp-degree "
                f"{tp_degree}) or start it with `torchrun --nproc-per-node {tp_degree} script.py`")
        if int(launched) != tp_degree:
            raise ValueError(f"tp_degree={tp_degree} does not match the launch: {launched} processes were started "
                             f"(WORLD_SIZE={launched}); start {tp_degree} or set tp_degree={launched}")
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.device(device).type == "cuda" else "gloo")
    world = dist.get_world_size()
    if tp_degree != world:
        relation = "exceeds" if tp_degree > world else "is smaller than"
        raise ValueError(f"tp_degree={tp_degree} {relation} the world size {world} of the process group: a model "
                         f"is sharded over every rank (tp_degree={world}) or replicated (tp_degree=1)")
    return TPGroup(dist.get_rank(), world, dist.group.WORLD)


def spmd_group(tp_degree: int) -> TPGroup:
    """The group of a model traced once for ``tp_degree`` NeuronCores (``backend='neuron'``): this one
    process holds rank 0's module (every rank's module has the same shapes), no process group."""
    check_tp_degree(tp_degree)
    return TPGroup(0, tp_degree, None, NXD) if tp_degree > 1 else TPGroup()


# ----------------------------------------------------------------------------- collectives
def _nxd_mappings():
    """neuronx-distributed's tensor-parallel collectives (imported only when an NXD model runs)."""
    from neuronx_distributed.parallel_layers import mappings
    return mappings


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum of ``x`` over the group's ranks (same shape)."""
    if tp.collectives == NXD:
        return _nxd_mappings().reduce_from_tensor_model_parallel_region(x)
    return funcol.all_reduce(x, "sum", tp.group)


def all_reduce_max(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Elementwise maximum of ``x`` over the group's ranks (outside graphs: load-time statistics)."""
    if tp.size == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp.group)
    return x


def all_gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[..., d] on each rank → [..., tp * d], ranks in order."""
    if tp.collectives == NXD:
        return _nxd_mappings().gather_from_tensor_model_parallel_region(x)
    return _all_gather(x, x.dim() - 1, tp.group)


# one gather op (torch >= 2.10); torch 2.9 has only all_gather_tensor (the same result, along any dim)
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)


def broadcast(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Rank 0's ``x`` on every rank (``x`` itself when one process holds every rank)."""
    return x if tp.processes == 1 else funcol.broadcast(x.contiguous(), 0, tp.group).wait()


def barrier(tp: TPGroup) -> None:
    if tp.processes > 1:
        dist.barrier(group=tp.group)


# ----------------------------------------------------------------------------- shards
def per_rank(size: int, tp_degree: int) -> int:
    """Rows per rank of a dimension split into ``tp_degree`` equal, zero-padded blocks."""
    return -(-size // tp_degree)


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank loads: along ``dim``, parameter row i is source
    row ``index[i]`` (-1 = zeros); ``size`` is the source tensor's length along ``dim``."""

    dim: int
    index: tuple[int, ...]
    size: int


def block(size: int, tp_degree: int, rank: int) -> tuple[int, ...]:
    """Rank's contiguous block of a dimension of ``size`` (-1 past the end)."""
    n = per_rank(size, tp_degree)
    return tuple(i if i < size else -1 for i in range(rank * n, (rank + 1) * n))


def head_rows(heads: list[int], head_dim: int) -> tuple[int, ...]:
    """Source rows of the head slots ``heads`` (-1 = padding slot)."""
    return tuple(h * head_dim + d if h >= 0 else -1 for h in heads for d in range(head_dim))


def shard_plan(config: ModelConfig, layout: HeadLayout, rank: int) -> dict[str, Shard]:
    """HF tensor name → what ``rank`` loads of it; tensors not listed are loaded whole.

    Empty for tp_degree=1 with the identity head layout (the model then matches the checkpoint).
    """
    tp, d = layout.tp_degree, config.head_dim
    q_heads, kv_heads = layout.rank_slots(rank)
    q, kv = head_rows(q_heads, d), head_rows(kv_heads, d)
    mlp = block(config.intermediate_size, tp, rank)
    plan = {"model.embed_tokens.weight": Shard(0, block(config.vocab_size, tp, rank), config.vocab_size)}
    out_vocab = config.output_vocab_size or config.vocab_size
    if not config.tie_word_embeddings:
        plan["lm_head.weight"] = Shard(0, block(out_vocab, tp, rank), out_vocab)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name, rows, size in (("q_proj", q, config.num_heads * d), ("k_proj", kv, config.num_kv_heads * d),
                                 ("v_proj", kv, config.num_kv_heads * d)):
            plan[f"{p}self_attn.{name}.weight"] = Shard(0, rows, size)
            if config.attention_bias:
                plan[f"{p}self_attn.{name}.bias"] = Shard(0, rows, size)
        plan[f"{p}self_attn.o_proj.weight"] = Shard(1, q, config.num_heads * d)
        plan[f"{p}mlp.gate_proj.weight"] = Shard(0, mlp, config.intermediate_size)
        plan[f"{p}mlp.up_proj.weight"] = Shard(0, mlp, config.intermediate_size)
        plan[f"{p}mlp.down_proj.weight"] = Shard(1, mlp, config.intermediate_size)
    return {name: s for name, s in plan.items() if s.index != tuple(range(s.size))}


# ----------------------------------------------------------------------------- launching
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerError(RuntimeError):
    """A worker process failed; the message holds its rank and traceback."""


def launch(fn: Callable[..., Any], tp_degree: int, /, *args, dist_backend: str = "gloo",
           timeout_s: float = 3600.0, **kwargs) -> Any:
    """Run ``fn(*args, **kwargs)`` in ``tp_degree`` fresh processes that form one process group,
    and return rank 0's result — tensor parallelism without writing torchrun lines.

    ``fn`` and the arguments must be picklable (``fn`` defined in a module, not a notebook cell).
    Each worker gets ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``, and ``cpu_count // tp_degree``
    threads unless ``OMP_NUM_THREADS`` is set. ``dist_backend``: ``"gloo"`` (CPU) or ``"nccl"`` (one
    GPU per rank). The first worker exception is re-raised here (same type when it can be pickled,
    chained to a ``WorkerError`` with the rank's traceback); the other workers are stopped. A run
    longer than ``timeout_s`` is stopped with ``TimeoutError`` (also the collectives' timeout). A SIGTERM
    to this process while it waits (``docker stop``, a process manager) is passed on to rank 0, which
    coordinates the others (``specdec serve`` drains), as Ctrl-C reaches every process of the group.
    """
    check_tp_degree(tp_degree)
    with tempfile.TemporaryDirectory(prefix="specdec-tp-") as tmp:
        ctx = mp.start_processes(_worker, args=(fn, args, kwargs, tp_degree, free_port(), dist_backend, timeout_s, tmp),
                                 nprocs=tp_degree, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        forwarding = threading.current_thread() is threading.main_thread()
        if forwarding:
            previous = signal.signal(signal.SIGTERM, lambda *_: os.kill(ctx.processes[0].pid, signal.SIGTERM))
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel run of {getattr(fn, '__name__', fn)} did not finish within "
                                       f"{timeout_s} s; its {tp_degree} processes were stopped")
        except mp.ProcessRaisedException as e:
            cause = WorkerError(f"rank {e.error_index} failed:\n{e}")
            original = _load_error(Path(tmp) / f"error{e.error_index}.pt")
            if original is None:
                raise cause from None
            raise original from cause
        except mp.ProcessExitedException as e:
            raise WorkerError(f"rank {e.error_index} died (exit code {e.exit_code}); "
                              "the other ranks were stopped") from None
        finally:
            if forwarding:
                signal.signal(signal.SIGTERM, previous)
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                p.join()
        return torch.load(Path(tmp) / "result.pt", weights_only=False)


def _load_error(path: Path) -> BaseException | None:
    """The exception a worker saved, or None (it could not be pickled)."""
    try:
        return torch.load(path, weights_only=False)
    except Exception:
        return None


def _worker(rank: int, fn, args, kwargs, world: int, port: int, backend: str, timeout_s: float, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:
        with suppress(Exception):   # an exception that cannot be pickled is reported as text only
            torch.save(e, Path(tmp) / f"error{rank}.pt")
        raise
    if rank == 0:
        torch.save(result, Path(tmp) / "result.pt")
    # every rank finishes its last collective before any tears the group down: a rank that closed its
    # connections while another was still reading from them aborted it (gloo; seen once in CI, tp serve)
    dist.barrier()
    dist.destroy_process_group()
