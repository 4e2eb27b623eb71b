"""Train an EAGLE-1 draft for a target on the target's own generations and features.

Data: the batches of ``specdec.train.data`` (the same synthetic prompts and target answers as the
vanilla draft; never MT-Bench). Features: the target's final-norm hidden state at every position of
every row, from one teacher-forced forward of the runtime in the serving dtype (``features.pt``,
computed once; ``specdec.train.features``, shared with the Medusa trainer).

Model: ``fc`` (2H → H) + one Llama layer initialised from the target's layer ``init_layer`` with its
input RMSNorm (``eagle_input_norm``), frozen target embedding, frozen LM-head rows of a reduced
vocabulary (``choose_vocab``, as the vanilla draft).

Training-time unrolling over ``unroll`` drafting steps (the draft's own features fed back, as at
inference). Step s at position i reads (f^(s-1)_i, t_{i+1}) — step 1 the true feature f_i, step s > 1
the step-(s-1) output at i-1 — and attends to the true pairs at j <= i-s+1 and to its own chain
(step r's entry at i-(s-r), r = 2..s): exactly the draft's KV cache at inference when it drafts its
s-th token. The output at i predicts f_{i+1}:

    loss = sum_s decay^(s-1) * [ SmoothL1(f^_s, f_{i+1}) + cls_weight * CE(p_target(.|i+1), softmax(head(f^_s))) ]

on positions whose predicted token t_{i+2} is an answer token. p_target = softmax of the target's
LM head on f_{i+1} over the reduced vocabulary. AdamW + warmup + cosine; ``ckpt.pt`` every
``save_every`` steps, on Ctrl-C and at the end; restarts resume with the same batch order.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ..core.model import apply_rope, rms_norm, rope_inv_freq, rope_tables
from .distill import OptimConfig, load_target_state, lr_at, make_optimizer, run_steps, split_rows, target_vocab
from .features import check_resume_settings, jsonl_recorder, load_features, step_rows, training_rows


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


# ----------------------------------------------------------------------------- model
class EagleTrainer(torch.nn.Module):
    """Trainable EAGLE draft (parameter names = the shipped checkpoint keys) with an unrolled,
    cache-free forward for training."""

    def __init__(self, target_cfg: dict, trainable: dict, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        from transformers import LlamaConfig
        from ..core.config import ModelConfig
        h = target_cfg["hidden_size"]
        self.n_heads = target_cfg["num_attention_heads"]
        self.n_kv = target_cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = target_cfg.get("head_dim") or h // self.n_heads
        self.eps = target_cfg["rms_norm_eps"]
        self.params = torch.nn.ParameterDict({k.replace(".", "/"): torch.nn.Parameter(v.float().clone())
                                              for k, v in trainable.items()})
        self.register_buffer("embed", embed.float())
        self.register_buffer("head", head.float())
        cfg = ModelConfig.from_hf(LlamaConfig(**{k: v for k, v in target_cfg.items()
                                                 if k not in ("architectures", "draft_vocab_size")}))
        inv_freq, self.rope_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq)

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "/")]

    def state(self) -> dict[str, torch.Tensor]:
        return {k.replace("/", "."): v.detach().clone() for k, v in self.params.items()}

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, unroll: int) -> list[torch.Tensor]:
        """tokens [b, L] (t_{i+1} at i), features [b, L, H] (true f_i) → predicted features per
        unroll step, each [b, L, H] (step s at position i predicts f_{i+1}; i < s-1 is invalid)."""
        b, L, _ = features.shape
        dev = features.device
        cos, sin = rope_tables(torch.arange(L, device=dev).unsqueeze(0), self.inv_freq, self.rope_scaling,
                               torch.float32)   # [1, L, D]
        e = F.embedding(tokens, self.embed)
        keys, values, outs = [], [], []
        feat = features
        for s in range(1, unroll + 1):
            if s > 1:   # position i reads the previous step's prediction made at i-1
                feat = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], 1)
            x = F.linear(torch.cat([e, feat], -1), self.p("fc.weight"), self.params.get("fc/bias"))
            h = rms_norm(x, self.p("layers.0.input_layernorm.weight"), self.eps)
            q = F.linear(h, self.p("layers.0.self_attn.q_proj.weight")).view(b, L, self.n_heads, self.head_dim)
            k = F.linear(h, self.p("layers.0.self_attn.k_proj.weight")).view(b, L, self.n_kv, self.head_dim)
            v = F.linear(h, self.p("layers.0.self_attn.v_proj.weight")).view(b, L, self.n_kv, self.head_dim)
            c, sn = cos.to(q.dtype).unsqueeze(2), sin.to(q.dtype).unsqueeze(2)
            q, k = apply_rope(q, c, sn), apply_rope(k, c, sn)
            keys.append(k.transpose(1, 2))
            values.append(v.transpose(1, 2))
            mask = unrolled_mask(L, s, dev)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat(keys, 2), torch.cat(values, 2),
                                                 attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
            x = x + F.linear(att.transpose(1, 2).reshape(b, L, -1), self.p("layers.0.self_attn.o_proj.weight"))
            m = rms_norm(x, self.p("layers.0.post_attention_layernorm.weight"), self.eps)
            mlp = F.silu(F.linear(m, self.p("layers.0.mlp.gate_proj.weight"))) * F.linear(m, self.p("layers.0.mlp.up_proj.weight"))
            x = x + F.linear(mlp, self.p("layers.0.mlp.down_proj.weight"))
            outs.append(x)
        return outs


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
def make_batch(rows, feats, index, max_len: int):
    """tokens [b, L] (t_{i+1}), features [b, L, H] (f_i), target features [b, L, H] (f_{i+1}),
    valid [b, L] (t_{i+2} is an answer token)."""
    L = min(max(len(rows[i]["tokens"]) for i in index) - 1, max_len)
    H = feats[index[0]].shape[-1]
    tok = torch.zeros(len(index), L, dtype=torch.long)
    f = torch.zeros(len(index), L, H)
    f_next = torch.zeros(len(index), L, H)
    valid = torch.zeros(len(index), L, dtype=torch.bool)
    for j, i in enumerate(index):
        t, ft, p = rows[i]["tokens"], feats[i].float(), rows[i]["prompt_len"]
        n = min(len(t) - 1, L)
        tok[j, :n] = t[1:n + 1]
        f[j, :n] = ft[:n]
        f_next[j, :n] = ft[1:n + 1]
        lo = max(p - 2, 0)
        valid[j, lo:max(n - 1, lo)] = True   # i in [p-2, len-3]: t_{i+2} is in the answer
    return tok, f, f_next, valid


def eagle_loss(trainer: EagleTrainer, batch, cfg: EagleTrainConfig) -> tuple[torch.Tensor, list[float]]:
    """Total loss and the per-step top-1 agreement with the target's argmax (reduced vocabulary)."""
    tok, f, f_next, valid = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
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
        reg = F.smooth_l1_loss(pred[sel].float(), f_next[valid][sel])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = (pred[sel] @ trainer.head.T).float()
        cls = -(target_p[sel] * logits.log_softmax(-1)).sum(-1).mean()
        total = total + cfg.step_decay ** (s - 1) * (reg + cfg.cls_weight * cls)
        agree.append(float((logits.argmax(-1) == target_top[sel]).float().mean()))
    return total, agree


@torch.no_grad()
def evaluate(trainer, rows, feats, index, cfg, prefix: str = "") -> dict:
    """Mean loss and per-step top-1 agreement with the target's argmax over ``index`` (rows)."""
    sums, loss_sum, n = None, 0.0, 0
    for s in range(0, len(index), cfg.batch_rows):
        idx = index[s:s + cfg.batch_rows]
        loss, agree = eagle_loss(trainer, make_batch(rows, feats, idx, cfg.max_len), cfg)
        sums = agree if sums is None else [a + b for a, b in zip(sums, agree)]
        loss_sum, n = loss_sum + float(loss), n + 1
    return {f"{prefix}loss": loss_sum / n, **{f"{prefix}agree_step{s + 1}": a / n for s, a in enumerate(sums)}}


# ----------------------------------------------------------------------------- training
def init_state(target_state: dict, target_cfg: dict, cfg: EagleTrainConfig, g: torch.Generator) -> dict:
    """fc = [identity on the embedding | small random on the feature], bias 0; the layer (with its
    input norm) copied from target layer ``init_layer``."""
    h = target_cfg["hidden_size"]
    src = cfg.init_layer % target_cfg["num_hidden_layers"]
    prefix = f"model.layers.{src}."
    state = {"layers.0." + k[len(prefix):]: v.clone() for k, v in target_state.items() if k.startswith(prefix)}
    state["fc.weight"] = torch.cat([torch.eye(h), torch.randn(h, h, generator=g) * (0.5 / h ** 0.5)], 1)
    state["fc.bias"] = torch.zeros(h)
    return state


@torch.enable_grad()
def train_eagle(data_dir: str | Path, out_dir: str | Path, target_dir: str | Path, cfg: EagleTrainConfig,
                progress: bool = True, log=print, stop_after: int | None = None) -> Path:
    """Train (or resume) an EAGLE draft; ``out_dir/ckpt.pt``, ``out_dir/train_log.jsonl``."""
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = training_rows(data_dir)
    feats = load_features(rows, target_dir, out_dir / "features.pt", progress=progress)
    train_idx, held_idx = split_rows(list(range(len(rows))), cfg.heldout_fraction, cfg.seed)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    target_state = load_target_state(target_dir)
    ckpt_file = out_dir / "ckpt.pt"
    ckpt = torch.load(ckpt_file, weights_only=False) if ckpt_file.is_file() else None
    if ckpt is not None:
        check_resume_settings(ckpt, cfg, ckpt_file)
        token_ids = ckpt["output_token_ids"]
    else:
        token_ids = target_vocab([rows[i] for i in train_idx], target_dir, cfg.draft_vocab_size)
    g = torch.Generator().manual_seed(cfg.seed)
    trainable = ckpt["model"] if ckpt is not None else init_state(target_state, target_cfg, cfg, g)
    embed = target_state["model.embed_tokens.weight"]
    head = target_state.get("lm_head.weight", embed)[token_ids]
    trainer = EagleTrainer(target_cfg, trainable, embed, head)
    params = list(trainer.params.values())
    opt, step = make_optimizer(params, cfg, ckpt)

    def save(step: int) -> None:
        tmp = ckpt_file.with_suffix(".tmp")
        torch.save({"step": step, "model": trainer.state(), "optimizer": opt.state_dict(),
                    "output_token_ids": token_ids, "config": asdict(cfg), "target_config": target_cfg}, tmp)
        tmp.replace(ckpt_file)

    record = jsonl_recorder(out_dir, log)
    probe = train_idx[:16]

    def scores() -> dict:
        return {**evaluate(trainer, rows, feats, probe, cfg, "train_probe_"), **evaluate(trainer, rows, feats, held_idx, cfg)}

    if ckpt is None:
        record({"step": 0, "train_rows": len(train_idx), "heldout_rows": len(held_idx), "vocab": len(token_ids),
                **scores()})

    def batch_loss(step: int):
        index = step_rows(step, train_idx, cfg)
        loss, agree = eagle_loss(trainer, make_batch(rows, feats, index, cfg.max_len), cfg)
        return loss, {"agree": f"{agree[0]:.2f}"}

    def on_eval(step: int, loss_avg: float, seconds: float) -> None:
        record({"step": step, "train_loss": loss_avg, "seconds": seconds, "lr": lr_at(step - 1, cfg), **scores()})

    run_steps(step, cfg, params, opt, batch_loss, save, on_eval, ckpt_file, "training EAGLE draft", progress, stop_after, log)
    return out_dir


def export_eagle(ckpt_file: str | Path, ship_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Ship directory in the EAGLE-1 layout: config.json (one-layer Llama config with
    ``eagle_input_norm`` and ``draft_vocab_size``) + model.safetensors (fc, layers.0, output_token_ids;
    no embedding, no LM head — ``copy_lm_head`` adds the target's rows)."""
    ckpt = torch.load(ckpt_file, weights_only=False)
    ship_dir = Path(ship_dir)
    ship_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in ckpt["model"].items()}
    tensors["output_token_ids"] = ckpt["output_token_ids"].long().contiguous()
    cfg = dict(ckpt["target_config"], num_hidden_layers=1, tie_word_embeddings=False, eagle_input_norm=True,
               draft_vocab_size=len(ckpt["output_token_ids"]), architectures=["LlamaForCausalLM"],
               dtype=str(dtype).removeprefix("torch."))
    cfg.pop("_name_or_path", None)
    save_file(tensors, ship_dir / "model.safetensors", metadata={"format": "pt", "step": str(ckpt["step"])})
    (ship_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return ship_dir
