"""``Command``: what a command module of ``specdec.cli`` lists (in ``COMMANDS``) for ``build_parser``."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple


class Command(NamedTuple):
    """One command: its name, help (one line, also its description), ``add_arguments(parser)`` and
    ``run(args) -> exit status``. A command module lists its commands in ``COMMANDS``."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
