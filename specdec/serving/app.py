"""The HTTP API (FastAPI): OpenAI-compatible completions and chat, ``/generate``, health and metrics.

    POST /v1/completions        OpenAI completions (stream: server-sent events)
    POST /v1/chat/completions   OpenAI chat completions (the tokenizer's chat template)
    GET  /v1/models             the served model
    POST /generate              {"prompt", "max_tokens", "temperature", "top_p", "top_k",
                                 "repetition_penalty", "seed", "stop", "stream"} → {"text", "token_ids", ...}
    GET  /health                200 once the graphs are compiled, 503 while loading
    GET  /metrics               Prometheus text format

Extensions to OpenAI's request fields (vLLM's names): ``top_k``, ``repetition_penalty``,
``ignore_eos``; every choice also carries its ``token_ids``. Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request (what was wrong and what
is allowed), 503 when busy or loading, 500 when generation failed. A client that disconnects
aborts its request and frees its row.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..core.chat import conversation_ids
from .engine import AsyncEngine, EngineBusy, EngineStopped, RequestOutput, RequestStream
from .params import RequestParams

# ---------------------------------------------------------------------------------------------------
# request bodies

class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream_options: dict | None = None

    def params(self, max_tokens: int | None) -> RequestParams:
        """Validated ``RequestParams`` (ValueError names what is wrong and what is allowed)."""
        for name, value, allowed in (("n", self.n, 1), ("presence_penalty", self.presence_penalty, 0),
                                     ("frequency_penalty", self.frequency_penalty, 0)):
            if value != allowed:
                raise ValueError(f"{name}={value!r} is not supported: only {allowed} "
                                 + ("(one choice per request)" if name == "n" else "(use repetition_penalty)"))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return RequestParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                             top_p=self.top_p, seed=self.seed, stop=stop,
                             repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] = Field(description="text, token ids, or a list of one text")
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None

    def the_prompt(self) -> str | list[int]:
        if self.echo or self.logprobs is not None:
            raise ValueError("echo and logprobs are not supported")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ValueError(f"prompt is a list of {len(p)} texts: give one prompt per request")
            return p[0]
        if isinstance(p, list) and not p:
            raise ValueError("prompt is empty: give at least one token")
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class GenerateRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = 16


# ---------------------------------------------------------------------------------------------------
# errors

class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({e.get('msg')})")
        elif e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
        else:
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "; ".join(dict.fromkeys(parts))


# ---------------------------------------------------------------------------------------------------
# the app

def create_app(engine: AsyncEngine | None = None, model_name: str = "specdec",
               loader: Callable[[], AsyncEngine] | None = None) -> FastAPI:
    """The HTTP app for ``engine`` (started with the app, shut down with it), or for the engine
    ``loader()`` returns, built in a thread after start-up (``/health`` is 503 until it is ready)."""
    if (engine is None) == (loader is None):
        raise ValueError("give an engine or a loader (one of them)")
    state: dict = {"engine": engine, "created": int(time.time()), "load_error": None}

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
        if state["engine"] is not None:
            await asyncio.to_thread(state["engine"].shutdown)

    app = FastAPI(title="specdec", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return APIError(400, _validation_message(exc)).response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

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

    def submit(prompt: str | list[int], body: _Sampling, max_tokens: int | None) -> RequestStream:
        check_model(body)
        engine = ready()
        try:
            return engine.add_request(prompt, body.params(max_tokens))
        except EngineBusy as e:
            raise APIError(503, str(e), "server_busy", "busy") from None
        except EngineStopped as e:
            raise APIError(503, str(e), "server_busy", "shutting_down") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    @app.get("/health")
    async def health():
        if state["load_error"]:
            return JSONResponse({"status": "failed", "error": state["load_error"]}, status_code=500)
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
            raise APIError(400, str(e), param="prompt") from None
        stream = submit(prompt, body, body.max_tokens)
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
        engine = ready()
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            ids = conversation_ids(engine.tokenizer, messages) if engine.tokenizer is not None else None
        except Exception as e:   # template errors (e.g. a role order the template rejects)
            raise APIError(400, f"the chat template could not format these messages: {e}", param="messages") \
                from None
        if ids is None:
            raise APIError(400, "this server has no tokenizer: use /v1/completions with token ids")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        stream = submit(ids, body, max_tokens)
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
        stream = submit(body.prompt, body, body.max_tokens)

        def record(out: RequestOutput) -> dict:
            return {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                    "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens}

        if body.stream:   # newline-delimited JSON, one record per delivery
            async def lines() -> AsyncIterator[bytes]:
                async with _closing(stream):
                    async for out in stream:
                        yield (json.dumps(record(out) if out.finish_reason != "error" else
                                          APIError(500, out.error, "server_error").body()) + "\n").encode()
            return StreamingResponse(lines(), media_type="application/x-ndjson")
        return record(await _collect(stream, request))

    return app


# ---------------------------------------------------------------------------------------------------
# helpers

def _usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


@asynccontextmanager
async def _closing(stream: RequestStream):
    """Abort the request when the response ends early (client gone, task cancelled)."""
    try:
        yield stream
    finally:
        stream.abort()


async def _collect(stream: RequestStream, request: Request) -> RequestOutput:
    """The whole output; aborts the request if the client disconnects first. Errors → 500."""
    async with _closing(stream):
        task = asyncio.ensure_future(stream.collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client disconnected", "client_closed")
        out = task.result()
    if out.finish_reason == "error":
        raise APIError(500, f"generation failed: {out.error}", "server_error")
    return out


def _sse(stream: RequestStream, chunk: Callable[[RequestOutput], dict],
         usage: Callable[[RequestOutput], dict] | None) -> StreamingResponse:
    """Server-sent events: one chunk per delivery, a usage chunk if asked, then ``[DONE]``."""
    async def events() -> AsyncIterator[str]:
        async with _closing(stream):
            async for out in stream:
                if out.finish_reason == "error":
                    yield f"data: {json.dumps(APIError(500, out.error, 'server_error').body())}\n\n"
                    break
                yield f"data: {json.dumps(chunk(out))}\n\n"
                if out.finished and usage is not None:
                    yield f"data: {json.dumps(usage(out))}\n\n"
            yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")
