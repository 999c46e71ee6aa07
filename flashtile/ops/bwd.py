"""FlashAttention backward: recompute P from the saved lse, no N x N tensor in memory.

Algorithm: Dao, FlashAttention-2 (2023), Algorithm 2, split into two kernels that own
their outputs: ``_bwd_dkdv_kernel`` (one program per key block and KV head, looping over
every query block of every query head in the group) and ``_bwd_dq_kernel`` (one program
per query block, looping over key blocks). No atomics, so the gradients are bitwise
reproducible, and GQA needs no copy of K/V: the group sum happens in registers.

``delta = rowsum(dO * O) - dlse`` (preprocess kernel) folds the gradient of the lse, when
the caller used it, into dS = P * (dP - delta).
"""

import torch
import triton
import triton.language as tl

from flashtile.ops import _launch, configs
from flashtile.ops._common import (LOG2E, _block_range, _fill_nan_rows, _load_tile,
                                   _prefix_sums_bad, _scores_log2, _seq_bounds, _tanh)


@triton.jit
def _bwd_preprocess_kernel(Out, DOut, DLse, Delta,
                           stride_ob, stride_om, stride_oh,
                           stride_dob, stride_dom, stride_doh,
                           nheads, seqlen_q, head_dim,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                           HAS_DLSE: tl.constexpr):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_tile = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    b_o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om
                  + offs_d[None, :], mask=m_tile, other=0.0).to(tl.float32)
    b_do = tl.load(DOut + off_b * stride_dob + off_h * stride_doh
                   + offs_m[:, None] * stride_dom + offs_d[None, :],
                   mask=m_tile, other=0.0).to(tl.float32)
    delta = tl.sum(b_o * b_do, 1)                                        # (M,)
    p_row = off_bh * seqlen_q + offs_m  # DLse and Delta are (b, h, sq) contiguous
    if HAS_DLSE:
        delta -= tl.load(DLse + p_row, mask=offs_m < seqlen_q, other=0.0)
    tl.store(Delta + p_row, delta, mask=offs_m < seqlen_q)


@triton.jit
def _load_lse_log2(p_lse, offs, n):
    # Rows that saw no key have lse = -inf; +inf makes their P exactly 0 instead of NaN.
    lse = tl.load(p_lse + offs, mask=offs < n, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _dkdv_block(dk, dv, b_k, b_v, p_q, p_do, p_lse, p_delta, start, stop,
                offs_n, offs_m0, offs_d, seqlen_q, seqlen_k, head_dim,
                stride_qm, stride_dom, diag_offset, window_left, window_right,
                softmax_scale, softcap, alibi_slope, p_mask, stride_mask_m, stride_mask_n,
                BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, BOUNDARY: tl.constexpr,
                MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
                INPUT_PRECISION: tl.constexpr):
    # Transposed tile: rows are this program's keys, cols the query block.
    for start_m in tl.range(start, stop, BLOCK_M):
        offs_m = start_m + offs_m0
        b_q = _load_tile(p_q + start_m * stride_qm, offs_m, seqlen_q, offs_d, head_dim,
                         BOUNDARY, EVEN_D)                                    # (M, D)
        qk_t = tl.dot(b_k, tl.trans(b_q), input_precision=INPUT_PRECISION)   # (N, M)
        m_mask = (offs_n[:, None] < seqlen_k) & (offs_m[None, :] < seqlen_q)
        s_t = _scores_log2(qk_t, offs_n, offs_m, seqlen_q, -diag_offset, window_right,
                           window_left, softmax_scale, softcap, alibi_slope, p_mask,
                           stride_mask_n, stride_mask_m, m_mask, BOUNDARY, MASK_RIGHT,
                           MASK_LEFT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL)
        p_t = tl.exp2(s_t - _load_lse_log2(p_lse, offs_m, seqlen_q)[None, :])  # (N, M)
        b_do = _load_tile(p_do + start_m * stride_dom, offs_m, seqlen_q, offs_d, head_dim,
                          BOUNDARY, EVEN_D)                                   # (M, D)
        dv = tl.dot(p_t.to(b_do.dtype), b_do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(b_v, tl.trans(b_do), input_precision=INPUT_PRECISION)  # (N, M)
        delta = tl.load(p_delta + offs_m, mask=offs_m < seqlen_q, other=0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            t = _tanh(qk_t * (softmax_scale / softcap))
            ds_t = ds_t * (1.0 - t * t)
        dk = tl.dot(ds_t.to(b_q.dtype), b_q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _varlen_bad(CuSeqlensQ, CuSeqlensK, batch, total_q, total_k, max_seqlen_q,
                max_seqlen_k):
    """Entries of the prefix sums that would send the kernel outside the packed rows or
    leave rows to no program (0: valid); then the gradients are NaN (``_common``)."""
    return (_prefix_sums_bad(CuSeqlensQ, batch, total_q, max_seqlen_q)
            + _prefix_sums_bad(CuSeqlensK, batch, total_k, max_seqlen_k))


# max_seqlen_q/k change from call to call: not specialised (one kernel, one plan).
@triton.jit(do_not_specialize=["max_seqlen_q", "max_seqlen_k"])
def _bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, Mask, Alibi, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lb, stride_lh,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_alibi_b, stride_alibi_h,
    nheads, nheads_kv, seqlen_q, seqlen_k, head_dim,
    total_q, total_k, max_seqlen_q, max_seqlen_k,
    diag_offset, window_left, window_right, softmax_scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, INPUT_PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    start_n = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // nheads_kv
    off_hkv = off_bh % nheads_kv
    group_size = nheads // nheads_kv
    if IS_VARLEN:
        batch = tl.num_programs(1) // nheads_kv
        if _varlen_bad(CuSeqlensQ, CuSeqlensK, batch, total_q, total_k, max_seqlen_q,
                       max_seqlen_k) > 0:
            chunk = off_b * tl.num_programs(0) + start_n
            n_chunks = batch * tl.num_programs(0)
            _fill_nan_rows(DK + off_hkv * stride_dkh, stride_dkn, total_k, head_dim,
                           chunk, n_chunks, BLOCK_N, BLOCK_D)
            _fill_nan_rows(DV + off_hkv * stride_dvh, stride_dvn, total_k, head_dim,
                           chunk, n_chunks, BLOCK_N, BLOCK_D)
            return
    q_start, k_start, seqlen_q, seqlen_k, diag_offset = _seq_bounds(
        CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset, IS_VARLEN)
    if start_n * BLOCK_N >= seqlen_k:  # varlen: the grid covers the longest sequence
        return

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    Q += off_b * stride_qb + q_start * stride_qm
    DOut += off_b * stride_dob + q_start * stride_dom
    K += off_b * stride_kb + k_start * stride_kn
    V += off_b * stride_vb + k_start * stride_vn
    DK += off_b * stride_dkb + k_start * stride_dkn
    DV += off_b * stride_dvb + k_start * stride_dvn
    p_k = K + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    p_v = V + off_hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    b_k = _load_tile(p_k, offs_n, seqlen_k, offs_d, head_dim, True, EVEN_D)   # (N, D)
    b_v = _load_tile(p_v, offs_n, seqlen_k, offs_d, head_dim, True, EVEN_D)   # (N, D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _block_range(start_n, seqlen_k, seqlen_q, -diag_offset,
                                          window_right, window_left, BLOCK_N, BLOCK_M,
                                          MASK_RIGHT, MASK_LEFT)
    for g in range(0, group_size):
        off_h = off_hkv * group_size + g
        p_q = Q + off_h * stride_qh + offs_m0[:, None] * stride_qm + offs_d[None, :]
        p_do = DOut + off_h * stride_doh + offs_m0[:, None] * stride_dom + offs_d[None, :]
        # Delta shares lse's layout.
        p_lse = Lse + off_b * stride_lb + off_h * stride_lh + q_start
        p_delta = Delta + off_b * stride_lb + off_h * stride_lh + q_start
        alibi_slope = 0.0
        if HAS_ALIBI:
            alibi_slope = tl.load(Alibi + off_b * stride_alibi_b + off_h * stride_alibi_h)
        p_mask = Mask
        if HAS_MASK:
            p_mask = Mask + off_b * stride_mask_b + off_h * stride_mask_h
        dk, dv = _dkdv_block(
            dk, dv, b_k, b_v, p_q, p_do, p_lse, p_delta, lo, mid_lo, offs_n, offs_m0,
            offs_d, seqlen_q, seqlen_k, head_dim, stride_qm, stride_dom, diag_offset,
            window_left, window_right, softmax_scale, softcap, alibi_slope, p_mask,
            stride_mask_m, stride_mask_n, BLOCK_M, EVEN_D, True, MASK_LEFT, MASK_RIGHT,
            HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL, INPUT_PRECISION)
        dk, dv = _dkdv_block(
            dk, dv, b_k, b_v, p_q, p_do, p_lse, p_delta, mid_lo, mid_hi, offs_n, offs_m0,
            offs_d, seqlen_q, seqlen_k, head_dim, stride_qm, stride_dom, diag_offset,
            window_left, window_right, softmax_scale, softcap, alibi_slope, p_mask,
            stride_mask_m, stride_mask_n, BLOCK_M, EVEN_D, False, MASK_LEFT, MASK_RIGHT,
            HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL, INPUT_PRECISION)
        dk, dv = _dkdv_block(
            dk, dv, b_k, b_v, p_q, p_do, p_lse, p_delta, mid_hi, hi, offs_n, offs_m0,
            offs_d, seqlen_q, seqlen_k, head_dim, stride_qm, stride_dom, diag_offset,
            window_left, window_right, softmax_scale, softcap, alibi_slope, p_mask,
            stride_mask_m, stride_mask_n, BLOCK_M, EVEN_D, True, MASK_LEFT, MASK_RIGHT,
            HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL, INPUT_PRECISION)

    m_tile = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < head_dim)
    p_dk = DK + off_hkv * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    p_dv = DV + off_hkv * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :]
    tl.store(p_dk, (dk * softmax_scale).to(DK.dtype.element_ty), mask=m_tile)
    tl.store(p_dv, dv.to(DV.dtype.element_ty), mask=m_tile)


@triton.jit
def _dq_block(dq, b_q, b_do, lse_log2, delta, p_k, p_v, start, stop,
              offs_m, offs_n0, offs_d, seqlen_q, seqlen_k, head_dim,
              stride_kn, stride_vn, diag_offset, window_left, window_right,
              softmax_scale, softcap, alibi_slope, p_mask, stride_mask_m, stride_mask_n,
              BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, BOUNDARY: tl.constexpr,
              MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
              INPUT_PRECISION: tl.constexpr):
    for start_n in tl.range(start, stop, BLOCK_N):
        offs_n = start_n + offs_n0
        b_k = _load_tile(p_k + start_n * stride_kn, offs_n, seqlen_k, offs_d, head_dim,
                         BOUNDARY, EVEN_D)                                  # (N, D)
        b_v = _load_tile(p_v + start_n * stride_vn, offs_n, seqlen_k, offs_d, head_dim,
                         BOUNDARY, EVEN_D)                                  # (N, D)
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=INPUT_PRECISION)   # (M, N)
        m_mask = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
        s = _scores_log2(qk, offs_m, offs_n, seqlen_k, diag_offset, window_left,
                         window_right, softmax_scale, softcap, alibi_slope, p_mask,
                         stride_mask_m, stride_mask_n, m_mask, BOUNDARY, MASK_LEFT,
                         MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL)
        p = tl.exp2(s - lse_log2[:, None])                                 # (M, N)
        dp = tl.dot(b_do, tl.trans(b_v), input_precision=INPUT_PRECISION)  # (M, N)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            t = _tanh(qk * (softmax_scale / softcap))
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(b_k.dtype), b_k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["max_seqlen_q", "max_seqlen_k"])
def _bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, Mask, Alibi, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_alibi_b, stride_alibi_h,
    nheads, group_size, seqlen_q, seqlen_k, head_dim,
    total_q, total_k, max_seqlen_q, max_seqlen_k,
    diag_offset, window_left, window_right, softmax_scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, INPUT_PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    off_hkv = off_h // group_size
    if IS_VARLEN:
        batch = tl.num_programs(1) // nheads
        if _varlen_bad(CuSeqlensQ, CuSeqlensK, batch, total_q, total_k, max_seqlen_q,
                       max_seqlen_k) > 0:
            chunk = off_b * tl.num_programs(0) + start_m
            _fill_nan_rows(DQ + off_h * stride_dqh, stride_dqm, total_q, head_dim, chunk,
                           batch * tl.num_programs(0), BLOCK_M, BLOCK_D)
            return
    q_start, k_start, seqlen_q, seqlen_k, diag_offset = _seq_bounds(
        CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset, IS_VARLEN)
    if start_m * BLOCK_M >= seqlen_q:  # varlen: the grid covers the longest sequence
        return

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    Q += off_b * stride_qb + q_start * stride_qm
    DOut += off_b * stride_dob + q_start * stride_dom
    DQ += off_b * stride_dqb + q_start * stride_dqm
    p_q = Q + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    p_do = DOut + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :]
    p_k = K + off_b * stride_kb + k_start * stride_kn + off_hkv * stride_kh + offs_n0[:, None] * stride_kn + offs_d[None, :]
    p_v = V + off_b * stride_vb + k_start * stride_vn + off_hkv * stride_vh + offs_n0[:, None] * stride_vn + offs_d[None, :]
    b_q = _load_tile(p_q, offs_m, seqlen_q, offs_d, head_dim, True, EVEN_D)    # (M, D)
    b_do = _load_tile(p_do, offs_m, seqlen_q, offs_d, head_dim, True, EVEN_D)  # (M, D)
    p_lse = off_b * stride_lb + off_h * stride_lh + q_start  # Delta shares lse's layout
    lse_log2 = _load_lse_log2(Lse + p_lse, offs_m, seqlen_q)                 # (M,)
    delta = tl.load(Delta + p_lse + offs_m, mask=offs_m < seqlen_q, other=0.0)
    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + off_b * stride_alibi_b + off_h * stride_alibi_h)
    p_mask = Mask
    if HAS_MASK:
        p_mask = Mask + off_b * stride_mask_b + off_h * stride_mask_h
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _block_range(start_m, seqlen_q, seqlen_k, diag_offset,
                                          window_left, window_right, BLOCK_M, BLOCK_N,
                                          MASK_LEFT, MASK_RIGHT)
    dq = _dq_block(dq, b_q, b_do, lse_log2, delta, p_k, p_v, lo, mid_lo, offs_m, offs_n0,
                   offs_d, seqlen_q, seqlen_k, head_dim, stride_kn, stride_vn, diag_offset,
                   window_left, window_right, softmax_scale, softcap, alibi_slope, p_mask,
                   stride_mask_m, stride_mask_n, BLOCK_N, EVEN_D, True, MASK_LEFT,
                   MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL,
                   INPUT_PRECISION)
    dq = _dq_block(dq, b_q, b_do, lse_log2, delta, p_k, p_v, mid_lo, mid_hi, offs_m,
                   offs_n0, offs_d, seqlen_q, seqlen_k, head_dim, stride_kn, stride_vn,
                   diag_offset, window_left, window_right, softmax_scale, softcap,
                   alibi_slope, p_mask, stride_mask_m, stride_mask_n, BLOCK_N, EVEN_D,
                   False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK,
                   MASK_IS_BOOL, INPUT_PRECISION)
    dq = _dq_block(dq, b_q, b_do, lse_log2, delta, p_k, p_v, mid_hi, hi, offs_m, offs_n0,
                   offs_d, seqlen_q, seqlen_k, head_dim, stride_kn, stride_vn, diag_offset,
                   window_left, window_right, softmax_scale, softcap, alibi_slope, p_mask,
                   stride_mask_m, stride_mask_n, BLOCK_N, EVEN_D, True, MASK_LEFT,
                   MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL,
                   INPUT_PRECISION)

    p_dq = DQ + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :]
    tl.store(p_dq, (dq * softmax_scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim))


# The kernel parameters a call of each backward plan fills, in this order (``_launch``).
_PRE_SLOTS = ("Out", "DOut", "DLse", "Delta")
_DKDV_SLOTS = ("Q", "K", "V", "DOut", "Lse", "Delta", "DK", "DV", "Mask", "Alibi",
               "CuSeqlensQ", "CuSeqlensK", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
               "softcap")
_DQ_SLOTS = ("Q", "K", "V", "DOut", "Lse", "Delta", "DQ", "Mask", "Alibi", "CuSeqlensQ",
             "CuSeqlensK", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "softcap")


def attn_bwd(dout, q, k, v, out, lse, dlse, *, attn_mask, alibi_slopes, softmax_scale,
             diag_offset, window_left, window_right, softcap, allow_tf32,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Launch preprocess, dK/dV and dQ. Returns (dq, dk, dv) shaped like q, k, v.

    Dense: ``lse`` and ``dlse`` are (b, h, sq) fp32; varlen (cu_seqlens given): q/k/v
    are packed (total, heads, d) and lse/dlse are (h, total_q). ``dlse`` may be None.
    Index values are checked by the kernels (bad prefix sums: NaN gradients).
    """
    varlen = cu_seqlens_q is not None
    h, d, hkv = q.shape[-2], q.shape[-1], k.shape[-2]
    if varlen:
        batch, longest_q, longest_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
    else:
        batch, longest_q, longest_k = q.shape[0], q.shape[1], k.shape[1]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=q.device)
    # Dense without keys: no gradient. Varlen launches even then, so that prefix sums
    # which are not valid still make dq NaN.
    if not q.numel() or not batch or (not dk.numel() and not varlen):
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    dlse = dlse.contiguous() if dlse is not None else None
    delta = torch.empty_like(lse)
    cu_q, cu_k = (cu_seqlens_q, cu_seqlens_k) if varlen else (q, q)
    # The preprocess reads out, dout, dlse (lse as a placeholder) and writes delta; the
    # dK/dV kernel takes tensors[:8] (dq's place is dk, dv), the dQ kernel dq instead.
    tensors = (q, k, v, dout, lse, delta, dk, dv, q if attn_mask is None else attn_mask,
               q if alibi_slopes is None else alibi_slopes, cu_q, cu_k, out,
               lse if dlse is None else dlse, dq)
    scalars = (max_seqlen_q if varlen else 0, max_seqlen_k if varlen else 0,
               softmax_scale, softcap)
    key = None
    if _launch.ready(q):
        p = _launch.pointers(tensors)
        key = ("bwd", q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(),
               dout.stride(), out.stride(), dlse is None,
               _launch.layout(attn_mask), _launch.layout(alibi_slopes),
               diag_offset, window_left, window_right, softcap > 0, allow_tf32,
               varlen and (batch, configs.seqlen_class(max(longest_q, longest_k))),
               _launch.misalignment(p))
        plans = _launch.lookup(key)
        if plans is not None:
            pre, dkdv, dqp = plans
            pre((p[12], p[3], p[13], p[5]))
            dkdv((*p[:12], *scalars),
                 (max(1, configs.cdiv(longest_k, dkdv.cfg.block_n)), batch * hkv, 1)
                 if varlen else None)
            dqp((*p[:6], p[14], *p[8:12], *scalars),
                (max(1, configs.cdiv(longest_q, dqp.cfg.block_m)), batch * h, 1)
                if varlen else None)
            return dq, dk, dv
    if varlen:
        # Packed tensors as a batch of one whose batch stride the kernels must not use.
        dout4, q4, k4, v4, out4, dq4, dk4, dv4 = (
            x.unsqueeze(0) for x in (dout, q, k, v, out, dq, dk, dv))
        lse3 = lse.unsqueeze(0)
    else:
        dout4, q4, k4, v4, out4, dq4, dk4, dv4, lse3 = dout, q, k, v, out, dq, dk, dv, lse
    rows = out4.shape[1]  # per row, so packed varlen rows are one long sequence here
    pre_m = configs.PREPROCESS_BLOCK_M
    pre = _launch.first_launch(
        _bwd_preprocess_kernel, (configs.cdiv(rows, pre_m), out4.shape[0] * h),
        (out, dout, tensors[13], delta, out4.stride(0), out4.stride(1), out4.stride(2),
         dout4.stride(0), dout4.stride(1), dout4.stride(2), h, rows, d),
        dict(BLOCK_M=pre_m, BLOCK_D=configs.padded_head_dim(d), HAS_DLSE=dlse is not None),
        _PRE_SLOTS if key is not None else None)
    mask, mask_strides, alibi, alibi_strides, flags = configs.feature_args(
        attn_mask, alibi_slopes, q, window_left=window_left, window_right=window_right,
        softcap=softcap, allow_tf32=allow_tf32, head_dim=d)
    windowed, longest = window_left >= 0 or window_right >= 0, max(longest_q, longest_k)
    ieee = flags["INPUT_PRECISION"] == "ieee"
    # Varlen kernels read each sequence's lengths from cu_seqlens; seqlen_q/k unused.
    sizes = (0, 0, d) if varlen else (longest_q, longest_k, d)
    totals = (q.shape[0], k.shape[0]) if varlen else (0, 0)
    common = (*totals, *scalars[:2], diag_offset, window_left, window_right,
              softmax_scale, softcap)
    dkdv = configs.launch(
        _bwd_dkdv_kernel,
        lambda cfg: (max(1, configs.cdiv(longest_k, cfg.block_n)), batch * hkv),
        configs.bwd_dkdv_config(q, d, windowed, seqlen=longest, ieee=ieee),
        "backward dk/dv", q, d,
        *tensors[:8], mask, alibi, cu_q, cu_k,
        *configs.strides(varlen, q4, k4, v4, dout4, dk4, dv4, lse3),
        *mask_strides, *alibi_strides, h, hkv, *sizes, *common,
        IS_VARLEN=varlen, slots=_DKDV_SLOTS if key is not None else None, **flags,
    )
    dqp = configs.launch(
        _bwd_dq_kernel,
        lambda cfg: (max(1, configs.cdiv(longest_q, cfg.block_m)), batch * h),
        configs.bwd_dq_config(q, d, windowed, seqlen=longest, ieee=ieee),
        "backward dq", q, d,
        *tensors[:6], dq, mask, alibi, cu_q, cu_k,
        *configs.strides(varlen, q4, k4, v4, dout4, dq4, lse3),
        *mask_strides, *alibi_strides, h, h // hkv, *sizes, *common,
        IS_VARLEN=varlen, slots=_DQ_SLOTS if key is not None else None, **flags,
    )
    if key is not None:
        _launch.store(key, (pre, dkdv, dqp))
    return dq, dk, dv
