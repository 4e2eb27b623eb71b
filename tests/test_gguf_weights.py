"""A GGUF file's quantized tensors (Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K) kept as the file stores
them (``specdec.core.gguf_weights``): the blocks decode to ``gguf``'s own dequantizer bit for bit, the
kernel-backed layers compute with those values, tensor-parallel shards take whole blocks, only llama-family
files' q / k rows are permuted back, and a model loaded with ``quantization="gguf"`` equals
transformers on the dequantized file, speculates exactly (greedy identity, chi-square losslessness)
and shards (TP=2 = TP=1)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from specdec import DraftModel, PromptLookup, SpeculativeGenerator  # noqa: E402
from specdec.core import gguf_weights
from specdec.core.block_linear import BlockLinear  # noqa: E402
from specdec.core.gguf_weights import (  # noqa: E402
    FORMATS,
    BlockWeights,
    gguf_quantized_tensors,
    quantize_q4_0,
    rope_row_order,
)
from specdec.core.kernels import quantize_activations  # noqa: E402
from specdec.core.parallel import launch  # noqa: E402
from specdec.core.quant import FUSED, Int4Linear, Int8Linear  # noqa: E402

from conftest import hf_logits, load, prompt_ids  # noqa: E402
from test_speculative import lossless_pvalue, save_tiny  # noqa: E402
from tiny_gguf import (  # noqa: E402
    GGUF_PROJECTIONS,
    HEADS,
    HF_PROJECTIONS,
    KV_HEADS,
    LAYER_TYPES,
    VOCAB,
    llama_cpp_permute,
    write_tiny_gguf,
)

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]              # the tiny model's types (gguf's ``quantize`` writes them)
ALL_QTYPES = list(FORMATS)                      # + Q5_0, Q4_K, Q6_K (the Qwen2.5-Coder files' types)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
CODE_RANGE = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q4_K": (0, 15), "Q8_0": (-128, 127), "Q5_0": (-16, 15),
              "Q6_K": (-32, 31)}


def file_blocks(qtype: str, n: int = 48, k: int = 128, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(raw bytes [n, k/32 · block bytes] as a GGUF file holds them, gguf's dequantized values [n, k])."""
    w = (0.3 * np.random.default_rng(seed).standard_normal((n, k))).astype(np.float32)
    raw = quantize(w, T[qtype])
    return raw, torch.from_numpy(dequantize(raw, T[qtype]).astype(np.float32))


def random_blocks(qtype: str, n: int, k: int, seed: int = 0, scale: float = 1.0) -> tuple[np.ndarray, torch.Tensor]:
    """Random valid blocks (random code and scale bytes, finite f16 d / dmin / m of either sign over a wide
    range, subnormals included, times ``scale``) as raw bytes [n, k/SB · block bytes], and gguf's
    dequantized values [n, k]."""
    rng = np.random.default_rng(seed)
    sb, size, _ = FORMATS[qtype]
    raw = rng.integers(0, 256, (n, k // sb, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        value = scale * rng.uniform(-1, 1, (n, k // sb)) * 2.0 ** rng.integers(-26, 4, (n, k // sb))
        raw[..., at:at + 2] = value.astype(np.float16)[..., None].view(np.uint8)
    raw = raw.reshape(n, -1)
    return raw, torch.from_numpy(dequantize(raw, T[qtype]))


def assert_bitwise_equal(ours: torch.Tensor, expected: torch.Tensor, qtype: str) -> None:
    """Bit for bit (the sign of a zero included)."""
    assert ours.dtype == expected.dtype == torch.float32 and ours.shape == expected.shape
    same = ours.view(torch.int32) == expected.view(torch.int32)
    assert bool(same.all()), f"{qtype}: {int((~same).sum())} weights differ"


@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_blocks_decode_to_the_gguf_dequantizer(qtype, monkeypatch):
    sb, _, g = FORMATS[qtype]
    n, k = 24, 2 * 256
    raw, expected = random_blocks(qtype, n, k)
    monkeypatch.setattr(gguf_weights, "DECODE_WEIGHTS", 5 * k)         # decoded 5 rows at a time: 5 + … + 4
    blocks = BlockWeights.from_bytes(raw, qtype)
    assert (blocks.group, blocks.superblock) == (g, sb) and blocks.codes.dtype == torch.int16
    assert blocks.d.shape == blocks.dmin.shape == (n, k // sb) and blocks.sc.shape == blocks.mn.shape == (n, k // g)
    assert_bitwise_equal(blocks.dequantize(), expected, qtype)
    low, high = CODE_RANGE[qtype]
    assert int(blocks.codes.min()) == low and int(blocks.codes.max()) == high      # every code occurs
    if qtype in ("Q4_0", "Q4_1", "Q8_0", "Q5_0"):
        raw, expected = file_blocks(qtype)                                             # gguf's own quantizer
        assert_bitwise_equal(BlockWeights.from_bytes(raw, qtype).dequantize(), expected, qtype)


@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_kernel_layer_computes_with_the_file_values(qtype):
    raw, expected = file_blocks(qtype, seed=1) if qtype in QTYPES else random_blocks(qtype, 48, 256, 1, 1e-3)
    layer = BlockWeights.from_bytes(raw, qtype).to_module(torch.float32)
    assert isinstance(layer, BlockLinear)
    assert_bitwise_equal(layer.dequantized(), expected, qtype)          # the file's weights, packed exactly
    x = torch.randn(5, expected.shape[1], generator=torch.Generator().manual_seed(0))
    reference = quantize_activations(x, layer.layout.superblock).double() @ expected.double().T   # 8-bit activations
    torch.testing.assert_close(layer(x).double(), reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    # bf16: activations widened to f32, the output rounded to bf16
    y = BlockWeights.from_bytes(raw, qtype).to_module(torch.bfloat16)(x.bfloat16()).double()
    assert float((y - reference).norm() / reference.norm()) < 0.02


@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_shards_take_rows_and_whole_blocks(qtype):
    sb = FORMATS[qtype][0]
    n, k = 32, 4 * sb
    raw, expected = random_blocks(qtype, n, k, seed=2)
    blocks = BlockWeights.from_bytes(raw, qtype)
    rows = blocks.take(0, [3, -1, 0] + list(range(4, 17)))
    assert torch.equal(rows.dequantize(), torch.cat([expected[[3]], torch.zeros(1, k), expected[[0]], expected[4:17]]))
    cols = blocks.take(1, list(range(2 * sb, 3 * sb)) + [-1] * sb + list(range(sb)))
    taken = torch.cat([expected[:, 2 * sb:3 * sb], torch.zeros(n, sb), expected[:, :sb]], 1)
    assert torch.equal(cols.dequantize(), taken)
    assert (cols.d.shape[1], cols.sc.shape[1]) == (3, 3 * sb // blocks.group)
    for misaligned in (list(range(16, 16 + sb)), list(range(sb // 2)), list(range(sb, 2 * sb))[::-1]):
        with pytest.raises(ValueError, match=f"only at multiples of {sb} columns"):
            blocks.take(1, misaligned)


def test_rope_row_order_undoes_llama_cpp_permutation():
    w = np.arange(64 * 8).reshape(64, 8)
    order = rope_row_order(64, HEADS)
    assert np.array_equal(llama_cpp_permute(w, HEADS)[order.numpy()], w)


def test_only_llama_family_rows_are_permuted(tiny):
    """llama.cpp's converter permutes q / k rows for llama / mistral only; transformers undoes it for a
    GGUF of architecture "llama" only (``LlamaTensorProcessor``): a qwen2 file's rows stay as stored."""
    from types import SimpleNamespace

    from gguf import GGUFReader

    target, _ = tiny
    stored = {t.name: torch.from_numpy(dequantize(np.array(t.data), t.tensor_type))
              for t in GGUFReader(str(target)).tensors if t.name.startswith("blk.0.attn_")}
    for model_type, permuted in (("llama", True), ("mistral", True), ("qwen2", False)):
        config = SimpleNamespace(model_type=model_type, tie_word_embeddings=True, num_heads=HEADS,
                                 num_kv_heads=KV_HEADS)
        found = gguf_quantized_tensors(target, config, tuple(QTYPES))
        for gguf_name, hf_name, heads in (("attn_q", "q_proj", HEADS), ("attn_k", "k_proj", KV_HEADS),
                                          ("attn_v", "v_proj", None)):
            w = stored[f"blk.0.{gguf_name}.weight"]
            expected = w[rope_row_order(len(w), heads)] if permuted and heads else w
            assert torch.equal(found[f"model.layers.0.self_attn.{hf_name}.weight"].dequantize(), expected)


def test_embedded_file_blocks_equal_gguf_dequantize(embedded_model):
    from specdec.core.config import ModelConfig
    from specdec.core.gguf_index import tensor_bytes, tensor_index
    from specdec.core.paths import embedded_gguf_path, resolve_model_path

    path = embedded_gguf_path()
    found = gguf_quantized_tensors(path, ModelConfig.from_dir(resolve_model_path(None, progress=False)),
                                   tuple(QTYPES))
    assert len(found) == 30 * 7 + 1 and found["lm_head.weight"].qtype == "Q8_0"     # tied: the embedding's blocks
    names = {"lm_head.weight": "token_embd.weight"}
    names |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{ours}.weight" for i in range(30)
              for ours, hf in zip(GGUF_PROJECTIONS, HF_PROJECTIONS)}
    entries = {t.name: t for t in tensor_index(path)}
    for name, blocks in found.items():       # llama: q / k rows are compared in the file's (permuted) order
        entry = entries[names[name]]
        expected = dequantize(tensor_bytes(path, entry), T[entry.qtype]).reshape(entry.shape)
        permute = {"self_attn.q_proj": 9, "self_attn.k_proj": 3}.get(name.split(".", 3)[-1].removesuffix(".weight"))
        ours = blocks.dequantize()
        if permute:
            ours = ours[torch.argsort(rope_row_order(ours.shape[0], permute))]
        assert torch.equal(ours, torch.from_numpy(expected)), name


# ---------------------------------------------------------------------------------- a tiny GGUF model
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_CACHE", str(root / "cache"))
        yield write_tiny_gguf(root / "target.gguf", seed=0), write_tiny_gguf(root / "draft.gguf", seed=1)


def projections(model):
    """(HF weight name, the file's GGML type name, the loaded layer computing it, that projection's output
    columns of the layer) for every projection of the tiny model; a fused layer (``quant.FUSED``) is the
    layer of each of its parts."""
    for i, types in enumerate(LAYER_TYPES):
        for name, qtype in zip(HF_PROJECTIONS, types):
            module, attr = name.rsplit(".", 1)
            parent = model.lm.get_submodule(f"model.layers.{i}.{module}")
            if hasattr(parent, attr):
                layer, columns = getattr(parent, attr), slice(None)
            else:
                fused, parts = next((f, p) for f, p in FUSED.items() if attr in p)
                layer = getattr(parent, fused)
                sizes = parent.qkv_sizes if fused == "qkv_proj" else [layer.out_features // 2] * 2
                start = sum(sizes[:parts.index(attr)])
                columns = slice(start, start + sizes[parts.index(attr)])
            yield f"model.layers.{i}.{name}.weight", qtype.name, layer, columns


def test_gguf_model_keeps_every_block_and_equals_transformers(tiny):
    from transformers import AutoModelForCausalLM

    target, _ = tiny
    model = load(target, quantization="gguf")
    assert all(isinstance(layer, BlockLinear) for _, _, layer, _ in projections(model))
    assert isinstance(model.lm.lm_head, BlockLinear)                   # the tied Q8_0 embedding's blocks
    hf = AutoModelForCausalLM.from_pretrained(target.parent, gguf_file=target.name).eval()  # transformers' own
    for seed in range(3):
        prompt = prompt_ids(7 + seed, seed, VOCAB)
        logits = model.prefill([torch.tensor(prompt)], model.sampling_params()).logits[0, -1]
        expected = hf_logits(hf, prompt)[-1]   # f32 activations; ours are quantized to 8 bits per group, which
        # moves this random tiny model's logits by 4-7 % (relative L2); the real models' cost: docs/real-pair.md
        assert float((logits - expected).norm() / expected.norm()) < 0.12 and logits.argmax() == expected.argmax()


def test_a_kept_layer_never_allocates_its_float_weight(tiny, monkeypatch):
    """The blocks replace their layers while the model is still on the meta device: loading a GGUF model
    needs its blocks' memory, not its dense float size first (the 1.5B: 5 GB peak, not 14 GB)."""
    from specdec.core import loading

    target, _ = tiny
    allocated = []
    materialize = loading.materialize

    def recording(lm, device, dtype):
        allocated.extend(name for name, t in lm.state_dict().items() if t.is_meta)
        materialize(lm, device, dtype)
    monkeypatch.setattr(loading, "materialize", recording)
    model = load(target, quantization="gguf")
    kept = {name for name, _, _, _ in projections(model)} | {"lm_head.weight"}
    assert allocated and not kept & set(allocated)
    assert "model.norm.weight" in allocated                  # the float tensors still come from the checkpoint ...
    assert "model.embed_tokens.weight" not in allocated      # ... the table as its file's pages (test_mapped_embedding)


def block_buffers(model) -> dict[str, tuple]:
    """Every ``BlockLinear`` of ``model``: its compute dtype, buffers and bias (an empty tensor for none)."""
    return {name: (m.dtype, *m.blocks(),
                   torch.empty(0) if m.bias is None else m.bias)
            for name, m in model.lm.named_modules() if isinstance(m, BlockLinear)}


def test_a_second_load_reads_the_packed_blocks_from_the_store(tiny, tmp_path, monkeypatch):
    """The first ``quantization="gguf"`` load keeps its packed layers in ``block_store``; the next reads them
    instead of decoding the file's blocks, and computes with the same bits (biases and dtype its own)."""
    from specdec.core import block_store

    target, _ = tiny
    monkeypatch.setattr(block_store, "store_dir", lambda: tmp_path / "blocks")
    first = load(target, quantization="gguf")
    assert [p.name.split("-")[-1] for p in (tmp_path / "blocks").iterdir()] == ["gguf.safetensors"]

    def refuse(*args, **kwargs):
        raise AssertionError("the file's blocks were decoded again")
    monkeypatch.setattr(gguf_weights, "gguf_quantized_tensors", refuse)
    second = load(target, quantization="gguf")
    expected, got = block_buffers(first), block_buffers(second)
    assert expected.keys() == got.keys() and len(expected) > 0
    for name in expected:
        assert expected[name][0] == got[name][0], name
        assert all(torch.equal(a, b) for a, b in zip(expected[name][1:], got[name][1:])), name
    prompt = [torch.tensor(prompt_ids(9, 0, VOCAB))]
    assert torch.equal(first.prefill(prompt, first.sampling_params()).logits,
                       second.prefill(prompt, second.sampling_params()).logits)
    with pytest.raises(AssertionError, match="decoded again"):      # another scheme keeps other blocks
        load(target, quantization="int8")


def test_a_stale_damaged_or_unwritable_store_is_rebuilt_or_skipped(tiny, tmp_path, monkeypatch, capsys):
    """A stored file of another format, or one that does not read, is rebuilt, never used; a store that cannot
    be written warns and the model loads from the file."""
    from specdec.core import block_store

    target, _ = tiny
    monkeypatch.setattr(block_store, "store_dir", lambda: tmp_path / "blocks")
    reference = block_buffers(load(target, quantization="gguf"))
    [stored] = (tmp_path / "blocks").iterdir()
    decoded = []
    real = gguf_weights.gguf_quantized_tensors
    monkeypatch.setattr(gguf_weights, "gguf_quantized_tensors", lambda *a, **k: decoded.append(1) or real(*a, **k))
    monkeypatch.setattr(block_store, "FORMAT", "0")        # a store written by another version of the layout
    load(target, quantization="gguf")
    monkeypatch.undo()
    monkeypatch.setattr(block_store, "store_dir", lambda: tmp_path / "blocks")
    monkeypatch.setattr(gguf_weights, "gguf_quantized_tensors", lambda *a, **k: decoded.append(1) or real(*a, **k))
    stored.write_bytes(stored.read_bytes()[:1000])          # a damaged file
    model = load(target, quantization="gguf")
    assert len(decoded) == 2 and block_store._read(stored) is not None
    got = block_buffers(model)
    assert all(torch.equal(a, b) for name in reference for a, b in zip(reference[name][1:], got[name][1:]))
    monkeypatch.setattr(block_store, "store_dir", lambda: stored)   # a file where the directory should be
    load(target, quantization="gguf")
    assert "could not keep the packed blocks" in capsys.readouterr().err and len(decoded) == 3


@pytest.mark.parametrize("scheme,keeps,requantized", [("int4", ("Q4_0", "Q4_1"), Int4Linear),
                                                      ("int8", ("Q8_0",), Int8Linear)])
def test_int4_and_int8_keep_the_blocks_of_their_own_width(tiny, scheme, keeps, requantized):
    target, _ = tiny
    model = load(target, quantization=scheme)
    file_blocks_ = gguf_quantized_tensors(target, model.config, tuple(QTYPES))
    for i, (name, qtype, layer, columns) in enumerate(projections(model)):
        if qtype in keeps:
            exact = file_blocks_[name].to_module(torch.float32)
            x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(i))
            assert torch.equal(layer(x)[:, columns], exact(x)), name
        else:
            assert isinstance(layer, requantized), name
    # the tied head is Q8_0 in the file: both schemes keep its blocks (an 8-bit head), none rounded again
    head = file_blocks_["lm_head.weight"].to_module(torch.float32)
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(99))
    assert isinstance(model.lm.lm_head, BlockLinear) and torch.equal(model.lm.lm_head(x), head(x))


def test_q4_0_blocks_are_ggml_reference_quantizers_and_exact_where_they_can_be():
    g = torch.Generator().manual_seed(0)
    outliers = 1 + 9 * (torch.rand(64, 256, generator=g) > 0.98)
    w = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * outliers
    blocks = quantize_q4_0(w)
    assert blocks.qtype == "Q4_0" and int(blocks.codes.min()) == -8 and int(blocks.codes.max()) == 7
    ggml = torch.from_numpy(dequantize(quantize(w.numpy(), T.Q4_0), T.Q4_0))
    ours = blocks.dequantize()
    assert float((ours != ggml).float().mean()) < 0.01              # gguf's quantizer, but for the d rounding
    assert float((ours - w).square().sum()) <= float((ggml - w).square().sum())
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(blocks.to_module(torch.float32)(x), BlockWeights.from_bytes(  # the same as a file's blocks
        quantize(blocks.dequantize().numpy(), T.Q4_0).reshape(64, -1), "Q4_0").to_module(torch.float32)(x))
    codes = torch.randint(-8, 8, (16, 256), generator=g)
    codes[:, ::32] = -8                                            # every group's largest magnitude: -8 · 2^-6
    exact = codes.float() * 2.0 ** -6
    assert torch.equal(quantize_q4_0(exact).dequantize(), exact)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q4_0(torch.randn(4, 40))


def test_q4_0_requantizes_the_rest_and_a_q4_0_draft_keeps_speculation_exact(tiny):
    target_path, draft_path = tiny
    model = load(target_path, quantization="q4_0")
    file_blocks_ = gguf_quantized_tensors(target_path, model.config, ("Q4_0",))
    dense = {name: layer.weight[columns] for name, _, layer, columns in projections(load(target_path))}
    for i, (name, qtype, layer, columns) in enumerate(projections(model)):
        assert isinstance(layer, BlockLinear) and (layer.layout.kind, layer.layout.offset) == (0, 8), name
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(i))
        if qtype == "Q4_0":                                        # the file's own Q4_0 blocks, not rounded again
            expected = file_blocks_[name]
        else:                        # the others re-quantized from their blocks = from the float checkpoint's weights
            expected = quantize_q4_0(dense[name])
        assert torch.equal(layer(x)[:, columns], expected.to_module(torch.float32)(x)), name
    assert model.lm.lm_head.layout.offset == 8                     # the head too (the file's is Q8_0)
    target = load(target_path, batch_size=3, quantization="gguf")
    prompts = [prompt_ids(5, 1, VOCAB), [5, 6, 7, 5, 6, 7, 5, 6], prompt_ids(12, 3, VOCAB)]
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    draft = DraftModel.from_pretrained(draft_path, target, quantization="q4_0", output_vocab_size=96)
    assert draft.model.lm.layer_runners is not None                # its layers run as block_layer calls
    gen = SpeculativeGenerator(draft, target, 3)
    assert torch.equal(gen.generate(prompts, max_new_tokens=30, eos_token_id=[]), reference)
    assert gen.last_stats.drafted > 0


def test_greedy_speculation_equals_the_gguf_target(tiny, tmp_path_factory):
    target_path, draft_path = tiny
    target = load(target_path, batch_size=3, quantization="gguf")
    prompts = [prompt_ids(5, 1, VOCAB), [5, 6, 7, 5, 6, 7, 5, 6], prompt_ids(12, 3, VOCAB)]
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    draft = DraftModel.from_pretrained(draft_path, target)
    assert isinstance(draft.model.lm.lm_head, BlockLinear)              # a GGUF draft inherits "gguf"
    _, float_dir = save_tiny(tmp_path_factory, "float-draft", 1, 5, vocab=VOCAB)
    float_draft = DraftModel.from_pretrained(float_dir, target)          # a checkpoint directory stays float
    assert type(float_draft.model.lm.model.layers[0].mlp.gate_up_proj) is torch.nn.Linear   # float, fused
    for proposer, k in ((draft, 3), (float_draft, 2), (PromptLookup(target), 4)):
        gen = SpeculativeGenerator(proposer, target, k)
        assert torch.equal(gen.generate(prompts, max_new_tokens=30, eos_token_id=[]), reference)
        assert gen.last_stats.drafted > 0


class TargetOnly:
    """A model's own next-token logits, read as ``exact_joint`` reads a transformers model's: ids [B, L] →
    .logits [B, 1, V] of the last position (one prefill of every row)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        out = self.model.prefill(list(ids), self.model.sampling_params())
        return SimpleNamespace(logits=out.logits[:len(ids)])


def test_sampling_with_gguf_target_and_draft_is_lossless(tiny):
    target_path, draft_path = tiny
    kw = dict(batch_size=512, n_positions=32, context_buckets=[8], kv_buckets=[32], quantization="gguf")
    target = load(target_path, **kw)
    gen = SpeculativeGenerator(load(draft_path, **kw), target, 2)
    reference = TargetOnly(load(target_path, **kw))     # the target's own distribution (8-bit activations)
    assert lossless_pvalue(reference, target, gen, dict(temperature=0.8), 2) > 1e-3    # 20,480 samples
    assert 0.02 < gen.stats.acceptance_rate < 0.98


def tp_gguf(path: str, prompts: list[list[int]]) -> list[list[int]]:
    return load(path, batch_size=2, tp_degree=2, quantization="gguf").generate(
        prompts, max_new_tokens=20, eos_token_id=[]).tolist()


def test_tp2_gguf_equals_tp1_gguf(tiny):
    target, _ = tiny
    prompts = [prompt_ids(6, 7, VOCAB), prompt_ids(10, 8, VOCAB)]
    tp1 = load(target, batch_size=2, quantization="gguf").generate(prompts, max_new_tokens=20, eos_token_id=[])
    assert launch(tp_gguf, 2, str(target), prompts, timeout_s=300) == tp1.tolist()


def test_gguf_quantization_needs_a_gguf_file_and_is_not_planned(checkpoint):
    from specdec.tools.plan import plan_capacity

    with pytest.raises(ValueError, match="quantization='gguf' keeps a GGUF file's own .* not a .gguf file"):
        load(checkpoint("llama"), quantization="gguf")
    with pytest.raises(ValueError, match="planner counts quantization='int8' or 'int4'"):
        plan_capacity(checkpoint("llama").path, batch_size=1, n_positions=64, amp="f32", platform="cpu:1",
                      quantization="gguf")


def test_gguf_graphs_export(tiny):
    target, _ = tiny
    model = load(target, amp="bf16", quantization="gguf")
    exported = model.export(model.graph_keys(prompt_length=16, max_length=32)[-1])
    assert any(n.target == torch.ops.specdec.block_mm.default for n in exported.graph.nodes)   # one custom op


# ---------------------------------------------------------------------------------- a restricted output vocabulary
def test_output_vocab_size_scores_the_first_ids_only(tiny, tmp_path_factory):
    """``output_vocab_size`` n: the head keeps its first n rows (the file's blocks, or a float head's rows), the
    logits of ids < n are the full model's (bit for bit on the kernel: its columns are independent) and every
    later id gets -inf; bad values and re-quantized heads are refused at load."""
    target_path, _ = tiny
    prompts = [prompt_ids(7, 2, VOCAB), prompt_ids(4, 5, VOCAB)]
    _, float_dir = save_tiny(tmp_path_factory, "float-vocab", 1, 5, vocab=VOCAB)
    for path, kw, exact in ((target_path, dict(quantization="gguf"), True), (float_dir, {}, False)):
        full, cut = (load(path, batch_size=2, **kw, output_vocab_size=n) for n in (None, 72))
        assert cut.lm.lm_head.out_features == 72 and cut.config.output_vocab_size == 72
        params = full.sampling_params()
        a, b = full.prefill(prompts, params).logits, cut.prefill(prompts, params).logits
        assert b.shape == a.shape and torch.isneginf(b[..., 72:]).all()
        if exact:
            assert torch.equal(b[..., :72], a[..., :72])
        else:
            torch.testing.assert_close(b[..., :72], a[..., :72], rtol=0, atol=1e-5)
    for n in (0, VOCAB + 1):
        with pytest.raises(ValueError, match="output_vocab_size must be in"):
            load(target_path, quantization="gguf", output_vocab_size=n)
    with pytest.raises(ValueError, match="re-quantizes the head"):
        load(target_path, quantization="int8", output_vocab_size=64)


def test_speculation_with_a_restricted_draft_vocabulary_is_exact(tiny):
    """A draft that never proposes ids >= n: greedy output = target-only, sampling lossless (chi-square)."""
    target_path, draft_path = tiny
    target = load(target_path, batch_size=3, quantization="gguf")
    prompts = [prompt_ids(5, 1, VOCAB), [5, 6, 7, 5, 6, 7, 5, 6], prompt_ids(12, 3, VOCAB)]
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    draft = DraftModel.from_pretrained(draft_path, target, output_vocab_size=96)
    gen = SpeculativeGenerator(draft, target, 3)
    assert torch.equal(gen.generate(prompts, max_new_tokens=30, eos_token_id=[]), reference)
    assert gen.last_stats.drafted > 0
    kw = dict(batch_size=512, n_positions=32, context_buckets=[8], kv_buckets=[32], quantization="gguf")
    target = load(target_path, **kw)
    gen = SpeculativeGenerator(load(target_path, **kw, output_vocab_size=96), target, 2)
    reference = TargetOnly(load(target_path, **kw))
    assert lossless_pvalue(reference, target, gen, dict(temperature=0.8), 2) > 1e-3    # 20,480 samples
    assert 0.02 < gen.stats.acceptance_rate < 0.98


def test_a_server_over_block_kernel_models_builds_no_graph_ahead(tiny, monkeypatch):
    """``specdec serve`` on a target and draft whose layers run as block kernels on ``regional`` (no graph shape
    costs a compilation: ``shapes_free``) loads without warming every bucket of the longest prompt — minutes for
    the 1.5B — and serves the target's greedy output; a fused speculator still compiles ahead."""
    from specdec.options import ModelOptions, SpeculationOptions
    from specdec.serving import server

    target_path, draft_path = tiny
    warmed = []
    monkeypatch.setattr(server, "precompile", lambda *args, **kwargs: warmed.append(kwargs) or [])
    model = ModelOptions(model=str(target_path), quantization="gguf", amp="f32", backend="regional", n_positions=128)

    def engine(**speculation):
        spec = SpeculationOptions(draft="model", draft_path=str(draft_path), k=3, **speculation).checked(model)
        return server.load_engine(server.ServeOptions(model=model, speculation=spec, batch_size=2))

    served = engine()
    assert warmed == [] and served.target.shapes_free
    prompts = [prompt_ids(5, 1, VOCAB), [5, 6, 7, 5, 6, 7, 5, 6]]
    reference = load(target_path, batch_size=2, quantization="gguf").generate(prompts, max_new_tokens=20,
                                                                              eos_token_id=[])
    assert torch.equal(served.generate(prompts, max_new_tokens=20, eos_token_id=[]), reference)
    engine(fused=True)
    assert len(warmed) == 1
