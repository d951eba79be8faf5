"""Context parallelism: attention over a sequence sharded across processes, through torch.distributed.

``import flashforge.distributed`` is the entry point (``import flashforge`` does not import
torch.distributed).  Files: layout.py (which rows each rank holds), plan.py (the calls of a
ring step, the blocks' routes), block.py (one call on the kernels, the lse merge), ring.py
and allgather.py (the two strategies), comm.py (the collectives), ops.py (the custom ops),
api.py (the public functions).
"""
import torch.distributed as _dist

if not _dist.is_available():
    raise ImportError("flashforge.distributed needs torch.distributed, which this build of PyTorch lacks "
                      "(torch.distributed.is_available() is False)")

from .api import context_parallel_attention, shard_sequence, unshard_sequence  # noqa: E402

__all__ = ["context_parallel_attention", "shard_sequence", "unshard_sequence"]
