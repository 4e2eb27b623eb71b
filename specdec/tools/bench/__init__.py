"""Benchmarks of specdec, run by ``specdec bench`` / ``specdec bench-spec`` (or the wrapper scripts
in the repository's ``bench/`` directory).

- :mod:`specdec.tools.bench.runtime` — target-only greedy decoding, batch 1: specdec's runtime against
  ``transformers`` (tokens/s, TTFT, compile time, peak RSS, fraction of the memory-bandwidth bound).
- :mod:`specdec.tools.bench.speculative` — speculative decoding with the shipped proposers (vanilla draft,
  EAGLE, Medusa) against the target alone and ``transformers`` assisted generation.
- :mod:`specdec.tools.bench.prompts` — the prompt set: the MT-Bench questions shipped as package data in
  ``data/mt_bench_questions.jsonl`` (see ``data/NOTICE``), or any MT-Bench style jsonl via ``--prompts``.
"""
from __future__ import annotations

import json


def emit_json(result: dict, output: str | None) -> None:
    """Print a benchmark result as indented JSON and, with ``output``, also write it there; the JSON carries
    the command, commit and machine (``runtime.with_provenance``)."""
    from .runtime import with_provenance

    text = json.dumps(with_provenance(result), indent=2)
    print(text)
    if output:
        with open(output, "w") as f:
            f.write(text + "\n")
