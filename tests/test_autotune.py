"""``autotune=True`` (the compiled backend on the CPU): graphs compiled with the weights frozen in and
each matmul's kernel chosen by timing (``graphs.AUTOTUNE_OPTIONS``) compute the model's function —
f32 greedy tokens equal transformers', logits equal eager's to float tolerance, int8 / int4 (bf16)
logits equal the untuned graphs' to bf16 tolerance (their prefill graph only: every compiled graph is
tuned anew, minutes on two cores) — and speculation on an autotuned target is exact with respect to it;
the setting travels to drafts and through save / load; clear errors."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.compiler._cache import CacheArtifactManager

from specdec import DecoderModel, DraftModel, PromptLookup, SpeculativeGenerator

from conftest import checkpoint, hf_greedy, load, prompt_ids  # noqa: F401  (fixture)

SHAPES = dict(n_positions=64, context_buckets=[16], kv_buckets=[64])
N_NEW = 24
PROMPTS = [prompt_ids(9, seed=81), [5, 6, 7, 5, 6, 7, 5, 6, 7]]


@pytest.fixture
def cold_cache(tmp_path, monkeypatch):
    """An empty compile cache: every graph is compiled (and its kernels tuned) in the test; afterwards
    the process's record of compiled artifacts (what ``save`` writes) forgets them again."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    CacheArtifactManager.clear()


def test_autotune_errors(checkpoint):
    ckpt = checkpoint("llama")
    with pytest.raises(ValueError, match="autotune=True tunes the 'compiled' backend.*backend='eager'"):
        load(ckpt, backend="eager", autotune=True, **SHAPES)
    with pytest.raises(ValueError, match="autotune must be True or False"):
        load(ckpt, backend="compiled", autotune="yes", **SHAPES)


def test_autotuned_f32_graphs_compute_the_model_and_speculation_is_exact(checkpoint, cold_cache, tmp_path):
    ckpt = checkpoint("llama")
    target = load(ckpt, backend="compiled", autotune=True, batch_size=2, **SHAPES)
    reference = target.generate(PROMPTS, max_new_tokens=N_NEW, eos_token_id=[])
    for row, p in enumerate(PROMPTS):
        assert reference[row, len(p):].tolist() == hf_greedy(ckpt.hf, p, N_NEW)
    params = target.sampling_params(do_sample=False)
    prompts = [torch.tensor(p) for p in PROMPTS]
    eager = load(ckpt, batch_size=2, **SHAPES)
    torch.testing.assert_close(target.prefill(prompts, params).logits, eager.prefill(prompts, params).logits,
                               atol=1e-4, rtol=1e-4)
    gen = SpeculativeGenerator(PromptLookup(target), target, 4)
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=N_NEW, eos_token_id=[]), reference)
    assert gen.last_stats.accepted > 0


def test_autotune_travels_to_drafts_and_through_save_and_load(checkpoint, tmp_path):
    target = load(checkpoint("llama"), backend="compiled", autotune=True, **SHAPES)
    assert DraftModel.from_pretrained(checkpoint("llama-draft").path, target).model.settings.autotune
    eager_draft = DraftModel.from_pretrained(checkpoint("llama-draft").path, target, backend="eager")
    assert not eager_draft.model.settings.autotune          # it tunes the compiled backend only
    target.save(tmp_path)                                   # no graph built yet: nothing compiles on load
    assert DecoderModel.load(tmp_path, progress=False).settings.autotune


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_autotuned_quantized_graphs_tune_their_kernels(checkpoint, cold_cache, scheme):
    ckpt = checkpoint("llama")
    kw = dict(amp="bf16", quantization=scheme, **SHAPES)
    tuned_before = counters["inductor"]["select_algorithm_autotune"]
    target = load(ckpt, backend="compiled", autotune=True, **kw)
    eager = load(ckpt, **kw)                                 # the same kernels, run one by one
    params = target.sampling_params(do_sample=False)
    prompt = [torch.tensor(PROMPTS[1])]
    torch.testing.assert_close(target.prefill(prompt, params).logits, eager.prefill(prompt, params).logits,
                               atol=0.1, rtol=0.02)
    assert counters["inductor"]["select_algorithm_autotune"] > tuned_before   # kernels were chosen by timing
