"""Speculative-decoding benchmark (see specdec/bench_spec.py): python bench/bench_speculative.py --help"""
import sys

from specdec.bench_spec import main

if __name__ == "__main__":
    sys.exit(main())
