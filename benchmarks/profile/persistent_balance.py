"""A model of how evenly the persistent forward's programs share a causal call's work (no GPU).

    python benchmarks/profile/persistent_balance.py

Each item (a query block of one head) costs its key tiles plus a fixed part (FIXED tiles: Q load,
o store); items are ordered as `ops/gluon/pipeline.program_order` orders the grid (longest first
within L2 sections of at most one wave).  Printed: the busiest program's work over the mean over
all SMS multiprocessors, for the hardware's dynamic start order (the non-persistent grid: each
item starts on the first free SM), rounds striding over every SM, and the persistent kernel's
snake-order rounds over `attention.persistent_programs` programs (RESULTS.md v0.9.12)."""
import heapq
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from flashforge.ops.gluon.attention import persistent_programs  # noqa: E402
from flashforge.ops.gluon.pipeline import section_heads  # noqa: E402

SMS, FIXED = 132, 0.3  # (sections: $FLASHFORGE_L2_SECTION and $FLASHFORGE_WAVE, as the kernels)


def order(pid, n_blk, n_bh, head_bytes):
    """`pipeline.program_order` with a causal mask, in Python: (block, head) of item pid."""
    sect = section_heads(head_bytes, n_blk, n_bh)
    size = sect * n_blk
    s, r = divmod(pid, size)
    g = min(sect, n_bh - s * sect)
    blk = r // g
    return blk, s * sect + (r - blk * g)


def rounds(items, P, snake):
    load = [0.0] * P
    for k in range(-(-len(items) // P)):
        for p in range(P):
            t = k * P + ((P - 1 - p) if snake and k % 2 else p)
            if t < len(items):
                load[p] += items[t]
    return max(load)


def main():
    print(f"{'case':<26}{'dynamic':>9}{'stride':>9}{'snake':>9}   P")
    for D, S, BH in ((128, 1024, 256), (128, 4096, 64), (128, 16384, 16), (64, 4096, 128), (128, 2048, 128)):
        n_blk = S // 128
        hb = S * 4 * D
        items = []
        for t in range(n_blk * BH):
            blk, _ = order(t, n_blk, BH, hb)
            items.append(n_blk - blk + FIXED)  # causal: block 0 is the last query block, all n_blk tiles
        mean = sum(items) / SMS
        heap = [0.0] * SMS
        for w in items:
            heapq.heappush(heap, heapq.heappop(heap) + w)
        P = persistent_programs((n_blk, BH), hb, True, SMS)
        print(f"{f'D{D} S{S} B*H {BH}':<26}{max(heap) / mean:9.3f}{rounds(items, SMS, False) / mean:9.3f}"
              f"{rounds(items, P, True) / mean:9.3f}   {P}")


if __name__ == "__main__":
    main()
