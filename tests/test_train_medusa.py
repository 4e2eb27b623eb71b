"""Medusa-1 head training (specdec.tools.train.medusa): batches, training on a learnable toy data set, exact
resumption, export/load round trip, calibration, tree construction (``specdec build-tree``) and clear
errors; plus the shipped SmolLM2 heads (skipped when absent)."""
import contextlib
import io
import json

import pytest
import torch

from specdec.cli import main as specdec_main
from specdec.core.checkpoint import target_lm_head
from specdec.medusa.heads import WEIGHTS_NAME, load_heads, load_medusa_config
from specdec.medusa.tree import build_tree, expected_accept_length, load_tree
from specdec.tools.train.distill import split_rows
from specdec.tools.train.features import training_rows
from specdec.tools.train.medusa import (
    ACCURACY_FILE,
    MedusaTrainConfig,
    build_heads,
    calibrate,
    evaluate,
    export_medusa,
    link_features,
    load_checkpoint,
    load_data,
    make_batch,
    train_medusa,
    vocab_index,
)

from test_train import tiny_target  # noqa: F401  (module fixture)

TRAIN = dict(steps=30, batch_rows=4, lr=1e-2, warmup=2, save_every=5, eval_every=10, seed=1, num_heads=3,
             medusa_vocab_size=48, heldout_fraction=0.25)
QUIET = dict(progress=False, log=lambda m: None)
CYCLE = 40   # toy rows count through 40 token ids: token i+1 = token i + 1 (mod the cycle)


def write_toy_data(directory, n_rows: int = 48, seed: int = 0):
    """One batch file (``load_dataset`` format) of deterministic counting rows with short prompts."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tokens, labels, prompt_lens = [], [], []
    for i in range(n_rows):
        n = 28 + i % 5
        t = 5 + (int(torch.randint(0, CYCLE, (1,), generator=g)) + torch.arange(n)) % CYCLE
        tokens.append(t)
        labels.append(torch.cat([t[1:], t[-1:]]))
        prompt_lens.append(5 + i % 3)
    torch.save({"tokens": tokens, "labels": labels, "prompt_lens": torch.tensor(prompt_lens),
                "sampled": torch.zeros(n_rows, dtype=torch.bool)}, directory / "batch_00000.pt")
    return directory


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return write_toy_data(tmp_path_factory.mktemp("medusa_data"))


@pytest.fixture(scope="module")
def trained(toy_data, tiny_target, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("medusa_run")
    train_medusa(toy_data, out, tiny_target, MedusaTrainConfig(**TRAIN), **QUIET)
    return out


def log_of(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_batch_positions_and_targets():
    """Hand-derived: 10 tokens, prompt 4, 2 heads → positions 1..7; head h at t predicts token t+h+2 when
    that is an answer token (index >= 4)."""
    rows = [{"tokens": torch.arange(10, 20), "prompt_len": 4}]
    feats = [torch.arange(10, dtype=torch.float32).unsqueeze(1).expand(10, 3).bfloat16()]
    hidden, targets = make_batch(rows, feats, [0], num_heads=2, max_len=512)
    assert hidden.dtype == torch.float32 and hidden[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert targets.tolist() == [[-1, 14], [14, 15], [15, 16], [16, 17], [17, 18], [18, 19], [19, -1]]
    _, cut = make_batch(rows, feats, [0], num_heads=2, max_len=8)   # only the first 8 tokens
    assert cut.tolist() == [[-1, 14], [14, 15], [15, 16], [16, 17], [17, -1]]


def test_evaluate_matches_a_direct_count(toy_data, tiny_target, tmp_path):  # noqa: F811
    """Top-1 / top-5 of ``evaluate`` against a per-position loop over the heads' logits (random ResBlocks)."""
    cfg = MedusaTrainConfig(**TRAIN)
    data = load_data(toy_data, tmp_path, tiny_target, cfg, progress=False)
    lm_head = target_lm_head(tiny_target).float()
    token_ids = torch.arange(0, 96, 2)    # even ids: odd targets fall outside and must count as misses
    g = torch.Generator().manual_seed(0)
    heads = build_heads(lm_head, token_ids, cfg)
    state = {k: 0.3 * torch.randn(v.shape, generator=g) for k, v in heads.heads.state_dict().items()
             if not k.endswith(".1.weight")}
    heads = build_heads(lm_head, token_ids, cfg, state)
    metrics, matrix = evaluate(heads, data.rows, data.feats, data.held_idx, vocab_index(token_ids, len(lm_head)), cfg)
    hits1, hits5, total = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    for i in data.held_idx:
        tok, p, f = data.rows[i]["tokens"], data.rows[i]["prompt_len"], data.feats[i].float()
        with torch.no_grad():
            logits = heads(f)                                       # [len, heads, 48]
        for t in range(len(tok)):
            for h in range(3):
                if p <= t + h + 2 < len(tok):
                    top = token_ids[logits[t, h].topk(5).indices]
                    total[h] += 1
                    hits1[h] += float(top[0] == tok[t + h + 2])
                    hits5[h] += float(tok[t + h + 2] in top)
    torch.testing.assert_close(torch.tensor(metrics["top1"]), hits1 / total)
    torch.testing.assert_close(torch.tensor(metrics["top5"]), hits5 / total)
    assert torch.equal(matrix[:, 0], torch.tensor(metrics["top1"]))
    assert 0 < metrics["in_vocab"] < 1


def test_training_lowers_heldout_loss_and_raises_accuracy(trained, toy_data, tiny_target):  # noqa: F811
    log = log_of(trained)
    assert [e["step"] for e in log] == [0, 10, 20, 30]
    first, last = log[0], log[-1]
    assert last["loss"] < 0.7 * first["loss"]
    assert last["top1"][0] > first["top1"][0] + 0.3, (first["top1"], last["top1"])
    assert last["top5"][0] >= last["top1"][0]
    assert len(last["head_accuracy"]) == TRAIN["num_heads"] and len(last["head_accuracy"][0]) == 10
    ckpt, cfg = load_checkpoint(trained / "ckpt.pt")
    assert ckpt["step"] == TRAIN["steps"] and cfg == MedusaTrainConfig(**TRAIN)
    assert set(ckpt["model"]) == {f"{h}.0.linear.{w}" for h in range(3) for w in ("weight", "bias")}
    matrix = calibrate(toy_data, trained, tiny_target, progress=False)
    saved = json.loads((trained / ACCURACY_FILE).read_text())
    assert torch.tensor(saved["head_accuracy"]).equal(matrix.float())
    torch.testing.assert_close(matrix, torch.tensor(last["head_accuracy"]))   # the final held-out measurement
    held = split_rows(training_rows(toy_data), TRAIN["heldout_fraction"], TRAIN["seed"])[1]
    assert saved["step"] == TRAIN["steps"] and saved["heldout_rows"] == log[0]["heldout_rows"] == len(held) > 0


def test_resume_ends_where_an_uninterrupted_run_does(toy_data, tiny_target, tmp_path):  # noqa: F811
    cfg = MedusaTrainConfig(**{**TRAIN, "steps": 8, "eval_every": 4, "save_every": 2})
    full, split = tmp_path / "full", tmp_path / "split"
    train_medusa(toy_data, full, tiny_target, cfg, **QUIET)
    train_medusa(toy_data, split, tiny_target, cfg, stop_after=3, **QUIET)
    assert torch.load(split / "ckpt.pt", weights_only=False)["step"] == 3
    train_medusa(toy_data, split, tiny_target, cfg, **QUIET)
    a, b = (torch.load(d / "ckpt.pt", weights_only=False) for d in (full, split))
    assert a["step"] == b["step"] == 8 and a["token_ids"].equal(b["token_ids"])
    assert any(v.abs().sum() > 0 for v in a["model"].values())   # it did train
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-6, atol=1e-7)
    assert [e["step"] for e in log_of(split)] == [0, 4, 8]
    assert log_of(split)[-1]["loss"] == pytest.approx(log_of(full)[-1]["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="other settings"):
        train_medusa(toy_data, split, tiny_target, MedusaTrainConfig(**{**TRAIN, "num_heads": 2}), **QUIET)


def test_export_round_trip_and_size(trained, toy_data, tiny_target, tmp_path):  # noqa: F811
    ckpt, cfg = load_checkpoint(trained / "ckpt.pt")
    if not (trained / ACCURACY_FILE).is_file():
        calibrate(toy_data, trained, tiny_target, progress=False)
    lm_head = target_lm_head(tiny_target).float()
    heads = build_heads(lm_head, ckpt["token_ids"], cfg, ckpt["model"])
    hidden = torch.randn(2, 7, lm_head.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = heads(hidden)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
            ship = export_medusa(trained / "ckpt.pt", tmp_path / str(dtype), num_nodes=7, base_model="tiny-llama",
                                 dtype=dtype)
            loaded = load_heads(ship, lm_head_weight=target_lm_head(tiny_target))
            assert loaded.token_ids.equal(ckpt["token_ids"]) and loaded.heads[0][0].linear.weight.dtype == dtype
            torch.testing.assert_close(loaded(hidden), reference, atol=tol, rtol=tol)
            if dtype == torch.float32:
                assert loaded.candidates(hidden[:, 0], 3).equal(heads.candidates(hidden[:, 0], 3))
    config = load_medusa_config(ship)
    accuracy = torch.tensor(json.loads((ship / ACCURACY_FILE).read_text())["head_accuracy"])
    assert config.tied_lm_head and config.vocab_size == TRAIN["medusa_vocab_size"]
    assert config.base_model_name_or_path == "tiny-llama" and config.num_heads == 3
    assert config.tree.paths == build_tree(accuracy, 7).paths and config.speculation_length == 8
    # size: the ResBlocks in bf16 + int64 token ids + the safetensors header, no projection
    hidden_size, vocab = lm_head.shape[1], TRAIN["medusa_vocab_size"]
    tensors = 3 * (hidden_size * hidden_size + hidden_size) * 2 + vocab * 8
    size = (ship / WEIGHTS_NAME).stat().st_size
    assert tensors < size < tensors + 2048, (size, tensors)
    assert sorted(f.name for f in ship.iterdir()) == sorted(["config.json", WEIGHTS_NAME, ACCURACY_FILE])


def run_cli(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = specdec_main(argv)
    return rc, out.getvalue()


def test_build_tree_command(tmp_path):
    """Hand-derived greedy trees for accuracies [[0.6, 0.3], [0.5, 0.2]]: [0] (0.6), [1] (0.3), [0, 0]
    (0.6*0.5, tied with [1]: lower depth first), then [1, 0] (0.15) beats [0, 1] (0.12)."""
    (tmp_path / "heads").mkdir()
    accuracy = tmp_path / "heads" / ACCURACY_FILE
    accuracy.write_text(json.dumps({"head_accuracy": [[0.6, 0.3], [0.5, 0.2]]}))
    for n, paths, length in ((3, [[0], [1], [0, 0]], 1.2), (4, [[0], [1], [0, 0], [1, 0]], 1.35)):
        rc, out = run_cli(["build-tree", "--accuracy", str(accuracy), "--num-nodes", str(n),
                           "--out", str(tmp_path / f"tree{n}.json")])
        assert rc == 0
        summary = json.loads(out)
        tree = load_tree(tmp_path / f"tree{n}.json")
        assert tree.to_list() == paths
        assert summary["expected_accept_length"] == pytest.approx(length)
        assert summary["expected_accept_length"] == pytest.approx(
            expected_accept_length(tree, torch.tensor([[0.6, 0.3], [0.5, 0.2]])))
        assert summary["expected_tau"] == pytest.approx(1 + length) and summary["num_nodes"] == n
    rc, out = run_cli(["build-tree", "--heads", str(tmp_path / "heads"), "--num-nodes", "2",   # DIR/head_accuracy.json
                       "--out", str(tmp_path / "t2.json")])
    assert rc == 0 and load_tree(tmp_path / "t2.json").to_list() == [[0], [1]]
    (tmp_path / "plain.json").write_text(json.dumps([[0.6, 0.3], [0.5, 0.2]]))   # a bare matrix
    rc, _ = run_cli(["build-tree", "--accuracy", str(tmp_path / "plain.json"), "--num-nodes", "2",
                     "--out", str(tmp_path / "t3.json")])
    assert rc == 0 and load_tree(tmp_path / "t3.json").to_list() == [[0], [1]]
    assert run_cli(["build-tree", "--heads", str(tmp_path), "--num-nodes", "2",   # no head_accuracy.json there
                    "--out", str(tmp_path / "x.json")])[0] == 2
    assert run_cli(["build-tree", "--accuracy", str(accuracy), "--num-nodes", "7", "--out",
                    str(tmp_path / "x.json")])[0] == 2   # more nodes than 2 heads x top-2 allow
    assert not (tmp_path / "x.json").exists()


def test_clear_errors(toy_data, tiny_target, tmp_path):  # noqa: F811
    other = write_toy_data(tmp_path / "other", n_rows=12, seed=5)
    load_data(other, tmp_path / "cache", tiny_target, MedusaTrainConfig(**TRAIN), progress=False)   # 12 rows' features
    with pytest.raises(ValueError, match="features of other rows"):
        train_medusa(toy_data, tmp_path / "cache", tiny_target, MedusaTrainConfig(**TRAIN), **QUIET)
    link = link_features(tmp_path / "cache" / "features.pt", tmp_path / "linked")
    assert link.is_symlink()
    with pytest.raises(ValueError, match="features of other rows"):
        load_data(toy_data, tmp_path / "linked", tiny_target, MedusaTrainConfig(**TRAIN), progress=False)
    with pytest.raises(FileNotFoundError, match="no features cache"):
        link_features(tmp_path / "missing.pt", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="train-medusa"):
        export_medusa(tmp_path / "nowhere" / "ckpt.pt", tmp_path / "ship")


def test_train_medusa_command(toy_data, tiny_target, tmp_path):  # noqa: F811
    """The CLI end to end on existing data: training, calibration, export, the printed summary."""
    out, ship = tmp_path / "run", tmp_path / "ship"
    rc, printed = run_cli(["train-medusa", "--model", str(tiny_target), "--out", str(out), "--data", str(toy_data),
                           "--num-prompts", "48", "--gen-batch-size", "48", "--steps", "6", "--batch-rows", "4",
                           "--heads", "2", "--medusa-vocab", "48", "--eval-every", "3", "--tree-nodes", "5",
                           "--ship", str(ship), "--no-progress"])
    assert rc == 0
    summary = json.loads(printed)
    assert summary["ship_bytes"] == sum(f.stat().st_size for f in ship.iterdir())
    assert summary["heldout_step0"]["step"] == 0 and summary["heldout_final"]["step"] == 6
    assert len(summary["head_accuracy"]) == 2 and set(summary["trees"]) == {"15", "31", "63"}
    config = load_medusa_config(ship)
    assert config.tree.num_nodes == 5 and config.base_model_name_or_path == str(tiny_target)
    assert summary["shipped_tree"]["expected_accept_length"] == pytest.approx(
        expected_accept_length(config.tree, torch.tensor(summary["head_accuracy"])))


@pytest.mark.slow
def test_shipped_smollm2_heads():
    from specdec.medusa.smollm2 import shipped_medusa_dir
    if not (shipped_medusa_dir() / WEIGHTS_NAME).is_file():
        pytest.skip("no shipped Medusa heads")
    size = sum(f.stat().st_size for f in shipped_medusa_dir().iterdir())
    assert size <= 15 * 2**20, size
    config = load_medusa_config(shipped_medusa_dir())
    accuracy = torch.tensor(json.loads((shipped_medusa_dir() / ACCURACY_FILE).read_text())["head_accuracy"])
    assert config.tied_lm_head and config.tree.paths == build_tree(accuracy, config.tree.num_nodes).paths
    assert accuracy[0, 0] > 0.2   # head 0 (token t+2) does predict
