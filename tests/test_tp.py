"""Tensor parallelism: TP=2 (two gloo processes on CPU, started with ``parallel.launch``) against
TP=1 in this process, on tiny random Llamas saved as real checkpoints:

- "even": 4 query / 2 KV heads (split over the ranks), intermediate 128, vocab 160, safetensors;
  also with gqa_strategy='convert-to-mha';
- "mqa": 3 query / 1 KV head (replicate-to-tp-degree: the KV head on both ranks, query heads
  split 2 + 1 and one padding slot);
- "padded": 9 query / 3 KV heads (convert-to-mha: 10 slots each, one padding), intermediate 97
  (padded to 98), vocab 163 (padded to 164), tied embeddings, q/k/v biases, sharded .bin files.

One launch runs every TP=2 check (spawning costs seconds) and returns what each rank computed.
Logits are compared in f32 with atol = rtol = 1e-4.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from specdec import DecoderModel, SpeculativeGenerator
from specdec.core.graphs import GraphKey
from specdec.core.parallel import launch

from conftest import load, prompt_ids, save_reduced_vocab

PROMPTS = [prompt_ids(7, seed=61), prompt_ids(12, seed=62)]
N_NEW = 12
SHAPES = dict(batch_size=2, n_positions=64, context_buckets=[16], kv_buckets=[32, 64])
CASES = {  # name → (target, draft, target kwargs)
    "even": ("even", "even-draft-reduced", {}),
    "even-mha": ("even", "even-draft-reduced", {"gqa_strategy": "convert-to-mha"}),
    "mqa": ("mqa", "even-draft-reduced", {}),
    "padded": ("padded", "padded-draft", {}),
}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def paths(checkpoint, tmp_path_factory):
    draft = checkpoint("llama-draft").path
    return {"even": checkpoint("llama").path,
            "mqa": checkpoint("llama-tp-mqa").path,
            "padded": checkpoint("llama-tp-padded", "bin-sharded").path,
            # reduced output vocabulary of 97 tokens: the LM head is padded to 98 rows at tp=2
            "even-draft-reduced": save_reduced_vocab(draft, tmp_path_factory.mktemp("reduced"), torch.arange(3, 100)),
            "padded-draft": checkpoint("llama-tp-padded-draft").path}


def outputs(target: DecoderModel, draft_replicated: DecoderModel, draft_sharded: DecoderModel) -> dict:
    """Everything compared between the degrees, computed by the same calls at either degree."""
    params = target.sampling_params(do_sample=False)
    prefill = target.prefill([torch.tensor(p) for p in PROMPTS], params)
    verify = target.step(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), params)
    greedy = dict(max_new_tokens=N_NEW, eos_token_id=[])
    sampled = dict(greedy, do_sample=True, temperature=0.8, top_p=0.95)
    return {
        "greedy": target.generate(PROMPTS, **greedy),
        "logits": [prefill.logits, verify.logits],
        "hidden": verify.hidden,
        "draft_logits": draft_sharded.prefill([torch.tensor(p) for p in PROMPTS], params).logits,
        "spec_draft_replicated": SpeculativeGenerator(draft_replicated, target, 3).sample(PROMPTS, **greedy),
        "spec_draft_sharded": SpeculativeGenerator(draft_sharded, target, 3).sample(PROMPTS, **greedy),
        "sampled": target.generate(PROMPTS, **sampled, seed=0),
        "spec_sampled": SpeculativeGenerator(draft_replicated, target, 3).sample(PROMPTS, **sampled, seed=1),
        "spec_sampled_unseeded": SpeculativeGenerator(draft_replicated, target, 3).sample(PROMPTS, **sampled),
    }


def rank_state(model: DecoderModel) -> dict:
    """What this rank holds: parameter bytes, KV-cache shape, layer-0 shards."""
    layer = model.lm.model.layers[0]
    q, k, _ = layer.self_attn.qkv_proj.weight.split(layer.self_attn.qkv_sizes)     # fused (quant.fuse_projections)
    return {"param_bytes": sum(p.numel() * p.element_size() for p in model.lm.parameters()),
            "kv_cache": tuple(layer.self_attn.k_cache.shape), "q_proj": q.clone(), "k_proj": k.clone(),
            "o_proj": layer.self_attn.o_proj.weight.clone(), "down_proj": layer.mlp.down_proj.weight.clone()}


def tp_worker(paths: dict, save_dir: str) -> list[dict]:
    """Runs on every rank of a 2-process group; returns every rank's results (gathered)."""
    results = {}
    for case, (target, draft, kwargs) in CASES.items():
        model = load(paths[target], tp_degree=2, **SHAPES, **kwargs)
        results[case] = outputs(model, load(paths[draft], tp_degree=1, **SHAPES),
                                load(paths[draft], tp_degree=2, **SHAPES))
        results[case]["state"] = rank_state(model)
        if case == "padded":
            exported = model.export(GraphKey(1, 1, 32, False))
            results["export_ops"] = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
            model.save(save_dir)
            results["reloaded"] = DecoderModel.load(save_dir, progress=False).generate(
                PROMPTS, max_new_tokens=N_NEW, eos_token_id=[])
    with pytest.raises(ValueError) as bad_gqa:   # 3 KV heads and tp=2 do not divide one another
        load(paths["padded"], tp_degree=2, gqa_strategy="replicate-to-tp-degree", **SHAPES)
    results["bad_gqa"] = str(bad_gqa.value)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    return gathered


@pytest.fixture(scope="module")
def tp2(paths, tmp_path_factory):
    return launch(tp_worker, 2, paths, str(tmp_path_factory.mktemp("saved-tp2")), timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def tp1(paths):
    refs = {}
    for case, (target, draft, kwargs) in CASES.items():
        drafts = load(paths[draft], **SHAPES)
        refs[case] = outputs(load(paths[target], **SHAPES, **kwargs), drafts, drafts)
    return refs


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logits_equal_tp1(tp2, tp1, case):
    ref = tp1[case]
    for rank in tp2:
        got = rank[case]
        assert torch.equal(got["greedy"], ref["greedy"])
        for a, b in zip(got["logits"], ref["logits"]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got["hidden"], ref["hidden"], atol=1e-4, rtol=1e-4)
        # a reduced-vocabulary draft sharded over the ranks: same logits (-inf outside its vocabulary)
        torch.testing.assert_close(got["draft_logits"], ref["draft_logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_speculative_greedy_equals_target_only(tp2, tp1, case):
    for rank in tp2:
        assert torch.equal(rank[case]["spec_draft_replicated"], tp1[case]["greedy"])   # draft tp=1 on each rank
        assert torch.equal(rank[case]["spec_draft_sharded"], tp1[case]["greedy"])      # draft tp=2


@pytest.mark.parametrize("case", CASES)
def test_sampling_is_identical_on_every_rank(tp2, tp1, case):
    rank0, rank1 = (r[case] for r in tp2)
    for name in ("sampled", "spec_sampled", "spec_sampled_unseeded"):
        assert rank0[name].shape[1] == len(PROMPTS[1]) + N_NEW
        assert torch.equal(rank0[name], rank1[name]), name
    # same seed, same uniforms and (to float tolerance) the same distributions as tp=1
    assert torch.equal(rank0["sampled"], tp1[case]["sampled"])
    assert not torch.equal(rank0["sampled"], tp1[case]["greedy"])


def rank_param_bytes(c: dict, q_slots: int, kv_slots: int) -> int:
    """f32 parameter bytes of one of two ranks, from the config: q/kv head slots per rank given;
    intermediate and vocab split in ceil(x / 2) rows; norms replicated; tied embeddings counted once."""
    h, d, layers = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"], c["num_hidden_layers"]
    inter, vocab = math.ceil(c["intermediate_size"] / 2), math.ceil(c["vocab_size"] / 2)
    bias = int(c.get("attention_bias", False))
    attn = (q_slots + 2 * kv_slots) * d * (h + bias) + h * q_slots * d
    layer = attn + 3 * h * inter + 2 * h
    return 4 * (layers * layer + vocab * h * (1 if c.get("tie_word_embeddings") else 2) + h)


# case → (HF variant, q source heads per rank, kv source heads per rank; -1 = zero padding)
HEADS = {"even": ("llama", [[0, 1], [2, 3]], [[0], [1]]),
         "even-mha": ("llama", [[0, 1], [2, 3]], [[0, 0], [1, 1]]),
         "mqa": ("llama-tp-mqa", [[0, 1], [2, -1]], [[0], [0]]),
         "padded": ("llama-tp-padded", [[0, 1, 2, 3, 4], [5, 6, 7, 8, -1]], [[0, 0, 0, 1, 1], [1, 2, 2, 2, -1]])}


def head_rows(weight: torch.Tensor, heads: list[int], d: int) -> torch.Tensor:
    return torch.cat([weight[h * d:(h + 1) * d] if h >= 0 else torch.zeros(d, weight.shape[1]) for h in heads])


@pytest.mark.parametrize("case", HEADS)
def test_each_rank_holds_only_its_shard(tp2, hf_models, case):
    variant, q_heads, kv_heads = HEADS[case]
    hf = hf_models(variant)
    c = hf.config.to_dict()
    d = c["hidden_size"] // c["num_attention_heads"]
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    full_bytes = sum(p.numel() * 4 for p in hf.parameters())
    inter = math.ceil(c["intermediate_size"] / 2)
    for rank, results in enumerate(tp2):
        state = results[case]["state"]
        assert state["param_bytes"] == rank_param_bytes(c, len(q_heads[rank]), len(kv_heads[rank]))
        assert state["kv_cache"] == (SHAPES["batch_size"], SHAPES["n_positions"], len(kv_heads[rank]), d)
        torch.testing.assert_close(state["q_proj"], head_rows(attn.q_proj.weight, q_heads[rank], d), atol=0, rtol=0)
        torch.testing.assert_close(state["k_proj"], head_rows(attn.k_proj.weight, kv_heads[rank], d), atol=0, rtol=0)
        o_cols = head_rows(attn.o_proj.weight.T, q_heads[rank], d).T
        torch.testing.assert_close(state["o_proj"], o_cols, atol=0, rtol=0)
        down = mlp.down_proj.weight[:, rank * inter:(rank + 1) * inter]
        padded_down = torch.cat([down, torch.zeros(down.shape[0], inter - down.shape[1])], 1)
        torch.testing.assert_close(state["down_proj"], padded_down, atol=0, rtol=0)
    if case == "even":   # no padding: the two shards are exactly half of the sharded tensors
        norms = 4 * c["hidden_size"] * (2 * c["num_hidden_layers"] + 1)
        assert tp2[0][case]["state"]["param_bytes"] == (full_bytes - norms) // 2 + norms


def test_export_traces_the_collectives_and_save_load_works(tp2, tp1):
    for rank in tp2:
        ops = " ".join(rank["export_ops"])
        assert "all_reduce" in ops and "all_gather" in ops, ops
        assert torch.equal(rank["reloaded"], tp1["padded"]["greedy"])


def test_bad_gqa_strategy_is_a_clear_error(tp2):
    assert "gqa_strategy='replicate-to-tp-degree' needs num_key_value_heads (3) and tp_degree (2) to divide " \
           "one another; use 'convert-to-mha'" in tp2[0]["bad_gqa"]


def test_convert_to_mha_at_tp1_equals_default(paths, tp1):
    """The head-slot loading (KV heads replicated per query head) also works without processes."""
    model = load(paths["padded"], gqa_strategy="convert-to-mha", **SHAPES)
    assert model.lm.layout.kv_per_rank == 9
    assert torch.equal(model.generate(PROMPTS, max_new_tokens=N_NEW, eos_token_id=[]), tp1["padded"]["greedy"])


@pytest.mark.parametrize("tp_degree", [0, -1, 1.5, True, "2"])
def test_invalid_tp_degree(paths, tp_degree):
    with pytest.raises(ValueError, match=rf"tp_degree must be an integer >= 1, got {tp_degree!r}"):
        load(paths["even"], tp_degree=tp_degree)
    with pytest.raises(ValueError, match=r"tp_degree must be an integer >= 1"):
        launch(print, tp_degree)


def test_tp_without_processes_points_to_launch(paths, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match=r"tp_degree=2 needs 2 processes, but torch.distributed is not "
                                           r"initialised: run the code with specdec.core.parallel.launch\(fn, 2, "
                                           r"...\) .* or start it with `torchrun --nproc-per-node 2 script.py`"):
        load(paths["even"], tp_degree=2)


def test_world_size_of_the_launch_must_match(paths, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")   # as torchrun --nproc-per-node 4 sets it
    with pytest.raises(ValueError, match=r"tp_degree=2 does not match the launch: 4 processes were started "
                                         r"\(WORLD_SIZE=4\); start 2 or set tp_degree=4"):
        load(paths["even"], tp_degree=2)
    assert not dist.is_initialized()


def test_tp_degree_larger_than_world_size_fails_in_the_worker_and_propagates(paths):
    with pytest.raises(ValueError, match=r"tp_degree=3 exceeds the world size 2 of the process group") as err:
        launch(load, 2, paths["even"], tp_degree=3, timeout_s=TIMEOUT_S)
    assert "rank" in str(err.value.__cause__) and "Traceback" in str(err.value.__cause__)
