"""Serving hardening (issue 40): every bad request is a clean 4xx with OpenAI's error body on every
route, and the keep-alive connection serves the next request; request-body limit (413); tokenising
off the event loop; API key, Host check and docs switch; burst admission fills free rows first; a
graceful drain ends every open request with an error and stops the server. Tiny byte-level model,
uvicorn in a thread, every wait bounded."""
import asyncio
import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from specdec import Engine  # noqa: E402
from specdec.serving import AsyncEngine, EngineBusy, RequestParams, create_app  # noqa: E402
from specdec.serving.draining import DrainingServer  # noqa: E402
from specdec.serving.server import running_server as serving  # noqa: E402

from conftest import checkpoint, load  # noqa: E402,F401  (fixture)
from test_serving_http import MODEL, make_engine, text_model  # noqa: E402,F401  (fixture)

LIMIT = 64 * 1024        # the body limit of the table's server
J = {"content-type": "application/json"}

# (method, path, body: a JSON value, raw bytes or None, status, a piece of the message, param or ...)
BAD = [
    # /v1/completions: out of range for int64 / float32 / the model
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2**63}, 400, "max_tokens=9223372036854775808",
     "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens=0 is invalid", "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 300}, 400, "may be at most 251", "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": 1e-40}, 400, "temperature=1e-40", "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature=-1", "temperature"),
    ("POST", "/v1/completions", b'{"prompt": "x", "temperature": 1e400}', 400, "temperature=inf", "temperature"),
    ("POST", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature=nan", "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 1e-300}, 400, "top_p=1e-300", "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p=0", "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "in (0, 1]", "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": 2**63}, 400, "top_k=9223372036854775808", "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": -1}, 400, "top_k=-1", "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "repetition_penalty": 1e-300}, 400, "repetition_penalty=1e-300",
     "repetition_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty=0",
     "repetition_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed=-1", "seed"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed=18446744073709551616", "seed"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop=", "stop"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, 400, "at most 16", "stop"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": ["a" * 1001]}, 400, "at most 1000 characters", "stop"),
    # strict types: no string-as-bool, no bool-as-int, no float-as-int
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens: Input should be a valid integer",
     "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 16.5}, 400, "max_tokens: Input should be a valid integer",
     "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400,
     "temperature: Input should be a valid number", "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature", "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": 1.5}, 400, "top_k: Input should be a valid integer", "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": "1"}, 400, "seed", "seed"),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream: Input should be a valid boolean",
     "stream"),
    ("POST", "/v1/completions", {"prompt": "x", "stream": 1}, 400, "stream: Input should be a valid boolean", "stream"),
    ("POST", "/v1/completions", {"prompt": "x", "ignore_eos": "true"}, 400, "ignore_eos", "ignore_eos"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop is invalid: must be a string", "stop"),
    ("POST", "/v1/completions", {"prompt": "x", "user": 5}, 400, "user: Input should be a valid string", "user"),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", "stream_options"),
    ("POST", "/v1/completions", {"prompt": "x", "model": 5}, 400, "model", "model"),
    # prompts: Unicode, token ids, length
    ("POST", "/v1/completions", {"prompt": "a\ud800b"}, 400, "not valid Unicode: it holds the lone surrogate U+D800",
     "prompt"),
    ("POST", "/v1/completions", {"prompt": [2**70]}, 400, "token id 1180591620717411303424 (at position 0) is outside",
     "prompt"),
    ("POST", "/v1/completions", {"prompt": [5, -1]}, 400, "token id -1 (at position 1)", "prompt"),
    ("POST", "/v1/completions", {"prompt": [5, 1.5]}, 400, "prompt is invalid: must be a string, a list of token ids",
     "prompt"),
    ("POST", "/v1/completions", {"prompt": [True]}, 400, "prompt is invalid", "prompt"),
    ("POST", "/v1/completions", {"prompt": {"text": "x"}}, 400, "prompt is invalid", "prompt"),
    ("POST", "/v1/completions", {"prompt": []}, 400, "prompt is empty", "prompt"),
    ("POST", "/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request", "prompt"),
    ("POST", "/v1/completions", {"prompt": "x" * 300}, 400, "context length is 256", "prompt"),
    ("POST", "/v1/completions", {"prompt": "x" * 5000}, 400, "5000 characters cannot fit in 255 tokens", "prompt"),
    ("POST", "/v1/completions", {}, 400, "prompt: Field required", "prompt"),
    # unsupported or unknown fields, another model
    ("POST", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n=2 is not supported", "n"),
    ("POST", "/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty=0.5",
     "presence_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 1}, 400, "logprobs are not supported", "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True}, 400, "echo and logprobs", "echo"),
    ("POST", "/v1/completions", {"prompt": "x", "bogus": 1}, 400, "unknown field 'bogus'", "bogus"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 400, "model 'gpt-4' is not served here", "model"),
    # bodies that do not parse or are not objects, or are too large
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8", None),
    ("POST", "/v1/completions", b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", 400, "", ...),
    ("POST", "/v1/completions", b"{not json", 400, "not valid JSON", None),
    ("POST", "/v1/completions", b"[1, 2]", 400, "must be a JSON object", None),
    ("POST", "/v1/completions", b'"hi"', 400, "must be a JSON object", None),
    ("POST", "/v1/completions", b"", 400, "the request body is empty", None),
    ("POST", "/v1/completions", {"prompt": "x" * (LIMIT + 10)}, 413, f"at most {LIMIT} bytes", None),
    # /v1/chat/completions
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages: List should have at least 1 item", "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role",
     "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}]}, 400,
     "messages.0.content is not valid Unicode", "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0.content: Field required",
     "messages"),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3000}]}, 400,
     "the messages' text is too long", "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": True},
     400, "max_completion_tokens", "max_completion_tokens"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**63}, 400,
     "max_tokens=9223372036854775808", "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 1e-40}, 400,
     "temperature=1e-40", "temperature"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400,
     "stream", "stream"),
    # /generate
    ("POST", "/generate", {"prompt": "a\ud800b"}, 400, "not valid Unicode", "prompt"),
    ("POST", "/generate", {"prompt": []}, 400, "prompt is empty", "prompt"),
    ("POST", "/generate", {"prompt": ["a"]}, 400, "prompt is invalid", "prompt"),
    ("POST", "/generate", {"prompt": "x", "max_tokens": 2**63}, 400, "max_tokens=", "max_tokens"),
    ("POST", "/generate", {"prompt": "x", "top_k": 2**63}, 400, "top_k=", "top_k"),
    ("POST", "/generate", {"prompt": [5, 2**70]}, 400, "outside the vocabulary", "prompt"),
    # routes and methods
    ("GET", "/nope", None, 404, "no route GET /nope", None),
    ("POST", "/v1/nope", {"prompt": "x"}, 404, "no route POST /v1/nope", None),
    ("GET", "/v1/completions", None, 405, "method GET is not allowed on /v1/completions: use POST", None),
    ("POST", "/health", {"x": 1}, 405, "use GET", None),
    ("DELETE", "/v1/models", None, 405, "method DELETE", None),
    ("GET", "/docs", None, 404, "no route", None),
    ("GET", "/openapi.json", None, 404, "no route", None),
]


def request(conn: http.client.HTTPConnection, method: str, path: str, body=None, headers=None):
    """One request on ``conn`` → (status, headers, JSON body or raw bytes)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={**J, **(headers or {})})
    r = conn.getresponse()
    raw = r.read()
    try:
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(raw)
    except ValueError:
        return r.status, {k.lower(): v for k, v in r.getheaders()}, raw


def connect(base: str) -> http.client.HTTPConnection:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # headers and body go out at once
    return conn


def test_every_bad_request_is_a_clean_4xx_on_a_connection_that_serves_on(text_model):
    path, _ = text_model
    assert len(BAD) >= 40
    with serving(create_app(make_engine(path, 1), MODEL, max_body_bytes=LIMIT)) as base:
        conn = connect(base)
        for method, route, body, status, message, param in BAD:
            case = (method, route, body if not isinstance(body, bytes) or len(body) < 80 else body[:80])
            got, headers, out = request(conn, method, route, body)
            assert got == status, (case, out)
            assert isinstance(out, dict) and set(out) == {"error"}, (case, out)
            error = out["error"]
            assert set(error) == {"message", "type", "param", "code"}, (case, error)
            assert message in error["message"] and error["type"] == "invalid_request_error", (case, error)
            assert "Traceback" not in error["message"] and "TypeError" not in error["message"], (case, error)
            if param is not ...:
                assert error["param"] == param, (case, error)
            assert "close" not in headers.get("connection", ""), case
            sock = conn.sock
            assert sock is not None, case         # the connection stays open
            assert request(conn, "GET", "/v1/models")[0] == 200, case
            assert conn.sock is sock, case         # ... and serves the next request
        status, _, out = request(conn, "POST", "/generate", {"prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert status == 200 and len(out["token_ids"]) == 3


def test_lenient_where_it_is_harmless(text_model):
    """A body without a JSON content type (curl -d) is parsed as JSON; ints are numbers; a chunked body
    over the limit is a 413 too."""
    path, _ = text_model
    with serving(create_app(make_engine(path, 1), MODEL, max_body_bytes=LIMIT)) as base:
        r = httpx.post(f"{base}/generate", content=b'{"prompt": "Hello", "max_tokens": 4, "temperature": 0}',
                       headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 4
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 1, "top_p": 1,
                                                        "seed": 3}, timeout=30)
        assert r.status_code == 200

        def chunks():
            for _ in range(LIMIT // 1000 + 5):
                yield b" " * 1000
        r = httpx.post(f"{base}/v1/completions", content=chunks(), headers=J, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_tokenising_does_not_block_the_event_loop(text_model):
    path, _ = text_model
    engine = make_engine(path, 1)
    tokenize = engine.tokenize

    def slow_tokenize(prompt):
        time.sleep(1.0)
        return tokenize(prompt)
    engine.tokenize = slow_tokenize
    with serving(create_app(engine, MODEL)) as base:
        result = {}

        def post():
            result["r"] = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
        t = threading.Thread(target=post)
        t.start()
        time.sleep(0.3)                                  # the request is being tokenised now
        start = time.perf_counter()
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        assert time.perf_counter() - start < 0.5
        t.join(30)
        assert result["r"].status_code == 200


def test_api_key_host_check_and_docs(text_model):
    path, _ = text_model
    app = create_app(make_engine(path, 1), MODEL, api_key="sekret", public_paths=("/health",),
                     allowed_hosts=["127.0.0.1", "*.example.com"], docs=True)
    with serving(app) as base:
        body = {"prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(f"{base}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
            assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{base}/nope").status_code == 401          # no probing without the key
        assert httpx.get(f"{base}/health").status_code == 200        # public
        assert httpx.get(f"{base}/metrics").status_code == 401       # not public here
        key = {"Authorization": "Bearer sekret"}
        assert httpx.get(f"{base}/metrics", headers=key).status_code == 200
        assert httpx.get(f"{base}/docs", headers=key).status_code == 200
        assert httpx.get(f"{base}/openapi.json", headers=key).json()["info"]["title"] == "specdec"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0, timeout=30)
        assert len(client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].token_ids) == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0).models.list()
        for host, ok in (("evil.com", False), ("127.0.0.1:8000", True), ("api.example.com", True),
                         ("example.com", False), ("[::1]:8000", False)):
            r = httpx.get(f"{base}/v1/models", headers={**key, "Host": host})
            assert (r.status_code == 200) == ok, host
            if not ok:
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"


def test_a_burst_fills_free_rows_before_it_queues(checkpoint):
    target = load(checkpoint("llama"), batch_size=4)
    engine = AsyncEngine(Engine(target), max_waiting=2)
    prefill = target.prefill

    def slow_prefill(*args, **kwargs):
        time.sleep(0.05)
        return prefill(*args, **kwargs)
    target.prefill = slow_prefill

    async def main():
        engine.start()
        try:
            params = RequestParams(max_tokens=8, temperature=0, ignore_eos=True)
            streams = [engine.add_request([5, 6, 7 + i], params) for i in range(6)]    # 4 rows + 2 waiting
            with pytest.raises(EngineBusy):
                engine.add_request([5, 6], params)
            await asyncio.sleep(0.02)        # the worker has claimed the free rows; the first prefill runs
            assert (engine.rows_in_use, engine.num_waiting) == (4, 2)
            outs = [await s.collect() for s in streams]
            assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in outs)
        finally:
            engine.shutdown()
        assert engine.rows_in_use == 0
    asyncio.run(main())


def test_drain_finishes_short_requests_and_ends_the_rest_with_an_error(text_model):
    path, _ = text_model
    engine = make_engine(path, 2)
    step = engine.engine.step

    def slow_step():
        time.sleep(0.01)
        return step()
    engine.engine.step = slow_step
    app = create_app(engine, MODEL)
    server = DrainingServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5), drain_timeout_s=1.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    long = {"prompt": "x", "max_tokens": 240, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            async def stream():
                events = []
                async with client.stream("POST", f"{base}/v1/completions", json={**long, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 1:
                                started.set()
                return events
            started = asyncio.Event()
            streaming = asyncio.create_task(stream())
            short = asyncio.create_task(client.post(f"{base}/generate", json={"prompt": "x", "max_tokens": 20,
                                                                             "temperature": 0}))
            await asyncio.wait_for(started.wait(), 30)
            queued = asyncio.create_task(client.post(f"{base}/v1/completions", json=long))   # waits for a row
            await asyncio.sleep(0.1)
            server.drain()
            await asyncio.sleep(0.1)
            refused = await client.post(f"{base}/v1/completions", json={"prompt": "x"})
            health = await client.get(f"{base}/health")
            return await streaming, await short, await queued, refused, health
    events, short, queued, refused, health = asyncio.run(main())
    thread.join(30)
    assert not thread.is_alive()
    sock.close()
    assert short.status_code == 200 and len(short.json()["token_ids"]) == 20     # finished within the grace
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    assert 1 < len(events) - 2 < 240
    assert queued.status_code == 503 and queued.json()["error"]["code"] == "shutting_down"
    assert engine.rows_in_use == 0 and not engine.running


def doc_curl_commands() -> list[tuple[str, str]]:
    """(file:line, command) of every ``curl`` command in the ```bash blocks of README.md and docs/: its lines up
    to one that ends neither inside a single-quoted string nor with a backslash."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for doc in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        in_bash, command, start = False, None, 0
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                in_bash = line.strip() == "```bash"
                continue
            if in_bash and command is None and line.lstrip().startswith("curl "):
                command, start = [], number
            if command is None:
                continue
            command.append(line)
            text = "\n".join(command)
            if text.count("'") % 2 == 0 and not text.endswith("\\"):
                found.append((f"{doc.relative_to(root)}:{start}", text))
                command = None
    return found


CURLS = doc_curl_commands()


def test_the_docs_curl_examples_run_as_written(text_model, monkeypatch):
    """Every curl line of the docs, against a served model (its port for localhost:8000; `-f`: an HTTP error
    fails), answers 200 with JSON."""
    import shutil
    import subprocess

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    assert len(CURLS) >= 3, CURLS
    path, _ = text_model
    monkeypatch.setenv("SPECDEC_API_KEY", "sekret")
    app = create_app(make_engine(path, 1), MODEL, api_key="sekret")
    with serving(app) as base:
        for where, command in CURLS:
            command = command.replace("localhost:8000", base.removeprefix("http://")).replace("curl ", "curl -f ", 1)
            if "Authorization" not in command:
                command = command.replace("curl ", "curl -H 'Authorization: Bearer sekret' ", 1)
            run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, (where, command, run.stdout, run.stderr)
            assert isinstance(json.loads(run.stdout), dict), where


def test_a_client_that_stalls_its_body_gets_408_and_others_are_served(text_model):
    path, _ = text_model
    app = create_app(make_engine(path, 1), MODEL, body_timeout_s=0.5)
    with serving(app) as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{\"prompt\": ")       # 11 of the 100 bytes, then nothing
            start = time.monotonic()
            assert httpx.get(f"{base}/health").status_code == 200        # the server serves others meanwhile
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = slow.recv(4096)
                if not chunk:
                    break
                reply += chunk
            waited = time.monotonic() - start
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and 0.4 < waited < 5, (head, waited)
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    with pytest.raises(ValueError, match="body_timeout_s must be > 0"):
        create_app(make_engine(path, 1), MODEL, body_timeout_s=0)
