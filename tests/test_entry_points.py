"""Every strategy of the registry through every entry point — ``specdec generate``, ``specdec bench-spec``, a
sweep (``specdec.tools.experiments``) and ``specdec serve``'s engine over HTTP — on the embedded model (the
shipped weights are trained for it; eager, f32): each gives the greedy output of target-only decoding
through the same entry point, and each speculative strategy drafted tokens on the way."""
from __future__ import annotations

import json

import pytest
import torch

from specdec.cli import main
from specdec.core.chat import chat_ids
from specdec.registry import REGISTRY

pytestmark = pytest.mark.slow

TEXT = "Repeat after me: one two three, one two three, one two three."
N_NEW = 8
RUNTIME = ["--backend", "eager", "--amp", "f32", "--n-positions", "128"]
SPECULATIVE = [name for name, s in REGISTRY.items() if s.speculative]


@pytest.fixture(scope="module")
def target(embedded_model):
    from specdec import DecoderModel
    return DecoderModel.from_pretrained(None, n_positions=128, backend="eager", amp="f32", progress=False)


@pytest.fixture(scope="module")
def ids(target) -> list[int]:
    """The chat prompt's ids: it repeats itself, so that prompt lookup and suffix decoding find matches."""
    return chat_ids(target.tokenizer, TEXT)


@pytest.fixture(autouse=True)
def restore_threads():
    """The commands set torch's thread count for the process; later tests must find the suite's own."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def command(argv, capsys) -> tuple[str, str]:
    """``specdec ARGV`` in this process → (stdout, stderr); a non-zero exit fails with its stderr."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_generate(ids, capsys):
    """``specdec generate --draft NAME`` for every name: the new ids equal ``--draft none``'s."""
    def generate(name: str) -> tuple[list[int], str]:
        out, err = command(["generate", "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", N_NEW,
                            "--ignore-eos", "--threads", 2, "--draft", name, "--stats", *RUNTIME], capsys)
        return [int(t) for t in out.strip().splitlines()[-1].split(",")], err

    reference, _ = generate("none")
    assert len(reference) == N_NEW
    for name in SPECULATIVE:
        new, err = generate(name)
        assert new == reference, name
        drafted = int(err.split("tokens drafted")[0].split()[-1])
        assert f"--draft {name} " in err and drafted > 0, (name, err)


def test_bench_spec(tmp_path, capsys):
    """``specdec bench-spec --strategy <every speculative strategy>``: each system's greedy output equals the
    benchmark's own target-only output (``greedy_equals_target``), and each drafted tokens."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "repeat", "turns": [TEXT]}) + "\n")
    out, _ = command(["bench-spec", "--prompts", prompts, "--num-prompts", 1, "--max-new-tokens", N_NEW,
                      "--strategy", ",".join(SPECULATIVE), "--ks", 2, "--trees", "chain_4",
                      "--dynamic-trees", "2x4x4", "--temperatures", 0, "--no-hf", "--threads", 2, *RUNTIME], capsys)
    runs = json.loads(out)["runs"]
    for name in SPECULATIVE:            # one system per strategy: k=2, one tree
        found = [(key, e) for key, e in runs.items() if key.startswith(f"specdec-{name}-")
                 and key.split("@")[0].removeprefix(f"specdec-{name}-") in ("k2", "chain_4", "2x4x4")]
        assert len(found) == 1, (name, list(runs))
        key, e = found[0]
        assert e["greedy_equals_target"] is True and e["stats"]["drafted"] > 0, (key, e)


def test_sweep(target, ids):
    """A sweep over every strategy of the registry at k=2 (trees: depth 2): every row's output ids equal
    the ``none`` row's."""
    from specdec.tools.experiments import grid, sweep
    df = sweep(target, grid(list(REGISTRY), [2]), [("p", "repeat", ids)], max_new_tokens=N_NEW, progress=False,
               warmup=False)
    assert list(df["strategy"]) == list(REGISTRY)
    reference = df["output_ids"][0]
    assert len(reference) == N_NEW
    for row in df.itertuples():
        assert list(row.output_ids) == list(reference), row.strategy
        assert row.strategy == "none" or row.drafted > 0, row.strategy


def test_serve(ids):
    """``specdec serve``'s engine (``load_engine`` from ``ServeOptions``, as the command builds it) for every
    strategy, behind the HTTP app: a greedy completion of the prompt's ids equals the ``none`` server's."""
    import httpx

    from specdec.options import ModelOptions, SpeculationOptions
    from specdec.serving.app import create_app
    from specdec.serving.server import ServeOptions, load_engine, running_server, serving_engine

    model = ModelOptions(backend="eager", amp="f32", n_positions=128)
    body = {"prompt": ids, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True}

    def serve(name: str) -> tuple[list[int], int]:
        speculation = SpeculationOptions(draft=name).checked(model)
        engine = serving_engine(load_engine(ServeOptions(model=model, speculation=speculation, batch_size=2)))
        with running_server(create_app(engine, "smollm2")) as base:
            r = httpx.post(f"{base}/v1/completions", json={"model": "smollm2", **body}, timeout=120)
        assert r.status_code == 200, (name, r.text)
        return r.json()["choices"][0]["token_ids"], engine.engine.stats.drafted

    reference, _ = serve("none")
    assert len(reference) == N_NEW
    for name in SPECULATIVE:
        new, drafted = serve(name)
        assert new == reference and drafted > 0, (name, new, drafted)
