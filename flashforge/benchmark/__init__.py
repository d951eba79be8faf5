"""GPU benchmark of flashforge against the attention kernels PyTorch ships, on identical inputs.

    PYTHONPATH=. python benchmarks/attention_bench.py --suite SUITE --out DIR [options]

SUITE is one of fwd, fwdbwd, features, decode, varlen, memory, headdims, all, or a comma-separated
list of them.  One process times flashforge and every peer available on the machine on the same
tensors, checks flashforge's output (and gradients) against a reference in the same run, prints a
table (last) and writes DIR/<suite>.json and DIR/<suite>.png for each suite, and the table as
DIR/<suite>.txt (for `all` or a list also DIR/all.json, .txt and .png, a chart of the ratios).  The
JSON is rewritten after every case, so a run cut short still leaves what it measured.

Peers: SDPA with one backend forced (`sdpa_kernel`: cudnn = CUDNN_ATTENTION, flash = FLASH_ATTENTION,
efficient = EFFICIENT_ATTENTION), FlexAttention compiled (`torch.compile(flex_attention)`, block
masks from `create_block_mask`), and where a case calls for them: PyTorch's `varlen_attn`
(FA2 varlen), our own padded dense kernel (`ours_padded`) and our default-mode kernel
(`ours_default`, next to `deterministic=True`).  A peer that cannot run a case gets null in the
JSON and "-" in the table; why is in the row's `peer_errors`.

Suites (bf16 unless --dtype):
  fwd, fwdbwd  PERF.md's grid: 16k tokens (B = 16384 / S), H*D = 2048, D 64/128, S 1k/4k/16k, causal or not.
  features     D = 128, B = 4, S = 4k, H = 32: GQA 32/8 causal; additive bias [B,1,S,S]; bias + dropout
               0.1; bias with gradient; causal sliding window 1024 (and 16k, B = 1, H = 16, PERF's
               anchor) next to dense causal; prefill Sq = 1k against Sk = 16k keys (causal offset 15k);
               deterministic=True vs default.
  decode       Sq = 1, GQA 32/8, D = 128: B 1/4/32/128 x cache 4k/32k/128k (caches over 20 GB skipped);
               ours contiguous and paged (block 256) with automatic split-KV, in one row each.
  varlen       16 sequences of random lengths summing to 16k, H = 16, D = 128, causal or not.
  memory       peak memory of one forward+backward, B = 1, H = 16, S = 128k, D = 128, causal.
  headdims     D 32/96/256 (H = round(2048 / D)) and float32 at D 64/128, B = 4, S = 4k, non-causal.
  all          all of them, cheapest first.  Runs of several suites (all, or a list) stop starting cases
               after --max-seconds (default 510, to fit a 10-minute job) and run FlexAttention (seconds
               of compilation per new shape or mask) only where PERF.md has Flex anchors: not on the
               D = 64 grid nor head dims other than 256 (--full-flex: everywhere).  A single suite has
               no time limit and Flex everywhere.

Units and FLOPs (PERF.md's convention): forward = 4 * B * Hq * pairs * D, where pairs = Sq * Sk
without masking, Sq * Sk / 2 causal with Sq = Sk, Sq * offset + Sq^2 / 2 causal with a key offset
(prefill), and Sq * (window + 1) for a causal sliding window (the band, as PERF.md counts it; the
first `window` rows see fewer keys).  Varlen sums over the sequences (our padded kernel is credited
the same useful FLOPs).  forward+backward = 3.5 x forward.  Decode is judged in bytes: K and V read
once, 2 * B * Sk * Hkv * D * bytes per element, in GB/s (1e9).  Memory rows are GiB (2**30): peak
`torch.cuda.max_memory_allocated` during one forward+backward minus what was allocated before it
(inputs, do); the gradients count.  `ratio` = ours / cuDNN ("ratio_cudnn"); where cuDNN cannot run
the case, ours / the best peer that ran ("ratio", "ratio_to" names it).  For GiB lower is better.

Correctness: each case compares flashforge's output (forward) or output and dq, dk, dv (and dbias)
(forward+backward) with a reference computed in the same run: the first of cuDNN, FA2, mem-efficient
that ran, else SDPA's math backend in float32 (float32 cases: always that); decode against a float32
computation in PyTorch; varlen against SDPA run one sequence at a time.  The row is `ok` when
||ours - ref|| / ||ref|| < 2e-2 (bf16; fp16 1e-2, fp32 1e-3) for every tensor.  Dropout rows are only
checked for shapes and finite values.  Peers' errors against the same reference are recorded too.

Timing: triton.testing.do_bench(fn, warmup, rep, return_mode="median") after a warm-up call outside
the timed region (L2 flushed before every repetition by do_bench); random normal inputs.

Exit status: 0 all rows ok, 1 a check failed (everything is still printed and written), 2 no CUDA GPU
or bad arguments, 130 interrupted (Ctrl-C or SIGTERM: the rows measured so far are still printed and
written).  Nothing touches CUDA at import time.
"""
