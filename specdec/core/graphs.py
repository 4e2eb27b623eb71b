"""Fixed-shape graphs and the backends that run them.

A graph is ``StepGraph(lm, key)``: the decoder forward followed by on-device sampling, a pure
function of fixed-shape tensors plus the KV-cache buffers it updates in place:

    inputs : input_ids [b, n] i64, position_ids [b, n] i64, cache_lengths [b] i64,
             token_mask [b, n, n] bool, logit_index [b, m] i64, params [b, 4] f32, uniform [b, m] f32,
             (presence [b, V] bool — ``penalty`` graphs: the tokens already in each row's sequence),
             (seq_ids [1] i64 — ``single_row`` graphs: the cache row the one input row reads and writes),
             (features [b, n, F] — modules with ``feature_size``, i.e. EAGLE drafts: target features)
    outputs: tokens [b, m] i64, logits [b, m, V] f32, hidden [b, n, H], (probs [b, m, V] f32)

A decoder with ``feature_layers`` (EAGLE-3 targets) returns hidden [b, n, H·(1+A)]: the final-norm
hidden states, then those entering its A feature layers (``model.split_hidden``).

b is the batch size B, or 1 for ``single_row`` graphs (context encoding into one slot of a running
batch, the other rows' caches untouched).

Repetition penalty (``penalty`` graphs): the logits at logit position j continue the row's sequence
(``presence``) followed by the graph's own input tokens that position j sees through ``token_mask``
(row ``logit_index[j]`` of the mask): a prompt's tokens in context encoding, S[-1] and the drafts
before it in chain verification, the path root..node in tree verification. Those tokens are
penalised (``sampling.penalised``) before sampling / argmax, and the penalised logits are returned,
so greedy and sampled verification see exactly the distribution target-only decoding samples from.

Backends (``build_graph``): ``eager`` runs the module; ``compiled`` wraps it in
``torch.compile(fullgraph=True, dynamic=False)`` with Inductor's on-disk cache; ``regional`` compiles
only its decoder layers, once for all the layers of one structure (``compile_layers``: seconds instead of
minutes), and runs the rest eagerly; ``xla`` compiles it
as one PyTorch/XLA graph (``xla``); ``neuron`` traces it for AWS Neuron (``neuron``). Every backend
takes any graph module of the same contract as ``StepGraph``: a forward over fixed-shape tensors that
may update its buffers (the KV caches) in place, and ``example_inputs(batch_size)`` for the backends
that trace ahead of time.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .model import Attention, DecoderLM
from .sampling import penalised, sample


@dataclass(frozen=True)
class GraphKey:
    """What a graph is compiled for: n new tokens per row, logits at m of them, a KV bucket,
    greedy (argmax) or sampling, whether warped probabilities are returned, (sampling) whether
    top-k / top-p warping is compiled in (``top_filter``; without it a sampling graph warps by
    temperature only, no vocabulary sort; chosen per request by ``sampling.needs_filter``), whether
    one cache row is written (``single_row``), whether the repetition penalty is applied
    (``penalty``: one more input, ``presence``) and (greedy) whether the graph returns the ``top_k``
    most likely tokens with their log-softmax instead of the argmax and the logits (tree drafting
    scores its candidates so: no [B, m, V] logits leave the graph)."""

    n_tokens: int
    n_logits: int
    kv_len: int
    do_sample: bool
    return_probs: bool = False
    top_filter: bool = False
    single_row: bool = False
    penalty: bool = False
    top_k: int = 0

    def describe(self) -> str:
        mode = ("sample" if self.top_filter else "sample-T") if self.do_sample else "greedy"
        return (f"n={self.n_tokens} m={self.n_logits} kv={self.kv_len} {mode}{' +probs' if self.return_probs else ''}"
                f"{' row' if self.single_row else ''}{' +penalty' if self.penalty else ''}"
                f"{f' top{self.top_k}' if self.top_k else ''}")

    def batch(self, batch_size: int) -> int:
        """Rows of the graph's inputs for a model compiled at ``batch_size``."""
        return 1 if self.single_row else batch_size


class StepGraph(nn.Module):
    def __init__(self, lm: DecoderLM, key: GraphKey, global_topk: int | None):
        super().__init__()
        self.lm, self.key, self.global_topk = lm, key, global_topk

    def forward(self, input_ids, position_ids, cache_lengths, token_mask, logit_index, params, uniform, *extra):
        # ints, not bools: torch 2.9's Dynamo refuses a bool as a tuple index
        penalty, single_row = int(self.key.penalty), int(self.key.single_row)
        presence = extra[0] if penalty else None
        seq_ids = extra[penalty] if single_row else None
        features = extra[penalty + single_row:]
        logits, hidden = self.lm(input_ids, position_ids, cache_lengths, token_mask, logit_index, *features,
                                 kv_len=self.key.kv_len, seq_ids=seq_ids)
        if penalty:
            logits = penalised(logits, params, seen_tokens(presence, input_ids, token_mask, logit_index))
        if self.key.do_sample:
            out = sample(logits, params, uniform, self.global_topk, self.key.return_probs, self.key.top_filter)
            return (out + (logits, hidden)) if self.key.return_probs else (out, logits, hidden)
        if self.key.top_k:     # a reduced output vocabulary scores its own ids only (-inf elsewhere)
            ids = getattr(self.lm, "output_token_ids", None)
            scores, index = torch.log_softmax(logits if ids is None else logits[..., ids], -1).topk(self.key.top_k, -1)
            return (index if ids is None else ids[index]), scores, hidden
        tokens = logits.argmax(-1)
        if self.key.return_probs:
            probs = torch.nn.functional.one_hot(tokens, logits.shape[-1]).float()
            return tokens, probs, logits, hidden
        return tokens, logits, hidden

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Valid inputs of the graph's shapes for a model compiled at ``batch_size`` (a causal chain
        written from slot 0; a ``single_row`` graph writes cache row 0; repetition penalty 1.3, which
        only ``penalty`` graphs apply, on every third token id and the inputs)."""
        n, m = self.key.n_tokens, self.key.n_logits
        batch_size = self.key.batch(batch_size)
        dev = self.lm.inv_freq.device
        pos = torch.arange(n, device=dev).expand(batch_size, n).contiguous()
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(batch_size, n, n).contiguous()
        params = torch.tensor([[0.0, 1.0, 1.0, 1.3]], device=dev).expand(batch_size, 4).contiguous()
        inputs = (torch.zeros(batch_size, n, dtype=torch.long, device=dev), pos,
                  torch.zeros(batch_size, dtype=torch.long, device=dev), causal,
                  torch.arange(n - m, n, device=dev).expand(batch_size, m).contiguous(), params,
                  torch.full((batch_size, m), 0.5, device=dev))
        if self.key.penalty:
            vocab = self.lm.config.vocab_size
            inputs += ((torch.arange(vocab, device=dev) % 3 == 1).expand(batch_size, vocab).contiguous(),)
        if self.key.single_row:
            inputs += (torch.zeros(1, dtype=torch.long, device=dev),)
        size = getattr(self.lm, "feature_size", None)
        if size:
            inputs += (torch.zeros(batch_size, n, size, dtype=self.lm.feature_dtype, device=dev),)
        return inputs


class CacheCompaction(nn.Module):
    """KV compaction as a graph: in every layer of ``lm``, row b's cache slot src[b, i] (K, V and,
    quantized, their scales) is copied to slot dst[b, i] — inputs src, dst [B, m] i64; every slot is
    read before any is written; no outputs (the caches are updated in place). Tree verification moves
    the accepted path's slots with it (``DecoderModel.copy_cache_slots``)."""

    def __init__(self, lm: nn.Module, n_slots: int):
        super().__init__()
        self.lm, self.n_slots = lm, n_slots

    def forward(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        rows = torch.arange(src.shape[0], device=src.device).unsqueeze(1)
        for module in self.lm.modules():
            if isinstance(module, Attention):
                module.move_slots(rows, src, dst)

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """src = dst = slots 0..m-1 of every row (a no-op move)."""
        slots = torch.arange(self.n_slots, device=graph_device(self)).expand(batch_size, self.n_slots).contiguous()
        return slots, slots.clone()


def graph_device(graph: nn.Module) -> torch.device:
    """The device of a graph module's weights (its first parameter or buffer)."""
    return next(itertools.chain(graph.parameters(), graph.buffers())).device


def seen_tokens(presence: torch.Tensor, input_ids: torch.Tensor, token_mask: torch.Tensor,
                logit_index: torch.Tensor) -> torch.Tensor:
    """[b, m, V] bool: the tokens logit position j of each row continues — the row's sequence so far
    (presence [b, V] bool) and the input tokens (input_ids [b, n]) visible to position logit_index[:, j]
    through token_mask [b, n, n]. Fixed shapes: one gather and one scatter-add."""
    b, n = input_ids.shape
    m = logit_index.shape[1]
    visible = token_mask.gather(1, logit_index.unsqueeze(-1).expand(b, m, n))               # [b, m, n]
    counts = torch.zeros(b, m, presence.shape[-1], dtype=torch.int32, device=presence.device)
    counts = counts.scatter_add(2, input_ids.unsqueeze(1).expand(b, m, n), visible.to(torch.int32))
    return presence.unsqueeze(1) | (counts > 0)


BACKENDS = ("eager", "compiled", "regional", "xla", "neuron")
COMPILING = ("compiled", "regional")
"""The backends that compile through ``torch.compile`` on first use (Inductor's on-disk cache)."""


def backend_device(backend: str, device: str | None) -> str:
    """The device a model on ``backend`` lives on: ``device``, or by default the process's XLA device
    for ``xla`` and the CPU for the others (``neuron`` traces from weights on the host)."""
    is_xla = device is not None and torch.device(device).type == "xla"
    if backend == "xla":
        if device is not None and not is_xla:
            raise ValueError(f"backend='xla' runs on an XLA device, not device={device!r}: leave device out "
                             "(the default XLA device) or give 'xla' / 'xla:N'")
        from .xla import xla_device
        return str(xla_device()) if device in (None, "xla") else device
    if is_xla:
        raise ValueError(f"device={device!r} needs backend='xla'")
    return device or "cpu"


def configure_compile_cache() -> None:
    """Make compiled graphs reusable by later processes: a persistent cache directory for Inductor
    (unless the user set one), its FX-graph and AOTAutograd caches on, and room for one compiled
    entry per graph.

    A later process with the same shapes and thread count loads every graph from these caches
    (``specdec generate``, 3 graphs on 2 cores: 73 s cold, 11 s cached — what remains is Dynamo
    re-tracing each graph's Python, which no on-disk cache skips). Inductor's CPU kernels are
    specialised on ``torch.get_num_threads()``, so another thread count compiles its own entry once
    (66 s). ``cpp.dynamic_threads`` would share one entry across thread counts, but its kernels keep
    the parallelisation of the thread count they were compiled at: compiled at 1 thread and run at 2
    they decoded at 23 tok/s against 33 tok/s specialised, so it stays off."""
    import torch._functorch.config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from .cache_files import cache_dir

    # torch writes its own default into the variable on first use (importing transformers' modeling
    # code is enough), so a value equal to that default does not count as the user's choice.
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 1024)


def own_frame(graph: Callable):
    """A function calling ``graph`` (a graph module, or any callable) with a code object of its own.

    Dynamo keeps compiled code per code object and checks each entry's guards on every call: compiling
    the module itself would put every graph of every model on ``StepGraph.forward``'s one code object,
    each entry with ~9,000 guards on module attributes (~1 ms a call on this CPU). With one code
    object per graph, the only entry is this graph's, so the guards on the (never modified) modules
    can be skipped (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``); the inputs' guards stay."""
    def run(*inputs):
        return graph(*inputs)
    run.__code__ = run.__code__.replace()      # a new code object: a compiled-code cache of its own
    return run


def own_outputs(compiled: Callable) -> Callable:
    """``compiled`` (a graph compiled with CUDA graphs) with outputs of its own: Inductor's CUDA graph trees
    replay every graph of a process into one memory pool, so a graph's outputs are overwritten by the next
    replay of any graph (the target's tokens by the draft's prefill); each call starts a new step and copies
    its outputs out of the pool."""
    def run(*inputs):
        torch.compiler.cudagraph_mark_step_begin()
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, compiled(*inputs))
    return run


AUTOTUNE_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                    "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
"""Inductor settings of ``autotune`` graphs (the ``compiled`` backend on the CPU): the weights are frozen
into the graph as constants, so the compiler may re-block them for oneDNN's or its own C++ GEMM
templates (AMX / AVX-512 micro-kernels for bf16, int8 and int4 weights), each matmul's kernel chosen
against ATen's by timing both on the graph's shapes; no autotuning tables printed."""


def autotuned(compiled):
    """``compiled`` (a ``torch.compile`` callable) whose compilation, on its first call, runs under
    ``AUTOTUNE_OPTIONS`` (``freezing`` is read from Inductor's global config, not from
    ``torch.compile``'s options); later calls run the compiled code as it is."""
    first = True

    def run(*inputs):
        nonlocal first
        if not first:
            return compiled(*inputs)
        with torch._inductor.config.patch(AUTOTUNE_OPTIONS), warnings.catch_warnings():
            # Inductor's autotuner reads a tensor's TypedStorage (its own deprecation warning, not ours)
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
            out = compiled(*inputs)
        first = False
        return out
    return run


COMPILE_OPTIONS = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "size_asserts": False,
                   "cpp.min_chunk_size": 32768}
"""``torch.compile`` options of the ``compiled`` and ``regional`` backends. No guards on module attributes
(``own_frame``); no size asserts: the generated code would check the size and stride of every input (each
weight, ~1,000 checks, ~0.5 ms a decode step), and the runtime passes fixed shapes by construction.

Row invariance: with Inductor's default chunk (512 elements a thread), a decode step's RMSNorm (one row
of 1,536) is summed by two threads in two halves while a verify step's rows are each summed by one thread,
so a row's norm differs in the last bit between decode and verify, the 8-bit activation rounding of the
GGUF kernel amplifies it (logits 0.15 apart on the 1.5B) and greedy speculation stopped matching target-only
decoding. A chunk of 32,768 elements (ATen's grain size, which keeps the eager backend invariant) leaves
every reduction shorter than that to one thread (``tests/test_regional.py``)."""


def unguarded_options() -> dict:
    """``COMPILE_OPTIONS`` with no guards at all: saved graphs (``saved_graphs``) and ``LayerRunner``'s codes, whose
    callers pass fixed shapes by construction. (A function: the guard filter is looked up when compiling, so
    importing this module needs no particular torch; the xla environment's torch 2.9 has no
    ``skip_all_guards_unsafe``.)"""
    return {**COMPILE_OPTIONS, "guard_filter_fn": torch.compiler.skip_all_guards_unsafe}


def attribute_key(value, across_processes: bool = False) -> object:
    """A stand-in for a module attribute, equal for two attributes exactly when compiled code may be shared
    between them: the value itself for plain values, shape / dtype / stride for a tensor, the class for a
    module (its own attributes are listed separately), a dataclass's repr, and the object's identity for
    anything else (so an unknown object is never shared by mistake).

    ``across_processes`` (the name of a saved graph, ``saved_graphs.fingerprint``): a tensor's values too
    (Dynamo may bake a plain tensor attribute in), and an unknown object's repr instead of its identity (a
    repr showing a memory address makes the graph unsavable)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, torch.Tensor):
        key = ("tensor", tuple(value.shape), value.dtype, value.stride())
        if not across_processes:
            return key
        data = value.detach().cpu().contiguous()
        return (*key, hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest() if data.numel() else "")
    if isinstance(value, nn.Module):
        return ("module", type(value).__qualname__)
    if isinstance(value, (list, tuple)):
        return tuple(attribute_key(v, across_processes) for v in value)
    if isinstance(value, dict):
        return tuple(sorted(((str(k), attribute_key(v, across_processes)) for k, v in value.items()), key=repr))
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(map(repr, value)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, repr(value))
    return (type(value).__qualname__, repr(value) if across_processes else id(value))


def layer_signature(layer: nn.Module) -> tuple:
    """Everything a decoder layer's compiled code depends on besides its tensors' values: every
    submodule's class and attributes (the weight format of a ``BlockLinear`` among them), every
    parameter's and buffer's shape, dtype and stride. Layers with equal signatures run the same code."""
    return tuple((name, type(m).__qualname__, attribute_key(vars(m))) for name, m in layer.named_modules())


def call_layer(layer: nn.Module, *inputs):
    """``layer(*inputs)``: what a ``LayerRunner``'s compiled code runs."""
    return layer(*inputs)


class LayerRunner:
    """The compiled code of the decoder layers of one ``layer_signature``: ``runner(layer, *inputs)`` runs
    ``layer(*inputs)`` through the code compiled for the inputs' shapes, dtypes and strides (and grad mode),
    compiling it on the first call with them.

    Each input key has a code object of its own (``own_frame``) and its code checks no guards at all
    (``unguarded_options``, as saved graphs): Dynamo's guards on a layer's inputs, parameters and
    buffers cost 40-70 µs a layer call (1-2 ms a decode step of the 1.5B), and everything they would check
    is fixed by the signature (the module side) and by the key (the inputs), looked up here in a dict."""

    def __init__(self):
        self._compiled: dict[tuple, Callable] = {}

    def __call__(self, layer: nn.Module, *inputs):
        key = (torch.is_grad_enabled(), *map(input_key, inputs))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = torch.compile(own_frame(call_layer), fullgraph=True, dynamic=False,
                                                           options=unguarded_options())
        return compiled(layer, *inputs)

    def __len__(self) -> int:
        """The input keys compiled so far."""
        return len(self._compiled)


def input_key(value) -> object:
    """What compiled code depends on in one input: a tensor's shape, dtype, stride and device; the value of
    anything else (kv_len, None)."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.stride(), value.device)
    return value


def compile_layers(lm: DecoderLM) -> None:
    """Regional compilation (the ``regional`` backend): each decoder layer runs
    through ``torch.compile``d code, compiled once per graph shape for all the layers of one
    ``layer_signature`` (28 identical layers: one compilation instead of 28 inlined copies), while the
    embedding, the LM head and sampling run eagerly. Layers share code only when their signatures are
    equal (a GGUF mixing Q4_K and Q6_K layers gets one ``LayerRunner`` per mix). Sets ``lm.layer_runners``
    once per model."""
    if lm.layer_runners is not None:
        return
    configure_compile_cache()
    signatures = [layer_signature(layer) for layer in lm.model.layers]
    runners = {signature: LayerRunner() for signature in dict.fromkeys(signatures)}
    lm.layer_runners = [runners[signature] for signature in signatures]


def build_graph(graph: nn.Module, backend: str, batch_size: int, name: str | None = None, autotune: bool = False):
    """A callable running the graph module ``graph`` on ``backend`` (``batch_size``: the rows of a
    model compiled for that batch, for backends that trace ``graph.example_inputs(batch_size)``;
    ``name``: the graph's label in the backend's logs and artifacts, default the module's class name;
    ``autotune``: ``compiled`` only, compile with ``AUTOTUNE_OPTIONS``)."""
    if backend == "eager":
        return graph
    name = name or type(graph).__name__
    if backend == "regional":
        for module in graph.modules():
            if isinstance(module, DecoderLM):
                compile_layers(module)
        return graph
    if backend == "compiled":
        configure_compile_cache()
        if graph_device(graph).type == "cuda":     # CUDA graphs ("reduce-overhead"'s option; a mode or options)
            options = COMPILE_OPTIONS | {"triton.cudagraphs": True}
            return own_outputs(torch.compile(own_frame(graph), fullgraph=True, dynamic=False, options=options))
        compiled = torch.compile(own_frame(graph), fullgraph=True, dynamic=False, options=COMPILE_OPTIONS)
        return autotuned(compiled) if autotune else compiled
    if backend == "xla":
        from .xla import build_xla_graph
        return build_xla_graph(graph, name)
    if backend == "neuron":
        from .neuron import build_neuron_graph
        return build_neuron_graph(graph, batch_size, name)
    raise ValueError(f"backend={backend!r} is not supported; use one of {', '.join(BACKENDS)}")
