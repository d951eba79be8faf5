"""GPU benchmark of flashforge against FA4 and the attention kernels PyTorch ships: the command-line entry point.

    PYTHONPATH=. python benchmarks/attention_bench.py --suite SUITE --out DIR [options]

The benchmark itself is flashforge's benchmark library, flashforge/benchmark/ (shared with the main job,
`python -m flashforge.bench`); `--help` describes the suites, peers, units and checks.
"""
import sys

from flashforge.benchmark.cli import main

if __name__ == "__main__":
    sys.exit(main())
