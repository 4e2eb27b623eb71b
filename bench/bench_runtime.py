#!/usr/bin/env python
"""Runtime benchmark (target-only greedy decoding, batch 1): specdec vs transformers.

Thin wrapper around :mod:`specdec.tools.bench.runtime`; run with ``--help`` for the options. JSON goes to
stdout (and ``--output FILE``), progress and a markdown table to stderr.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.tools.bench.runtime import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
