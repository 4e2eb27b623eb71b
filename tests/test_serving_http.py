"""The HTTP server, for real: uvicorn on 127.0.0.1 in a thread, a tiny byte-level model with a real
tokenizer, the official ``openai`` client and httpx as clients. Greedy outputs over HTTP equal offline
``generate`` (with and without speculation); 32 concurrent streams with cancellations; bad requests
get OpenAI-style 400s; ``/metrics`` parses and adds up. Every wait is bounded."""
import asyncio
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specdec import DraftModel, Engine, SpeculativeGenerator  # noqa: E402
from specdec.core.chat import conversation_ids  # noqa: E402
from specdec.serving import AsyncEngine, create_app  # noqa: E402
from specdec.serving.server import running_server as serving  # noqa: E402

from conftest import checkpoint, load  # noqa: E402,F401  (fixture)

MODEL = "tiny"
TEXTS = ["Hello there", "The quick brown fox", "a", "Translate: bonjour le monde", "1 + 1 =", "xyz " * 6]


def byte_tokenizer(directory):
    """A real ``transformers`` tokenizer: byte-level BPE without merges (ids 3..258 = the 256 bytes),
    specials <pad>=0, <s>=1, </s>=2, and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[c] = 3 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(directory)
    return fast


@pytest.fixture(scope="module")
def text_model(checkpoint):
    """The byte-level tiny checkpoint with its tokenizer saved beside it → (path, tokenizer)."""
    ckpt = checkpoint("llama-text")
    return ckpt.path, byte_tokenizer(ckpt.path)


def make_engine(path, batch_size: int, draft=None, max_waiting: int = 64, tokenizer=None) -> AsyncEngine:
    target = load(path, batch_size=batch_size, n_positions=256, context_buckets=[16, 64, 128],
                  kv_buckets=[64, 128, 256])
    if draft is None:
        return AsyncEngine(Engine(target), tokenizer=target.tokenizer, max_waiting=max_waiting)
    gen = SpeculativeGenerator(DraftModel.from_pretrained(draft, target), target, 3)
    return AsyncEngine(gen.engine, tokenizer=tokenizer or target.tokenizer, max_waiting=max_waiting)


def offline(path, ids: list[int], max_tokens: int, **kw) -> list[int]:
    """Target-only generation of one prompt on a batch-1 model: the new tokens up to EOS (included)."""
    one = load(path, batch_size=1, n_positions=256, context_buckets=[16, 64, 128], kv_buckets=[64, 128, 256])
    new = one.generate([ids], max_new_tokens=max_tokens, **kw)[0, len(ids):].tolist()
    return new[: new.index(2) + 1] if 2 in new else new


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client: 'name{label=value}' → value."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


# ---------------------------------------------------------------- outputs equal offline generate
@pytest.mark.parametrize("speculation", ["none", "draft"])
def test_greedy_over_http_equals_offline(text_model, checkpoint, speculation):
    path, tok = text_model
    draft = checkpoint("llama-text-draft").path if speculation == "draft" else None
    engine = make_engine(path, 3, draft)
    with serving(create_app(engine, MODEL)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        for text, n in zip(TEXTS, (40, 17, 25, 30)):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            expected = offline(path, ids, n)
            r = client.completions.create(model=MODEL, prompt=text, max_tokens=n, temperature=0)
            c = r.choices[0]
            assert c.token_ids == expected
            assert c.text == tok.decode(expected, skip_special_tokens=True)
            assert c.finish_reason == ("stop" if expected[-1] == 2 else "length")
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(expected))
            by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=n, temperature=0)
            assert by_ids.choices[0].token_ids == expected
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
        expected = offline(path, conversation_ids(tok, messages), 30)
        assert chat.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
        assert chat.choices[0].message.role == "assistant"
        pieces = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=30, temperature=0, stream=True) if ch.choices]
        assert "".join(pieces) == chat.choices[0].message.content
        r = httpx.post(f"{base}/generate", json={"prompt": TEXTS[1], "max_tokens": 12, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["token_ids"] == offline(
            path, tok(TEXTS[1], add_special_tokens=False)["input_ids"], 12)
        assert client.models.list().data[0].id == MODEL
    if speculation == "draft":
        assert engine.engine.stats.drafted > 0


def test_seeded_sampling_and_stop_strings_over_http(text_model):
    path, tok = text_model
    ids = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    with serving(create_app(make_engine(path, 2), MODEL)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        sample = dict(model=MODEL, prompt=ids, max_tokens=30, temperature=0.9, top_p=0.95, seed=11,
                      extra_body={"top_k": 50, "ignore_eos": True})
        a, b = (client.completions.create(**sample).choices[0].token_ids for _ in range(2))
        assert a == b == offline(path, ids, 30, do_sample=True, temperature=0.9, top_p=0.95, top_k=50, seed=11,
                                 eos_token_id=[])
        assert client.completions.create(**{**sample, "seed": 12}).choices[0].token_ids != a
        greedy = offline(path, ids, 40, eos_token_id=[])
        text = tok.decode(greedy, skip_special_tokens=True)
        stop = text[12:14]
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0, stop=[stop, "\x00\x01"],
                                      extra_body={"ignore_eos": True})
        assert (r.choices[0].text, r.choices[0].finish_reason) == (text[: text.find(stop)], "stop")
        assert r.choices[0].token_ids == greedy[: len(r.choices[0].token_ids)] and \
            len(r.choices[0].token_ids) < 40


def test_a_stopped_server_lets_go_of_its_engine(text_model):
    """FastAPI keeps every endpoint (and so what it closes over) for the life of the process: a process
    that runs server after server (tests, notebooks, benchmarks) must not keep every model."""
    path, _ = text_model
    engine = make_engine(path, 2)
    weights = weakref.ref(engine.target)
    with serving(create_app(engine, MODEL)) as base:
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200
    del engine, r
    gc.collect()
    assert weights() is None


# ---------------------------------------------------------------- concurrency and cancellation
@pytest.mark.parametrize("speculation", ["none", "draft"])
def test_32_concurrent_streams_with_cancellations(text_model, checkpoint, speculation):
    path, tok = text_model
    draft = checkpoint("llama-text-draft").path if speculation == "draft" else None
    engine = make_engine(path, 4, draft)
    prompts = [tok(f"request {i}: " + "ab" * (i % 7), add_special_tokens=False)["input_ids"] for i in range(32)]
    lengths = [5 + (11 * i) % 40 for i in range(32)]
    cancel = {3, 10, 17, 29}

    async def one(client: httpx.AsyncClient, base: str, i: int):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 200 if i in cancel else lengths[i],
                "temperature": 0, "stream": True, "ignore_eos": i in cancel}
        tokens, finish = [], None
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                tokens += choice["token_ids"]
                finish = choice["finish_reason"] or finish
                if i in cancel and len(tokens) >= 3:
                    return None          # leaving the block closes the connection mid-stream
        return tokens, finish

    async def run_all(base: str):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, base, i) for i in range(32))), 300)

    with serving(create_app(engine, MODEL)) as base:
        results = asyncio.run(run_all(base))
        deadline = time.monotonic() + 30
        while (m := metrics(base))["specdec_rows_in_use"] > 0:     # cancelled rows are being freed
            assert time.monotonic() < deadline, "rows were not freed after the clients left"
            time.sleep(0.1)
        after = httpx.post(f"{base}/v1/completions", json={"prompt": prompts[0], "max_tokens": lengths[0],
                                                            "temperature": 0}, timeout=60).json()
        m = metrics(base)
    for i, result in enumerate(results):
        if i in cancel:
            assert result is None
            continue
        tokens, finish = result
        expected = offline(path, prompts[i], lengths[i])
        assert tokens == expected, f"request {i}: cross-talk or a wrong output"
        assert finish == ("stop" if expected[-1] == 2 else "length")
    assert after["choices"][0]["token_ids"] == results[0][0]           # the freed rows serve again
    finished = {k.split("=")[1].rstrip("}"): v for k, v in m.items() if k.startswith("specdec_requests_total")}
    assert finished.get("abort", 0) == len(cancel)
    assert sum(finished.values()) == 33
    streamed = sum(len(r[0]) for r in results if r) + len(after["choices"][0]["token_ids"])
    assert streamed <= m["specdec_generation_tokens_total"] <= streamed + 200 * len(cancel)
    assert m["specdec_prompt_tokens_total"] == sum(map(len, prompts)) + len(prompts[0])
    assert m["specdec_time_to_first_token_seconds_count"] == 33
    assert m["specdec_rows"] == 4 and m["specdec_queue_depth"] == 0
    tau = m["specdec_spec_mean_acceptance_length"]
    assert tau == 1 + m["specdec_spec_accepted_tokens_total"] / m["specdec_spec_steps_total"]
    assert (tau > 1) == (speculation == "draft")


def test_a_client_that_disconnects_frees_its_row(text_model):
    path, tok = text_model
    engine = make_engine(path, 1)
    step = engine.engine.step

    def slow_step():   # 250 steps take > 5 s: the client gives up long before the end
        time.sleep(0.02)
        return step()
    engine.engine.step = slow_step
    with serving(create_app(engine, MODEL)) as base:
        with pytest.raises(httpx.ReadTimeout):   # a non-streaming request abandoned by its client
            httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 250, "temperature": 0,
                                                        "ignore_eos": True}, timeout=0.5)
        deadline = time.monotonic() + 30
        while metrics(base).get("specdec_requests_total{outcome=abort}", 0) < 1:
            assert time.monotonic() < deadline, "the abandoned request was not aborted"
            time.sleep(0.1)
        assert metrics(base)["specdec_rows_in_use"] == 0


# ---------------------------------------------------------------- errors
BAD = [
    ({"prompt": "x", "temperature": -1}, "temperature=-1.0 is invalid: must be a number >= 0"),
    ({"prompt": "x", "top_p": 1.5}, "top_p=1.5 is invalid: must be a number in (0, 1]"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens=0 is invalid"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty=0.0 is invalid"),
    ({"prompt": "x", "n": 2}, "n=2 is not supported"),
    ({"prompt": "x", "bogus": 1}, "unknown field 'bogus'"),
    ({"prompt": "x", "model": "gpt-4"}, "model 'gpt-4' is not served here"),
    ({"prompt": "x" * 300}, "context length is 256"),
    ({"prompt": "hello", "max_tokens": 300}, "n_positions=256"),
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": [5, 9999]}, "token id 9999 (at position 1) is outside the vocabulary"),
    ({"prompt": ["a", "b"]}, "give one prompt per request"),
    ({"prompt": "x", "stop": [""]}, "stop="),
    ({}, "prompt: Field required"),
]


def test_bad_requests_get_400_with_an_openai_error_body(text_model):
    path, _ = text_model
    with serving(create_app(make_engine(path, 1), MODEL)) as base:
        for body, message in BAD:
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert message in error["message"] and error["type"] == "invalid_request_error", (body, error)
        r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "hi"}]})
        assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model=MODEL, prompt="x", temperature=-2)
        # the server still serves after every bad request
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0).choices[0].text \
            is not None
        assert metrics(base)["specdec_rows_in_use"] == 0


def test_a_full_queue_answers_503(text_model):
    path, _ = text_model
    with serving(create_app(make_engine(path, 1, max_waiting=1), MODEL)) as base:
        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"prompt": "x", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*(client.post(f"{base}/v1/completions", json=body) for _ in range(5)))
        codes = sorted(r.status_code for r in asyncio.run(main()))
        assert codes.count(200) >= 2 and codes.count(503) >= 2 and set(codes) == {200, 503}
        busy = [r for r in asyncio.run(main()) if r.status_code == 503][0]
        assert "busy" in busy.json()["error"]["message"] and busy.headers["retry-after"] == "1"


def test_health_is_503_until_the_model_is_ready(text_model):
    path, _ = text_model
    release = threading.Event()

    def loader():
        assert release.wait(60)
        return make_engine(path, 1)
    with serving(create_app(loader=loader, model_name=MODEL)) as base:
        assert httpx.get(f"{base}/health").status_code == 503
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "still loading" in r.json()["error"]["message"]
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def serve_command(path, draft_path, *extra: str, stop: int = signal.SIGINT, api_key: str | None = None,
                  group: bool = True) -> tuple[list[dict], list[int], list[int]]:
    """Run ``specdec serve`` with the draft model (k=2) on the tiny model, ask for one greedy completion,
    stop it with ``stop`` (default Ctrl-C: SIGINT to its process group, as a terminal does; ``group=False``:
    to the command's own process only, as ``docker stop`` does) → (start-up
    events, the completion's token ids, the prompt ids). Asserts a clean exit (status 0, no traceback).
    ``api_key``: passed as $SPECDEC_API_KEY; the completion sends it, and a request without it gets 401."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", str(path), "--backend", "eager", "--amp", "f32",
           "--n-positions", "256", "--batch-size", "2", "--draft", "model", "--draft-path", str(draft_path),
           "--k", "2", "--port", str(port), *extra]
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_API_KEY"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**env, "OMP_NUM_THREADS": "1", **({"SPECDEC_API_KEY": api_key} if api_key else {})})
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ids = [40 + i for i in range(11)]
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "serve did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        body = {"model": path.stem, "prompt": ids, "max_tokens": 20, "temperature": 0}
        if api_key:
            assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        (os.killpg if group else os.kill)(proc.pid, stop)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0 and "Traceback" not in err, err
    logs = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    return [e for e in logs if "event" in e], r.json()["choices"][0]["token_ids"], ids


def test_specdec_serve_command(text_model, checkpoint):
    """The real command: JSON start-up logs, the API key from $SPECDEC_API_KEY, a completion with
    speculation, a drain and a clean exit (status 0) on SIGTERM."""
    path, _ = text_model
    events, tokens, ids = serve_command(path, checkpoint("llama-text-draft").path, "--threads", "1",
                                        "--drain-timeout", "2", stop=signal.SIGTERM, api_key="k-123")
    assert tokens == offline(path, ids, 20)
    assert [e["event"] for e in events][:3] == ["loading", "loaded", "ready"], events
    assert events[1]["proposer"] == "DraftModel" and events[1]["k"] == 2
    assert [e["event"] for e in events][-2:] == ["draining", "stopped"] and events[-2]["signal"] == "SIGTERM"


def test_specdec_serve_tensor_parallel(text_model, checkpoint):
    """--tp-degree 2: two processes, rank 0 serves and mirrors every engine call to rank 1; the output
    equals the single-process offline output; a SIGTERM to the launching process alone drains rank 0 and
    exits 0."""
    path, _ = text_model
    events, tokens, ids = serve_command(path, checkpoint("llama-text-draft").path, "--tp-degree", "2",
                                        "--threads", "2", stop=signal.SIGTERM, group=False)
    assert tokens == offline(path, ids, 20)
    assert events[0]["tp_degree"] == 2 and [e["event"] for e in events].count("loading") == 1
    assert [e["event"] for e in events][-2:] == ["draining", "stopped"], events
