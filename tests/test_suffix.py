"""Suffix decoding (``specdec.suffix``): the index and the frequency-scored trees it proposes, the global
cache's bound over 10,000 requests and its safety under concurrent updates (alone and under a running
engine), greedy identity with target-only (tiny model; the embedded SmolLM2 at batch 1 and batch 3 with
rows joining), and chi-square losslessness of sampled tree verification."""
import random
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from specdec import DecoderModel, SpeculativeGenerator
from specdec.suffix import SuffixCache, SuffixChain, SuffixDraft, SuffixIndex, speculate
from specdec.suffix.replay import Replay, VerifyCost, replay
from specdec.suffix.speculate import continuation

from conftest import VOCAB, load, prompt_ids
from test_lookup import record_widths
from test_speculative import lossless_pvalue, save_tiny

REPEATED = [[1, 2, 3, 4, 5, 6]] * 3 + [[1, 2, 3, 7, 8], [9, 2, 3, 4, 5, 10]]


def cache_of(seqs, **kw) -> SuffixCache:
    cache = SuffixCache(**kw)
    for s in seqs:
        cache.add(s)
    return cache


# ---------------------------------------------------------------- the index and the drafts
def test_a_repeated_text_is_proposed_as_a_tree_with_its_frequencies():
    cache = cache_of(REPEATED)
    found = cache.candidates([0, 2, 3])                       # "2 3" occurs 5 times: match length 2
    assert sorted(c[3] for c in found) == [2] * 5
    draft = speculate(found, 4, 8, alpha=4.0, min_prob=0.1)
    # continuations 4 5 6 (3x), 7 8 (1x), 4 5 10 (1x): best-first by count, then depth
    assert draft.tokens == [4, 5, 6, 7, 8, 10]
    assert draft.parents == [0, 1, 2, 0, 4, 2]
    assert draft.probs == pytest.approx([0.8, 0.8, 0.6, 0.2, 0.2, 0.2])
    assert draft.match_len == 2
    assert speculate(found, 4, 8, alpha=4.0, min_prob=0.3).tokens == [4, 5, 6]          # the frequency threshold
    assert speculate(found, 4, 3, alpha=4.0, min_prob=0.1).tokens == [4, 5, 6]          # the node budget
    assert speculate(found, 4, 8, alpha=1.0, min_prob=0.1).tokens == [4, 5]             # max_spec = alpha * 2
    chain = speculate(found, 4, 8, alpha=4.0, tree=False)
    assert (chain.tokens, chain.parents) == ([4, 5, 6], [0, 1, 2])


def test_the_longest_match_and_its_budget_win_when_they_score_higher():
    found = cache_of(REPEATED).candidates([1, 2, 3])
    assert sorted(c[3] for c in found) == [2, 3, 3, 3, 3]
    # m = 3: 4 occurrences, budget 3 → 4 5 6 at 3/4 each (2.25); m = 2: all 5, budget 2 → 4 5 at 0.8 (1.6)
    draft = speculate(found, 4, 8, alpha=1.0)
    assert (draft.tokens, draft.match_len) == ([4, 5, 6], 3)
    assert draft.probs == pytest.approx([0.75] * 3)


def test_index_lookups():
    index = SuffixIndex(keys=(1, 4), max_match=6, max_candidates=2)
    index.add(0, [5, 6, 7, 8, 9, 5, 6, 7, 8, 1])
    index.add(1, [6, 7, 8, 2])
    # the 4-gram "5 6 7 8" ends at 3 and 8 of sequence 0; at 8 the match goes on (9 5 6 7 8): longest first
    found = [(sid, e, n) for sid, _, e, n in index.candidates([4, 9, 5, 6, 7, 8])]
    assert found == [(0, 8, 5), (0, 3, 4)]
    assert [(sid, e, n) for sid, _, e, n in index.candidates([3, 7, 8])] == [(1, 2, 2), (0, 8, 2)]
    assert index.candidates([42]) == [] and index.candidates([]) == []
    assert index.candidates([8, 1]) == []              # the last position has no continuation: not indexed
    index.extend(1, [3])                                # ... until a token follows it
    assert [(sid, e, n) for sid, _, e, n in index.candidates([2])] == [(1, 3, 1)]
    assert continuation([7, 24, 8, 24, 8], 2, 5, periodic=True) == [24, 8, 24, 8, 24]
    with pytest.raises(ValueError, match="max_match"):
        SuffixIndex(keys=(1, 8), max_match=4)


# ---------------------------------------------------------------- the global cache
def synthetic_request(rng: random.Random, templates: list[list[int]]) -> list[int]:
    if rng.random() < 0.5:                                           # a template with a few edits
        seq = list(rng.choice(templates))
        for _ in range(3):
            seq[rng.randrange(len(seq))] = rng.randrange(50_000)
        return seq
    return [rng.randrange(50_000) for _ in range(rng.randrange(5, 60))]


def cache_bytes(cache: SuffixCache) -> int:
    """The cache's memory, deep (shared int objects counted each time: an upper bound)."""
    size = sys.getsizeof
    total = size(cache._lru) + size(cache.index.seqs) + sum(size(s) for s in cache.index.seqs.values())
    for table in cache.index.tables:
        total += size(table) + sum(size(k) + size(v) + (sum(map(size, v)) if isinstance(v, list) else 0)
                                   for k, v in table.items())
    return total


def test_cache_memory_stays_under_its_bound_over_10000_requests():
    rng = random.Random(0)
    templates = [[rng.randrange(50_000) for _ in range(rng.randrange(20, 60))] for _ in range(40)]
    requests = [synthetic_request(rng, templates) for _ in range(10_000)]
    cache = SuffixCache(max_tokens=20_000)
    memory = {}
    for i, seq in enumerate(requests, 1):
        cache.add(seq)
        if i % 100 == 0:
            stats = cache.stats()
            assert stats["tokens"] <= 20_000
            assert stats["entries"] <= 3 * 2 * stats["tokens"]        # live entries: <= 2 per token (2 keys)
        if i in (2_000, 10_000):
            memory[i] = cache_bytes(cache)
    stats = cache.stats()
    assert stats["evicted"] > 9_000 and stats["tokens"] > 19_000
    assert stats["tokens"] == sum(len(s) for s in cache.index.seqs.values())
    assert memory[10_000] < 1.3 * memory[2_000]                  # flat once the cache is full
    assert memory[10_000] < 20_000 * 400                         # ~230 bytes per cached token measured
    # what is cached still answers: a template's text proposes its continuation
    t = templates[0]
    draft = speculate(cache.candidates(t[:12]), 4, 4, alpha=1.0)
    assert draft.tokens and draft.tokens[0] in {s[12] for s in cache.index.seqs.values() if list(s[:12]) == t[:12]}


def test_a_sequence_longer_than_the_budget_keeps_its_end_and_lru_keeps_what_lookups_use():
    cache = SuffixCache(max_tokens=10)
    cache.add(list(range(100, 125)))
    assert list(cache.index.seqs[0]) == list(range(115, 125))
    cache = SuffixCache(max_tokens=12)
    cache.add([1, 2, 3, 4])                      # id 0
    cache.add([5, 6, 7, 8])                      # id 1
    cache.add([9, 10, 11, 12])                   # id 2
    assert cache.candidates([1, 2])              # id 0 used: now the most recent
    cache.add([13, 14, 15, 16])                  # evicts id 1, the least recently used
    assert sorted(cache.index.seqs) == [0, 2, 3]
    assert cache.stats()["hit_rate"] == 1.0
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixCache(max_tokens=1)


def check_candidates(context, found):
    for _, seq, e, n in found:
        assert n >= 1 and list(seq[e - n + 1:e + 1]) == list(context[-n:]) and e + 1 < len(seq)


def test_concurrent_updates_while_lookups_run():
    """Writer threads add requests while reader threads look up and build trees: no errors, every
    candidate a real occurrence, and the cache's books balance afterwards."""
    cache = SuffixCache(max_tokens=5_000)
    templates = [prompt_ids(40, s, 200) for s in range(8)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1_500):
                seq = list(rng.choice(templates))
                seq[rng.randrange(40)] = rng.randrange(200)
                cache.add(seq)
        except BaseException as e:      # noqa: BLE001 - reported below
            errors.append(e)

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        done = 0
        try:
            while not stop.is_set() or done < 60:     # (at least 60 lookups each, however the threads run)
                done += 1
                t = rng.choice(templates)
                context = t[:rng.randrange(1, 39)]
                found = cache.candidates(context)
                check_candidates(context, found)
                speculate(found, 6, 8)
        except BaseException as e:      # noqa: BLE001
            errors.append(e)

    writers = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
    readers = [threading.Thread(target=reader, args=(10 + s,)) for s in range(2)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors
    stats = cache.stats()
    assert stats["added"] == 4_500 and stats["tokens"] <= 5_000 and stats["lookups"] > 100
    assert stats["tokens"] == sum(len(s) for s in cache.index.seqs.values())
    assert set(cache._lru) == set(cache.index.seqs)


# ---------------------------------------------------------------- the proposer
def test_proposals_come_from_the_cache_and_the_rows_own_text(checkpoint):
    target = load(checkpoint("llama"), batch_size=2)
    cache = cache_of(REPEATED)
    proposer = SuffixDraft(target, cache, depth=4, num_nodes=6, alpha=4.0, cache_prompts=True)
    out = SimpleNamespace(tokens=torch.tensor([[3], [19]]))
    proposer.start(None, [torch.tensor([0, 2]), torch.tensor([11, 12, 19, 11, 12])], None, None, out)
    proposal = proposer.propose(torch.tensor([[2, 3], [12, 19]]), torch.tensor([3, 6]), 4, None, None)
    # row 0: "2 3" from the cache (the tree above, 6 nodes); row 1: its own "11 12 19" → 11 12 19 11 (periodic)
    assert proposal.tokens[0].tolist() == [4, 5, 6, 7, 8, 10]
    assert proposal.tree.parent[0].tolist() == [0, 0, 1, 2, 0, 4, 2]
    assert proposal.tokens[1].tolist() == [11, 12, 19, 11, 19, 19]                       # then 2 pads (S[-1])
    assert proposal.tree.parent[1].tolist() == [0, 0, 1, 2, 3, 0, 0]
    assert proposal.tree.depth[1].tolist() == [0, 1, 2, 3, 4, 1, 1]
    assert proposer.from_cache.tolist() == [True, False] and proposer.matched.tolist() == [2, 3]
    assert proposer.drafted.tolist() == [6, 4] and proposal.tree.max_depth == 4 and proposal.probs is None
    chain = SuffixChain(target, cache, alpha=4.0)                # the most frequent path, padded with S[-1]
    chain.start(None, [torch.tensor([0, 2]), torch.tensor([11, 12, 19, 11, 12])], None, None, out)
    tokens, matched = chain.matches(torch.tensor([[2, 3], [12, 19]]), torch.tensor([3, 6]), 4)
    assert tokens.tolist() == [[4, 5, 6, 3], [11, 12, 19, 11]] and matched.tolist() == [2, 3]
    chained = chain.propose(torch.tensor([[2, 3], [12, 19]]), torch.tensor([3, 6]), 4, None, None)
    assert chained.num_drafts.tolist() == [3, 4]          # "padded": row 0's last token is padding
    # a row whose length and tail stop matching has finished: its sequence enters the cache, once
    before = len(cache)
    proposer.propose(torch.tensor([[0, 0], [12, 19]]), torch.tensor([2, 6]), 4, None, None)
    assert len(cache) == before + 1 and list(cache.index.seqs[max(cache.index.seqs)]) == [0, 2, 3]
    proposer.finished([0, 1], lengths=[3, 5])                   # row 1 stopped at 5 tokens: cut there
    assert len(cache) == before + 2 and list(cache.index.seqs[max(cache.index.seqs)]) == [11, 12, 19, 11, 12]
    proposer.finished([1])
    assert len(cache) == before + 2


def generators(target, cache, **kw):
    return {"tree": SpeculativeGenerator(SuffixDraft(target, cache, **kw), target),
            "chain": SpeculativeGenerator(SuffixChain(target, cache), target, 4)}


def test_greedy_equals_target_only_on_a_tiny_model(checkpoint):
    target = load(checkpoint("llama"), batch_size=3)
    prompts = [prompt_ids(5, 1) * 3, prompt_ids(7, 2), prompt_ids(11, 3) + prompt_ids(11, 3)[:6]]
    reference = target.generate(prompts, max_new_tokens=40, eos_token_id=[])
    for name, gen in generators(target, SuffixCache(), depth=4, num_nodes=6).items():
        for _ in range(2):                          # the second time the cache holds the first outputs
            assert torch.equal(gen.generate(prompts, max_new_tokens=40, eos_token_id=[]), reference), name
        assert gen.last_stats.mean_acceptance_length > 2.0, name
    eos = int(reference[0, len(prompts[2]) + 20])
    gen = generators(target, SuffixCache(), depth=4, num_nodes=6)["tree"]
    assert torch.equal(gen.generate(prompts, max_new_tokens=40, eos_token_id=eos),
                       target.generate(prompts, max_new_tokens=40, eos_token_id=eos))


def test_a_chain_step_verifies_only_the_drafts_found(checkpoint):
    """SuffixChain is "padded": a step verifies the longest active row's real drafts, a decode step when no
    row matched (test_lookup's rule); greedy output stays target-only's, with and without a warm cache."""
    target = load(checkpoint("llama"), batch_size=3)
    prompts = [prompt_ids(5, 1) * 3, prompt_ids(7, 2), prompt_ids(11, 3) + prompt_ids(11, 3)[:6]]
    reference = target.generate(prompts, max_new_tokens=40, eos_token_id=[])
    chain = SuffixChain(target, SuffixCache())
    gen = SpeculativeGenerator(chain, target, 4)
    steps = record_widths(gen, target, chain)
    for _ in range(2):
        assert torch.equal(gen.generate(prompts, max_new_tokens=40, eos_token_id=[]), reference)
    for active, found, width in steps:
        assert min(found) >= 0 and width == 1 + max(f for f, a in zip(found, active) if a)
    assert {width for _, _, width in steps} & {1, 2, 3, 4}


def test_cache_updates_from_another_thread_while_the_engine_runs(checkpoint):
    target = load(checkpoint("llama"), batch_size=3)
    prompts = [prompt_ids(6, 4), prompt_ids(9, 5), prompt_ids(4, 6)]
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    cache = SuffixCache(max_tokens=3_000)
    gen = SpeculativeGenerator(SuffixDraft(cache=cache, target=target, depth=4, num_nodes=6), target)
    stop, errors = threading.Event(), []

    def writer() -> None:
        rng = random.Random(0)
        try:
            # the reference outputs, cut and mutated: real matches; a pause between adds, or the writer's
            # pure-Python sweeps hold the GIL and the engine thread waits a switch interval for every op
            while not stop.wait(0.001):
                row = reference[rng.randrange(3)].tolist()
                row[rng.randrange(len(row))] = rng.randrange(VOCAB)
                cache.add(row[rng.randrange(10):])
        except BaseException as e:          # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(3):
            assert torch.equal(gen.generate(prompts, max_new_tokens=30, eos_token_id=[]), reference)
    finally:
        stop.set()
        thread.join()
    assert not errors and cache.stats()["hits"] > 0 and gen.stats.accepted > 0


@pytest.fixture(scope="module")
def lossless_target(tmp_path_factory):
    hf, path = save_tiny(tmp_path_factory, "suffix-lossless", 2, 3, vocab=VOCAB)
    return hf, DecoderModel.from_pretrained(path, batch_size=512, n_positions=32, context_buckets=[8], kv_buckets=[32],
                                            backend="eager", progress=False)


def test_sampled_trees_are_lossless(lossless_target):
    """Each call's 512 finished rows (prompt + sample) enter the cache, so later calls propose trees of
    the samples' most frequent continuations, several children per node."""
    hf, target = lossless_target
    proposer = SuffixDraft(target, SuffixCache(max_candidates=16), depth=3, num_nodes=6, alpha=2.0, min_prob=0.05,
                           cache_prompts=True)
    branching = []                  # per step: the most real children of a root, the most real nodes

    def recorded(*args):
        proposal = propose(*args)
        real = torch.arange(6) < proposer.drafted.unsqueeze(1)                     # [B, N] real (not padding)
        roots = ((proposal.tree.parent[:, 1:].cpu() == 0) & real).sum(1)
        branching.append((int(roots.max()), int(proposer.drafted.max())))
        return proposal

    propose = proposer.propose
    proposer.propose = recorded
    gen = SpeculativeGenerator(proposer, target)
    pvalue = lossless_pvalue(hf, target, gen, dict(temperature=0.7), 2, calls=20)     # 10,240 samples
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert max(b[0] for b in branching) >= 3 and max(b[1] for b in branching) == 6     # real trees, full budget
    assert proposer.cache.stats()["hits"] > 0
    assert pvalue > 1e-3


# ---------------------------------------------------------------- the embedded SmolLM2
CODE = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n"]        # the model answers both alike
BUDGET = 16


@pytest.fixture(scope="module")
def embedded():
    def make(batch_size):
        return DecoderModel.from_pretrained(None, batch_size=batch_size, n_positions=128, context_buckets=[32, 64],
                                            kv_buckets=[64, 128], backend="eager", progress=False)
    one = make(1)
    prompts = [one.tokenizer(t, add_special_tokens=False)["input_ids"] for t in CODE]
    refs = [one.generate([p], max_new_tokens=BUDGET, eos_token_id=[])[0, len(p):].tolist() for p in prompts]
    return SimpleNamespace(one=one, make=make, prompts=prompts, refs=refs)


@pytest.mark.slow
def test_embedded_greedy_batch1_equals_target_only(embedded):
    gen = SpeculativeGenerator(SuffixDraft(embedded.one, depth=4, num_nodes=4), embedded.one)
    for i in (0, 1, 0):                          # later requests find the earlier outputs in the cache
        p = embedded.prompts[i]
        assert gen.generate([p], max_new_tokens=BUDGET, eos_token_id=[])[0, len(p):].tolist() == embedded.refs[i]
        if i == 1:
            assert gen.last_stats.mean_acceptance_length >= 3.0
    assert gen.last_stats.mean_acceptance_length >= 3.0
    assert gen.proposer.cache.stats()["sequences"] == 3         # each request entered when it ended


@pytest.mark.slow
def test_embedded_greedy_batch3_rows_joining(embedded):
    """Requests 0 and 1 start in rows 0 and 1; after 2 steps request 0 comes again into row 2; when a row
    finishes it is released and request 1 comes again into it (by then the cache holds a finished
    output): every row's output is target-only batch-1 greedy."""
    target = embedded.make(3)
    gen = SpeculativeGenerator(SuffixDraft(target, depth=4, num_nodes=4), target)
    engine, kw = gen.engine, dict(max_new_tokens=BUDGET, eos_token_id=[])
    rows = {engine.add(embedded.prompts[i], **kw): i for i in (0, 1)}
    for _ in range(2):
        engine.step()
    rows[engine.add(embedded.prompts[0], **kw)] = 0
    done: list[tuple[int, list[int]]] = []
    while engine.active_rows or len(done) < 4:
        engine.step()
        for r in [r for r in rows if engine.rows[r] is not None and engine.rows[r].done]:
            done.append((rows.pop(r), engine.rows[r].new))
            engine.release(r)                       # (its output entered the cache when it finished)
            if len(done) == 1:
                rows[engine.add(embedded.prompts[1], row=r, **kw)] = 1
    assert sorted(i for i, _ in done) == [0, 0, 1, 1]
    for i, new in done:
        assert new == embedded.refs[i], i
    assert gen.stats.accepted > 0 and gen.proposer.cache.stats()["hits"] > 0


# ---------------------------------------------------------------- replay on recorded greedy outputs

@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_replay_takes_the_engines_steps(checkpoint, kind):
    """A replay over the requests' target-only greedy outputs takes the engine's steps, request by request
    (the cache filling as they finish): the same number of steps, drafts (chains; a tree step counts its depth)
    and emitted tokens; the accepted drafts too, but in a request's last step, where the engine may accept
    drafts past the budget and then cut them. The oracle verifies only what it accepts, in the same steps."""
    target = load(checkpoint("llama"), batch_size=1)
    prompts = [prompt_ids(5, 1) * 3, prompt_ids(7, 2), prompt_ids(9, 3)] * 2    # the second time from the cache
    outputs = [target.generate([p], max_new_tokens=40, eos_token_id=[])[0, len(p):].tolist() for p in prompts]

    def proposer():
        return SuffixChain(target, SuffixCache()) if kind == "chain" else SuffixDraft(target, depth=4, num_nodes=6)

    gen = SpeculativeGenerator(proposer(), target, 4)
    replayed, oracle, every, bound = proposer(), proposer(), Replay(), Replay()
    for p, out in zip(prompts, outputs):
        assert gen.generate([p], max_new_tokens=40, eos_token_id=[])[0, len(p):].tolist() == out
        stats, r = gen.last_stats, replay(replayed, [(p, out)], 4)
        assert (len(r.steps), r.tokens) == (stats.steps, len(out) - 1)
        if kind == "chain":
            assert r.drafted == stats.drafted
        assert 0 <= stats.accepted - r.accepted <= r.steps[-1].drafted - r.steps[-1].accepted
        best = replay(oracle, [(p, out)], 4, oracle=True)
        assert [(s.accepted, s.emitted) for s in best.steps] == [(s.accepted, s.emitted) for s in r.steps]
        assert best.drafted == best.accepted <= r.drafted
        every.steps += r.steps
        bound.steps += best.steps
    assert every.tau > 1.5
    cost = VerifyCost((1, 5), (10.0, 14.0))
    assert bound.modelled_speedup(cost) > every.modelled_speedup(cost) > 1.0


def test_verify_cost_interpolates_between_measured_sizes():
    cost = VerifyCost.from_decode_steps({"results": [{"batch": 1, "n": 5, "median_ms": 30.0},
                                                     {"batch": 1, "n": 1, "median_ms": 20.0},
                                                     {"batch": 4, "n": 1, "median_ms": 99.0}]})
    assert (cost(1), cost(3), cost(5), cost(10)) == (20.0, 25.0, 30.0, 60.0)
    with pytest.raises(ValueError, match="ascend from 1"):
        VerifyCost((2, 5), (1.0, 2.0))
    with pytest.raises(ValueError, match="batch 1"):
        replay(SuffixChain(SimpleNamespace(batch_size=2, n_positions=64, vocab_size=VOCAB)), [([1], [2])], 4)
