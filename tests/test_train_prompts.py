"""The request mixes of draft training data (specdec.tools.train.prompts) and their use in generate_tokens."""
import random
import re
from collections import Counter

import pytest
import torch

from specdec import DecoderModel
from specdec.core.chat import chat_ids
from specdec.tools.bench.prompts import load_records, resolve_prompts
from specdec.tools.train.data import DataConfig, fit_request, generate_data, generate_tokens, token_settings
from specdec.tools.train.prompts import (
    KIND_WEIGHTS,
    LANGUAGES,
    TASKS,
    build_requests,
    math_problem,
    plan_rows,
    written_digest,
    written_file,
    written_requests,
)
from specdec.tools.train.store import embedded_store, read_shard, shard_files

from test_train import tiny_target  # noqa: F401  (module fixture)


@pytest.mark.skipif(not shard_files(embedded_store()), reason="the repository's token store is absent")
def test_topics_mix_replans_the_repository_store_and_its_settings_still_match():
    """The first store was made before the "tasks" mix existed: the "topics" plan of a batch draws the
    categories its shard recorded, and its settings equal those of a default DataConfig today."""
    for f in shard_files(embedded_store()):
        shard = read_shard(f)
        if shard.meta["seed"] != 0:
            continue
        rng = random.Random(shard.meta["seed"] * 1_000_003 + shard.meta["batch"])
        plans = plan_rows("topics", rng, len(shard.tokens))
        assert [p.category for p in plans] == shard.meta["categories"]
        assert shard.meta["settings"] == token_settings(DataConfig())
    assert "prompts" in token_settings(DataConfig(prompts="tasks"))


def test_tasks_mix_wraps_the_targets_passages():
    rng = random.Random(7)
    plans = plan_rows("tasks", rng, 2000)
    counts = Counter(p.kind for p in plans)
    for kind, w in KIND_WEIGHTS.items():   # every kind, near its weight (binomial sd < 1%)
        assert abs(counts[kind] / 2000 - w) < 0.04, (kind, counts)
    replies = [f"Passage number {i} starts here. It names Maria Novak in Millford. It ends." for i in range(len(plans))]
    requests = build_requests(plans, replies)
    for i, (plan, request) in enumerate(zip(plans, requests)):
        if plan.kind in ("summarize", "context_qa", "rewrite", "rag"):
            assert replies[i] in request, plan.kind
        if plan.kind == "rag":   # its own passage and 1-2 other rows' passages, as numbered documents
            others = [int(n) for n in re.findall(r"Passage number (\d+)", request) if int(n) != i]
            assert 1 <= len(others) <= 2 and "Document 2:" in request
            assert all(plans[j].kind not in ("question", "math") for j in others)
        if plan.kind == "translate":
            assert f"Passage number {i} starts here." in request and any(lang in request for lang in LANGUAGES)
        if plan.kind == "math":
            assert "Passage" not in request and any(ch.isdigit() for ch in request)
        if plan.kind == "question":
            assert request == replies[i] and plan.category in {c for c, _, _ in TASKS}
    with pytest.raises(ValueError, match="'topics', 'tasks', 'written'"):
        plan_rows("mt-bench", rng, 3)


def test_math_problems_are_well_posed():
    rng = random.Random(3)
    seen = 0
    for _ in range(500):
        text = math_problem(rng)
        m = re.match(r"Solve for x: (\d+)x \+ (\d+) = (-?\d+)\.", text)
        if m:
            a, b, c = map(int, m.groups())
            assert (c - b) % a == 0   # an integer solution
            seen += 1
        m = re.search(r"pays with a \$(\d+) note", text)
        if m:
            n, price = re.search(r"buys (\d+) of them", text), re.search(r"for \$([\d.]+) each", text)
            assert int(m.group(1)) >= int(n.group(1)) * float(price.group(1))   # change is never negative
    assert seen > 10


def test_fit_request_cuts_the_request_text_not_the_template(tiny_target):  # noqa: F811
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_target)
    short = chat_ids(tok, "write a question")
    assert fit_request(tok, "write a question", 100) == short
    long = " ".join(["w5"] * 300)
    ids = fit_request(tok, long, 64)
    tail = chat_ids(tok, "w5")[-3:]   # the end of the user turn and the generation prompt
    assert len(ids) <= 64 and ids[-3:] == tail


def test_generate_tokens_with_the_tasks_mix(tiny_target):  # noqa: F811
    model = DecoderModel.from_pretrained(tiny_target, batch_size=6, n_positions=160, backend="eager", amp="f32",
                                         progress=False)
    cfg = DataConfig(num_prompts=6, batch_size=6, backend="eager", amp="f32", max_new_tokens=8,
                     max_question_tokens=12, prompts="tasks", max_prompt_tokens=60, seed=2)
    shard = generate_tokens(model, cfg, 0)
    again = generate_tokens(model, cfg, 0)
    assert [t.tolist() for t in shard.tokens] == [t.tolist() for t in again.tokens]   # deterministic
    assert len(shard.tokens) == 6 and all(p <= 60 for p in shard.prompt_lens)
    assert set(shard.meta["categories"]) <= set(KIND_WEIGHTS) | {c for c, _, _ in TASKS}
    for t, p, q in zip(shard.tokens, shard.prompt_lens, shard.meta["questions"]):
        assert torch.equal(t[:p], torch.tensor(fit_request(model.tokenizer, q, 60)))
        assert 0 < len(t) - p <= 8


def test_written_mix_answers_each_request_once_per_seed():
    found = written_requests()
    assert len(found) >= 500 and len({t for _, t in found}) == len(found)      # no request twice
    cats = Counter(c for c, _ in found)
    for needed in ("writing", "math", "coding", "summarization", "translation", "rag", "context_qa", "stem"):
        assert cats[needed] >= 20, cats
    orders = {}
    for seed in (0, 1):
        plans = [p for first in range(0, len(found) + 100, 100)       # batches of 100, the last one short
                 for p in plan_rows("written", random.Random(first), 100, first=first, seed=seed)]
        assert sorted((p.category, p.template) for p in plans) == sorted(found)   # each once
        assert all(p.kind == "written" and p.meta == "" for p in plans)
        assert build_requests(plans, [""] * len(plans)) == [p.template for p in plans]   # taken as written
        orders[seed] = [p.template for p in plans]
    assert orders[0] != orders[1]


def test_written_requests_stay_apart_from_the_evaluation_prompts():
    """No written request (of any shipped file) shares an 8-word run with an MT-Bench question or a
    varied-set prompt, and none is in two files."""
    def shingles(text):
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i:i + 8]) for i in range(len(words) - 7)}
    evaluation = set()
    for name in ("mt-bench", "varied"):
        for _, _, text in load_records(resolve_prompts(name)):
            evaluation |= shingles(text)
    files = sorted(written_file().parent.glob("requests*.jsonl"))
    assert written_file() in files
    shared = [(f.name, t[:60]) for f in files for _, t in written_requests(f) if shingles(t) & evaluation]
    assert not shared, shared
    texts = [t for f in files for _, t in written_requests(f)]
    assert len(set(texts)) == len(texts)          # no request in two files


def test_written_requests_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "requests.jsonl"
    bad.write_text('{"category": "qa", "text": "Why is the sky blue?"}\n{"category": "qa"}\n')
    with pytest.raises(ValueError, match=r"requests.jsonl:2: expected a JSON object"):
        written_requests(bad)
    bad.write_text('{"category": "qa", "text": "  "}\n')
    with pytest.raises(ValueError, match=r":1: empty request"):
        written_requests(bad)
    with pytest.raises(ValueError, match="does not exist"):
        written_requests(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("own_file", [False, True])
def test_generate_tokens_with_the_written_mix(tiny_target, tmp_path, own_file):  # noqa: F811
    """The rows answer the requests in the seed's order, as written (the shipped file or the user's)."""
    requests = None
    if own_file:
        requests = tmp_path / "mine.jsonl"
        requests.write_text("".join(f'{{"category": "c{i % 3}", "text": "Question number {i}?"}}\n' for i in range(7)))
    model = DecoderModel.from_pretrained(tiny_target, batch_size=4, n_positions=200, backend="eager", amp="f32",
                                         progress=False)
    cfg = DataConfig(num_prompts=7, batch_size=4, backend="eager", amp="f32", max_new_tokens=6,
                     prompts="written", max_prompt_tokens=120, seed=3, requests_file=requests and str(requests))
    shards = [generate_tokens(model, cfg, i) for i in (0, 1)]
    plans = plan_rows("written", random.Random(0), 7, seed=3, requests=requests)
    assert {p.template for p in plans} <= {t for _, t in written_requests(requests)}
    for shard, batch in zip(shards, (plans[:4], plans[4:])):
        assert shard.meta["questions"] == [p.template for p in batch]
        assert shard.meta["categories"] == [p.category for p in batch]
        for t, p, q in zip(shard.tokens, shard.prompt_lens, shard.meta["questions"]):
            assert torch.equal(t[:p], torch.tensor(fit_request(model.tokenizer, q, 120)))
            assert 0 < len(t) - p <= 6
    assert len(shards[1].tokens) == 3
    assert token_settings(cfg)["requests"] == written_digest(requests) and "requests_file" not in token_settings(cfg)
    assert "requests" not in token_settings(DataConfig(prompts="tasks"))
    too_many = DataConfig(num_prompts=len(written_requests(requests)) + 1, prompts="written",
                          requests_file=requests and str(requests))
    with pytest.raises(ValueError, match="written mix holds"):
        generate_data(tmp_path / "data", too_many, target_path=tiny_target, progress=False)
