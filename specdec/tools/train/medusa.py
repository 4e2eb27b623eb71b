"""Train Medusa-1 heads for a frozen target on the target's own generations and features.

Data and features are shared with the EAGLE trainer (``specdec.tools.train.features``): the synthetic prompts
and target answers of ``specdec.tools.train.data`` (never MT-Bench) and the target's final-norm hidden state f_t
at every position (``features.pt``, computed once by ``compute_features``; ``train-medusa --features``
links an existing cache of the same rows).

Model: ``MedusaHeads`` with tied projections, the target's LM-head rows of a reduced vocabulary
``token_ids`` (``target_vocab`` on the training rows), frozen; only the ResBlocks train (zero-initialised,
so an untrained head is the LM head itself). Head h (0-based) reads f_t and predicts token t+h+2:

    loss = sum_h head_decay^h * CE(head_h(f_t), column of token t+h+2 in token_ids)

over positions whose token t+h+2 is an answer token inside the reduced vocabulary (the Medusa-1 recipe,
backbone frozen). f32 by default (features upcast); AdamW + warmup + cosine (``run_steps``); ``ckpt.pt``
every ``save_every`` steps, on Ctrl-C and at the end; a restart resumes with the same batch order.

Calibration (``calibrate``): the [num_heads, 10] top-k accuracy matrix (``measure_head_accuracy``) of the
final heads on the held-out rows, ``head_accuracy.json``; ``export_medusa`` builds the shipped tree from it
(``build_tree``) and writes the FasterDecoding/Medusa layout (tied: ResBlocks + ``token_ids`` only).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ...core.checkpoint import target_lm_head
from ...medusa.heads import MedusaConfig, MedusaHeads, save_heads
from ...medusa.tree import build_tree, expected_accept_length, measure_head_accuracy
from ...speculation.tree import TokenTree
from .distill import OptimConfig, lr_at, make_optimizer, run_steps, split_rows, target_vocab
from .features import check_resume_settings, jsonl_recorder, load_features, step_rows, training_rows
from .store import save_atomic

TOP_K = 10            # ranks of the measured accuracy matrix (the trees' top-k)
PROBE_ROWS = 16       # training rows evaluated alongside the held-out rows
EVAL_ROWS = 16        # rows per evaluation batch
ACCURACY_FILE = "head_accuracy.json"


@dataclass
class MedusaTrainConfig(OptimConfig):
    steps: int = 960
    lr: float = 1e-3
    warmup: int = 20
    save_every: int = 80
    eval_every: int = 160
    bf16: bool = False             # f32 training (the bf16 features are upcast)
    num_heads: int = 4
    num_layers: int = 1            # ResBlocks per head
    medusa_vocab_size: int = 8192  # reduced vocabulary (LM-head rows) the heads score
    head_decay: float = 0.8        # loss weight of head h: head_decay ** h (Medusa-1)


# ----------------------------------------------------------------------------- model
def build_heads(lm_head: torch.Tensor, token_ids: torch.Tensor, cfg: MedusaTrainConfig,
                state: dict[str, torch.Tensor] | None = None) -> MedusaHeads:
    """f32 tied heads projecting with ``lm_head`` [V, H] rows ``token_ids`` [V'] (frozen); ResBlocks from
    ``state`` (``trainable_state``) or zero (identity)."""
    heads = MedusaHeads(lm_head.shape[1], len(token_ids), cfg.num_heads, cfg.num_layers,
                        lm_head_weight=lm_head[token_ids].float(), dtype=torch.float32, tied=True,
                        token_ids=token_ids)
    heads.heads[0][-1].weight.requires_grad_(False)   # the shared projection
    if state is not None:
        missing, unexpected = heads.heads.load_state_dict(state, strict=False)
        if unexpected or any(not k.endswith(f".{cfg.num_layers}.weight") for k in missing):
            raise ValueError(f"checkpoint heads do not match the config: missing {missing}, unexpected {unexpected}")
    return heads


def trainable_state(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """The ResBlocks' tensors (``heads.heads`` state-dict names), detached copies."""
    return {k: p.detach().clone() for k, p in heads.heads.named_parameters() if p.requires_grad}


def vocab_index(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] long: the column of each token in ``token_ids``, -1 outside the reduced vocabulary."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[token_ids] = torch.arange(len(token_ids))
    return index


# ----------------------------------------------------------------------------- batches and loss
def make_batch(rows: list[dict], feats: list[torch.Tensor], index: list[int], num_heads: int,
               max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H] f32 (f_t) and targets [N, num_heads] (token t+h+2 for head h, -1 where that is not an
    answer token of the row) at the N positions t of rows ``index`` (first ``max_len`` tokens) where some
    head has a target."""
    offsets = torch.arange(num_heads) + 2
    hidden, targets = [], []
    for i in index:
        tok, p = rows[i]["tokens"][:max_len], rows[i]["prompt_len"]
        n = len(tok)
        lo = max(p - num_heads - 1, 0)
        pos = torch.arange(lo, max(n - 2, lo))
        idx = pos.unsqueeze(1) + offsets
        targets.append(torch.where((idx >= p) & (idx < n), tok[idx.clamp(max=n - 1)], -1))
        hidden.append(feats[i][pos].float())
    return torch.cat(hidden), torch.cat(targets)


def target_columns(targets: torch.Tensor, index_of: torch.Tensor) -> torch.Tensor:
    """targets [N, num_heads] token ids (-1: none) → reduced-vocabulary columns (-1: none or outside)."""
    return torch.where(targets >= 0, index_of[targets.clamp(min=0)], -1)


def head_losses(heads: MedusaHeads, hidden: torch.Tensor, columns: torch.Tensor,
                bf16: bool = False) -> list[tuple[torch.Tensor, int]]:
    """Per head h: (summed cross-entropy over the positions with a column, their count); hidden [N, H],
    columns [N, num_heads] (``target_columns``). Each head runs on its own positions only."""
    out = []
    for h, head in enumerate(heads.heads):
        sel = columns[:, h] >= 0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = head(hidden[sel]).float()
        out.append((F.cross_entropy(logits, columns[sel, h], reduction="sum"), int(sel.sum())))
    return out


def weighted_loss(per_head: list[tuple[torch.Tensor | float, int]], decay: float) -> torch.Tensor | float:
    """sum_h decay^h * (mean cross-entropy of head h) from ``head_losses``-style (sum, count) pairs."""
    return sum(decay ** h * s / max(n, 1) for h, (s, n) in enumerate(per_head))


@torch.no_grad()
def evaluate(heads: MedusaHeads, rows: list[dict], feats: list[torch.Tensor], index: list[int],
             index_of: torch.Tensor, cfg: MedusaTrainConfig, prefix: str = "") -> tuple[dict, torch.Tensor]:
    """Loss, per-head top-1 / top-5 accuracy on answer positions of rows ``index`` (targets outside the
    reduced vocabulary count as misses) and the share inside it; plus the accuracy matrix
    [num_heads, TOP_K] (``measure_head_accuracy`` of ``heads.candidates``)."""
    sums = [[0.0, 0] for _ in heads.heads]
    cands, tgts = [], []
    for s in range(0, len(index), EVAL_ROWS):
        hidden, targets = make_batch(rows, feats, index[s:s + EVAL_ROWS], heads.num_heads, cfg.max_len)
        for acc, (loss, n) in zip(sums, head_losses(heads, hidden, target_columns(targets, index_of), cfg.bf16)):
            acc[0], acc[1] = acc[0] + float(loss), acc[1] + n
        cands.append(heads.candidates(hidden, min(TOP_K, heads.vocab_size)))
        tgts.append(targets)
    targets = torch.cat(tgts)
    matrix = measure_head_accuracy(torch.cat(cands), targets)
    inside = int((target_columns(targets, index_of) >= 0).sum())
    metrics = {"loss": weighted_loss(sums, cfg.head_decay), "top1": matrix[:, 0].tolist(),
               "top5": matrix[:, :5].sum(1).tolist(), "in_vocab": inside / max(int((targets >= 0).sum()), 1)}
    return {prefix + k: v for k, v in metrics.items()}, matrix


# ----------------------------------------------------------------------------- training
@dataclass
class MedusaData:
    """The rows, their features and the split (indices into ``rows``) a run trains and evaluates on."""

    rows: list[dict]
    feats: list[torch.Tensor]
    train_idx: list[int]
    held_idx: list[int]


def load_data(data_dir: str | Path, out_dir: Path, target_dir: Path, cfg: MedusaTrainConfig,
              progress: bool = True, device: str = "cpu") -> MedusaData:
    """``training_rows`` of ``data_dir``, their features (``out_dir/features.pt``, checked; computed by the
    target on ``device``) and the seeded held-out split."""
    rows = training_rows(data_dir)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    feats = load_features(rows, Path(target_dir), Path(out_dir) / "features.pt", progress=progress, device=device)
    return MedusaData(rows, feats, *split_rows(rows, cfg.heldout_fraction, cfg.seed))


def link_features(source: str | Path, out_dir: str | Path) -> Path:
    """Symlink an existing features cache (e.g. the EAGLE run's, made from the same data) as
    ``out_dir/features.pt`` (kept if one exists); ``load_features`` checks it against the rows."""
    source, link = Path(source).resolve(), Path(out_dir) / "features.pt"
    if not source.is_file():
        raise FileNotFoundError(f"no features cache at {source}")
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(source)
    return link


@torch.enable_grad()   # callers (the CLI) may have disabled autograd globally
def train_medusa(data_dir: str | Path, out_dir: str | Path, target_dir: str | Path, cfg: MedusaTrainConfig,
                 progress: bool = True, log=print, stop_after: int | None = None,
                 data: MedusaData | None = None) -> Path:
    """Train (or resume) Medusa heads; ``out_dir/ckpt.pt``, ``out_dir/train_log.jsonl``. ``stop_after``:
    return (checkpoint saved) after that many steps of this call, as an interruption would. ``data``: the
    already loaded ``load_data(data_dir, out_dir, target_dir, cfg)``."""
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = load_data(data_dir, out_dir, target_dir, cfg, progress) if data is None else data
    ckpt_file = out_dir / "ckpt.pt"
    ckpt = torch.load(ckpt_file, weights_only=False) if ckpt_file.is_file() else None
    if ckpt is not None:
        check_resume_settings(ckpt, cfg, ckpt_file)
        token_ids = ckpt["token_ids"]
    else:
        token_ids = target_vocab([data.rows[i] for i in data.train_idx], target_dir, cfg.medusa_vocab_size)
    lm_head = target_lm_head(target_dir).float()
    heads = build_heads(lm_head, token_ids, cfg, None if ckpt is None else ckpt["model"])
    index_of = vocab_index(token_ids, lm_head.shape[0])
    params = [p for p in heads.parameters() if p.requires_grad]
    opt, step = make_optimizer(params, cfg, ckpt)

    def save(step: int) -> None:
        save_atomic({"step": step, "model": trainable_state(heads), "optimizer": opt.state_dict(),
                     "token_ids": token_ids, "config": asdict(cfg), "hidden_size": lm_head.shape[1],
                     "target_vocab_size": lm_head.shape[0]}, ckpt_file)

    record = jsonl_recorder(out_dir, log)
    probe = data.train_idx[:PROBE_ROWS]

    def scores() -> dict:
        train_probe, _ = evaluate(heads, data.rows, data.feats, probe, index_of, cfg, "train_probe_")
        held, matrix = evaluate(heads, data.rows, data.feats, data.held_idx, index_of, cfg)
        return {**train_probe, **held, "head_accuracy": matrix.tolist()}

    if ckpt is None:
        record({"step": 0, "train_rows": len(data.train_idx), "heldout_rows": len(data.held_idx),
                "vocab": len(token_ids), **scores()})

    def batch_loss(step: int):
        hidden, targets = make_batch(data.rows, data.feats, step_rows(step, data.train_idx, cfg), cfg.num_heads,
                                     cfg.max_len)
        per_head = head_losses(heads, hidden, target_columns(targets, index_of), cfg.bf16)
        ce0 = float(per_head[0][0].detach()) / max(per_head[0][1], 1)   # head 0's mean cross-entropy
        return weighted_loss(per_head, cfg.head_decay), {"ce0": f"{ce0:.2f}"}

    def on_eval(step: int, loss_avg: float, seconds: float) -> None:
        record({"step": step, "train_loss": loss_avg, "seconds": seconds, "lr": lr_at(step - 1, cfg), **scores()})

    run_steps(step, cfg, params, opt, batch_loss, save, on_eval, ckpt_file, "training Medusa heads", progress,
              stop_after, log)
    return out_dir


# ----------------------------------------------------------------------------- calibration and export
def save_head_accuracy(matrix: torch.Tensor, path: str | Path, **meta) -> None:
    """Write ``{"head_accuracy": [num_heads][top_k], **meta}`` as JSON (read by ``load_head_accuracy``)."""
    Path(path).write_text(json.dumps({"head_accuracy": matrix.tolist(), **meta}, indent=1) + "\n")


def load_head_accuracy(path: str | Path) -> torch.Tensor:
    """[num_heads, top_k] float64 from a ``head_accuracy.json`` (or a plain JSON list of lists)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no head accuracy file {path} (written by calibrate / specdec train-medusa)")
    value = json.loads(path.read_text())
    matrix = value.get("head_accuracy") if isinstance(value, dict) else value
    if matrix is None:
        raise ValueError(f"{path} has no 'head_accuracy' entry")
    return torch.tensor(matrix, dtype=torch.float64)


def load_checkpoint(ckpt_file: str | Path) -> tuple[dict, MedusaTrainConfig]:
    """A training checkpoint (``ckpt.pt``) and its config."""
    ckpt_file = Path(ckpt_file)
    if not ckpt_file.is_file():
        raise FileNotFoundError(f"no Medusa training checkpoint {ckpt_file} (train first: specdec train-medusa)")
    ckpt = torch.load(ckpt_file, weights_only=False)
    return ckpt, MedusaTrainConfig(**ckpt["config"])


def calibrate(data_dir: str | Path, train_dir: str | Path, target_dir: str | Path, progress: bool = True,
              data: MedusaData | None = None) -> torch.Tensor:
    """The measured accuracy matrix [num_heads, TOP_K] of the heads in ``train_dir/ckpt.pt`` on the held-out
    rows (the synthetic calibration prompts; never MT-Bench), written to ``train_dir/head_accuracy.json``.
    ``data``: the already loaded ``load_data`` of the run."""
    train_dir, target_dir = Path(train_dir), Path(target_dir)
    ckpt, cfg = load_checkpoint(train_dir / "ckpt.pt")
    data = load_data(data_dir, train_dir, target_dir, cfg, progress) if data is None else data
    lm_head = target_lm_head(target_dir).float()
    heads = build_heads(lm_head, ckpt["token_ids"], cfg, ckpt["model"])
    metrics, matrix = evaluate(heads, data.rows, data.feats, data.held_idx,
                               vocab_index(ckpt["token_ids"], lm_head.shape[0]), cfg)
    save_head_accuracy(matrix, train_dir / ACCURACY_FILE, step=ckpt["step"], heldout_rows=len(data.held_idx),
                       source="held-out rows of the synthetic training prompts (not MT-Bench)", **metrics)
    return matrix


def export_medusa(ckpt_file: str | Path, ship_dir: str | Path, num_nodes: int = 31,
                  base_model: str | None = None, accuracy_file: str | Path | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Ship directory in the FasterDecoding/Medusa layout (``save_heads``): tied heads (ResBlocks in ``dtype``
    + ``token_ids``), config with ``base_model_name_or_path`` and the ``num_nodes``-node ``medusa_tree`` built
    from the measured accuracy (``accuracy_file``, default ``head_accuracy.json`` next to the checkpoint),
    which is copied alongside."""
    ckpt, cfg = load_checkpoint(ckpt_file)
    accuracy_file = Path(accuracy_file) if accuracy_file else Path(ckpt_file).parent / ACCURACY_FILE
    tree = build_tree(load_head_accuracy(accuracy_file), num_nodes)
    token_ids = ckpt["token_ids"]
    # the projection is tied (not saved): a placeholder of the right shape stands in for the target's rows
    heads = build_heads(torch.zeros(ckpt["target_vocab_size"], ckpt["hidden_size"]), token_ids, cfg, ckpt["model"])
    config = MedusaConfig(cfg.num_heads, cfg.num_layers, tree=tree, base_model_name_or_path=base_model,
                          tied_lm_head=True, vocab_size=len(token_ids))
    ship_dir = Path(ship_dir)
    save_heads(heads.to(dtype), ship_dir, config)
    if accuracy_file.resolve() != (ship_dir / ACCURACY_FILE).resolve():
        shutil.copyfile(accuracy_file, ship_dir / ACCURACY_FILE)
    return ship_dir


def tree_summary(tree: TokenTree, matrix: torch.Tensor) -> dict:
    """Size, depth, ``expected_accept_length`` under ``matrix`` [num_heads, top_k] and expected τ (1 + it)."""
    length = expected_accept_length(tree, matrix)
    return {"num_nodes": tree.num_nodes, "depth": tree.depth, "expected_accept_length": length,
            "expected_tau": 1.0 + length}
