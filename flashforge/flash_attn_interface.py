"""flash-attn 2's ``flash_attn.flash_attn_interface``, computed by flashforge: change the import,
keep the calls.  See `flashforge.interfaces.flash_attn` for the meaning and the differences."""
from .interfaces.flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                    flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                    flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
