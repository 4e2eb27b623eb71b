"""The training commands: ``specdec train-draft`` (:mod:`specdec.tools.train.cli`), ``train-eagle``
(:mod:`specdec.tools.train.eagle_cli`), ``train-medusa`` and ``build-tree`` (:mod:`specdec.tools.train.medusa_cli`). The
training tool has its own command line (those modules: flags and ``run``); these commands are its entries."""
from ..tools.train import cli as draft_cli
from ..tools.train import eagle_cli, medusa_cli
from .command import Command

COMMANDS = [
    Command("train-draft", "train a draft for the target: data -> distillation -> export (resumable)",
            draft_cli.add_arguments, draft_cli.run),
    Command("train-eagle", "train an EAGLE draft for the target: data -> features -> training -> export",
            eagle_cli.add_arguments, eagle_cli.run),
    Command("train-medusa", "train Medusa heads for the target: data -> features -> training -> calibration -> "
            "export (resumable)", medusa_cli.add_arguments, medusa_cli.run),
    Command("build-tree", "build a Medusa tree from measured head accuracies (prints expected tau)",
            medusa_cli.add_tree_arguments, medusa_cli.run_build_tree),
]
