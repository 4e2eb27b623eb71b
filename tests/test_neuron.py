"""The ``neuron`` backend without the Neuron SDK: the one clear error, and its calls to
neuronx-distributed checked against a RECORDING STAND-IN.

The stand-in (``Recorder``) takes the place of ``neuronx_distributed``'s ModelBuilder units; it
records what it is given and runs the traced module eagerly on the CPU when called. It proves nothing
about Neuron — no HLO is lowered, nothing is compiled by neuronx-cc, nothing runs on a NeuronCore —
only that the backend hands the SDK what its documentation asks for: one traced module per graph key
(the same ``StepGraph`` modules every other backend runs), example inputs of the graph's shapes, the
KV caches updated as state (rebound out of place while traced), one set of weights shared by all
keys, calls routed by key name, save / load of the compiled program.
"""
from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from conftest import load, prompt_ids

from specdec.core.graphs import CacheCompaction, StepGraph
from specdec.core.neuron import INSTALL, NeuronGraph


class Recorder:
    """A recording stand-in for ``neuronx_distributed``'s ``trace`` / ``compile`` / ``NxDModel``."""

    def __init__(self):
        self.traced: dict[str, dict] = {}
        self.pending: list[dict] = []
        self.weights: list = []
        self.loaded_from: list[str] = []
        self.started = 0

    def trace(self, model, args):
        assert isinstance(model, NeuronGraph)
        params = inspect.signature(model.forward).parameters.values()     # explicit, named (the docs' rule)
        assert [p.kind for p in params] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(args)
        before = {name: id(b) for name, b in model.named_buffers()}
        with torch.no_grad():
            model(*args)            # eager, under the backend's tracing context
        rebound = sorted(name for name, b in model.named_buffers() if id(b) != before.get(name))
        record = {"module": model, "shapes": [tuple(a.shape) for a in args], "rebound": rebound}
        self.pending.append(record)
        return types.SimpleNamespace(hlo_module=record, metaneff=b"")

    def compile(self, hlo_module, metaneff, compiler_workdir=None, compiler_args=None, key=None):
        self.traced[key] = hlo_module
        return types.SimpleNamespace(neff_filepath=f"{key}.neff")

    def nxd_model(self, world_size):
        recorder = self

        class NxDModel:
            def __init__(self):
                self.world_size, self.keys = world_size, []

            def add(self, key, trace_artifacts, compilation_artifacts):
                assert trace_artifacts.hlo_module is recorder.traced[key]
                self.keys.append(key)
                return self

            def set_weights(self, sharded_checkpoint):
                recorder.weights.append(sharded_checkpoint)

            def to_neuron(self):
                recorder.started += 1

            def __call__(self, *inputs, model_name=None):
                with torch.no_grad():
                    return recorder.traced[model_name]["module"](*inputs)

            def save(self, path, save_weights=False):
                with open(path, "w") as f:
                    f.write("\n".join(self.keys))

            @classmethod
            def load(cls, path):
                recorder.loaded_from.append(path)
                return cls()

        return NxDModel

    def install(self, monkeypatch) -> None:
        builder = types.ModuleType("neuronx_distributed.trace.model_builder")
        builder.trace, builder.compile = self.trace, self.compile
        nxd = types.ModuleType("neuronx_distributed")
        nxd.NxDModel = _Factory(self.nxd_model(1))
        for name, module in {"torch_neuronx": types.ModuleType("torch_neuronx"), "neuronx_distributed": nxd,
                             "neuronx_distributed.trace": types.ModuleType("neuronx_distributed.trace"),
                             "neuronx_distributed.trace.model_builder": builder}.items():
            monkeypatch.setitem(sys.modules, name, module)


class _Factory:
    """``NxDModel(world_size=...)`` and ``NxDModel.load(path)`` on the stand-in class."""

    def __init__(self, cls):
        self.cls = cls

    def __call__(self, world_size):
        return self.cls()

    def load(self, path):
        return self.cls.load(path)


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    rec.install(monkeypatch)
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
    assert recorder.started == 1
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
    assert set(loaded._graphs) == set(model._graphs) and set(loaded._compactions) == {2}
