"""Tile configurations for the attention kernels, in one table.

Keyed by (pass, head-dim bucket, element size); the interpreter (CPU tensors)
uses small tiles because it runs each program as numpy code.  Override a
choice by editing the table, with `set_config` (benchmarks sweep this way), or
for a whole process with a JSON file named by $FLASHFORGE_TILE_CONFIGS:
``{"fwd/128/2": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2}, ...}``
(what `benchmarks/tune/sweep.py --write-configs` writes for another GPU).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from ..launch import next_power_of_2


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # forward only: load K/V tiles with the Hopper copy engine (TMA descriptors) where
    # the layout allows it; off until measured (benchmarks/tune/sweep.py compares both)
    tma: bool = False
    # forward only: warp-specialize the interior key loop (tl.range(..., warp_specialize=True))
    ws: bool = False
    # bwd_kv only: the dK/dV kernel also accumulates dQ (float32 atomics) and the dQ kernel
    # is skipped; ignored when deterministic=True (the Gluon kernel: `gluon.attention.fuses_dq`)
    fused_dq: bool = False
    # bwd_kv only: dV and dK in two launches of the dK/dV kernel (PART 1, 2), each program
    # holding one float32 [block_n, D] accumulator instead of two; costs one more q k^T product
    # per tile.  For D = 256, where both accumulators would need 256 registers a thread: the
    # portable kernel's and the Gluon kernel's (which requires it past D = 128) entries use it.
    split_kv: bool = False
    # forward only, 16-bit inputs: compute 1 = half, 2 = all of the interior tiles'
    # exponentials on the FMA pipes instead of the MUFU unit (common.exp2_split).  Off until measured.
    poly_exp2: int = 0
    # forward only, sm_90: run the Gluon kernel (ops/gluon/attention_fwd_sm90.py, asynchronous
    # wgmma: a tile's softmax overlaps the tensor cores) with block_m x block_n and num_warps,
    # where the call is in its scope (dense or packed 16-bit, D = Dv in {64, 128, 256}, no mask,
    # bias or dropout: `gluon.attention.scope_reason`); other calls with this config take the
    # portable kernel with the same tiles
    gluon: bool = False
    # gluon only: serve calls with at least this many keys (the forward: the portable kernel below
    # it; a "fwd_long" entry: the "fwd_gluon" one; a "bwd_kv_ws" entry: the "bwd_kv" one)
    min_keys: int = 0
    # gluon only: slots in V's ring (0: num_stages, as K's).  One lets 64 x 128 tiles at
    # D = 128 (112 KB) run two programs per SM; V's copy then hides behind one tile's q k^T
    v_stages: int = 0
    # gluon bwd_kv only: overlap a query tile's element-wise work with the previous tile's
    # dV / dK products (more live registers); False: one tile at a time
    overlap: bool = True
    # gluon: 2 runs the warp-specialized kernel (ops/gluon/attention_fwd_ws_sm90.py,
    # attention_bwd_dq_ws_sm90.py: a loader warp and two consumer warpgroups sharing each K/V
    # tile, block_m = 128 query rows a program and num_warps = 4, one consumer's; bwd_kv:
    # attention_bwd_dkdv_ws_sm90.py, dQ fused, block_n = 128 keys, block_m = 64 query rows a tile)
    consumers: int = 1
    # consumers = 2 only: the two take turns issuing their products (FA3's ping-pong)
    pingpong: bool = False
    # bwd_kv, consumers = 2 only: a query tile's dQ_t is one product over the block's 128 keys,
    # the consumers taking turns (one float32 buffer and one set of reduce-adds a tile, not two)
    shared_dq: bool = False
    # bwd_kv, consumers = 2, D = 64 only: scores keys by queries, P^T and dS^T as register A
    # operands of dV and dK (only dS^T through shared memory); opt-in, not yet run on a GPU
    rs: bool = False
    # bwd_kv, consumers = 2 only (ops/gluon/attention_bwd_dkdv_halfdq_sm90.py): register operands
    # as rs, and each consumer computes half of every query tile's dQ from both consumers' dS
    # (FA3's layout): block_m = 128 query rows at D = 64 (rows split), 64 at D = 128 (columns split);
    # at D = 256 the wide kernel (ops/gluon/attention_bwd_dkdv_wide_sm90.py: 64 x 64 tiles, one
    # stage, the consumers splitting the head dim): the table's D = 256 entry from 4096 keys,
    # 1.17-1.38x the ordered pair's backward (H100, RESULTS.md v0.9.8)
    half_dq: bool = False
    # forward, consumers >= 2 only (ops/gluon/attention_fwd_persistent_sm90.py): at most one program
    # an SM, taking the work items in snake-order rounds, the loader fetching the next item's Q and
    # K / V while the consumers finish the current one, o staged in its own buffer.  The table's
    # D = 128 entries below 8192 keys set it (RESULTS.md v0.9.14)
    persistent: bool = False


# (pass, head-dim bucket, bytes per element) -> config, one table per GPU architecture.
# "bwd_kv" walks query tiles (block_m, small) past a resident key tile
# (block_n, large); "bwd_q" the other way round.  "fwd_causal", where present, serves
# forward calls with a causal mask.
#
# Hopper (sm_90, 227 KB of shared memory per block): measured on the H200.
_SM90: dict[tuple[str, int, int], TileConfig] = {
    # H200 grid (benchmarks/RESULTS.md, 2026-11-29): without a causal mask the wide tiles win
    # (D = 128: 370-525 TFLOP/s against 342-476 for 128 x 64); with one, the 64-row tiles
    # through TMA (D = 128: 329-530 against 248-509) -- shorter rows balance the triangle.
    # These serve the calls outside the Gluon forward's scope (masks, dropout, ...).
    ("fwd", 64, 2): TileConfig(64, 128, 4, 2, tma=True),
    ("fwd", 128, 2): TileConfig(128, 128, 8, 3),
    ("fwd_causal", 64, 2): TileConfig(128, 64, 8, 3),
    ("fwd_causal", 128, 2): TileConfig(64, 64, 4, 3, tma=True),
    # KV-cache calls whose query rows (x the GQA group) fit 16 rows -- decoding: 16-row tiles
    # (mma.sync; 64-row wgmma tiles computed 16x the rows there are).  H200 sweep in CUDA graphs,
    # GQA 32/8, auto splits, GB/s for 64 x 64 -> 16 x 64 (benchmarks/RESULTS.md v0.7.2):
    # B = 1 4k 1205 -> 1295, 32k 2878 -> 2933; B = 4 4k 2277 -> 2335; B >= 32 and 128k level
    ("fwd_decode", 128, 2): TileConfig(16, 64, 4, 3, tma=True),
    # D = 256 KV-cache calls (a fwd_decode entry at least as tall as the forward's serves every
    # KV-cache call, see the launcher): the forward's 64 x 32 tiles with pointer loads crash
    # ptxas 12.x/13.0 (exit -11) for paged, split, unpacked calls (MQA/GQA with Sq x group > 64;
    # flash-attn's test_flash_attn_kvcache at d = 256, 256-row pages); through TMA they compile
    # (247 registers, no spill; reproduced and checked offline with sm90_compile_check)
    ("fwd_decode", 256, 2): TileConfig(64, 32, 4, 2, tma=True),
    # The Gluon forward (ops/gluon) for the calls in its scope, one warpgroup per program (two
    # programs per SM), against the portable tiles above; H200, S = 1k / 4k / 16k, TFLOP/s
    # (benchmarks/RESULTS.md v0.4.0): D = 128: 480 / 544 / 510 against 381 / 493 / 528,
    # causal 245 / 507 / 569 against 242 / 475 / 545; D = 64 (64 x 128): 449 / 474 / 465
    # against 361 / 467 / 478, causal (64 x 64) 350 / 435 / 465 against 264 / 370 / 418.
    ("fwd_gluon", 64, 2): TileConfig(64, 128, 4, 2, gluon=True),
    # D = 128: the warp-specialized kernel (a loader warp, two 64-row consumers sharing each K/V
    # tile, ping-pong), H200, bf16, one process (RESULTS.md v0.9.0, benchmarks/profile/ws_fwd_gpu.py):
    # S = 1k / 4k / 16k 508 / 605 / 630 TFLOP/s against 516 / 559 / 551 for 64 x 128 tiles with one
    # V slot (one warpgroup a program, two programs an SM, each copying every tile); causal 351 /
    # 509 / 606 against 366 / 491 / 555, GQA 32/8 causal 4k 571 against 507, window 1023 450
    # against 432.  D = 64 stays on the one-warpgroup kernel: WS measured 0.66-0.97x there but
    # at S = 16k causal (1.09).
    # Below 8192 keys the persistent variant (one program an SM taking the grid's items in rounds,
    # the next item's Q and K loaded while the consumers finish the last): H100, bf16, A/B in one
    # process a tree, two rounds (RESULTS.md v0.9.14): S = 1k 1.10 / 1.11x, causal 1.11 / 1.10x,
    # 4k causal 1.02x, GQA 32/8 4k causal 1.03-1.04x, window 1023 1.03x; from 8192 keys it lost
    # (v0.9.12: S = 16k 0.88x, causal 0.98x), so the "fwd_long" entries below keep the plain grid there
    ("fwd_gluon", 128, 2): TileConfig(128, 128, 4, 2, gluon=True, consumers=2, pingpong=True, persistent=True),
    ("fwd_gluon_causal", 64, 2): TileConfig(64, 64, 4, 2, gluon=True),
    # D = 64 with many keys: the warp-specialized kernel with three consumers (192 query rows a
    # program, each K / V tile copied once for them; FA4's D = 64 tiles).  H200, bf16, against the
    # one-warpgroup tiles above in one process (RESULTS.md v0.9.4, ws_fwd_gpu.py): S = 1k / 4k / 16k
    # 375 / 472 / 500 TFLOP/s against 467 / 456 / 446, causal 186 / 373 / 437 against 341 / 391 /
    # 403 (192 x 64 tiles: 424-425 at 16k causal); exp2 on the FMA pipes (poly_exp2) lost 8-27%
    # on every row.  Below min_keys, or with a narrower window, the entries above serve
    # (`attention._long_fwd`)
    ("fwd_long_gluon", 64, 2): TileConfig(192, 128, 4, 2, gluon=True, consumers=3, min_keys=4096),
    ("fwd_long_gluon_causal", 64, 2): TileConfig(192, 128, 4, 2, gluon=True, consumers=3, min_keys=8192),
    # D = 128 causal at S = 1k: v0.4.0's benchmark read Gluon 263 TFLOP/s against the portable
    # tiles' 329 and kept Gluon from 2k keys on; v0.5.0 timed both in one process
    # (benchmarks/profile/short_calls.py): Gluon 348 in a CUDA graph and 307 eager against the portable
    # 321 and 219 (it also needs ~100 us less host time per call), so Gluon serves all lengths
    ("fwd_gluon_causal", 128, 2): TileConfig(128, 128, 4, 2, gluon=True, consumers=2, pingpong=True, persistent=True),
    ("fwd_long_gluon", 128, 2): TileConfig(128, 128, 4, 2, gluon=True, consumers=2, pingpong=True, min_keys=8192),
    ("fwd_long_gluon_causal", 128, 2): TileConfig(128, 128, 4, 2, gluon=True, consumers=2, pingpong=True,
                                                  min_keys=8192),
    # D = 256 (H200, benchmarks/tune/bwd256_sweep.py, RESULTS.md v0.8.1; bf16 TFLOP/s, S = 4k / 16k
    # causal): the forward in 128 x 32 tiles, 8 warps, 3 stages through TMA 448 / 464 against 351 / 351
    # for 64 x 32 x 4 warps (which spilled nothing; more rows per program is what paid)
    ("fwd", 256, 2): TileConfig(128, 32, 8, 3, tma=True),
    # D = 256 in the Gluon forward (H200 sweep, RESULTS.md v0.8.6; bf16 TFLOP/s): two warpgroups
    # of 64 rows each over 64-key tiles, 2 K stages (225-229 registers, no spill).  S = 4k: 573
    # with one V stage, 564 with two, against 453 for the portable 128 x 32 TMA tiles and 480
    # for 64 x 32; S = 16k causal: 604 with two V stages, 588 with one, portable 472
    # v0.9.0: the warp-specialized kernel (two 64-row consumers sharing each 64-key tile, 2 + 2
    # slots, no ping-pong), S = 4k / 16k 649 / 655 against 591 / 603 for the two-warpgroup tiles;
    # causal 578 / 649 against 509 / 551 (ping-pong 0.97-0.99x of it; one V slot 0.74-0.84x)
    ("fwd_gluon", 256, 2): TileConfig(128, 64, 4, 2, gluon=True, consumers=2),
    ("fwd_gluon_causal", 256, 2): TileConfig(128, 64, 4, 2, gluon=True, consumers=2),
    # D = 256 in the Gluon backward: dV and dK in two launches (split_kv: one [keys, 256] float32
    # accumulator a program).  H200 sweep, RESULTS.md v0.8.6, bf16, whole backward in TFLOP/s
    # (the other pass's kernel fixed): S = 4k: dK/dV 64 x 64 x 4 warps 273, 32 x 64 247, 32 x 128 x 8
    # warps 246, the portable split kernel 220; dQ 64 x 32 x 3 stages 273 (S = 16k causal 288),
    # the portable 128 x 32 267 (278).  S = 16k causal dK/dV: 32 x 128 x 3 stages 251, portable 216
    ("bwd_kv_gluon", 256, 2): TileConfig(64, 64, 4, 2, gluon=True, split_kv=True),
    ("bwd_q_gluon", 256, 2): TileConfig(64, 32, 4, 3, gluon=True),
    # The Gluon backward (ops/gluon/attention_bwd_sm90.py) for the calls in the Gluon forward's
    # scope: bwd_kv: block_n keys resident (one warpgroup), block_m-query tiles streamed;
    # bwd_q: block_m queries resident, block_n-key tiles streamed.  H200 sweep, S = 4k, whole
    # backward TFLOP/s (benchmarks/RESULTS.md v0.5.0): D = 128 dK/dV one tile at a time 425
    # against the portable 406 (overlapped: 367, its 255 registers spill); dQ 403 against 384.
    # D = 64 dK/dV: the portable kernel (363 against 355); dQ 337 against 336.
    ("bwd_kv_gluon", 128, 2): TileConfig(64, 64, 4, 2, gluon=True, overlap=False),
    # D = 64 dK/dV (v0.8.2): Gluon, 355 against the portable kernel's 363 before lse_lo, which the
    # portable kernel subtracts for every score and the Gluon one only where rows need it
    # (fused_dq, dQ inside this kernel, is opt-in: through TMA reduce-adds it measured level with the
    # pair of kernels at S >= 4k, 0.94-1.00x a training step, and 0.65x at S = 1k, where its zeroed
    # accumulator, conversion and delta launches weigh; D = 128 spills, 0.68-0.81x: RESULTS.md
    # v0.8.9, `benchmarks/profile/fused_dq_gpu.py`)
    ("bwd_kv_gluon", 64, 2): TileConfig(64, 64, 4, 3, gluon=True),
    # From 2048 keys, not deterministic: the warp-specialized dK/dV kernel with dQ fused in FA3's
    # layout (half_dq: scores keys by queries, P^T and dS^T register operands, each consumer half
    # of every query tile's dQ; ops/gluon/attention_bwd_dkdv_halfdq_sm90.py).  H100, bf16, backward
    # TFLOP/s against the ordered pair (RESULTS.md v0.9.6): D = 64 S = 4k 428 against 351, S = 16k
    # causal 436 against 348; D = 128 S = 4k causal 420-452 against 387, S = 16k 512-545 against
    # 433; the shared-dQ kernel (the entry before) 374 / 391 / 382 / 496.  v0.9.7, S = 2k: D = 64
    # 383 against 331 (a training step 1.10x), D = 128 442 against 391 (1.05x), causal 360 against
    # 328 (1.04x); S = 1k 1.02-1.05x a step, but causal 0.94x a step at D = 128 (v0.9.6: the backward
    # 0.86x at D = 64): min_keys, which a narrower window also falls short of (`attention._long_bwd_kv`).
    # D = 64 issues a tile's dQ part with the next tile's products (overlap: 1.03-1.09x lockstep);
    # D = 128 lockstep (0.93-1.06x overlap, within the runs' noise).  v0.9.10 (H100, one process a
    # setting, two rounds): from 1024 keys, S = 1k without a mask 1.04x (D = 64) and 1.05x (D = 128) a
    # training step; causal 0.87x and 0.89x, so masked calls ("_causal": causal or windowed) keep 2048
    # (the same tiles: the entries follow the table)
    ("bwd_kv_ws_gluon", 64, 2): TileConfig(128, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, half_dq=True,
                                           min_keys=1024),
    ("bwd_kv_ws_gluon", 128, 2): TileConfig(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, half_dq=True,
                                            overlap=False, min_keys=1024),
    # D = 256 from 4096 keys, not deterministic: the wide dK/dV kernel (two consumers share 64 keys,
    # each half of the head dim's dK, dV and dQ_t; ops/gluon/attention_bwd_dkdv_wide_sm90.py).
    # H100, bf16, one process (RESULTS.md v0.9.8, fused_dq_gpu.py): backward 346 TFLOP/s against the
    # ordered split pair's 296 at S = 4k, 406 against 294 at 16k causal (a training step 1.17x,
    # 1.31x).  Shorter calls are unmeasured, so they keep the pair
    ("bwd_kv_ws_gluon", 256, 2): TileConfig(64, 64, 4, 1, gluon=True, consumers=2, fused_dq=True, half_dq=True,
                                            min_keys=4096),
    ("bwd_q_gluon", 64, 2): TileConfig(64, 64, 4, 3, gluon=True),
    ("bwd_q_gluon", 128, 2): TileConfig(64, 64, 4, 3, gluon=True, v_stages=1),
    ("fwd", 64, 4): TileConfig(64, 64, 4, 2),
    ("fwd", 128, 4): TileConfig(64, 32, 4, 2),
    ("fwd", 256, 4): TileConfig(32, 32, 4, 1),
    ("bwd_kv", 64, 2): TileConfig(32, 128, 4, 3),
    ("bwd_kv", 128, 2): TileConfig(64, 128, 8, 3),
    # With dropout the mask's generator, not the products, bounds the backward, and the split
    # backward runs it twice (dK/dV and dQ kernels): the fused form runs it once.  H200, bias +
    # dropout 0.1, D = 128, S = 4k, fwd+bwd: 187 TFLOP/s fused against 160 split (cuDNN 181);
    # fused with 64 x 64 tiles 114.  (deterministic=True still takes the split backward.)
    ("bwd_kv_dropout", 128, 2): TileConfig(64, 128, 8, 3, fused_dq=True),
    # D = 256 dK / dV: split_kv (dV, then dK, in two launches of one float32 accumulator each:
    # 128 keys x 256 over two warpgroups, nothing computed twice; one more q k^T per tile).
    # Backward-only TFLOP/s, bf16 S = 4k / 16k causal: 226 / 235 against 67 / 74 for the one-launch
    # 16 x 64 tiles, whose two accumulators spilled 496-752 B per thread (sm90_compile_check's
    # stack column).  Dropout keeps the one-launch tiles: the split draws its mask twice and that
    # case was not timed (the issue: dropout must not get slower).
    ("bwd_kv", 256, 2): TileConfig(16, 128, 8, 3, split_kv=True),
    ("bwd_kv_dropout", 256, 2): TileConfig(16, 64, 8, 1),
    ("bwd_kv", 64, 4): TileConfig(32, 64, 4, 2),
    ("bwd_kv", 128, 4): TileConfig(16, 64, 4, 1),
    ("bwd_kv", 256, 4): TileConfig(16, 32, 4, 1),
    ("bwd_q", 64, 2): TileConfig(128, 64, 8, 3),
    ("bwd_q", 128, 2): TileConfig(128, 64, 8, 3),
    # D = 256 dQ: 128 x 32 x 8 warps x 2 stages, no spill (64 x 32 spilled 264-464 B): with the
    # old dK/dV tiles 82 against 67 TFLOP/s backward-only
    ("bwd_q", 256, 2): TileConfig(128, 32, 8, 2),
    ("bwd_q", 64, 4): TileConfig(64, 32, 4, 2),
    ("bwd_q", 128, 4): TileConfig(32, 32, 4, 1),
    ("bwd_q", 256, 4): TileConfig(32, 16, 4, 1),
}
# Every other GPU: tiles sized for the smallest shared memory of the recent ones (99 KB
# per block on sm_86 / sm_89; 163 KB on sm_80), checked offline by
# tools/sm90_compile_check.py --arch 80,89; not tuned.
_GENERIC: dict[tuple[str, int, int], TileConfig] = {
    ("fwd", 64, 2): TileConfig(128, 64, 4, 2),
    ("fwd", 128, 2): TileConfig(64, 64, 4, 2),
    ("fwd", 256, 2): TileConfig(64, 32, 4, 1),
    ("fwd", 64, 4): TileConfig(64, 32, 4, 2),
    ("fwd", 128, 4): TileConfig(32, 32, 4, 2),
    ("fwd", 256, 4): TileConfig(32, 16, 4, 1),
    ("bwd_kv", 64, 2): TileConfig(32, 64, 4, 2),
    ("bwd_kv", 128, 2): TileConfig(32, 64, 4, 1),
    ("bwd_kv", 256, 2): TileConfig(16, 32, 4, 1),
    ("bwd_kv", 64, 4): TileConfig(16, 64, 4, 1),
    ("bwd_kv", 128, 4): TileConfig(16, 32, 4, 1),
    ("bwd_kv", 256, 4): TileConfig(16, 16, 4, 1),
    ("bwd_q", 64, 2): TileConfig(64, 32, 4, 2),
    ("bwd_q", 128, 2): TileConfig(64, 32, 4, 1),
    ("bwd_q", 256, 2): TileConfig(32, 16, 4, 1),
    ("bwd_q", 64, 4): TileConfig(32, 32, 4, 1),
    ("bwd_q", 128, 4): TileConfig(32, 16, 4, 1),
    ("bwd_q", 256, 4): TileConfig(16, 16, 4, 1),
}
_TABLES: dict[tuple[int, int], dict] = {(9, 0): _SM90}
# masked backward calls: the unmasked entries' tiles from 2048 keys (the note at "bwd_kv_ws_gluon")
for _d in (64, 128):
    _SM90[("bwd_kv_ws_gluon_causal", _d, 2)] = replace(_SM90[("bwd_kv_ws_gluon", _d, 2)], min_keys=2048)
del _d
_TABLE = _SM90  # the measured table (tests and tools read it)
_INTERPRETER = TileConfig(16, 16, 1, 1)
KINDS = ("fwd", "fwd_causal", "fwd_decode", "fwd_gluon", "fwd_gluon_causal", "fwd_long_gluon", "fwd_long_gluon_causal",
         "bwd_kv", "bwd_kv_dropout", "bwd_q",
         "bwd_kv_gluon", "bwd_kv_ws_gluon", "bwd_kv_ws_gluon_causal", "bwd_q_gluon")
_overrides: dict[tuple[str, int, int], TileConfig] = {}
ENV_FILE = "FLASHFORGE_TILE_CONFIGS"


def parse_configs(data: dict) -> dict[tuple[str, int, int], TileConfig]:
    """{"kind/bucket/elem": {TileConfig fields}} -> table entries; bad keys raise ValueError."""
    out = {}
    for key, fields in data.items():
        parts = str(key).split("/")
        if len(parts) != 3 or parts[0] not in KINDS:
            raise ValueError(f"{ENV_FILE}: key {key!r} is not '{'|'.join(KINDS)}/<head-dim bucket>/<bytes>'")
        out[(parts[0], int(parts[1]), int(parts[2]))] = TileConfig(**fields)
    return out


def _load_env_file() -> dict[tuple[str, int, int], TileConfig]:
    path = os.environ.get(ENV_FILE)
    if not path:
        return {}
    with open(path) as f:
        return parse_configs(json.load(f))


_from_env = _load_env_file()


def head_dim_block(d: int) -> int:
    """Padded head dim: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(d))


def _bucket(head_dim: int) -> int:
    """The table's head-dim bucket: 64, 128 or 256."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def _lookup(keys, arch) -> TileConfig | None:
    """The first of `keys` found, by source (set_config, then the $FLASHFORGE_TILE_CONFIGS file,
    then the arch's table), earlier keys first within a source; None if none is."""
    for source in (_overrides, _from_env, _TABLES.get(tuple(arch), _GENERIC)):
        for key in keys:
            if key in source:
                return source[key]
    return None


# answers of get_config / gluon_config, which a training step asks ~6 times: the sources change
# only through set_config (which clears this) or by replacing _from_env (tests), checked here
_memo: dict = {}
_memo_env: list = [None]
_generation = [0]  # bumped with every clearing of _memo (launch plans key on it: ops/replay.py)


def _clear_memo() -> None:
    _memo.clear()
    _generation[0] += 1


def _check_env() -> None:
    """Clear the memo if the $FLASHFORGE_TILE_CONFIGS table was replaced since it was filled."""
    if _memo_env[0] is not _from_env:
        _clear_memo()
        _memo_env[0] = _from_env


def _memoized(key):
    _check_env()
    return _memo.get(key, _memo)  # _memo itself: not there


def generation() -> int:
    """A number that changes whenever a tile lookup may answer differently than before."""
    _check_env()
    return _generation[0]


def get_config(kind: str, head_dim: int, elem_size: int, interpret: bool, causal: bool = False,
               arch: tuple[int, int] = (9, 0), dropout: bool = False, decode: bool = False) -> TileConfig:
    """The tiles for one kernel on a GPU of compute capability `arch`.  causal (forward
    only): a "fwd_causal" entry, where there is one, takes precedence over "fwd" at the
    same level (set_config, then the $FLASHFORGE_TILE_CONFIGS file, then the arch's table);
    decode (forward only, a KV-cache call): likewise a "fwd_decode" entry over both (the
    launcher takes it where the call's rows fit its block_m); dropout (dK/dV only): likewise
    a "bwd_kv_dropout" entry over "bwd_kv"."""
    if interpret:
        return _INTERPRETER
    key = ("get", kind, head_dim, elem_size, causal, tuple(arch), dropout, decode)
    cfg = _memoized(key)
    if cfg is _memo:
        cfg = _memo[key] = _get_config(kind, head_dim, elem_size, causal, arch, dropout, decode)
    return cfg


def _get_config(kind: str, head_dim: int, elem_size: int, causal: bool, arch: tuple[int, int],
                dropout: bool, decode: bool = False) -> TileConfig:
    bucket = _bucket(head_dim)
    keys = [(kind, bucket, elem_size)]
    if causal and kind == "fwd":
        keys.insert(0, ("fwd_causal", bucket, elem_size))
    if decode and kind == "fwd":
        keys.insert(0, ("fwd_decode", bucket, elem_size))
    if dropout and kind == "bwd_kv":
        keys.insert(0, ("bwd_kv_dropout", bucket, elem_size))
    cfg = _lookup(keys, arch)
    if cfg is None:
        raise KeyError(keys[-1])
    return cfg


def gluon_config(head_dim: int, elem_size: int, causal: bool, arch: tuple[int, int],
                 kind: str = "fwd") -> TileConfig | None:
    """The Gluon kernel's tiles for pass `kind` ("fwd", "bwd_kv", "bwd_q": the table's
    "<kind>_gluon" entries, and "<kind>_gluon_causal", where there is one, for a causal forward
    or a masked "bwd_kv_ws" call), or None: where there
    is no entry, or where the pass's own tiles are overridden (set_config,
    $FLASHFORGE_TILE_CONFIGS: a sweep or a user chose them, and an override with gluon=True
    asks for Gluon itself)."""
    key = ("gluon", head_dim, elem_size, causal, tuple(arch), kind)
    cfg = _memoized(key)
    if cfg is _memo:
        cfg = _memo[key] = _gluon_config(head_dim, elem_size, causal, arch, kind)
    return cfg


def _gluon_config(head_dim: int, elem_size: int, causal: bool, arch: tuple[int, int],
                  kind: str = "fwd") -> TileConfig | None:
    bucket = _bucket(head_dim)
    base = "fwd" if kind == "fwd_long" else kind  # (overriding the forward's tiles overrides both)
    base_keys = [(base, bucket, elem_size)] + ([("fwd_causal", bucket, elem_size)] if causal and base == "fwd" else [])
    if any(key in source for source in (_overrides, _from_env) for key in base_keys):
        return None
    keys = [(kind + "_gluon", bucket, elem_size)]
    if causal:  # (a "_causal" entry where the table has one: the forward's, "bwd_kv_ws")
        keys.insert(0, (kind + "_gluon_causal", bucket, elem_size))
    return _lookup(keys, arch)


def with_mask(kind: str, cfg: TileConfig) -> TileConfig:
    """The tiles for a call with a mask or bias, whose tile is pipelined with the operands:
    on sm_90, 128-key forward tiles (288 KB) and 3-stage backward tiles at D = 128 with a
    float32 mask (233-239 KB) overflow the 227 KB of shared memory a block may have."""
    if kind == "fwd" and cfg.block_n > 64:
        return replace(cfg, block_n=64, num_stages=min(cfg.num_stages, 3))
    if kind in ("bwd_kv", "bwd_q") and cfg.num_stages > 2:
        return replace(cfg, num_stages=2)
    return cfg


def set_config(kind: str, head_dim_bucket: int, elem_size: int, config: TileConfig | None) -> None:
    """Override (or with None, restore) one table entry."""
    key = (kind, head_dim_bucket, elem_size)
    _clear_memo()
    if config is None:
        _overrides.pop(key, None)
    else:
        _overrides[key] = config
