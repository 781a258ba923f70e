"""Benchmark entry point: `python benchmarks/run.py [--quick] ...` == `specdecode bench ...`."""

import sys

from specdecode.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
