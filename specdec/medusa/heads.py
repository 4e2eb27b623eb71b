"""Medusa heads (Cai et al. 2024) and the FasterDecoding/Medusa checkpoint layout.

Head h (0-based) reads the target's last hidden state at position t (after the final norm, the LM
head's input) and predicts token t + h + 2 (the target's own LM head predicts t + 1). Each head is
``num_layers`` ResBlocks ``x + SiLU(Linear(x))`` followed by a vocabulary projection
``Linear(hidden, vocab, bias=False)`` initialised from the target's LM head.

Checkpoint directory (FasterDecoding/Medusa, also read by TensorRT-LLM and TGI):
  config.json                  {"medusa_num_heads": H, "medusa_num_layers": L, ...}
  medusa_lm_head.safetensors   (or the older medusa_lm_head.pt) with, for head i < H and layer j < L,
                               "{i}.{j}.linear.weight" [hidden, hidden], "{i}.{j}.linear.bias" [hidden],
                               "{i}.{L}.weight" [vocab, hidden]  (the state dict of the heads'
                               ``nn.ModuleList`` of ``nn.Sequential``, which ``MedusaHeads.heads`` mirrors).
Reduced, tied heads (our extension, used by the shipped SmolLM2 heads): ``"medusa_tied_lm_head": true``
means the checkpoint holds no projections: every head projects with the target's LM head, restricted to
the rows ``token_ids`` (an int64 tensor in the weights file, ``medusa_vocab_size`` entries) when present.
Logit column c of such a head scores token ``token_ids[c]``; ``MedusaHeads.candidates`` maps back to token ids.
Quantization: heads follow their target's weight-only scheme (``MedusaDraft.from_pretrained`` calls
``MedusaHeads.quantize`` with ``target.settings.quantization``): under "int8" / "int4" each ResBlock's
``linear`` [H, H] takes the scheme and each vocabulary projection [V, H] per-channel int8, as the
target's LM head (tied heads: one ``Int8Linear`` shared by every head); under "gguf" they stay float.
The checkpoint always holds float tensors.
NxD Inference names the same settings ``num_medusa_heads``, ``medusa_speculation_length`` (tree nodes +
root, e.g. 64 for ``mc_sim_7b_63``) and ``medusa_tree`` (the list of paths); ``MedusaConfig.from_dict``
reads either naming.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from ..core.quant import compute_dtype, quantize_linears
from ..speculation.tree import TokenTree

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_NAME_PT",
    "MedusaConfig",
    "MedusaHeads",
    "ResBlock",
    "load_heads",
    "load_medusa_config",
    "save_heads",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "medusa_lm_head.safetensors"
WEIGHTS_NAME_PT = "medusa_lm_head.pt"

# setting -> accepted config keys (FasterDecoding/Medusa name first, then NxD Inference's)
_KEYS = {
    "num_heads": ("medusa_num_heads", "num_medusa_heads"),
    "num_layers": ("medusa_num_layers",),
    "speculation_length": ("medusa_speculation_length",),
    "tree": ("medusa_tree",),
    "base_model_name_or_path": ("base_model_name_or_path",),
    "tied_lm_head": ("medusa_tied_lm_head",),
    "vocab_size": ("medusa_vocab_size",),
}


def _pick(config: Mapping, setting: str):
    """The value of ``setting`` under any of its names (None if absent); ValueError on a conflict."""
    found = {k: config[k] for k in _KEYS[setting] if config.get(k) is not None}
    if len({json.dumps(v) for v in found.values()}) > 1:
        raise ValueError("contradictory Medusa config values: "
                         + ", ".join(f"{k}={v!r}" for k, v in found.items()))
    return next(iter(found.values()), None)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass
class MedusaConfig:
    """Medusa settings: heads, ResBlocks per head, and optionally the tree.

    ``speculation_length`` (NxD Inference's ``medusa_speculation_length``) is the verify width, tree
    nodes + root; with a ``tree`` it defaults to ``tree.verify_size`` and must equal it. The tree's depth
    must not exceed ``num_heads``.
    """

    num_heads: int
    num_layers: int = 1
    tree: TokenTree | None = None
    speculation_length: int | None = None
    base_model_name_or_path: str | None = None
    tied_lm_head: bool = False
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        _check_int("medusa_num_heads", self.num_heads, 1)
        _check_int("medusa_num_layers", self.num_layers, 0)
        if self.vocab_size is not None:
            _check_int("medusa_vocab_size", self.vocab_size, 1)
            if not self.tied_lm_head:
                raise ValueError("medusa_vocab_size (a reduced vocabulary) needs medusa_tied_lm_head=true")
        if self.speculation_length is not None:
            _check_int("medusa_speculation_length", self.speculation_length, 2)
        if self.tree is None:
            return
        if self.tree.depth > self.num_heads:
            raise ValueError(f"medusa_tree has depth {self.tree.depth} > medusa_num_heads {self.num_heads}")
        if self.speculation_length is None:
            self.speculation_length = self.tree.verify_size
        elif self.speculation_length != self.tree.verify_size:
            raise ValueError(f"medusa_speculation_length={self.speculation_length} but medusa_tree has "
                             f"{self.tree.num_nodes} nodes + root = {self.tree.verify_size}")

    @classmethod
    def from_dict(cls, config: Mapping) -> MedusaConfig:
        """Read a FasterDecoding/Medusa ``config.json`` or NxD Inference neuron-config keys (see ``_KEYS``).

        ValueError when the number of heads is missing, when two names of one setting disagree, when
        ``is_medusa`` is present and false, or when the values are inconsistent (``__post_init__``).
        """
        if "is_medusa" in config and not config["is_medusa"]:
            raise ValueError("config has is_medusa=False: not a Medusa configuration")
        num_heads = _pick(config, "num_heads")
        if num_heads is None:
            raise ValueError("Medusa config has no number of heads: set medusa_num_heads (FasterDecoding/Medusa) "
                             "or num_medusa_heads (NxD Inference)")
        _check_int("medusa_num_heads", num_heads, 1)
        paths = _pick(config, "tree")
        num_layers = _pick(config, "num_layers")
        return cls(num_heads=num_heads,
                   num_layers=1 if num_layers is None else num_layers,
                   tree=None if paths is None else TokenTree.from_paths(paths, num_heads=num_heads),
                   speculation_length=_pick(config, "speculation_length"),
                   base_model_name_or_path=_pick(config, "base_model_name_or_path"),
                   tied_lm_head=bool(_pick(config, "tied_lm_head")),
                   vocab_size=_pick(config, "vocab_size"))

    def to_dict(self) -> dict:
        """FasterDecoding/Medusa names, plus ``medusa_tree`` / ``medusa_speculation_length`` when set.

        The tree is stored as its paths only: ``from_dict`` rebuilds it with ``num_heads`` = the config's
        and ``top_k`` = its largest rank + 1.
        """
        out = {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers}
        if self.tree is not None:
            out["medusa_tree"] = self.tree.to_list()
        if self.speculation_length is not None:
            out["medusa_speculation_length"] = self.speculation_length
        if self.base_model_name_or_path is not None:
            out["base_model_name_or_path"] = self.base_model_name_or_path
        if self.tied_lm_head:
            out["medusa_tied_lm_head"] = True
        if self.vocab_size is not None:
            out["medusa_vocab_size"] = self.vocab_size
        return out


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))``; weight and bias start at zero, so a fresh block is the identity.

    (FasterDecoding/Medusa zeroes only the weight; zeroing the bias too makes a fresh head exactly the
    LM head, since SiLU(0) = 0.)
    """

    def __init__(self, hidden_size: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, dtype=dtype, device=device)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` Medusa heads; ``heads[i]`` = Sequential(ResBlock x num_layers, Linear(H, V, bias=False)).

    ``lm_head_weight`` [V, H], if given, initialises every head's projection (the Medusa recipe);
    ``self.heads.state_dict()`` is the FasterDecoding/Medusa layout (``save_heads`` / ``load_heads``).
    ``tied=True``: all heads share that one projection (the same Parameter, not saved: see the module
    docstring); ``token_ids`` [V] (tied only): logit column c scores token ``token_ids[c]`` (a reduced
    vocabulary, the LM head's rows ``token_ids``).
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 lm_head_weight: torch.Tensor | None = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tied: bool = False,
                 token_ids: torch.Tensor | None = None):
        super().__init__()
        _check_int("num_heads", num_heads, 1)
        _check_int("num_layers", num_layers, 0)
        if tied and lm_head_weight is None:
            raise ValueError("tied heads need lm_head_weight (the target's LM head rows they project with)")
        if token_ids is not None and (not tied or tuple(token_ids.shape) != (vocab_size,)):
            raise ValueError(f"token_ids must be a [{vocab_size}] tensor of tied heads, got shape "
                             f"{tuple(token_ids.shape)} (tied={tied})")
        self.tied = tied
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size, dtype=dtype, device=device) for _ in range(num_layers)),
                          nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype, device=device))
            for _ in range(num_heads))
        if token_ids is not None:
            self.register_buffer("token_ids", token_ids.to(device=device, dtype=torch.long))
        if lm_head_weight is not None:
            if tuple(lm_head_weight.shape) != (vocab_size, hidden_size):
                raise ValueError(f"lm_head_weight has shape {tuple(lm_head_weight.shape)}, expected "
                                 f"(vocab_size, hidden_size) = ({vocab_size}, {hidden_size})")
            with torch.no_grad():
                self.heads[0][-1].weight.copy_(lm_head_weight)
                for head in self.heads[1:]:
                    if tied:
                        head[-1].weight = self.heads[0][-1].weight
                    else:
                        head[-1].weight.copy_(lm_head_weight)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def num_layers(self) -> int:
        return len(self.heads[0]) - 1

    @property
    def hidden_size(self) -> int:
        return self.heads[0][-1].in_features

    @property
    def vocab_size(self) -> int:
        """Columns of each head's logits (a reduced vocabulary's size when ``token_ids`` is set)."""
        return self.heads[0][-1].out_features

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: hidden states are cast to it (a quantized projection's, not its codes')."""
        return compute_dtype(self.heads[0][-1])

    @property
    def quantized(self) -> bool:
        """Whether any ResBlock linear or projection is a quantized layer (``quantize``)."""
        return any(not isinstance(layer, nn.Linear) for head in self.heads
                   for layer in (*(block.linear for block in head[:-1]), head[-1]))

    def quantize(self, scheme: str | None) -> MedusaHeads:
        """Quantize in place as a target quantized with ``scheme`` (canonical name, ``parse_quantization``):
        "int8" / "int4": each ResBlock's ``linear`` [H, H] with the scheme, each vocabulary projection
        [V, H] at per-channel int8 (as the target's LM head; tied heads keep one projection, now one
        ``Int8Linear`` shared by every head); None / "gguf": nothing (float stays float).

        int4 needs H divisible by 32 (and 16): otherwise ``Int4Linear.from_linear``'s ValueError (use
        int8), not a silent fallback. It cannot fire for heads of a target that int4 quantized itself, as
        that target's MLP has H as in features of gate/up and out features of down.
        """
        return quantize_linears(self, scheme, names=("linear",), head_names=(str(self.num_layers),))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, n, H] (final-norm hidden states) → logits [B, n, num_heads, V] float32.

        logits[b, t, h] scores token t + h + 2 (column c: token ``token_ids[c]`` when reduced). Any
        leading dims work ([..., H] → [..., num_heads, V]).
        """
        x = hidden.to(self.dtype)
        if self.tied:   # one matmul with the shared projection for all heads
            blocks = torch.stack([head[:-1](x) for head in self.heads], dim=-2)
            return self.heads[0][-1](blocks).float()
        return torch.stack([head(x).float() for head in self.heads], dim=-2)

    def candidates(self, hidden: torch.Tensor, top_k: int) -> torch.Tensor:
        """hidden [B, H] → each head's ``top_k`` token ids [B, num_heads, top_k] (rank order)."""
        ranks = self(hidden).topk(top_k, dim=-1).indices
        token_ids = getattr(self, "token_ids", None)
        return ranks if token_ids is None else token_ids[ranks]


def load_medusa_config(directory: str | os.PathLike) -> MedusaConfig:
    """``MedusaConfig.from_dict`` of ``directory/config.json``."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no Medusa config: {path} does not exist")
    return MedusaConfig.from_dict(json.loads(path.read_text()))


def _read_weights(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    for name in (WEIGHTS_NAME, WEIGHTS_NAME_PT):
        path = directory / name
        if path.is_file():
            if name == WEIGHTS_NAME:
                return path, load_file(path)
            return path, torch.load(path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no Medusa weights in {directory}: expected {WEIGHTS_NAME} or {WEIGHTS_NAME_PT}")


def _expected_shapes(num_heads: int, num_layers: int, hidden: int, vocab: int,
                     with_projection: bool = True) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for i in range(num_heads):
        for j in range(num_layers):
            shapes[f"{i}.{j}.linear.weight"] = (hidden, hidden)
            shapes[f"{i}.{j}.linear.bias"] = (hidden,)
        if with_projection:
            shapes[f"{i}.{num_layers}.weight"] = (vocab, hidden)
    return shapes


def load_heads(directory: str | os.PathLike, config: MedusaConfig | None = None, *,
               hidden_size: int | None = None, vocab_size: int | None = None,
               dtype: torch.dtype | None = None, device: torch.device | str | None = None,
               lm_head_weight: torch.Tensor | None = None) -> MedusaHeads:
    """Load heads saved in the FasterDecoding/Medusa layout (see the module docstring).

    ``config`` defaults to ``load_medusa_config(directory)``. ``hidden_size`` / ``vocab_size`` (the
    target's) default to the shape of head 0's projection. ``dtype`` defaults to the checkpoint's.
    Tied heads (``medusa_tied_lm_head``) need ``lm_head_weight``, the target's full LM head [V, H].
    KeyError naming missing tensors; ValueError naming a tensor of the wrong shape (expected vs found)
    or tensors the config does not account for.
    """
    directory = Path(directory)
    config = load_medusa_config(directory) if config is None else config
    path, state = _read_weights(directory)
    where = f"(config: medusa_num_heads={config.num_heads}, medusa_num_layers={config.num_layers})"
    token_ids = state.pop("token_ids", None)
    if config.tied_lm_head:
        if lm_head_weight is None:
            raise ValueError(f"{directory} holds tied Medusa heads (medusa_tied_lm_head): pass the target's LM "
                             "head as lm_head_weight (MedusaDraft.from_pretrained does)")
        if (token_ids is None) != (config.vocab_size is None) or \
                (token_ids is not None and token_ids.numel() != config.vocab_size):
            raise ValueError(f"{path}: token_ids ({None if token_ids is None else token_ids.numel()} entries) "
                             f"does not match medusa_vocab_size={config.vocab_size}")
        if token_ids is not None and (int(token_ids.min()) < 0 or int(token_ids.max()) >= lm_head_weight.shape[0]):
            raise ValueError(f"{path}: token_ids fall outside the target's vocabulary [0, {lm_head_weight.shape[0]})")
        proj_weight = lm_head_weight if token_ids is None else lm_head_weight[token_ids]
        hidden_size, vocab_size = proj_weight.shape[1], proj_weight.shape[0]
    else:
        proj = f"0.{config.num_layers}.weight"
        if proj not in state:
            raise KeyError(f"{path} is missing tensor {proj!r} {where}")
        vocab_size = state[proj].shape[0] if vocab_size is None else vocab_size
        hidden_size = state[proj].shape[-1] if hidden_size is None else hidden_size
    expected = _expected_shapes(config.num_heads, config.num_layers, hidden_size, vocab_size,
                                with_projection=not config.tied_lm_head)
    missing = [k for k in expected if k not in state]
    if missing:
        raise KeyError(f"{path} is missing tensor(s) {', '.join(missing)} {where}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{path} has tensor(s) the config does not account for: {', '.join(unexpected)} {where}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"tensor {name!r} in {path} has shape {tuple(state[name].shape)}, expected {shape}")
    if dtype is None:
        dtype = next(iter(state.values())).dtype if state else proj_weight.dtype
    heads = MedusaHeads(hidden_size, vocab_size, config.num_heads, config.num_layers,
                        proj_weight.to(dtype) if config.tied_lm_head else None, dtype=dtype, device=device,
                        tied=config.tied_lm_head, token_ids=token_ids)
    heads.heads.load_state_dict(state, strict=not config.tied_lm_head)
    return heads


def save_heads(heads: MedusaHeads, directory: str | os.PathLike, config: MedusaConfig | None = None) -> None:
    """Write ``config.json`` and ``medusa_lm_head.safetensors`` in the FasterDecoding/Medusa layout
    (tied heads: the ResBlocks and ``token_ids`` only, see the module docstring).

    ``config`` (e.g. to record the tree) defaults to the heads' own counts and must agree with them.
    """
    if heads.quantized:
        raise ValueError("quantized Medusa heads cannot be saved in the FasterDecoding/Medusa layout (float "
                         "tensors): save the float heads; loading them for a quantized target quantizes them")
    token_ids = getattr(heads, "token_ids", None)
    if config is None:
        config = MedusaConfig(heads.num_heads, heads.num_layers, tied_lm_head=heads.tied,
                              vocab_size=None if token_ids is None else token_ids.numel())
    if (config.num_heads, config.num_layers, config.tied_lm_head) != (heads.num_heads, heads.num_layers, heads.tied):
        raise ValueError(f"config has {config.num_heads} heads x {config.num_layers} layers "
                         f"(tied={config.tied_lm_head}) but the module has {heads.num_heads} x {heads.num_layers} "
                         f"(tied={heads.tied})")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in heads.heads.state_dict().items()
             if not (heads.tied and k.endswith(f".{heads.num_layers}.weight"))}
    if token_ids is not None:
        state["token_ids"] = token_ids.detach().cpu().long().contiguous()
    save_file(state, directory / WEIGHTS_NAME)
    (directory / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
