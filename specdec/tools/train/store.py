"""The kept token data: the target's own answers (and the prompts it synthesised) as token ids.

Generating answers is the slow part of making draft training data; labels and features are not:
they come from one prefill over the tokens (``specdec.tools.train.data.label_sequences``). So only the
tokens are kept, in a *token store*: a directory of shards, one per generated batch,

    <store>/answers-s<seed>-<batch:05d>.npz      e.g. answers-s0-00000.npz

The repository keeps the embedded model's store in the specdec-assets distribution,
``assets/specdec_assets/train/tokens/smollm2-135m-instruct`` (``embedded_store()``); ``specdec train-draft
--store DIR`` appends shards to a store (a restart or a larger ``--num-prompts`` generates only the batches not
there yet) and ``--data DIR`` on a store trains from it without generating anything.

Shard format (``numpy.savez_compressed``; every array 1-D, one entry per row unless noted):

- ``tokens``: all rows' token ids concatenated (prompt then answer), uint16 when the vocabulary has
  at most 65,536 ids, else int32;
- ``lengths`` int32: tokens per row; ``prompt_lens`` int32: the prompt's share of them (chat
  template included; the answer follows it, ending at EOS or the token budget);
- ``sampled`` bool: answered with sampling (else greedy);
- ``meta``: a JSON string (0-d array): ``format`` (1), ``kind`` ("answers"), ``model`` (the target's
  name), ``vocab_size``, ``seed``, ``batch`` (index), ``settings`` (the ``DataConfig`` fields the
  tokens depend on), ``categories`` (one per row), ``seconds`` and ``answer_tokens``.

A shard is written to a temporary file and renamed, so an interrupted run leaves no partial shard.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...speculation.assets import asset_path

FORMAT = 1
SHARD_RE = re.compile(r"answers-s(\d+)-(\d{5})\.npz$")


def embedded_store() -> Path:
    """The repository's token store for the embedded SmolLM2-135M-Instruct (specdec-assets)."""
    return asset_path("train", "tokens", "smollm2-135m-instruct")


def save_atomic(obj, path: str | Path) -> None:
    """``torch.save(obj, path)`` through a temporary file renamed over ``path``: an interrupted save
    (Ctrl-C, a crash) leaves the previous file or none, never half of one (checkpoints, data batches,
    feature caches)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


@dataclass
class Shard:
    """One shard: rows of token ids with their prompt lengths and sampling flags, plus ``meta``."""

    tokens: list[torch.Tensor]
    prompt_lens: list[int]
    sampled: list[bool]
    meta: dict = field(default_factory=dict)


def shard_name(seed: int, batch: int) -> str:
    return f"answers-s{seed}-{batch:05d}.npz"


def is_store(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding at least one shard."""
    path = Path(path)
    return path.is_dir() and any(SHARD_RE.match(f.name) for f in path.iterdir())


def shard_files(store: str | Path) -> list[Path]:
    """The store's shards, ordered by (seed, batch)."""
    store = Path(store)
    if not store.is_dir():
        return []
    found = [(tuple(map(int, m.groups())), f) for f in store.iterdir() if (m := SHARD_RE.match(f.name))]
    return [f for _, f in sorted(found)]


def write_shard(store: str | Path, seed: int, batch: int, shard: Shard, vocab_size: int) -> Path:
    """Write ``shard`` as ``answers-s<seed>-<batch>.npz`` into ``store`` (created if needed); returns
    the file. Token ids must lie in [0, vocab_size)."""
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    flat = torch.cat([t.reshape(-1).long() for t in shard.tokens]) if shard.tokens else torch.zeros(0, dtype=torch.long)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size})")
    dtype = np.uint16 if vocab_size <= 2**16 else np.int32
    meta = {"format": FORMAT, "kind": "answers", "vocab_size": vocab_size, "seed": seed, "batch": batch,
            **shard.meta}
    out = store / shard_name(seed, batch)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez_compressed(tmp, tokens=flat.numpy().astype(dtype),
                        lengths=np.array([len(t) for t in shard.tokens], dtype=np.int32),
                        prompt_lens=np.array(shard.prompt_lens, dtype=np.int32),
                        sampled=np.array(shard.sampled, dtype=bool), meta=np.array(json.dumps(meta)))
    tmp.replace(out)
    return out


def read_shard(path: str | Path) -> Shard:
    """A shard's rows (int64 token tensors) and meta."""
    with np.load(path, allow_pickle=False) as z:
        flat = torch.from_numpy(z["tokens"].astype(np.int64))
        lengths = z["lengths"].tolist()
        meta = json.loads(str(z["meta"]))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: token-store format {meta.get('format')!r}, this version reads {FORMAT}")
        tokens = list(torch.split(flat, lengths)) if lengths else []
        return Shard(tokens, z["prompt_lens"].tolist(), z["sampled"].tolist(), meta)


def read_store(store: str | Path) -> list[tuple[Path, Shard]]:
    """Every shard of ``store`` (ordered by seed, then batch); ValueError when there is none."""
    files = shard_files(store)
    if not files:
        raise ValueError(f"{store} holds no token shards (answers-s<seed>-<batch>.npz)")
    return [(f, read_shard(f)) for f in files]


def store_summary(store: str | Path) -> dict:
    """Shards, rows, answer tokens and total tokens of a store."""
    shards = [s for _, s in read_store(store)]
    rows = sum(len(s.tokens) for s in shards)
    total = sum(len(t) for s in shards for t in s.tokens)
    answer = sum(len(t) - p for s in shards for t, p in zip(s.tokens, s.prompt_lens))
    return {"shards": len(shards), "rows": rows, "tokens": total, "answer_tokens": answer}
