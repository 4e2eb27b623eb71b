"""``specdec`` command line: ``generate``, ``bench`` (runtime), ``bench-spec`` / ``bench-eagle``
(speculation), ``train-draft`` / ``train-eagle`` / ``train-medusa``, ``build-tree`` (Medusa trees),
``eagle-lm-head`` (EAGLE checkpoints), ``plan`` (capacity planning)."""
from __future__ import annotations

import argparse
import sys
import time

import torch


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--amp", default="bf16", choices=["f32", "bf16", "f16"], help="weights/KV dtype")
    p.add_argument("--backend", default="compiled", choices=["eager", "compiled"],
                   help="compiled = torch.compile graphs (cached on disk after the first run)")
    p.add_argument("--n-positions", type=int, default=1024, help="KV-cache length (prompt + new tokens)")


def cmd_generate(args: argparse.Namespace) -> int:
    if args.tp_degree > 1:   # one process per rank; rank 0 prints
        from .core.parallel import launch
        return launch(generate_on_rank, args.tp_degree, args, timeout_s=24 * 3600.0)
    return generate_on_rank(args)


def generate_on_rank(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    from . import DecoderModel, SamplingConfig
    from .core.chat import chat_ids

    sampling = SamplingConfig(do_sample=args.temperature > 0, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p)
    model = DecoderModel.from_pretrained(args.model, n_positions=args.n_positions, amp=args.amp,
                                         backend=args.backend, sampling=sampling, tp_degree=args.tp_degree,
                                         gqa_strategy=args.gqa_strategy)
    rank0 = model.tp.rank == 0
    tok = model.tokenizer
    ids = tok(args.prompt, return_tensors="pt")["input_ids"] if args.raw else \
        torch.tensor([chat_ids(tok, args.prompt)])
    max_new = min(args.max_new_tokens, args.n_positions - ids.shape[1])
    if args.backend == "compiled":
        if rank0:
            print("compiling the graphs this request needs (cached on disk after the first run) ...", file=sys.stderr)
        model.compile(prompt_length=ids.shape[1], max_length=ids.shape[1] + max_new)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True) if rank0 else None
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new, streamer=streamer, seed=args.seed)
    elapsed = time.perf_counter() - start
    n = out.shape[1] - ids.shape[1]
    if rank0:
        print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s, {args.backend} {args.amp}, "
              f"tp_degree {args.tp_degree}]", file=sys.stderr)
    return 0


def cmd_eagle_lm_head(args: argparse.Namespace) -> int:
    from .core.paths import resolve_model_path
    from .eagle.checkpoint import copy_lm_head
    try:
        out = copy_lm_head(args.draft, resolve_model_path(args.target), args.out)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'model.safetensors'} (draft tensors + the target's lm_head.weight)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt (chat template applied)")
    g.add_argument("prompt")
    add_model_arguments(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--tp-degree", type=int, default=1,
                   help="tensor parallelism: shard the model over this many processes (launched for you)")
    g.add_argument("--gqa-strategy", default=None, choices=["replicate-to-tp-degree", "convert-to-mha"],
                   help="how KV heads are sharded when they do not divide --tp-degree (default: automatic)")
    g.set_defaults(func=cmd_generate)
    from .bench import runtime as bench_runtime, speculative as bench_spec
    b = sub.add_parser("bench", help="target-only decoding benchmark vs transformers (prints JSON)")
    bench_runtime.add_arguments(b)
    b.set_defaults(func=lambda a: bench_runtime.print_result(bench_runtime.run(a), a))
    s = sub.add_parser("bench-spec", help="speculative decoding benchmark with the trained draft (prints JSON)")
    bench_spec.add_arguments(s)
    s.set_defaults(func=lambda a: bench_spec.print_result(bench_spec.run(a), a))
    from . import plan
    pl = sub.add_parser("plan", help="capacity planner: memory per core and the smallest tp_degree that fits")
    plan.add_arguments(pl)
    pl.set_defaults(func=plan.run)
    from .train import cli as train_cli
    t = sub.add_parser("train-draft", help="train a draft for the target: data -> distillation -> export (resumable)")
    train_cli.add_arguments(t)
    t.set_defaults(func=train_cli.run)
    from .train import eagle_cli
    te = sub.add_parser("train-eagle", help="train an EAGLE draft for the target: data -> features -> training -> export")
    eagle_cli.add_arguments(te)
    te.set_defaults(func=eagle_cli.run)
    from .train import medusa_cli
    tm = sub.add_parser("train-medusa", help="train Medusa heads for the target: data -> features -> training -> "
                        "calibration -> export (resumable)")
    medusa_cli.add_arguments(tm)
    tm.set_defaults(func=medusa_cli.run)
    bt = sub.add_parser("build-tree", help="build a Medusa tree from measured head accuracies (prints expected tau)")
    medusa_cli.add_tree_arguments(bt)
    bt.set_defaults(func=medusa_cli.run_build_tree)
    lm = sub.add_parser("eagle-lm-head", help="copy the target's lm_head.weight into an EAGLE draft checkpoint")
    lm.add_argument("--draft", required=True, help="EAGLE draft directory (EAGLE-1 layout, no lm_head)")
    lm.add_argument("--target", required=True, help="target checkpoint directory (single/sharded safetensors or bin)")
    lm.add_argument("--out", default=None, help="output directory (default: rewrite the draft in place)")
    lm.set_defaults(func=cmd_eagle_lm_head)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
