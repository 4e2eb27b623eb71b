"""``specdec train-eagle``: data generation → target features → EAGLE training → export, resumable.

    specdec train-eagle --out DIR [--data DIR] [--steps 600] [--unroll 3] [--seed 0] [--threads 2] [--ship DIR]
                        [--arch eagle1|eagle3] [--aux-layers 2,15,27] [--init CKPT|SHIP_DIR] [--device cuda]

The data is the same as ``train-draft``'s (``--data`` reuses an existing run's batches, or a token store:
labelled into ``DIR/labels`` for a new run, which chooses its vocabulary from the labels; read as it is
with ``--init`` or when resuming, which need none). ``DIR/train``
holds the target features, the checkpoint and the log; the draft is exported to ``--ship`` (default
``DIR/ship``; the packaged one lives in ``assets/specdec_assets/eagle/smollm2-135m-instruct``) in the EAGLE-1
layout, or with ``--arch eagle3`` in the public EAGLE-3 layout (``--aux-layers``: the target layers
whose input hidden states the draft reads; default (2, L//2, L-3)).
Re-running the same command after an interruption continues where it stopped; ``--init`` starts a new
run from an earlier one's weights or a shipped draft (e.g. after the token store grew). Held-out rows are
chosen by a hash of their tokens, so rows held out before stay held out when the data grows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .cli import add_common_arguments, add_optim_arguments, optim_settings, prepare_data, resolve_target, ship_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .eagle import ARCHS, EagleTrainConfig
    c = EagleTrainConfig()
    add_common_arguments(p)
    g = add_optim_arguments(p, c)
    g.add_argument("--unroll", type=int, default=c.unroll, help="drafting steps simulated in training")
    g.add_argument("--draft-vocab", type=int, default=c.draft_vocab_size, help="reduced LM-head vocabulary size")
    g.add_argument("--arch", choices=ARCHS, default=c.arch,
                   help="eagle1: fc over [embedding | final feature]; eagle3: fc over three target layers' "
                        "hidden states, cross-entropy only, public EAGLE-3 export")
    g.add_argument("--aux-layers", type=_layers, default=c.aux_layers,
                   help="eagle3: comma-separated target layers whose input hidden states the draft reads "
                        "(default 2,L//2,L-3)")
    g.add_argument("--init", default=None, metavar="CKPT",
                   help="start a new run from an earlier run's checkpoint (OUT/train/ckpt.pt) or a shipped draft "
                        "directory (e.g. assets/specdec_assets/eagle/smollm2-135m-instruct-eagle3): its weights and "
                        "draft vocabulary, a fresh optimiser and schedule; e.g. to go on training on a grown token "
                        "store")
    g.add_argument("--ship-int8", action="store_true",
                   help="export the matrices as int8 with per-row scales (half of bf16's bytes; expanded on load "
                        "by specdec.eagle.smollm2)")


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated layer numbers, e.g. 2,15,27") from None


def run(args: argparse.Namespace) -> int:
    from .eagle import EagleTrainConfig, export_eagle, train_eagle
    from .store import is_store

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    ship = Path(args.ship) if args.ship else out / "ship"
    times, start = {}, time.perf_counter()
    if args.data and is_store(args.data) and (args.init or (out / "train" / "ckpt.pt").is_file()):
        data = Path(args.data)     # the vocabulary comes from --init / the checkpoint: no labels needed
    else:
        data = prepare_data(args)
    times["data_s"] = time.perf_counter() - start
    cfg = EagleTrainConfig(unroll=args.unroll, draft_vocab_size=args.draft_vocab, arch=args.arch,
                           aux_layers=args.aux_layers, **optim_settings(args))
    start = time.perf_counter()
    train_eagle(data, out / "train", resolve_target(args), cfg, progress=not args.no_progress,
                log=lambda m: print(m, file=sys.stderr), init=args.init, device=args.device)
    times["train_s"] = time.perf_counter() - start
    export_eagle(out / "train" / "ckpt.pt", ship, int8=args.ship_int8)
    print(json.dumps({"ship": str(ship), "ship_bytes": ship_bytes(ship), **times}))
    return 0
