#!/usr/bin/env python
"""Speculative-decoding benchmark: thin wrapper around :mod:`specdec.tools.bench.speculative`
(``python bench/bench_speculative.py --help``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.tools.bench.speculative import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
