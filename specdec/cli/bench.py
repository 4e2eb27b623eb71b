"""The benchmark commands: ``specdec bench`` (:mod:`specdec.tools.bench.runtime`), ``bench-spec``
(:mod:`specdec.tools.bench.speculative`), ``bench-quality`` (:mod:`specdec.tools.bench.quality`), ``bench-coverage``
(:mod:`specdec.tools.bench.coverage`) and ``bench-serve`` (:mod:`specdec.tools.bench.serving`). Each benchmark module is
also a script of its own, so it keeps its flags (``add_arguments``); a command parses them into the module's
options dataclass, runs it and prints the result (JSON to stdout and ``--output``, a table to stderr)."""
from __future__ import annotations

import argparse

from ..options import options_from
from ..tools.bench import coverage, quality, runtime, serving, speculative
from .command import Command

BENCHMARKS = (
    ("bench", "target-only decoding benchmark vs transformers (prints JSON)", runtime, runtime.RuntimeBenchOptions),
    ("bench-spec", "speculative decoding benchmark with a shipped proposer: draft model, EAGLE or Medusa (prints "
     "JSON)", speculative, speculative.SpecBenchOptions),
    ("bench-quality", "perplexity on held-out text and greedy agreement of f32 / bf16 / int8 / int4 (prints JSON)",
     quality, quality.QualityBenchOptions),
    ("bench-coverage", "coverage of the shipped drafts' reduced vocabulary on the target's greedy outputs, per prompt "
     "category, and of larger vocabularies (writes bench/results/coverage.json)", coverage,
     coverage.CoverageBenchOptions),
    ("bench-serve", "serving benchmark: the HTTP server under 1-16 concurrent streaming clients, with and without "
     "speculation (prints JSON)", serving, serving.ServeBenchOptions),
)
"""(command, help, benchmark module, its options dataclass)."""


def benchmark_run(module, options: type):
    """The command's ``run``: the parsed arguments as ``options``, then ``module.print_result(module.run(...),
    output)`` → the exit status."""
    def run(args: argparse.Namespace) -> int:
        found = options_from(options, args)
        return module.print_result(module.run(found), found.output)
    return run


COMMANDS = [Command(name, help, module.add_arguments, benchmark_run(module, options))
            for name, help, module, options in BENCHMARKS]
