"""Medusa heads quantized as their target (``MedusaDraft.from_pretrained`` → ``MedusaHeads.quantize``):
the layers' types, the logits against a float reference on the formats' dequantized values (f32 and
the bf16 CPU kernels), tied heads sharing one int8 projection holding the target LM head's codes,
greedy identity with int8 / int4 targets (batch 1 and 3, mixed prompt lengths), "gguf" leaving the
heads float, and errors. Chi-square losslessness with quantized targets and heads:
``test_medusa.test_sampling_is_lossless`` (parametrised over the schemes)."""
import copy

import pytest
import torch

from specdec import SpeculativeGenerator
from specdec.core.config import module_bytes
from specdec.core.quant import Int8Linear, computed_weight
from specdec.medusa import MedusaHeads, save_heads
from specdec.medusa.draft import MedusaDraft

from conftest import load
from test_medusa import PROMPTS, load_target, models, oracle_heads  # noqa: F401  (fixture)
from test_quantization import LINEAR, SCHEMES, dequantize, dequantized_hf

HIDDEN = 64      # the ``models`` target's hidden size and vocabulary


def random_heads(hidden: int, vocab: int, num_heads: int = 4, *, lm_head: torch.Tensor | None = None,
                 token_ids: torch.Tensor | None = None, seed: int = 0) -> MedusaHeads:
    """``num_heads`` float heads x 2 ResBlocks with random weights and biases; untied projections random
    too, tied ones (``lm_head`` [V', H] rows, ``token_ids`` [V']) left as given."""
    tied = lm_head is not None
    heads = MedusaHeads(hidden, vocab, num_heads, 2, lm_head, tied=tied, token_ids=token_ids)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in heads.heads.named_parameters():
            if not (tied and name.endswith(".2.weight")):
                p.copy_((0.3 if name.endswith(".2.weight") else 0.15) * torch.randn(p.shape, generator=g))
    return heads.requires_grad_(False)


def dequantized_heads(heads: MedusaHeads, scheme: str) -> MedusaHeads:
    """A float copy of ``heads`` holding the values they compute with once quantized with ``scheme``:
    ResBlock weights rounded with the scheme, projections at int8 (the formats' definitions)."""
    ref = copy.deepcopy(heads)
    with torch.no_grad():
        for head in ref.heads:
            for block in head[:-1]:
                block.linear.weight.copy_(dequantize(block.linear.weight, scheme))
            # rebinds this head's Parameter only: a tied copy's other heads keep the float one to round
            head[-1].weight = torch.nn.Parameter(dequantize(head[-1].weight, "int8"), requires_grad=False)
    return ref


def loaded(heads: MedusaHeads, target, directory, tree: str = "small_8") -> MedusaDraft:
    """``heads`` through the FasterDecoding layout and ``MedusaDraft.from_pretrained`` for ``target``."""
    save_heads(heads, directory)
    return MedusaDraft.from_pretrained(directory, target, tree=tree)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_heads_are_quantized_as_the_target(models, tmp_path, scheme, tied):
    _, root = models
    target = load_target(root / "target", quantization=scheme)
    token_ids = torch.arange(0, HIDDEN, 2)
    # tied heads project with the target's head as it computes (its int8 values), restricted to token_ids
    heads = random_heads(HIDDEN, 32, lm_head=computed_weight(target.lm.lm_head)[token_ids], token_ids=token_ids) \
        if tied else random_heads(HIDDEN, HIDDEN)
    quantized = loaded(heads, target, tmp_path).heads
    assert quantized.quantized and quantized.dtype == torch.float32
    assert all(isinstance(block.linear, LINEAR[scheme]) for head in quantized.heads for block in head[:-1])
    assert all(isinstance(head[-1], Int8Linear) for head in quantized.heads)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1))
    logits = quantized(x)
    assert logits.shape == (2, 5, 4, heads.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, dequantized_heads(heads, scheme)(x), atol=1e-4, rtol=1e-4)
    assert float((logits - heads(x)).abs().max()) > 1e-2            # the rounding shows: this can fail
    assert module_bytes(quantized) < 0.3 * module_bytes(heads)
    if tied:
        projection = quantized.heads[0][-1]
        assert all(head[-1] is projection for head in quantized.heads)   # one module, as one Parameter before
        assert torch.equal(projection.weight, target.lm.lm_head.weight[token_ids])   # the target head's codes
        torch.testing.assert_close(projection.scale, target.lm.lm_head.scale[token_ids], atol=0, rtol=1e-6)
        assert torch.equal(quantized.candidates(x[:, 0], 5) % 2, torch.zeros(2, 4, 5, dtype=torch.long))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bf16_heads_run_the_cpu_kernels(models, tmp_path, scheme):
    """bf16: the int8 projections run ``aten._weight_int8pack_mm`` (hidden states cast to the compute
    dtype, not to the int8 codes') and give the f32 quantized heads' logits up to bf16 rounding."""
    _, root = models
    heads = random_heads(HIDDEN, HIDDEN)
    bf16 = loaded(heads, load_target(root / "target", quantization=scheme, amp="bf16"), tmp_path / "bf16").heads
    assert bf16.dtype == torch.bfloat16 and isinstance(bf16.heads[1][-1], Int8Linear)
    assert bf16.heads[1][-1].weight.dtype == torch.int8
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(2))
    reference = dequantized_heads(heads, scheme)(x)
    logits = bf16(x)
    assert logits.dtype == torch.float32
    assert float((logits - reference).abs().max()) < 0.05 * float(reference.abs().max())


@pytest.mark.parametrize("resblock_std", [0.0, 0.03], ids=["oracle", "perturbed"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_with_quantized_heads_equals_the_quantized_target(models, tmp_path, scheme, resblock_std):
    hf, root = models
    target = load_target(root / "target", quantization=scheme)
    # oracle heads for the quantized model (its own next-token map), their ResBlocks random (perturbed:
    # quantized ResBlocks at work, fewer drafts accepted) or the identity
    heads = oracle_heads(dequantized_hf(hf, scheme), 4, 0.0, seed=2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for head in heads.heads:
            head[0].linear.weight.copy_(resblock_std * torch.randn(HIDDEN, HIDDEN, generator=g))
    draft = loaded(heads, target, tmp_path, tree="mc_sim_7b_63")
    assert draft.heads.quantized
    gen = SpeculativeGenerator(draft, target)
    reference = target.generate(PROMPTS, max_new_tokens=60, eos_token_id=[])
    assert torch.equal(gen.sample(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    assert gen.last_stats.acceptance_rate > (0.9 if resblock_std == 0 else 0.1), gen.last_stats
    one = gen.sample([PROMPTS[2]], max_new_tokens=60, eos_token_id=[])
    width = max(map(len, PROMPTS))
    assert torch.equal(one[0, len(PROMPTS[2]):], reference[2, width:])


def test_gguf_target_leaves_heads_float(tmp_path, monkeypatch):
    """"gguf" quantizes nothing more: the heads stay float; tied heads take the GGUF head's computed
    weight (its Q8_0 blocks' values)."""
    pytest.importorskip("gguf")
    from tiny_gguf import HIDDEN as GGUF_HIDDEN
    from tiny_gguf import VOCAB as GGUF_VOCAB
    from tiny_gguf import write_tiny_gguf
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    target = load(write_tiny_gguf(tmp_path / "target.gguf", seed=0), quantization="gguf")
    x = torch.randn(3, GGUF_HIDDEN, generator=torch.Generator().manual_seed(4))
    untied = random_heads(GGUF_HIDDEN, GGUF_VOCAB)
    heads = loaded(untied, target, tmp_path / "untied").heads
    assert not heads.quantized and torch.equal(heads(x), untied(x))
    token_ids = torch.arange(0, GGUF_VOCAB, 4)
    head_rows = computed_weight(target.lm.lm_head)[token_ids]
    tied = loaded(random_heads(GGUF_HIDDEN, len(token_ids), lm_head=head_rows, token_ids=token_ids), target,
                  tmp_path / "tied").heads
    assert not tied.quantized and torch.equal(tied.heads[2][-1].weight, head_rows)


def test_errors(tmp_path):
    # int4 on a hidden size its kernel cannot take is an error naming the way out, not a silent int8
    with pytest.raises(ValueError, match="divisible by 16 .* use quantization='int8'"):
        MedusaHeads(48, 64, 2).quantize("int4")
    with pytest.raises(ValueError, match="quantized Medusa heads cannot be saved"):
        save_heads(MedusaHeads(64, 64, 2).quantize("int8"), tmp_path)
