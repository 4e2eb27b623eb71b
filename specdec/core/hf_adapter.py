"""Drive a :class:`~specdec.core.decoder.DecoderModel` with Hugging Face ``generate()``.

``HFAdapter(model)`` is a ``transformers`` ``PreTrainedModel`` + ``GenerationMixin`` whose forward
runs the static-shape graphs, so every decoding mode of ``generate()`` that needs nothing but
next-token logits works on top of the runtime: greedy, sampling (HF's logits processors and
warpers run on the host), stopping criteria, streamers, ``output_scores``/``output_logits``, and
assisted generation (``assistant_model=HFAdapter(draft)``, or any HF model sharing the vocabulary)::

    m = DecoderModel.from_pretrained(path, batch_size=2, n_positions=256, backend="eager")
    hf_like = HFAdapter(m)                       # or as_hf(m)
    out = hf_like.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False)

How the cache is kept
---------------------
The adapter keeps the runtime's static KV cache and ignores HF's. It keeps, per batch row, a host
record of the token ids whose keys/values sit in that row's cache slots ``[0, len)``. On every
forward it is given the *full* sequence (``prepare_inputs_for_generation`` is overridden so HF's
slicing to "new tokens only" never happens) and:

1. strips each row's padding with the attention mask (row ``r``'s real tokens are stored from slot
   0 at positions ``0..L_r-1``, which are HF's ``position_ids`` for left padding);
2. finds the longest common prefix between each row and its record, and the first position whose
   logits are requested (``logits_to_keep``); a row must (re)run everything from the smaller of the
   two — at least its last token;
3. if some row has nothing usable cached, runs context encoding (``prefill``) for all rows (up to
   the first requested position, at most the largest context bucket), then continues as below;
4. otherwise rolls rows back by length (``set_lengths``) and runs one ``step(tokens [B, n])``
   with ``n`` = the most new tokens any row needs (1 in plain decoding, ``candidates + 1`` when
   the target verifies an assistant's candidates). Rows that need fewer new tokens are rolled back
   further so all rows run ``n`` tokens (recomputing already-cached tokens is free: the batch graph
   computes ``B x n`` positions anyway); a row shorter than ``n`` runs from slot 0 and is padded at
   the end with filler tokens, whose slots lie past the row's length and are masked later.

Rollback is just moving lengths; divergent suffixes (rejected candidates, a new prompt in a later
``generate`` call) are overwritten. A prompt that starts like the previous call's sequence reuses
its cache (prompt caching across calls) — this is exact, since the record says which ids the
cached slots hold. The records are dropped (the next forward context-encodes) when something else
ran the ``DecoderModel`` in between: another ``HFAdapter`` on the same model (the adapter tags the
model with a private attribute on each forward), or direct use that moved its ``lengths``. After
direct use that could leave the lengths unchanged, call :meth:`HFAdapter.clear_cache`.

What forward returns
--------------------
``CausalLMOutputWithPast(logits [b, M, V] float32, past_key_values=<StaticCacheView>)``, where the
logits are those of the **last M columns** of ``input_ids``: ``M = logits_to_keep`` when it is a
positive int (``generate`` always passes one: 1 in plain decoding, ``candidate_length + 1`` in
assisted generation), otherwise the columns of the tokens the call ran through a token-generation
step (``n``), or only the last column after context encoding. Column ``c`` holds the next-token
logits given row ``r``'s real tokens up to and including column ``c`` (zeros for padding columns
before the first real token). Full-sequence logits (HF's ``logits_to_keep=0``) are not produced.

The returned ``StaticCacheView`` is a ``transformers`` ``Cache`` that holds no tensors: it reports
the number of columns the adapter has cached for the current ``generate`` call and turns
``crop(-k)`` (used by assisted generation to drop rejected candidates) into a rollback of the
records. It exists so that HF's assisted-generation code, which requires a croppable cache object,
works; HF never allocates a ``DynamicCache`` for the adapter.

Limitations
-----------
- batch rows ``<= batch_size`` (missing rows are dummy rows); ``num_beams > 1``, contrastive
  search, ``inputs_embeds``, ``output_attentions``/``output_hidden_states`` are not supported;
- every sequence must fit ``n_positions`` (else ``ValueError``); a prompt longer than the largest
  context bucket is context-encoded up to that bucket and the rest runs as one wide step;
- HF's ``generate`` with an attention mask that has holes (right padding) is computed on the real
  tokens only (positions contiguous), as HF does for left padding;
- cost: plain decoding runs one ``n=1`` step per token, as the runtime's own loop; a row whose
  prefix diverges is only rolled back (no copies); context encoding re-runs *all* rows whenever
  some row has nothing usable cached (e.g. a new prompt in a later call);
- the graphs run greedy (sampling happens in HF on the returned logits). With backends other than
  ``eager``, step widths are padded up to ``step_buckets`` (powers of two by default) so varying
  candidate counts do not compile a graph per width.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .buckets import default_buckets
from .decoder import DecoderModel

__all__ = ["AdapterStats", "HFAdapter", "StaticCacheView", "as_hf"]

# The name ``generate`` passes the cache under, in the model kwargs and the forward's output: ``cache``
# from transformers 5.24 on, ``past_key_values`` before.
CACHE_KEY = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


@dataclass
class AdapterStats:
    """Counters of what the adapter ran (since construction or :meth:`HFAdapter.clear_cache`).

    prefills: context-encoding calls; steps: token-generation calls; step_widths: histogram of the
    number of tokens per row of each step (before bucket padding); reused: tokens found in the cache
    (common prefix) summed over rows and forwards; recomputed: cached tokens re-run to line rows up
    or to produce requested logits; rolled_back: cached tokens discarded because the sequence
    diverged from the record (rejected candidates, a different prompt) or HF cropped them.
    """

    prefills: int = 0
    steps: int = 0
    step_widths: Counter = field(default_factory=Counter)
    reused: int = 0
    recomputed: int = 0
    rolled_back: int = 0


class StaticCacheView(Cache):
    """HF-facing handle on the adapter's static KV cache (holds no tensors).

    ``get_seq_length()`` is the number of ``input_ids`` columns cached in this ``generate`` call;
    ``crop(-k)`` drops the last k columns from the adapter's per-row records (the rows are rolled
    back by length on the next forward); ``reset()`` clears the records.
    """

    def __init__(self, adapter: HFAdapter):
        super().__init__(layers=[])
        self._adapter = adapter
        self.columns = 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._adapter.decoder.n_positions

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        if tokens_to_remove == 0 or self.columns == 0:
            return
        self.columns = max(self.columns + int(tokens_to_remove), 0)
        self._adapter._crop_records(self.columns)

    def reset(self) -> None:
        self.columns = 0
        self._adapter.clear_cache()

    def activate_past_recording(self) -> None:  # rollback is always possible: nothing to record
        pass

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("HFAdapter does not support beam search (num_beams > 1)")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("HFAdapter does not support expanding a cached batch (beam search / contrastive)")

    def batch_select_indices(self, indices):
        raise NotImplementedError("HFAdapter does not support selecting cached batch rows (beam search / contrastive)")


_OWNER = "_specdec_hf_adapter_token"  # set on the DecoderModel: which adapter last ran it


class HFAdapter(PreTrainedModel, GenerationMixin):
    """A ``transformers`` causal LM backed by a ``DecoderModel`` (see the module docstring).

    model: the runtime model (any backend; its KV cache is used, its sampling settings are not).
    generation_config: defaults for ``generate``; by default the checkpoint's
      ``generation_config.json`` when present, else derived from its config.
    step_buckets: allowed step widths (tokens per row); a step of n tokens is padded to the
      smallest width >= n. Default: exact widths for ``backend="eager"``, powers of two otherwise.
    """

    base_model_prefix = "specdec"
    main_input_name = "input_ids"
    _is_stateful = False

    def __init__(self, model: DecoderModel, generation_config: GenerationConfig | None = None,
                 step_buckets: list[int] | None = None):
        if not isinstance(model, DecoderModel):
            raise TypeError(f"HFAdapter wraps a specdec DecoderModel, got {type(model).__name__}")
        super().__init__(copy.deepcopy(model.config.hf_config))
        self.decoder = model
        if generation_config is None:
            path = Path(model.path)
            if path.is_dir() and (path / "generation_config.json").is_file():
                generation_config = GenerationConfig.from_pretrained(path)
        if generation_config is not None:
            self.generation_config = copy.deepcopy(generation_config)
        if step_buckets is None and model.settings.backend != "eager":
            step_buckets = default_buckets(model.n_positions, smallest=1)
        if step_buckets is not None:
            step_buckets = sorted({int(w) for w in step_buckets})
            if not step_buckets or step_buckets[0] < 1:
                raise ValueError(f"step_buckets must be positive widths, got {step_buckets!r}")
        self.step_buckets = step_buckets
        self._params = model.sampling_params(do_sample=False)  # graphs run greedy; HF samples on the host
        # private noise generator: the graphs draw (unused) uniforms, which must not consume the
        # global RNG that HF's sampling uses
        self._generator = torch.Generator(model.device).manual_seed(0)
        self.stats = AdapterStats()
        self._records: list[torch.Tensor] = []
        self._seen_lengths = model.lengths.clone()
        self._last_cum: torch.Tensor | None = None
        self._token = object()
        self.clear_cache()

    # ------------------------------------------------------------------ HF plumbing
    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    def get_input_embeddings(self):
        return self.decoder.lm.model.embed_tokens

    def get_output_embeddings(self):
        return self.decoder.lm.lm_head

    def clear_cache(self) -> None:
        """Forget what the KV cache holds (the next forward context-encodes) and zero the stats."""
        self._records = [torch.zeros(0, dtype=torch.long) for _ in range(self.decoder.batch_size)]
        self._seen_lengths = self.decoder.lengths.clone()
        self._last_cum = None
        self.stats = AdapterStats()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Install a :class:`StaticCacheView` instead of HF's ``DynamicCache``/``StaticCache``."""
        if generation_config.use_cache is False:
            return
        cache = model_kwargs.get(CACHE_KEY)
        if isinstance(cache, StaticCacheView) and cache._adapter is self:
            cache._is_user_defined = True
            return
        if cache is not None:
            warnings.warn(f"HFAdapter keeps its own static KV cache; the given {type(cache).__name__} is ignored",
                          stacklevel=3)
        model_kwargs[CACHE_KEY] = StaticCacheView(self)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        """Always pass the full ``input_ids`` and 2-D ``attention_mask``: the forward diffs the
        sequence against its own cache record (``next_sequence_length`` is ignored)."""
        if inputs_embeds is not None and is_first_iteration:
            raise NotImplementedError("HFAdapter needs input_ids; inputs_embeds is not supported")
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, CACHE_KEY: kwargs.get(CACHE_KEY)}
        for key in ("logits_to_keep", "use_cache", "output_attentions", "output_hidden_states"):
            if key in kwargs:
                inputs[key] = kwargs[key]
        return inputs

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, logits_to_keep: int | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                cache: Cache | None = None, **kwargs) -> CausalLMOutputWithPast:
        """Logits of the last ``logits_to_keep`` columns of ``input_ids`` (see the module docstring).
        The cache comes as ``cache`` (transformers >= 5.24) or ``past_key_values`` (before)."""
        if input_ids is None:
            raise ValueError("HFAdapter.forward needs input_ids (inputs_embeds is not supported)")
        if output_attentions or output_hidden_states:
            raise NotImplementedError("HFAdapter returns logits only (output_attentions / output_hidden_states)")
        if kwargs.get("inputs_embeds") is not None:
            raise NotImplementedError("HFAdapter needs input_ids; inputs_embeds is not supported")
        dec = self.decoder
        ids = torch.as_tensor(input_ids).cpu()
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.is_floating_point():
            raise ValueError(f"input_ids must be integer ids of shape [batch, length], got {tuple(ids.shape)}")
        ids = ids.long()
        b, width = ids.shape
        if b > dec.batch_size:
            raise ValueError(f"batch of {b} rows exceeds the DecoderModel's compiled batch_size={dec.batch_size}")
        if attention_mask is None:
            mask = torch.ones(b, width, dtype=torch.bool)
        else:
            mask = torch.as_tensor(attention_mask).cpu()
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask must be 2-D and match input_ids {tuple(ids.shape)}, "
                                 f"got {tuple(mask.shape)}")
            mask = mask.bool()
        lens = mask.sum(1)
        if bool((lens == 0).any()):
            raise ValueError(f"row {int(torch.argmax((lens == 0).long()))} has no unmasked tokens")
        if int(lens.max()) > dec.n_positions:
            raise ValueError(f"a row has {int(lens.max())} tokens but the DecoderModel was built with "
                             f"n_positions={dec.n_positions}; lower max_new_tokens/max_length or rebuild it "
                             "with a larger n_positions")
        if bool((ids[mask] < 0).any()) or bool((ids[mask] >= dec.vocab_size).any()):
            raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {dec.vocab_size})")
        if isinstance(logits_to_keep, torch.Tensor):
            raise NotImplementedError("logits_to_keep as a tensor of indices is not supported; pass an int")
        keep = int(logits_to_keep) if logits_to_keep else None

        cum = mask.long().cumsum(1) - 1  # real-token index of the last real token at or before each column
        seqs = [ids[r][mask[r]] for r in range(b)]
        if not torch.equal(dec.lengths, self._seen_lengths) or getattr(dec, _OWNER, None) is not self._token:
            # someone else ran the DecoderModel since our last forward: the records are stale
            self._records = [torch.zeros(0, dtype=torch.long) for _ in range(dec.batch_size)]
        setattr(dec, _OWNER, self._token)
        pieces, ran = self._encode(seqs, cum, keep)
        self._seen_lengths = dec.lengths.clone()
        self._last_cum = cum

        n_cols = min(keep if keep is not None else ran, width)
        logits = self._gather(pieces, cum[:, width - n_cols:])
        view = cache if cache is not None else past_key_values
        if isinstance(view, StaticCacheView) and view._adapter is self:
            view.columns = width
        else:
            view = None
        out = CausalLMOutputWithPast(logits=logits, **{CACHE_KEY: view})
        return out if return_dict is not False else out.to_tuple()

    # ------------------------------------------------------------------ internals
    def _common_prefix(self, row: int, seq: torch.Tensor) -> int:
        rec = self._records[row]
        k = min(len(rec), len(seq))
        if k == 0:
            return 0
        diff = (rec[:k] != seq[:k]).nonzero()
        return int(diff[0]) if diff.numel() else k

    def _encode(self, seqs: list[torch.Tensor], cum: torch.Tensor, keep: int | None):
        """Bring each row's cache up to its full sequence; return the computed logits per row as
        ``[(first real index, logits [k, V]), ...]`` and the width of the last graph call."""
        dec, stats = self.decoder, self.stats
        b, width = cum.shape
        lens = [len(s) for s in seqs]
        # first real index whose logits are requested
        if keep is None:
            first = [n - 1 for n in lens]
        else:
            col = max(width - keep, 0)
            first = [max(int(cum[r, col]), 0) for r in range(b)]
        prefix = [self._common_prefix(r, seqs[r]) for r in range(b)]
        for r in range(b):
            stats.rolled_back += len(self._records[r]) - prefix[r]
        start = [min(p, f) for p, f in zip(prefix, first)]
        pieces: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(b)]
        ran, prefilled = 1, min(start) == 0
        if prefilled:
            # context encoding of every row up to its first requested position (at most the
            # largest context bucket; a step runs the rest)
            stats.recomputed += sum(min(p, f + 1) for p, f in zip(prefix, first))
            longest = dec.context_buckets[-1]
            prompts = [seqs[r][: min(first[r] + 1, longest)] for r in range(b)]
            out = dec.prefill(prompts, self._params, self._generator)
            stats.prefills += 1
            for r in range(b):
                pieces[r].append((len(prompts[r]) - 1, out.logits[r, -1:].float().cpu()))
            self._records = [p.clone() for p in prompts] + \
                [torch.zeros(0, dtype=torch.long)] * (dec.batch_size - b)
            start = [len(p) for p in prompts]
            prefix = list(start)
        if any(s < n for s, n in zip(start, lens)):
            ran = self._step(seqs, start, prefix, pieces, count_reuse=not prefilled)
        return pieces, ran

    def _step_width(self, n: int, begin: list[int]) -> int:
        if self.step_buckets is None:
            return n
        room = self.decoder.n_positions - max(begin)
        for w in self.step_buckets:
            if n <= w <= room:
                return w
        return n

    def _step(self, seqs, start, prefix, pieces, count_reuse: bool = True) -> int:
        """One ``step`` running every row from ``begin_r = max(L_r - n, 0)`` (<= its start)."""
        dec, stats = self.decoder, self.stats
        b, B = len(seqs), dec.batch_size
        lens = [len(s) for s in seqs]
        n = max(L - s for L, s in zip(lens, start))
        begin = [max(L - n, 0) for L in lens]
        w = self._step_width(n, begin)
        tokens = torch.zeros(B, w, dtype=torch.long)
        for r in range(b):
            chunk = seqs[r][begin[r]:]
            tokens[r, : len(chunk)] = chunk
            tokens[r, len(chunk):] = chunk[-1]  # filler past the row's end (masked later)
            stats.recomputed += max(prefix[r] - begin[r], 0)
            stats.reused += begin[r] if count_reuse else 0
        lengths = torch.zeros(B, dtype=torch.long)  # unused rows run filler from slot 0
        lengths[:b] = torch.tensor(begin)
        dec.set_lengths(lengths)
        out = dec.step(tokens, self._params, self._generator, advance=False)
        lengths[:b] = torch.tensor(lens)
        dec.set_lengths(lengths)
        stats.steps += 1
        stats.step_widths[n] += 1
        for r in range(b):
            pieces[r].append((begin[r], out.logits[r, : lens[r] - begin[r]].float().cpu()))
        self._records = [s.clone() for s in seqs] + [torch.zeros(0, dtype=torch.long)] * (B - b)
        return n

    def _gather(self, pieces, index: torch.Tensor) -> torch.Tensor:
        """logits [b, M, V] for real-token indices ``index [b, M]`` (negative: padding → zeros)."""
        b, m = index.shape
        out = torch.zeros(b, m, self.decoder.vocab_size, dtype=torch.float32)
        for r in range(b):
            covered = index[r] < 0
            for begin, logits in pieces[r]:  # later pieces win
                sel = (index[r] >= begin) & (index[r] < begin + logits.shape[0])
                out[r, sel] = logits[index[r][sel] - begin]
                covered |= sel
            if not bool(covered.all()):
                raise RuntimeError("HFAdapter internal error: requested logits were not computed")
        return out.to(self.device)

    def _crop_records(self, columns: int) -> None:
        """Keep only what the first ``columns`` columns of the last forward's input hold."""
        if self._last_cum is None:
            return
        b, width = self._last_cum.shape
        if columns >= width:
            return
        for r in range(b):
            n = int(self._last_cum[r, columns - 1]) + 1 if columns > 0 else 0
            n = max(n, 0)
            self.stats.rolled_back += max(len(self._records[r]) - n, 0)
            self._records[r] = self._records[r][:n]


def as_hf(model: DecoderModel, **kwargs) -> HFAdapter:
    """``HFAdapter(model, **kwargs)``: the ``DecoderModel`` as a ``transformers`` generation model."""
    return HFAdapter(model, **kwargs)
