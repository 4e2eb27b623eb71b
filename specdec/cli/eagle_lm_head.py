"""``specdec eagle-lm-head``: copy the target's LM head into an EAGLE draft checkpoint
(:func:`specdec.eagle.checkpoint.copy_lm_head`)."""
from __future__ import annotations

import argparse
import sys

from .command import Command

NAME = "eagle-lm-head"
HELP = "copy the target's lm_head.weight into an EAGLE draft checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", required=True, help="EAGLE draft directory (EAGLE-1 layout, no lm_head)")
    p.add_argument("--target", required=True,
                   help="target checkpoint directory (single/sharded safetensors or bin), .gguf file or named model")
    p.add_argument("--out", default=None, help="output directory (default: rewrite the draft in place)")


def run(args: argparse.Namespace) -> int:
    from ..core.paths import resolve_model_path
    from ..eagle.checkpoint import copy_lm_head
    try:
        out = copy_lm_head(args.draft, resolve_model_path(args.target), args.out)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"specdec eagle-lm-head: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'model.safetensors'} (draft tensors + the target's lm_head.weight)")
    return 0


COMMANDS = [Command(NAME, HELP, add_arguments, run)]
