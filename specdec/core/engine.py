"""The request loop: requests occupy rows (slots) of the static batch; a step advances every active row.

Target-only generation and every speculative strategy run this one loop. Per row r, with
S_r = prompt + emitted tokens, the target's KV cache holds S_r[:-1] before each step (S_r[-1] was
sampled but not yet fed). A step returns, per row, the number of accepted drafts n_r and the n_r + 1
emitted tokens (the accepted drafts, then the target's correction or bonus token):

- no speculator: one decode step (k = 0): n_r = 0, the target's next token;
- a ``Speculator`` (``specdec.speculation.speculative``): its proposer proposes, its verifier runs the target over
  the proposal and applies the shared acceptance rules.

The engine appends the emitted tokens one position at a time, so EOS, the row's budget and stopping
criteria cut the run exactly where target-only decoding stops; a finished row stays in the batch
(static shapes) with its output frozen until it is released. The speculator hears of every request's end
once (``finished``: when its row finishes, or when it is released or dropped unfinished), with the
final length, so a proposer that learns across requests (suffix decoding's cache) sees the output as
emitted. Rows are independent: ``add`` prefills one row (a single-row context-encoding graph) while the
others keep their state, and each row draws its random numbers from its own generator, so a row's output
does not depend on its neighbours.

Repetition penalty: the engine tracks the target's ``presence`` (``DecoderModel.track_presence``) and
keeps it equal to each row's S_r: reset to the prompt before the row's context encoding, then marked
with the tokens actually appended. The target's graphs add the tokens of each verified position's own
prefix (``specdec.core.graphs``), so every strategy verifies against the penalised distribution
without knowing about it; drafts do not track presence and propose unpenalised.

    engine = Engine(target)                    # or Engine(target, speculator)
    row = engine.add(prompt_ids, max_new_tokens=64, temperature=0.7, seed=1)
    while engine.active_rows:
        new = engine.step()                    # {row: [tokens emitted this step]}
    engine.release(row)

``generate`` is the batch form (HF ``generate`` arguments and output format) built on the same rows.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .model import causal_mask
from .request import format_output, prepare_request, stop_requested
from .sampling import RowGenerators
from .stats import SpecStats
from .target import StepOutput, Target


@dataclass
class StepResult:
    """One step's outcome per row (host tensors): num_accepted [B] long, emitted [B, w] long (row r's
    tokens are emitted[r, :num_accepted[r] + 1]), drafted [B] long (draft tokens proposed)."""

    num_accepted: torch.Tensor
    emitted: torch.Tensor
    drafted: torch.Tensor


def decode_step(target: Target, tail: torch.Tensor, params: torch.Tensor, rng: RowGenerators,
                active: torch.Tensor) -> StepOutput:
    """A plain decode step (k = 0): S[-1] = tail[:, 1] at slot len(S) - 1 → the next token per row. The token of
    a row that is not ``active`` [B] bool is padding (``model.causal_mask``: kernels that skip padding do not
    compute it; its output is meaningless); such a row's cache holds at least the dummy sequence's first slot, so
    it still attends to something."""
    padding = None if bool(active.all()) else causal_mask(1, active.long())
    return target.step(tail[:, 1:], params, rng, token_mask=padding, advance=False)


class Speculator(Protocol):
    """What the loop needs from speculation (``specdec.speculation.speculative.Speculator`` implements it)."""

    def start(self, rows: list[int] | None, prompts: list[torch.Tensor], params: torch.Tensor,
              rng: RowGenerators, target_out: StepOutput) -> None:
        """After the target's context encoding of ``prompts`` into ``rows`` (None: rows 0.. b-1, all
        rows restarted); ``target_out`` rows are in ``prompts`` order."""

    def step(self, tail: torch.Tensor, lengths: torch.Tensor, active: torch.Tensor, params: torch.Tensor,
             rng: RowGenerators, stats: SpecStats) -> StepResult:
        """Advance every row once. tail [B, 2] = the last two tokens of S_r, lengths [B] = len(S_r),
        active [B] bool; the target's lengths are len(S_r) - 1. Times its phases into ``stats``."""

    def finished(self, rows: list[int], lengths: list[int]) -> None:
        """The requests in ``rows`` ended (EOS, budget, stopping criteria, release) with len(S_r) = ``lengths``
        (each request once, after the step that emitted its last token)."""


@dataclass
class Row:
    """A request in one row: its prompt, budget of new tokens, EOS ids, and the tokens so far."""

    prompt: list[int]
    budget: int
    eos: frozenset[int]
    new: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.new)

    def tail(self) -> list[int]:
        seq = self.prompt[-2:] + self.new[-2:]
        return seq[-2:]


class Engine:
    """Generation over ``target`` with an optional ``speculator``; ``stats`` accumulates every step."""

    def __init__(self, target: Target, speculator: Speculator | None = None):
        self.target, self.speculator = target, speculator
        target.track_presence()
        B = target.batch_size
        self.rows: list[Row | None] = [None] * B
        self.params = target.sampling_params(do_sample=False)          # free rows: greedy
        self.rng = RowGenerators(B, target.device)
        self.stats = SpecStats()         # every step so far
        self.last_stats = SpecStats()    # the latest ``generate`` call's
        self.on_tokens = None            # callback(rows: list[int]) after each emitted position

    # ------------------------------------------------------------------ rows
    @property
    def active_rows(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row is not None and not row.done]

    @property
    def free_rows(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row is None]

    def add(self, prompt, *, row: int | None = None, max_new_tokens: int | None = None,
            sequence_length: int | None = None, do_sample: bool | None = None, temperature=None, top_k=None,
            top_p=None, repetition_penalty=None, eos_token_id=None, seed: int | None = None) -> int:
        """Start a request in a free row (``row``, or the first free one) while the other rows keep
        their state: one single-row context encoding, the speculator started for that row, the first
        token emitted. ``prompt``: token ids, or a tokenizer's output of one prompt (a mapping with
        ``input_ids``). Returns the row. Invalid arguments raise before anything changes."""
        one = isinstance(prompt, Mapping)       # (its input_ids hold one row, or the check below says so)
        req = prepare_request(self.target, prompt if one else [prompt], max_new_tokens=max_new_tokens,
                              sequence_length=sequence_length, do_sample=do_sample, temperature=temperature,
                              top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                              eos_token_id=eos_token_id, seed=seed)
        if len(req.prompts) != 1:
            raise ValueError(f"add starts one request: its tokenizer output holds {len(req.prompts)} prompts")
        free = self.free_rows
        if row is None:
            if not free:
                raise RuntimeError(f"all {self.target.batch_size} rows are in use: release one first")
            row = self.best_row(req.prompts[0].tolist(), free)
        elif row not in free:
            raise ValueError(f"row {row} is not free (free rows: {free})")
        self.params[row] = req.params[0]
        self.rng.seed(row, req.seeds[0])
        self.rows[row] = Row(req.prompts[0].tolist(), int(req.budget[0]), frozenset(req.eos.tolist()))
        self.target.reset_presence(row, req.prompts[0])
        out = self.target.prefill(req.prompts, self.params, self.rng, rows=[row])
        if self.speculator is not None:
            with self.stats.timer("draft"):
                self.speculator.start([row], req.prompts, self.params, self.rng, out)
        self._emit_first([row], out.tokens[:, -1].cpu())
        return row

    def best_row(self, prompt: list[int], rows: list[int]) -> int:
        """Of ``rows`` (free), the one whose cache already holds most of ``prompt`` with ``prefix_cache`` (llama.cpp
        server's slot choice), else the first."""
        if not self.target.prefix_cache:
            return rows[0]
        return max(rows, key=lambda r: self.target.shared_prefix(r, prompt))

    def release(self, row: int) -> None:
        """Free a row (finished or not: an unfinished request ends here); its cache slots are simply
        overwritten by the next request."""
        current = self.rows[row]
        if current is not None and not current.done:
            self._finished([row])
        self.rows[row] = None
        self.rng.release(row)
        self.params[row] = self.target.sampling_params(do_sample=False)[row]

    def step(self) -> dict[int, list[int]]:
        """Advance every active row once → {row: tokens it emitted this step}."""
        B = self.target.batch_size
        live = [row if row is not None and not row.done else None for row in self.rows]
        if not any(live):
            return {}
        # one host → tensor conversion per step; free and finished rows get a dummy sequence: 2 tokens, or with
        # ``prefix_cache`` as long as the KV they keep (no longer than the longest active row's, so the KV bucket
        # stays), the dummy token's KV going to the slot past it
        active = torch.tensor([row is not None for row in live])
        lengths = torch.tensor([self._dummy_length(r, live) if row is None else row.length
                                for r, row in enumerate(live)])
        tail = torch.tensor([[0, 0] if row is None else row.tail() for row in live])
        self.target.set_lengths(lengths - 1)
        if self.speculator is None:
            with self.stats.timer("verify"):
                zeros = torch.zeros(B, dtype=torch.long)
                result = StepResult(zeros, decode_step(self.target, tail, self.params, self.rng, active).tokens.cpu(),
                                    zeros)
        else:
            result = self.speculator.step(tail, lengths, active, self.params, self.rng, self.stats)
        with self.stats.timer("other"):
            # the target's cache now holds S[:-1] of every active row (rejected slots rolled back)
            self.target.set_lengths(torch.where(active, lengths + result.num_accepted, lengths - 1))
            appended = self._emit(result.emitted, result.num_accepted)
            self.stats.update(result.num_accepted, result.drafted, active=active,
                              emitted=torch.tensor([len(appended.get(r, ())) for r in range(B)]))
        return appended

    def _dummy_length(self, r: int, live: list[Row | None]) -> int:
        """len(S) of free or finished row r's dummy sequence in a step over the ``live`` rows."""
        if not self.target.prefix_cache:
            return 2
        longest = max(row.length for row in live if row is not None)
        return max(2, min(self.target.cached_length(r), longest - 1) + 1)

    # ------------------------------------------------------------------ emission
    def _emit_first(self, rows: list[int], tokens: torch.Tensor) -> None:
        """The token sampled by the context encoding, for ``rows`` (tokens [len(rows)])."""
        self._emit(tokens.view(-1, 1), torch.zeros(len(rows), dtype=torch.long), rows)

    def _emit(self, emitted: torch.Tensor, num_accepted: torch.Tensor,
              rows: list[int] | None = None) -> dict[int, list[int]]:
        """Append row r's emitted[i, :num_accepted[i] + 1] (i = position of r in ``rows``, default
        all rows) one position at a time, stopping a row at EOS, its budget or ``on_tokens``' verdict;
        the appended tokens are marked in the target's ``presence``."""
        rows = list(range(len(self.rows))) if rows is None else rows
        live = [(i, r) for i, r in enumerate(rows) if self.rows[r] is not None and not self.rows[r].done]
        counts = num_accepted.tolist()
        table = emitted.tolist()
        appended: dict[int, list[int]] = {}
        for j in range(emitted.shape[1]):
            now = [(i, r) for i, r in live if j <= counts[i] and not self.rows[r].done]
            if not now:
                break
            for i, r in now:
                row, token = self.rows[r], table[i][j]
                row.new.append(token)
                appended.setdefault(r, []).append(token)
                if token in row.eos or len(row.new) >= row.budget:
                    row.done = True
            if self.on_tokens is not None:
                self.on_tokens([r for _, r in now])
        if appended:
            self.target.mark_presence([r for r, tokens in appended.items() for _ in tokens],
                                      [t for tokens in appended.values() for t in tokens])
        ended = [r for _, r in live if self.rows[r].done]
        if self.target.prefix_cache:          # the cache holds S[:-1] of a row that ends here
            for r in ended:
                row = self.rows[r]
                self.target.keep_prefix(r, (row.prompt + row.new)[:-1])
        self._finished(ended)
        return appended

    def _finished(self, rows: list[int]) -> None:
        """Tell the speculator that the requests in ``rows`` ended, with their final lengths."""
        if self.speculator is not None and rows:
            self.speculator.finished(rows, [self.rows[r].length for r in rows])

    # ------------------------------------------------------------------ batch requests
    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int | None = None,
                 sequence_length: int | None = None, do_sample: bool | None = None, temperature=None,
                 top_k=None, top_p=None, repetition_penalty=None, eos_token_id=None,
                 pad_token_id: int | None = None, streamer=None, stopping_criteria=None,
                 seed=None) -> torch.Tensor:
        """Generate for up to ``batch_size`` prompts (rows 0 .. b-1; every row restarts).

        ``input_ids``: [b, L] (+ ``attention_mask``, left or right padding), 1-D, or a list of token
        lists. ``sequence_length`` bounds prompt + new tokens per row (transformers-neuronx),
        ``max_new_tokens`` new tokens; sampling values may be scalars or one per row;
        ``repetition_penalty`` (> 0, 1 = off; scalar or one per row) penalises every token already in
        the row's sequence as Hugging Face's ``RepetitionPenaltyLogitsProcessor``; ``seed``: an int
        (independent streams per row) or one per row. Rows finish independently at EOS, a stopping
        criterion (HF ``criterion(input_ids, scores)``) or their budget. A streamer gets
        ``put(prompt)``, ``put(tokens)`` per emitted position and ``end()`` (HF protocol; batch 1 for
        text). Returns ``input_ids`` followed by the new tokens, padded with ``pad_token_id``.
        """
        target = self.target
        req = prepare_request(target, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                              sequence_length=sequence_length, do_sample=do_sample, temperature=temperature,
                              top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                              eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=seed)
        b = len(req.prompts)
        start = time.perf_counter()
        total, self.stats = self.stats, SpecStats()     # this call's numbers, merged into the total after
        self._finished(self.active_rows)                # requests added before this call are dropped
        self.rows = [None] * target.batch_size
        self.rng = RowGenerators(target.batch_size, target.device)
        eos = frozenset(req.eos.tolist())
        for r, (prompt, budget, s) in enumerate(zip(req.prompts, req.budget.tolist(), req.seeds)):
            self.rows[r] = Row(prompt.tolist(), budget, eos)
            self.rng.seed(r, s)
            target.reset_presence(r, prompt)
        self.params = req.params.clone()

        def output() -> torch.Tensor:
            return format_output(input_ids, attention_mask, req.prompts, [row.new for row in self.rows[:b]],
                                 req.pad_token_id)

        def on_tokens(rows: list[int]) -> None:
            if streamer is not None:
                streamer.put(torch.tensor([self.rows[r].new[-1] for r in rows]))
            if stopping_criteria:
                stop = stop_requested(stopping_criteria, output())
                for r in range(b):
                    self.rows[r].done |= bool(stop[r])

        self.on_tokens = on_tokens
        try:
            if streamer is not None:
                streamer.put(format_output(input_ids, attention_mask, req.prompts, [[]] * b, req.pad_token_id))
            out = target.prefill(req.prompts, self.params, self.rng)
            if self.speculator is not None:
                with self.stats.timer("draft"):
                    self.speculator.start(None, req.prompts, self.params, self.rng, out)
            self._emit_first(list(range(b)), out.tokens[:b, -1].cpu())
            while self.active_rows:
                self.step()
            if streamer is not None:
                streamer.end()
        finally:
            self._finished(self.active_rows)            # rows an exception left unfinished end here
            self.on_tokens = None
            self.stats.add_time(other_s=time.perf_counter() - start - self.stats.total_s)
            self.last_stats, self.stats = self.stats, total.merge(self.stats)
        return output()
