"""The token store (specdec.tools.train.store), labelling by prefill (label_sequences / label_store) and the
large-batch decode attention, on the tiny random target of test_train."""
import argparse
import json

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from specdec import DecoderModel
from specdec.tools.train import data as data_mod
from specdec.tools.train.cli import prepare_data
from specdec.tools.train.data import DataConfig, generate_data, label_sequences, label_store, load_dataset
from specdec.tools.train.store import Shard, is_store, read_shard, read_store, shard_files, write_shard

from test_train import VOCAB, tiny_target  # noqa: F401  (module fixture)

DATA = dict(num_prompts=3, batch_size=3, backend="eager", amp="f32", max_new_tokens=20, max_question_tokens=6,
            sample_fraction=0.34, seed=5)


def test_store_round_trips_token_ids_exactly(tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 49152, (n,), generator=g) for n in (5, 1, 300)]
    rows[0][0], rows[2][-1] = 0, 49151
    shard = Shard(rows, [2, 1, 17], [False, True, False], {"categories": ["a", "b", "c"]})
    f = write_shard(tmp_path, 3, 7, shard, vocab_size=49152)
    assert f.name == "answers-s3-00007.npz" and is_store(tmp_path)
    with np.load(f) as z:
        assert z["tokens"].dtype == np.uint16
    back = read_shard(f)
    assert [t.tolist() for t in back.tokens] == [t.tolist() for t in rows]
    assert all(t.dtype == torch.long for t in back.tokens)
    assert back.prompt_lens == [2, 1, 17] and back.sampled == [False, True, False]
    assert back.meta["categories"] == ["a", "b", "c"] and (back.meta["seed"], back.meta["batch"]) == (3, 7)
    # a vocabulary past uint16 is kept as int32, also exactly
    big = [torch.tensor([70000, 3, 65536])]
    f2 = write_shard(tmp_path / "big", 0, 0, Shard(big, [1], [False]), vocab_size=80000)
    assert read_shard(f2).tokens[0].tolist() == [70000, 3, 65536]
    with pytest.raises(ValueError, match="outside"):
        write_shard(tmp_path / "bad", 0, 0, Shard([torch.tensor([5, 160])], [1], [False]), vocab_size=160)
    assert not is_store(tmp_path / "bad") and not (tmp_path / "bad" / "answers-s0-00000.npz").exists()
    # order: by seed, then batch
    write_shard(tmp_path, 3, 2, shard, 49152)
    write_shard(tmp_path, 10, 0, shard, 49152)
    assert [f.name for f in shard_files(tmp_path)] == ["answers-s3-00002.npz", "answers-s3-00007.npz",
                                                       "answers-s10-00000.npz"]


def test_label_sequences_equal_transformers_argmax(tiny_target):
    """Prefill labels are the target's own argmax / top-k at every position, whatever the chunking."""
    hf = LlamaForCausalLM.from_pretrained(tiny_target).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 30, 1, 17, 30)]
    model = DecoderModel.from_pretrained(tiny_target, batch_size=2, n_positions=32, backend="eager", progress=False)
    labels, top_ids, top_probs = label_sequences(model, seqs, topk=4)
    for s, lab, ids, p in zip(seqs, labels, top_ids, top_probs):
        with torch.no_grad():
            logits = hf(s.unsqueeze(0)).logits[0].float()
        assert torch.equal(lab, logits.argmax(-1))
        ref_p, ref_ids = logits.softmax(-1).topk(4, dim=-1)
        assert torch.equal(ids.long(), ref_ids) and ids.dtype == torch.int32
        torch.testing.assert_close(p.float(), ref_p, atol=1e-3, rtol=1e-2)
    # the same rows one at a time: identical labels
    alone = DecoderModel.from_pretrained(tiny_target, batch_size=1, n_positions=32, backend="eager", progress=False)
    for s, lab in zip(seqs, labels):
        assert torch.equal(label_sequences(alone, [s])[0][0], lab)


@pytest.fixture(scope="module")
def generated(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen")
    store = tmp_path_factory.mktemp("store")
    generate_data(out, DataConfig(**DATA), tiny_target, progress=False, store=store)
    return out, store


def test_generation_keeps_tokens_and_greedy_labels_are_the_answers(generated):
    out, store = generated
    (f, shard), = read_store(store)
    rows = load_dataset(out)
    assert [r["tokens"].tolist() for r in rows] == [t.tolist() for t in shard.tokens]
    assert [r["prompt_len"] for r in rows] == shard.prompt_lens and [r["sampled"] for r in rows] == shard.sampled
    assert shard.meta["settings"]["seed"] == DATA["seed"] and len(shard.meta["categories"]) == 3
    assert shard.meta["answer_tokens"] == sum(len(t) - p for t, p in zip(shard.tokens, shard.prompt_lens))
    greedy = [r for r in rows if not r["sampled"]]
    assert greedy
    for r in greedy:   # f32: the prefill's argmax is exactly what greedy decoding emitted
        p = r["prompt_len"]
        assert torch.equal(r["labels"][p - 1:-1], r["tokens"][p:])


def test_label_store_gives_the_generation_paths_rows(generated, tiny_target, tmp_path):
    out, store = generated
    labelled = label_store(store, tmp_path / "labels", tiny_target, progress=False, amp="f32", batch_rows=2)
    assert [f.name for f in labelled.glob("batch_*.pt")] == ["batch_s5-00000.pt"]
    a, b = load_dataset(out), load_dataset(labelled)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        for k in ("tokens", "labels", "topk_ids"):
            assert torch.equal(x[k], y[k]), k
        torch.testing.assert_close(x["topk_probs"].float(), y["topk_probs"].float(), atol=2e-3, rtol=0)
        assert (x["prompt_len"], x["sampled"]) == (y["prompt_len"], y["sampled"])


def test_generation_appends_shards_and_reuses_kept_ones(generated, tiny_target, tmp_path, monkeypatch):
    out, store = generated
    first = (store / "answers-s5-00000.npz").read_bytes()
    # a run for more prompts with the same store: only batch 1 is generated, batch 0 is read back
    calls = []
    real = data_mod.plan_batch
    monkeypatch.setattr(data_mod, "plan_batch", lambda m, c, i: calls.append(i) or real(m, c, i))
    out2 = generate_data(tmp_path / "d2", DataConfig(**{**DATA, "num_prompts": 6}), tiny_target, progress=False,
                         store=store)
    assert calls == [1]
    assert [f.name for f in shard_files(store)] == ["answers-s5-00000.npz", "answers-s5-00001.npz"]
    assert (store / "answers-s5-00000.npz").read_bytes() == first
    rows = load_dataset(out2)
    assert len(rows) == 6 and [r["tokens"].tolist() for r in rows[:3]] == \
        [r["tokens"].tolist() for r in load_dataset(out)]
    # other settings with the same store are refused instead of mixed in
    with pytest.raises(ValueError, match="other settings"):
        generate_data(tmp_path / "d3", DataConfig(**{**DATA, "max_new_tokens": 7}), tiny_target, progress=False,
                      store=store)


def test_cli_data_store_labels_without_generating(generated, tiny_target, tmp_path, monkeypatch):
    _, store = generated
    monkeypatch.setattr(data_mod, "plan_batch", lambda *a: pytest.fail("generated"))
    args = argparse.Namespace(data=str(store), out=str(tmp_path / "run"), model=str(tiny_target), no_progress=True,
                              device="cpu")
    labelled = prepare_data(args)
    rows = sum(len(s.tokens) for _, s in read_store(store))
    assert labelled == tmp_path / "run" / "labels" and len(load_dataset(labelled)) == rows >= 3


def test_answer_stream_refills_rows_and_each_answer_is_the_rows_own(tiny_target, monkeypatch):  # noqa: F811
    """While jobs wait, every step runs a full batch (finished rows are refilled at once), and every
    answer equals the same prompt answered alone (f32): greedy and sampled rows, prompts of different
    lengths, EOS inside answers."""
    from specdec.core.engine import Engine

    model = DecoderModel.from_pretrained(tiny_target, batch_size=2, n_positions=64, backend="eager", amp="f32",
                                         progress=False)
    g = torch.Generator().manual_seed(3)
    jobs = [(torch.randint(3, VOCAB, (n,), generator=g), t, 100 + i)
            for i, (n, t) in enumerate([(5, 0.0), (9, 0.8), (3, 0.0), (12, 1.0), (7, 0.0), (4, 0.0)])]
    taken, steps = [], []

    def feed():
        for job in jobs:
            taken.append(job)
            yield job

    real_step = Engine.step
    monkeypatch.setattr(Engine, "step",
                        lambda self: steps.append((len(self.active_rows), len(taken))) or real_step(self))
    answers = list(data_mod.answer_stream(model, feed(), max_new_tokens=12))
    assert sorted(i for i, _ in answers) == list(range(len(jobs)))
    assert steps and all(active == 2 for active, n in steps if n < len(jobs))
    eos = set(model.config.eos_token_ids)
    for i, answer in answers:
        prompt, t, seed = jobs[i]
        alone = model.generate([prompt], max_new_tokens=12, do_sample=t > 0, temperature=t or None, seed=seed)
        expected = alone[0, len(prompt):].tolist()
        cut = next((j + 1 for j, tok in enumerate(expected) if tok in eos), len(expected))
        assert answer == expected[:cut], i


def test_train_draft_tokens_only_grows_the_store_and_stops(tiny_target, tmp_path, capsys):  # noqa: F811
    """``train-draft --tokens-only``: the store gets the missing shards (refilled generation), nothing is
    labelled or trained, and the printed summary counts the store."""
    from specdec.tools.train.cli import main
    store = tmp_path / "store"
    argv = ["--out", str(tmp_path / "run"), "--model", str(tiny_target), "--store", str(store), "--tokens-only",
            "--num-prompts", "5", "--gen-batch-size", "3", "--max-new-tokens", "6", "--max-question-tokens", "4",
            "--gen-backend", "eager", "--seed", "7", "--no-progress"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["store"]
    assert [f.name for f in shard_files(store)] == ["answers-s7-00000.npz", "answers-s7-00001.npz"]
    assert summary["shards"] == 2 and summary["rows"] == 5
    assert not list((tmp_path / "run").rglob("*.pt"))          # no labels, no checkpoint
