"""``AsyncEngine``: continuous batching for asyncio servers, with speculation inside.

The static batch's rows are slots: a request waits in a bounded FIFO queue, joins a free row
(a single-row context encoding into that slot; the other rows keep their state), advances with
every step of the batch (each row accepts its own number of draft tokens), and leaves at EOS, its
``max_tokens``, a stop string or an abort; the row is reused by the next request.

The model runs in one worker thread, so the event loop never blocks on it; results cross to the
loop with ``call_soon_threadsafe``. Everything a request asks for is validated in ``add_request``
(on the caller's thread, before it is queued): a bad request raises ``ValueError`` and changes
nothing. A request takes a free row at once when one is unclaimed (a burst fills the free rows
before anything waits); ``max_waiting`` more may wait, and beyond that ``EngineBusy`` is raised. A
request that fails when it joins its row fails alone; an exception inside a batch step fails the
requests in the batch at that step (their rows are released) and the engine serves on.
``abort_all`` and ``shutdown`` end every request with finish_reason "abort" and an ``error`` that
says why (a server drains with them).

    engine = AsyncEngine(Engine(target, speculator), tokenizer=target.tokenizer)
    engine.start()
    async for out in engine.add_request("Hello", RequestParams(max_tokens=32)):
        print(out.text, end="")
    engine.shutdown()
"""
from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from ..core.engine import Engine
from ..core.request import prepare_request
from .metrics import ServingMetrics
from .mirror import MirroredEngine
from .params import InvalidParam, RequestParams
from .text import TextStream

log = logging.getLogger("specdec.serving")
SHUTTING_DOWN = "the server is shutting down"


class EngineBusy(RuntimeError):
    """The waiting queue is full: retry later."""


class EngineStopped(RuntimeError):
    """The engine is shutting down (or was never started) and takes no new requests."""


@dataclass
class RequestOutput:
    """One delivery to a request's stream: the tokens and text that became final since the last one.

    finish_reason (on the last delivery, ``finished``): "stop" (EOS or a stop string), "length"
    (``max_tokens``), "abort", or "error" (``error`` says what went wrong)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0       # tokens so far, this delivery included


class RequestStream:
    """Async iterator of one request's ``RequestOutput``s (the last has ``finished``). Closing it
    early (``aclose()``, or the consumer cancelled) aborts the request and frees its row."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue, prompt_tokens: int):
        self.engine, self.request_id, self._queue = engine, request_id, queue
        self.prompt_tokens = prompt_tokens
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:   # the consumer was cancelled (e.g. its client disconnected)
            self.abort()
            raise
        self.finished = out.finished
        return out

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def collect(self) -> RequestOutput:
        """Wait for the end → one ``RequestOutput`` with every token and the whole text."""
        tokens, text, last = [], [], None
        async for out in self:
            tokens += out.token_ids
            text.append(out.text)
            last = out
        return RequestOutput(self.request_id, tokens, "".join(text), True, last.finish_reason, last.error,
                             last.prompt_tokens, last.completion_tokens)


@dataclass
class _Request:
    id: str
    prompt: list[int]
    params: RequestParams
    budget: int
    seed: int
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    text: TextStream | None
    arrival: float = field(default_factory=time.perf_counter)
    row: int | None = None
    emitted: int = 0
    last_time: float | None = None


class AsyncEngine:
    """Serves requests on ``engine`` (a ``specdec.core.engine.Engine``, target-only or speculative; at
    ``tp_degree > 1`` rank 0's engine wrapped in a ``MirroredEngine``).

    ``tokenizer``: needed for text prompts, text outputs and stop strings (None: token ids only).
    ``max_waiting``: requests allowed to wait for a row; more raise ``EngineBusy``.
    ``metrics``: a ``ServingMetrics`` to record into (one is made if not given)."""

    def __init__(self, engine: Engine | MirroredEngine, tokenizer=None, max_waiting: int = 64,
                 metrics: ServingMetrics | None = None):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine, self.tokenizer, self.max_waiting = engine, tokenizer, max_waiting
        self.target = engine.target
        self.metrics = metrics or ServingMetrics()
        self.metrics.watch(self)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._admitting: list[_Request] = []             # given a free row (req.row), not yet started in it
        self._running: dict[int, _Request] = {}          # row -> request (worker thread only)
        self._aborted: dict[str, str | None] = {}        # request id -> error (None: a plain abort)
        self._max_prompt_chars: int | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.accepting = True     # False: add_request raises EngineStopped (a draining server)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="specdec-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, abort the waiting and running ones (their streams end with
        finish_reason "abort" and ``error`` saying the server is shutting down), join the worker thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def rows_in_use(self) -> int:
        """Rows taken by requests: running ones and ones being started in their row."""
        return len(self._running) + len(self._admitting)

    @property
    def idle(self) -> bool:
        """No request waits or runs."""
        with self._cv:
            return not (self._waiting or self._admitting or self._running)

    def abort_all(self, error: str | None = None) -> None:
        """Abort every waiting and running request (thread-safe); ``error`` is passed to their streams
        with finish_reason "abort" (e.g. why: the server is shutting down)."""
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
            for req in self._admitting + list(self._running.values()):
                self._aborted[req.id] = error
            self._cv.notify_all()
        for req in waiting:
            self._finish(req, [], "", "abort", error)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: RequestParams,
                    request_id: str | None = None) -> RequestStream:
        """Validate and queue a request (call from the event loop) → its stream.

        ``prompt``: text (tokenised as is: apply a chat template before) or token ids; an async server
        tokenises text off its event loop first (``tokenize`` in a thread) and passes the ids. Raises
        ``ValueError`` (``InvalidParam``: ``param`` names the field) for a bad request (nothing
        changes), ``EngineBusy`` when every row is taken and ``max_waiting`` requests already wait,
        ``EngineStopped`` when the engine is not running."""
        ids = self.tokenize(prompt)
        budget, seed = self._validate(ids, params)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        text = TextStream(self.tokenizer, params.stop) if self.tokenizer is not None else None
        req = _Request(request_id or f"req-{secrets.token_hex(8)}", ids, params, budget, seed, queue, loop, text)
        with self._cv:
            if not self.running or not self.accepting:
                raise EngineStopped("the engine is not running (shutting down or not started)")
            if len(self._waiting) >= self.max_waiting and not self._unclaimed_rows():
                self.metrics.requests.labels("rejected").inc()
                raise EngineBusy(f"the server is busy: {len(self._waiting)} requests are waiting for one of "
                                 f"{self.target.batch_size} rows (max_waiting={self.max_waiting}); retry later")
            self._waiting.append(req)
            self._claim_rows()          # a free row takes it at once: a burst fills the free rows first
            self._cv.notify_all()
        self.metrics.prompt_tokens.inc(len(ids))
        return RequestStream(self, req.id, queue, len(ids))

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Abort a waiting or running request (thread-safe; unknown or finished ids are ignored)."""
        with self._cv:
            for req in self._waiting:
                if req.id == request_id:
                    self._waiting.remove(req)
                    self._finish(req, [], "", "abort", error)
                    return
            self._aborted.setdefault(request_id, error)
            self._cv.notify_all()

    @property
    def max_prompt_chars(self) -> int:
        """A prompt text longer than this cannot fit the context whatever it tokenises to (each token
        covers at most the longest vocabulary entry's characters): rejected before tokenising."""
        if self._max_prompt_chars is None:
            longest = 64
            if self.tokenizer is not None and hasattr(self.tokenizer, "get_vocab"):
                longest = max([len(t) for t in self.tokenizer.get_vocab()] or [64])
            self._max_prompt_chars = (self.target.n_positions - 1) * max(longest, 1)
        return self._max_prompt_chars

    def check_prompt_chars(self, chars: int, what: str = "the prompt") -> None:
        """ValueError when ``chars`` characters of text are sure not to fit the context (before tokenising)."""
        if chars > self.max_prompt_chars:
            n_pos = self.target.n_positions
            raise InvalidParam(f"{what} is too long: {chars} characters cannot fit in {n_pos - 1} tokens (this model's "
                               f"context length is {n_pos} tokens; at most {self.max_prompt_chars} characters)",
                               "prompt")

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Text → token ids (the tokenizer, no special tokens added), or token ids checked → a list.
        ValueError for an empty, too long or invalid prompt (text that is not valid Unicode, token ids
        that are not integers in the vocabulary)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParam("this server has no tokenizer: give the prompt as a list of token ids", "prompt")
            if not prompt:
                raise InvalidParam("prompt is empty: give at least one token", "prompt")
            self.check_prompt_chars(len(prompt))
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidParam(f"the prompt is not valid Unicode: it holds the lone surrogate "
                                   f"U+{ord(prompt[e.start]):04X} at character {e.start}", "prompt") from None
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt):
            raise InvalidParam("prompt must be a string or a list of integer token ids", "prompt")
        vocab = self.target.vocab_size
        for i, t in enumerate(prompt):
            if not 0 <= t < vocab:
                shown = t if t.bit_length() <= 128 else f"(a {t.bit_length()}-bit integer)"
                raise InvalidParam(f"prompt token id {shown} (at position {i}) is outside the vocabulary: "
                                   f"token ids must be in [0, {vocab})", "prompt")
        return list(prompt)

    def _validate(self, ids: list[int], params: RequestParams) -> tuple[int, int]:
        """(new-token budget, seed) of a request; ValueError for anything the model cannot do."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this server has none")
        n_pos = self.target.n_positions
        if not ids:
            raise InvalidParam("prompt is empty: give at least one token", "prompt")
        if len(ids) >= n_pos:
            raise InvalidParam(f"the prompt has {len(ids)} tokens; this model's context length is {n_pos} "
                               f"tokens, so prompts may have at most {n_pos - 1}", "prompt")
        if params.max_tokens is not None and len(ids) + params.max_tokens > n_pos:
            raise InvalidParam(f"max_tokens={params.max_tokens} is too large: the prompt has {len(ids)} tokens; "
                               f"with max_tokens it needs {len(ids) + params.max_tokens} positions, but "
                               f"n_positions={n_pos} (this model's context length), so max_tokens may be at "
                               f"most {n_pos - len(ids)}", "max_tokens")
        budget = n_pos - len(ids) if params.max_tokens is None else params.max_tokens
        seed = secrets.randbits(63) if params.seed is None else params.seed
        prepare_request(self.target, [ids], **self._generation_args(params, budget, seed))
        return budget, seed

    @staticmethod
    def _generation_args(params: RequestParams, budget: int, seed: int) -> dict:
        return dict(max_new_tokens=budget, do_sample=not params.greedy, temperature=params.temperature,
                    top_k=params.top_k, top_p=params.top_p, seed=seed, repetition_penalty=params.repetition_penalty,
                    eos_token_id=[] if params.ignore_eos else None)

    # ------------------------------------------------------------------ worker thread
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not (self._stopping or self._waiting or self._admitting or self._aborted or self._running):
                    self._cv.wait()
                if self._stopping:
                    break
                aborted, self._aborted = self._aborted, {}
            try:
                for req in list(self._running.values()):
                    if req.id in aborted:
                        self._leave(req, [], "", "abort", aborted[req.id])
                self._admit()
                if self._running:
                    self._step()
            except Exception as e:   # a bug outside the model: fail the running requests, serve on
                log.exception("serving loop error; failing %d running requests", len(self._running))
                for req in list(self._running.values()):
                    self._leave(req, [], "", "error", error=f"{type(e).__name__}: {e}")
        with self._cv:
            waiting, self._waiting = self._admitting + list(self._waiting), collections.deque()
            self._admitting = []
        for req in waiting:
            self._finish(req, [], "", "abort", SHUTTING_DOWN)
        for req in list(self._running.values()):
            self._leave(req, [], "", "abort", SHUTTING_DOWN)
        close = getattr(self.engine, "close", None)     # a MirroredEngine: the other ranks stop too
        if close is not None:
            close()

    def _unclaimed_rows(self) -> list[int]:
        """Free rows no admitted request has claimed yet (call holding the lock)."""
        claimed = {req.row for req in self._admitting}
        return [row for row in self.engine.free_rows if row not in claimed]

    def _claim_rows(self) -> None:
        """Give waiting requests (FIFO) the unclaimed free rows (call holding the lock)."""
        free = self._unclaimed_rows() if self._waiting else []
        while free and self._waiting:
            req = self._waiting.popleft()
            req.row = self.engine.best_row(req.prompt, free)    # (prefix_cache: the row holding most of it)
            free.remove(req.row)
            self._admitting.append(req)

    def _admit(self) -> None:
        """Start the requests that claimed rows (each with its single-row context encoding), and give
        rows freed since to the waiting ones."""
        while True:
            with self._cv:
                self._claim_rows()
                if not self._admitting:
                    return
                req = self._admitting[0]
            row = req.row
            try:
                self.engine.add(req.prompt, row=row, **self._generation_args(req.params, req.budget, req.seed))
            except Exception as e:   # this request fails alone
                log.exception("request %s failed to start", req.id)
                if self.engine.rows[row] is not None:
                    self.engine.release(row)
                with self._cv:
                    self._admitting.remove(req)
                self._finish(req, [], "", "error", error=f"{type(e).__name__}: {e}")
                continue
            with self._cv:
                self._running[row] = req
                self._admitting.remove(req)
            self._started(req, row)

    def _started(self, req: _Request, row: int) -> None:
        self.metrics.queue_time.observe(time.perf_counter() - req.arrival)
        self._deliver(req, list(self.engine.rows[row].new))

    def _step(self) -> None:
        try:
            appended = self.engine.step()
        except Exception as e:   # the batch's step failed: its requests fail, the engine serves on
            log.exception("a batch step failed; failing its %d requests", len(self._running))
            for req in list(self._running.values()):
                self._leave(req, [], "", "error", error=f"{type(e).__name__}: {e}")
            return
        for row, tokens in appended.items():
            self._deliver(self._running[row], tokens)

    def _deliver(self, req: _Request, tokens: list[int]) -> None:
        """Pass a row's new tokens to its stream (cut at a stop string); leave the row when done."""
        row = self.engine.rows[req.row]
        kept, text = tokens, ""
        if req.text is not None:
            for i, token in enumerate(tokens):
                text += req.text.add([token])
                if req.text.stopped:
                    kept = tokens[: i + 1]
                    break
        stopped = req.text is not None and req.text.stopped
        now = time.perf_counter()
        if req.emitted == 0:
            self.metrics.ttft.observe(now - req.arrival)
        elif kept:
            for _ in kept:
                self.metrics.itl.observe((now - req.last_time) / len(kept))
        req.emitted += len(kept)
        req.last_time = now
        self.metrics.generation_tokens.inc(len(kept))
        if not (row.done or stopped):
            self._send(req, RequestOutput(req.id, kept, text, prompt_tokens=len(req.prompt),
                                          completion_tokens=req.emitted))
            return
        if req.text is not None and not stopped:
            text += req.text.add([], final=True)
        reason = "stop" if stopped or (row.new and row.new[-1] in row.eos) else "length"
        self._leave(req, kept, text, reason)

    def _leave(self, req: _Request, tokens: list[int], text: str, reason: str, error: str | None = None) -> None:
        """A running request ends: its row is freed and its stream gets the last delivery."""
        self.engine.release(req.row)
        with self._cv:
            del self._running[req.row]
        self._finish(req, tokens, text, reason, error)

    def _finish(self, req: _Request, tokens: list[int], text: str, reason: str, error: str | None = None) -> None:
        self.metrics.requests.labels(reason).inc()
        self._send(req, RequestOutput(req.id, tokens, text, True, reason, error, len(req.prompt), req.emitted))

    @staticmethod
    def _send(req: _Request, out: RequestOutput) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, out)
        except RuntimeError:   # the request's event loop is closed: nobody is listening
            pass
