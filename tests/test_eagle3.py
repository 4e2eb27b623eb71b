"""EAGLE-3 drafts: the public checkpoint layout (midlayer, fc over three target layers, d2t / t2d),
logits against an independent plain-torch reference over transformers' hidden states, greedy
exactness (chains and dynamic trees), losslessness (chi-square), true features after verification,
fused speculation, errors; the EAGLE-3 trainer (unrolled forward = runtime drafting, export round trip)."""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from specdec import DecoderModel, EagleDraft, SpeculativeGenerator
from specdec.eagle import EagleModel
from specdec.eagle.tree import DynamicTree, EagleTreeDraft

from test_eagle import PROMPTS, H, I, assert_true_pairs, load_target, record_true_pairs
from test_eagle import tiny_target as tiny_hf
from test_speculative import lossless_pvalue

LAYERS = 8                      # default aux layers (2, L//2, L-3) = (2, 4, 5)
DEFAULT_AUX = (2, 4, 5)


def random_eagle3(seed: int, vocab: int, draft_ids: torch.Tensor, aux: int = 3, scale: float = 0.2) -> dict:
    """Tensors of an EAGLE-3 checkpoint in the public layout (``midlayer.*``, ``d2t``, ``t2d``; no embedding)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (H, aux * H), "midlayer.self_attn.q_proj.weight": (H, 2 * H),
              "midlayer.self_attn.k_proj.weight": (H // 2, 2 * H), "midlayer.self_attn.v_proj.weight": (H // 2, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, H), "midlayer.mlp.gate_proj.weight": (I, H),
              "midlayer.mlp.up_proj.weight": (I, H), "midlayer.mlp.down_proj.weight": (H, I),
              "lm_head.weight": (len(draft_ids), H)}
    t = {k: torch.randn(*s, generator=g) * scale for k, s in shapes.items()}
    t["fc.weight"] /= aux ** 0.5
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        t[f"{name}.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    t["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    t["t2d"] = t2d
    return t


def write_eagle3(directory: Path, target: LlamaForCausalLM, tensors: dict, aux_ids=None) -> Path:
    """config.json as the public EAGLE-3 repos ship it (+ ``eagle_config`` when ``aux_ids`` is given)."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(target.config.to_dict(), num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"],
               draft_vocab_size=len(tensors["d2t"]), target_hidden_size=H, tie_word_embeddings=False)
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    return directory


DRAFT_IDS = torch.tensor(sorted(set(range(0, 64, 2)) | {1, 3, 7, 9, 15, 33, 41, 63}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    hf = tiny_hf(0, layers=LAYERS)
    hf.save_pretrained(root / "target")
    tensors = random_eagle3(1, 64, DRAFT_IDS)
    return dict(root=root, hf=hf, target_dir=root / "target", tensors=tensors,
                eagle=write_eagle3(root / "eagle3", hf, tensors))


# ---------------------------------------------------------------- reference math
def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama RoPE of x [n, heads, D] at positions 0 .. n-1 (rotate-half convention)."""
    n, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(n).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_first_step(hf: LlamaForCausalLM, t: dict, aux_ids,
                         sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-3 draft's first step at every position of ``sequence`` (true features), written from the
    checkpoint tensors ``t`` with plain torch: (pre-norm outputs [n-1, H], target-vocabulary logits [n-1, V])."""
    eps, heads, kv = hf.config.rms_norm_eps, hf.config.num_attention_heads, hf.config.num_key_value_heads
    d = H // heads
    theta = hf.config.rope_parameters["rope_theta"]
    with torch.no_grad():
        states = hf(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0, :-1] for i in aux_ids], -1)           # positions 0 .. n-2
    h = aux @ t["fc.weight"].T
    e = hf.model.embed_tokens.weight.detach()[torch.tensor(sequence[1:])]   # token i+1 at position i
    n = len(sequence) - 1

    def norm(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    a_in = torch.cat([norm(e, t["midlayer.input_layernorm.weight"]), norm(h, t["midlayer.hidden_norm.weight"])], -1)
    q = rope((a_in @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), theta)
    k = rope((a_in @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d), theta)
    v = (a_in @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, H)
    x = h + att @ t["midlayer.self_attn.o_proj.weight"].T
    m = norm(x, t["midlayer.post_attention_layernorm.weight"])
    x = x + (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)) \
        @ t["midlayer.mlp.down_proj.weight"].T
    draft_logits = norm(x, t["norm.weight"]) @ t["lm_head.weight"].T
    logits = torch.full((n, hf.config.vocab_size), float("-inf"))
    logits[:, torch.arange(len(t["d2t"])) + t["d2t"]] = draft_logits
    return x, logits


def test_first_step_equals_plain_torch_reference(tiny):
    target = load_target(tiny["target_dir"])
    draft = EagleDraft.from_pretrained(tiny["eagle"], target, progress=False)
    assert target.lm.feature_layers == DEFAULT_AUX == draft.model.lm.aux_layers
    assert torch.equal(draft.model.lm.output_token_ids, DRAFT_IDS)
    params = target.sampling_params(do_sample=False)
    seqs = [PROMPTS[0] + [20, 21, 22], PROMPTS[2]]
    out = target.prefill([torch.tensor(s) for s in seqs], params)
    features = draft.model.true_features(out)
    for b, s in enumerate(seqs):
        with torch.no_grad():
            hidden = tiny["hf"](torch.tensor([s]), output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[i][0] for i in DEFAULT_AUX], -1)       # HF: hidden_states[i] enters layer i
        torch.testing.assert_close(out.aux_hidden[b, :len(s)], aux, atol=1e-4, rtol=1e-4)
        x_ref, logits_ref = reference_first_step(tiny["hf"], tiny["tensors"], DEFAULT_AUX, s)
        n = len(s) - 1
        draft.model.reset()
        step = draft.model.prefill([torch.tensor(s[1:])], params, features=features[b:b + 1, :n], rows=[0])
        torch.testing.assert_close(step.hidden[0, :n], x_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(step.logits[0, 0], logits_ref[-1], atol=1e-4, rtol=1e-4)
        assert step.logits[0, 0].isinf().sum() == 64 - len(DRAFT_IDS)


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_chain_equals_target_only(tiny, k):
    target = load_target(tiny["target_dir"])
    draft = EagleDraft.from_pretrained(tiny["eagle"], target, progress=False)
    reference = target.generate(PROMPTS, max_new_tokens=60, eos_token_id=[])
    gen = SpeculativeGenerator(draft, target, k)
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    one = gen.sample([PROMPTS[2]], max_new_tokens=60, eos_token_id=[])
    width = max(map(len, PROMPTS))
    assert torch.equal(one[0, len(PROMPTS[2]):], reference[2, width:])


def test_greedy_tree_equals_target_only(tiny):
    target = load_target(tiny["target_dir"])
    draft = EagleTreeDraft.from_pretrained(tiny["eagle"], target, tree=DynamicTree(3, 4, 8), progress=False)
    reference = target.generate(PROMPTS, max_new_tokens=60, eos_token_id=[])
    gen = SpeculativeGenerator(draft, target)
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    one = gen.sample([PROMPTS[1]], max_new_tokens=60, eos_token_id=[])
    width = max(map(len, PROMPTS))
    assert torch.equal(one[0, len(PROMPTS[1]):], reference[1, width:])


def test_top_k_steps_score_like_the_full_softmax_over_the_reduced_vocabulary(tiny):
    """A top-K step (the tree's scoring graphs) returns the K best tokens and log-probabilities of the
    full-vocabulary log-softmax of the same step (logits -inf outside the draft's ids); sampled
    parameters or probabilities are refused."""
    target = load_target(tiny["target_dir"])
    draft = EagleTreeDraft.from_pretrained(tiny["eagle"], target, tree=DynamicTree(3, 4, 8), progress=False)
    model, greedy = draft.model, draft.greedy
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (model.batch_size, 5), generator=g)
    features = torch.randn(model.batch_size, 5, model.lm.feature_size, generator=g)
    full = model.step(tokens, greedy, advance=False, features=features)
    top = model.step(tokens, greedy, advance=False, features=features, top_k=4)
    reference_scores, reference_tokens = torch.log_softmax(full.logits, -1).topk(4, dim=-1)
    assert top.tokens.shape == top.logits.shape == (model.batch_size, 5, 4)
    torch.testing.assert_close(top.logits, reference_scores)
    assert torch.equal(top.tokens, reference_tokens)
    assert bool(torch.isin(top.tokens, model.lm.output_token_ids).all())
    with pytest.raises(ValueError, match="top_k scoring steps are greedy"):
        model.step(tokens, model.sampling_params(do_sample=True, temperature=0.7), advance=False,
                   features=features, top_k=4)


def test_draft_quantization_is_the_drafts_own_and_keeps_greedy_exact(tiny):
    """quantization= quantizes the draft only (int8 decoder layer and LM head), the target stays float,
    and greedy tree speculation still reproduces target-only output; None or "none" keep a draft float under
    an int8 target; an unknown scheme is refused by name."""
    from specdec.core.quant import Int8Linear
    target = load_target(tiny["target_dir"])
    draft = EagleTreeDraft.from_pretrained(tiny["eagle"], target, tree=DynamicTree(3, 4, 8), quantization="int8",
                                           progress=False)
    layer = draft.model.lm.layers[0]
    assert isinstance(draft.model.lm.lm_head, Int8Linear) and isinstance(layer.mlp.down_proj, Int8Linear)
    assert draft.model.settings.quantization == "int8" and target.settings.quantization is None
    assert not any(isinstance(m, Int8Linear) for m in target.lm.modules())
    reference = target.generate(PROMPTS, max_new_tokens=60, eos_token_id=[])
    gen = SpeculativeGenerator(draft, target)
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    assert gen.last_stats.accepted > 0

    int8_target = load_target(tiny["target_dir"], quantization="int8")
    inherited = EagleDraft.from_pretrained(tiny["eagle"], int8_target, progress=False)
    assert isinstance(inherited.model.lm.lm_head, Int8Linear)
    for scheme in (None, "none"):
        float_draft = EagleDraft.from_pretrained(tiny["eagle"], int8_target, quantization=scheme, progress=False)
        assert not any(isinstance(m, Int8Linear) for m in float_draft.model.lm.modules())
    with pytest.raises(ValueError, match="quantization='int3' is not supported"):
        EagleDraft.from_pretrained(tiny["eagle"], target, quantization="int3", progress=False)


def test_fused_chain_equals_unfused(tiny):
    """Fused speculation projects the verify step's aux hidden states with fc inside the graph."""
    target = load_target(tiny["target_dir"])
    draft = EagleDraft.from_pretrained(tiny["eagle"], target, progress=False)
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    gen = SpeculativeGenerator(draft, target, 3, fused=True)
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=40, eos_token_id=[]), reference)


@pytest.mark.parametrize("tree", [None, DynamicTree(3, 4, 8)])
def test_true_features_after_verification_are_fc_of_the_targets(tiny, tree, monkeypatch):
    """Every (feature, token) pair the re-read step reads as true is fc(transformers' hidden states
    entering the aux layers) at that position and the next token of the final sequence."""
    target = load_target(tiny["target_dir"])
    draft = (EagleDraft.from_pretrained(tiny["eagle"], target, progress=False) if tree is None else
             EagleTreeDraft.from_pretrained(tiny["eagle"], target, tree=tree, progress=False))
    gen = SpeculativeGenerator(draft, target, 3)
    fed, seqs = record_true_pairs(gen, monkeypatch)
    fc = tiny["tensors"]["fc.weight"]
    with torch.no_grad():
        states = [tiny["hf"](torch.tensor([s]), output_hidden_states=True).hidden_states for s in seqs]
    projected = [torch.cat([st[i][0] for i in DEFAULT_AUX], -1) @ fc.T for st in states]
    assert_true_pairs(fed, seqs, projected)


# ---------------------------------------------------------------- losslessness
VOCAB = 16


@pytest.fixture(scope="module")
def lossless(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-lossless")
    hf = tiny_hf(3, vocab=VOCAB, layers=3)
    hf.save_pretrained(root / "target")
    ids = torch.tensor([0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15])          # q = 0 on 4 tokens
    eagle = write_eagle3(root / "eagle", hf, random_eagle3(4, VOCAB, ids, scale=0.4), aux_ids=[0, 1, 3])
    kw = dict(batch_size=512, n_positions=32, context_buckets=[8], kv_buckets=[32], backend="eager", progress=False)
    target = DecoderModel.from_pretrained(root / "target", **kw)
    return hf, target, eagle


def test_sampling_is_lossless(lossless):
    hf, target, eagle = lossless
    draft = EagleDraft.from_pretrained(eagle, target, progress=False)
    assert target.lm.feature_layers == (0, 1, 3)           # 3 = the last layer's output (before the norm)
    gen = SpeculativeGenerator(draft, target, 2)
    pvalue = lossless_pvalue(hf, target, gen, dict(temperature=0.7), 3)   # 20,480 samples of 3 tokens
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert gen.stats.per_position_acceptance[1] > 0.005    # second drafts (draft features) get accepted too
    assert pvalue > 1e-3


# ---------------------------------------------------------------- errors and persistence
def test_errors(tiny, tmp_path):
    hf, t = tiny["hf"], tiny["tensors"]
    target = load_target(tiny["target_dir"])
    with pytest.raises(ValueError, match=r"reads target layer\(s\) \[9\] .* the target has 8 layers"):
        EagleModel.from_pretrained(write_eagle3(tmp_path / "a", hf, t, aux_ids=[2, 4, 9]), target, progress=False)
    short = tiny_hf(0, layers=4)
    short.save_pretrained(tmp_path / "t4")
    with pytest.raises(ValueError, match=">= 7 layers, got 4"):
        EagleModel.from_pretrained(tiny["eagle"], load_target(tmp_path / "t4"), progress=False)
    with pytest.raises(KeyError, match="missing tensor.*norm.weight"):
        EagleModel.from_pretrained(write_eagle3(tmp_path / "b", hf, {k: v for k, v in t.items() if k != "norm.weight"}),
                                   target, progress=False)
    no_d2t = write_eagle3(tmp_path / "c", hf, t)
    _drop(no_d2t, "d2t")
    with pytest.raises(KeyError, match="no d2t"):
        EagleModel.from_pretrained(no_d2t, target, progress=False)
    bad_t2d = dict(t, t2d=t["t2d"].roll(1))
    with pytest.raises(ValueError, match="t2d .* does not mark"):
        EagleModel.from_pretrained(write_eagle3(tmp_path / "d", hf, bad_t2d), target, progress=False)
    with pytest.raises(ValueError, match="shape"):
        narrow_fc = dict(t, **{"fc.weight": t["fc.weight"][:, :2 * H]})
        EagleModel.from_pretrained(write_eagle3(tmp_path / "e", hf, narrow_fc), target, progress=False)
    wide = LlamaForCausalLM(type(hf.config)(**{**hf.config.to_dict(), "hidden_size": 48}))
    wide.save_pretrained(tmp_path / "h48")
    with pytest.raises(ValueError, match="hidden_size=32 .* != target hidden_size=48"):
        EagleModel.from_pretrained(tiny["eagle"], load_target(tmp_path / "h48"), progress=False)
    draft = EagleDraft.from_pretrained(tiny["eagle"], target, progress=False)
    target.use_feature_layers(())                     # someone else reconfigured the target
    with pytest.raises(ValueError, match=r"entering layers \[2, 4, 5\] but the target returns those of \[\]"):
        SpeculativeGenerator(draft, target, 3)


def _drop(directory: Path, name: str) -> None:
    tensors = load_file(directory / "model.safetensors")
    tensors.pop(name)
    save_file(tensors, directory / "model.safetensors")


def test_target_with_feature_layers_saves_and_loads(tiny, tmp_path):
    """``feature_layers`` is a runtime setting: saved with the model, restored by ``load``."""
    target = load_target(tiny["target_dir"], feature_layers=[5, 2, 4])
    assert target.settings.feature_layers == (2, 4, 5)
    target.save(tmp_path / "saved")
    loaded = DecoderModel.load(tmp_path / "saved", progress=False)
    assert loaded.lm.feature_layers == (2, 4, 5)
    out = loaded.prefill([torch.tensor(PROMPTS[0])], loaded.sampling_params(do_sample=False))
    assert out.hidden.shape[-1] == H and out.aux_hidden.shape[-1] == 3 * H
    with pytest.raises(ValueError, match="feature layer 9 does not exist"):
        load_target(tiny["target_dir"], feature_layers=[9])


def test_graphs_export_with_aux_outputs(tiny):
    """Target graphs with feature layers and the EAGLE-3 draft's graphs export with torch.export strict."""
    target = load_target(tiny["target_dir"])
    draft = EagleDraft.from_pretrained(tiny["eagle"], target, progress=False)
    for model, width in ((target, 4 * H), (draft.model, H)):
        for key in model.graph_keys(do_sample=True, spec_tokens=(3,), max_length=32):
            output = next(n for n in model.export(key).graph.nodes if n.op == "output")
            assert output.args[0][-1].meta["val"].shape[-1] == width      # hidden: [final | 3 aux] / x


# ---------------------------------------------------------------- training
from dataclasses import asdict  # noqa: E402

from specdec.tools.train.distill import load_target_state  # noqa: E402
from specdec.tools.train.eagle import EagleTrainConfig, EagleTrainer, export_eagle, init_state, train_eagle  # noqa: E402

from test_train import data_dir, tiny_target  # noqa: E402,F401  (module fixtures)

TRAIN3 = dict(steps=4, batch_rows=2, lr=3e-3, warmup=1, save_every=2, eval_every=2, seed=1, bf16=False,
              draft_vocab_size=48, unroll=3, arch="eagle3", aux_layers=(1, 2, 3))   # 3 = the last layer's output


def test_unrolled_training_forward_equals_runtime_drafting(tiny_target, tmp_path):
    """EAGLE-3 training's step s at position i computes exactly what EagleDraft computes when it drafts
    its s-th token after the true pairs up to i-s+1 (outputs before the norm, and the logits), through
    the public-layout export (f32)."""
    target_cfg = json.loads((tiny_target / "config.json").read_text())
    state = load_target_state(tiny_target)
    cfg = EagleTrainConfig(**TRAIN3)
    g = torch.Generator().manual_seed(1)
    ids = (torch.arange(48) * 3)[torch.randperm(48, generator=g)]      # export sorts them (d2t >= 0)
    embed = state["model.embed_tokens.weight"]
    trainable = init_state(state, target_cfg, cfg, torch.Generator().manual_seed(0), embed[ids])
    trainable = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in trainable.items()}
    trainer = EagleTrainer(target_cfg, trainable, embed, embed[ids])
    ckpt = {"step": 0, "model": trainer.state(), "output_token_ids": ids, "target_config": target_cfg,
            "config": asdict(cfg), "aux_layers": (1, 2, 3)}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    ship = export_eagle(tmp_path / "ckpt.pt", tmp_path / "ship", dtype=torch.float32)
    target = DecoderModel.from_pretrained(tiny_target, batch_size=1, n_positions=64, backend="eager", progress=False)
    draft = EagleDraft.from_pretrained(ship, target, progress=False).model
    assert target.lm.feature_layers == (1, 2, 3)

    L = 12
    tokens = torch.randint(5, 150, (1, L + 1), generator=g)
    params = target.sampling_params(do_sample=False)
    out = target.prefill([tokens[0]], params)
    features = draft.true_features(out)[:, :L + 1]                      # fc(aux_0 .. aux_L)
    with torch.no_grad():
        outs = trainer(tokens[:, 1:L + 1], out.aux_hidden[:, :L], unroll=3)
    for i in (4, 9):
        draft.reset()
        draft.prefill([tokens[0, 1:i + 1]], params, features=features[:, :i])
        draft.set_lengths(torch.tensor([i - 1]))
        step = draft.step(tokens[:, i:i + 1], params, features=features[:, i - 1:i])       # step 1 at i-1
        for s in (1, 2, 3):
            pos = i - 2 + s
            torch.testing.assert_close(step.hidden[0, 0], outs[s - 1][0, pos], atol=1e-4, rtol=1e-4)
            with torch.no_grad():
                torch.testing.assert_close(step.logits[0, 0, ids], trainer.logits(outs[s - 1][0, pos]),
                                           atol=1e-4, rtol=1e-4)
            if s < 3:   # step s+1 at position pos+1 reads this step's output (before the final norm)
                step = draft.step(tokens[:, pos + 2:pos + 3], params, features=step.hidden)


def test_training_exports_the_public_layout_and_speculates_exactly(data_dir, tiny_target, tmp_path, monkeypatch):  # noqa: F811
    from specdec.tools.train.data import load_dataset
    out = train_eagle(data_dir, tmp_path / "train", tiny_target, EagleTrainConfig(**TRAIN3), progress=False,
                      log=lambda m: None)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == TRAIN3["steps"] and "agree_step3" in log[-1]
    # the features cache: final-norm hidden states, then those entering layers 1, 2, 3 (runtime forward)
    feats = torch.load(out / "features.pt", weights_only=True)
    rows = [r for r in load_dataset(data_dir) if len(r["tokens"]) > r["prompt_len"] + 1]
    bf16 = DecoderModel.from_pretrained(tiny_target, batch_size=1, n_positions=128, amp="bf16", backend="eager",
                                        progress=False, feature_layers=(1, 2, 3))
    ref = bf16.prefill([rows[1]["tokens"]], bf16.sampling_params(do_sample=False))
    n = len(rows[1]["tokens"])
    torch.testing.assert_close(feats[1], torch.cat([ref.hidden, ref.aux_hidden], -1)[0, :n], atol=2e-2, rtol=2e-2)
    target = DecoderModel.from_pretrained(tiny_target, batch_size=2, n_positions=128, backend="eager", progress=False)

    ship = export_eagle(out / "ckpt.pt", tmp_path / "ship", dtype=torch.float32)
    names = set(load_file(ship / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight"} <= names
    assert not any(k.startswith("layers.") or k.startswith("embed") for k in names)
    cfg = json.loads((ship / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 48
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    draft = EagleDraft.from_pretrained(ship, target, progress=False)
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    ids = ckpt["output_token_ids"]
    state = load_target_state(tiny_target)
    trainer = EagleTrainer(json.loads((tiny_target / "config.json").read_text()), ckpt["model"],
                           state["model.embed_tokens.weight"], state["model.embed_tokens.weight"][ids])
    tokens = rows[0]["tokens"]
    first = target.prefill([tokens], target.sampling_params(do_sample=False))
    with torch.no_grad():
        x = trainer(tokens[1:].unsqueeze(0), first.aux_hidden[:1, :len(tokens) - 1], unroll=1)[0]
        expected = trainer.logits(x[0, -1])
    draft.start(None, [tokens], target.sampling_params(do_sample=False), None, first)
    got = draft.model.prefill([tokens[1:]], target.sampling_params(do_sample=False),
                              features=draft.features[:, :len(tokens) - 1])
    torch.testing.assert_close(got.logits[0, 0, ids], expected, atol=1e-4, rtol=1e-4)
    prompts = [[1, 5, 9, 12, 40, 41], [1, 77, 3]]
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    for k in (1, 3):
        assert torch.equal(SpeculativeGenerator(draft, target, k).sample(prompts, max_new_tokens=30, eos_token_id=[]),
                           reference)

    # the int8-packed ship (half of bf16's bytes) expands into the same layout and speculates exactly
    from specdec.core.ship import SCALE_SUFFIX
    from specdec.eagle.smollm2 import embedded_eagle_path
    packed = export_eagle(out / "ckpt.pt", tmp_path / "ship8", dtype=torch.float32, int8=True)
    stored = load_file(packed / "model.safetensors")
    assert stored["lm_head.weight"].dtype == torch.int8 and "fc.weight" + SCALE_SUFFIX in stored
    assert stored["norm.weight"].dtype == torch.float32 and stored["d2t"].dtype == torch.int64
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    expanded = embedded_eagle_path(packed)
    draft8 = EagleDraft.from_pretrained(expanded, target, progress=False)
    for name, w in load_file(ship / "model.safetensors").items():
        got8 = load_file(expanded / "model.safetensors")[name]
        if w.dim() == 2:   # half a quantization step per weight at most
            step = w.abs().amax(1, keepdim=True) / 127
            assert bool(((got8.float() - w).abs() <= step / 2 + 1e-3 * step + 1e-6).all()), name
        else:
            assert torch.equal(got8, w), name
    for k in (1, 3):
        assert torch.equal(SpeculativeGenerator(draft8, target, k).sample(prompts, max_new_tokens=30, eos_token_id=[]),
                           reference)
