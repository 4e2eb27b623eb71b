"""The serving engine (``specdec.serving.AsyncEngine``) without HTTP: more requests than rows, each
strategy with per-row state inside continuous batching (each output = its batch-1 output), aborts,
shutdown, and the streamed text (stop strings, incomplete characters)."""
import asyncio

import pytest
import torch

from specdec import DraftModel, EagleDraft, Engine, PromptLookup, SpeculativeGenerator
from specdec.serving import AsyncEngine, EngineBusy, RequestParams
from specdec.serving.text import TextStream

from conftest import EOS, checkpoint, load, prompt_ids  # noqa: F401  (fixture)
from test_eagle import saved_target_and_eagle
from test_medusa import draft_for, oracle_heads, token_map_target

pytest.importorskip("prometheus_client")


def requests(vocab: int, n: int = 8) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) of mixed lengths; some prompts repeat themselves (prompt lookup finds n-grams)."""
    out = []
    for i in range(n):
        p = prompt_ids(3 + (5 * i) % 11, 100 + i, vocab)
        out.append((p * 2 if i % 3 == 0 else p, 6 + (7 * i) % 25))
    return out


def offline(path, reqs) -> list[list[int]]:
    """Each request alone, target-only greedy, on a batch-1 model."""
    one = load(path, batch_size=1)
    return [one.generate([p], max_new_tokens=m, eos_token_id=[])[0, len(p):].tolist() for p, m in reqs]


def serve_all(engine: AsyncEngine, reqs, abort: set[int] = frozenset()) -> list:
    """Submit every request at once (more than rows: they queue); abort those in ``abort`` after their
    first delivery. Returns each request's collected output."""
    async def one(i, prompt, max_tokens):
        stream = engine.add_request(prompt, RequestParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        if i in abort:
            first = await stream.__anext__()
            stream.abort()
            rest = await stream.collect()
            rest.token_ids[:0] = first.token_ids
            return rest
        return await stream.collect()

    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(reqs)))
        finally:
            engine.shutdown()
    return asyncio.run(main())


def check(engine: AsyncEngine, path, reqs, abort=frozenset()):
    outs = serve_all(engine, reqs, abort)
    expected = offline(path, reqs)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        if i in abort:
            assert out.finish_reason == "abort" and out.token_ids == ref[:len(out.token_ids)]
        else:
            assert (out.finish_reason, out.token_ids) == ("length", ref), i
    assert all(row is None for row in engine.engine.rows)     # every row was freed
    return outs


def test_more_requests_than_rows_target_only(checkpoint):
    ckpt = checkpoint("llama")
    check(AsyncEngine(Engine(load(ckpt, batch_size=3))), ckpt.path, requests(160, 10), abort={2, 5})


def test_draft_model_inside_continuous_batching(checkpoint):
    ckpt = checkpoint("llama")
    target = load(ckpt, batch_size=3)
    gen = SpeculativeGenerator(DraftModel.from_pretrained(checkpoint("llama-draft").path, target), target, 3)
    check(AsyncEngine(gen.engine), ckpt.path, requests(160), abort={4})
    assert gen.stats.accepted > 0


def test_prompt_lookup_inside_continuous_batching(checkpoint):
    ckpt = checkpoint("llama")
    target = load(ckpt, batch_size=3)
    gen = SpeculativeGenerator(PromptLookup(target), target, 3)
    check(AsyncEngine(gen.engine), ckpt.path, requests(160))


def test_eagle_inside_continuous_batching(tmp_path):
    _, eagle = saved_target_and_eagle(tmp_path)
    target = load(tmp_path / "target", batch_size=3)
    gen = SpeculativeGenerator(EagleDraft.from_pretrained(eagle, target, progress=False), target, 3)
    check(AsyncEngine(gen.engine), tmp_path / "target", requests(64), abort={1})


def test_medusa_inside_continuous_batching(tmp_path):
    hf = token_map_target(0, 64, 64)
    hf.save_pretrained(tmp_path / "target")
    target = load(tmp_path / "target", batch_size=3)
    gen = SpeculativeGenerator(draft_for(target, oracle_heads(hf, 4, 2.5, seed=2), "small_8"), target)
    check(AsyncEngine(gen.engine), tmp_path / "target", requests(64))
    assert gen.stats.accepted > 0


def test_bad_requests_raise_before_queueing_and_a_full_queue_is_busy(checkpoint):
    engine = AsyncEngine(Engine(load(checkpoint("llama"), batch_size=1)), max_waiting=2)

    async def main():
        engine.start()
        try:
            with pytest.raises(ValueError, match="needs 503 positions, but n_positions=128"):
                engine.add_request([5, 6, 7], RequestParams(max_tokens=500))
            with pytest.raises(ValueError, match="token id 999"):
                engine.add_request([5, 999], RequestParams())
            with pytest.raises(ValueError, match="context length is 128"):
                engine.add_request([5] * 128, RequestParams())
            with pytest.raises(ValueError, match="no tokenizer"):
                engine.add_request("text", RequestParams())
            long = [engine.add_request([5, 6], RequestParams(max_tokens=100, temperature=0, ignore_eos=True))
                    for _ in range(3)]    # one row + two waiting
            with pytest.raises(EngineBusy, match="busy"):
                engine.add_request([5, 6], RequestParams(max_tokens=2))
            for s in long:
                s.abort()
            outs = [await s.collect() for s in long]
            assert {o.finish_reason for o in outs} <= {"abort", "length"}
            ok = await engine.add_request([5, 6], RequestParams(max_tokens=3, temperature=0)).collect()
            assert len(ok.token_ids) == 3          # served after the rejections
        finally:
            engine.shutdown()
    asyncio.run(main())


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=1.5), dict(max_tokens=0),
                                 dict(repetition_penalty=0), dict(seed=-1), dict(stop=("",)),
                                 dict(temperature=float("nan"))])
def test_request_params_are_validated(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"{name}=.* is invalid: must be"):
        RequestParams(**bad)


def test_a_failing_request_fails_alone(checkpoint):
    target = load(checkpoint("llama"), batch_size=2)
    engine = AsyncEngine(Engine(target))
    prefill = target.prefill

    def faulty(prompts, *args, **kwargs):
        if int(prompts[0][0]) == 7:
            raise RuntimeError("injected fault")
        return prefill(prompts, *args, **kwargs)
    target.prefill = faulty

    async def main():
        engine.start()
        try:
            good = [engine.add_request([5, 6, 8 + i], RequestParams(max_tokens=12, temperature=0)) for i in range(3)]
            bad = engine.add_request([7, 6], RequestParams(max_tokens=12, temperature=0))
            outs = [await s.collect() for s in good]
            failed = await bad.collect()
            return outs, failed
        finally:
            engine.shutdown()
    outs, failed = asyncio.run(main())
    assert failed.finish_reason == "error" and "injected fault" in failed.error
    target.prefill = prefill
    one = load(checkpoint("llama"), batch_size=1)
    for i, out in enumerate(outs):
        ref = one.generate([[5, 6, 8 + i]], max_new_tokens=12)[0, 3:].tolist()
        assert out.token_ids == ref[:len(out.token_ids)]
        assert (out.finish_reason, len(out.token_ids)) == ("length", 12) or \
            (out.finish_reason, out.token_ids[-1]) == ("stop", EOS)


def test_shutdown_aborts_running_requests(checkpoint):
    engine = AsyncEngine(Engine(load(checkpoint("llama"), batch_size=1)))

    async def main():
        engine.start()
        streams = [engine.add_request([5, 6], RequestParams(max_tokens=120, temperature=0, ignore_eos=True))
                   for _ in range(2)]
        await streams[0].__anext__()
        await asyncio.to_thread(engine.shutdown)
        return [await s.collect() for s in streams]
    outs = asyncio.run(main())
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert not engine.running


# ---------------------------------------------------------------- streamed text
class CharTokenizer:
    """Token i is chr(i); ids >= 1000 are pieces of one two-byte character (decoded as U+FFFD until
    the pair is complete), as byte-level tokenizers behave."""

    def decode(self, ids, skip_special_tokens=True):
        out, i = [], 0
        while i < len(ids):
            if ids[i] >= 1000:
                out.append("é" if i + 1 < len(ids) and ids[i + 1] >= 1000 else "\ufffd")
                i += 2
            else:
                out.append(chr(ids[i]))
                i += 1
        return "".join(out)


def feed(stream: TextStream, text_or_ids) -> list[str]:
    ids = [ord(c) for c in text_or_ids] if isinstance(text_or_ids, str) else text_or_ids
    return [stream.add([t]) for t in ids]


def test_text_stream_cuts_at_the_first_stop_string_across_tokens():
    s = TextStream(CharTokenizer(), stop=["END", "xyz"])
    pieces = feed(s, "abcEN")
    assert "".join(pieces) == "abc"           # "EN" may start "END": held back
    assert s.add([ord("D")]) == "" and s.stopped
    assert s.text == "abc"
    assert s.add([ord("q")]) == ""            # nothing after the stop


def test_text_stream_releases_a_held_prefix_that_is_not_a_stop():
    s = TextStream(CharTokenizer(), stop=["END"])
    assert "".join(feed(s, "aEN")) == "a"
    assert s.add([ord("x")]) == "ENx" and not s.stopped
    s = TextStream(CharTokenizer(), stop=["END"])
    feed(s, "aE")
    assert s.add([], final=True) == "E"       # the output ended: nothing is held back


def test_text_stream_holds_an_incomplete_character():
    s = TextStream(CharTokenizer())
    assert s.add([ord("a"), 1000]) == "a"
    assert s.add([1001]) == "é"
    assert s.text == "aé" == CharTokenizer().decode([ord("a"), 1000, 1001])


def test_text_pieces_concatenate_to_the_whole_decode():
    tok = CharTokenizer()
    g = torch.Generator().manual_seed(0)
    ids = [int(t) for t in torch.randint(97, 100, (60,), generator=g)]
    s = TextStream(tok, stop=["zz"])
    text = "".join(s.add([t]) for t in ids) + s.add([], final=True)
    assert text == tok.decode(ids)
