"""``specdec train-draft``: data generation → distillation → export, each step resumable.

    specdec train-draft --out DIR [--num-prompts 4096] [--steps 720] [--seed 0] [--threads 2] [--ship DIR]

``DIR/data`` (or ``--data``) holds the generated batches (their tokens kept in the token store ``--store``,
default ``DIR/data/tokens``; ``--data STORE`` trains from a store's tokens, labelled by prefill, without
generating), ``DIR/train`` the training checkpoint and log, and the exported draft goes to ``--ship``
(default ``DIR/ship``; the packaged draft lives in ``assets/specdec_assets/draft/smollm2-135m-instruct``).
Re-running the same command after an interruption (Ctrl-C, a crash) continues where it stopped; finished
steps are skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """Target, working directory, seed, threads and the data-generation options (shared with
    ``train-eagle``)."""
    from .data import DataConfig
    from .prompts import MIXES
    d = DataConfig()
    p.add_argument("--model", default=None, help="target checkpoint, .gguf or named model "
                                                    "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="working directory (data, checkpoints)")
    p.add_argument("--ship", default=None, help="where to export the draft (default OUT/ship)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (1 is fastest on a shared 2-core machine)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--device", default="cpu",
                   help="where the target runs to generate and label the data, e.g. cuda (train-eagle and "
                        "train-medusa: also its features; train-eagle: also the draft's training)")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None,
                   help="data directory (default OUT/data; e.g. an existing train-draft run's), or a token store "
                        "(answers-*.npz, e.g. assets/specdec_assets/train/tokens/smollm2-135m-instruct): then "
                        "nothing is generated, its tokens are labelled by prefill into OUT/labels")
    g.add_argument("--store", default=None,
                   help="token store the generated tokens are kept in and read back from (default DATA/tokens); "
                        "a run appends the batches it lacks")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts)
    g.add_argument("--gen-batch-size", type=int, default=d.batch_size)
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument("--sample-fraction", type=float, default=d.sample_fraction,
                   help="share of answers sampled at --answer-temperature (the rest greedy)")
    g.add_argument("--answer-temperature", type=float, default=d.answer_temperature)
    g.add_argument("--gen-backend", default=d.backend, choices=["eager", "compiled"])
    g.add_argument("--prompts", default=d.prompts, choices=list(MIXES),
                   help="request mix (specdec.tools.train.prompts): topic questions the target writes, tasks over "
                        "passages it writes (summaries, QA, RAG, translation, rewriting) and math problems, or "
                        "the written requests shipped with specdec (assets/specdec_assets/train/requests.jsonl)")
    g.add_argument("--requests", default=None,
                   help="--prompts written: a JSON-lines file of {\"category\", \"text\"} requests (default: "
                        "assets/specdec_assets/train/requests.jsonl)")
    g.add_argument("--max-question-tokens", type=int, default=d.max_question_tokens,
                   help="length of the target's meta-replies (its questions or passages)")
    g.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="requests longer than this (chat template included) are cut")


def add_optim_arguments(p: argparse.ArgumentParser, cfg) -> argparse._ArgumentGroup:
    """The "training" group with the optimisation options every trainer shares (defaults from ``cfg``, an
    ``OptimConfig``); returns the group for the trainer's own options."""
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=cfg.steps)
    g.add_argument("--batch-rows", type=int, default=cfg.batch_rows)
    g.add_argument("--lr", type=float, default=cfg.lr)
    g.add_argument("--save-every", type=int, default=cfg.save_every)
    g.add_argument("--eval-every", type=int, default=cfg.eval_every)
    g.add_argument("--max-len", type=int, default=cfg.max_len, help="rows are cut to this many tokens")
    return g


def optim_settings(args: argparse.Namespace) -> dict:
    """The ``OptimConfig`` fields set on the command line (``add_optim_arguments`` + ``--seed``)."""
    return dict(steps=args.steps, batch_rows=args.batch_rows, lr=args.lr, seed=args.seed,
                save_every=args.save_every, eval_every=args.eval_every, max_len=args.max_len)


def ship_bytes(ship_dir: str | Path) -> int:
    """Total size of the files in a ship directory."""
    return sum(f.stat().st_size for f in Path(ship_dir).iterdir() if f.is_file())


def prepare_data(args: argparse.Namespace) -> Path:
    """Generate (or finish) the target's data in ``--data`` / OUT/data, or (``--data`` a token store)
    label the kept tokens by prefill into OUT/labels; returns the directory of labelled batches."""
    from .data import generate_data, label_store
    from .store import is_store
    if args.data and is_store(args.data):
        with torch.no_grad():
            return label_store(args.data, Path(args.out) / "labels", resolve_target(args),
                               progress=not args.no_progress, device=args.device)
    with torch.no_grad():
        return generate_data(data_dir(args), data_config(args), resolve_target(args), progress=not args.no_progress,
                             store=args.store, device=args.device)


def data_dir(args: argparse.Namespace) -> Path:
    """Where generated batches go: ``--data``, else OUT/data."""
    return Path(args.data) if args.data else Path(args.out) / "data"


def data_config(args: argparse.Namespace):
    """The ``DataConfig`` of the data arguments."""
    from .data import DataConfig
    return DataConfig(num_prompts=args.num_prompts, batch_size=args.gen_batch_size,
                      max_new_tokens=args.max_new_tokens, sample_fraction=args.sample_fraction,
                      answer_temperature=args.answer_temperature, seed=args.seed, backend=args.gen_backend,
                      prompts=args.prompts, max_question_tokens=args.max_question_tokens,
                      max_prompt_tokens=args.max_prompt_tokens, requests_file=args.requests)


def resolve_target(args: argparse.Namespace) -> Path:
    from ...core.paths import resolve_model_path
    return resolve_model_path(args.model)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .distill import DraftSpec, TrainConfig
    t, s = TrainConfig(), DraftSpec()
    add_common_arguments(p)
    g = p.add_argument_group("draft")
    g.add_argument("--layers", default=",".join(map(str, s.init_layers)),
                   help="target layers the draft's layers are initialised from (e.g. 0,1 or 0,-1)")
    g.add_argument("--draft-vocab", type=int, default=s.draft_vocab_size, help="reduced output vocabulary size")
    g.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--tokens-only", action="store_true",
                   help="only generate the token store's missing shards (--store, default DATA/tokens) and stop: "
                        "no labels, no training (e.g. to grow "
                        "assets/specdec_assets/train/tokens/smollm2-135m-instruct)")
    add_optim_arguments(p, t)


def run(args: argparse.Namespace) -> int:
    from .distill import DraftSpec, TrainConfig, train_draft
    from .export import export_draft

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    ship = Path(args.ship) if args.ship else out / "ship"
    target = resolve_target(args)
    progress = not args.no_progress
    times = {}
    start = time.perf_counter()
    if args.tokens_only:
        from .data import generate_data
        from .store import store_summary
        with torch.no_grad():
            generate_data(data_dir(args), data_config(args), target, progress=progress, store=args.store, label=False,
                          device=args.device)
        print(json.dumps({"store": store_summary(args.store or data_dir(args) / "tokens"),
                          "seconds": round(time.perf_counter() - start, 1)}))
        return 0
    data = prepare_data(args)
    times["data_s"] = time.perf_counter() - start
    spec = DraftSpec(init_layers=[int(x) for x in args.layers.split(",")], draft_vocab_size=args.draft_vocab,
                     intermediate_size=args.intermediate_size)
    tcfg = TrainConfig(**optim_settings(args))
    start = time.perf_counter()
    train_draft(data, out / "train", target, spec, tcfg, progress=progress,
                log=lambda m: print(m, file=sys.stderr))
    times["train_s"] = time.perf_counter() - start
    export_draft(out / "train" / "ckpt.pt", ship)
    print(json.dumps({"ship": str(ship), "ship_bytes": ship_bytes(ship), **times}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec train-draft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
