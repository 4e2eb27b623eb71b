"""The ``neuron`` backend without the Neuron SDK: the one clear error, and its calls to
neuronx-distributed checked against a RECORDING STAND-IN.

The stand-in (``Recorder``) takes the place of ``neuronx_distributed``'s ModelBuilder units; it
records what it is given and runs the traced module eagerly on the CPU when called. It proves nothing
about Neuron — no HLO is lowered, nothing is compiled by neuronx-cc, nothing runs on a NeuronCore —
only that the backend hands the SDK what its documentation asks for: one traced module per graph key
(the same ``StepGraph`` modules every other backend runs), example inputs of the graph's shapes, the
KV caches updated as state (rebound out of place while traced), one set of weights shared by all
keys, calls routed by key name, save / load of the compiled program; and at tp_degree > 1 the SPMD
contract: ``NxDModel(world_size=tp)``, one trace per key inside ``NxDParallelState`` with NxD's
collectives, one state dict per rank equal to ``shard_plan``'s shards, and the rank read from that
state dict, not from a Python int in the trace (two gloo processes each run the same trace with its
rank's weights and match the torch.distributed runtime's rank).
"""
from __future__ import annotations

import inspect
import sys
import types
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from specdec.core import parallel
from specdec.core.graphs import CacheCompaction, StepGraph
from specdec.core.neuron import INSTALL, NeuronGraph
from specdec.core.parallel import TPGroup, all_gather_last, launch, shard_plan

from conftest import fused_names, load, prompt_ids


class Recorder:
    """A recording stand-in for ``neuronx_distributed``'s ``trace`` / ``compile`` / ``NxDModel`` /
    ``NxDParallelState`` and the collectives of ``parallel_layers.mappings``.

    ``rank``: the rank whose state dict (``set_weights``) this stand-in loads into the traced modules
    before running them: under ``parallel.launch`` each process plays one NeuronCore, and the stand-in's
    collectives are torch.distributed's over the launch; in one process they only keep shapes (the
    all-reduce returns its input, the all-gather repeats it)."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.traced: dict[str, dict] = {}
        self.pending: list[dict] = []
        self.weights: list = []
        self.loaded_from: list[str] = []
        self.started = 0
        self.world_sizes: list[int] = []        # NxDModel(world_size=...)
        self.parallel_state: tuple[int, int] | None = None   # inside NxDParallelState(...): its sizes
        self.collectives: list[str] = []        # mappings called, in order
        self.world = 1

    # ---------------------------------------------------------------- neuronx_distributed.*
    def trace(self, model, args):
        assert isinstance(model, NeuronGraph)
        params = inspect.signature(model.forward).parameters.values()     # explicit, named (the docs' rule)
        assert [p.kind for p in params] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(args)
        before = {name: id(b) for name, b in model.named_buffers()}
        called = len(self.collectives)
        with torch.no_grad():
            model(*args)            # eager, under the backend's tracing context
        rebound = sorted(name for name, b in model.named_buffers() if id(b) != before.get(name))
        record = {"module": model, "shapes": [tuple(a.shape) for a in args], "rebound": rebound,
                  "parallel_state": self.parallel_state, "collectives": self.collectives[called:]}
        self.pending.append(record)
        return types.SimpleNamespace(hlo=record, metaneff=b"")   # TraceArtifacts: .hlo, .metaneff

    def compile(self, hlo_module, metaneff, compiler_workdir=None, compiler_args=None, key=None):
        self.traced[key] = hlo_module
        return types.SimpleNamespace(neff_filepath=f"{key}.neff")

    @contextmanager
    def nxd_parallel_state(self, world_size, tensor_model_parallel_size):
        self.parallel_state, self.world = (world_size, tensor_model_parallel_size), tensor_model_parallel_size
        try:
            yield
        finally:
            self.parallel_state = None

    def reduce_from_tensor_model_parallel_region(self, x):
        self.collectives.append("all-reduce")
        return funcol.all_reduce(x, "sum", dist.group.WORLD) if dist.is_initialized() else x

    def gather_from_tensor_model_parallel_region(self, x):
        self.collectives.append("all-gather")
        if dist.is_initialized():
            return all_gather_last(x, TPGroup(dist.get_rank(), dist.get_world_size(), dist.group.WORLD))
        return torch.cat([x] * self.world, -1)

    def nxd_model(self):
        recorder = self

        class NxDModel:
            def __init__(self, world_size=1):
                recorder.world_sizes.append(world_size)
                self.world_size, self.keys = world_size, []

            def add(self, key, trace_artifacts, compilation_artifacts):
                assert trace_artifacts.hlo is recorder.traced[key]
                self.keys.append(key)
                return self

            def set_weights(self, sharded_checkpoint):
                assert isinstance(sharded_checkpoint, list)
                recorder.weights.append(sharded_checkpoint)

            def to_neuron(self):
                recorder.started += 1
                recorder.world = self.world_size
                mine = recorder.weights[-1][recorder.rank]
                for record in recorder.traced.values():    # this rank's weights into every traced module
                    module = record["module"]
                    tensors = dict(module.named_parameters(remove_duplicate=False))
                    tensors |= dict(module.named_buffers(remove_duplicate=False))
                    with torch.no_grad():
                        for name, value in mine.items():
                            assert tensors[name].shape == value.shape, name
                            tensors[name].copy_(value)

            def __call__(self, *inputs, model_name=None):
                with torch.no_grad():
                    return recorder.traced[model_name]["module"](*inputs)

            def save(self, path, save_weights=False):
                recorder.saved_world_size = self.world_size     # NxDModel.save keeps what it was built for
                with open(path, "w") as f:
                    f.write("\n".join(self.keys))

            @classmethod
            def load(cls, path):
                recorder.loaded_from.append(path)
                return cls(recorder.saved_world_size)

        return NxDModel

    def install(self, setitem) -> None:
        """Put the stand-in in ``sys.modules`` with ``setitem(sys.modules, name, module)`` (pytest's
        ``monkeypatch.setitem``, or a plain assignment in a worker process)."""
        builder = types.ModuleType("neuronx_distributed.trace.model_builder")
        builder.trace, builder.compile = self.trace, self.compile
        nxd = types.ModuleType("neuronx_distributed")
        nxd.NxDModel, nxd.NxDParallelState = self.nxd_model(), self.nxd_parallel_state
        mappings = types.ModuleType("neuronx_distributed.parallel_layers.mappings")
        mappings.reduce_from_tensor_model_parallel_region = self.reduce_from_tensor_model_parallel_region
        mappings.gather_from_tensor_model_parallel_region = self.gather_from_tensor_model_parallel_region
        layers = types.ModuleType("neuronx_distributed.parallel_layers")
        layers.mappings = mappings
        for name, module in {"torch_neuronx": types.ModuleType("torch_neuronx"), "neuronx_distributed": nxd,
                             "neuronx_distributed.trace": types.ModuleType("neuronx_distributed.trace"),
                             "neuronx_distributed.trace.model_builder": builder,
                             "neuronx_distributed.parallel_layers": layers,
                             "neuronx_distributed.parallel_layers.mappings": mappings}.items():
            setitem(sys.modules, name, module)


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    rec.install(monkeypatch.setitem)
    return rec


def test_without_the_sdk_one_clear_error(ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)          # importing it raises ImportError
    model = load(ckpt, backend="neuron")
    with pytest.raises(ImportError) as err:
        model.to_neuron(progress=False)
    assert str(err.value) == INSTALL
    assert "--extra-index-url https://pip.repos.neuron.amazonaws.com" in INSTALL
    assert "torch-neuronx neuronx-cc neuronx-distributed" in INSTALL
    with pytest.raises(ValueError, match="to_neuron"):               # not compiled: no lazy tracing
        model.generate([prompt_ids(5, 1)], max_new_tokens=2)


def test_to_neuron_call_contract_on_a_recording_stand_in(ckpt, recorder):
    model = load(ckpt, backend="neuron", batch_size=2)
    model.to_neuron(progress=False, spec_tokens=(3,), compaction_slots=(2,))
    keys = model.graph_keys(spec_tokens=(3,))
    assert list(recorder.traced) == [k.describe() for k in keys] + ["kv-compaction m=2"]
    caches = sorted(f"graph.lm.model.layers.{i}.self_attn.{kv}_cache" for i in range(2) for kv in "kv")
    for key in keys:
        record = recorder.traced[key.describe()]
        graph = record["module"].graph
        assert type(graph) is StepGraph and graph.lm is model.lm and graph.key == key   # what xla runs
        assert record["shapes"] == [tuple(t.shape) for t in model.graph_module(key).example_inputs(2)]
        assert record["rebound"] == caches      # every KV cache updated as state, nothing else
    compaction = recorder.traced["kv-compaction m=2"]
    assert isinstance(compaction["module"].graph, CacheCompaction) and compaction["rebound"] == caches
    assert compaction["shapes"] == [(2, 2), (2, 2)]
    (weights,), = recorder.weights                                    # one rank, one copy for every key
    assert sorted(weights) == sorted(f"graph.lm.{name}" for name in [*model.lm.state_dict(), "inv_freq"])
    assert recorder.started == 1 and recorder.world_sizes == [1]
    assert all(record["parallel_state"] is None and not record["collectives"] for record in recorder.traced.values())
    assert all(not a.functional_state for a in model.lm.modules() if hasattr(a, "store"))   # restored


def test_generation_routes_every_call_by_key(ckpt, recorder):
    """Through the stand-in (which runs each traced module eagerly), generation equals the eager
    backend's: every call reached the graph of its own key."""
    prompts = [prompt_ids(6, 1), prompt_ids(11, 2)]
    reference = load(ckpt, batch_size=2).generate(prompts, max_new_tokens=12, eos_token_id=[])
    model = load(ckpt, backend="neuron", batch_size=2).to_neuron(progress=False)
    assert torch.equal(model.generate(prompts, max_new_tokens=12, eos_token_id=[]), reference)


def test_save_load_reuses_the_compiled_program(ckpt, recorder, tmp_path):
    model = load(ckpt, backend="neuron").to_neuron(progress=False, compaction_slots=(2,))
    model.save(tmp_path)
    assert (tmp_path / "neuron.pt").read_text().splitlines() == list(recorder.traced)
    traced = len(recorder.traced)
    from specdec import DecoderModel
    loaded = DecoderModel.load(tmp_path, progress=False)
    assert recorder.loaded_from == [str(tmp_path / "neuron.pt")]
    assert len(recorder.traced) == traced and recorder.started == 2   # nothing traced again; started
    assert set(loaded.graphs.built) == set(model.graphs.built) and set(loaded.graphs.compactions) == {2}


# ----------------------------------------------------------------------------- tensor parallelism
TP_SHAPES = dict(batch_size=2, n_positions=64, context_buckets=[16], kv_buckets=[32])
TP_VOCAB = 163      # "llama-tp-padded": heads (9 / 3), MLP (97) and vocabulary (163) all padded at tp=2
TP_PROMPTS = [prompt_ids(7, seed=71, vocab=TP_VOCAB), prompt_ids(12, seed=72, vocab=TP_VOCAB)]


def expected_shard(full: torch.Tensor, shard) -> torch.Tensor:
    """What a ``parallel.Shard`` means, from the full tensor: row i along ``dim`` is row ``index[i]``,
    zeros where the index is -1."""
    index = torch.tensor(shard.index)
    keep = (index >= 0).view([-1 if d == shard.dim else 1 for d in range(full.dim())])
    return full.index_select(shard.dim, index.clamp(min=0)) * keep


def refuse(*args, **kwargs):
    raise AssertionError("a torch.distributed collective was called by the neuron backend's graph")


def test_tp_call_contract_on_a_recording_stand_in(checkpoint, recorder, monkeypatch):
    """tp_degree=2 in one process (no torch.distributed): one trace per key of rank 0's module, inside
    NxDParallelState(2, 2), with NxD's collectives; NxDModel(world_size=2); set_weights gets one state dict
    per rank holding exactly the shards shard_plan names (computed here from the full HF tensors) and the
    rank value."""
    monkeypatch.setattr(parallel.funcol, "all_reduce", refuse)
    monkeypatch.setattr(parallel, "_all_gather", refuse)
    ckpt = checkpoint("llama-tp-padded")
    model = load(ckpt, backend="neuron", tp_degree=2, **TP_SHAPES).to_neuron(progress=False, spec_tokens=(3,))
    assert recorder.world_sizes == [2]
    layers = ckpt.hf.config.num_hidden_layers
    keys = model.graph_keys(spec_tokens=(3,))
    assert list(recorder.traced) == [k.describe() for k in keys]
    for key in keys:
        record = recorder.traced[key.describe()]
        assert record["parallel_state"] == (2, 2)
        assert record["module"].graph.lm is model.lm and model.lm.tp.rank == 0
        # embedding + (o_proj, down_proj) per layer all-reduced, the logits all-gathered
        assert record["collectives"] == ["all-reduce"] * (1 + 2 * layers) + ["all-gather"]
    weights, = recorder.weights
    assert len(weights) == 2
    full = ckpt.hf.state_dict()
    # the rank is a parameter, as NxD's SPMDRank holds it (the tracer keeps parameters as weight inputs)
    assert isinstance(model.lm.tp_rank, torch.nn.Parameter) and "tp_rank" in model.lm.state_dict()
    names = sorted(f"graph.lm.{name}" for name in [*model.lm.state_dict(), "inv_freq"])
    for rank, state in enumerate(weights):
        assert sorted(state) == names
        assert torch.equal(state["graph.lm.tp_rank"], torch.tensor([rank], dtype=torch.int32))
        plan = shard_plan(model.config, model.lm.layout, rank)
        assert "model.embed_tokens.weight" in plan and "model.layers.1.mlp.down_proj.weight" in plan
        for name, shard in plan.items():
            assert torch.equal(state[f"graph.lm.{name}"], expected_shard(full[name], shard)), (rank, name)
        for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):   # replicated
            assert torch.equal(state[f"graph.lm.{name}"], full[name])
    assert not torch.equal(weights[0]["graph.lm.model.layers.0.self_attn.q_proj.weight"],
                           weights[1]["graph.lm.model.layers.0.self_attn.q_proj.weight"])
    # the host module is rank 0's again after the other ranks were read through it
    assert torch.equal(model.lm.model.embed_tokens.weight, weights[0]["graph.lm.model.embed_tokens.weight"])


def test_the_traced_rank_is_data_not_a_python_int(checkpoint, recorder):
    """The module traced once (rank 0's, ``tp.rank == 0``) run with rank 1's state dict embeds with rank 1's
    vocabulary block: the rank it uses is the ``tp_rank`` weight. (In one process the stand-in's all-reduce
    returns its input, so the embedding is rank 1's partial sum: rows of its own block, zeros elsewhere.)"""
    ckpt = checkpoint("llama-tp-padded")
    recorder.rank = 1                                   # the stand-in loads rank 1's state dict
    model = load(ckpt, backend="neuron", tp_degree=2, **TP_SHAPES).to_neuron(progress=False)
    lm = model.lm
    assert lm.tp.rank == 0 and lm.tp_rank.tolist() == [1]
    ids = torch.tensor([[3, 80, 81, 82, 100, 162]])     # ranks' blocks: 0..81 and 82..163 (padded)
    table = ckpt.hf.model.embed_tokens.weight
    mine = (ids >= 82).unsqueeze(-1)
    with torch.no_grad():
        torch.testing.assert_close(lm.embed(ids), table[ids] * mine, rtol=0, atol=0)


def test_tp_save_load_hands_every_rank_its_weights_again(checkpoint, recorder, tmp_path):
    model = load(checkpoint("llama-tp-padded"), backend="neuron", tp_degree=2, **TP_SHAPES).to_neuron(progress=False)
    model.save(tmp_path)
    from specdec import DecoderModel
    loaded = DecoderModel.load(tmp_path, progress=False)
    assert len(recorder.traced) == len(model.graphs.built) and recorder.world_sizes == [2, 2]   # nothing traced again
    first, again = recorder.weights
    assert loaded.tp.size == 2 and loaded.graphs.neuron.tp_degree == 2 and len(again) == 2
    assert all(sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a) for a, b in zip(first, again))
    prompts = [p[:5] for p in TP_PROMPTS]
    assert loaded.generate(prompts, max_new_tokens=3, eos_token_id=[]).shape == (2, 8)


def neuron_tp_worker(path: str) -> list[dict]:
    """Runs in each of 2 gloo processes, each playing one NeuronCore: the neuron backend traces rank 0's
    module (one SPMD trace) and the stand-in loads this rank's state dict into it and runs its collectives
    over the launch; next to it, the torch.distributed runtime's own rank of the same checkpoint."""
    rank = dist.get_rank()
    recorder = Recorder(rank)
    recorder.install(lambda modules, name, module: modules.__setitem__(name, module))
    reference = load(path, tp_degree=2, **TP_SHAPES)                  # torch.distributed, this rank's shard
    model = load(path, backend="neuron", tp_degree=2, **TP_SHAPES).to_neuron(progress=False, spec_tokens=(4,))
    weights, = recorder.weights
    mine = weights[rank]
    # the runtime fuses float q/k/v and gate/up; Neuron keeps them apart (ranks re-read by checkpoint name)
    neuron_lm = fused_names({k.removeprefix("graph.lm."): v for k, v in mine.items() if k.startswith("graph.lm.")})
    out = {"python_rank": model.lm.tp.rank, "rank_value": mine["graph.lm.tp_rank"].tolist(),
           "runtime_rank_value": reference.lm.tp_rank.tolist(),
           "same_shards": {name: torch.equal(neuron_lm[name], t)
                           for name, t in reference.lm.state_dict().items()}}
    for name, m in (("reference", reference), ("neuron", model)):
        params = m.sampling_params(do_sample=False)
        prefill = m.prefill([torch.tensor(p) for p in TP_PROMPTS], params)
        verify = m.step(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), params, return_probs=True)   # verify graph
        out[name] = {"logits": [prefill.logits, verify.logits], "hidden": verify.hidden,
                     "greedy": m.generate(TP_PROMPTS, max_new_tokens=8, eos_token_id=[])}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return gathered


def test_one_trace_serves_every_rank_as_the_torch_distributed_runtime_does(checkpoint):
    """Two processes, one per rank, each running the SAME trace (rank 0's module, tp.rank == 0) with its own
    rank's state dict: every rank's logits, hidden states and greedy tokens equal those of the
    torch.distributed TP runtime at that rank, and the state dict handed to set_weights for rank r holds
    exactly the tensors that runtime's rank r loads. Were the rank a Python int in the trace, rank 1 would
    embed with rank 0's vocabulary block and its logits would differ."""
    results = launch(neuron_tp_worker, 2, str(checkpoint("llama-tp-padded").path), timeout_s=300)
    for rank, r in enumerate(results):
        assert r["python_rank"] == 0
        assert r["rank_value"] == r["runtime_rank_value"] == [rank]
        assert r["same_shards"] and all(r["same_shards"].values()), r["same_shards"]
        for a, b in zip(r["neuron"]["logits"], r["reference"]["logits"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["neuron"]["hidden"], r["reference"]["hidden"], atol=1e-5, rtol=1e-5)
        assert torch.equal(r["neuron"]["greedy"], r["reference"]["greedy"])


@pytest.mark.parametrize("tp_degree", [3, 6, 12])
def test_a_degree_no_neuron_platform_supports_is_a_clear_error(ckpt, tp_degree):
    with pytest.raises(ValueError, match=rf"backend='neuron' does not support tp_degree={tp_degree}: no Neuron "
                                         r"platform runs it. Supported degrees — inf2: 1, 2, 4, 8, 24; trn1: 1, 2, "
                                         r"8, 16, 32; trn2: 1, 2, 4, 8, 16, 32, 64; trn2 \(LNC=1\): 1, 2, 4, 8, 16, "
                                         r"32, 64, 128"):
        load(ckpt, backend="neuron", tp_degree=tp_degree)


def test_quantization_with_neuron_tp_is_a_clear_error(ckpt):
    with pytest.raises(ValueError, match=r"quantization='int8' with backend='neuron' runs at tp_degree=1 only "
                                         r"\(got 2\)"):
        load(ckpt, backend="neuron", tp_degree=2, quantization="int8")
