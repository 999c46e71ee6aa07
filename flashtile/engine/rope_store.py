"""The rotary embedding of q and k and the KV-cache write of a layer, in one kernel.

Unfused, a decode step's layer launches one kernel for the rotary embedding (compiled)
and two for the cache writes (``index_put_`` of k and of v); at batch 1 of a 1B model
each is a few microseconds against ~30 us for the layer's weights, so kernel count is
a visible part of the step (docs/benchmarks/NOTES.md section 15). Here a program takes a
block of q heads or a block of kv heads of one token (a 2D tile of heads x half the head
dim, cos/sin loaded once), rotates them in fp32 (GPT-NeoX halves, as ``rotate_halves``),
writes them to a new q or k tensor, and for kv heads stores the rotated k and the v into
the pool at the token's slot. A negative slot (CUDA-graph padding rows) writes nothing.
Without a pool (``k_cache`` None: the runner's sizing forward) it only rotates.

Until session 16 a program took one head of one token with one warp: 80 us a layer for a
prompt step of 8 x 1024 tokens of Qwen2.5-0.5B on the H200 (~40 MB, 12% of the copy
bandwidth), cos/sin read once per head.

``rope_and_store`` is the launcher (CUDA tensors, or CPU ones under the Triton
interpreter); ``rope_and_store_reference`` is the same in PyTorch, the path the engine
takes elsewhere (its CPU runs, whose logits are compared with transformers').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashtile.ops import _launch, configs
from flashtile.ops._fp8 import _quantize


@triton.jit
def _rotate_heads(Src, Dst, stride_sh, o_h, m_h, o_d, m_d, b_cos, b_sin,
                  HALF: tl.constexpr):
    """Rotate the heads o_h ([HEADS], m_h their mask) of one token: Src's at head
    stride stride_sh, written to Dst's contiguous heads of 2 * HALF. Returns the rotated
    halves ([HEADS, BLOCK_HALF] each) in Dst's dtype."""
    m = m_h[:, None] & m_d[None, :]                                         # [HEADS, BLOCK_HALF]
    p_s = Src + o_h[:, None] * stride_sh + o_d[None, :]
    b_x1 = tl.load(p_s, mask=m, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_s + HALF, mask=m, other=0.0).to(tl.float32)
    b_r1 = (b_x1 * b_cos - b_x2 * b_sin).to(Dst.dtype.element_ty)
    b_r2 = (b_x2 * b_cos + b_x1 * b_sin).to(Dst.dtype.element_ty)
    p_d = Dst + o_h[:, None] * (2 * HALF) + o_d[None, :]
    tl.store(p_d, b_r1, mask=m)
    tl.store(p_d + HALF, b_r2, mask=m)
    return b_r1, b_r2


@triton.jit
def _store_halves(P, b_x1, b_x2, m, Scale, HALF: tl.constexpr):
    """Both halves of a block of heads into pool rows at P. An FP8 pool
    (kv_cache_dtype="fp8") takes them divided by its scale (a 0-d fp32 tensor), rounded
    to nearest even and saturated (attention.to_pool's numbers: a plain cast would not
    saturate everywhere); a 16-bit pool never reads Scale."""
    if P.dtype.element_ty.is_fp8():
        scale = tl.load(Scale)
        tl.store(P, _quantize(b_x1, scale, P.dtype.element_ty), mask=m)
        tl.store(P + HALF, _quantize(b_x2, scale, P.dtype.element_ty), mask=m)
    else:
        tl.store(P, b_x1.to(P.dtype.element_ty), mask=m)
        tl.store(P + HALF, b_x2.to(P.dtype.element_ty), mask=m)


@triton.jit
def _rope_store_kernel(
    Q, K, V, Cos, Sin, Slots, KCache, VCache, KScale, VScale, QOut, KOut,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
    stride_cache_slot, stride_cache_h,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, HEADS_Q: tl.constexpr, HEADS_KV: tl.constexpr,
    STORE: tl.constexpr,
):
    """Program (t, j): token t; j < Q_BLOCKS: q heads [j * HEADS_Q, ...), else kv heads
    [(j - Q_BLOCKS) * HEADS_KV, ...) (rotated k, and with STORE the pool writes of k and
    v at the token's slot). QOut (T, NUM_HEADS, 2 HALF) and KOut contiguous."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    o_d = tl.arange(0, BLOCK_HALF)                                          # [BLOCK_HALF]
    m_d = o_d < HALF
    b_cos = tl.load(Cos + t * stride_ct + o_d, mask=m_d, other=0.0)[None, :]
    b_sin = tl.load(Sin + t * stride_ct + o_d, mask=m_d, other=0.0)[None, :]
    Q_BLOCKS: tl.constexpr = (NUM_HEADS + HEADS_Q - 1) // HEADS_Q
    if j < Q_BLOCKS:
        # Names of their own in each branch: the compiler refuses one name bound to
        # tiles of two shapes (HEADS_Q, HEADS_KV) by the two sides of an if.
        o_hq = j * HEADS_Q + tl.arange(0, HEADS_Q)                          # [HEADS_Q]
        _rotate_heads(Q + t * stride_qt, QOut + t * (NUM_HEADS * 2 * HALF), stride_qh,
                      o_hq, o_hq < NUM_HEADS, o_d, m_d, b_cos, b_sin, HALF)
    else:
        o_h = (j - Q_BLOCKS) * HEADS_KV + tl.arange(0, HEADS_KV)            # [HEADS_KV]
        m_h = o_h < NUM_KV_HEADS
        b_r1, b_r2 = _rotate_heads(K + t * stride_kt, KOut + t * (NUM_KV_HEADS * 2 * HALF),
                                   stride_kh, o_h, m_h, o_d, m_d, b_cos, b_sin, HALF)
        if STORE:
            slot = tl.load(Slots + t)
            if slot >= 0:
                m = m_h[:, None] & m_d[None, :]                             # [HEADS_KV, BLOCK_HALF]
                o_c = slot * stride_cache_slot + o_h[:, None] * stride_cache_h + o_d[None, :]
                p_v = V + t * stride_vt + o_h[:, None] * stride_vh + o_d[None, :]
                _store_halves(KCache + o_c, b_r1, b_r2, m, KScale, HALF)
                _store_halves(VCache + o_c, tl.load(p_v, mask=m), tl.load(p_v + HALF, mask=m),
                              m, VScale, HALF)


# The kernel parameters a call of a plan fills, in this order (``_launch``).
_SLOTS = ("Q", "K", "V", "Cos", "Sin", "Slots", "KCache", "VCache", "KScale", "VScale",
          "QOut", "KOut")


def rope_and_store(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                   slot_mapping: Tensor | None, k_cache: Tensor | None,
                   v_cache: Tensor | None, k_scale: Tensor | None = None,
                   v_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q (T, H, d), k/v (T, Hkv, d), each with a unit last stride (views of the fused
    projection are fine); cos/sin (T, d / 2) fp32 per token with a unit last stride;
    slot_mapping (T,) int64; k_cache/v_cache (num_blocks, page_size, Hkv, d) contiguous
    in q's dtype or an FP8 format (written as attention.to_pool quantises), or None
    (then nothing is stored and slot_mapping is not read); k_scale/v_scale: an FP8
    pool's scales, 0-d fp32 on q's device (None: 1.0). Returns the rotated q (T, H, d)
    and k (T, Hkv, d), contiguous; writes rotated k and v at each slot >= 0."""
    t, h, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if not t:
        return q_out, k_out
    store = k_cache is not None
    if store and k_cache.dtype.itemsize == 1:
        k_scale, v_scale = (_unit_scale(q.device) if x is None else _check_scale(x, name, q)
                            for x, name in ((k_scale, "k_scale"), (v_scale, "v_scale")))
    # Without a pool, q and q_out stand in for the tensors the kernel then never reads
    # (and for the scales of a 16-bit pool).
    tensors = (q, k, v, cos, sin, slot_mapping if store else q, k_cache if store else q_out,
               v_cache if store else q_out, q_out if k_scale is None else k_scale,
               q_out if v_scale is None else v_scale, q_out, k_out)
    key = None
    if _launch.ready(q):
        p = _launch.pointers(tensors)
        # q_out and k_out are left out of the alignment: fresh allocations are aligned
        # (the scales are read one scalar each).
        key = ("rope_store", q.dtype, q.shape[1:], q.stride(), k.shape[1:], k.stride(),
               v.stride(), cos.dtype, cos.stride(), store and (
                   slot_mapping.dtype, k_cache.dtype, k_cache.stride(), v_cache.dtype),
               _launch.misalignment(p[:8]))
        found = _launch.lookup(key)
        if found is not None:
            blocks, plan = found
            plan(p, (t, blocks, 1))
            return q_out, k_out
    if store and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache/v_cache: expected contiguous pools, got strides "
                         f"{k_cache.stride()} and {v_cache.stride()}")
    if not all(x.stride(-1) == 1 for x in (q, k, v, cos, sin)):
        raise ValueError("q, k, v, cos, sin: expected a unit last stride each, got "
                         f"{[x.stride() for x in (q, k, v, cos, sin)]}")
    block_half, heads_q, heads_kv, warps = configs.rope_store_tile(h, hkv, d // 2, q.device)
    blocks = configs.cdiv(h, heads_q) + configs.cdiv(hkv, heads_kv)
    plan = _launch.first_launch(
        _rope_store_kernel, (t, blocks),
        (*tensors, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
         v.stride(1), cos.stride(0), k_cache.stride(1) if store else 0,
         k_cache.stride(2) if store else 0),
        dict(NUM_HEADS=h, NUM_KV_HEADS=hkv, HALF=d // 2, BLOCK_HALF=block_half,
             HEADS_Q=heads_q, HEADS_KV=heads_kv, STORE=store, num_warps=warps),
        _SLOTS if key is not None else None)
    if key is not None:
        _launch.store(key, (blocks, plan))
    return q_out, k_out


_UNIT_SCALES: dict = {}


def _check_scale(x, name, q):
    if not (isinstance(x, Tensor) and x.dtype == torch.float32 and x.dim() == 0
            and x.device == q.device):
        raise ValueError(f"{name}: expected a 0-d float32 tensor on {q.device}, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    return x


def _unit_scale(device) -> Tensor:
    """A 0-d fp32 1.0 on device, made once (an FP8 pool's scale where none is given)."""
    one = _UNIT_SCALES.get(device)
    if one is None:
        one = _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def rotate_halves(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head (GPT-NeoX layout); x (T, heads, d), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_and_store_reference(q, k, v, cos, sin, slot_mapping, k_cache, v_cache,
                             k_scale=None, v_scale=None):
    """rope_and_store in PyTorch: the same results and the same cache writes (an FP8
    pool's as attention.to_pool quantises them)."""
    from flashtile.engine.attention import store_kv

    q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
    if k_cache is None:
        return q, k
    keep = slot_mapping >= 0
    store_kv(k_cache, v_cache, slot_mapping[keep], k[keep], v[keep], k_scale, v_scale)
    return q, k
