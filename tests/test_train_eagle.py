"""EAGLE training (specdec.tools.train.eagle): the unrolled training forward equals the runtime's drafting,
training reduces the loss and resumes exactly, the export loads and speculates exactly; plus the
shipped SmolLM2 EAGLE head (skipped when the embedded model is absent)."""
import json

import pytest
import torch

from specdec import DecoderModel, EagleDraft, SpeculativeGenerator
from specdec.core.chat import chat_ids
from specdec.eagle.checkpoint import copy_lm_head
from specdec.tools.train.data import load_dataset
from specdec.tools.train.distill import load_target_state
from specdec.tools.train.eagle import (
    EagleTrainConfig,
    EagleTrainer,
    export_eagle,
    init_state,
    train_eagle,
    unrolled_mask,
)
from specdec.tools.train.features import compute_features

from test_train import data_dir, tiny_target  # noqa: F401  (module fixtures)

TRAIN = dict(steps=8, batch_rows=2, lr=3e-3, warmup=2, save_every=2, eval_every=4, seed=1, bf16=False,
             draft_vocab_size=48, unroll=3)


def test_unrolled_mask_is_the_drafting_cache():
    """Step s at position i sees true entries j <= i-s+1 and its own chain (hand-derived, L=4)."""
    assert unrolled_mask(4, 1, "cpu").tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
    m2 = unrolled_mask(4, 2, "cpu").int().tolist()
    assert m2 == [[0, 0, 0, 0, 1, 0, 0, 0],     # i=0: no true entry yet, only itself
                  [1, 0, 0, 0, 0, 1, 0, 0],
                  [1, 1, 0, 0, 0, 0, 1, 0],
                  [1, 1, 1, 0, 0, 0, 0, 1]]
    m3 = unrolled_mask(4, 3, "cpu").int()
    assert m3[3].tolist() == [1, 1, 0, 0] + [0, 0, 1, 0] + [0, 0, 0, 1]


def test_unrolled_training_forward_equals_runtime_drafting(tiny_target, tmp_path):
    """Training's step s at position i computes exactly what EagleDraft computes when it drafts its
    s-th token after the true pairs up to i-s+1 (f32)."""
    target_cfg = json.loads((tiny_target / "config.json").read_text())
    state = load_target_state(tiny_target)
    cfg = EagleTrainConfig(**TRAIN)
    trainable = init_state(state, target_cfg, cfg, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    trainable = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in trainable.items()}
    ids = torch.arange(48) * 3
    embed = state["model.embed_tokens.weight"]
    trainer = EagleTrainer(target_cfg, trainable, embed, embed[ids])
    ckpt = {"step": 0, "model": trainer.state(), "output_token_ids": ids, "target_config": target_cfg}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    ship = export_eagle(tmp_path / "ckpt.pt", tmp_path / "ship", dtype=torch.float32)
    draft_dir = copy_lm_head(ship, tiny_target, tmp_path / "draft")
    target = DecoderModel.from_pretrained(tiny_target, batch_size=1, n_positions=64, backend="eager", progress=False)
    draft = EagleDraft.from_pretrained(draft_dir, target, progress=False).model

    L = 12
    tokens = torch.randint(5, 150, (1, L + 1), generator=g)
    params = target.sampling_params(do_sample=False)
    out = target.prefill([tokens[0]], params)
    features = out.hidden[:, :L + 1]                        # true f_0 .. f_L
    with torch.no_grad():
        outs = trainer(tokens[:, 1:L + 1], features[:, :L], unroll=3)
    for i in (4, 9):
        # runtime: true pairs 0 .. i-1 ingested, then drafting from position i-1
        draft.reset()
        draft.prefill([tokens[0, 1:i + 1]], params, features=features[:, :i])
        draft.set_lengths(torch.tensor([i - 1]))
        f_hat = draft.step(tokens[:, i:i + 1], params, features=features[:, i - 1:i]).hidden   # step 1 at i-1
        torch.testing.assert_close(f_hat[0, 0], outs[0][0, i - 1], atol=1e-4, rtol=1e-4)
        for s in (2, 3):   # step s at position i-2+s reads the previous draft feature
            pos = i - 2 + s
            f_hat = draft.step(tokens[:, pos + 1:pos + 2], params, features=f_hat).hidden
            torch.testing.assert_close(f_hat[0, 0], outs[s - 1][0, pos], atol=1e-4, rtol=1e-4)


def log_of(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_features_are_the_runtime_targets(data_dir, tiny_target, tmp_path):  # noqa: F811
    rows = load_dataset(data_dir)
    feats = compute_features(rows, tiny_target, tmp_path / "features.pt", amp="f32", progress=False)
    target = DecoderModel.from_pretrained(tiny_target, batch_size=1, n_positions=256, backend="eager", progress=False)
    out = target.prefill([rows[1]["tokens"]], target.sampling_params(do_sample=False))
    torch.testing.assert_close(feats[1], out.hidden[0, : len(rows[1]["tokens"])], atol=1e-4, rtol=1e-4)
    assert compute_features(rows, tiny_target, tmp_path / "features.pt")[1].equal(feats[1])   # cached


def test_training_reduces_loss_resumes_exactly_and_exports(data_dir, tiny_target, tmp_path):  # noqa: F811
    full, split = tmp_path / "full", tmp_path / "split"
    quiet = dict(progress=False, log=lambda m: None)
    train_eagle(data_dir, full, tiny_target, EagleTrainConfig(**TRAIN), **quiet)
    log = log_of(full)
    assert log[-1]["step"] == TRAIN["steps"]
    assert log[-1]["train_probe_loss"] < log[0]["train_probe_loss"]
    train_eagle(data_dir, split, tiny_target, EagleTrainConfig(**TRAIN), stop_after=3, **quiet)
    assert torch.load(split / "ckpt.pt", weights_only=False)["step"] == 3
    train_eagle(data_dir, split, tiny_target, EagleTrainConfig(**TRAIN), **quiet)
    a, b = (torch.load(d / "ckpt.pt", weights_only=False) for d in (full, split))
    assert a["step"] == b["step"] == TRAIN["steps"]
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="other settings"):
        train_eagle(data_dir, split, tiny_target, EagleTrainConfig(**{**TRAIN, "unroll": 2}), **quiet)

    ship = export_eagle(full / "ckpt.pt", tmp_path / "ship")
    assert sorted(f.name for f in ship.iterdir()) == ["config.json", "model.safetensors"]
    target = DecoderModel.from_pretrained(tiny_target, batch_size=2, n_positions=128, backend="eager", progress=False)
    with pytest.raises(KeyError, match="eagle-lm-head"):
        EagleDraft.from_pretrained(ship, target, progress=False)
    draft = EagleDraft.from_pretrained(copy_lm_head(ship, tiny_target, tmp_path / "draft"), target, progress=False)
    assert draft.model.lm.input_norm and draft.model.config.output_vocab_size == TRAIN["draft_vocab_size"]
    prompts = [[1, 5, 9, 12, 40, 41], [1, 77, 3]]
    reference = target.generate(prompts, max_new_tokens=40, eos_token_id=[])
    for k in (1, 3, 5):
        assert torch.equal(SpeculativeGenerator(draft, target, k).sample(prompts, max_new_tokens=40, eos_token_id=[]),
                           reference)


def test_init_starts_a_new_run_from_an_earlier_checkpoint(data_dir, tiny_target, tmp_path):  # noqa: F811
    """``init``: the new run's step 0 scores the earlier run's final weights (same vocabulary), then trains
    on with its own schedule; a checkpoint of another shape is refused."""
    quiet = dict(progress=False, log=lambda m: None)
    first, second = tmp_path / "first", tmp_path / "second"
    train_eagle(data_dir, first, tiny_target, EagleTrainConfig(**TRAIN), **quiet)
    cfg = EagleTrainConfig(**{**TRAIN, "steps": 4, "lr": 1e-3})
    train_eagle(data_dir, second, tiny_target, cfg, init=first / "ckpt.pt", **quiet)
    before, after = log_of(first)[-1], log_of(second)
    assert after[0]["init"] == str(first / "ckpt.pt")
    for name in ("loss", "agree_step1", "train_probe_loss"):
        assert after[0][name] == pytest.approx(before[name], rel=1e-5), name
    a, b = (torch.load(d / "ckpt.pt", weights_only=False) for d in (first, second))
    assert b["step"] == 4 and torch.equal(a["output_token_ids"], b["output_token_ids"])
    assert any(not torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    with pytest.raises(ValueError, match="--init.*draft_vocab"):
        train_eagle(data_dir, tmp_path / "third", tiny_target, EagleTrainConfig(**{**TRAIN, "draft_vocab_size": 40}),
                    init=first / "ckpt.pt", **quiet)


@pytest.mark.parametrize("arch,int8", [("eagle1", False), ("eagle3", False), ("eagle3", True)])
def test_init_from_a_shipped_draft(data_dir, tiny_target, tmp_path, arch, int8):  # noqa: F811
    """``init`` also takes a shipped directory (``export_eagle``'s, bf16 or int8-packed, e.g. the packaged
    head when the run that made it is gone): the new run's step 0 scores the shipped weights, within their
    rounding of the checkpoint's; a ship of another architecture is refused."""
    quiet = dict(progress=False, log=lambda m: None)

    def config(arch: str, **more) -> EagleTrainConfig:
        return EagleTrainConfig(**{**TRAIN, "arch": arch, "aux_layers": (0, 1, 2) if arch == "eagle3" else (), **more})

    cfg = config(arch)
    first = tmp_path / "first"
    train_eagle(data_dir, first, tiny_target, cfg, **quiet)
    ship = export_eagle(first / "ckpt.pt", tmp_path / "ship", int8=int8)
    second = tmp_path / "second"
    train_eagle(data_dir, second, tiny_target, config(arch, steps=2), init=ship, **quiet)
    before, after = log_of(first)[-1], log_of(second)[0]
    assert after["init"] == str(ship)
    assert after["loss"] == pytest.approx(before["loss"], rel=0.02)
    a, b = (torch.load(d / "ckpt.pt", weights_only=False) for d in (first, second))
    assert sorted(a["output_token_ids"].tolist()) == b["output_token_ids"].tolist() if arch == "eagle3" else \
        torch.equal(a["output_token_ids"], b["output_token_ids"])
    assert set(a["model"]) == set(b["model"])
    other = "eagle1" if arch == "eagle3" else "eagle3"
    with pytest.raises(ValueError, match="--init.*arch"):
        train_eagle(data_dir, tmp_path / "third", tiny_target, config(other), init=ship, **quiet)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_shipped_smollm2_eagle_is_exact(kind):
    """The shipped EAGLE-1 and EAGLE-3 heads: small, exact, and they get runs accepted."""
    pytest.importorskip("gguf")
    from specdec import shipped
    from specdec.core.paths import embedded_gguf_path
    from specdec.eagle.smollm2 import shipped_eagle3_dir, shipped_eagle_dir
    try:
        embedded_gguf_path()
    except FileNotFoundError:
        pytest.skip("embedded model not installed")
    ship = shipped_eagle3_dir() if kind == "eagle3" else shipped_eagle_dir()
    size = sum(f.stat().st_size for f in ship.iterdir())
    assert size <= 15 * 2**20, size
    # f32: bf16 near-ties flip between the decode and verify graphs (rounding, not speculation)
    target = DecoderModel.from_pretrained(None, batch_size=3, n_positions=256, amp="f32", backend="eager",
                                          progress=False)
    draft = shipped(kind, target, progress=False)
    assert (target.lm.feature_layers != ()) == (kind == "eagle3")   # EAGLE-3 reads three target layers
    tok = target.tokenizer
    questions = ["Give me three tips for learning to cook.", "What is 17 times 23?",
                 "Write a haiku about the sea."]
    prompts = [chat_ids(tok, q) for q in questions]
    reference = target.generate(prompts, max_new_tokens=48)
    for k in (1, 3, 5):
        gen = SpeculativeGenerator(draft, target, k)
        assert torch.equal(gen.sample(prompts, max_new_tokens=48), reference)
    assert gen.last_stats.mean_acceptance_length > 1.5   # the trained head does get runs accepted


def test_a_run_from_init_reads_a_token_store_without_labels(data_dir, tiny_target, tmp_path):  # noqa: F811
    """With ``init``, the rows come straight from the token store (``store_rows``: load_dataset's rows and
    order, no labels): the same step-0 scores as from the labelled batches; a new run on an unlabelled
    store is refused (it chooses its vocabulary from labels)."""
    from specdec.tools.train.data import store_rows
    quiet = dict(progress=False, log=lambda m: None)
    store = data_dir / "tokens"
    labelled, unlabelled = load_dataset(data_dir), store_rows(store)
    assert [(r["tokens"].tolist(), r["prompt_len"], r["sampled"]) for r in labelled] == \
        [(r["tokens"].tolist(), r["prompt_len"], r["sampled"]) for r in unlabelled]
    assert "labels" not in unlabelled[0]
    first = tmp_path / "first"
    train_eagle(data_dir, first, tiny_target, EagleTrainConfig(**TRAIN), **quiet)
    cfg = EagleTrainConfig(**{**TRAIN, "steps": 2})
    for data, out in ((data_dir, tmp_path / "a"), (store, tmp_path / "b")):
        train_eagle(data, out, tiny_target, cfg, init=first / "ckpt.pt", **quiet)
    a, b = log_of(tmp_path / "a")[0], log_of(tmp_path / "b")[0]
    assert a["loss"] == b["loss"] and a["agree_step1"] == b["agree_step1"]
    with pytest.raises(ValueError, match="without labels"):
        train_eagle(store, tmp_path / "c", tiny_target, cfg, **quiet)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run on the lent GPU machine)"))])
def test_generation_features_and_training_run_on_a_device(data_dir, tiny_target, tmp_path, device):  # noqa: F811
    """``device``: the target generates the tokens and computes the features there and the draft trains
    there; the features are the CPU's (f32), the loss falls, and the checkpoint holds CPU tensors (a run
    resumes and exports anywhere)."""
    from specdec.tools.train.data import DataConfig, generate_data

    from test_train import DATA
    store = tmp_path / "tokens"
    generate_data(tmp_path / "gen", DataConfig(**{**DATA, "num_prompts": 3, "amp": "f32"}), tiny_target,
                  progress=False, store=store, label=False, device=device)
    assert len(list(store.glob("answers-*.npz"))) == 1
    rows = load_dataset(data_dir)
    on_device = compute_features(rows, tiny_target, tmp_path / "f_dev.pt", amp="f32", progress=False, device=device)
    on_cpu = compute_features(rows, tiny_target, tmp_path / "f_cpu.pt", amp="f32", progress=False)
    assert all(f.device.type == "cpu" for f in on_device)
    for a, b in zip(on_device, on_cpu):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    cfg = EagleTrainConfig(**{**TRAIN, "arch": "eagle3", "aux_layers": (0, 1, 2)})
    train_eagle(data_dir, tmp_path / "run", tiny_target, cfg, progress=False, log=lambda m: None, device=device)
    log = log_of(tmp_path / "run")
    assert log[-1]["train_probe_loss"] < log[0]["train_probe_loss"]
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    assert all(v.device.type == "cpu" for v in ckpt["model"].values())
    assert (export_eagle(tmp_path / "run" / "ckpt.pt", tmp_path / "ship") / "model.safetensors").is_file()
