"""KV-cache quantization (``kv_cache_dtype``, ``specdec.core.kv_quant``): the format's error bound on real
cache writes, logits near the unquantized model's, exactness of speculation with respect to the
KV-quantized target (greedy identity with a draft model, prompt lookup and EAGLE; chi-square
losslessness), single-row context encoding and KV compaction with scales, TP=2 = TP=1, export and
compile, saved settings, the capacity planner's bytes, the command-line option and clear errors."""
import json
from types import SimpleNamespace

import pytest
import torch

from specdec import DecoderModel, DraftModel, EagleDraft, PromptLookup, SpeculativeGenerator
from specdec.cli import build_parser, main
from specdec.core.kv_quant import dequantize_kv, parse_kv_cache_dtype, quantize_kv, storage_dtype
from specdec.core.model import Attention
from specdec.core.parallel import launch
from specdec.options import options_from
from specdec.serving.server import ServeOptions, load_engine

from conftest import checkpoint, load, prompt_ids  # noqa: F401  (fixture)
from test_eagle import saved_target_and_eagle
from test_export import check_export
from test_speculative import VOCAB, lossless_pvalue, save_tiny

DTYPES = ["int8", "fp8_e4m3"]


def attentions(model: DecoderModel) -> list[Attention]:
    return [m for m in model.lm.modules() if isinstance(m, Attention)]


def error_bound(x: torch.Tensor, scale: torch.Tensor, kv: str) -> torch.Tensor:
    """The format's per-element bound [..., D] for x [..., D] with scales [...] (``kv_quant``), widened
    by 1e-5 relative for the f32 arithmetic of dequantization."""
    s = scale.unsqueeze(-1)
    bound = s / 2 if kv == "int8" else 2.0 ** -4 * x.abs() + 2.0 ** -10 * s
    return bound * (1 + 1e-5) + 1e-5 * s


# ----------------------------------------------------------------------------- the format
@pytest.mark.parametrize("kv", DTYPES)
def test_quantize_round_trip_is_within_the_bound(kv):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, 3, 32, generator=g) * 10.0 ** (6 * torch.rand(6, 40, 3, 1, generator=g) - 3)
    x[2, 5, 1] = 0                                        # an all-zero vector
    x[3, 7, 0, 4] = 1e-9                                  # tiny next to the vector's maximum: subnormal in fp8
    q, scale = quantize_kv(x, storage_dtype(kv))
    assert q.dtype == storage_dtype(kv) and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    qmax = {"int8": 127, "fp8_e4m3": 448}[kv]
    assert float(q.float().abs().amax(-1).min()) == 0 and float(q.float().abs().max()) == qmax
    assert float(scale[2, 5, 1]) == 1.0 and not bool(q[2, 5, 1].float().any())
    err = (dequantize_kv(q, scale, torch.float32) - x).abs()
    assert bool((err <= error_bound(x, scale, kv)).all())
    assert float(err.max()) > 0                            # it is rounded


@pytest.mark.parametrize("kv", DTYPES)
def test_cache_write_round_trip_is_within_the_bound(checkpoint, kv):
    """Layer 0's keys and values depend on the embeddings only: the unquantized model's cache holds
    the exact vectors the quantized model's cache rounded."""
    ckpt = checkpoint("llama")
    full, quant = load(ckpt, batch_size=2), load(ckpt, batch_size=2, kv_cache_dtype=kv)
    prompts = [torch.tensor(prompt_ids(13, 1)), torch.tensor(prompt_ids(7, 2))]
    for m in (full, quant):
        m.prefill(prompts, m.sampling_params())
    exact, rounded = attentions(full)[0], attentions(quant)[0]
    s, hkv, d = quant.n_positions, 2, ckpt.hf.config.head_dim
    assert rounded.k_cache.shape == (2, s, hkv, d) and rounded.k_cache.dtype == storage_dtype(kv)
    assert rounded.k_scale.shape == rounded.v_scale.shape == (2, s, hkv) and rounded.v_scale.dtype == torch.float32
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        for x, q, scale in ((exact.k_cache, rounded.k_cache, rounded.k_scale),
                            (exact.v_cache, rounded.v_cache, rounded.v_scale)):
            x, q, scale = x[row, :n], q[row, :n], scale[row, :n]
            qmax = {"int8": 127, "fp8_e4m3": 448}[kv]
            torch.testing.assert_close(scale, x.abs().amax(-1) / qmax, atol=0, rtol=1e-5)
            assert bool(((dequantize_kv(q, scale, torch.float32) - x).abs() <= error_bound(x, scale, kv)).all())
    assert not bool(rounded.k_scale[:, 16:].any())     # slots past the context bucket (16) keep zero scales


@pytest.mark.parametrize("kv", DTYPES)
def test_prefill_logits_close_to_the_unquantized_model(checkpoint, kv):
    """Tolerance: half of the logit error bound the format gives, not a fit to the data. A key error
    of δ moves a score by q·δ/√D; int8's δ is at most 1/254 of a vector's largest element, fp8's 1/16
    of each element, so fp8 may err ~16x more. Measured on these prompts: int8 <= 0.05, fp8 <= 0.25,
    with logits of std ~1.2 — a wrong row or scale gives errors of the logits' own size."""
    ckpt = checkpoint("llama")
    full, quant = load(ckpt), load(ckpt, kv_cache_dtype=kv)
    tolerance = {"int8": 0.12, "fp8_e4m3": 0.6}[kv]
    for n, seed in ((9, 5), (30, 6)):
        prompt = [torch.tensor(prompt_ids(n, seed))]
        ref = full.prefill(prompt, full.sampling_params()).logits[0, -1]
        got = quant.prefill(prompt, quant.sampling_params()).logits[0, -1]
        diff = float((got - ref).abs().max())
        assert 1e-4 < diff < tolerance, diff               # rounded, but close


# ----------------------------------------------------------------------------- exactness of speculation
@pytest.mark.parametrize("kv", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculation_equals_the_kv_quantized_target(checkpoint, kv, batch):
    ckpt = checkpoint("llama")
    target = load(ckpt, batch_size=batch, kv_cache_dtype=kv)
    prompts = [prompt_ids(5, 1), [5, 6, 7, 5, 6, 7, 5, 6], prompt_ids(12, 3)][:batch]
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    draft = DraftModel.from_pretrained(checkpoint("llama-draft").path, target)
    assert draft.model.settings.kv_cache_dtype == kv                          # the draft inherits it
    assert all(a.k_cache.dtype == storage_dtype(kv) for a in attentions(draft.model))
    for proposer, k in ((draft, 3), (PromptLookup(target), 4)):
        gen = SpeculativeGenerator(proposer, target, k)
        assert torch.equal(gen.generate(prompts, max_new_tokens=30, eos_token_id=[]), reference)
        assert gen.last_stats.drafted > 0


def test_eagle_draft_inherits_the_kv_cache_dtype(tmp_path):
    _, eagle = saved_target_and_eagle(tmp_path)
    target = load(tmp_path / "target", batch_size=3, kv_cache_dtype="int8")
    draft = EagleDraft.from_pretrained(eagle, target, progress=False)
    assert all(a.k_cache.dtype == torch.int8 and a.k_scale.dtype == torch.float32 for a in attentions(draft.model))
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    reference = target.generate(prompts, max_new_tokens=30, eos_token_id=[])
    assert torch.equal(SpeculativeGenerator(draft, target, 3).generate(prompts, max_new_tokens=30, eos_token_id=[]),
                       reference)


def prefill_reference(model: DecoderModel):
    """An ``hf``-like callable for ``lossless_pvalue``: ids [N, L] → ``.logits`` [N, 1, V], the prefill
    logits of each row's last token from ``model`` (its own quantized KV cache), ``batch_size`` rows
    at a time."""
    def logits(ids: torch.Tensor) -> SimpleNamespace:
        params = model.sampling_params(do_sample=False)
        chunks = [ids[i:i + model.batch_size] for i in range(0, len(ids), model.batch_size)]
        return SimpleNamespace(logits=torch.cat([model.prefill(list(c), params).logits[:len(c)] for c in chunks]))
    return logits


@pytest.mark.parametrize("kv", DTYPES)
def test_sampling_with_kv_quantized_target_and_draft_is_lossless(tmp_path_factory, kv):
    """The reference is the KV-quantized model's own target-only distribution (each prefix's prefill
    logits): what speculation must reproduce exactly."""
    _, target_dir = save_tiny(tmp_path_factory, "kt", 2, 3, vocab=VOCAB)
    _, draft_dir = save_tiny(tmp_path_factory, "kd", 1, 4, vocab=VOCAB)
    kw = dict(n_positions=32, context_buckets=[8], kv_buckets=[32], backend="eager", progress=False,
              kv_cache_dtype=kv)
    target = DecoderModel.from_pretrained(target_dir, batch_size=512, **kw)
    gen = SpeculativeGenerator(DecoderModel.from_pretrained(draft_dir, batch_size=512, **kw), target, 2)
    reference = prefill_reference(DecoderModel.from_pretrained(target_dir, batch_size=VOCAB, **kw))
    assert lossless_pvalue(reference, target, gen, dict(temperature=0.8), 2) > 1e-3   # 20,480 samples
    assert 0.05 < gen.stats.acceptance_rate < 0.95


# ----------------------------------------------------------------------------- cache rows and slots
def test_single_row_context_encoding_writes_and_reads_its_own_row(checkpoint):
    ckpt = checkpoint("llama")
    model = load(ckpt, batch_size=3, kv_cache_dtype="int8")
    params = model.sampling_params()
    model.prefill([torch.tensor(prompt_ids(n, 10 + n)) for n in (20, 25, 30)], params)
    before = [[b.clone() for b in a.cache_buffers()] for a in attentions(model)]
    prompt = torch.tensor(prompt_ids(11, 40))
    logits = model.prefill([prompt], params, rows=[1]).logits[0, -1]
    fresh = load(ckpt, kv_cache_dtype="int8")
    torch.testing.assert_close(logits, fresh.prefill([prompt], params[:1]).logits[0, -1], atol=1e-4, rtol=1e-4)
    for a, old in zip(attentions(model), before):
        for new, previous in zip(a.cache_buffers(), old):
            assert torch.equal(new[[0, 2]], previous[[0, 2]])             # other rows untouched
            assert not torch.equal(new[1, :11], previous[1, :11])         # row 1 rewritten, scales too
    assert len(before[0]) == 4


def test_kv_compaction_moves_the_scales_with_the_slots(checkpoint):
    model = load(checkpoint("llama"), batch_size=2, kv_cache_dtype="fp8_e4m3")
    model.prefill([torch.tensor(prompt_ids(12, 1)), torch.tensor(prompt_ids(12, 2))], model.sampling_params())
    before = [[b.clone() for b in a.cache_buffers()] for a in attentions(model)]
    src, dst = torch.tensor([[3, 7], [9, 2]]), torch.tensor([[4, 5], [5, 6]])
    model.copy_cache_slots(src, dst)
    rows = torch.arange(2).unsqueeze(1)
    for a, old in zip(attentions(model), before):
        for new, previous in zip(a.cache_buffers(), old):
            # compared as bytes: torch 2.9's CPU indexing has no float8 kernel
            assert torch.equal(new.view(torch.uint8)[rows, dst], previous.view(torch.uint8)[rows, src])


def tp_kv_quantized(path: str, prompts: list[list[int]]) -> dict:
    out = {}
    for kv in DTYPES:
        target = load(path, batch_size=2, tp_degree=2, kv_cache_dtype=kv)
        attn = target.lm.model.layers[0].self_attn
        out[kv] = {"tokens": target.generate(prompts, max_new_tokens=20, eos_token_id=[]).tolist(),
                   "k_scale": attn.k_scale.clone(), "heads": target.lm.layout.kv_index[:attn.n_kv]}
    return out


def test_tp2_kv_quantized_equals_tp1_kv_quantized(checkpoint):
    """Each rank quantizes its own KV heads: rank 0's scales are the unsharded model's for its heads."""
    ckpt = checkpoint("llama")
    prompts = [prompt_ids(6, 7), prompt_ids(10, 8)]
    tp2 = launch(tp_kv_quantized, 2, str(ckpt.path), prompts, timeout_s=300)
    for kv in DTYPES:
        tp1 = load(ckpt, batch_size=2, kv_cache_dtype=kv)
        assert tp2[kv]["tokens"] == tp1.generate(prompts, max_new_tokens=20, eos_token_id=[]).tolist()
        rank0 = tp2[kv]["k_scale"]
        assert rank0.shape == (2, tp1.n_positions, len(tp2[kv]["heads"])) == (2, tp1.n_positions, 1)
        torch.testing.assert_close(rank0, tp1.lm.model.layers[0].self_attn.k_scale[:, :, list(tp2[kv]["heads"])],
                                   atol=1e-6, rtol=1e-4)


# ----------------------------------------------------------------------------- graphs, settings
@pytest.mark.parametrize("kv", DTYPES)
def test_kv_quantized_graphs_export_and_compile(checkpoint, kv):
    ckpt = checkpoint("llama")
    model = load(ckpt, batch_size=2, n_positions=32, context_buckets=[16], kv_buckets=[32], kv_cache_dtype=kv)
    for key in model.graph_keys(do_sample=False, spec_tokens=(4,)):        # context, one token, verify
        exported = model.export(key)
        check_export(model, lambda _: exported, key)  # noqa: B023  (called at once)
    mutated = set(exported.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert mutated == {f"lm.model.layers.{i}.self_attn.{which}_{part}" for i in range(2) for which in "kv"
                       for part in ("cache", "scale")}
    # f32: Inductor's quantization is bit-exact to eager's and its other kernels differ by ~2e-6, far
    # below the KV rounding itself (>= 0.02 on these logits); in bf16 the compiled kernels' different
    # rounding of K/V can move a value across an 8-bit step, so a bf16 comparison says less
    eager, compiled = (load(ckpt, kv_cache_dtype=kv, backend=b) for b in ("eager", "compiled"))
    prompt = torch.tensor(prompt_ids(9, 2))
    prefill = [m.prefill([prompt], m.sampling_params()).logits for m in (eager, compiled)]
    step = [m.step(torch.tensor([[7]]), m.sampling_params()).logits for m in (eager, compiled)]
    for a, b in (prefill, step):                                  # context encoding, one-token step
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert all(attn.v_cache.dtype == storage_dtype(kv) for attn in attentions(compiled))


def test_saved_settings_keep_the_kv_cache_dtype(checkpoint, tmp_path):
    model = load(checkpoint("llama"), kv_cache_dtype="fp8")
    assert model.settings.kv_cache_dtype == "fp8_e4m3"
    model.save(tmp_path)
    assert DecoderModel.load(tmp_path, progress=False).settings.kv_cache_dtype == "fp8_e4m3"
    meta = json.loads((tmp_path / "specdec.json").read_text())
    del meta["settings"]["kv_cache_dtype"]                     # saved by a version without the option
    (tmp_path / "specdec.json").write_text(json.dumps(meta))
    old = DecoderModel.load(tmp_path, progress=False)
    assert old.settings.kv_cache_dtype is None and attentions(old)[0].k_cache.dtype == torch.float32


# ----------------------------------------------------------------------------- names and errors
@pytest.mark.parametrize("name,canonical", [(None, None), ("auto", None), ("int8", "int8"), ("fp8", "fp8_e4m3"),
                                            ("fp8_e4m3", "fp8_e4m3")])
def test_kv_cache_dtype_names(name, canonical):
    assert parse_kv_cache_dtype(name) == canonical


@pytest.mark.parametrize("name", ["int4", "fp8_e5m2", "bf16", "none"])
def test_unsupported_kv_cache_dtype_is_a_clear_error(checkpoint, name):
    message = f"kv_cache_dtype='{name}' is not supported: use None .*'int8' or 'fp8_e4m3' \\(alias 'fp8'\\)"
    with pytest.raises(ValueError, match=message):
        load(checkpoint("llama"), kv_cache_dtype=name)
    from specdec.tools.plan import plan_capacity
    with pytest.raises(ValueError, match=message):
        plan_capacity(checkpoint("llama").path, batch_size=1, n_positions=64, amp="bf16", platform="cpu:1",
                      kv_cache_dtype=name)


# ----------------------------------------------------------------------------- planner
LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)


def test_planner_counts_the_quantized_kv_bytes(checkpoint):
    from specdec.tools.plan import plan_capacity
    kw = dict(batch_size=4, n_positions=8192, amp="bf16", platform="gpu:80", cores=2)
    plans = {kv: plan_capacity(LLAMA_8B, kv_cache_dtype=kv, **kw) for kv in (None, "int8", "fp8_e4m3")}
    elems = 2 * 32 * 4 * 8192 * 8 * 128
    assert plans[None].model.kv_bytes == 2 * elems
    for kv in DTYPES:
        plan = plans[kv]
        assert plan.model.kv_bytes == elems + elems // 128 * 4                    # 1 byte + 4 per (slot, head)
        assert 0.5 < plan.model.kv_bytes / plans[None].model.kv_bytes < 0.52     # about half of bf16's
        assert plan.model.weight_bytes == plans[None].model.weight_bytes
        assert plan.degree(2).kv_bytes_per_core == plan.model.kv_bytes // 2     # 4 KV heads per core
    # the runtime holds exactly what the planner and ModelConfig count (f32 compute, tiny model)
    ckpt = checkpoint("llama")
    model = load(ckpt, batch_size=2, n_positions=64, kv_buckets=[64], kv_cache_dtype="int8")
    held = sum(b.numel() * b.element_size() for a in attentions(model) for b in a.cache_buffers())
    plan = plan_capacity(ckpt.path, batch_size=2, n_positions=64, amp="f32", platform="cpu:1", kv_cache_dtype="int8")
    assert held == plan.model.kv_bytes == model.config.kv_bytes(torch.float32, 2, 64, "int8")
    assert model.config.kv_bytes(torch.bfloat16, 2, 64) == 2 * 2 * 2 * 64 * 2 * 16 * 2


def test_plan_command_option(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    argv = ["plan", str(tmp_path), "--n-positions", "8192", "--batch-size", "4", "--platform", "gpu:80", "--json"]
    assert main(argv) == 0
    full = json.loads(capsys.readouterr().out)
    assert main(argv + ["--kv-cache-dtype", "int8"]) == 0
    quant = json.loads(capsys.readouterr().out)
    assert quant["request"]["kv_cache_dtype"] == "int8" and full["request"]["kv_cache_dtype"] is None
    assert quant["model"]["kv_bytes"] < 0.52 * full["model"]["kv_bytes"]
    assert main(argv[:-1] + ["--kv-cache-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert "(fp8_e4m3 + scales, batch 4 × 8192 positions)" in out


# ----------------------------------------------------------------------------- command line
@pytest.fixture
def loads(monkeypatch):
    """The ``kv_cache_dtype`` of every ``DecoderModel.from_pretrained`` call, in order."""
    seen = []
    original = DecoderModel.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("kv_cache_dtype"))
        return original(cls, *args, **kwargs)
    monkeypatch.setattr(DecoderModel, "from_pretrained", classmethod(spy))
    return seen


def test_generate_option_is_passed_to_target_and_draft(checkpoint, loads, capsys):
    ckpt, prompt = checkpoint("llama"), prompt_ids(9, 3)
    argv = ["generate", "--prompt-ids", ",".join(map(str, prompt)), "--model", str(ckpt.path), "--backend", "eager",
            "--amp", "f32", "--n-positions", "64", "--max-new-tokens", "20", "--ignore-eos", "--threads", "1",
            "--kv-cache-dtype", "fp8_e4m3", "--draft", "model", "--draft-path", str(checkpoint("llama-draft").path)]
    assert main(argv) == 0
    tokens = [int(t) for t in capsys.readouterr().out.strip().splitlines()[-1].split(",")]
    assert loads == ["fp8_e4m3", "fp8_e4m3"]                                  # the target, then the draft
    model = DecoderModel.from_pretrained(ckpt.path, n_positions=64, backend="eager", progress=False,
                                         kv_cache_dtype="fp8_e4m3")
    assert tokens == model.generate([prompt], max_new_tokens=20, eos_token_id=[])[0, len(prompt):].tolist()


def test_serve_option_is_passed_to_the_engine(checkpoint, loads):
    args = build_parser().parse_args(["serve", "--model", str(checkpoint("llama").path), "--backend", "eager",
                                      "--amp", "f32", "--n-positions", "64", "--batch-size", "2",
                                      "--kv-cache-dtype", "int8"])
    engine = load_engine(options_from(ServeOptions, args))
    assert loads == ["int8"] and engine.target.settings.kv_cache_dtype == "int8"
    assert build_parser().parse_args(["serve"]).kv_cache_dtype is None


def test_bad_option_value_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "--prompt-ids", "1,2", "--kv-cache-dtype", "fp4"])
    assert e.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp4' (choose from" in capsys.readouterr().err
