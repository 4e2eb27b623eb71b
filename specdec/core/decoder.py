"""``DecoderModel``: a checkpoint on the static-shape runtime (the user-facing model object).

State: the KV cache (inside the module), ``lengths`` [batch_size] (host copy, the authority
for bucket choice) and, when tracked, ``presence`` [batch_size, V] (the tokens in each row's
sequence, which the repetition penalty reads). Graph-level API used by the strategies:

- ``prefill(prompts, ..., rows=None)``: context encoding of up to ``batch_size`` prompts → first
  tokens; all rows restart, or (``rows``) only the named rows, the others untouched;
- ``step(tokens [B, n], ...)``: n new tokens per row at slots ``lengths + i`` with an explicit
  mask among them (causal by default) → tokens/logits/hidden for all n;
- ``set_lengths(lengths)``: rollback (or commit) by moving each row's length.

The model is composed of one object per responsibility, each in its own module: building the decoder from
a checkpoint (``loading``), its graphs and their cache (``graph_cache.GraphCache``, ``graphs``), the KV
bookkeeping (``kv_state.KVState``, ``kv``), save / load (``persistence``) and prompt checks (``prompts``).
What stays here is running graphs: sampling parameters, the graph key of a call, prefill and step.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from .block_layer import runs_block_layers
from .buckets import check_buckets, pick_bucket
from .config import ModelConfig, amp_dtype
from .graph_cache import GraphCache
from .graphs import COMPILING, GraphKey, StepGraph
from .kv_state import KVState
from .loading import RuntimeSettings, load_decoder, rank_weights
from .model import Attention, DecoderLM, causal_mask, check_feature_layers, split_hidden
from .parallel import TPGroup
from .persistence import load_compiled, read_saved, save_compiled
from .prefix_store import STORE_MIN_TOKENS, PrefixStore, StoredPrefix
from .prompts import prompt_rows
from .sampling import (
    TEMPERATURE,
    RowGenerators,
    SamplingConfig,
    any_penalised,
    any_sampled,
    needs_filter,
    sampling_params,
)
from .target import StepOutput


class Kept(NamedTuple):
    """What a row's prompt encoding keeps (``DecoderModel._kept``): its first ``n`` tokens' KV, from the stored
    prefix ``entry`` (None: the row's own slots); ``own``: how many leading tokens the row's record shares with
    the prompt (what a store must save of the record is the rest)."""

    n: int = 0
    entry: StoredPrefix | None = None
    own: int = 0


class DecoderModel:
    """A decoder (``lm``) on fixed shapes (``settings``): ``graphs`` (``GraphCache``) builds and holds its
    compiled graphs, ``kv`` (``KVState``) its rows' lengths and token presence."""

    def __init__(self, path: Path, config: ModelConfig, lm: DecoderLM, settings: RuntimeSettings):
        self.path, self.config, self.lm, self.settings = path, config, lm, settings
        self.source = path      # what ``load`` reloads from: the checkpoint directory, or the GGUF file
        # graphs that compile nothing per prompt bucket (layers as row-invariant block kernels, eager or regional)
        # get fine default context buckets (a prompt over 32 tokens pads by under half its length), at no compile cost
        fine = settings.backend in ("eager", "regional") and runs_block_layers(lm)
        self._shapes_free = settings.backend == "eager" or fine
        self.context_buckets = check_buckets("context_buckets", settings.context_buckets, settings.n_positions, fine)
        self.kv_buckets = check_buckets("kv_buckets", settings.kv_buckets, settings.n_positions)
        self.device = torch.device(settings.device)
        self.graphs = GraphCache(lm, settings, partial(rank_weights, lm, path, config))
        self.kv = KVState(settings.batch_size, settings.n_positions, config.vocab_size, self.device,
                          self.graphs.compaction, settings.prefix_cache)
        self._tokenizer = None
        self.prompt_tokens_kept = 0            # prompt tokens whose KV a prompt encoding kept (``prefix_cache``)
        # KV prefixes rows gave up, in host memory (``prefix_cache_mb``)
        store = settings.prefix_cache and settings.prefix_cache_mb > 0
        self.prefix_store = PrefixStore(settings.prefix_cache_mb << 20) if store else None
        self.progress = True                   # progress output: lazy compiles of graphs on first use
        if self.device.type == "xla":
            from .xla import materialize
            materialize()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, batch_size: int = 1, n_positions: int = 2048,
                        amp: str = "auto", tp_degree: int = 1, gqa_strategy: str | None = None,
                        context_buckets: list[int] | None = None, kv_buckets: list[int] | None = None,
                        sampling: SamplingConfig | None = None, backend: str = "auto", device: str | None = None,
                        quantization: str | None = "auto", kv_cache_dtype: str | None = None,
                        feature_layers: tuple[int, ...] | list[int] = (), autotune: bool = False,
                        output_vocab_size: int | None = None, saved_graphs: bool = False,
                        prompt_weights: str | None = None, prefix_cache: bool = False,
                        prefix_cache_mb: int = 1024, progress: bool = True) -> DecoderModel:
        """Load a checkpoint directory (4 HF layouts), a ``.gguf`` file, a named model (e.g.
        ``"qwen2.5-coder-1.5b-instruct"``, ``named_models.NAMED_MODELS``: a GGUF file assembled once from
        its packages), or (``None``) the embedded SmolLM2-135M-Instruct. Graphs are built lazily on first
        use, or all at once by ``compile()``. ``amp``, ``backend`` and ``quantization`` left "auto" take a named
        model's preset on the CPU (``named_models.Preset``: the file's own blocks, ``quantization="gguf"``, in f32 on
        ``regional`` graphs, its fastest measured runtime), else ``amp="f32"``, ``backend="compiled"`` and no
        quantization (``loading.resolve_auto``).

        ``tp_degree > 1`` shards the model over the ranks of the running process group (its world
        size; see ``specdec.core.parallel.launch``), each rank loading only its shards (``neuron``: one
        process for every NeuronCore, one SPMD trace, every rank's shards handed to the program);
        ``gqa_strategy`` ('replicate-to-tp-degree' / 'convert-to-mha', None = automatic) sets how
        query/KV heads are laid out over the ranks (``tp_layout``). ``quantization``: None (or "none"), ``"int8"``
        weight-only per-channel int8 of the attention and MLP projections and the LM head (NxD
        Inference's names ``"per_channel_symmetric"``, transformers-neuronx's ``"s8"`` also accepted;
        see ``quant``), ``"int4"`` group-wise int4 projections (the LM head int8), or ``"gguf"`` (a GGUF
        file only): every Q4_0 / Q4_1 / Q4_K / Q5_0 / Q6_K / Q8_0 tensor, LM head included, keeps the file's
        own blocks (``gguf_weights``) and runs on the ``block_mm`` CPU kernel (``block_linear``: exact
        weights, 8-bit activations as llama.cpp's, row-invariant). With int4 / int8 a GGUF file's 4-bit
        (int4) or Q8_0 (int8) projections and ≤ 8-bit LM head keep theirs too instead of being rounded again.
        ``"q4_0"``: GGML Q4_0 blocks on the same kernel for every projection and the LM head (a GGUF file's
        Q4_0 tensors kept, the rest re-quantized as llama.cpp's reference Q4_0: ``gguf_weights.quantize_q4_0``;
        4.5 bits a weight; a cheaper draft: the 0.5B Qwen draft reads 24 % fewer bytes than its "gguf").
        ``kv_cache_dtype``: None / "auto" (the KV cache in the compute dtype), ``"int8"`` or ``"fp8_e4m3"``
        (alias ``"fp8"``; vLLM's names, NxD Inference's ``kv_cache_quant``): 8-bit K/V with an f32 scale
        per (row, slot, KV head), dequantized when read (``kv_quant``). Drafts inherit both settings.
        ``feature_layers``: every graph also returns the hidden states entering these layers
        (``StepOutput.aux_hidden``; EAGLE-3 drafts set them with ``use_feature_layers``).
        ``backend``: one of ``BACKENDS`` (``graphs``); ``device``: default the XLA device for ``xla``,
        the CPU otherwise. ``autotune`` (``compiled`` backend on the CPU): each graph is compiled with
        its weights frozen in and every matmul's kernel chosen by timing Inductor's C++ GEMM templates
        against ATen's (``graphs.AUTOTUNE_OPTIONS``): faster steps at every precision, at the cost of a
        longer first compile and, for bf16 and int8 weights, a re-blocked copy of the weights per graph
        (see docs/backends.md, "Autotuned graphs"). ``output_vocab_size`` n: score only the token ids [0, n)
        (``DecoderLM.restrict_output_vocab``; a cheaper LM head for a draft, which then never proposes a later
        id; quantization None, "gguf" or "q4_0"). ``saved_graphs`` (``compiled`` backend on the CPU, without
        ``autotune``; ignored otherwise): each graph is compiled ahead of time into a file under
        ``$SPECDEC_CACHE/graphs`` that later processes load in about a second instead of re-tracing it
        (``saved_graphs``); ``graphs.defer`` runs graphs eagerly until ``graphs.compile_deferred`` builds them.
        ``prompt_weights="bf16"`` (GGML blocks: quantization "gguf" or "q4_0", on the CPU, backend eager or
        regional): the decoder layers also hold their weights as dense bf16 matrices (2 more bytes a weight),
        which a prompt's encoding multiplies with (bf16 GEMMs: AMX / AVX-512-BF16), while decode and verify steps
        keep the blocks (``block_linear``); a prompt's KV and first token then come from bf16 arithmetic.
        ``prefix_cache`` (llama.cpp's ``cache_prompt``, vLLM's prefix caching; not on ``neuron``): a row's prompt
        encoding keeps the KV its cache already holds for the prompt's leading tokens and encodes only the rest
        (``prefill``): an agent's or a chat's next turn, which re-sends the conversation, costs its new tokens only;
        ``prefix_cache_mb`` MiB of host memory (0: none) keep the prefixes rows give up (``prefix_store``: llama.cpp's
        ``--cache-ram``), so a conversation whose row served another one in between keeps its prefix too."""
        requested = RuntimeSettings(batch_size, n_positions, amp, tp_degree, gqa_strategy, context_buckets, kv_buckets,
                                    sampling or SamplingConfig(), backend, device, quantization, kv_cache_dtype,
                                    feature_layers, autotune, output_vocab_size, saved_graphs, prompt_weights,
                                    prefix_cache, prefix_cache_mb)
        loaded = load_decoder(path, requested, progress)
        model = cls(loaded.path, loaded.config, loaded.lm, loaded.settings)
        model.source = loaded.source
        model.progress = progress
        return model

    @property
    def batch_size(self) -> int:
        return self.settings.batch_size

    @property
    def n_positions(self) -> int:
        return self.settings.n_positions

    @property
    def tp(self) -> TPGroup:
        """This rank's tensor-parallel group (size 1 = not sharded)."""
        return self.lm.tp

    @property
    def dtype(self) -> torch.dtype:
        return amp_dtype(self.settings.amp)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (``transformers.AutoTokenizer``), loaded on first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        return self._tokenizer

    def use_feature_layers(self, layers: tuple[int, ...] | list[int]) -> None:
        """Make every graph also return the hidden states entering ``layers`` (``StepOutput.aux_hidden``;
        what EAGLE-3 drafts read). Graphs built before with other layers are dropped (rebuilt on use);
        ValueError for layers the model lacks, or on ``neuron`` once the program is compiled."""
        layers = check_feature_layers(layers, self.config.num_layers)
        if layers == self.lm.feature_layers:
            return
        if self.graphs.neuron is not None:
            raise ValueError(f"the Neuron program was compiled without feature layers {list(layers)}: set them "
                             "(load the EAGLE-3 draft) before to_neuron()")
        self.lm.feature_layers = self.settings.feature_layers = layers
        self.graphs.clear()

    # ------------------------------------------------------------------ graphs (``GraphCache``)
    @property
    def compile_seconds(self) -> dict[str, float]:
        """Seconds each graph took to build and first run, by ``GraphKey.describe()`` (or compaction name)."""
        return self.graphs.compile_seconds

    def graph_module(self, key: GraphKey) -> StepGraph:
        """The graph module of ``key`` (over this model's decoder): what every backend runs or traces."""
        return self.graphs.module(key)

    def graph(self, key: GraphKey):
        """The callable for ``key``, built (and for ``compiled`` / ``xla``, traced on first call) once;
        ``neuron`` graphs exist only as ``compile()`` / ``to_neuron()`` built them (ahead of time). Every
        graph call of the model goes through it (timing tools wrap it)."""
        built = self.graphs.built.get(key)     # the hot path: one look-up, no further call
        return self.graphs.graph(key) if built is None else built

    def graph_keys(self, do_sample: bool | None = None, spec_tokens: tuple[int, ...] = (),
                   prompt_length: int | None = None, max_length: int | None = None,
                   single_row: bool = False) -> list[GraphKey]:
        """Context-encoding keys (one per context bucket) and token-generation keys (one per KV
        bucket, plus n-token keys for each entry of ``spec_tokens``). ``prompt_length`` /
        ``max_length`` keep only the buckets that prompts / sequences up to those lengths use.
        ``single_row`` adds the single-row context keys rows joining a running batch use
        (``Engine.add``)."""
        cfg = self.settings.sampling
        s = cfg.do_sample if do_sample is None else do_sample
        f = s and needs_filter(self.sampling_params(do_sample=s), cfg.global_topk)
        ctx = self.context_buckets
        if prompt_length is not None:
            ctx = [c for c in ctx if c <= pick_bucket(ctx, prompt_length, "prompt length")]
        kvs = self.kv_buckets
        if max_length is not None:
            kvs = [kv for kv in kvs if kv <= pick_bucket(kvs, max_length, "max_length")]
        keys = [GraphKey(c, 1, c, s, False, f, one) for one in (False, True)[:1 + single_row] for c in ctx]
        for n in (1, *spec_tokens):
            keys += [GraphKey(n, n, kv, s, n > 1, f) for kv in kvs if kv >= n]
        return keys

    def compile(self, progress: bool = True, spec_tokens: tuple[int, ...] = (), prompt_length: int | None = None,
                max_length: int | None = None, single_row: bool = False,
                compaction_slots: tuple[int, ...] = ()) -> DecoderModel:
        """Build and warm the graphs (Neuron's ahead-of-time model): all buckets, or only those
        ``prompt_length`` / ``max_length`` need; ``single_row`` also the context graphs of rows joining
        a running batch (see ``graph_keys``); ``compaction_slots`` the KV-compaction graphs moving that
        many slots per row (tree verification: the tree's depth). Clears the KV cache. On ``neuron``
        every graph goes into one program (shared weights and KV caches) loaded onto the NeuronCores."""
        keys = self.graph_keys(spec_tokens=spec_tokens, prompt_length=prompt_length, max_length=max_length,
                               single_row=single_row)
        return self._warm(keys, f"compiling ({self.settings.backend})", progress, compaction_slots)

    to_neuron = compile

    def _warm(self, keys: list[GraphKey], desc: str, progress: bool,
              compaction_slots: tuple[int, ...] | list[int] = ()) -> DecoderModel:
        """Build and run once each of ``keys`` and the compaction graphs of ``compaction_slots``
        (``GraphCache.warm``), then clear the KV cache."""
        self.graphs.warm(keys, desc, progress, compaction_slots)
        self.reset()
        return self

    def rank_weights(self, graph: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
        """What the Neuron program of ``graph`` (a graph module over this model's decoder) loads: one
        state dict per rank (``loading.rank_weights``); the module ends holding rank 0's weights."""
        return self.graphs.rank_weights(graph)

    def export(self, key: GraphKey) -> torch.export.ExportedProgram:
        """``torch.export`` (strict, static shapes) of one graph: the check that it is trace-clean."""
        return self.graphs.export(key)

    # ------------------------------------------------------------------ state (``KVState``)
    @property
    def lengths(self) -> torch.Tensor:
        """[batch_size] long (host): each row's sequence length, i.e. its filled cache slots."""
        return self.kv.lengths

    @property
    def presence(self) -> torch.Tensor | None:
        """[batch_size, V] bool (device): the tokens in each row's sequence (prompt + emitted), read by the
        repetition penalty; None = not tracked (draft models), so no graph applies the penalty."""
        return self.kv.presence

    @presence.setter
    def presence(self, presence: torch.Tensor | None) -> None:
        self.kv.presence = presence

    def reset(self) -> None:
        self.kv.reset()

    @property
    def shapes_free(self) -> bool:
        """Whether a graph of a shape not built before costs no compilation (``eager``, or ``regional`` over
        block-kernel layers), so a caller may choose a call's width freely."""
        return self._shapes_free

    @property
    def prefix_cache(self) -> bool:
        """Whether a prompt's encoding keeps the KV its row already holds (``prefill``)."""
        return self.settings.prefix_cache

    def shared_prefix(self, row: int, prompt: list[int]) -> int:
        """How many leading ids of ``prompt`` row ``row``'s cache holds the KV of (at most len(prompt) - 1)."""
        return self.kv.shared_prefix(row, prompt)

    def keep_prefix(self, row: int, tokens: list[int]) -> None:
        """Row ``row``'s slots [0, len(tokens)) hold the KV of ``tokens``, on the caller's word (a request loop's
        S[:-1] when a request ends): a later prompt starting with them keeps them (``prefix_cache``)."""
        self.kv.keep(row, tokens)

    def forget_from(self, starts: torch.Tensor) -> None:
        """A graph outside this model's own calls (a fused speculation step) wrote row b's cache from slot
        starts[b] on (starts [batch_size], host): what ``cached`` says of those slots no longer holds."""
        self.kv.forget_from(starts.cpu())

    def cached_length(self, row: int) -> int:
        """How many leading slots of row ``row`` hold known tokens' KV (``KVState.cached``)."""
        return len(self.kv.cached[row])

    def set_lengths(self, lengths: torch.Tensor) -> None:
        """Roll rows back (or forward over already-written slots): lengths [batch_size]."""
        self.kv.set_lengths(lengths)

    def track_presence(self) -> None:
        """Start tracking ``presence`` (every row empty; a no-op when already tracking), so graphs apply
        the repetition penalty of rows that ask for one. The request loop (``Engine``) keeps it equal to
        each row's prompt + emitted tokens."""
        self.kv.track_presence()

    def reset_presence(self, row: int, tokens: torch.Tensor | list[int]) -> None:
        """Row ``row``'s sequence restarts as ``tokens`` (ids, 1-D): one copy to the device."""
        self.kv.reset_presence(row, tokens)

    def mark_presence(self, rows: torch.Tensor | list[int], tokens: torch.Tensor | list[int]) -> None:
        """Token tokens[i] was appended to row rows[i]'s sequence (rows, tokens: 1-D, same length):
        one index_put on the device."""
        self.kv.mark_presence(rows, tokens)

    def copy_cache_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV compaction, on device: in every layer, row b's cache slot src[b, i] (K, V and, quantized,
        their scales) is copied to slot dst[b, i] (src, dst [B, m]; all slots are read before any is written).
        One ``CacheCompaction`` graph per m, on the model's backend."""
        self.kv.copy_slots(src, dst)

    # ------------------------------------------------------------------ input checks
    def prepare_prompts(self, input_ids, attention_mask=None) -> list[torch.Tensor]:
        """Validate prompts and strip padding: a [b, L] tensor (+ optional attention mask, left or
        right padding), a 1-D tensor, or a list of token lists → list of 1-D LongTensors."""
        return prompt_rows(input_ids, attention_mask, self.batch_size, self.vocab_size, self.context_buckets[-1],
                           self.n_positions)

    def sampling_params(self, top_k=None, top_p=None, temperature=None, do_sample=None,
                        repetition_penalty=None) -> torch.Tensor:
        """Per-row [batch_size, 4] parameters (``sampling.TOP_K`` .. ``REPETITION_PENALTY``); unset
        values come from the SamplingConfig (the repetition penalty: 1.0, off), and
        ``do_sample=False`` forces greedy (temperature 0) for every row."""
        s = self.settings.sampling
        do_sample = s.do_sample if do_sample is None else do_sample
        temperature = s.temperature if temperature is None else temperature
        params = sampling_params(self.batch_size, s.top_k if top_k is None else top_k,
                                 s.top_p if top_p is None else top_p, temperature,
                                 1.0 if repetition_penalty is None else repetition_penalty)
        if not do_sample:
            params[:, TEMPERATURE] = 0.0
        return params

    # ------------------------------------------------------------------ running graphs
    def _key(self, n: int, m: int, kv: int, params: torch.Tensor, return_probs: bool = False,
             top_k: int = 0) -> GraphKey:
        """The graph for n tokens, m logits, KV bucket kv and these sampling params [B, 4] (a penalty
        graph when ``presence`` is tracked and some row has a repetition penalty)."""
        do_sample = any_sampled(params)
        top_filter = do_sample and needs_filter(params, self.settings.sampling.global_topk)
        penalty = self.kv.presence is not None and any_penalised(params)
        return GraphKey(n, m, kv, do_sample, return_probs, top_filter, penalty=penalty, top_k=top_k)

    def _run(self, key: GraphKey, input_ids, position_ids, cache_lengths, token_mask, logit_index,
             params, rng: RowGenerators | torch.Generator | None, features: torch.Tensor | None = None,
             seq_ids: torch.Tensor | None = None) -> StepOutput:
        """Run one graph. Sampling graphs draw their noise from ``rng``: one generator per row
        (``RowGenerators``), one for all rows (``torch.Generator``), or None (torch's global one);
        greedy graphs draw nothing. Penalty graphs read ``presence`` (the ``seq_ids`` row of a
        single-row graph)."""
        dev, b = self.device, key.batch(self.batch_size)
        if not key.do_sample:
            uniform = torch.zeros(b, key.n_logits, device=dev)
        else:
            uniform = self._uniform(rng, b, key.n_logits, seq_ids)
        extra = ()
        if key.penalty:
            presence = self.kv.presence
            extra += (presence if seq_ids is None else presence[seq_ids.to(dev)],)
        extra += () if seq_ids is None else (seq_ids,)
        extra += () if features is None else (features.to(dtype=self.dtype),)
        # inputs on the device with standard strides (also on size-1 dims: slices such as tail[:, 1:]
        # keep their parent's stride there), since a compiled graph is specialised on its inputs' strides
        inputs = [t.to(dev).clone(memory_format=torch.contiguous_format)
                  for t in (input_ids, position_ids, cache_lengths, token_mask, logit_index, params, uniform, *extra)]
        if key in self.graphs.ran or self.settings.backend not in COMPILING:
            with torch.no_grad():
                out = self.graph(key)(*inputs)
        else:
            out = self.graphs.first_run(key, inputs, self.progress, self.graph)
        self.kv.forget_from(cache_lengths, seq_ids)
        tokens, probs, logits, hidden = out if key.return_probs else (out[0], None, *out[1:])
        hidden, aux = split_hidden(hidden, self.config.hidden_size)
        return StepOutput(tokens, logits, hidden, probs, aux)

    def prefill(self, prompts: list[torch.Tensor], params: torch.Tensor,
                rng: RowGenerators | torch.Generator | None = None, features: torch.Tensor | None = None,
                rows: list[int] | None = None) -> StepOutput:
        """Context encoding → tokens [b, 1] sampled after each prompt (logits of its last token),
        hidden [b, L, H] of every prompt position, in ``prompts`` order.

        ``rows=None``: prompt i goes to row i and every row restarts (one batch graph; rows past the
        prompts get a 1-token dummy prompt; b = batch_size). ``rows``: prompt i goes to row rows[i]
        (one single-row graph each, NxD's ``seq_ids``) and no other row's cache or length changes
        (b = len(rows)). ``params`` [batch_size, 4] are indexed by row. ``features`` [b, >= longest
        prompt, F]: per-token inputs of feature-reading models (EAGLE).

        ``prefix_cache`` models: a row whose cache holds the KV of the prompt's first p tokens (``KVState.cached``)
        encodes only the rest, at positions p.. over the kept slots, when that takes a smaller context bucket
        (``_kept``); its hidden states then cover the new positions only (``hidden[:, :len - p]``), which is why
        feature-reading drafts refuse such a target. With ``rows=None`` the prompts then go through single-row
        graphs and the rows past them keep their slots (length 1)."""
        for r in rows or ():
            if not 0 <= r < self.batch_size:
                raise ValueError(f"row {r} is outside the batch [0, {self.batch_size})")
        kept = [Kept()] * len(prompts)
        if self.prefix_cache:
            kept = [self._kept(r, p, features is None)
                    for r, p in zip(range(len(prompts)) if rows is None else rows, prompts)]
        single = rows if rows is not None or not any(k.n for k in kept) else list(range(len(prompts)))
        if single is not None:
            outs = [self._prefill_row(r, p, params, rng, None if features is None else features[i:i + 1], kept[i])
                    for i, (r, p) in enumerate(zip(single, prompts))]
            self.prompt_tokens_kept += sum(k.n for k in kept)
            if rows is None:
                self.kv.lengths[len(prompts):] = 1
            width = max(o.hidden.shape[1] for o in outs)
            hidden = torch.cat([_fit(o.hidden, width) for o in outs])
            aux = None if outs[0].aux_hidden is None else torch.cat([_fit(o.aux_hidden, width) for o in outs])
            return StepOutput(torch.cat([o.tokens for o in outs]), torch.cat([o.logits for o in outs]), hidden,
                              aux_hidden=aux)
        lens = torch.tensor([len(p) for p in prompts] + [1] * (self.batch_size - len(prompts)))
        bucket = pick_bucket(self.context_buckets, int(lens.max()), "prompt length")
        ids = torch.zeros(self.batch_size, bucket, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.as_tensor(p)      # a 1-D tensor or a list of ids
        b = self.batch_size
        for i in range(b):
            self._store_record(i, kept[i].own if i < len(prompts) else 0)
        key = self._key(bucket, 1, bucket, params)
        out = self._run(key, ids, torch.arange(bucket).expand(b, bucket), torch.zeros(b, dtype=torch.long),
                        causal_mask(bucket, lens), (lens - 1).unsqueeze(1), params, rng, _fit(features, bucket))
        self.kv.lengths.copy_(lens)
        for i, p in enumerate(prompts):
            self.kv.keep(i, p)
        return out

    def _kept(self, row: int, prompt: torch.Tensor, keep: bool = True) -> Kept:
        """What row ``row``'s encoding of ``prompt`` keeps (``prefill``): the longer of what the row holds and what
        the prefix store holds, when encoding only the rest takes a smaller context bucket and fits a KV bucket;
        nothing when neither does or not ``keep``."""
        ids = torch.as_tensor(prompt).tolist()
        own = self.kv.shared_prefix(row, ids)
        if not keep:
            return Kept(own=own)
        stored, entry = (0, None) if self.prefix_store is None else self.prefix_store.longest(ids)
        for n, source in ([(stored, entry)] if stored > own else []) + [(own, None)]:
            rest = pick_bucket(self.context_buckets, len(ids) - n, "prompt length")
            if n and n + rest <= self.kv_buckets[-1] and \
                    rest < pick_bucket(self.context_buckets, len(ids), "prompt length"):
                return Kept(n, source, own)
        return Kept(own=own)

    def _store_record(self, row: int, shared: int) -> None:
        """Before a prompt sharing its first ``shared`` tokens with row ``row``'s record overwrites the slots past
        them: the record and its slots into the prefix store, when that loses at least ``STORE_MIN_TOKENS`` of it."""
        record = self.kv.cached[row]
        if self.prefix_store is not None and len(record) - shared >= STORE_MIN_TOKENS:
            n = len(record)
            self.prefix_store.add(record, lambda: [b[row, :n].to("cpu", copy=True) for b in self._cache_buffers()])

    def _restore(self, row: int, entry: StoredPrefix, n: int) -> None:
        """Row ``row``'s slots [0, n) := the stored prefix ``entry``'s first n."""
        for buffer, slots in zip(self._cache_buffers(), entry.slots):
            buffer[row, :n].copy_(slots[:n])
        self.kv.keep(row, entry.tokens[:n])
        self.prefix_store.hit(entry)

    def _cache_buffers(self) -> list[torch.Tensor]:
        """Every layer's per-slot cache buffers (``Attention.cache_buffers``), in module order."""
        return [b for m in self.lm.modules() if isinstance(m, Attention) for b in m.cache_buffers()]

    def _prefill_row(self, row: int, prompt: torch.Tensor, params: torch.Tensor, rng: RowGenerators | None,
                     features: torch.Tensor | None, keeping: Kept) -> StepOutput:
        """Context encoding of one prompt into cache row ``row`` (a single-row graph): its tokens from
        kept = ``keeping.n`` (``_kept``) on, written at slots kept.. and attending to the kept slots too (the row's
        own, or first restored from the stored prefix ``keeping.entry``)."""
        self._store_record(row, keeping.own)
        kept = keeping.n
        if keeping.entry is not None:
            self._restore(row, keeping.entry, kept)
        n = len(prompt) - kept
        bucket = pick_bucket(self.context_buckets, n, "prompt length")
        kv = bucket if kept == 0 else pick_bucket(self.kv_buckets, kept + bucket, "KV length")
        ids = torch.zeros(1, bucket, dtype=torch.long)
        ids[0, :n] = torch.as_tensor(prompt)[kept:]
        row_params = params[row:row + 1]
        key = replace(self._key(bucket, 1, kv, row_params), single_row=True)
        out = self._run(key, ids, kept + torch.arange(bucket).unsqueeze(0), torch.tensor([kept]),
                        causal_mask(bucket, torch.tensor([n])), torch.tensor([[n - 1]]), row_params, rng,
                        _fit(features, bucket), torch.tensor([row]))
        self.kv.lengths[row] = len(prompt)
        self.kv.keep(row, prompt)
        return out

    def can_extend(self, start: int, n: int) -> bool:
        """Whether ``extend`` encodes n > 0 tokens after ``start`` held slots: n fits a context bucket and start +
        that bucket the largest KV bucket."""
        return 0 < n <= self.context_buckets[-1] and \
            start + pick_bucket(self.context_buckets, n) <= self.kv_buckets[-1]

    def extend(self, row: int, tokens: torch.Tensor, start: int, params: torch.Tensor,
               rng: RowGenerators | None = None) -> StepOutput:
        """Row ``row``'s slots [0, ``start``) hold the KV of tokens[:start] (the caller's word): encode
        tokens[start:] (1-D ids) at slots start.. in one single-row context graph attending to them → the
        token after ``tokens`` [1, 1]; the row's length becomes len(tokens). A cache that fell behind its
        sequence catches up in one call instead of token steps. ValueError unless ``can_extend``."""
        if start < 0 or not self.can_extend(start, len(tokens) - start):
            raise ValueError(f"cannot encode tokens[{start}:] of {len(tokens)} after slot {start}: it takes 1 to "
                             f"{self.context_buckets[-1]} tokens (the largest context bucket), whose bucket after "
                             f"the held slots fits {self.kv_buckets[-1]} (the largest KV bucket)")
        return self._prefill_row(row, tokens, params, rng, None, Kept(start, None, start))

    def _uniform(self, rng: RowGenerators | torch.Generator | None, b: int, n_logits: int,
                 seq_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A sampling graph's noise [b, n_logits]: from each row's own stream (``RowGenerators``), one stream
        for every row (``torch.Generator``) or torch's global one (None)."""
        if rng is None or isinstance(rng, torch.Generator):
            return torch.rand(b, n_logits, generator=rng, device=self.device)
        return rng.uniform(n_logits, None if seq_ids is None else seq_ids.tolist())

    def skip_draws(self, rng: RowGenerators | torch.Generator | None, n_logits: int) -> None:
        """Consume the noise of one sampling ``step`` of ``n_logits`` positions for every row without running it:
        a proposer that stops drafting early leaves each row's random stream where the full step would
        (so a row's samples do not depend on when its batch neighbours stop)."""
        self._uniform(rng, self.batch_size, n_logits)

    def step(self, tokens: torch.Tensor, params: torch.Tensor, rng: RowGenerators | torch.Generator | None = None,
             token_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
             advance: bool = True, return_probs: bool = False, rows: torch.Tensor | None = None,
             logit_index: torch.Tensor | None = None, features: torch.Tensor | None = None,
             top_k: int = 0) -> StepOutput:
        """Run n new tokens per row (tokens [B, n]) at slots ``lengths + i``.

        token_mask [B, n, n] or [n, n] (default causal); position_ids [B, n] (default lengths + i).
        ``advance`` moves the lengths of ``rows`` (bool [B], default all) forward by n.
        ``logit_index`` [B, m]: the m positions whose logits/tokens are returned (default all n).
        ``features`` [B, n, F]: per-token inputs of feature-reading models (EAGLE drafts).
        ``top_k`` > 0 (greedy ``params`` only): return the K most likely tokens and their log-softmax at
        each of the m positions (``StepOutput``), computed in the graph.
        """
        b, n = tokens.shape
        if top_k and (return_probs or any_sampled(params)):
            raise ValueError("top_k scoring steps are greedy and return no probabilities: pass greedy params "
                             "(sampling_params(do_sample=False)) and return_probs=False")
        if b != self.batch_size:
            raise ValueError(f"step expects {self.batch_size} rows, got {b}")
        lengths = self.kv.lengths
        needed = int(lengths.max()) + n
        if needed > self.n_positions:
            raise ValueError(f"a row would reach {needed} positions; n_positions={self.n_positions}")
        kv = pick_bucket(self.kv_buckets, needed, "KV length")
        if token_mask is None:
            token_mask = causal_mask(n)
        if token_mask.dim() == 2:
            token_mask = token_mask.expand(b, n, n)
        if position_ids is None:
            position_ids = lengths.unsqueeze(1) + torch.arange(n)
        if logit_index is None:
            logit_index = torch.arange(n).expand(b, n)
        key = self._key(n, logit_index.shape[1], kv, params, return_probs, top_k)
        out = self._run(key, tokens.long(), position_ids, lengths.clone(), token_mask,
                        logit_index, params, rng, features)
        if advance:
            lengths += n if rows is None else rows.long().cpu() * n
        return out

    # ------------------------------------------------------------------ generation / persistence (``persistence``)
    def generate(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        """Target-only generation: the request loop of ``specdec.core.engine`` with no proposer
        (arguments: ``Engine.generate``)."""
        from .engine import Engine
        return Engine(self).generate(input_ids, attention_mask, **kwargs)

    def save(self, directory: str | Path) -> None:
        """Write the runtime settings and (``compiled``) the Inductor cache artifacts of every graph
        built so far, or (``neuron``) the compiled program, so ``load`` in a fresh process skips code
        generation. At ``tp_degree > 1`` every rank calls it: rank 0 writes the settings, each rank its
        artifacts."""
        save_compiled(self.graphs, self.source, directory)

    @classmethod
    def load(cls, directory: str | Path, progress: bool = True) -> DecoderModel:
        """Re-create a saved model: weights from its checkpoint, compiled graphs from the cache."""
        saved = read_saved(directory)
        model = cls.from_pretrained(saved.checkpoint, progress=progress, **saved.settings)
        return model._load_compiled(directory, saved.keys, progress, saved.compaction_slots)

    def _load_compiled(self, directory: str | Path, keys: list[GraphKey], progress: bool,
                       compaction_slots: tuple[int, ...] | list[int] = ()) -> DecoderModel:
        """Unpack the saved compile cache (if any) and warm ``keys`` from it (``neuron``: load the saved
        program with ``keys`` and the compaction graphs of ``compaction_slots``); then clear the KV cache."""
        load_compiled(self.graphs, directory, keys, progress, compaction_slots)
        self.reset()
        return self


def _fit(features: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """features [B, L, F] cut or zero-padded to [B, n, F]."""
    if features is None or features.shape[1] == n:
        return features
    if features.shape[1] > n:
        return features[:, :n]
    pad = features.new_zeros(features.shape[0], n - features.shape[1], features.shape[2])
    return torch.cat([features, pad], 1)
