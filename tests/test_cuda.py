"""The CUDA path (skipped without a CUDA device; run on a lent GPU machine): on tiny random checkpoints in f32,
greedy target-only generation equals transformers' greedy generation on the same GPU, and greedy speculation —
a draft model, prompt lookup, the two combined — equals target-only generation token for token, at batch 1 and
3, on the eager backend; the draft model on the compiled one too (``torch.compile`` with CUDA graphs)."""
import pytest
import torch

from specdec import DecoderModel, DraftModel, LookupOrDraft, PromptLookup, SpeculativeGenerator

from test_speculative import save_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the lent GPU machine)")

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target_hf, target_dir = save_tiny(tmp_path_factory, "target", 2, 0)
    _, draft_dir = save_tiny(tmp_path_factory, "draft", 1, 1)
    return target_hf.to("cuda"), target_dir, draft_dir


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_greedy_speculation_on_cuda_equals_target_only(tiny, backend):
    """Every proposer on eager; the draft model on compiled (one KV bucket: few graphs to compile)."""
    target_hf, target_dir, draft_dir = tiny
    kw = dict(device="cuda", backend=backend, n_positions=128, kv_buckets=[128], context_buckets=[16],
              progress=False)
    target = DecoderModel.from_pretrained(target_dir, batch_size=3, **kw)
    assert target.lm.lm_head.weight.device.type == "cuda"
    reference = target.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    width = max(map(len, PROMPTS))          # list-of-lists prompts are right-padded in the output
    hf = target_hf.generate(torch.tensor([PROMPTS[0]], device="cuda"), max_new_tokens=NEW, do_sample=False)
    assert torch.equal(reference[0, width:].cpu(), hf[0, len(PROMPTS[0]):].cpu())
    draft = DraftModel.from_pretrained(draft_dir, target)
    proposers = [draft] if backend == "compiled" else [draft, PromptLookup(target),
                                                        LookupOrDraft(PromptLookup(target), draft)]
    for proposer in proposers:
        out = SpeculativeGenerator(proposer, target, 4).generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
        assert torch.equal(out.cpu(), reference.cpu()), type(proposer).__name__
    if backend == "eager":
        single = DecoderModel.from_pretrained(target_dir, batch_size=1, **kw)
        one = SpeculativeGenerator(DraftModel.from_pretrained(draft_dir, single), single, 4).generate(
            [PROMPTS[2]], max_new_tokens=NEW, eos_token_id=[])
        assert torch.equal(one[0, len(PROMPTS[2]):].cpu(), reference[2, width:].cpu())
