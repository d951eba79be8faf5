"""flashforge: exact flash attention for PyTorch (Triton on GPUs, chunked PyTorch on CPUs)."""
from ._version import __version__
from . import reference
from .api.attention import attention
from .api.dropout import dropout_mask
from .api.kvcache import Rope, attention_with_kvcache
from .api.rope import apply_rope
from .api.varlen import attention_varlen
from .interfaces.sdpa import scaled_dot_product_attention

__all__ = ["Rope", "__version__", "apply_rope", "attention", "attention_varlen", "attention_with_kvcache",
           "dropout_mask", "reference", "scaled_dot_product_attention"]
