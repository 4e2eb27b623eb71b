"""``specdec train-medusa``: data → target features → Medusa-1 head training → calibration → export, resumable;
``specdec build-tree``: a Medusa tree from measured head accuracies.

    specdec train-medusa --out DIR [--data DIR] [--features FILE] [--steps 960] [--heads 4] [--seed 0]
                         [--threads 2] [--ship DIR] [--tree-nodes 31]
    specdec build-tree (--accuracy head_accuracy.json | --heads DIR) --num-nodes 31 --out tree.json

The data is the same as ``train-draft``'s (``--data`` reuses an existing run's batches); ``--features`` links
an existing features cache of the same rows (e.g. ``train-eagle``'s ``DIR/train/features.pt``) instead of
recomputing it. ``DIR/train`` holds the features, the checkpoint, the log and ``head_accuracy.json`` (the
heads' measured top-10 accuracy on the held-out synthetic prompts, never MT-Bench); the heads are exported
in the FasterDecoding/Medusa layout with tied projections and the tree built from that accuracy to ``--ship``
(default ``DIR/ship``; the packaged heads live in ``assets/specdec_assets/medusa/smollm2-135m-instruct``).
Re-running the same command after an interruption continues where it stopped.

The packaged heads were made on the shared 2-core machine with the ``train-draft`` data and the
``train-eagle`` run's features (same rows, linked, not recomputed):

    specdec train-medusa --out runs/medusa --data runs/draft/data --features runs/eagle/train/features.pt \
        --threads 2 --ship assets/specdec_assets/medusa/smollm2-135m-instruct

960 steps x 16 rows (~4 epochs, f32): 21.4 min of training (1.2-1.3 s/step plus the evaluations), 2.7 s to
load and check the linked features, 15 s of calibration. Held-out top-1 of heads 0-3: 0.38 / 0.21 / 0.16 /
0.12 (top-5 0.64 / 0.44 / 0.36 / 0.31; untrained: 0.02 / 0.01 / 0.02 / 0.02). Shipped: 2.7 MB, 31-node
tree, expected tau 2.04 (15 / 63 nodes: 1.91 / 2.13).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .cli import add_common_arguments, add_optim_arguments, optim_settings, prepare_data, resolve_target, ship_bytes

TREE_SIZES = (15, 31, 63)   # trees whose expected τ is reported


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .medusa import MedusaTrainConfig
    c = MedusaTrainConfig()
    add_common_arguments(p)
    p.add_argument("--features", default=None,
                   help="existing features cache of the same rows to link (e.g. a train-eagle run's train/features.pt)")
    g = add_optim_arguments(p, c)
    g.add_argument("--heads", type=int, default=c.num_heads, help="number of Medusa heads")
    g.add_argument("--layers", type=int, default=c.num_layers, help="ResBlocks per head")
    g.add_argument("--medusa-vocab", type=int, default=c.medusa_vocab_size, help="reduced vocabulary size")
    g = p.add_argument_group("export")
    g.add_argument("--tree-nodes", type=int, default=31,
                   help="nodes of the shipped tree (built from the accuracy)")
    g.add_argument("--base-model", default=None,
                   help="base_model_name_or_path written to the config "
                        "(default: --model, or the embedded model's name)")


def read_log(train_dir: Path) -> list[dict]:
    """The entries of ``train_dir/train_log.jsonl``."""
    return [json.loads(line) for line in (train_dir / "train_log.jsonl").read_text().splitlines() if line]


def heldout_scores(entry: dict) -> dict:
    """The held-out loss and per-head top-1 / top-5 of a log entry."""
    return {k: entry[k] for k in ("step", "loss", "top1", "top5", "in_vocab")}


def run(args: argparse.Namespace) -> int:
    from ...core.paths import EMBEDDED_MODEL
    from ...medusa.tree import build_tree
    from .medusa import (
        MedusaTrainConfig,
        calibrate,
        export_medusa,
        link_features,
        load_data,
        train_medusa,
        tree_summary,
    )

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    train_dir, ship = out / "train", Path(args.ship) if args.ship else out / "ship"
    progress, log = not args.no_progress, (lambda m: print(m, file=sys.stderr))
    times, start = {}, time.perf_counter()
    data_dir = prepare_data(args)
    target = resolve_target(args)
    times["data_s"] = time.perf_counter() - start
    cfg = MedusaTrainConfig(num_heads=args.heads, num_layers=args.layers, medusa_vocab_size=args.medusa_vocab,
                            **optim_settings(args))
    start = time.perf_counter()
    if args.features:
        link_features(args.features, train_dir)
    data = load_data(data_dir, train_dir, target, cfg, progress, device=args.device)
    times["features_s"] = time.perf_counter() - start
    start = time.perf_counter()
    train_medusa(data_dir, train_dir, target, cfg, progress=progress, log=log, data=data)
    times["train_s"] = time.perf_counter() - start
    start = time.perf_counter()
    matrix = calibrate(data_dir, train_dir, target, progress=progress, data=data)
    times["calibrate_s"] = time.perf_counter() - start
    base_model = args.base_model or args.model or EMBEDDED_MODEL
    export_medusa(train_dir / "ckpt.pt", ship, num_nodes=args.tree_nodes, base_model=base_model)
    entries = [e for e in read_log(train_dir) if "top1" in e]
    print(json.dumps({
        "ship": str(ship), "ship_bytes": ship_bytes(ship), **times,
        "heldout_step0": heldout_scores(entries[0]), "heldout_final": heldout_scores(entries[-1]),
        "head_accuracy": matrix.tolist(),
        "shipped_tree": tree_summary(build_tree(matrix, args.tree_nodes), matrix),
        "trees": {n: tree_summary(build_tree(matrix, n), matrix) for n in TREE_SIZES}}))
    return 0


# ----------------------------------------------------------------------------- build-tree
def add_tree_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--accuracy", help="head accuracy JSON ({'head_accuracy': [[...]]} or a list of lists)")
    src.add_argument("--heads", help="Medusa heads directory holding head_accuracy.json")
    p.add_argument("--num-nodes", type=int, default=31, help="tree nodes (without the root)")
    p.add_argument("--out", required=True, help="tree JSON to write (FasterDecoding/Medusa list of paths)")


def run_build_tree(args: argparse.Namespace) -> int:
    """Build the ``--num-nodes`` tree maximising the expected acceptance length, save it, print its summary."""
    from ...medusa.tree import build_tree, save_tree
    from .medusa import ACCURACY_FILE, load_head_accuracy, tree_summary
    path = Path(args.accuracy) if args.accuracy else Path(args.heads) / ACCURACY_FILE
    try:
        matrix = load_head_accuracy(path)
        tree = build_tree(matrix, args.num_nodes)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save_tree(tree, args.out)
    print(json.dumps({"tree": str(args.out), **tree_summary(tree, matrix)}))
    return 0
