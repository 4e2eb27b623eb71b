"""The ``xla`` backend on XLA:CPU: greedy output equal to the eager backend for target-only generation
and every strategy (batch 1 and 3), one compile per graph (none after warm-up), no op falling back to
the CPU, the KV caches aliased input → output in the compiled decode / verify / compaction graphs.

Runs in the environment with torch-xla (``.ci/run`` builds it as ``.venv-xla``; ``pytest -m xla``);
skipped where ``torch_xla`` is not installed.
"""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402

from specdec import DecoderModel, DraftModel, EagleDraft, MedusaDraft, PromptLookup, SpeculativeGenerator  # noqa: E402
from specdec.core.graphs import CacheCompaction, GraphKey  # noqa: E402
from specdec.medusa import load_tree  # noqa: E402

from test_eagle import saved_target_and_eagle, tiny_target  # noqa: E402
from test_medusa import oracle_heads, token_map_target  # noqa: E402

pytestmark = pytest.mark.xla

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW = 24
STRATEGIES = ["target", "draft", "eagle", "medusa", "lookup"]


def load(path, backend: str, batch_size: int) -> DecoderModel:
    return DecoderModel.from_pretrained(path, backend=backend, batch_size=batch_size, n_positions=128,
                                        context_buckets=[16], kv_buckets=[32, 64, 128], progress=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("xla")
    target, eagle = saved_target_and_eagle(root)
    tiny_target(1, layers=1).save_pretrained(root / "draft")
    medusa_target = token_map_target(0, 64, 64)
    medusa_target.save_pretrained(root / "medusa-target")
    return {"target": target, "eagle": eagle, "draft": root / "draft", "medusa-target": root / "medusa-target",
            "heads": oracle_heads(medusa_target, 4, 2.5, 0)}


def generator(kind: str, target: DecoderModel, paths: dict):
    """A callable generating on ``target`` with strategy ``kind`` (``generate``'s arguments)."""
    if kind == "target":
        return target.generate
    if kind == "draft":
        proposer, k = DraftModel.from_pretrained(paths["draft"], target, progress=False), 3
    elif kind == "eagle":
        proposer, k = EagleDraft.from_pretrained(paths["eagle"], target, progress=False), 3
    elif kind == "medusa":
        heads = copy.deepcopy(paths["heads"])        # MedusaDraft moves its heads to the target's device
        proposer, k = MedusaDraft(heads, load_tree("small_8", num_heads=4), target), None
    else:
        proposer, k = PromptLookup(target), 3
    return SpeculativeGenerator(proposer, target, k).generate


def target_path(kind: str, paths: dict) -> Path:
    return paths["medusa-target" if kind == "medusa" else "target"]


def compiles() -> int:
    data = met.metric_data("CompileTime")
    return 0 if data is None else data[0]


def fallback_ops() -> list[str]:
    """Ops that ran on the CPU because XLA has no lowering for them (PyTorch/XLA counts each as
    ``aten::<op>``)."""
    return [name for name in met.counter_names() if name.startswith("aten::")]


@pytest.mark.parametrize("kind", STRATEGIES)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_equals_eager_compiles_once_no_fallback(checkpoints, kind, batch_size):
    prompts = PROMPTS[:batch_size] if batch_size == 3 else [PROMPTS[2]]
    path = target_path(kind, checkpoints)
    reference = generator(kind, load(path, "eager", batch_size), checkpoints)(prompts, max_new_tokens=NEW,
                                                                              eos_token_id=[])
    run = generator(kind, load(path, "xla", batch_size), checkpoints)
    met.clear_counters()
    outputs, compiled = [], []
    for _ in range(3):      # 1st: every graph compiles; 2nd: host-side glue settles; 3rd: nothing compiles
        before = compiles()
        outputs.append(run(prompts, max_new_tokens=NEW, eos_token_id=[]).cpu())
        compiled.append(compiles() - before)
    for out in outputs:
        assert torch.equal(out, reference)
    assert compiled[0] > 0 and compiled[2] == 0, compiled
    assert fallback_ops() == []


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_seeded_sampling_equals_eager(checkpoints, kind):
    """The rows' random streams are drawn on the host for XLA (no torch.Generator there), so a seeded
    sampled run draws the same noise as on the CPU and, with logits equal to ~1e-6, the same tokens."""
    path, kw = checkpoints["target"], dict(max_new_tokens=NEW, eos_token_id=[], do_sample=True, temperature=0.8,
                                           top_k=20, top_p=0.9, seed=7)
    reference = generator(kind, load(path, "eager", 3), checkpoints)(PROMPTS, **kw)
    assert torch.equal(generator(kind, load(path, "xla", 3), checkpoints)(PROMPTS, **kw).cpu(), reference)


def test_each_graph_key_compiles_once(checkpoints):
    """compile() builds every bucket's graph; repeating a workload (each graph on views and on plain
    tensors) compiles nothing the second time; a second, different trace of a graph is an error, never a
    silent recompilation."""
    model = load(checkpoints["target"], "xla", 2)
    before = compiles()
    model.compile(progress=False, spec_tokens=(3,))
    keys = model.graph_keys(spec_tokens=(3,))
    assert compiles() - before >= len(keys)
    runs = []
    for key in keys:
        inputs = model.graph_module(key).example_inputs(2)               # views (expand) and plain tensors
        runs += [(key, inputs), (key, tuple(t.cpu().to(t.device) for t in inputs))]
    for _ in range(2):
        before = compiles()
        for key, inputs in runs:
            model.graph(key)(*inputs)
    assert compiles() == before
    with pytest.raises(RuntimeError, match="different graphs"):
        model.graph(keys[0])(*model.graph_module(keys[0]).example_inputs(1))     # one row instead of two


def cache_count(model: DecoderModel) -> int:
    return sum(name.endswith(("k_cache", "v_cache")) for name, _ in model.lm.named_buffers())


def aliases_compiled(run) -> list[int]:
    """The input → output alias count of each program compiled while ``run()`` ran (PyTorch/XLA
    records it when it compiles a program)."""
    before = met.metric_data("InputOutputAliasCount")
    seen = 0 if before is None else len(before[2])
    run()
    return [int(value) for _, value in met.metric_data("InputOutputAliasCount")[2][seen:]]


@pytest.mark.parametrize("key", [GraphKey(1, 1, 32, False), GraphKey(4, 4, 64, True, True)],
                         ids=["decode", "verify"])
def test_kv_caches_are_aliased_outputs(checkpoints, key):
    """The compiled program updates every KV cache in place: one input → output alias per cache buffer
    (batch 4: shapes no other test compiles in this process)."""
    model = load(checkpoints["target"], "xla", 4)
    inputs = model.graph_module(key).example_inputs(4)
    assert cache_count(model) in aliases_compiled(lambda: model.graph(key)(*inputs))


def test_kv_compaction_is_its_own_graph_with_aliased_caches(checkpoints):
    model = load(checkpoints["target"], "xla", 2)
    src, dst = CacheCompaction(model.lm, 3).example_inputs(2)
    reversed_src, reversed_dst = src.flip(1), dst.flip(1)
    torch_xla.sync()
    assert cache_count(model) in aliases_compiled(lambda: model.copy_cache_slots(reversed_src, dst))
    before = compiles()
    model.copy_cache_slots(src, reversed_dst)          # other slots, the same graph
    assert compiles() == before


HLO_SCRIPT = """
import sys, torch
from specdec import DecoderModel
from specdec.core.graphs import GraphKey
model = DecoderModel.from_pretrained(sys.argv[1], backend="xla", batch_size=2, n_positions=128,
                                     context_buckets=[16], kv_buckets=[32, 64, 128], progress=False)
for key in (GraphKey(1, 1, 32, False), GraphKey(4, 4, 64, True, True)):
    model.graph(key)(*model.graph_module(key).example_inputs(2))
"""


def test_hlo_of_decode_and_verify_lists_the_caches_as_aliased_outputs(checkpoints, tmp_path):
    """XLA's own dump of the compiled programs: the decode and the verify graph each carry an
    ``input_output_alias`` entry per KV cache, on parameters of the cache's shape [B, S, Hkv, D]."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text", PJRT_DEVICE="CPU")
    subprocess.run([sys.executable, "-c", HLO_SCRIPT, str(checkpoints["target"])], check=True, env=env,
                   cwd=Path(__file__).parents[1])
    cache = "f32[2,128,2,8]"        # batch 2, n_positions 128, 2 KV heads, head_dim 32 / 4
    aliased = []
    for dump in sorted(tmp_path.glob("*cpu_after_optimizations.txt")):
        header = dump.read_text().splitlines()[0]
        if "input_output_alias" not in header:
            continue
        entries = header.split("input_output_alias={")[1].split("}, entry_computation_layout")[0]
        params = header.split("entry_computation_layout={(")[1].split(")->")[0]
        shapes = [s.split("{")[0].strip() for s in re.sub(r"/\*index=\d+\*/", "", params).split(", ")]
        indices = [int(e.split("(")[1].split(",")[0]) for e in entries.split("), ")]
        aliased.append([shapes[i] if i < len(shapes) else "?" for i in indices])
    big = [a for a in aliased if len(a) == 4]          # 2 layers × (K, V)
    assert len(big) >= 2, aliased                      # the decode and the verify program
    assert all(shape == cache for a in big for shape in a), big


# ---------------------------------------------------------------- fused speculation on XLA
def fused_generator(kind: str, target: DecoderModel, paths: dict) -> SpeculativeGenerator:
    if kind == "draft":
        proposer = DraftModel.from_pretrained(paths["draft"], target, progress=False)
    else:
        proposer = EagleDraft.from_pretrained(paths["eagle"], target, progress=False)
    return SpeculativeGenerator(proposer, target, 3, fused=True)


@pytest.mark.parametrize("kind", ["draft", "eagle"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_fused_step_is_one_graph_equal_to_eager(checkpoints, kind, batch_size):
    """A fused step (draft loop + verify + acceptance) runs as one full_graph XLA program: greedy
    output equals eager, nothing compiles after warm-up, nothing falls back to the CPU."""
    prompts = PROMPTS[:batch_size] if batch_size == 3 else [PROMPTS[2]]
    kw = dict(max_new_tokens=NEW, eos_token_id=[])
    eager = load(checkpoints["target"], "eager", batch_size)
    reference = fused_generator(kind, eager, checkpoints).generate(prompts, **kw)
    gen = fused_generator(kind, load(checkpoints["target"], "xla", batch_size), checkpoints)
    met.clear_counters()
    outputs, compiled = [], []
    for _ in range(3):
        before = compiles()
        outputs.append(gen.generate(prompts, **kw).cpu())
        compiled.append(compiles() - before)
    for out in outputs:
        assert torch.equal(out, reference)
    assert compiled[0] > 0 and compiled[2] == 0, compiled
    assert fallback_ops() == []
    assert gen.speculator.graphs and gen.last_stats.steps > 0


def test_fused_graph_aliases_both_caches_and_eagle_buffers(checkpoints):
    target = load(checkpoints["target"], "xla", 2)
    gen = fused_generator("eagle", target, checkpoints)
    key = gen.speculator.key(3, 20, target.sampling_params(do_sample=True, temperature=0.8))
    module, run = gen.speculator.graph(key)
    inputs = module.example_inputs(2)
    state = cache_count(target) + cache_count(gen.proposer.model) + 2     # + EAGLE's features and tokens
    assert state in aliases_compiled(lambda: run(*inputs))


def test_fused_seeded_sampling_equals_eager(checkpoints):
    kw = dict(max_new_tokens=NEW, eos_token_id=[], do_sample=True, temperature=0.8, top_k=20, seed=3)
    reference = fused_generator("draft", load(checkpoints["target"], "eager", 3), checkpoints).generate(PROMPTS, **kw)
    out = fused_generator("draft", load(checkpoints["target"], "xla", 3), checkpoints).generate(PROMPTS, **kw)
    assert torch.equal(out.cpu(), reference)
