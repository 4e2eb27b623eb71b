"""Shared by the trainers that learn from the target's hidden states (EAGLE, Medusa): the training rows,
the target features cache, the per-step row selection and the run bookkeeping.

- ``training_rows``: the rows of a ``specdec.tools.train.data`` data set (or of a token store, unlabelled)
  with at least two answer tokens;
- ``compute_features`` / ``load_features``: the target's final-norm hidden state at every position of
  every row (with ``feature_layers``, EAGLE-3: followed by the hidden states entering those layers, as
  the runtime graph's ``hidden`` output), from one teacher-forced forward of the runtime in the serving
  dtype, cached once in ``features.pt`` (``load_features`` checks a cache against the rows, so one made
  from the same data, e.g. another trainer's, can be linked);
- ``step_rows``: the rows of an optimisation step (``batch_order`` of its epoch: a restart resumes with
  the same batch order);
- ``check_resume_settings`` (a checkpoint resumes only with its own settings) and ``jsonl_recorder``
  (``train_log.jsonl``).
"""
from __future__ import annotations

import gc
import json
from dataclasses import asdict
from pathlib import Path

import torch

from .distill import OptimConfig, batch_order
from .store import save_atomic


@torch.no_grad()
def compute_features(rows: list[dict], target_dir: Path, out_file: Path, amp: str = "bf16",
                     batch_rows: int = 32, progress: bool = True,
                     feature_layers: tuple[int, ...] = (), device: str = "cpu") -> list[torch.Tensor]:
    """The target's final-norm hidden states [len, H] of every row (runtime forward in ``amp``), with A
    ``feature_layers`` followed by the hidden states entering them: [len, H·(1+A)]; cached in ``out_file``
    and read back from it memory-mapped (several GB for a large store: pages the OS can drop and
    re-read, not process memory). ``device``: where the target runs (the cache holds CPU tensors)."""
    if out_file.is_file():
        return torch.load(out_file, weights_only=True, mmap=True)
    from ...core.decoder import DecoderModel
    from .data import prefill_hidden
    longest = max(len(r["tokens"]) for r in rows)
    model = DecoderModel.from_pretrained(target_dir, batch_size=batch_rows, n_positions=longest, amp=amp,
                                         backend="eager", device=device, feature_layers=feature_layers,
                                         progress=False)
    feats = [None] * len(rows)
    for i, hidden in prefill_hidden(model, [r["tokens"] for r in rows], progress, "target features"):
        feats[i] = hidden.to("cpu", copy=True)
    save_atomic(feats, out_file)
    del feats, model
    gc.collect()
    return torch.load(out_file, weights_only=True, mmap=True)


def training_rows(data_dir: str | Path) -> list[dict]:
    """The rows of ``data_dir`` with at least two answer tokens (``load_dataset`` format; a token store's rows
    come without labels, ``store_rows``); ValueError if none."""
    from .data import load_dataset, store_rows
    from .store import is_store
    rows = [r for r in (store_rows(data_dir) if is_store(data_dir) else load_dataset(data_dir))
            if len(r["tokens"]) > r["prompt_len"] + 1]
    if not rows:
        raise ValueError(f"no training rows in {data_dir}")
    return rows


def load_features(rows: list[dict], target_dir: Path, out_file: Path, progress: bool = True,
                  feature_layers: tuple[int, ...] = (), device: str = "cpu") -> list[torch.Tensor]:
    """``compute_features`` (or its cache ``out_file``), checked against ``rows`` and ``feature_layers``:
    one [len(tokens), H·(1+A)] tensor per row, in order; ValueError naming the cache when it holds other
    rows' features or another number of layers'."""
    feats = compute_features(rows, target_dir, out_file, progress=progress, feature_layers=feature_layers,
                             device=device)
    width = json.loads((Path(target_dir) / "config.json").read_text())["hidden_size"] * (1 + len(feature_layers))
    if len(feats) != len(rows) or any(f.shape != (len(r["tokens"]), width) for r, f in zip(rows, feats)):
        raise ValueError(f"{out_file} holds features of other rows or layers ({len(feats)} rows, the data has "
                         f"{len(rows)}, or their lengths / widths differ from {width}): delete it (or link the "
                         "cache made from this data and these layers)")
    return feats


def check_resume_settings(ckpt: dict, cfg: OptimConfig, ckpt_file: Path,
                          free: tuple[str, ...] = ("steps", "save_every", "eval_every")) -> None:
    """ValueError unless checkpoint ``ckpt`` was trained with ``cfg`` (dataclass), up to the ``free`` fields."""
    if {k: v for k, v in ckpt["config"].items() if k not in free} != \
            {k: v for k, v in asdict(cfg).items() if k not in free}:
        raise ValueError(f"{ckpt_file} was trained with other settings ({ckpt['config']}); use another --out")


def step_rows(step: int, train_idx: list[int], cfg: OptimConfig) -> list[int]:
    """The rows (indices into the data) of optimisation step ``step``: ``batch_order`` of its epoch."""
    per_epoch = len(batch_order(len(train_idx), cfg.batch_rows, cfg.seed, 0))
    epoch, i = divmod(step, per_epoch)
    return [train_idx[j] for j in batch_order(len(train_idx), cfg.batch_rows, cfg.seed, epoch)[i]]


def jsonl_recorder(out_dir: Path, log):
    """``record(entry)``: append ``entry`` to ``out_dir/train_log.jsonl`` and ``log`` it as JSON."""
    def record(entry: dict) -> None:
        with (out_dir / "train_log.jsonl").open("a") as f:
            f.write(json.dumps(entry) + "\n")
        log(json.dumps(entry))
    return record
