"""Stand-in for the flash_attn package: flashforge's drop-ins under flash-attn's names (README.md)."""
from flashforge.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                             flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                             flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
