"""PyTorch modules computed by flashtile.

``MultiheadAttention``: a drop-in for ``torch.nn.MultiheadAttention`` (same constructor,
parameters and state dict). ``Attention``: the attention block of a decoder or encoder
for model builders (fused QKV projection, GQA, rotary embedding, q/k RMSNorm, sliding
window, softcap, packed sequences, and a KV cache for decoding).
"""

from flashtile.nn.attention import Attention
from flashtile.nn.multihead import MultiheadAttention

__all__ = ["Attention", "MultiheadAttention"]
