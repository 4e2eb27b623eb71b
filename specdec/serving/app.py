"""The HTTP API (FastAPI): OpenAI-compatible completions and chat, ``/generate``, health and metrics.

    POST /v1/completions        OpenAI completions (stream: server-sent events)
    POST /v1/chat/completions   OpenAI chat completions (the tokenizer's chat template)
    GET  /v1/models             the served model
    POST /generate              {"prompt", "max_tokens", "temperature", "top_p", "top_k",
                                 "repetition_penalty", "seed", "stop", "stream"} → {"text", "token_ids", ...}
    GET  /health                200 once the graphs are compiled, 503 while loading or draining
    GET  /metrics               Prometheus text format

Extensions to OpenAI's request fields (vLLM's names): ``top_k``, ``repetition_penalty``,
``ignore_eos``; every choice also carries its ``token_ids``. Request bodies are JSON (whatever the
content type says), with strict types (``"stream": "yes"`` and ``"max_tokens": true`` are errors) and
values checked against what the model can carry. Every error, on every route (404 and 405
included), uses OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request (what was wrong and what is allowed), 401 without the API key, 413 for a body over the
limit, 503 when busy, loading or shutting down, 500 when generation failed. A client that
disconnects aborts its request and frees its row. Text is tokenised in a thread, off the event loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.chat import conversation_ids
from .engine import SHUTTING_DOWN, AsyncEngine, EngineBusy, EngineStopped, RequestOutput, RequestStream
from .params import InvalidParam, RequestParams

log = logging.getLogger("specdec.serving")
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 30.0
PUBLIC_PATHS = ("/health", "/metrics")

# ---------------------------------------------------------------------------------------------------
# request bodies: strict types (no string-as-bool, no bool-as-int), valid Unicode; ranges in RequestParams

def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode: it holds the lone surrogate U+{ord(text[e.start]):04X} at "
                         f"character {e.start}") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_unicode)]
Number = Annotated[float, Strict()]     # an int or a float (not a bool, not a string)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0
    seed: StrictInt | None = None
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    repetition_penalty: Number = 1.0
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    user: Text | None = None
    stream_options: StreamOptions | None = None

    def params(self, max_tokens: int | None) -> RequestParams:
        """Validated ``RequestParams`` (InvalidParam names what is wrong and what is allowed)."""
        for name, value, allowed in (("n", self.n, 1), ("presence_penalty", self.presence_penalty, 0),
                                     ("frequency_penalty", self.frequency_penalty, 0)):
            if value != allowed:
                raise InvalidParam(f"{name}={value!r} is not supported: only {allowed} "
                                   + ("(one choice per request)" if name == "n" else "(use repetition_penalty)"),
                                   name)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return RequestParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                             top_p=self.top_p, seed=self.seed, stop=stop,
                             repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Text | list[StrictInt] | list[Text] = Field(description="text, token ids, or a list of one text")
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None

    def the_prompt(self) -> str | list[int]:
        if self.echo or self.logprobs is not None:
            raise InvalidParam("echo and logprobs are not supported", "echo" if self.echo else "logprobs")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise InvalidParam(f"prompt is a list of {len(p)} texts: give one prompt per request", "prompt")
            return p[0]
        if isinstance(p, list) and not p:
            raise InvalidParam("prompt is empty: give at least one token", "prompt")
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: Text
    name: Text | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None


class GenerateRequest(_Sampling):
    prompt: Text | list[StrictInt]
    max_tokens: StrictInt | None = 16


# ---------------------------------------------------------------------------------------------------
# errors

class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **(self.headers or {})})


def _bad_request(e: ValueError) -> APIError:
    return APIError(400, str(e), param=getattr(e, "param", None))


_UNION_HELP = {"prompt": "a string, a list of token ids (integers) or a list of one string",
               "stop": "a string, a list of strings or null"}
_TAGS = {"body", "str", "int", "float", "bool", "list", "dict", "none"}


def _tag(x) -> bool:
    return isinstance(x, str) and (x in _TAGS or "[" in x or x.startswith(("function-", "constrained-")))


def _path(loc) -> str:
    """'messages.0.content' from pydantic's loc, without 'body' and union-member tags."""
    return ".".join(str(x) for x in loc if not _tag(x))


def _validation_error(errors: list[dict]) -> APIError:
    """One 400 for pydantic's errors: each field named with what is wrong and what is allowed."""
    parts, params, by_field = [], [], {}
    for e in errors:
        loc = [x for x in e.get("loc", ()) if x != "body"]
        kind = e.get("type")
        if kind == "json_invalid":
            parts.append(f"the request body is not valid JSON ({(e.get('ctx') or {}).get('error', e.get('msg'))} "
                         f"at character {loc[0] if loc else 0})")
        elif not loc:
            parts.append("the request body is empty: send a JSON object" if kind == "missing" else
                         "the request body must be a JSON object ({\"field\": value, ...})")
        else:
            by_field.setdefault(str(loc[0]), []).append(e)
    for field, errs in by_field.items():
        params.append(field)
        custom = [e for e in errs if e.get("type") == "value_error"]
        if custom:
            parts += [f"{_path(e['loc'])} {e['msg'].removeprefix('Value error, ')}" for e in custom]
        elif any(e.get("type") == "extra_forbidden" for e in errs):
            parts.append(f"unknown field {field!r}")
        elif field in _UNION_HELP and any(len(e["loc"]) > 2 for e in errs):
            parts.append(f"{field} is invalid: must be {_UNION_HELP[field]}")
        else:
            parts += [f"{_path(e['loc'])}: {e.get('msg')}" for e in errs]
    return APIError(400, "; ".join(dict.fromkeys(parts)), param=params[0] if params else None)


def _parse_error(cause: BaseException | None) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8 (byte {cause.start}): send JSON text in UTF-8"
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply to parse: send a JSON object of request fields"
    return "the request body could not be parsed: send a JSON object in UTF-8"


ROUTES = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /generate, GET /health, "
          "GET /metrics")


# ---------------------------------------------------------------------------------------------------
# checks before a request reaches its route: Host, API key, draining, body size

class _Guard:
    """ASGI middleware: the Host header (``allowed_hosts``), the API key (``Authorization: Bearer``;
    ``public_paths`` are open), 503 while draining, the body limit (413) and the body timeout (408: a
    client that does not send its whole body within ``body_timeout_s`` of the request, e.g. a slow or
    stalled one, is answered and disconnected); reads the whole body before the route runs (so an early
    error leaves the keep-alive connection usable), and counts the requests in flight (a drain waits for
    them)."""

    DISCARD_LIMIT = 64 * 2**20        # an oversized body is read and dropped up to this, then the connection closes

    def __init__(self, app, state: dict, api_key: str | None, public_paths: tuple[str, ...],
                 allowed_hosts: tuple[str, ...] | None, max_body_bytes: int, body_timeout_s: float):
        self.app, self.state, self.api_key = app, state, api_key
        self.public_paths, self.max_body_bytes, self.body_timeout_s = public_paths, max_body_bytes, body_timeout_s
        self.allowed_hosts = tuple(h.lower() for h in allowed_hosts) if allowed_hosts else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        body, error, ended = b"", None, True
        length = headers.get("content-length")
        if length is not None and int(length) > self.max_body_bytes:
            error, ended = self._too_large(int(length)), False
        elif length is not None and int(length) > 0 or "chunked" in headers.get("transfer-encoding", "").lower():
            try:
                body, ended = await asyncio.wait_for(self._read(receive, self.max_body_bytes), self.body_timeout_s)
            except TimeoutError:
                error = APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                                 "(--body-timeout)", code="request_timeout", headers={"Connection": "close"})
                return await error.response()(scope, receive, send)
            if body is None:
                error = self._too_large(None)
        error = self._check(scope, headers) or error
        if error is not None:
            if not ended and not await self._discard(receive):     # too much to read: close the connection
                error.headers = {**(error.headers or {}), "Connection": "close"}
            return await error.response()(scope, receive, send)
        if scope["method"] == "POST" and "json" not in headers.get("content-type", "").lower():
            # the API speaks JSON only: a body sent as a form (curl -d) or without a type is parsed as JSON
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        sent = [False]

        async def replay():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        self.state["inflight"] += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.state["inflight"] -= 1

    def _check(self, scope, headers: Headers) -> APIError | None:
        if self.allowed_hosts is not None:
            host = headers.get("host", "").lower()
            host = host[: host.find("]") + 1] if host.startswith("[") else host.split(":")[0]
            if not any(p == "*" or host == p or p.startswith("*.") and host.endswith(p[1:])
                       for p in self.allowed_hosts):
                return APIError(400, f"the Host header {host!r} is not allowed here (--allowed-hosts)",
                                code="invalid_host")
        path = scope["path"]
        if self.api_key is not None and path not in self.public_paths:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>' (the OpenAI "
                                "clients' api_key)", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            if not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                return APIError(401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if self.state["draining"] and path not in ("/health", "/metrics"):
            return APIError(503, SHUTTING_DOWN + ": retry on another server", "server_busy", "shutting_down")
        return None

    def _too_large(self, length: int | None) -> APIError:
        size = f"{length} bytes" if length is not None else "more"
        return APIError(413, f"the request body is too large ({size}): this server takes at most "
                        f"{self.max_body_bytes} bytes (--max-body-size)", code="request_too_large")

    @staticmethod
    async def _read(receive, limit: int) -> tuple[bytes | None, bool]:
        """The body, or None when it has more than ``limit`` bytes → (body, whether all of it was read)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), True
            more = message.get("more_body", False)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None, not more
            chunks.append(chunk)
            if not more:
                return b"".join(chunks), True

    async def _discard(self, receive) -> bool:
        """Read and drop the rest of the body (up to ``DISCARD_LIMIT``) → whether it all arrived."""
        size = 0
        while size <= self.DISCARD_LIMIT:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return message["type"] == "http.request"
            size += len(message.get("body", b""))
        return False


# ---------------------------------------------------------------------------------------------------
# the app

def create_app(engine: AsyncEngine | None = None, model_name: str = "specdec",
               loader: Callable[[], AsyncEngine] | None = None, *, api_key: str | None = None,
               public_paths: Iterable[str] = PUBLIC_PATHS, allowed_hosts: Iterable[str] | None = None,
               docs: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """The HTTP app for ``engine`` (started with the app, shut down with it), or for the engine
    ``loader()`` returns, built in a thread after start-up (``/health`` is 503 until it is ready).

    ``api_key``: every request but those to ``public_paths`` must send ``Authorization: Bearer
    <api_key>`` (else 401). ``allowed_hosts``: Host header values accepted (``"*.example.com"``
    patterns, ``"*"``; None: any). ``docs``: serve ``/docs`` and ``/openapi.json``.
    ``max_body_bytes``: larger request bodies get 413; ``body_timeout_s``: a body not received within it
    gets 408 (slow clients). ``app.state.drain(grace_s)`` drains the server
    (what ``specdec serve`` runs on SIGINT / SIGTERM)."""
    if (engine is None) == (loader is None):
        raise ValueError("give an engine or a loader (one of them)")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0 seconds, got {body_timeout_s}")
    state: dict = {"engine": engine, "created": int(time.time()), "load_error": None, "draining": False,
                   "inflight": 0}
    pool = ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenizer")   # tokenising off the event loop

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None
        if loader is not None:
            async def load():
                try:
                    state["engine"] = await asyncio.to_thread(loader)
                    state["engine"].start()
                except Exception as e:   # reported by /health and every request
                    state["load_error"] = f"{type(e).__name__}: {e}"
            task = asyncio.create_task(load())
        else:
            engine.start()
        yield
        if task is not None:
            task.cancel()
        # FastAPI caches the endpoints (and so their closures, ``state``) for the life of the process:
        # the stopped app lets go of its engine, or every server a process ran would keep its model
        stopped, state["engine"] = state["engine"], None
        if stopped is not None:
            await asyncio.to_thread(stopped.shutdown)
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.add_middleware(_Guard, state=state, api_key=api_key or None, public_paths=tuple(public_paths),
                       allowed_hosts=tuple(allowed_hosts) if allowed_hosts else None, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _validation_error(list(exc.errors())).response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        method, path, code = request.method, request.url.path, None
        if exc.status_code == 404:
            message, code = f"no route {method} {path}: this server serves {ROUTES}", "not_found"
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            message, code = f"method {method} is not allowed on {path}: use {allow}", "method_not_allowed"
        elif exc.status_code == 400:
            message = _parse_error(exc.__cause__)
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):   # a bug: still an OpenAI body, no internals
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, f"internal server error ({type(exc).__name__})", "server_error").response()

    def ready() -> AsyncEngine:
        if state["load_error"]:
            raise APIError(500, f"the model failed to load: {state['load_error']}", "server_error")
        if state["engine"] is None:
            raise APIError(503, "the model is still loading and compiling; retry when /health returns 200",
                           "server_busy", "loading")
        return state["engine"]

    def check_model(body: _Sampling) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(400, f"model {body.model!r} is not served here; this server serves {model_name!r}",
                           code="model_not_found", param="model")

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def submit(prompt: str | list[int], body: _Sampling, max_tokens: int | None) -> RequestStream:
        """Validate, tokenise (text: in the tokenizer thread) and queue a request → its stream."""
        check_model(body)
        engine = ready()
        try:
            params = body.params(max_tokens)
            if isinstance(prompt, str):
                engine.check_prompt_chars(len(prompt))       # a hopeless prompt is not tokenised at all
                prompt = await off_loop(engine.tokenize, prompt)
            return engine.add_request(prompt, params)
        except EngineBusy as e:
            raise APIError(503, str(e), "server_busy", "busy") from None
        except EngineStopped as e:
            raise APIError(503, str(e), "server_busy", "shutting_down") from None
        except ValueError as e:
            raise _bad_request(e) from None

    async def drain(grace_s: float) -> None:
        """Stop admitting (new requests get 503, ``/health`` 503 "draining"), let the requests in flight
        finish for up to ``grace_s`` seconds, then abort what is left: an open stream ends with an
        error event and ``[DONE]``, a non-streaming request gets a 503 error body."""
        loop = asyncio.get_running_loop()
        state["draining"] = True
        deadline = loop.time() + grace_s
        while state["inflight"] and loop.time() < deadline:
            await asyncio.sleep(0.02)
        engine = state["engine"]
        if engine is not None:
            engine.accepting = False
            if not engine.idle:
                log.info("drain: aborting what is left after %.1f s", grace_s)
            engine.abort_all(SHUTTING_DOWN)
        deadline = loop.time() + 5.0
        while state["inflight"] and loop.time() < deadline:   # the aborted responses end
            await asyncio.sleep(0.02)
    app.state.drain = drain

    @app.get("/health")
    async def health():
        if state["load_error"]:
            return JSONResponse({"status": "failed", "error": state["load_error"]}, status_code=500)
        if state["draining"]:
            return JSONResponse({"status": "draining"}, status_code=503)
        if state["engine"] is None or not state["engine"].running:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        engine = state["engine"]
        return Response(engine.metrics.exposition() if engine else b"",
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        engine = state["engine"]
        card = {"id": model_name, "object": "model", "created": state["created"], "owned_by": "specdec"}
        if engine is not None:
            card["max_model_len"] = engine.target.n_positions
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        try:
            prompt = body.the_prompt()
        except ValueError as e:
            raise _bad_request(e) from None
        stream = await submit(prompt, body, body.max_tokens)
        ident, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

        def envelope(choice: dict, usage: dict | None = None) -> dict:
            return {"id": ident, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [choice] if choice else [], **({"usage": usage} if usage else {})}

        def choice(out: RequestOutput) -> dict:
            return {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason,
                    "token_ids": out.token_ids}

        if body.stream:
            return _sse(stream, lambda out: envelope(choice(out)),
                        (lambda out: envelope({}, _usage(out))) if body.include_usage else None)
        out = await _collect(stream, request)
        return envelope(choice(out), _usage(out))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        check_model(body)
        engine = ready()
        if engine.tokenizer is None:
            raise APIError(400, "this server has no tokenizer: use /v1/completions with token ids")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            engine.check_prompt_chars(sum(len(m["content"]) for m in messages), "the messages' text")
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        try:
            ids = await off_loop(conversation_ids, engine.tokenizer, messages)
        except Exception as e:   # template errors (e.g. a role order the template rejects)
            why = str(e) if type(e).__module__.startswith("jinja2") else type(e).__name__
            raise APIError(400, f"the chat template could not format these messages: {why}", param="messages") \
                from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        stream = await submit(ids, body, max_tokens)
        ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def envelope(choice: dict, kind: str, usage: dict | None = None) -> dict:
            return {"id": ident, "object": kind, "created": created, "model": model_name,
                    "choices": [choice] if choice else [], **({"usage": usage} if usage else {})}

        if body.stream:
            first = [True]

            def chunk(out: RequestOutput) -> dict:
                delta = {"role": "assistant", "content": out.text} if first[0] else {"content": out.text}
                first[0] = False
                return envelope({"index": 0, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason,
                                 "token_ids": out.token_ids}, "chat.completion.chunk")
            return _sse(stream, chunk,
                        (lambda out: envelope({}, "chat.completion.chunk", _usage(out))) if body.include_usage
                        else None)
        out = await _collect(stream, request)
        message = {"role": "assistant", "content": out.text}
        return envelope({"index": 0, "message": message, "logprobs": None, "finish_reason": out.finish_reason,
                         "token_ids": out.token_ids}, "chat.completion", _usage(out))

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if isinstance(body.prompt, list) and not body.prompt:
            raise APIError(400, "prompt is empty: give at least one token", param="prompt")
        stream = await submit(body.prompt, body, body.max_tokens)

        def record(out: RequestOutput) -> dict:
            return {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                    "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens}

        if body.stream:   # newline-delimited JSON, one record per delivery
            async def lines() -> AsyncIterator[bytes]:
                async with _closing(stream):
                    async for out in stream:
                        error = _stream_error(out)
                        yield (json.dumps(record(out) if error is None else error.body()) + "\n").encode()
            return StreamingResponse(lines(), media_type="application/x-ndjson")
        return record(await _collect(stream, request))

    return app


# ---------------------------------------------------------------------------------------------------
# helpers

def _usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def _stream_error(out: RequestOutput) -> APIError | None:
    """The error a last delivery carries: generation failed (500) or the server is shutting down (503)."""
    if out.finish_reason == "error":
        return APIError(500, f"generation failed: {out.error}", "server_error")
    if out.finish_reason == "abort" and out.error:
        return APIError(503, out.error, "server_busy", "shutting_down")
    return None


@asynccontextmanager
async def _closing(stream: RequestStream):
    """Abort the request when the response ends early (client gone, task cancelled)."""
    try:
        yield stream
    finally:
        stream.abort()


async def _collect(stream: RequestStream, request: Request) -> RequestOutput:
    """The whole output; aborts the request if the client disconnects first. Errors → 500 (503 when
    the server shuts down)."""
    async with _closing(stream):
        task = asyncio.ensure_future(stream.collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client disconnected", "client_closed")
        out = task.result()
    error = _stream_error(out)
    if error is not None:
        raise error
    return out


def _sse(stream: RequestStream, chunk: Callable[[RequestOutput], dict],
         usage: Callable[[RequestOutput], dict] | None) -> StreamingResponse:
    """Server-sent events: one chunk per delivery, a usage chunk if asked, then ``[DONE]``; a failed or
    shut-down request ends with an error event, then ``[DONE]``."""
    async def events() -> AsyncIterator[str]:
        async with _closing(stream):
            async for out in stream:
                error = _stream_error(out)
                if error is not None:
                    yield f"data: {json.dumps(error.body())}\n\n"
                    break
                yield f"data: {json.dumps(chunk(out))}\n\n"
                if out.finished and usage is not None:
                    yield f"data: {json.dumps(usage(out))}\n\n"
            yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")
