"""Medusa heads: identity ResBlocks at init, the FasterDecoding/Medusa checkpoint layout (round trip,
foreign checkpoints in .safetensors and .pt), config naming (Medusa / NxD Inference) and errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specdec.medusa.heads import MedusaConfig, MedusaHeads, load_heads, load_medusa_config, save_heads
from specdec.medusa.tree import load_tree

H, V = 16, 40


def lm_head(seed=0):
    return torch.randn(V, H, generator=torch.Generator().manual_seed(seed))


def medusa_state(num_heads, num_layers, seed=1):
    """A checkpoint state dict written with FasterDecoding/Medusa's key names."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(num_heads):
        for j in range(num_layers):
            state[f"{i}.{j}.linear.weight"] = torch.randn(H, H, generator=g) * 0.1
            state[f"{i}.{j}.linear.bias"] = torch.randn(H, generator=g) * 0.1
        state[f"{i}.{num_layers}.weight"] = torch.randn(V, H, generator=g)
    return state


def write_checkpoint(directory, state, config, fmt="safetensors"):
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        save_file(state, directory / "medusa_lm_head.safetensors")
    else:
        torch.save(state, directory / "medusa_lm_head.pt")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_fresh_heads_reproduce_lm_head():
    w = lm_head()
    heads = MedusaHeads(H, V, num_heads=3, num_layers=2, lm_head_weight=w)
    hidden = torch.randn(2, 5, H)
    logits = heads(hidden)
    assert logits.shape == (2, 5, 3, V) and logits.dtype == torch.float32
    ref = hidden @ w.T
    for h in range(3):
        assert torch.equal(logits[:, :, h], ref)
    assert (heads.num_heads, heads.num_layers, heads.hidden_size, heads.vocab_size) == (3, 2, H, V)
    # bf16 heads still return float32 logits
    assert MedusaHeads(H, V, 2, dtype=torch.bfloat16)(hidden).dtype == torch.float32


def test_trained_resblock_changes_output():
    heads = MedusaHeads(H, V, num_heads=1, num_layers=1, lm_head_weight=lm_head())
    with torch.no_grad():
        heads.heads[0][0].linear.weight.fill_(0.1)
    hidden = torch.randn(1, 2, H)
    x = hidden + torch.nn.functional.silu(hidden @ torch.full((H, H), 0.1).T)
    assert torch.allclose(heads(hidden)[:, :, 0], x @ lm_head().T, atol=1e-5)


def test_state_dict_uses_medusa_key_names():
    keys = set(MedusaHeads(H, V, 2, 1).heads.state_dict())
    assert keys == {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight",
                    "1.0.linear.weight", "1.0.linear.bias", "1.1.weight"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_bit_exact(tmp_path, dtype):
    heads = MedusaHeads(H, V, 4, 2, dtype=dtype)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    config = MedusaConfig(4, 2, tree=load_tree("small_8"), base_model_name_or_path="tiny")
    save_heads(heads, tmp_path, config)
    assert (tmp_path / "medusa_lm_head.safetensors").is_file()
    loaded = load_heads(tmp_path)
    assert loaded.heads[0][-1].weight.dtype == dtype
    a, b = heads.heads.state_dict(), loaded.heads.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = load_medusa_config(tmp_path)
    assert again == config and again.speculation_length == 9


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_loads_faster_decoding_checkpoint(tmp_path, fmt):
    state = medusa_state(num_heads=4, num_layers=1)
    config = {"medusa_num_heads": 4, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
              "transformers_version": "4.33.0"}
    heads = load_heads(write_checkpoint(tmp_path, state, config, fmt), hidden_size=H, vocab_size=V)
    assert (heads.num_heads, heads.num_layers) == (4, 1)
    hidden = torch.randn(1, 3, H)
    for i in range(4):
        x = hidden + torch.nn.functional.silu(hidden @ state[f"{i}.0.linear.weight"].T + state[f"{i}.0.linear.bias"])
        assert torch.allclose(heads(hidden)[:, :, i], x @ state[f"{i}.1.weight"].T, atol=1e-5)


def test_missing_tensor_error(tmp_path):
    state = medusa_state(2, 1)
    del state["1.0.linear.bias"]
    write_checkpoint(tmp_path, state, {"medusa_num_heads": 2, "medusa_num_layers": 1})
    with pytest.raises(KeyError, match=r"missing tensor\(s\) 1\.0\.linear\.bias"):
        load_heads(tmp_path)


def test_config_layers_disagree_with_checkpoint(tmp_path):
    write_checkpoint(tmp_path, medusa_state(2, 1), {"medusa_num_heads": 2, "medusa_num_layers": 2})
    with pytest.raises(KeyError, match="missing tensor '0.2.weight'.*medusa_num_layers=2"):
        load_heads(tmp_path)


def test_more_heads_than_config_error(tmp_path):
    write_checkpoint(tmp_path, medusa_state(3, 1), {"medusa_num_heads": 2})
    with pytest.raises(ValueError, match="does not account for: 2.0.linear.bias, 2.0.linear.weight, 2.1.weight"):
        load_heads(tmp_path)


def test_shape_mismatch_names_tensor(tmp_path):
    state = medusa_state(2, 1)
    state["1.0.linear.weight"] = torch.zeros(H, H + 1)
    write_checkpoint(tmp_path, state, {"medusa_num_heads": 2})
    with pytest.raises(ValueError, match=r"'1\.0\.linear\.weight'.*shape \(16, 17\), expected \(16, 16\)"):
        load_heads(tmp_path)
    write_checkpoint(tmp_path, medusa_state(2, 1), {"medusa_num_heads": 2})
    with pytest.raises(ValueError, match=r"'0\.1\.weight'.*shape \(40, 16\), expected \(41, 16\)"):
        load_heads(tmp_path, vocab_size=V + 1)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_heads(tmp_path)
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 1}')
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.safetensors or medusa_lm_head.pt"):
        load_heads(tmp_path)


def test_config_from_either_naming():
    paths = load_tree("mc_sim_7b_63").to_list()
    medusa = MedusaConfig.from_dict({"medusa_num_heads": 4, "medusa_num_layers": 1})
    nxd = MedusaConfig.from_dict({"is_medusa": True, "num_medusa_heads": 4, "medusa_speculation_length": 64,
                                  "medusa_tree": paths})
    assert (medusa.num_heads, medusa.num_layers, medusa.tree) == (4, 1, None)
    assert (nxd.num_heads, nxd.num_layers, nxd.speculation_length) == (4, 1, 64)
    assert nxd.tree == load_tree("mc_sim_7b_63")
    both = MedusaConfig.from_dict({"medusa_num_heads": 4, "num_medusa_heads": 4, "medusa_tree": paths})
    assert both.speculation_length == 64
    assert MedusaConfig.from_dict(nxd.to_dict()) == nxd


@pytest.mark.parametrize("config, message", [
    ({"medusa_num_layers": 1}, "no number of heads: set medusa_num_heads"),
    ({"medusa_num_heads": 4, "num_medusa_heads": 3}, "contradictory Medusa config values: medusa_num_heads=4, "
                                                     "num_medusa_heads=3"),
    ({"num_medusa_heads": 4, "is_medusa": False}, "is_medusa=False"),
    ({"num_medusa_heads": 0}, "medusa_num_heads must be an int >= 1, got 0"),
    ({"num_medusa_heads": 4, "medusa_speculation_length": 32, "medusa_tree": [[0], [1]]},
     "medusa_speculation_length=32 but medusa_tree has 2 nodes + root = 3"),
    ({"num_medusa_heads": 1, "medusa_tree": [[0], [0, 0]]}, "depth 2 > num_heads 1"),
    ({"medusa_num_heads": 2, "medusa_num_layers": -1}, "medusa_num_layers must be an int >= 0"),
])
def test_config_errors(config, message):
    with pytest.raises(ValueError) as e:
        MedusaConfig.from_dict(config)
    assert message in str(e.value)


def test_constructor_and_save_errors(tmp_path):
    with pytest.raises(ValueError, match=r"lm_head_weight has shape \(40, 15\), expected"):
        MedusaHeads(H, V, 2, lm_head_weight=torch.zeros(V, H - 1))
    with pytest.raises(ValueError, match=r"config has 3 heads x 1 layers \(tied=False\) but the module has 2 x 1"):
        save_heads(MedusaHeads(H, V, 2), tmp_path, MedusaConfig(3))
