"""The ``specdec`` command: ``generate`` (target-only or speculative), ``serve`` (HTTP server), ``bench`` /
``bench-spec`` / ``bench-serve`` / ``bench-quality`` / ``bench-coverage`` (benchmarks), ``plan`` (capacity
planning), ``train-draft`` / ``train-eagle`` / ``train-medusa``, ``build-tree`` (Medusa trees), ``eagle-lm-head``
(EAGLE checkpoints).

One module per command or family of commands (``MODULES``: generate, serve, the benchmarks, plan, training,
eagle-lm-head), each listing its ``Command``s (``command``): a command parses its arguments into the typed options
of the library (``specdec.options``, ``specdec.serving.server.ServeOptions``, the benchmarks' options dataclasses)
and calls the library. No module outside this package imports it. ``build_parser`` assembles the commands;
``main`` runs one (bad arguments: one ``specdec: error:`` line, exit code 2)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

MODULES = ("generate", "bench", "serve", "plan", "train", "eagle_lm_head")
"""The command modules of this package, in the order ``specdec --help`` lists their commands."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``PROG: error: MESSAGE``, exit code 2) and help text cleaned of
    reStructuredText markup (the modules' docstrings use double backticks)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


class HelpFormatter(argparse.HelpFormatter):
    def _format_text(self, text: str) -> str:
        return super()._format_text(text.replace("``", ""))

    def _expand_help(self, action) -> str:
        return super()._expand_help(action).replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    """The ``specdec`` parser: a sub-command per ``Command`` of the modules of ``MODULES`` (its ``run`` as
    ``func``)."""
    parser = Parser(prog="specdec", description="specdec: speculative decoding on a static-shape LLM runtime.",
                    epilog='Run "specdec COMMAND --help" for the options of a command.')
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in MODULES:
        for command in importlib.import_module(f"{__name__}.{module}").COMMANDS:
            p = sub.add_parser(command.name, help=command.help, description=command.help)
            command.add_arguments(p)
            p.set_defaults(func=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line (``argv`` None: ``sys.argv``). Exit status: 0, 2 for a bad argument or a
    missing file (one ``specdec: error:`` line on stderr, no traceback; ``SPECDEC_DEBUG=1`` re-raises),
    130 when interrupted."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        from .generate import apply_wait_policy
        apply_wait_policy(argv)
    torch.set_grad_enabled(False)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        message = " ".join(str(e).split()) or type(e).__name__   # one line
        print(f"specdec: error: {message}", file=sys.stderr)
        return 2
