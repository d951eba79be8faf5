"""flash_attn.flash_attn_interface as flash-attn's tests import it."""
from flashforge.flash_attn_interface import *  # noqa: F401,F403

USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    # flash-attn's kernel tile width, used only to decode its S_dmask (skipped by fa_compat_plugin)
    raise NotImplementedError("flashforge returns no S_dmask to decode")
