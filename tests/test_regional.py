"""backend="regional" (``graphs.compile_layers``): the decoder layers run torch.compile'd code, compiled
once per graph shape for all the layers of one structure, the rest eager. It computes what eager
computes (greedy tokens equal eager's and transformers', logits to float tolerance, speculation exact),
layers of different structure never share code (a model whose layers mix weight formats), and the
runners are built once per model; compiled reductions are row-invariant (a row's RMSNorm has the same
bits in a decode step and in a verify step)."""
from __future__ import annotations

import pytest
import torch

from specdec import PromptLookup, SpeculativeGenerator
from specdec.core.graphs import COMPILE_OPTIONS, LayerRunner, compile_layers, layer_signature
from specdec.core.model import rms_norm
from specdec.core.quant import Int8Linear

from conftest import checkpoint, hf_greedy, load, prompt_ids  # noqa: F401  (fixture)

SHAPES = dict(n_positions=64, context_buckets=[16], kv_buckets=[64])
N_NEW = 24
PROMPTS = [prompt_ids(9, seed=81), [5, 6, 7, 5, 6, 7, 5, 6, 7]]


@pytest.fixture
def cold_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_regional_graphs_compute_the_model_and_speculation_is_exact(checkpoint, cold_cache):
    ckpt = checkpoint("llama")
    model = load(ckpt, backend="regional", batch_size=2, **SHAPES)
    out = model.generate(PROMPTS, max_new_tokens=N_NEW, eos_token_id=[])
    for row, p in enumerate(PROMPTS):
        assert out[row, len(p):].tolist() == hf_greedy(ckpt.hf, p, N_NEW)
    runners = model.lm.layer_runners
    assert len(runners) == model.config.num_layers and len(set(map(id, runners))) == 1   # one code for all
    assert isinstance(runners[0], LayerRunner) and len(runners[0]) >= 2     # prefill and decode shapes
    eager = load(ckpt, batch_size=2, **SHAPES)
    params = model.sampling_params(do_sample=False)
    prompts = [torch.tensor(p) for p in PROMPTS]
    torch.testing.assert_close(model.prefill(prompts, params).logits, eager.prefill(prompts, params).logits,
                               atol=1e-4, rtol=1e-4)
    gen = SpeculativeGenerator(PromptLookup(model), model, 4)
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=N_NEW, eos_token_id=[]), out)
    assert gen.last_stats.accepted > 0


def test_layers_of_different_structure_get_code_of_their_own(checkpoint, cold_cache):
    """Layer 1's MLP projections become int8 (another module, other buffers): it gets a runner of its own,
    and the logits equal eager's on the same mixed model (shared code would run layer 1 as float)."""
    ckpt = checkpoint("llama")
    models = [load(ckpt, backend=backend, **SHAPES) for backend in ("eager", "regional")]
    for model in models:
        mlp = model.lm.model.layers[1].mlp
        for name in ("gate_up_proj", "down_proj"):
            if getattr(mlp, name) is not None:
                setattr(mlp, name, Int8Linear.from_linear(getattr(mlp, name)))
    layers = models[1].lm.model.layers
    assert layer_signature(layers[0]) != layer_signature(layers[1])
    params = models[0].sampling_params(do_sample=False)
    eager, regional = (m.prefill([torch.tensor(PROMPTS[0])], params).logits for m in models)
    torch.testing.assert_close(regional, eager, atol=1e-4, rtol=1e-4)
    runners = models[1].lm.layer_runners
    assert runners[0] is not runners[1]
    compile_layers(models[1].lm)                           # once per model: the runners stay
    assert models[1].lm.layer_runners is runners


def test_signature_sees_attributes_and_tensor_shapes(checkpoint):
    layers = load(checkpoint("llama"), **SHAPES).lm.model.layers
    assert layer_signature(layers[0]) == layer_signature(layers[1])
    layers[1].self_attn.kv_cache_dtype = "int8"            # a plain attribute the code branches on
    assert layer_signature(layers[0]) != layer_signature(layers[1])
    layers[1].self_attn.kv_cache_dtype = layers[0].self_attn.kv_cache_dtype
    layers[1].input_layernorm.weight.data = torch.ones(3)   # a parameter of another shape
    assert layer_signature(layers[0]) != layer_signature(layers[1])


@pytest.mark.parametrize("n", [2, 5, 9, 16])
def test_compiled_norms_are_row_invariant(n):
    """A 1,536-wide RMSNorm feeding a matmul, compiled with the backends' options at two threads: each row's
    norm is bitwise the same alone (a decode step) as among n rows (a verify step). With Inductor's default
    chunk the one-row reduction is split between the threads and its last bits differ."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        weight, w = torch.rand(1536) + 0.5, torch.randn(1536, 64)

        def norm_then_matmul(x):
            y = rms_norm(x, weight, 1e-6).reshape(-1, 1536).float().contiguous()
            return y, torch.mm(y, w)
        torch._dynamo.reset()
        f = torch.compile(norm_then_matmul, dynamic=False, options=COMPILE_OPTIONS)
        x = torch.randn(n, 1536, generator=torch.Generator().manual_seed(n)) * 3
        assert torch.equal(f(x)[0], torch.cat([f(x[i:i + 1])[0] for i in range(n)]))
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
