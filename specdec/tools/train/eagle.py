"""Train an EAGLE-1 or EAGLE-3 draft for a target on the target's own generations and features.

Data: the batches of ``specdec.tools.train.data`` (the same synthetic prompts and target answers as the
vanilla draft; never MT-Bench). Features: the target's final-norm hidden state at every position of
every row — EAGLE-3: followed by the hidden states entering its aux layers (``aux_layers``, default
(2, L//2, L-3)) — from one teacher-forced forward of the runtime in the serving dtype (``features.pt``,
computed once; ``specdec.tools.train.features``, shared with the Medusa trainer).

Model (``arch="eagle1"``): ``fc`` (2H → H) + one Llama layer initialised from the target's layer
``init_layer`` with its input RMSNorm (``eagle_input_norm``), frozen target embedding, frozen LM-head
rows of a reduced vocabulary (``choose_vocab``, as the vanilla draft).
Model (``arch="eagle3"``, ``specdec.eagle.model.Eagle3LM``): ``fc`` (A·H → H, initialised to pass the
highest aux layer) projects the aux hidden states to the first step's feature; one layer whose q/k/v
read [norm(embedding) | hidden_norm(feature)] (2H), its residual stream starting at the feature; a
final norm and the draft's own LM head over the reduced vocabulary (trained, initialised from the
target's rows); frozen target embedding.

Training-time unrolling over ``unroll`` drafting steps (the draft's own features fed back, as at
inference). Step s at position i reads (f^(s-1)_i, t_{i+1}) — step 1 the true feature f_i, step s > 1
the step-(s-1) output at i-1 — and attends to the true pairs at j <= i-s+1 and to its own chain
(step r's entry at i-(s-r), r = 2..s): exactly the draft's KV cache at inference when it drafts its
s-th token. The output at i predicts f_{i+1}:

    EAGLE-1: loss = sum_s decay^(s-1) * [ SmoothL1(f^_s, f_{i+1})
                                          + cls_weight * CE(p_target(.|i+1), softmax(head(f^_s))) ]
    EAGLE-3: loss = sum_s decay^(s-1) * CE(p_target(.|i+1), softmax(lm_head(norm(x_s))))   (no feature regression)

on positions whose predicted token t_{i+2} is an answer token. p_target = softmax of the target's
LM head on f_{i+1} over the reduced vocabulary. (EAGLE-3's step 1 reads fc(aux_i); later steps read
the previous step's output x before the final norm, as ``Eagle3LM`` drafts.) AdamW + warmup + cosine;
``ckpt.pt`` every ``save_every`` steps, on Ctrl-C and at the end; restarts resume with the same batch
order. ``export_eagle`` writes the EAGLE-1 layout or (EAGLE-3) the public EAGLE-3 layout.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ...core.model import apply_rope, grouped_query_attention, rms_norm, rope_inv_freq, rope_tables, split_hidden
from ...core.ship import pack_int8
from ...eagle.checkpoint import EAGLE3_ARCHITECTURE, aux_layer_ids
from .distill import (
    OptimConfig,
    load_target_state,
    lr_at,
    make_optimizer,
    run_steps,
    split_rows,
    target_vocab,
)
from .features import check_resume_settings, jsonl_recorder, load_features, step_rows, training_rows
from .store import save_atomic

ARCHS = ("eagle1", "eagle3")


@dataclass
class EagleTrainConfig(OptimConfig):
    steps: int = 450
    lr: float = 1e-3
    warmup: int = 20
    save_every: int = 50
    eval_every: int = 100
    unroll: int = 3          # drafting steps simulated per position (training-time test)
    step_decay: float = 0.8
    cls_weight: float = 0.1
    draft_vocab_size: int = 8192
    init_layer: int = 0      # target layer the draft's layer starts from (layer 0 reads embeddings, as fc's init)
    arch: str = "eagle1"     # "eagle1" or "eagle3"
    aux_layers: tuple[int, ...] = ()   # EAGLE-3: target layers whose input hidden states fc reads; () = (2, L//2, L-3)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r}: use one of {', '.join(ARCHS)}")
        self.aux_layers = tuple(self.aux_layers)


def resolve_aux_layers(cfg: EagleTrainConfig, target_cfg: dict) -> tuple[int, ...]:
    """The target layers an EAGLE-3 draft of ``cfg`` reads (``()`` for EAGLE-1), checked against the target."""
    if cfg.arch != "eagle3":
        return ()
    given = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers)}} if cfg.aux_layers else {}
    return tuple(sorted(aux_layer_ids(given, target_cfg["num_hidden_layers"])))


# ----------------------------------------------------------------------------- model
class EagleTrainer(torch.nn.Module):
    """Trainable EAGLE draft (parameter names = the shipped checkpoint keys; EAGLE-3 when they hold
    ``layers.0.hidden_norm.weight``) with an unrolled, cache-free forward for training. ``head``: the
    target's LM-head rows of the reduced vocabulary (EAGLE-1's output head; the target distribution)."""

    def __init__(self, target_cfg: dict, trainable: dict, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        from transformers import LlamaConfig

        from ...core.config import ModelConfig
        h = target_cfg["hidden_size"]
        self.n_heads = target_cfg["num_attention_heads"]
        self.n_kv = target_cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = target_cfg.get("head_dim") or h // self.n_heads
        self.eps = target_cfg["rms_norm_eps"]
        self.params = torch.nn.ParameterDict({k.replace(".", "/"): torch.nn.Parameter(v.float().clone())
                                              for k, v in trainable.items()})
        self.eagle3 = "layers.0.hidden_norm.weight" in trainable
        self.register_buffer("embed", embed.float())
        self.register_buffer("head", head.float())
        cfg = ModelConfig.from_hf(LlamaConfig(**{k: v for k, v in target_cfg.items()
                                                 if k not in ("architectures", "draft_vocab_size")}))
        inv_freq, self.rope_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq)

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "/")]

    def state(self) -> dict[str, torch.Tensor]:
        return {k.replace("/", "."): v.detach().to("cpu", copy=True) for k, v in self.params.items()}

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, unroll: int) -> list[torch.Tensor]:
        """tokens [b, L] (t_{i+1} at i), features [b, L, F] (true inputs at i: EAGLE-1 f_i [H], EAGLE-3
        the aux hidden states [A·H]) → the layer's outputs per unroll step, each [b, L, H] (step s at
        position i predicts f_{i+1} / token i+2; i < s-1 is invalid)."""
        b, L, _ = features.shape
        dev = features.device
        cos, sin = rope_tables(torch.arange(L, device=dev).unsqueeze(0), self.inv_freq, self.rope_scaling,
                               torch.float32)   # [1, L, D]
        e = F.embedding(tokens, self.embed)
        keys, values, outs = [], [], []
        feat = F.linear(features, self.p("fc.weight")) if self.eagle3 else features
        for s in range(1, unroll + 1):
            if s > 1:   # position i reads the previous step's prediction made at i-1
                feat = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], 1)
            x, h = self.layer_input(e, feat)
            q = F.linear(h, self.p("layers.0.self_attn.q_proj.weight")).view(b, L, self.n_heads, self.head_dim)
            k = F.linear(h, self.p("layers.0.self_attn.k_proj.weight")).view(b, L, self.n_kv, self.head_dim)
            v = F.linear(h, self.p("layers.0.self_attn.v_proj.weight")).view(b, L, self.n_kv, self.head_dim)
            c, sn = cos.to(q.dtype).unsqueeze(2), sin.to(q.dtype).unsqueeze(2)
            q, k = apply_rope(q, c, sn), apply_rope(k, c, sn)
            keys.append(k.transpose(1, 2))
            values.append(v.transpose(1, 2))
            mask = unrolled_mask(L, s, dev)
            att = grouped_query_attention(q.transpose(1, 2), torch.cat(keys, 2), torch.cat(values, 2), mask)
            x = x + F.linear(att.transpose(1, 2).reshape(b, L, -1), self.p("layers.0.self_attn.o_proj.weight"))
            m = rms_norm(x, self.p("layers.0.post_attention_layernorm.weight"), self.eps)
            mlp = (F.silu(F.linear(m, self.p("layers.0.mlp.gate_proj.weight")))
                   * F.linear(m, self.p("layers.0.mlp.up_proj.weight")))
            x = x + F.linear(mlp, self.p("layers.0.mlp.down_proj.weight"))
            outs.append(x)
        return outs

    def layer_input(self, e: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream [b, L, H], attention input [b, L, H or 2H]) from embeddings e and features feat
        [b, L, H]: EAGLE-1 x = fc([e | f]) and norm(x); EAGLE-3 f and [norm(e) | hidden_norm(f)]."""
        if self.eagle3:
            return feat, torch.cat([rms_norm(e, self.p("layers.0.input_layernorm.weight"), self.eps),
                                    rms_norm(feat, self.p("layers.0.hidden_norm.weight"), self.eps)], -1)
        x = F.linear(torch.cat([e, feat], -1), self.p("fc.weight"), self.params.get("fc/bias"))
        return x, rms_norm(x, self.p("layers.0.input_layernorm.weight"), self.eps)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Reduced-vocabulary logits [..., N] of layer outputs x [..., H] (EAGLE-3: final norm, own head)."""
        if self.eagle3:
            return rms_norm(x, self.p("norm.weight"), self.eps) @ self.p("lm_head.weight").T
        return x @ self.head.T


def unrolled_mask(L: int, s: int, device) -> torch.Tensor:
    """[L, s*L] bool: query i of step s sees the true entries j <= i-s+1 and, for r = 2..s, step
    r's entry at i-(s-r) (its own drafting chain)."""
    i = torch.arange(L, device=device).unsqueeze(1)
    j = torch.arange(L, device=device).unsqueeze(0)
    parts = [j <= i - s + 1] + [j == i - (s - r) for r in range(2, s + 1)]
    mask = torch.cat(parts, 1)
    mask[:, 0] |= ~mask.any(1)   # rows with nothing visible (invalid positions): avoid NaN
    return mask


# ----------------------------------------------------------------------------- batches and loss
def make_batch(rows, feats, index, max_len: int, hidden_size: int):
    """tokens [b, L] (t_{i+1}), inputs [b, L, F] (f_i; with aux hidden states in ``feats``: those,
    A·H), target features [b, L, H] (f_{i+1}), valid [b, L] (t_{i+2} is an answer token). ``feats``:
    the cached rows [len, H] or [len, H·(1+A)] (``split_hidden``); the batch is made on their device."""
    L = min(max(len(rows[i]["tokens"]) for i in index) - 1, max_len)
    width, dev = feats[index[0]].shape[-1], feats[index[0]].device
    tok = torch.zeros(len(index), L, dtype=torch.long, device=dev)
    f = torch.zeros(len(index), L, width if width == hidden_size else width - hidden_size, device=dev)
    f_next = torch.zeros(len(index), L, hidden_size, device=dev)
    valid = torch.zeros(len(index), L, dtype=torch.bool, device=dev)
    for j, i in enumerate(index):
        t, p = rows[i]["tokens"], rows[i]["prompt_len"]
        final, aux = split_hidden(feats[i].float(), hidden_size)
        n = min(len(t) - 1, L)
        tok[j, :n] = t[1:n + 1]
        f[j, :n] = (final if aux is None else aux)[:n]
        f_next[j, :n] = final[1:n + 1]
        lo = max(p - 2, 0)
        valid[j, lo:max(n - 1, lo)] = True   # i in [p-2, len-3]: t_{i+2} is in the answer
    return tok, f, f_next, valid


def eagle_loss(trainer: EagleTrainer, batch, cfg: EagleTrainConfig) -> tuple[torch.Tensor, list[float]]:
    """Total loss and the per-step top-1 agreement with the target's argmax (reduced vocabulary)."""
    tok, f, f_next, valid = batch
    autocast = torch.autocast(tok.device.type, dtype=torch.bfloat16, enabled=cfg.bf16)
    with autocast:
        outs = trainer(tok, f, cfg.unroll)
        target_logits = (f_next[valid] @ trainer.head.T).float()
    target_p = target_logits.softmax(-1)
    target_top = target_logits.argmax(-1)
    total, agree = 0.0, []
    for s, out in enumerate(outs, start=1):
        ok = valid.clone()
        ok[:, : s - 1] = False
        sel = ok[valid]
        pred = out[valid]
        with autocast:
            logits = trainer.logits(pred[sel]).float()
        cls = -(target_p[sel] * logits.log_softmax(-1)).sum(-1).mean()
        if trainer.eagle3:
            step_loss = cls
        else:
            step_loss = F.smooth_l1_loss(pred[sel].float(), f_next[valid][sel]) + cfg.cls_weight * cls
        total = total + cfg.step_decay ** (s - 1) * step_loss
        agree.append(float((logits.argmax(-1) == target_top[sel]).float().mean()))
    return total, agree


@torch.no_grad()
def evaluate(trainer, rows, feats, index, cfg, prefix: str = "") -> dict:
    """Mean loss and per-step top-1 agreement with the target's argmax over ``index`` (rows)."""
    sums, loss_sum, n = None, 0.0, 0
    for s in range(0, len(index), cfg.batch_rows):
        idx = index[s:s + cfg.batch_rows]
        loss, agree = eagle_loss(trainer, make_batch(rows, feats, idx, cfg.max_len, trainer.head.shape[1]), cfg)
        sums = agree if sums is None else [a + b for a, b in zip(sums, agree)]
        loss_sum, n = loss_sum + float(loss), n + 1
    return {f"{prefix}loss": loss_sum / n, **{f"{prefix}agree_step{s + 1}": a / n for s, a in enumerate(sums)}}


# ----------------------------------------------------------------------------- training
def init_state(target_state: dict, target_cfg: dict, cfg: EagleTrainConfig, g: torch.Generator,
               head: torch.Tensor | None = None) -> dict:
    """The layer (with its input norm) copied from target layer ``init_layer``. EAGLE-1: fc = [identity on
    the embedding | small random on the feature], bias 0. EAGLE-3 (``head``: the target's LM-head rows
    [N, H] of the reduced vocabulary): q/k/v = [W | W] / 2 over [embedding | feature], ``hidden_norm``
    = the input norm, fc = [small random | ... | identity on the highest aux layer], the target's final
    norm and ``head`` as the draft's own."""
    h = target_cfg["hidden_size"]
    src = cfg.init_layer % target_cfg["num_hidden_layers"]
    prefix = f"model.layers.{src}."
    state = {"layers.0." + k[len(prefix):]: v.clone() for k, v in target_state.items() if k.startswith(prefix)}
    if cfg.arch == "eagle1":
        state["fc.weight"] = torch.cat([torch.eye(h), torch.randn(h, h, generator=g) * (0.5 / h ** 0.5)], 1)
        state["fc.bias"] = torch.zeros(h)
        return state
    aux = len(resolve_aux_layers(cfg, target_cfg))
    for name in ("q_proj", "k_proj", "v_proj"):
        w = state[f"layers.0.self_attn.{name}.weight"]
        state[f"layers.0.self_attn.{name}.weight"] = torch.cat([w, w], 1) / 2
    state["layers.0.hidden_norm.weight"] = state["layers.0.input_layernorm.weight"].clone()
    state["fc.weight"] = torch.cat([torch.randn(h, (aux - 1) * h, generator=g) * (0.1 / h ** 0.5), torch.eye(h)], 1)
    state["norm.weight"] = target_state["model.norm.weight"].clone()
    state["lm_head.weight"] = head.clone()
    return state


def init_checkpoint(path: str | Path, cfg: EagleTrainConfig, target_cfg: dict,
                    aux_layers: tuple[int, ...]) -> tuple[dict, torch.Tensor]:
    """The weights and draft vocabulary (``output_token_ids``) of the training checkpoint ``path``, or of
    the shipped draft directory ``path`` (``export_eagle``'s, int8-packed or not: ``read_ship``);
    ValueError unless it is a draft of the same architecture, aux layers and draft vocabulary size for a
    target of this shape."""
    ckpt = read_ship(Path(path)) if Path(path).is_dir() else torch.load(path, weights_only=False, map_location="cpu")
    shape = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if ckpt["target_config"].get(k) is not None]
    theirs = dict(arch=ckpt["config"]["arch"], aux_layers=tuple(ckpt["aux_layers"]),
                  draft_vocab=len(ckpt["output_token_ids"]), target=[ckpt["target_config"][k] for k in shape])
    ours = dict(arch=cfg.arch, aux_layers=aux_layers, draft_vocab=cfg.draft_vocab_size,
                target=[target_cfg[k] for k in shape])
    if theirs != ours:
        raise ValueError(f"--init {path}: a draft with {theirs}, this run trains one with {ours} "
                         "(target: hidden size, vocabulary, layers); start from a matching checkpoint")
    return ckpt["model"], ckpt["output_token_ids"]


def read_ship(ship_dir: Path) -> dict:
    """A directory of ``export_eagle`` as the training checkpoint fields ``init_checkpoint`` reads:
    ``model`` (the trainer's parameter names, f32; int8-packed matrices expanded), ``output_token_ids``
    (in the LM head's row order), ``config`` (arch), ``aux_layers`` and ``target_config`` (hidden size and
    vocabulary; the target's layer count is not in a ship: None, not compared)."""
    from safetensors.torch import load_file

    from ...core.ship import is_packed, unpack_int8

    config_file, weights = ship_dir / "config.json", ship_dir / "model.safetensors"
    if not (config_file.is_file() and weights.is_file()):
        raise ValueError(f"--init {ship_dir}: a shipped draft directory holds config.json and model.safetensors")
    config = json.loads(config_file.read_text())
    tensors = load_file(weights)
    tensors = unpack_int8(tensors, torch.float32) if is_packed(tensors) else tensors
    if "d2t" in tensors:                                   # EAGLE-3: target id = draft id + d2t
        ids = tensors.pop("d2t") + torch.arange(config["draft_vocab_size"])
        tensors.pop("t2d", None)
        arch, aux = "eagle3", tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                   for k, v in tensors.items()}
    else:
        ids, arch, aux = tensors.pop("output_token_ids"), "eagle1", ()
        tensors.pop("lm_head.weight", None)             # copied from the target (copy_lm_head); EAGLE-1 trains none
    model = {k: v.float() for k, v in tensors.items()}
    target = {"hidden_size": config.get("target_hidden_size", config["hidden_size"]),
              "vocab_size": config["vocab_size"], "num_hidden_layers": None}
    return {"model": model, "output_token_ids": ids.long(), "config": {"arch": arch}, "aux_layers": aux,
            "target_config": target}


@torch.enable_grad()
def train_eagle(data_dir: str | Path, out_dir: str | Path, target_dir: str | Path, cfg: EagleTrainConfig,
                progress: bool = True, log=print, stop_after: int | None = None,
                init: str | Path | None = None, device: str = "cpu") -> Path:
    """Train (or resume) an EAGLE draft; ``out_dir/ckpt.pt``, ``out_dir/train_log.jsonl``. ``init``: a new
    run starts from that checkpoint's weights and draft vocabulary (``init_checkpoint``) with a fresh
    optimiser and schedule, e.g. to go on training on a grown token store; a resumed run ignores it.
    ``device`` (e.g. "cuda"): where the target computes the features and the draft trains; the features
    are then held there whole (H·(1+A) bf16 values per token: 11.3 GB for the 2.45M-token store at A = 3);
    the checkpoint is saved with CPU tensors either way, so a run resumes on any device."""
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = training_rows(data_dir)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    aux_layers = resolve_aux_layers(cfg, target_cfg)
    feats = load_features(rows, target_dir, out_dir / "features.pt", progress=progress, feature_layers=aux_layers,
                          device=device)
    feats = [f.to(device) for f in feats]      # the same tensors on the CPU
    train_idx, held_idx = split_rows(rows, cfg.heldout_fraction, cfg.seed)
    target_state = load_target_state(target_dir)
    ckpt_file = out_dir / "ckpt.pt"
    ckpt = torch.load(ckpt_file, weights_only=False, map_location="cpu") if ckpt_file.is_file() else None
    if ckpt is not None:
        check_resume_settings(ckpt, cfg, ckpt_file)
        start, token_ids = ckpt["model"], ckpt["output_token_ids"]
    elif init is not None:
        start, token_ids = init_checkpoint(init, cfg, target_cfg, aux_layers)
    elif "labels" not in rows[0]:
        raise ValueError(f"{data_dir} is a token store without labels: a new run chooses its draft vocabulary from "
                         "the target's labels (label_store; train-eagle --data STORE labels it into OUT/labels), "
                         "or starts from a checkpoint or ship (init)")
    else:
        start, token_ids = None, target_vocab([rows[i] for i in train_idx], target_dir, cfg.draft_vocab_size)
    g = torch.Generator().manual_seed(cfg.seed)
    embed = target_state["model.embed_tokens.weight"]
    head = target_state.get("lm_head.weight", embed)[token_ids]
    trainable = start if start is not None else init_state(target_state, target_cfg, cfg, g, head)
    trainer = EagleTrainer(target_cfg, trainable, embed, head).to(device)
    params = list(trainer.params.values())
    opt, step = make_optimizer(params, cfg, ckpt)

    def save(step: int) -> None:
        save_atomic({"step": step, "model": trainer.state(), "optimizer": opt.state_dict(),
                     "output_token_ids": token_ids, "config": asdict(cfg), "target_config": target_cfg,
                     "aux_layers": aux_layers}, ckpt_file)

    record = jsonl_recorder(out_dir, log)
    probe = train_idx[:16]

    def scores() -> dict:
        return {**evaluate(trainer, rows, feats, probe, cfg, "train_probe_"),
                **evaluate(trainer, rows, feats, held_idx, cfg)}

    if ckpt is None:
        record({"step": 0, "train_rows": len(train_idx), "heldout_rows": len(held_idx), "vocab": len(token_ids),
                **({"init": str(init)} if init is not None else {}), **scores()})

    def batch_loss(step: int):
        index = step_rows(step, train_idx, cfg)
        loss, agree = eagle_loss(trainer, make_batch(rows, feats, index, cfg.max_len, target_cfg["hidden_size"]), cfg)
        return loss, {"agree": f"{agree[0]:.2f}"}

    def on_eval(step: int, loss_avg: float, seconds: float) -> None:
        record({"step": step, "train_loss": loss_avg, "seconds": seconds, "lr": lr_at(step - 1, cfg), **scores()})

    run_steps(step, cfg, params, opt, batch_loss, save, on_eval, ckpt_file, "training EAGLE draft", progress,
              stop_after, log)
    return out_dir


def export_eagle(ckpt_file: str | Path, ship_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                 int8: bool = False) -> Path:
    """Ship directory of a training checkpoint, loadable by ``EagleDraft.from_pretrained``.

    EAGLE-1 layout: config.json (one-layer Llama config with ``eagle_input_norm`` and
    ``draft_vocab_size``) + model.safetensors (fc, layers.0, output_token_ids; no embedding, no LM head —
    ``copy_lm_head`` adds the target's rows). EAGLE-3: the public layout (``specdec.eagle.checkpoint``):
    config.json with ``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``,
    ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``; fc, ``midlayer.*``,
    norm, lm_head (rows in target-id order), ``d2t``, ``t2d``; no embedding.
    ``int8``: matrices stored as int8 with per-row scales (``specdec.core.ship.pack_int8``; half the
    bytes of bf16), a packed file that ``unpack_int8`` expands into the layout above before loading."""
    ckpt = torch.load(ckpt_file, weights_only=False, map_location="cpu")
    ship_dir = Path(ship_dir)
    ship_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in ckpt["model"].items()}
    ids = ckpt["output_token_ids"].long()
    target_cfg = ckpt["target_config"]
    cfg = dict(target_cfg, num_hidden_layers=1, tie_word_embeddings=False, draft_vocab_size=len(ids),
               dtype=str(dtype).removeprefix("torch."))
    if "layers.0.hidden_norm.weight" in tensors:      # EAGLE-3 (as EagleTrainer tells them apart)
        order = ids.argsort()                        # d2t >= 0, as the public checkpoints have it
        ids = ids[order]
        tensors["lm_head.weight"] = tensors["lm_head.weight"][order]
        tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                   for k, v in tensors.items()}
        tensors["d2t"] = ids - torch.arange(len(ids))
        tensors["t2d"] = torch.zeros(target_cfg["vocab_size"], dtype=torch.bool).index_fill(0, ids, True)
        cfg.update(architectures=[EAGLE3_ARCHITECTURE], target_hidden_size=target_cfg["hidden_size"],
                   eagle_config={"eagle_aux_hidden_state_layer_ids": list(ckpt["aux_layers"])})
    else:
        tensors["output_token_ids"] = ids
        cfg.update(architectures=["LlamaForCausalLM"], eagle_input_norm=True)
    tensors = {k: v.contiguous() for k, v in (pack_int8(tensors) if int8 else tensors).items()}
    cfg.pop("_name_or_path", None)
    save_file(tensors, ship_dir / "model.safetensors", metadata={"format": "pt", "step": str(ckpt["step"])})
    (ship_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return ship_dir
