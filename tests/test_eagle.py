"""EAGLE drafts: checkpoint layouts and LM-head copying, exactness (greedy), losslessness (sampling),
feature plumbing (against transformers' output_hidden_states), on tiny random models."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import DecoderModel, EagleDraft, SpeculativeGenerator
from specdec.eagle.checkpoint import copy_lm_head, target_lm_head
from specdec.speculation.proposer import Proposal

from conftest import save_checkpoint
from test_speculative import lossless_pvalue

H, I = 32, 64  # noqa: E741  (hidden size, intermediate size)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]


def tiny_target(seed: int, vocab: int = 64, layers: int = 2, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=H, intermediate_size=I, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=None, pad_token_id=0, initializer_range=0.3, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


def layer_tensors(g: torch.Generator, scale: float = 0.2) -> dict:
    shapes = {"self_attn.q_proj.weight": (H, H), "self_attn.k_proj.weight": (H // 2, H),
              "self_attn.v_proj.weight": (H // 2, H), "self_attn.o_proj.weight": (H, H),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    t = {"layers.0." + k: torch.randn(*s, generator=g) * scale for k, s in shapes.items()}
    t["layers.0.post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    return t


def write_eagle(directory: Path, target: LlamaForCausalLM, tensors: dict, prefix: str = "",
                extra_config: dict | None = None) -> Path:
    """An EAGLE-1 layout checkpoint: one-layer config, fc + layers.0 (+ whatever ``tensors`` holds)."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(target.config.to_dict(), num_hidden_layers=1, **(extra_config or {}))
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    return directory


def random_eagle(target: LlamaForCausalLM, seed: int, input_norm: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.2, "fc.bias": torch.randn(H, generator=g) * 0.1,
         **layer_tensors(g)}
    if input_norm:
        t["layers.0.input_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    return t


def saved_target_and_eagle(directory: Path) -> tuple[Path, Path]:
    """``tiny_target(0)`` saved to ``directory / "target"`` and a random EAGLE-1 head for it with the
    target's LM head copied in (``directory / "eagle"``): (target dir, EAGLE dir)."""
    hf = tiny_target(0)
    hf.save_pretrained(directory / "target")
    eagle = copy_lm_head(write_eagle(directory / "eagle1", hf, random_eagle(hf, 1)), directory / "target",
                         directory / "eagle")
    return directory / "target", eagle


def load_target(path, **kw) -> DecoderModel:
    kw = {"batch_size": 3, "n_positions": 128, "kv_buckets": [32, 64, 128], "context_buckets": [16, 32],
          "backend": "eager", "progress": False, **kw}
    return DecoderModel.from_pretrained(path, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    hf = tiny_target(0)
    hf.save_pretrained(root / "target")
    eagle1 = write_eagle(root / "eagle1", hf, random_eagle(hf, 1))
    nxd = copy_lm_head(eagle1, root / "target", root / "nxd")
    return dict(root=root, hf=hf, target_dir=root / "target", eagle1=eagle1, nxd=nxd)


def matched_eagle(hf: LlamaForCausalLM, feature_weight: float = 0.0, seed: int = 0) -> dict:
    """An EAGLE draft copying a one-layer target: fc passes the token embedding (plus
    ``feature_weight`` × a random mix of the feature), the layer is the target's."""
    state = hf.state_dict()
    t = {k[len("model."):]: v.clone() for k, v in state.items() if k.startswith("model.layers.0.")}
    t.pop("layers.0.input_layernorm.weight")
    mix = torch.randn(H, H, generator=torch.Generator().manual_seed(seed)) * feature_weight / H ** 0.5
    t["fc.weight"] = torch.cat([torch.eye(H), mix], 1)
    t["fc.bias"] = torch.zeros(H)
    t["lm_head.weight"] = state["lm_head.weight"].clone()
    return t


@pytest.fixture(scope="module")
def perfect(tmp_path_factory):
    """A one-layer target without attention output (next token = f(current token)) and the EAGLE
    draft that computes exactly its pre-norm hidden state (``matched_eagle``); a unit final norm only
    rescales, so the draft's argmax is the target's."""
    root = tmp_path_factory.mktemp("perfect")
    hf = tiny_target(5, layers=1)
    with torch.no_grad():
        hf.model.layers[0].self_attn.o_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
    hf.save_pretrained(root / "target")
    return write_eagle(root / "eagle", hf, matched_eagle(hf)), root / "target"


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_target_only(tiny, k):
    target = load_target(tiny["target_dir"])
    draft = EagleDraft.from_pretrained(tiny["nxd"], target, progress=False)
    reference = target.generate(PROMPTS, max_new_tokens=70, eos_token_id=[])
    gen = SpeculativeGenerator(draft, target, k)
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=70, eos_token_id=[]), reference)
    one = gen.sample([PROMPTS[2]], max_new_tokens=70, eos_token_id=[])
    width = max(map(len, PROMPTS))
    assert torch.equal(one[0, len(PROMPTS[2]):], reference[2, width:])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_perfect_draft_and_eos_inside_accepted_runs(perfect, k):
    eagle_dir, target_dir = perfect
    target = load_target(target_dir)
    draft = EagleDraft.from_pretrained(eagle_dir, target, progress=False)
    gen = SpeculativeGenerator(draft, target, k)
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=40, eos_token_id=[]), reference)
    assert gen.last_stats.acceptance_rate > 0.95       # the construction really is a perfect draft
    # an EOS that greedy decoding emits mid-way: the spec run must stop on it like target-only
    width = max(map(len, PROMPTS))
    eos = reference[0, width + 7].item()
    ref_eos = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=eos)
    out = gen.sample(PROMPTS, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out, ref_eos)
    assert gen.last_stats.acceptance_rate > 0.95   # so the EOS was an accepted draft, not a correction


def test_features_fed_to_draft_are_the_targets(tiny, monkeypatch):
    """Every (feature, token) pair the draft reads as 'true' equals transformers' final hidden state
    at that position and the next token of the final sequence."""
    target = load_target(tiny["target_dir"])
    draft = EagleDraft.from_pretrained(tiny["nxd"], target, progress=False)
    gen = SpeculativeGenerator(draft, target, 3)
    fed = []   # (row, position, feature, token)
    net = draft.model
    real_prefill, real_step = net.prefill, net.step

    def prefill(prompts, params, rng=None, features=None, rows=None):
        for b, p in enumerate(prompts):
            fed.extend((b, i, features[b, i].clone(), int(p[i])) for i in range(len(p)))
        return real_prefill(prompts, params, rng, features=features, rows=rows)

    def step(tokens, params, rng=None, features=None, logit_index=None, **kw):
        if logit_index is not None:   # the re-read step: positions lengths .. lengths + logit_index are true
            for b in range(tokens.shape[0]):
                for j in range(int(logit_index[b, 0]) + 1):
                    fed.append((b, int(net.lengths[b]) + j, features[b, j].clone(), int(tokens[b, j])))
        return real_step(tokens, params, rng, features=features, logit_index=logit_index, **kw)

    monkeypatch.setattr(net, "prefill", prefill)
    monkeypatch.setattr(net, "step", step)
    out = gen.sample(PROMPTS, max_new_tokens=30, eos_token_id=[])
    width = max(map(len, PROMPTS))
    seqs = [p + out[b, width:].tolist() for b, p in enumerate(PROMPTS)]
    with torch.no_grad():
        hidden = [tiny["hf"](torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0] for s in seqs]
    assert_true_pairs(fed, seqs, hidden)


# ---------------------------------------------------------------- losslessness
VOCAB = 16


def lossless_setup(root: Path) -> tuple[LlamaForCausalLM, DecoderModel, Path]:
    """A one-layer target over VOCAB tokens whose attention matters (batch 512 of the chi-square tests)
    and an EAGLE head approximating it: (transformers model, target, EAGLE dir)."""
    hf = tiny_target(3, vocab=VOCAB, layers=1)
    with torch.no_grad():
        hf.model.layers[0].self_attn.o_proj.weight.mul_(0.5)   # attention matters, the draft approximates it
    hf.save_pretrained(root / "target")
    eagle = write_eagle(root / "eagle", hf, matched_eagle(hf, feature_weight=0.3))
    kw = dict(batch_size=512, n_positions=32, context_buckets=[8], kv_buckets=[32], backend="eager", progress=False)
    return hf, DecoderModel.from_pretrained(root / "target", **kw), eagle


def record_true_pairs(gen: SpeculativeGenerator, monkeypatch, max_new_tokens: int = 30) -> tuple[list, list]:
    """Run ``gen`` (an EAGLE chain or tree draft) on PROMPTS greedily, recording every (row, position,
    feature, token) its re-read step reads as true → (records, the final sequences)."""
    fed, net = [], gen.proposer.model
    real_step = net.step

    def step(tokens, params, rng=None, features=None, logit_index=None, token_mask=None, **kw):
        if logit_index is not None and token_mask is None:     # the re-read: these positions are true pairs
            for b in range(tokens.shape[0]):
                fed.extend((b, int(net.lengths[b]) + j, features[b, j].clone(), int(tokens[b, j]))
                           for j in range(int(logit_index[b, 0]) + 1))
        return real_step(tokens, params, rng, features=features, logit_index=logit_index, token_mask=token_mask, **kw)

    monkeypatch.setattr(net, "step", step)
    out = gen.sample(PROMPTS, max_new_tokens=max_new_tokens, eos_token_id=[])
    width = max(map(len, PROMPTS))
    return fed, [p + out[b, width:].tolist() for b, p in enumerate(PROMPTS)]


def assert_true_pairs(fed: list, seqs: list[list[int]], features: list[torch.Tensor]) -> None:
    """Every (row, position, feature, token) the draft read as true is the final sequence's token at
    position + 1 and ``features[row][position]``."""
    assert len(fed) > 60
    for b, pos, feature, token in fed:
        assert pos + 1 < len(seqs[b])
        assert token == seqs[b][pos + 1]
        torch.testing.assert_close(feature.float(), features[b][pos], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def lossless(tmp_path_factory):
    hf, target, eagle = lossless_setup(tmp_path_factory.mktemp("eagle-lossless"))
    return hf, target, EagleDraft.from_pretrained(eagle, target, progress=False)


@pytest.mark.parametrize("sample_kwargs", [dict(temperature=0.7), dict(temperature=1.3, top_k=6, top_p=0.9)])
def test_sampling_is_lossless(lossless, sample_kwargs):
    hf, target, draft = lossless
    gen = SpeculativeGenerator(draft, target, 2)
    pvalue = lossless_pvalue(hf, target, gen, sample_kwargs, 3)  # 20,480 samples of 3 tokens
    assert 0.05 < gen.stats.acceptance_rate < 0.95
    assert gen.stats.per_position_acceptance[1] > 0.01   # second drafts (draft features) get accepted too
    assert pvalue > 1e-3


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("layout", ["safetensors", "safetensors-sharded", "bin", "bin-sharded"])
@pytest.mark.parametrize("tie", [False, True])
def test_copy_lm_head_round_trips_bit_exactly(tmp_path, layout, tie):
    hf = tiny_target(7, tie=tie)
    target_dir = save_checkpoint(hf, tmp_path / "target", layout)
    drafts = write_eagle(tmp_path / "eagle", hf, random_eagle(hf, 8))
    out = copy_lm_head(drafts, target_dir, tmp_path / "out")
    copied = load_file(out / "model.safetensors")
    expected = hf.lm_head.weight.detach()
    assert copied["lm_head.weight"].dtype == expected.dtype
    assert torch.equal(copied["lm_head.weight"], expected)
    assert torch.equal(target_lm_head(target_dir), expected)
    original = load_file(drafts / "model.safetensors")
    assert all(torch.equal(copied[k], v) for k, v in original.items())
    # in place (the default) gives the same file
    copy_lm_head(drafts, target_dir)
    assert torch.equal(load_file(drafts / "model.safetensors")["lm_head.weight"], expected)


def test_copy_lm_head_reduced_vocabulary_takes_the_rows(tmp_path):
    hf = tiny_target(9)
    hf.save_pretrained(tmp_path / "target")
    ids = torch.tensor([0, 2, 5, 7, 11, 40])
    t = {**random_eagle(hf, 10), "output_token_ids": ids}
    eagle = write_eagle(tmp_path / "eagle", hf, t, extra_config={"draft_vocab_size": len(ids)})
    copy_lm_head(eagle, tmp_path / "target")
    assert torch.equal(load_file(eagle / "model.safetensors")["lm_head.weight"], hf.lm_head.weight.detach()[ids])
    target = load_target(tmp_path / "target")
    draft = EagleDraft.from_pretrained(eagle, target, progress=False)
    reference = target.generate(PROMPTS, max_new_tokens=30, eos_token_id=[])
    assert torch.equal(SpeculativeGenerator(draft, target, 3).sample(PROMPTS, max_new_tokens=30, eos_token_id=[]),
                       reference)


def test_copy_lm_head_errors(tmp_path):
    hf = tiny_target(11)
    hf.save_pretrained(tmp_path / "target")
    eagle = write_eagle(tmp_path / "eagle", hf, random_eagle(hf, 12))
    other_vocab = tiny_target(11, vocab=80)
    other_vocab.save_pretrained(tmp_path / "vocab80")
    with pytest.raises(ValueError, match="vocab_size=64 .* != target vocab_size=80"):
        copy_lm_head(eagle, tmp_path / "vocab80", tmp_path / "o1")
    bigger = LlamaForCausalLM(LlamaConfig(**{**hf.config.to_dict(), "hidden_size": 48}))
    bigger.save_pretrained(tmp_path / "h48")
    with pytest.raises(ValueError, match="hidden_size=32 .* != target hidden_size=48"):
        copy_lm_head(eagle, tmp_path / "h48", tmp_path / "o2")
    headless = tmp_path / "headless"
    headless.mkdir()
    (headless / "config.json").write_text((tmp_path / "target" / "config.json").read_text())
    state = load_file(tmp_path / "target" / "model.safetensors")
    save_file({k: v for k, v in state.items() if k not in ("lm_head.weight", "model.embed_tokens.weight")},
              headless / "model.safetensors")
    with pytest.raises(KeyError, match="neither lm_head.weight"):
        copy_lm_head(eagle, headless, tmp_path / "o3")
    not_eagle = tmp_path / "not-eagle"
    hf.save_pretrained(not_eagle)
    with pytest.raises(KeyError, match="no fc.weight"):
        copy_lm_head(not_eagle, tmp_path / "target", tmp_path / "o4")
    reduced = write_eagle(tmp_path / "reduced", hf, random_eagle(hf, 13), extra_config={"draft_vocab_size": 8})
    with pytest.raises(KeyError, match="output_token_ids"):
        copy_lm_head(reduced, tmp_path / "target", tmp_path / "o5")


def test_loading_without_lm_head_names_the_copy_command(tiny):
    target = load_target(tiny["target_dir"])
    with pytest.raises(KeyError, match="specdec eagle-lm-head --draft"):
        EagleDraft.from_pretrained(tiny["eagle1"], target, progress=False)


def test_nxd_layout_with_prefix_and_embedding_loads(tiny, tmp_path):
    """``model.``-prefixed keys and a stored embedding (NxD / HF style) give the same draft."""
    hf = tiny["hf"]
    t = {**random_eagle(hf, 1), "embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
         "lm_head.weight": hf.lm_head.weight.detach().clone()}
    prefixed = {("" if k == "lm_head.weight" else "model.") + k: v for k, v in t.items()}
    d = write_eagle(tmp_path / "nxd", hf, prefixed)
    target = load_target(tiny["target_dir"])
    a = EagleDraft.from_pretrained(d, target, progress=False)
    b = EagleDraft.from_pretrained(tiny["nxd"], target, progress=False)
    assert a.model.lm.embed_tokens.weight.data_ptr() != target.lm.model.embed_tokens.weight.data_ptr()
    assert b.model.lm.embed_tokens.weight.data_ptr() == target.lm.model.embed_tokens.weight.data_ptr()  # shared
    for (name, x), (_, y) in zip(a.model.lm.state_dict().items(), b.model.lm.state_dict().items()):
        assert torch.equal(x, y), name
    ref = SpeculativeGenerator(b, target, 3).sample(PROMPTS, max_new_tokens=20, eos_token_id=[])
    assert torch.equal(SpeculativeGenerator(a, target, 3).sample(PROMPTS, max_new_tokens=20, eos_token_id=[]), ref)


def test_input_norm_option(tiny, tmp_path):
    hf = tiny["hf"]
    d = copy_lm_head(write_eagle(tmp_path / "norm", hf, random_eagle(hf, 2, input_norm=True)), tiny["target_dir"])
    target = load_target(tiny["target_dir"])
    with pytest.raises(ValueError, match="eagle_input_norm=True"):
        EagleDraft.from_pretrained(d, target, progress=False)
    draft = EagleDraft.from_pretrained(d, target, eagle_input_norm=True, progress=False)
    assert isinstance(draft.model.lm.layers[0].input_layernorm, torch.nn.Module)
    assert draft.model.lm.layers[0].input_layernorm.weight.shape == (H,)
    reference = target.generate(PROMPTS, max_new_tokens=30, eos_token_id=[])
    assert torch.equal(SpeculativeGenerator(draft, target, 3).sample(PROMPTS, max_new_tokens=30, eos_token_id=[]),
                       reference)


def test_draft_must_fit_the_target(tiny, tmp_path):
    target = load_target(tiny["target_dir"])
    other = tiny_target(0, vocab=80)
    other.save_pretrained(tmp_path / "t80")
    with pytest.raises(ValueError, match="vocab_size=64 .* != target vocab_size=80"):
        EagleDraft.from_pretrained(tiny["nxd"], load_target(tmp_path / "t80"), progress=False)
    draft = EagleDraft.from_pretrained(tiny["nxd"], target, progress=False)
    bigger = load_target(tiny["target_dir"], n_positions=256, kv_buckets=[256])
    with pytest.raises(ValueError, match="does not fit the target"):
        SpeculativeGenerator(draft, bigger, 3)
    bf16 = load_target(tiny["target_dir"], amp="bf16")
    with pytest.raises(ValueError, match="runs in torch.float32 but the target in torch.bfloat16"):
        SpeculativeGenerator(draft, bf16, 3)


def test_misaligned_draft_probabilities_are_detected(lossless, monkeypatch):
    """Power check: draft probabilities misaligned with the sampled tokens (off by one vocabulary
    index) change the distribution, and the same chi-square test catches it."""
    hf, target, draft = lossless
    gen = SpeculativeGenerator(draft, target, 2)
    real = gen.proposer.propose

    def misaligned(*args):
        proposal = real(*args)
        return Proposal(proposal.tokens, proposal.probs.roll(1, -1))

    monkeypatch.setattr(gen.proposer, "propose", misaligned)
    assert lossless_pvalue(hf, target, gen, dict(temperature=0.7), 3, calls=20) < 1e-6


def test_draft_graphs_export_and_compile_keys(tiny):
    """Every EAGLE graph (context, one-token, (k+1)-token re-read) exports with torch.export strict."""
    target = load_target(tiny["target_dir"])
    draft = EagleDraft.from_pretrained(tiny["nxd"], target, progress=False)
    keys = draft.model.graph_keys(do_sample=True, spec_tokens=(3,), max_length=32)
    assert {(k.n_tokens, k.n_logits) for k in keys} == {(16, 1), (32, 1), (1, 1), (4, 1)}
    for key in keys:
        program = draft.model.export(key)
        assert len(program.graph_signature.user_inputs) == 8   # the seven runtime inputs + features


def test_draft_network_saves_and_loads_like_any_decoder_model(tiny, tmp_path):
    """``EagleModel`` keeps the ``DecoderModel`` contract: ``save`` writes the checkpoint path, runtime
    settings and built graphs; ``EagleModel.load(dir, target)`` gives a draft that drafts the same."""
    from specdec.eagle import EagleModel
    target = load_target(tiny["target_dir"])
    draft = EagleDraft.from_pretrained(tiny["nxd"], target, progress=False)
    reference = SpeculativeGenerator(draft, target, 3).sample(PROMPTS, max_new_tokens=20, eos_token_id=[])
    draft.model.save(tmp_path / "saved")
    loaded = EagleModel.load(tmp_path / "saved", target, progress=False)
    assert loaded.settings == draft.model.settings and set(loaded.graphs.built) == set(draft.model.graphs.built)
    gen = SpeculativeGenerator(EagleDraft(loaded), target, 3)
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=20, eos_token_id=[]), reference)
    assert gen.last_stats.steps > 0
