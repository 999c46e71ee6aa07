"""Combining a split decode's partials (Dao et al., Flash-Decoding, 2023).

A split decode (``flashtile.ops.decode``) cuts the cache length into splits, and each
split writes its normalized partial output out_s and its lse_s (fp32). They merge
exactly through the lse: with m the largest lse_s of a row and w_s = exp(lse_s - m),

    out = sum_s w_s out_s / sum_s w_s,    lse = m + log(sum_s w_s).

``_combine_kernel`` runs the merge as a second launch, one program per (batch, query
token, query head) row; on Hopper a programmatic dependent launch (``combine_pdl``)
whose programs are scheduled while the decode programs finish.
"""

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from flashtile.ops import _launch, configs


# The split count and the partial lse's split stride (splits x batch x heads) follow the
# batch and the cache length: unspecialised, one variant per BLOCK_S (as _decode_kernel).
# A split count known to be a multiple of 16 would save a few predicates of the split
# mask (sm_90 PTX), not a load.
@triton.jit(do_not_specialize=["stride_lps", "num_splits"])
def _combine_kernel(OutPartial, LsePartial, Out, Lse,
                    stride_ps, stride_pb, stride_pm, stride_ph,
                    stride_lps, stride_lpb, stride_lph,
                    stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
                    num_splits, nheads, seqlen_q, head_dim,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """out = sum_s out_s * exp(lse_s - lse), lse = logsumexp_s lse_s, one row per program."""
    if USE_PDL:
        # Launched before the decode grid finished: wait until its partials are visible.
        gdc_wait()
    row = tl.program_id(0)
    off_h = row % nheads
    off_t = (row // nheads) % seqlen_q
    off_b = row // (nheads * seqlen_q)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    m_s = offs_s < num_splits
    lse_s = tl.load(LsePartial + offs_s * stride_lps + off_b * stride_lpb + off_h * stride_lph
                    + off_t, mask=m_s, other=float("-inf"))                # (S,)
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)                                              # (S,)
    total = tl.sum(w, 0)
    b_o = tl.load(OutPartial + offs_s[:, None] * stride_ps + off_b * stride_pb
                  + off_t * stride_pm + off_h * stride_ph + offs_d[None, :],
                  mask=m_s[:, None] & (offs_d[None, :] < head_dim), other=0.0)  # (S, D)
    # == 0, not > 0: a NaN partial lse makes total NaN and must come out NaN.
    total_safe = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(b_o * w[:, None], 0) / total_safe
    lse = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total_safe))
    tl.store(Out + off_b * stride_ob + off_t * stride_om + off_h * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=offs_d < head_dim)
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + off_t, lse)


def _combine_warps(elements: int) -> int:
    """Warps of the combine for a (splits, head_dim) tile: one up to 32 x 128 (the
    common decode; PDL's early launch wants it small), then enough that each thread
    holds at most 128 of its fp32 partials (sm_90 AOT: one warp at 32 x 512 spills)."""
    return 1 if elements <= 32 * 128 else min(16, max(4, elements // (128 * 32)))


def combine_pdl(q) -> tuple[bool, bool]:
    """(combine is a programmatic dependent launch, decode signals it early): Hopper and
    later. FLASHTILE_DECODE_PDL=0 turns it off, =late keeps the dependent launch but
    signals only when the decode grid ends (A/B timing). Read when a plan is made."""
    mode = os.environ.get("FLASHTILE_DECODE_PDL", "1").strip().lower()
    if mode not in ("0", "1", "late"):
        raise ValueError(f"FLASHTILE_DECODE_PDL must be '0', '1' or 'late', got {mode!r}")
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9) or mode == "0":
        return False, False
    return True, mode == "1"


_COMBINE_SLOTS = ("OutPartial", "LsePartial", "Out", "Lse")


def launch_combine(q, dv, num_splits, dst, dst_lse, out, lse_t, pdl, planned):
    """Merge a split decode's partials (dst (splits, b, sq, h, dv) fp32 and dst_lse
    (splits, b, h, sq)) into out and lse_t with _combine_kernel, a programmatic
    dependent launch when pdl (combine_pdl); returns its plan when planned."""
    b, sq, h = q.shape[:3]
    block_s = configs.next_power_of_2(num_splits)
    block_dv = configs.padded_head_dim(dv)
    return _launch.first_launch(
        _combine_kernel, (b * sq * h,),
        (dst, dst_lse, out, lse_t, *dst.stride()[:4], *dst_lse.stride()[:3],
         out.stride(0), out.stride(1), out.stride(2), lse_t.stride(0), lse_t.stride(1),
         num_splits, h, sq, dv),
        # One warp while its tile fits in 128 registers a thread: no cross-warp
        # reductions. H200, 32 splits x d128 alone: 1.66 us, 4 warps 2.69 (NOTES 9).
        dict(BLOCK_S=block_s, BLOCK_D=block_dv, USE_PDL=pdl, launch_pdl=pdl,
             num_warps=_combine_warps(block_s * block_dv)),
        _COMBINE_SLOTS if planned else None)
