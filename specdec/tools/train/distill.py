"""Distil a small draft from a target on the target's own generations (``specdec.tools.train.data``).

The draft is a Llama checkpoint with the target's hidden size, ``len(init_layers)`` decoder layers
initialised from the target's layers, the target's final norm, and a reduced output vocabulary
(``draft_vocab_size`` N, ``output_token_ids`` [N]): the N most frequent answer tokens of the data
(+ EOS and special tokens, filled up with the lowest token ids, i.e. the earliest BPE merges). Its
input embedding and ``lm_head`` (= the target's embedding rows of those tokens) stay frozen: they
are recomputable from the target, so only the layers, the norm and the token ids are shipped.

Loss: cross-entropy towards the target's argmax next token (hard labels) on answer positions;
positions whose label is outside the reduced vocabulary are ignored (the draft can never propose
it, so those steps are rejected whatever it predicts). AdamW + warmup + cosine decay, seeded;
``ckpt.pt`` every ``save_every`` steps, on Ctrl-C and at the end; a restart resumes from it with the
same data order (batch order is a function of seed and epoch), so an interrupted run ends where an
uninterrupted one does.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ...core.checkpoint import checkpoint_shards, iter_tensors
from .store import save_atomic


@dataclass
class DraftSpec:
    init_layers: list[int] = field(default_factory=lambda: [0, 1])   # target layers to copy (-1 = last)
    draft_vocab_size: int = 8192
    intermediate_size: int | None = None   # None = the target's


@dataclass
class OptimConfig:
    """Optimisation settings shared by the trainers (AdamW, warmup + cosine decay, checkpoints)."""

    steps: int = 720
    batch_rows: int = 16
    lr: float = 2e-3
    warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 45
    eval_every: int = 90
    heldout_fraction: float = 0.05
    max_len: int = 512
    bf16: bool = True     # autocast the forward/backward to bf16 (master weights stay f32)


@dataclass
class TrainConfig(OptimConfig):
    soft_weight: float = 0.5   # loss = (1 - w) * CE(argmax label) + w * CE(target top-k distribution)


# ----------------------------------------------------------------------------- vocabulary
def choose_vocab(rows: list[dict], size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """``size`` token ids: ``always`` + the most frequent labels on answer positions, filled up with the
    lowest unused ids. Sorted ascending."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        p = r["prompt_len"]
        counts += torch.bincount(r["labels"][p - 1:-1], minlength=vocab_size)
        counts += torch.bincount(r["tokens"], minlength=vocab_size)  # contexts: a weaker signal
    score = counts.double() + (1.0 - torch.arange(vocab_size, dtype=torch.double) / vocab_size)  # tie-break: low ids
    score[torch.tensor(sorted(set(always)), dtype=torch.long)] = float("inf")
    ids = score.topk(min(size, vocab_size)).indices
    return ids.sort().values


def target_vocab(rows: list[dict], target_dir: Path, size: int) -> torch.Tensor:
    """``choose_vocab`` for the target checkpoint in ``target_dir`` (its EOS / special tokens always in)."""
    from ...core.config import ModelConfig
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError):
        tok = None
    config = ModelConfig.from_dir(target_dir)
    return choose_vocab(rows, size, config.vocab_size, special_ids(tok, config))


def special_ids(tokenizer, config) -> list[int]:
    ids = set(config.eos_token_ids)
    if tokenizer is not None:
        ids.update(tokenizer.all_special_ids)
    return sorted(i for i in ids if i is not None and i >= 0)


# ----------------------------------------------------------------------------- draft construction
def load_target_state(target_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in iter_tensors(checkpoint_shards(target_dir))}


def draft_config(target_dir: Path, spec: DraftSpec) -> dict:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg.update(num_hidden_layers=len(spec.init_layers), tie_word_embeddings=False,
               draft_vocab_size=spec.draft_vocab_size, architectures=["LlamaForCausalLM"])
    if spec.intermediate_size:
        cfg["intermediate_size"] = spec.intermediate_size
    cfg.pop("_name_or_path", None)
    return cfg


def init_draft_state(target_state: dict, target_cfg: dict, spec: DraftSpec) -> dict:
    """Trainable tensors of the draft (layers + final norm), initialised from the target."""
    n_target = target_cfg["num_hidden_layers"]
    state = {"model.norm.weight": target_state["model.norm.weight"].clone()}
    for j, src in enumerate(spec.init_layers):
        src = src % n_target
        prefix = f"model.layers.{src}."
        for k, v in target_state.items():
            if k.startswith(prefix):
                v = v.clone()
                if spec.intermediate_size and "mlp" in k:  # keep the first rows/cols of the MLP
                    i = spec.intermediate_size
                    v = v[:, :i].clone() if "down_proj" in k else v[:i].clone()
                state[f"model.layers.{j}." + k[len(prefix):]] = v
    return state


def frozen_tensors(target_state: dict, token_ids: torch.Tensor) -> dict:
    embed = target_state["model.embed_tokens.weight"]
    head = target_state.get("lm_head.weight", embed)
    return {"model.embed_tokens.weight": embed, "lm_head.weight": head[token_ids].clone()}


class DraftTrainer(torch.nn.Module):
    """HF ``LlamaModel`` (the draft's layers) + a frozen reduced head, for training."""

    def __init__(self, cfg: dict, trainable: dict, frozen: dict):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel
        hf = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("draft_vocab_size", "architectures")})
        hf._attn_implementation = "sdpa"
        with torch.device("meta"):
            self.model = LlamaModel(hf)
        self.model = self.model.to_empty(device="cpu")
        self.model.rotary_emb.__init__(hf)  # recompute inv_freq (lost by to_empty)
        state = {k[len("model."):]: v for k, v in {**trainable, **frozen}.items() if k.startswith("model.")}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not [m for m in missing if "inv_freq" not in m] and not unexpected, (missing, unexpected)
        self.model.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("head", frozen["lm_head.weight"].float())

    def trainable_state(self) -> dict:
        return {"model." + k: v.detach().clone() for k, v in self.model.state_dict().items()
                if k != "embed_tokens.weight" and "inv_freq" not in k}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=ids).last_hidden_state
        return hidden @ self.head.T.to(hidden.dtype)


# ----------------------------------------------------------------------------- batches
def split_rows(rows: list[dict], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of the training rows and of the held-out rows (each ascending).

    A row is held out when a seeded hash of its tokens falls in the lowest ``fraction`` of the hash
    range, so where a row goes does not depend on the other rows: when the data grows (a token store
    gains shards) every held-out row stays held out, and a run continued on the grown data (``--init``)
    is still measured on rows it was never trained on. With two rows or more at least one is held out
    (the lowest hash)."""
    key = seed.to_bytes(8, "little", signed=True)
    hashes = [int.from_bytes(hashlib.blake2b(r["tokens"].to(torch.int64).numpy().tobytes(), digest_size=8,
                                             key=key).digest(), "little") / 2.0 ** 64 for r in rows]
    held = [i for i, h in enumerate(hashes) if h < fraction]
    if not held and len(rows) > 1 and fraction > 0:
        held = [min(range(len(rows)), key=hashes.__getitem__)]
    held_set = set(held)
    return [i for i in range(len(rows)) if i not in held_set], held


def make_batch(rows: list[dict], index_of: torch.Tensor, max_len: int, soft: bool = False):
    """ids [b, L] (right-padded) and targets [b, L] in reduced-vocab indices (-100 = ignored); with
    ``soft``, also the target's top-k as reduced indices [b, L, k] (-1 = outside) and probabilities."""
    L = min(max(len(r["tokens"]) for r in rows), max_len)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    tgt = torch.full((len(rows), L), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        t, lab, p = r["tokens"][:L], r["labels"][:L], r["prompt_len"]
        ids[i, : len(t)] = t
        end = min(len(r["tokens"]) - 1, L)  # positions p-1 .. len-2 predict the answer tokens
        if end > p - 1:
            tgt[i, p - 1:end] = index_of[lab[p - 1:end]]
    if not soft:
        return ids, tgt
    k = rows[0]["topk_ids"].shape[1]
    sid = torch.full((len(rows), L, k), -1, dtype=torch.long)
    sp = torch.zeros(len(rows), L, k)
    for i, r in enumerate(rows):
        n = min(len(r["tokens"]), L)
        m = index_of[r["topk_ids"][:n].long()]
        sid[i, :n] = m.clamp(min=-1)
        sp[i, :n] = r["topk_probs"][:n].float() * (m >= 0)
    sp = sp / sp.sum(-1, keepdim=True).clamp(min=1e-6)
    return ids, tgt, sid, sp


def distill_loss(logits: torch.Tensor, tgt: torch.Tensor, soft_ids, soft_p, soft_weight: float) -> torch.Tensor:
    mask = tgt >= 0
    if not mask.any():
        return logits.sum() * 0
    logp = logits.float()[mask].log_softmax(-1)
    hard = F.nll_loss(logp, tgt[mask])
    if soft_ids is None or soft_weight <= 0:
        return hard
    ids, p = soft_ids[mask], soft_p[mask]
    soft = -(torch.gather(logp, 1, ids.clamp(min=0)) * p).sum(-1).mean()
    return (1 - soft_weight) * hard + soft_weight * soft


def batch_order(n_rows: int, batch_rows: int, seed: int, epoch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    perm = torch.randperm(n_rows, generator=g).tolist()
    return [perm[i:i + batch_rows] for i in range(0, n_rows - batch_rows + 1, batch_rows)] or [perm]


def lr_at(step: int, cfg: OptimConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


@torch.no_grad()
def evaluate(trainer: DraftTrainer, rows: list[dict], index_of: torch.Tensor, cfg: TrainConfig) -> dict:
    """Top-1 agreement with the target's argmax on answer positions of held-out rows (labels outside
    the reduced vocabulary count as misses), and the share of labels inside the vocabulary."""
    hits = total = inside = 0
    loss_sum = 0.0
    for i in range(0, len(rows), cfg.batch_rows):
        ids, tgt = make_batch(rows[i:i + cfg.batch_rows], index_of, cfg.max_len)
        full = torch.full_like(tgt, -100)
        for j, r in enumerate(rows[i:i + cfg.batch_rows]):
            p, n = r["prompt_len"], min(len(r["tokens"]) - 1, ids.shape[1])
            if n > p - 1:
                full[j, p - 1:n] = 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = trainer(ids).float()
        answer = full != -100
        pred = logits.argmax(-1)
        hits += int(((pred == tgt) & (tgt >= 0)).sum())
        inside += int((tgt >= 0).sum())
        total += int(answer.sum())
        if (tgt >= 0).any():
            loss_sum += float(F.cross_entropy(logits[tgt >= 0], tgt[tgt >= 0], reduction="sum"))
    return {"agreement": hits / max(total, 1), "in_vocab": inside / max(total, 1),
            "loss": loss_sum / max(inside, 1), "positions": total}


# ----------------------------------------------------------------------------- training
def make_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig,
                   ckpt: dict | None) -> tuple[torch.optim.Optimizer, int]:
    """AdamW over ``params`` and the step to start from: 0, or the checkpoint's (state restored)."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    if ckpt is None:
        return opt, 0
    opt.load_state_dict(ckpt["optimizer"])
    return opt, ckpt["step"]


def run_steps(step: int, cfg: OptimConfig, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
              batch_loss, save, on_eval, ckpt_file: Path, desc: str, progress: bool, stop_after: int | None,
              log) -> None:
    """The optimisation loop every trainer shares, from ``step`` to ``cfg.steps`` (or ``stop_after``
    more steps): ``batch_loss(step)`` → (loss, tqdm postfix); warmup + cosine learning rate
    (``lr_at``), gradient clipping, an optimiser step. ``save(step)`` every ``save_every`` steps, at
    the end and on Ctrl-C (then re-raised; ``ckpt_file`` is named in the message);
    ``on_eval(step, smoothed_loss, seconds)`` every ``eval_every`` steps and at the last one."""
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, unit="step", disable=not progress)
    start, loss_avg = time.perf_counter(), None
    stop_at = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
    try:
        while step < stop_at:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            loss, postfix = batch_loss(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            value = float(loss.detach())
            loss_avg = value if loss_avg is None else 0.9 * loss_avg + 0.1 * value
            bar.update()
            bar.set_postfix(loss=f"{loss_avg:.3f}", **postfix)
            if step % cfg.save_every == 0 or step == cfg.steps:
                save(step)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                on_eval(step, loss_avg, time.perf_counter() - start)
    except KeyboardInterrupt:
        save(step)
        bar.close()
        log(f"interrupted: checkpoint saved at step {step} in {ckpt_file}; run again to resume")
        raise
    bar.close()
    save(step)


@torch.no_grad()
def calibrate_norm(trainer: DraftTrainer, rows: list[dict], index_of: torch.Tensor, cfg: TrainConfig, log) -> float:
    """Scale the final norm (copied from the target, whose deep features it expects) so the draft's
    first logits are not over-confident: the factor with the lowest loss on ``rows`` wins."""
    ids, tgt = make_batch(rows, index_of, cfg.max_len)
    mask = tgt >= 0
    if not mask.any():
        return 1.0
    w = trainer.model.norm.weight
    base = w.detach().clone()
    best = (float("inf"), 1.0)
    for c in (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0):
        w.copy_(base * c)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = float(F.cross_entropy(trainer(ids).float()[mask], tgt[mask]))
        best = min(best, (loss, c))
    w.copy_(base * best[1])
    log(json.dumps({"norm_scale": best[1], "initial_loss": best[0]}))
    return best[1]


@torch.enable_grad()  # callers (the CLI) may have disabled autograd globally
def train_draft(data_dir: str | Path, out_dir: str | Path, target_dir: str | Path, spec: DraftSpec,
                cfg: TrainConfig, progress: bool = True, log=print, stop_after: int | None = None) -> Path:
    """Train (or resume training) a draft; writes ``out_dir/ckpt.pt`` (resumable state) and
    ``out_dir/train_log.jsonl``. ``stop_after``: return (checkpoint saved) after that many steps of
    this call, as an interruption would. Returns ``out_dir``."""
    from .data import load_dataset

    out_dir, target_dir = Path(out_dir), Path(target_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_file = out_dir / "ckpt.pt"
    rows = [r for r in load_dataset(data_dir) if len(r["tokens"]) > r["prompt_len"]]
    if not rows:
        raise ValueError(f"no training rows in {data_dir}")
    train_idx, held_idx = split_rows(rows, cfg.heldout_fraction, cfg.seed)
    train_rows, held = [rows[i] for i in train_idx], [rows[i] for i in held_idx]
    target_cfg = json.loads((target_dir / "config.json").read_text())
    vocab_size = target_cfg["vocab_size"]
    target_state = load_target_state(target_dir)

    ckpt = torch.load(ckpt_file, weights_only=False) if ckpt_file.is_file() else None
    if ckpt is not None:
        if ckpt["spec"] != asdict(spec) or ckpt["config"]["seed"] != cfg.seed:
            raise ValueError(f"{ckpt_file} was trained with other settings ({ckpt['spec']}, seed "
                             f"{ckpt['config']['seed']}); use another --out")
        token_ids = ckpt["output_token_ids"]
    else:
        token_ids = target_vocab(train_rows, target_dir, spec.draft_vocab_size)
    index_of = torch.full((vocab_size,), -100, dtype=torch.long)
    index_of[token_ids] = torch.arange(len(token_ids))
    dcfg = draft_config(target_dir, spec)
    dcfg["draft_vocab_size"] = len(token_ids)
    torch.manual_seed(cfg.seed)
    trainable = ckpt["model"] if ckpt is not None else init_draft_state(target_state, target_cfg, spec)
    trainer = DraftTrainer(dcfg, trainable, frozen_tensors(target_state, token_ids))
    if ckpt is None:
        calibrate_norm(trainer, train_rows[: cfg.batch_rows * 2], index_of, cfg, log)
    params = [p for p in trainer.parameters() if p.requires_grad]
    opt, step = make_optimizer(params, cfg, ckpt)

    def save(step: int) -> None:
        state = {"step": step, "model": trainer.trainable_state(), "optimizer": opt.state_dict(),
                 "output_token_ids": token_ids, "spec": asdict(spec), "config": asdict(cfg),
                 "draft_config": dcfg}
        save_atomic(state, ckpt_file)

    log_file = out_dir / "train_log.jsonl"
    per_epoch = len(batch_order(len(train_rows), cfg.batch_rows, cfg.seed, 0))

    def record(entry):
        with log_file.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        log(json.dumps(entry))

    probe = train_rows[:16]
    if ckpt is None:
        record({"step": 0, "train_rows": len(train_rows), "heldout_rows": len(held), "vocab": len(token_ids),
                "train_probe_loss": evaluate(trainer, probe, index_of, cfg)["loss"],
                **evaluate(trainer, held, index_of, cfg)})
    tokens_seen = 0

    def batch_loss(step: int):
        nonlocal tokens_seen
        epoch, i = divmod(step, per_epoch)
        batch = [train_rows[j] for j in batch_order(len(train_rows), cfg.batch_rows, cfg.seed, epoch)[i]]
        soft = cfg.soft_weight > 0 and all("topk_ids" in r for r in batch)
        ids, tgt, *soft_t = make_batch(batch, index_of, cfg.max_len, soft)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = trainer(ids)
        tokens_seen += int((tgt >= 0).sum())
        return distill_loss(logits, tgt, *(soft_t or (None, None)), cfg.soft_weight), \
            {"lr": f"{lr_at(step, cfg):.1e}"}

    def on_eval(step: int, loss_avg: float, seconds: float) -> None:
        trainer.eval()
        record({"step": step, "train_loss": loss_avg, "seconds": seconds, "tokens": tokens_seen,
                "lr": lr_at(step - 1, cfg), "train_probe_loss": evaluate(trainer, probe, index_of, cfg)["loss"],
                **evaluate(trainer, held, index_of, cfg)})
        trainer.train()

    trainer.train()
    run_steps(step, cfg, params, opt, batch_loss, save, on_eval, ckpt_file, "training draft", progress, stop_after, log)
    return out_dir
