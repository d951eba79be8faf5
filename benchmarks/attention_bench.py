"""GPU benchmark of flashforge against the attention kernels PyTorch ships: the command-line entry point.

    PYTHONPATH=. python benchmarks/attention_bench.py --suite SUITE --out DIR [options]

The benchmark itself is the package next to this file, benchmarks/attention/ (its doc is the --help text):
cases.py (the cases, their FLOP and byte counts, the suites' lists), impls.py (inputs, flashforge and its
peers, masks, references, error checks), report.py (rows, table, JSON files, environment), plots.py (charts),
runner.py (warm-up, check and timing of one case; the timing plan) and cli.py (arguments and main).  Run as a
script, this file's folder is on sys.path, so the package imports as `attention` from any working directory.
"""
import sys

from attention.cli import main

if __name__ == "__main__":
    sys.exit(main())
