"""The rotary embedding of q and k and the KV-cache write of a layer, in one kernel.

Unfused, a decode step's layer launches one kernel for the rotary embedding (compiled)
and two for the cache writes (``index_put_`` of k and of v); at batch 1 of a 1B model
each is a few microseconds against ~30 us for the layer's weights, so kernel count is
a visible part of the step (docs/benchmarks/NOTES.md section 15). Here one program per
(token, head) rotates its q or k head in fp32 (GPT-NeoX halves, as ``rotate_halves``),
writes it to a new q or k tensor, and for a kv head stores the rotated k and the v into
the pool at the token's slot. A negative slot (CUDA-graph padding rows) writes nothing.

``rope_and_store`` is the launcher (CUDA tensors, or CPU ones under the Triton
interpreter); ``rope_and_store_reference`` is the same in PyTorch, the path the engine
takes elsewhere (its CPU runs, whose logits are compared with transformers').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rope_store_kernel(
    Q, K, V, Cos, Sin, Slots, KCache, VCache, QOut, KOut,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
    stride_cache_slot, stride_cache_h, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_H)
    m = offs < HALF
    c = tl.load(Cos + t * stride_ct + offs, mask=m, other=0.0)
    s = tl.load(Sin + t * stride_ct + offs, mask=m, other=0.0)
    if head < num_heads:
        src = Q + t * stride_qt + head * stride_qh
        dst = QOut + (t * num_heads + head) * (2 * HALF)
    else:
        src = K + t * stride_kt + (head - num_heads) * stride_kh
        dst = KOut + (t * (tl.num_programs(1) - num_heads) + head - num_heads) * (2 * HALF)
    x1 = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=m, other=0.0).to(tl.float32)
    r1 = (x1 * c - x2 * s).to(QOut.dtype.element_ty)
    r2 = (x2 * c + x1 * s).to(QOut.dtype.element_ty)
    tl.store(dst + offs, r1, mask=m)
    tl.store(dst + HALF + offs, r2, mask=m)
    if head >= num_heads:
        slot = tl.load(Slots + t)
        if slot >= 0:
            hk = head - num_heads
            at = slot * stride_cache_slot + hk * stride_cache_h
            tl.store(KCache + at + offs, r1, mask=m)
            tl.store(KCache + at + HALF + offs, r2, mask=m)
            v = V + t * stride_vt + hk * stride_vh
            tl.store(VCache + at + offs, tl.load(v + offs, mask=m), mask=m)
            tl.store(VCache + at + HALF + offs, tl.load(v + HALF + offs, mask=m), mask=m)


def rope_and_store(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                   slot_mapping: Tensor, k_cache: Tensor, v_cache: Tensor
                   ) -> tuple[Tensor, Tensor]:
    """q (T, H, d), k/v (T, Hkv, d), each with a unit last stride (views of the fused
    projection are fine); cos/sin (T, d / 2) fp32 per token; slot_mapping (T,) int64;
    k_cache/v_cache (num_blocks, page_size, Hkv, d) contiguous. Returns the rotated q
    (T, H, d) and k (T, Hkv, d), contiguous; writes rotated k and v at each slot >= 0."""
    t, h, d = q.shape
    hkv = k.shape[1]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache/v_cache: expected contiguous pools, got strides "
                         f"{k_cache.stride()} and {v_cache.stride()}")
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t:
        _rope_store_kernel[(t, h + hkv)](
            q, k, v, cos, sin, slot_mapping, k_cache, v_cache, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), k_cache.stride(1), k_cache.stride(2), h,
            HALF=d // 2, BLOCK_H=triton.next_power_of_2(d // 2), num_warps=1)
    return q_out, k_out


def rotate_halves(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head (GPT-NeoX layout); x (T, heads, d), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_and_store_reference(q, k, v, cos, sin, slot_mapping, k_cache, v_cache):
    """rope_and_store in PyTorch: the same results and the same cache writes."""
    q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
    keep = slot_mapping >= 0
    flat = (-1, *k_cache.shape[2:])
    k_cache.view(flat)[slot_mapping[keep]] = k[keep]
    v_cache.view(flat)[slot_mapping[keep]] = v[keep]
    return q, k
