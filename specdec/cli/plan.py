"""``specdec plan``: the capacity planner (:mod:`specdec.tools.plan`)."""
from __future__ import annotations

import argparse

from ..options import options_from
from ..tools import plan as capacity
from .command import Command

NAME = "plan"
HELP = "capacity planner: memory per core and the smallest tp_degree that fits"
add_arguments = capacity.add_arguments


def run(args: argparse.Namespace) -> int:
    return capacity.run(options_from(capacity.PlanOptions, args))


COMMANDS = [Command(NAME, HELP, add_arguments, run)]
