"""Where an eager batch-1 decode call spends its host time (NOTES.md section 11).

flash_attn_with_kvcache at batch 1 x 8k keys, 32/8 heads, d128 (split: decode and
combine kernels), its index check, its launcher; a step's wall time eager and compiled
with CUDA graphs beside cuDNN's SDPA; a cProfile by own time.
Run on the GPU: PYTHONPATH=. python3 benchmarks/profile_decode_host.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile import _validate as V
from flashtile import inference
from flashtile.ops.decode import attn_decode

from _host_timing import loop_us, print_profile  # benchmarks/_host_timing.py


q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
seqlens = torch.full((1,), 8192, dtype=torch.int32, device="cuda")
kw = dict(alibi_slopes=None, softmax_scale=0.088, window_left=-1, window_right=-1,
          softcap=0.0)


def call():
    return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)


parts = {
    "flash_attn_with_kvcache": call,
    "  _check_cache (shapes, dtypes, devices)": lambda: inference._check_cache(
        q, k, v, None, None, None, seqlens, None, None),
    "  check_index_values (one sync)": lambda: V.check_index_values(
        k, None, seqlens, None, None, 0),
    "  attn_decode (launcher, 2 kernels)": lambda: attn_decode(
        q, k, v, cache_seqlens=seqlens, block_table=None, cache_batch_idx=None,
        cache_leftpad=None, num_splits=0, allow_tf32=False, **kw),
    "  attn_decode unsplit (1 kernel)": lambda: attn_decode(
        q, k, v, cache_seqlens=seqlens, block_table=None, cache_batch_idx=None,
        cache_leftpad=None, num_splits=1, allow_tf32=False, **kw),
    "  torch.empty x4": lambda: [torch.empty(1, 1, 32, 128, device="cuda")
                                for _ in range(4)],
}
for name, fn in parts.items():
    print(f"{name}: {loop_us(fn)[0]:.1f} us", flush=True)
# What a serving loop sees per step (wall us, a synchronized loop of 300 steps): eager,
# and compiled with CUDA graphs (mode="reduce-overhead"), flashtile beside cuDNN's SDPA.
qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def sdpa():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)


for name, fn in (("flashtile", call), ("sdpa-cudnn", sdpa)):
    print(f"{name} eager step: {loop_us(fn, warmup=30)[1]:.1f} us", flush=True)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    print(f"{name} compiled (reduce-overhead) step: {loop_us(compiled, warmup=30)[1]:.1f} us",
          flush=True)
print_profile(call, 300, 22)
