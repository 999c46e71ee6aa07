"""flashtile: exact FlashAttention for PyTorch, in Python and Triton."""

import logging

from flashtile.inference import flash_attn_with_kvcache
from flashtile.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    scaled_dot_product_attention,
)
from flashtile._validate import set_index_checks
from flashtile.merge import merge_attention_states
from flashtile.sdpa_routing import sdpa_override
from flashtile import nn  # flashtile.nn.MultiheadAttention, .Attention

__version__ = "0.1.0"
__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_attention_states",
    "nn",
    "scaled_dot_product_attention",
    "sdpa_override",
    "set_index_checks",
]

logging.getLogger("flashtile").addHandler(logging.NullHandler())
