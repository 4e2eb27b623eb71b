"""Every graph kind (repetition-penalty graphs included) is trace-clean under ``torch.export`` (strict,
static shapes) — the CPU stand-in for Neuron tracing — and computes what the eager graph computes; a
tree-shaped ``token_mask`` with explicit ``position_ids`` in the multi-token graph gives transformers'
logits on every root-to-leaf path."""
from __future__ import annotations

import pytest
import torch

from specdec.core.graphs import GraphKey, StepGraph

from conftest import hf_logits, load, prompt_ids

SPEC = 4


@pytest.fixture(scope="module")
def model(ckpt):
    return load(ckpt, batch_size=2, n_positions=32, context_buckets=[8, 16], kv_buckets=[32])


def zero_caches(model) -> None:
    for layer in model.lm.model.layers:
        layer.self_attn.k_cache.zero_()
        layer.self_attn.v_cache.zero_()


def all_keys(model) -> list[GraphKey]:
    return (model.graph_keys(do_sample=False, spec_tokens=(SPEC,))
            + model.graph_keys(do_sample=True, spec_tokens=(SPEC,)))


KEY_IDS = ["ctx8-greedy", "ctx16-greedy", "tokgen-greedy", "multi4-greedy-probs",
           "ctx8-sample", "ctx16-sample", "tokgen-sample", "multi4-sample-probs"]


@pytest.fixture(scope="module")
def exported(model):
    """GraphKey → ExportedProgram, exported once per module."""
    cache = {}

    def get(key):
        if key not in cache:
            cache[key] = model.export(key)
        return cache[key]
    return get


def test_graph_keys_cover_every_kind(model):
    keys = all_keys(model)
    assert len(keys) == len(KEY_IDS)
    for do_sample in (False, True):
        ks = [k for k in keys if k.do_sample == do_sample]
        assert [(k.n_tokens, k.kv_len) for k in ks if k.n_logits == 1 and k.n_tokens > 1] == [(8, 8), (16, 16)]
        assert [(k.n_tokens, k.kv_len) for k in ks if k.n_tokens == 1] == [(1, 32)]
        assert [(k.n_tokens, k.n_logits, k.return_probs) for k in ks if k.n_logits > 1] == [(SPEC, SPEC, True)]


@pytest.mark.parametrize("index", range(len(KEY_IDS)), ids=KEY_IDS)
def test_graph_exports_strict_and_matches_eager(model, exported, index):
    check_export(model, exported, all_keys(model)[index])


PENALTY_KEYS = [GraphKey(SPEC, SPEC, 32, True, True, penalty=True),            # verify, sampling
                GraphKey(8, 1, 8, False, single_row=True, penalty=True)]       # a joining row's context


@pytest.mark.parametrize("key", PENALTY_KEYS, ids=["multi4-sample-probs-penalty", "ctx8-greedy-row-penalty"])
def test_penalty_graph_exports_strict_and_matches_eager(model, exported, key):
    """Repetition-penalty graphs take ``presence`` [b, V] as one more input (before seq_ids)."""
    check_export(model, exported, key)
    placeholders = exported(key).graph_signature.user_inputs
    assert len(placeholders) == 8 + key.single_row


def check_export(model, exported, key: GraphKey) -> None:
    ep = exported(key)
    assert isinstance(ep, torch.export.ExportedProgram)
    assert not ep.range_constraints          # no symbolic dimensions: fully static shapes
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            assert all(isinstance(d, int) for d in node.meta["val"].shape), node.name
    graph = StepGraph(model.lm, key, model.settings.sampling.global_topk)
    inputs = graph.example_inputs(model.batch_size)
    zero_caches(model)
    with torch.no_grad():
        expected = graph(*inputs)
    zero_caches(model)
    got = ep.module()(*inputs)
    zero_caches(model)
    n_out = 4 if key.return_probs else 3
    assert len(expected) == len(got) == n_out
    for e, g in zip(expected, got):
        assert e.shape == g.shape and e.dtype == g.dtype
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    b, m, v = key.batch(model.batch_size), key.n_logits, model.vocab_size
    assert got[0].shape == (b, m)
    assert got[-2].shape == (b, m, v)
    assert got[-1].shape == (b, key.n_tokens, model.config.hidden_size)


def test_exported_graph_updates_every_kv_cache(model, exported):
    """After functionalization the KV caches are mutated buffers of the graph (what Neuron aliases)."""
    key = GraphKey(1, 1, 32, False)
    decomposed = exported(key).run_decompositions()
    mutated = set(decomposed.graph_signature.buffers_to_mutate.values())
    expected = {f"lm.model.layers.{i}.self_attn.{kv}_cache" for i in range(model.config.num_layers) for kv in "kv"}
    assert mutated == expected


# ----------------------------------------------------------------------------- tree masks
def tree_inputs(parents: list[int]):
    """Ancestor-or-self mask [n, n], depths [n], and root-to-leaf paths of a tree given by parent indices."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i in range(n):
        j, d = i, 0
        while j != -1:
            mask[i, j] = True
            j = parents[j]
            d += 1
        depth[i] = d - 1
    leaves = [i for i in range(n) if i not in parents]
    paths = []
    for leaf in leaves:
        path, j = [], leaf
        while j != -1:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return mask, torch.tensor(depth), paths


def check_tree_logits(ckpt, prompts, tokens, parents_per_row, logits):
    for r, (prompt, parents) in enumerate(zip(prompts, parents_per_row)):
        _, depth, paths = tree_inputs(parents)
        assert len(paths) >= 2
        covered = set()
        for path in paths:
            ref = hf_logits(ckpt.hf, prompt + tokens[r, path].tolist())
            for node in path:
                torch.testing.assert_close(logits[r, node], ref[len(prompt) + int(depth[node])], atol=1e-4,
                                           rtol=1e-4, msg=lambda m: f"row {r} node {node}: {m}")  # noqa: B023
                covered.add(node)
        assert covered == set(range(len(parents)))


TREES = [
    [-1, 0, 0, 1, 2, 2, 3],      # root → {a, b}; a → c → f; b → {d, e}
    [-1, 0, 1, 0, 3, 3, 1],      # per-row different topology, nodes not in BFS order
]


def test_tree_mask_matches_transformers_on_every_path(ckpt):
    model = load(ckpt, batch_size=2, n_positions=32, context_buckets=[16], kv_buckets=[32])
    prompts = [prompt_ids(5, seed=61), prompt_ids(11, seed=62)]   # rows at different cache lengths
    params = model.sampling_params(do_sample=False)
    model.prefill([torch.tensor(p) for p in prompts], params)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, model.vocab_size, (2, len(TREES[0])), generator=g)
    masks, depths = zip(*[tree_inputs(t)[:2] for t in TREES])
    mask = torch.stack(masks)
    position_ids = model.lengths.unsqueeze(1) + torch.stack(depths)
    lengths = model.lengths.clone()
    out = model.step(tokens, params, token_mask=mask, position_ids=position_ids, advance=False,
                     return_probs=True)
    assert torch.equal(model.lengths, lengths)
    check_tree_logits(ckpt, prompts, tokens, TREES, out.logits)
    assert torch.equal(out.tokens, out.logits.argmax(-1))
    assert torch.equal(out.probs, torch.nn.functional.one_hot(out.tokens, model.vocab_size).float())
    # the default (causal chain) mask is not what we checked: a chain would give different logits
    chain = model.step(tokens, params, advance=False)
    assert not torch.allclose(chain.logits, out.logits, atol=1e-3)


def test_exported_multi_token_graph_runs_a_tree(model, ckpt, exported):
    """The exported verify graph (not just the eager module) honours the tree mask and positions."""
    key = GraphKey(SPEC, SPEC, 32, False, True)
    module = exported(key).module()
    prompts = [prompt_ids(6, seed=71), prompt_ids(9, seed=72)]
    parents = [[-1, 0, 0, 1], [-1, 0, 1, 0]]
    params = model.sampling_params(do_sample=False)
    zero_caches(model)
    model.prefill([torch.tensor(p) for p in prompts], params)
    # the exported module's cache buffers start from the eager prefill (a no-op if they alias)
    buffers = dict(module.named_buffers())
    for name, buf in model.lm.named_buffers():
        if name.endswith("_cache"):
            buffers[f"lm.{name}"].copy_(buf)
    masks, depths = zip(*[tree_inputs(p)[:2] for p in parents])
    tokens = torch.randint(3, model.vocab_size, (2, SPEC), generator=torch.Generator().manual_seed(4))
    lengths = model.lengths.clone()
    outs = module(tokens, lengths.unsqueeze(1) + torch.stack(depths), lengths, torch.stack(masks),
                  torch.arange(SPEC).expand(2, SPEC), params, torch.zeros(2, SPEC))
    tok, probs, logits, hidden = outs
    check_tree_logits(ckpt, prompts, tokens, parents, logits)
    assert torch.equal(tok, logits.argmax(-1))
    model.reset()
