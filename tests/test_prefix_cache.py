"""Prefix caching (``prefix_cache=True``): a row keeps the KV of what it last held and a later prompt that starts
with it encodes only the rest. The kept tokens are counted exactly, the outputs equal those of a model without
the cache (target-only and speculative, greedy, batch 1 and rows joining a running batch), a graph call forgets
the slots it overwrites, the prefix store keeps what rows give up within its bound and restores it into any row,
and the strategies that need the whole prompt's hidden states refuse such a target."""
from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch

from specdec import DecoderModel, Engine, SpeculativeGenerator
from specdec.core.prefix_store import PrefixStore
from specdec.medusa import MedusaHeads, load_tree
from specdec.medusa.draft import MedusaDraft
from specdec.options import ModelOptions, options_from
from specdec.registry import REGISTRY
from specdec.serving import AsyncEngine
from specdec.tools.arguments import add_model_arguments

from conftest import load, prompt_ids
from test_cli import generate_args, new_ids, run
from test_serving_engine import serve_all
from test_suffix_engine import build as build_suffix

NEW = 8
BUCKETS = dict(context_buckets=[16, 32, 64], kv_buckets=[32, 64, 128])


def build(name: str, target, checkpoint):
    """The registry's ``name`` for ``target`` (model parts: the tiny llama draft)."""
    if REGISTRY[name].suffix is not None:
        return build_suffix(name, target, checkpoint)
    return REGISTRY[name].build(target, checkpoint("llama-draft").path)


def turns(reference, first: list[int], n: int = 3) -> list[list[int]]:
    """A conversation's prompts: each one re-sends the previous prompt and its greedy output (``reference``),
    then adds 6 new tokens (a user's next message)."""
    prompts = [first]
    for i in range(n - 1):
        prompts.append(prompts[-1] + reference(prompts[-1]) + prompt_ids(6, 50 + i))
    return prompts


@pytest.fixture(scope="module")
def reference(ckpt):
    """prompt → target-only greedy output (NEW tokens) of a model without a prefix cache."""
    plain, memo = load(ckpt, **BUCKETS), {}

    def get(p: list[int]) -> list[int]:
        if tuple(p) not in memo:
            memo[tuple(p)] = plain.generate([p], max_new_tokens=NEW, eos_token_id=[])[0, len(p):].tolist()
        return memo[tuple(p)]
    return get


def test_a_conversation_keeps_every_earlier_token_and_generates_the_same(ckpt, reference):
    cached = load(ckpt, prefix_cache=True, **BUCKETS)
    prompts = turns(reference, prompt_ids(10, 1))
    for p in prompts:
        assert cached.generate([p], max_new_tokens=NEW, eos_token_id=[])[0, len(p):].tolist() == reference(p)
    # turn t keeps turn t-1's prompt and output but the last token (never fed: the cache holds S[:-1])
    assert cached.prompt_tokens_kept == sum(len(p) + NEW - 1 for p in prompts[:-1])


def test_without_the_setting_nothing_is_kept(ckpt, reference):
    plain = load(ckpt, **BUCKETS)
    for p in turns(reference, prompt_ids(10, 1)):
        plain.generate([p], max_new_tokens=NEW, eos_token_id=[])
    assert plain.prompt_tokens_kept == 0


def test_a_kept_prefix_encodes_the_rest_as_the_whole_prompt_would(ckpt):
    """The first token's logits after a kept prefix equal those of encoding the whole prompt at once."""
    first, rest = prompt_ids(20, 2), prompt_ids(9, 3)
    cached, plain = load(ckpt, prefix_cache=True, **BUCKETS), load(ckpt, **BUCKETS)
    params = plain.sampling_params(do_sample=False)
    cached.prefill([torch.tensor(first)], params)
    out = cached.prefill([torch.tensor(first + rest)], params)
    ref = plain.prefill([torch.tensor(first + rest)], params)
    assert cached.prompt_tokens_kept == len(first)
    torch.testing.assert_close(out.logits[:, -1], ref.logits[:, -1], atol=1e-4, rtol=1e-4)
    assert out.tokens[0, -1] == ref.tokens[0, -1]
    assert int(cached.lengths[0]) == len(first) + len(rest)


def test_a_graph_call_forgets_the_slots_it_writes(ckpt):
    model = load(ckpt, prefix_cache=True, **BUCKETS)
    prompt = prompt_ids(20, 4)
    params = model.sampling_params(do_sample=False)
    model.prefill([torch.tensor(prompt)], params)
    assert model.cached_length(0) == 20 and model.shared_prefix(0, prompt + [1]) == 20
    model.set_lengths(torch.tensor([12]))               # a rollback alone keeps the slots ...
    assert model.cached_length(0) == 20
    model.step(torch.tensor([[5, 6]]), params)          # ... a step writing slots 12, 13 does not
    assert model.cached_length(0) == 12 and model.shared_prefix(0, prompt) == 12
    model.prefill([torch.tensor(prompt)], params)       # kept 12 (the rest, 8 tokens, takes a smaller bucket)
    assert model.prompt_tokens_kept == 12 and model.cached_length(0) == 20
    model.reset()
    assert model.cached_length(0) == 0


@pytest.mark.parametrize("name", ["model", "lookup+model", "suffix+model", "suffix"])
def test_speculation_with_a_prefix_cache_generates_target_only_output(checkpoint, ckpt, reference, name):
    target = load(ckpt, prefix_cache=True, **BUCKETS)
    gen = SpeculativeGenerator(build(name, target, checkpoint), target, 3)
    prompts = turns(reference, prompt_ids(10, 5))
    for p in prompts:
        assert gen.generate([p], max_new_tokens=NEW, eos_token_id=[])[0, len(p):].tolist() == reference(p)
    assert target.prompt_tokens_kept == sum(len(p) + NEW - 1 for p in prompts[:-1])
    draft = gen.proposer.draft if name != "model" else gen.proposer
    if draft is not None and draft.model is not None:     # the draft model keeps its own cache's prefix too
        assert draft.model.prefix_cache and draft.model.prompt_tokens_kept > 0


def test_fused_speculation_with_a_prefix_cache(checkpoint, ckpt, reference):
    target = load(ckpt, prefix_cache=True, **BUCKETS)
    gen = SpeculativeGenerator(build("model", target, checkpoint), target, 3, fused=True)
    prompts = turns(reference, prompt_ids(10, 6))
    for p in prompts:
        assert gen.generate([p], max_new_tokens=NEW, eos_token_id=[])[0, len(p):].tolist() == reference(p)
    assert target.prompt_tokens_kept > 0 and gen.proposer.model.prompt_tokens_kept > 0


def test_a_free_row_keeps_its_prefix_while_the_batch_runs_and_its_next_turn_takes_it(ckpt, reference):
    """Row 0's conversation ends and waits while row 1 keeps stepping (longer); the next turn goes to row 0
    (the free row holding most of it, as llama.cpp's server picks a slot) and keeps all of it."""
    engine = Engine(load(ckpt, batch_size=3, prefix_cache=True, **BUCKETS))
    kw = dict(max_new_tokens=NEW, eos_token_id=[])
    short, long = prompt_ids(10, 7), prompt_ids(30, 8)
    a = engine.add(short, **kw)
    engine.add(long, max_new_tokens=40, eos_token_id=[])
    while not engine.rows[a].done:
        engine.step()
    assert engine.rows[a].new == reference(short)
    engine.release(a)
    for _ in range(3):                           # row a is free while row b steps
        engine.step()
    assert engine.target.cached_length(a) == len(short) + NEW - 1
    nxt = short + reference(short) + prompt_ids(6, 9)
    before = engine.target.prompt_tokens_kept
    row = engine.add(nxt, **kw)
    assert row == a and engine.target.prompt_tokens_kept - before == len(short) + NEW - 1
    while engine.active_rows:
        engine.step()
    assert engine.rows[row].new == reference(nxt)


def test_the_server_picks_the_row_holding_the_prompt_and_counts_kept_tokens(ckpt, reference):
    engine = AsyncEngine(Engine(load(ckpt, batch_size=2, prefix_cache=True, **BUCKETS)))
    first = prompt_ids(12, 10)
    second = first + reference(first) + prompt_ids(5, 11)
    (out,) = serve_all(engine, [(first, NEW)])
    assert out.token_ids == reference(first)
    (out,) = serve_all(engine, [(second, NEW)])
    assert out.token_ids == reference(second)
    text = engine.metrics.exposition().decode()
    assert f"specdec_prompt_tokens_cached_total {float(len(first) + NEW - 1)}" in text


def interleaved_turns(reference, n: int = 3) -> list[list[int]]:
    """Two conversations' turns, alternating (A1 B1 A2 B2 ...): each turn's row served the other one in between."""
    a, b = turns(reference, prompt_ids(10, 13), n), turns(reference, prompt_ids(10, 14), n)
    return [p for pair in zip(a, b) for p in pair]


def kept_by_turn(prompts: list[list[int]]) -> int:
    """Tokens a turn keeps when its conversation's previous turn (two prompts back) is kept: prompt + output
    but the last token."""
    return sum(len(p) + NEW - 1 for p in prompts[:-2])


def test_the_prefix_store_keeps_what_a_row_gives_up_for_the_conversation_that_comes_back(ckpt, reference):
    """Batch 1, two conversations alternating: each turn finds its row holding the other conversation; the store
    gives back its own previous turn (outputs equal a model without any cache). Without the store
    (prefix_cache_mb=0) the row keeps nothing of it."""
    prompts = interleaved_turns(reference)
    stored = load(ckpt, prefix_cache=True, **BUCKETS)
    for p in prompts:
        assert stored.generate([p], max_new_tokens=NEW, eos_token_id=[])[0, len(p):].tolist() == reference(p)
    assert stored.prompt_tokens_kept == kept_by_turn(prompts)
    assert stored.prefix_store.stats()["restored"] == len(prompts) - 2
    rows_only = load(ckpt, prefix_cache=True, prefix_cache_mb=0, **BUCKETS)
    assert rows_only.prefix_store is None
    for p in prompts:
        rows_only.generate([p], max_new_tokens=NEW, eos_token_id=[])
    assert rows_only.prompt_tokens_kept == 0


def test_a_stored_prefix_goes_back_into_another_row_as_the_whole_prompt_would_encode(ckpt):
    first, other, rest = prompt_ids(20, 15), prompt_ids(20, 16), prompt_ids(9, 17)
    cached, plain = load(ckpt, batch_size=2, prefix_cache=True, **BUCKETS), load(ckpt, **BUCKETS)
    params = cached.sampling_params(do_sample=False)
    cached.prefill([torch.tensor(first)], params, rows=[0])
    cached.prefill([torch.tensor(other)], params, rows=[0])          # row 0 gives up ``first``: stored
    out = cached.prefill([torch.tensor(first + rest)], params, rows=[1])
    ref = plain.prefill([torch.tensor(first + rest)], plain.sampling_params(do_sample=False))
    assert cached.prompt_tokens_kept == len(first) and cached.prefix_store.stats()["restored"] == 1
    torch.testing.assert_close(out.logits[:, -1], ref.logits[:, -1], atol=1e-4, rtol=1e-4)
    assert cached.cached_length(1) == len(first + rest) and cached.shared_prefix(0, other + [1]) == len(other)


def test_the_prefix_store_stays_within_its_bound_least_recently_used_first():
    def slots(n: int) -> Callable[[], list[torch.Tensor]]:
        return lambda: [torch.zeros(n, 4), torch.zeros(n, 4)]     # 32 bytes a token
    store = PrefixStore(32 * 100)
    store.add(list(range(40)), slots(40))
    store.add(list(range(100, 140)), slots(40))
    assert store.longest(list(range(10)) + [7]) == (10, store.entries[0])
    store.hit(store.entries[0])                                   # the first entry becomes the most recent
    store.add(list(range(200, 240)), slots(40))                   # 120 tokens > 100: the least recent goes
    assert [e.tokens[0] for e in store.entries.values()] == [0, 200] and store.bytes == 32 * 80
    store.add(list(range(200, 250)), slots(50))                   # extends an entry: replaces it
    assert [e.tokens[0] for e in store.entries.values()] == [0, 200] and store.bytes == 32 * 90
    store.add(list(range(200, 220)), lambda: pytest.fail("read"))  # held already (a prefix of an entry): not read
    store.add(list(range(300, 410)), slots(110))                  # larger than the bound: not kept
    assert store.stats() == {"entries": 2, "bytes": 32 * 90, "max_bytes": 3200, "added": 3 + 1, "restored": 1,
                             "evicted": 1}
    assert store.longest([5, 6]) == (0, None)
    _, found = store.longest(list(range(200, 260)))
    store.add(list(range(200, 270)), slots(70))                   # replaces the entry longest found (and evicts)
    store.hit(found)                                              # restored all the same (its copies live on)
    assert [len(e.tokens) for e in store.entries.values()] == [70] and store.stats()["restored"] == 2
    with pytest.raises(ValueError, match="budget must be an int >= 0"):
        PrefixStore(-1)


def test_prefix_cache_mb_must_be_a_size(ckpt):
    with pytest.raises(ValueError, match="prefix_cache_mb must be an int >= 0"):
        DecoderModel.from_pretrained(ckpt.path, backend="eager", prefix_cache=True, prefix_cache_mb=-1,
                                     progress=False)


def test_the_server_restores_stored_prefixes_and_reports_the_store(ckpt, reference):
    engine = AsyncEngine(Engine(load(ckpt, prefix_cache=True, **BUCKETS)))
    prompts = interleaved_turns(reference, 2)
    for p in prompts:
        (out,) = serve_all(engine, [(p, NEW)])
        assert out.token_ids == reference(p)
    text = engine.metrics.exposition().decode()
    assert "specdec_prefix_store_restored_total 2.0" in text
    assert f"specdec_prompt_tokens_cached_total {float(kept_by_turn(prompts))}" in text
    assert "specdec_prefix_store_entries 2.0" in text


def test_drafts_reading_the_prompts_hidden_states_refuse_a_prefix_cache_target(ckpt):
    target = load(ckpt, prefix_cache=True, **BUCKETS)
    heads = MedusaHeads(target.config.hidden_size, target.vocab_size, 4)
    with pytest.raises(ValueError, match="Medusa reads the target's hidden states .* prefix_cache=False"):
        SpeculativeGenerator(MedusaDraft(heads, load_tree("chain_4"), target), target)


def test_the_neuron_backend_refuses_a_prefix_cache(ckpt):
    with pytest.raises(ValueError, match="prefix_cache"):
        DecoderModel.from_pretrained(ckpt.path, backend="neuron", prefix_cache=True, progress=False)



def test_the_cli_flag_reaches_the_loaded_models(ckpt, reference, capsys):
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    options = options_from(ModelOptions, parser.parse_args(["--model", str(ckpt.path), "--prefix-cache",
                                                            "--backend", "eager", "--amp", "f32",
                                                            "--n-positions", "128"]))
    loaded = options.load(progress=False)
    assert options.prefix_cache and loaded.prefix_cache and loaded.prefix_store.max_bytes == 1024 << 20
    options = options_from(ModelOptions, parser.parse_args(["--model", str(ckpt.path), "--prefix-cache",
                                                            "--prefix-cache-mb", "0", "--backend", "eager",
                                                            "--n-positions", "128"]))
    assert options.prefix_cache_mb == 0 and options.load(progress=False).prefix_store is None
    prompt = prompt_ids(10, 12)
    rc, out, err = run(generate_args(ckpt.path, prompt, NEW, 128, "--prefix-cache", "--draft", "lookup"), capsys)
    assert rc == 0, err
    assert new_ids(out) == reference(prompt)
