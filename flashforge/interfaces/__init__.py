"""Drop-in replacements for other attention APIs, computed by flashforge's kernels.

* `scaled_dot_product_attention`: ``torch.nn.functional.scaled_dot_product_attention``
  (``[..., H, L, E]`` layout, top-left causal, SDPA's masks and errors);
* `flash_attn_func`, `flash_attn_qkvpacked_func`, `flash_attn_kvpacked_func`: flash-attn 2's
  functions (``[B, S, H, D]`` layout, bottom-right causal), also importable as
  ``flashforge.flash_attn_interface``.
"""
from .flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from .sdpa import SDPAInputError, scaled_dot_product_attention

__all__ = ["SDPAInputError", "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "scaled_dot_product_attention"]
