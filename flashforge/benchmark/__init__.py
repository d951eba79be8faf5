"""flashforge's benchmark library: one set of cases, FLOP counts, timing, peers, checks and reports for
every benchmark in the project, so that a convention or a timing fix lives in one place.

    python -m flashforge.bench                         the main job: self-check, then a small benchmark
    PYTHONPATH=. python benchmarks/attention_bench.py  the GPU suites against FA4, cuDNN, FA2, Flex (cli.py)
    PYTHONPATH=. python benchmarks/cpu_vs_sdpa.py      CPU shapes of one's choice against SDPA

Nothing here touches CUDA, Triton or FA4 at import time.  Modules, lowest first:
  cases.py        Case: the problem one row times, and its label
  flops.py        the FLOPs and bytes a case is credited with (PERF.md's convention); throughput
  suites.py       the suites' case lists, the main job's rows, what picks and shrinks them
  inputs.py       random inputs for a case; the dense mask equivalent to a window or an offset
  impl.py         Impl: one implementation of a case as the Runner calls it
  fa4.py          FlashAttention-4 (imported lazily)
  flex.py         FlexAttention (compiled once, block masks)
  peers.py        ours, SDPA, varlen_attn, our padded kernel, decoding; every Impl of a case in run order
  checks.py       the reference, the error measure and its tolerance
  timing.py       do_bench, CPU wall-clock, CUDA graphs, peak memory, the timing plan
  report.py       rows, ratios (ours / max(FA4, cuDNN)), tables, grid geometric means, JSON files
  environment.py  versions, device, git commit, FA4's status
  runner.py       Runner: warm-up, check and time every implementation of a case
  plots.py        PNG charts (matplotlib, when present)
  read_floor.py   the decode table's floor: a Triton kernel that only reads K and V
  selfcheck.py    the main job's self-check against the float64 reference
  cli.py          attention_bench's command line (its doc is the --help text)
"""
