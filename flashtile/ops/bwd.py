"""FlashAttention backward: recompute P from the saved lse, no N x N tensor in memory.

Algorithm: Dao, FlashAttention-2 (2023), Algorithm 2, in two forms.

Split (the default, bitwise reproducible): two kernels that own their outputs,
``_bwd_dkdv_kernel`` (one program per key block and KV head, looping over every query
block of every query head in the group) and ``_bwd_dq_kernel`` (one program per query
block, looping over key blocks). No atomics, and GQA needs no copy of K/V: the group sum
happens in registers. Each kernel recomputes QK^T and dP: 7 matrix products per block.

Fused (``fused=True``, flash-attn's ``deterministic=False``): ``_bwd_dkdv_kernel`` with
ATOMIC_DQ also forms dQ_partial = dS K of its key block and adds it, fp32 atomic
reductions, into a dQ accumulator that the preprocess zeroed; ``_bwd_dq_convert_kernel``
then scales it into dq. 5 matrix products per block, as FA2's CUDA backward; the order
of the reductions varies from run to run, so dq differs in its last bits.

``delta = rowsum(dO * O) - dlse`` (preprocess kernel) folds the gradient of the lse, when
the caller used it, into dS = P * (dP - delta).

Head dims past 256 (``configs.head_dim_parts``): each key block's (dK/dV) and query
block's (dQ) gradients are computed by DV_PARTS programs, each owning its part of the
columns of dK, dV (and the fused path's share of dQ) or dQ, and computing S and dP over
the whole head dims, its part of each operand's columns first (``_other_parts``): the
accumulators of one program stay those of a head dim of 256.
"""

import torch
import triton
import triton.language as tl

from flashtile.ops import _launch, configs
from flashtile.ops._common import (LOG2E, _block_range, _dropout_keep, _dropout_setup,
                                   _fill_nan_rows, _load_tile, _prefix_sums_bad,
                                   _scores_log2, _seq_bounds, _tanh)

_data_ptr = torch.Tensor.data_ptr


def _address(x):
    """x's address, None for an absent optional operand (``_operands``)."""
    return None if x is None else _data_ptr(x)


def _operands(q, k, v, dout, lse, delta, dk, dv, attn_mask, alibi_slopes, cu_q, cu_k, out,
              dlse, dq, dq_accum, philox):
    """The backward kernels' operands in the launcher's slot order, as tensors (Triton's
    path) or as their addresses (the launch plans). An absent optional operand (None)
    takes a never-read placeholder: q for attn_mask, alibi_slopes, a dense call's
    cu_seqlens and dq_accum (not fused), lse for dlse and philox (no dropout). The
    preprocess reads out, dout, dlse and writes delta (and zeroes dq_accum); the dK/dV
    kernel takes [:8], dq_accum, [8:12] and philox; the dQ kernel dq in dk's place."""
    return (q, k, v, dout, lse, delta, dk, dv, q if attn_mask is None else attn_mask,
            q if alibi_slopes is None else alibi_slopes, q if cu_q is None else cu_q,
            q if cu_k is None else cu_k, out, lse if dlse is None else dlse, dq,
            q if dq_accum is None else dq_accum, lse if philox is None else philox)


@triton.jit
def _row_block(nheads, seqlen_q, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (row block, batch x head) of the row-wise kernels: (off_b, off_h, offs_m,
    offs_d, the (M, D) mask of rows and head dims in bounds)."""
    off_bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_tile = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    return off_bh // nheads, off_bh % nheads, offs_m, offs_d, m_tile


# A varlen call's packed row count (seqlen_q here) and the strides that follow it
# (stride_acch, stride_lb/lh, total_q/total_k below) change from call to call: not
# specialised, so one compiled kernel and one launch plan serve every batch of a layout,
# as in the forward (ops/fwd.py). They address one scalar per row, and no tile.
@triton.jit(do_not_specialize=["stride_acch", "seqlen_q", "rows_pad"])
def _bwd_preprocess_kernel(Out, DOut, DLse, Delta, DQAccum, Lse, Lse2,
                           stride_ob, stride_om, stride_oh,
                           stride_dob, stride_dom, stride_doh,
                           stride_accb, stride_acch,
                           nheads, seqlen_q, head_dim_v, rows_pad,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DV: tl.constexpr,
                           HAS_DLSE: tl.constexpr, ZERO_DQ: tl.constexpr,
                           LSE2: tl.constexpr):
    # out and dout have v's head dim (BLOCK_DV); the dQ accumulator q's (BLOCK_D).
    # LSE2 (the Gluon backward's lse_pre): Delta and Lse2 are (b, h, rows_pad), rows_pad
    # >= seqlen_q; Lse2 takes lse in base 2 with +inf where lse is -inf (a row that saw
    # no key: P = 0, not NaN), and the rows past seqlen_q hold delta 0 and Lse2 +inf, so
    # the kernel that reads them masks nothing. Lse, Lse2 and rows_pad are unused
    # otherwise.
    off_b, off_h, offs_m, offs_dv, m_tile = _row_block(nheads, seqlen_q, head_dim_v,
                                                       BLOCK_M, BLOCK_DV)
    b_o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om
                  + offs_dv[None, :], mask=m_tile, other=0.0).to(tl.float32)
    b_do = tl.load(DOut + off_b * stride_dob + off_h * stride_doh
                   + offs_m[:, None] * stride_dom + offs_dv[None, :],
                   mask=m_tile, other=0.0).to(tl.float32)
    delta = tl.sum(b_o * b_do, 1)                                        # (M,)
    p_row = (off_b * nheads + off_h) * seqlen_q + offs_m  # DLse, Delta: (b, h, sq)
    if HAS_DLSE:
        delta -= tl.load(DLse + p_row, mask=offs_m < seqlen_q, other=0.0)
    if LSE2:  # (rows past seqlen_q: out and dout read as 0, so delta is 0)
        p_pad = (off_b * nheads + off_h) * rows_pad + offs_m
        tl.store(Delta + p_pad, delta, mask=offs_m < rows_pad)
        lse_row = Lse + (off_b * nheads + off_h) * seqlen_q
        tl.store(Lse2 + p_pad, _load_lse_log2(lse_row, offs_m, seqlen_q),
                 mask=offs_m < rows_pad)
    else:
        tl.store(Delta + p_row, delta, mask=offs_m < seqlen_q)
    if ZERO_DQ:  # the fused backward's dQ accumulator: here, not a memset launch more
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(DQAccum + off_b * stride_accb + off_h * stride_acch
                 + offs_m[:, None] * BLOCK_D + offs_d[None, :],
                 tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
                 mask=offs_m[:, None] < seqlen_q)


@triton.jit
def _load_lse_log2(p_lse, offs, n):
    # Rows that saw no key have lse = -inf; +inf makes their P exactly 0 instead of NaN.
    lse = tl.load(p_lse + offs, mask=offs < n, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _other_parts(ptrs, offs_rows, n_rows, offs_cols, n_cols, part,
                 CHECK_ROWS: tl.constexpr, EVEN: tl.constexpr, COLS: tl.constexpr,
                 DV_PARTS: tl.constexpr):
    """The tiles of the other parts' columns of the (rows, COLS) tile at ptrs (this
    program's part, columns offs_cols): DV_PARTS - 1 of them, of parts part + 1, part +
    2, ... (mod DV_PARTS), in a tuple (empty at one part)."""
    tiles = ()
    for j in tl.static_range(1, DV_PARTS):
        shift = ((part + j) % DV_PARTS - part) * COLS
        tiles = tiles + (_load_tile(ptrs + shift, offs_rows, n_rows, offs_cols + shift,
                                    n_cols, CHECK_ROWS, EVEN),)
    return tiles


@triton.jit
def _dot_parts(acc, a, b, INPUT_PRECISION: tl.constexpr, DV_PARTS: tl.constexpr):
    """acc + the sum of a[j] @ b[j]^T over the other parts' tiles (_other_parts): the
    rest of a product over the whole head dim."""
    for j in tl.static_range(DV_PARTS - 1):
        acc = tl.dot(a[j], tl.trans(b[j]), acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _dkdv_block(dk, dv, b_k, b_v, b_ko, b_vo, p_q, p_do, p_lse, p_delta, p_dq, start,
                stop, offs_n, offs_m0, offs_d, offs_dv, seqlen_q, seqlen_k, head_dim,
                head_dim_v, stride_qm, stride_dom, diag_offset, window_left, window_right,
                softmax_scale, softcap, alibi_slope, p_mask, stride_mask_m, stride_mask_n,
                drop_seed, drop_offset, drop_row0, key0, dropout_p, part,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                ACC_D: tl.constexpr, EVEN_D: tl.constexpr,
                EVEN_DV: tl.constexpr, BOUNDARY: tl.constexpr,
                MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, DV_PARTS: tl.constexpr):
    # Transposed tile: rows are this program's keys, cols the query block. b_k, b_v:
    # this program's part of the keys' columns; b_ko, b_vo: the other parts' (resident).
    for start_m in tl.range(start, stop, BLOCK_M):
        offs_m = start_m + offs_m0
        b_q = _load_tile(p_q + start_m * stride_qm, offs_m, seqlen_q, offs_d, head_dim,
                         BOUNDARY, EVEN_D)                                    # (M, D)
        qk_t = tl.dot(b_k, tl.trans(b_q), input_precision=INPUT_PRECISION)   # (N, M)
        qk_t = _dot_parts(qk_t, b_ko, _other_parts(
            p_q + start_m * stride_qm, offs_m, seqlen_q, offs_d, head_dim, part, BOUNDARY,
            EVEN_D, BLOCK_D, DV_PARTS), INPUT_PRECISION, DV_PARTS)
        if HAS_DROPOUT:
            # Drawn right after the q k^T product is issued, so that the integer work
            # can overlap it; sm_90 d128 dense spills 272 B causal (264 B not) here vs
            # 360 B (256 B) drawn before the dV product.
            keep_t = _dropout_keep(drop_seed, drop_offset, drop_row0 + start_m, key0,
                                   dropout_p, BLOCK_M, b_k.shape[0], True)   # (N, M)
        m_mask = (offs_n[:, None] < seqlen_k) & (offs_m[None, :] < seqlen_q)
        s_t = _scores_log2(qk_t, offs_n, offs_m, seqlen_q, -diag_offset, window_right,
                           window_left, softmax_scale, softcap, alibi_slope, p_mask,
                           stride_mask_n, stride_mask_m, m_mask, BOUNDARY, MASK_RIGHT,
                           MASK_LEFT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL)
        p_t = tl.exp2(s_t - _load_lse_log2(p_lse, offs_m, seqlen_q)[None, :])  # (N, M)
        b_do = _load_tile(p_do + start_m * stride_dom, offs_m, seqlen_q, offs_dv,
                          head_dim_v, BOUNDARY, EVEN_DV)                      # (M, DV)
        if HAS_DROPOUT:
            # O = (P * Z) V, Z = keep / (1 - p): dV takes the kept P (scaled once at the
            # store), dP the kept entries of dO V^T times 1 / (1 - p); the delta of dS
            # is unchanged (rowsum(P * dP) = rowsum(dO * O)).
            dv = tl.dot(tl.where(keep_t, p_t, 0.0).to(b_do.dtype), b_do, dv,
                        input_precision=INPUT_PRECISION)
        else:
            dv = tl.dot(p_t.to(b_do.dtype), b_do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(b_v, tl.trans(b_do), input_precision=INPUT_PRECISION)  # (N, M)
        dp_t = _dot_parts(dp_t, b_vo, _other_parts(
            p_do + start_m * stride_dom, offs_m, seqlen_q, offs_dv, head_dim_v, part,
            BOUNDARY, EVEN_DV, BLOCK_DV, DV_PARTS), INPUT_PRECISION, DV_PARTS)
        if HAS_DROPOUT:
            dp_t = tl.where(keep_t, dp_t * (1.0 / (1.0 - dropout_p)), 0.0)
        delta = tl.load(p_delta + offs_m, mask=offs_m < seqlen_q, other=0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            t = _tanh(qk_t * (softmax_scale / softcap))
            ds_t = ds_t * (1.0 - t * t)
        b_ds_t = ds_t.to(b_q.dtype)                                           # (N, M)
        dk = tl.dot(b_ds_t, b_q, dk, input_precision=INPUT_PRECISION)
        if ATOMIC_DQ:
            # Keys past seqlen_k were loaded as zero rows of K: they add nothing.
            # This part's columns of dQ: dS times this part's columns of K.
            b_dq = tl.dot(tl.trans(b_ds_t), b_k, input_precision=INPUT_PRECISION)  # (M, D)
            # Relaxed: nothing reads a reduction's result, so it needs no ordering (the
            # default, acq_rel, fences each one). Accumulator rows are ACC_D wide
            # (the padding gets zeros), so only the edge ranges mask rows.
            if BOUNDARY:
                tl.atomic_add(p_dq + start_m * ACC_D, b_dq, sem="relaxed",
                              mask=offs_m[:, None] < seqlen_q)
            else:
                tl.atomic_add(p_dq + start_m * ACC_D, b_dq, sem="relaxed")
    return dk, dv


@triton.jit
def _varlen_bad(CuSeqlensQ, CuSeqlensK, batch, total_q, total_k, max_seqlen_q,
                max_seqlen_k):
    """Entries of the prefix sums that would send the kernel outside the packed rows or
    leave rows to no program (0: valid); then the gradients are NaN (``_common``)."""
    return (_prefix_sums_bad(CuSeqlensQ, batch, total_q, max_seqlen_q)
            + _prefix_sums_bad(CuSeqlensK, batch, total_k, max_seqlen_k))


# max_seqlen_q/k change from call to call: not specialised (one kernel, one plan).
@triton.jit(do_not_specialize=["max_seqlen_q", "max_seqlen_k", "stride_acch", "stride_lb",
                               "stride_lh", "total_q", "total_k"])
def _bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, DQAccum, Mask, Alibi, CuSeqlensQ, CuSeqlensK,
    Philox,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_accb, stride_acch,
    stride_lb, stride_lh,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_alibi_b, stride_alibi_h,
    nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v,
    total_q, total_k, max_seqlen_q, max_seqlen_k,
    diag_offset, window_left, window_right, softmax_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, INPUT_PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, HAS_DROPOUT: tl.constexpr, DV_PARTS: tl.constexpr,
):
    """dK, dV of one key block of one KV head; with ATOMIC_DQ also every query row's
    share of dQ from these keys, added into DQAccum: fp32 (batch, nheads, rows,
    BLOCK_D * DV_PARTS), zeroed by the preprocess. Its row stride is a constant: the
    addresses of the atomics cost no pointer tile held across the loop.

    DV_PARTS > 1: the key block's programs split the columns, BLOCK_D of dK (and of
    dQ's share) and BLOCK_DV of dV each (configs.head_dim_parts); each computes the
    scores and dP over the whole head dims."""
    start_n = tl.program_id(0)
    part = 0
    if DV_PARTS > 1:
        # A key block's parts are neighbours in the grid: they stream the same Q and
        # dO tiles at about the same time, from L2.
        part = start_n % DV_PARTS
        start_n = start_n // DV_PARTS
    # The accumulator's row: every part's columns (the padded head dim of q).
    ACC_D: tl.constexpr = BLOCK_D * DV_PARTS
    off_bh = tl.program_id(1)
    off_b = off_bh // nheads_kv
    off_hkv = off_bh % nheads_kv
    group_size = nheads // nheads_kv
    if IS_VARLEN:
        batch = tl.num_programs(1) // nheads_kv
        if _varlen_bad(CuSeqlensQ, CuSeqlensK, batch, total_q, total_k, max_seqlen_q,
                       max_seqlen_k) > 0:
            chunk = off_b * tl.num_programs(0) + tl.program_id(0)
            n_chunks = batch * tl.num_programs(0)
            _fill_nan_rows(DK + off_hkv * stride_dkh, stride_dkn, total_k, head_dim,
                           chunk, n_chunks, BLOCK_N, ACC_D)
            _fill_nan_rows(DV + off_hkv * stride_dvh, stride_dvn, total_k, head_dim_v,
                           chunk, n_chunks, BLOCK_N, BLOCK_DV * DV_PARTS)
            if ATOMIC_DQ:  # no program adds to dQ now: every one saw the same bad sums
                for g in range(0, group_size):
                    _fill_nan_rows(DQAccum + (off_hkv * group_size + g) * stride_acch,
                                   ACC_D, total_q, head_dim, chunk, n_chunks, BLOCK_M,
                                   ACC_D)
            return
    q_start, k_start, seqlen_q, seqlen_k, diag_offset = _seq_bounds(
        CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset, IS_VARLEN)
    if start_n * BLOCK_N >= seqlen_k:  # varlen: the grid covers the longest sequence
        return

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    # V's, dO's and dV's head dim (MLA: 128 beside 192). offs_d itself where the
    # tiles match, so equal-dim calls compile the IR they had before.
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    if DV_PARTS > 1:  # this program's columns
        offs_d += part * BLOCK_D
        offs_dv += part * BLOCK_DV
    Q += off_b * stride_qb + q_start * stride_qm
    DOut += off_b * stride_dob + q_start * stride_dom
    K += off_b * stride_kb + k_start * stride_kn
    V += off_b * stride_vb + k_start * stride_vn
    DK += off_b * stride_dkb + k_start * stride_dkn
    DV += off_b * stride_dvb + k_start * stride_dvn
    DQAccum += off_b * stride_accb + q_start * ACC_D
    p_k = K + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    p_v = V + off_hkv * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :]
    b_k = _load_tile(p_k, offs_n, seqlen_k, offs_d, head_dim, True, EVEN_D)   # (N, D)
    b_v = _load_tile(p_v, offs_n, seqlen_k, offs_dv, head_dim_v, True, EVEN_DV)  # (N, DV)
    # The other parts' columns of K and V, for the scores and dP (empty at one part).
    b_ko = _other_parts(p_k, offs_n, seqlen_k, offs_d, head_dim, part, True, EVEN_D,
                        BLOCK_D, DV_PARTS)
    b_vo = _other_parts(p_v, offs_n, seqlen_k, offs_dv, head_dim_v, part, True, EVEN_DV,
                        BLOCK_DV, DV_PARTS)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _block_range(start_n, seqlen_k, seqlen_q, -diag_offset,
                                          window_right, window_left, BLOCK_N, BLOCK_M,
                                          MASK_RIGHT, MASK_LEFT)
    for g in range(0, group_size):
        off_h = off_hkv * group_size + g
        p_q = Q + off_h * stride_qh + offs_m0[:, None] * stride_qm + offs_d[None, :]
        p_do = DOut + off_h * stride_doh + offs_m0[:, None] * stride_dom + offs_dv[None, :]
        # Delta shares lse's layout.
        p_lse = Lse + off_b * stride_lb + off_h * stride_lh + q_start
        p_delta = Delta + off_b * stride_lb + off_h * stride_lh + q_start
        p_dq = DQAccum + off_h * stride_acch + offs_m0[:, None] * ACC_D + offs_d[None, :]
        alibi_slope = 0.0
        if HAS_ALIBI:
            alibi_slope = tl.load(Alibi + off_b * stride_alibi_b + off_h * stride_alibi_h)
        p_mask = Mask
        if HAS_MASK:
            p_mask = Mask + off_b * stride_mask_b + off_h * stride_mask_h
        drop_seed, drop_offset, drop_row0 = 0, 0, 0  # unused
        if HAS_DROPOUT:  # this head's counters (_common._dropout_setup)
            drop_seed, drop_offset, drop_row0 = _dropout_setup(
                Philox, off_b, off_h, nheads, seqlen_q, q_start, total_q, IS_VARLEN)
        # The three spans of _block_range (masked, unmasked, masked), unrolled.
        for span in tl.static_range(3):
            start = lo if span == 0 else (mid_lo if span == 1 else mid_hi)
            stop = mid_lo if span == 0 else (mid_hi if span == 1 else hi)
            dk, dv = _dkdv_block(
                dk, dv, b_k, b_v, b_ko, b_vo, p_q, p_do, p_lse, p_delta, p_dq, start, stop,
                offs_n, offs_m0, offs_d, offs_dv, seqlen_q, seqlen_k, head_dim, head_dim_v,
                stride_qm, stride_dom,
                diag_offset, window_left, window_right, softmax_scale, softcap,
                alibi_slope, p_mask, stride_mask_m, stride_mask_n, drop_seed, drop_offset,
                drop_row0, start_n * BLOCK_N, dropout_p, part, BLOCK_M, BLOCK_D, BLOCK_DV,
                ACC_D, EVEN_D, EVEN_DV, span != 1, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP,
                HAS_ALIBI, HAS_MASK, MASK_IS_BOOL, INPUT_PRECISION, ATOMIC_DQ, HAS_DROPOUT,
                DV_PARTS)

    m_tile = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < head_dim)
    p_dk = DK + off_hkv * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    p_dv = DV + off_hkv * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :]
    tl.store(p_dk, (dk * softmax_scale).to(DK.dtype.element_ty), mask=m_tile)
    if BLOCK_DV == BLOCK_D and EVEN_D and EVEN_DV:
        # head_dim_v == head_dim: dK's mask, as before dv had a head dim of its own (a
        # second mask spilled 8 bytes on sm_90, fp32 fused, head_dim 16).
        m_tile_v = m_tile
    else:
        m_tile_v = (offs_n[:, None] < seqlen_k) & (offs_dv[None, :] < head_dim_v)
    if HAS_DROPOUT:
        dv *= 1.0 / (1.0 - dropout_p)
    tl.store(p_dv, dv.to(DV.dtype.element_ty), mask=m_tile_v)


@triton.jit
def _dq_block(dq, b_q, b_do, b_qo, b_doo, lse_log2, delta, p_k, p_v, start, stop,
              offs_m, offs_n0, offs_d, offs_dv, seqlen_q, seqlen_k, head_dim, head_dim_v,
              stride_kn, stride_vn, diag_offset, window_left, window_right,
              softmax_scale, softcap, alibi_slope, p_mask, stride_mask_m, stride_mask_n,
              drop_seed, drop_offset, drop_row_start, dropout_p, part,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
              BOUNDARY: tl.constexpr,
              MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
              INPUT_PRECISION: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              DV_PARTS: tl.constexpr):
    # b_q, b_do: this program's part of the rows' columns; b_qo, b_doo: the other
    # parts' (resident). K and V tiles are read in the same parts.
    for start_n in tl.range(start, stop, BLOCK_N):
        offs_n = start_n + offs_n0
        b_k = _load_tile(p_k + start_n * stride_kn, offs_n, seqlen_k, offs_d, head_dim,
                         BOUNDARY, EVEN_D)                                  # (N, D)
        b_v = _load_tile(p_v + start_n * stride_vn, offs_n, seqlen_k, offs_dv,
                         head_dim_v, BOUNDARY, EVEN_DV)                     # (N, DV)
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=INPUT_PRECISION)   # (M, N)
        qk = _dot_parts(qk, b_qo, _other_parts(
            p_k + start_n * stride_kn, offs_n, seqlen_k, offs_d, head_dim, part, BOUNDARY,
            EVEN_D, BLOCK_D, DV_PARTS), INPUT_PRECISION, DV_PARTS)
        m_mask = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
        s = _scores_log2(qk, offs_m, offs_n, seqlen_k, diag_offset, window_left,
                         window_right, softmax_scale, softcap, alibi_slope, p_mask,
                         stride_mask_m, stride_mask_n, m_mask, BOUNDARY, MASK_LEFT,
                         MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL)
        p = tl.exp2(s - lse_log2[:, None])                                 # (M, N)
        dp = tl.dot(b_do, tl.trans(b_v), input_precision=INPUT_PRECISION)  # (M, N)
        dp = _dot_parts(dp, b_doo, _other_parts(
            p_v + start_n * stride_vn, offs_n, seqlen_k, offs_dv, head_dim_v, part,
            BOUNDARY, EVEN_DV, BLOCK_DV, DV_PARTS), INPUT_PRECISION, DV_PARTS)
        if HAS_DROPOUT:  # as in _dkdv_block
            keep = _dropout_keep(drop_seed, drop_offset, drop_row_start, start_n,
                                 dropout_p, offs_m.shape[0], BLOCK_N, False)  # (M, N)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            t = _tanh(qk * (softmax_scale / softcap))
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(b_k.dtype), b_k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["max_seqlen_q", "max_seqlen_k", "stride_lb", "stride_lh",
                               "total_q", "total_k"])
def _bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, Mask, Alibi, CuSeqlensQ, CuSeqlensK, Philox,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_alibi_b, stride_alibi_h,
    nheads, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v,
    total_q, total_k, max_seqlen_q, max_seqlen_k,
    diag_offset, window_left, window_right, softmax_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, INPUT_PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DV_PARTS: tl.constexpr,
):
    """dQ of one query block of one head. DV_PARTS > 1: the block's programs split
    dQ's columns, BLOCK_D each (configs.head_dim_parts); each computes the scores and
    dP over the whole head dims."""
    start_m = tl.program_id(0)
    part = 0
    if DV_PARTS > 1:  # a row block's parts are neighbours: the same K/V tiles, from L2
        part = start_m % DV_PARTS
        start_m = start_m // DV_PARTS
    off_bh = tl.program_id(1)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    off_hkv = off_h // group_size
    if IS_VARLEN:
        batch = tl.num_programs(1) // nheads
        if _varlen_bad(CuSeqlensQ, CuSeqlensK, batch, total_q, total_k, max_seqlen_q,
                       max_seqlen_k) > 0:
            chunk = off_b * tl.num_programs(0) + tl.program_id(0)
            _fill_nan_rows(DQ + off_h * stride_dqh, stride_dqm, total_q, head_dim, chunk,
                           batch * tl.num_programs(0), BLOCK_M, BLOCK_D * DV_PARTS)
            return
    q_start, k_start, seqlen_q, seqlen_k, diag_offset = _seq_bounds(
        CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset, IS_VARLEN)
    if start_m * BLOCK_M >= seqlen_q:  # varlen: the grid covers the longest sequence
        return

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # V's and dO's head dim. offs_d itself where the tiles match, so equal-dim calls
    # compile the IR they had before.
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    if DV_PARTS > 1:  # this program's columns
        offs_d += part * BLOCK_D
        offs_dv += part * BLOCK_DV
    Q += off_b * stride_qb + q_start * stride_qm
    DOut += off_b * stride_dob + q_start * stride_dom
    DQ += off_b * stride_dqb + q_start * stride_dqm
    p_q = Q + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    p_do = DOut + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :]
    p_k = K + off_b * stride_kb + k_start * stride_kn + off_hkv * stride_kh + offs_n0[:, None] * stride_kn + offs_d[None, :]
    p_v = V + off_b * stride_vb + k_start * stride_vn + off_hkv * stride_vh + offs_n0[:, None] * stride_vn + offs_dv[None, :]
    b_q = _load_tile(p_q, offs_m, seqlen_q, offs_d, head_dim, True, EVEN_D)    # (M, D)
    b_do = _load_tile(p_do, offs_m, seqlen_q, offs_dv, head_dim_v, True,
                      EVEN_DV)                                                 # (M, DV)
    # The other parts' columns of q and dO, for the scores and dP (empty at one part).
    b_qo = _other_parts(p_q, offs_m, seqlen_q, offs_d, head_dim, part, True, EVEN_D,
                        BLOCK_D, DV_PARTS)
    b_doo = _other_parts(p_do, offs_m, seqlen_q, offs_dv, head_dim_v, part, True, EVEN_DV,
                         BLOCK_DV, DV_PARTS)
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
    drop_seed, drop_offset, drop_row_start = 0, 0, 0  # unused
    if HAS_DROPOUT:  # the forward's counters (_common._dropout_setup)
        drop_seed, drop_offset, row0 = _dropout_setup(
            Philox, off_b, off_h, nheads, seqlen_q, q_start, total_q, IS_VARLEN)
        drop_row_start = row0 + start_m * BLOCK_M

    lo, mid_lo, mid_hi, hi = _block_range(start_m, seqlen_q, seqlen_k, diag_offset,
                                          window_left, window_right, BLOCK_M, BLOCK_N,
                                          MASK_LEFT, MASK_RIGHT)
    # The three spans of _block_range (masked, unmasked, masked), unrolled.
    for span in tl.static_range(3):
        start = lo if span == 0 else (mid_lo if span == 1 else mid_hi)
        stop = mid_lo if span == 0 else (mid_hi if span == 1 else hi)
        dq = _dq_block(dq, b_q, b_do, b_qo, b_doo, lse_log2, delta, p_k, p_v, start,
                       stop, offs_m, offs_n0, offs_d, offs_dv, seqlen_q, seqlen_k,
                       head_dim, head_dim_v, stride_kn, stride_vn, diag_offset,
                       window_left, window_right, softmax_scale, softcap, alibi_slope,
                       p_mask, stride_mask_m, stride_mask_n, drop_seed, drop_offset,
                       drop_row_start, dropout_p, part, BLOCK_N, BLOCK_D, BLOCK_DV,
                       EVEN_D, EVEN_DV, span != 1, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP,
                       HAS_ALIBI, HAS_MASK, MASK_IS_BOOL, INPUT_PRECISION, HAS_DROPOUT,
                       DV_PARTS)

    p_dq = DQ + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :]
    tl.store(p_dq, (dq * softmax_scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim))


@triton.jit
def _dq_convert(DQAccum, DQ, stride_accb, stride_acch, stride_dqb, stride_dqm, stride_dqh,
                nheads, seqlen_q, head_dim, softmax_scale, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr):
    off_b, off_h, offs_m, offs_d, m_tile = _row_block(nheads, seqlen_q, head_dim, BLOCK_M,
                                                      BLOCK_D)
    b_dq = tl.load(DQAccum + off_b * stride_accb + off_h * stride_acch
                   + offs_m[:, None] * BLOCK_D + offs_d[None, :], mask=m_tile)  # (M, D)
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm
             + offs_d[None, :], (b_dq * softmax_scale).to(DQ.dtype.element_ty),
             mask=m_tile)


@triton.jit
def _shares_sum(Shares, Out, block, kv_rows, head_dim, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr, SHARES: tl.constexpr):
    """Rows [block * BLOCK_M, +BLOCK_M) of Out, (kv_rows, head_dim) contiguous: each the
    fp32 sum of its SHARES shares, which lie side by side in a row of Shares' (kv_rows,
    SHARES * head_dim) (bwd_hopper's GQA head split), rounded once."""
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tile = (rows[:, None] < kv_rows) & (offs_d[None, :] < head_dim)
    p_share = Shares + rows[:, None] * (SHARES * head_dim) + offs_d[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for share in range(SHARES):  # not unrolled: a wide group would hoist every load
        acc += tl.load(p_share + share * head_dim, mask=tile).to(tl.float32)
    tl.store(Out + rows[:, None] * head_dim + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=tile)


@triton.jit(do_not_specialize=["stride_acch", "seqlen_q"])
def _bwd_dq_convert_kernel(DQAccum, DQ, DKShares, DVShares, DK, DV, stride_accb,
                           stride_acch, stride_dqb, stride_dqm, stride_dqh,
                           batch, nheads, seqlen_q, head_dim, kv_rows, softmax_scale,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                           SHARES: tl.constexpr):
    """dq = DQAccum * softmax_scale in dq's dtype and layout (the fused backward and
    bwd_hopper). SHARES > 1 (bwd_hopper's GQA head split): the grid's rows past batch x
    nheads also sum dK's and dV's shares into dk and dv (``_shares_sum``): one launch
    where the conversion and two torch reductions took three."""
    if SHARES == 1:  # DKShares, DVShares, DK, DV: never read (None, or dk's shares)
        _dq_convert(DQAccum, DQ, stride_accb, stride_acch, stride_dqb, stride_dqm,
                    stride_dqh, nheads, seqlen_q, head_dim, softmax_scale, BLOCK_M, BLOCK_D)
    else:
        past = tl.program_id(1) - batch * nheads
        if past < 0:
            _dq_convert(DQAccum, DQ, stride_accb, stride_acch, stride_dqb, stride_dqm,
                        stride_dqh, nheads, seqlen_q, head_dim, softmax_scale, BLOCK_M,
                        BLOCK_D)
        else:
            block = past * tl.num_programs(0) + tl.program_id(0)
            _shares_sum(DKShares, DK, block, kv_rows, head_dim, BLOCK_M, BLOCK_D, SHARES)
            _shares_sum(DVShares, DV, block, kv_rows, head_dim, BLOCK_M, BLOCK_D, SHARES)


def convert_grid(batch: int, nheads: int, seqlen_q: int, kv_rows: int = 0) -> tuple:
    """``_bwd_dq_convert_kernel``'s grid: a program a PREPROCESS_BLOCK_M rows of a head's
    dq, then (kv_rows > 0) enough grid rows of programs for kv_rows rows of dk and dv."""
    blocks = configs.cdiv(seqlen_q, configs.PREPROCESS_BLOCK_M)
    extra = configs.cdiv(configs.cdiv(kv_rows, configs.PREPROCESS_BLOCK_M), blocks)
    return (blocks, batch * nheads + extra)


# The kernel parameters a call of each backward plan fills, in this order (``_launch``).
# A varlen plan's slots also carry what follows the packed row counts: the rows, the
# accumulator's and lse's head strides, total_q and total_k.
_PRE_SLOTS = ("Out", "DOut", "DLse", "Delta", "DQAccum", "Lse", "Lse2", "stride_acch",
              "seqlen_q")
_DKDV_SLOTS = ("Q", "K", "V", "DOut", "Lse", "Delta", "DK", "DV", "DQAccum", "Mask",
               "Alibi", "CuSeqlensQ", "CuSeqlensK", "Philox", "stride_acch", "stride_lb",
               "stride_lh", "total_q", "total_k", "max_seqlen_q", "max_seqlen_k",
               "softmax_scale", "softcap", "dropout_p")
_DQ_SLOTS = ("Q", "K", "V", "DOut", "Lse", "Delta", "DQ", "Mask", "Alibi", "CuSeqlensQ",
             "CuSeqlensK", "Philox", "stride_lb", "stride_lh", "total_q", "total_k",
             "max_seqlen_q", "max_seqlen_k", "softmax_scale", "softcap", "dropout_p")
_CONVERT_SLOTS = ("DQAccum", "DQ", "stride_acch", "seqlen_q", "softmax_scale")


def attn_bwd(dout, q, k, v, out, lse, dlse, *, attn_mask, alibi_slopes, softmax_scale,
             diag_offset, window_left, window_right, softcap, allow_tf32,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             fused=False, dropout_p=0.0, philox=None, one_allocation=False):
    """Launch the backward. Returns (dq, dk, dv) shaped like q, k, v; v (so out, dout
    and dv) may have a head dim of its own.

    Dense: ``lse`` and ``dlse`` are (b, h, sq) fp32; varlen (cu_seqlens given): q/k/v
    are packed (total, heads, d) and lse/dlse are (h, total_q). ``dlse`` may be None.
    fused: False, the split kernels (preprocess, dK/dV, dQ: bitwise reproducible); True,
    the preprocess, dK/dV with atomic fp32 dQ, and the dQ conversion (fewer products,
    dq reproducible to rounding only), where they have tiles: not fp32 with head_dim
    over 128 (``configs.fused_bwd_has_tiles``), which the split kernels serve. Same
    features either way, dropout included: dropout_p and the forward's philox tensor
    regenerate its mask (``_common._dropout_setup``).
    Index values are checked by the kernels (bad prefix sums: NaN gradients).
    Allocations (``_launch.carve``): dq's also holds the kernels' fp32 scratch (delta,
    and the fused path's dQ accumulator); one_allocation=True puts dk and dv in it too,
    for the eager autograd path, whose gradients may share a storage (a custom op's
    outputs may not). The gradients are contiguous views either way.
    """
    varlen = cu_seqlens_q is not None
    h, d, hkv = q.shape[-2], q.shape[-1], k.shape[-2]
    # v's head dim (dv's and dout's) may differ from q's and k's (MLA); the tiles are
    # chosen for the wider one, the register tiles growing with either.
    d_v = v.shape[-1]
    d_tiles = max(d, d_v)
    fused = fused and configs.fused_bwd_has_tiles(q.element_size(), d_tiles)
    if varlen:
        batch, longest_q, longest_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
    else:
        batch, longest_q, longest_k = q.shape[0], q.shape[1], k.shape[1]
    rows = q.shape[0] if varlen else q.shape[1]  # packed varlen rows: one long sequence
    # delta has lse's (b, h, sq), or (h, total_q) packed; the fused dQ accumulator is
    # (batch, h, rows, padded head_dim), or (1, h, total_q, ...) packed, zeroed by the
    # preprocess. Their fp32 words follow the gradients: the accumulator's, then delta's.
    n_delta = (1 if varlen else batch) * h * rows
    # Past 256 columns the kernels split the head dims across programs (the tiles'
    # dv_parts, configs.head_dim_parts); each part's columns are BLOCK_D of q's head dim
    # and BLOCK_DV of v's, and the accumulator's row holds every part's.
    parts = configs.head_dim_parts(d_tiles)
    part_d, part_dv = configs.part_columns(d, parts), configs.part_columns(d_v, parts)
    block_d = part_d * parts
    n_accum = n_delta * block_d if fused else 0
    if one_allocation:
        (dq, dk, dv), buf, accum_at = _launch.carve((q.shape, k.shape, v.shape), q.dtype,
                                                    n_accum + n_delta, q.device)
    else:
        (dq,), buf, accum_at = _launch.carve((q.shape,), q.dtype, n_accum + n_delta,
                                             q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=q.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=q.device)
    delta_at = accum_at + 4 * n_accum
    # Dense without keys: no gradient. Varlen launches even then, so that prefix sums
    # which are not valid still make dq NaN.
    if not q.numel() or not batch or (not dk.numel() and not varlen):
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    dlse = dlse.contiguous() if dlse is not None else None
    scalars = (max_seqlen_q if varlen else 0, max_seqlen_k if varlen else 0,
               softmax_scale, softcap, dropout_p)
    # What follows a varlen call's packed row counts, in the slots' order: the dQ
    # accumulator's head stride, lse's strides (a packed batch's lse is (h, total_q)),
    # total_q and total_k; then the rows the preprocess and the dQ conversion cover.
    acc_strides = (0 if varlen else h * rows * block_d, rows * block_d) if fused \
        else (0, 0)
    lse_strides = (0, lse.stride(0)) if varlen else lse.stride()[:2]
    totals = (q.shape[0], k.shape[0]) if varlen else (0, 0)
    row_grid = (configs.cdiv(rows, configs.PREPROCESS_BLOCK_M), (1 if varlen else batch) * h)
    key = None
    if _launch.ready(q):
        # The operands' addresses, each tensor's read once; delta and the dQ
        # accumulator at their offsets in dq's allocation.
        pb = _data_ptr(dq)
        p = _operands(_data_ptr(q), _data_ptr(k), _data_ptr(v), _data_ptr(dout),
                      _data_ptr(lse), pb + delta_at, _data_ptr(dk), _data_ptr(dv),
                      _address(attn_mask), _address(alibi_slopes), _address(cu_seqlens_q),
                      _address(cu_seqlens_k), _data_ptr(out), _address(dlse), pb,
                      pb + accum_at if fused else None, _address(philox))
        # A varlen key leaves the batch and token counts out (the grids and the slots
        # carry them): one set of plans per layout, as the forward's.
        key = ("bwd", q.dtype, q.shape[1:] if varlen else q.shape, q.stride(),
               k.shape[1:] if varlen else k.shape, k.stride(), d_v, v.stride(),
               dout.stride(), out.stride(), dlse is None,
               _launch.layout(attn_mask), _launch.layout(alibi_slopes),
               diag_offset, window_left, window_right, softcap > 0, allow_tf32,
               philox is not None,
               varlen and configs.seqlen_class(max(longest_q, longest_k)),
               fused, _launch.misalignment(p))
        plans = _launch.lookup(key)
        if plans is not None:
            pre, dkdv, last = plans
            pre((p[12], p[3], p[13], p[5], p[15], p[5], p[5], acc_strides[1], rows),
                (*row_grid, 1))
            dkdv((*p[:8], p[15], *p[8:12], p[16], acc_strides[1], *lse_strides, *totals,
                  *scalars),
                 (max(1, configs.cdiv(longest_k, dkdv.cfg.block_n)) * parts, batch * hkv, 1)
                 if varlen else None)
            if fused:
                last((p[15], p[14], acc_strides[1], rows, softmax_scale), (*row_grid, 1))
            else:
                last((*p[:6], p[14], *p[8:12], p[16], *lse_strides, *totals, *scalars),
                     (max(1, configs.cdiv(longest_q, last.cfg.block_m)) * parts, batch * h, 1)
                     if varlen else None)
            return dq, dk, dv
    # The first launch of a variant: Triton's path takes tensors, so delta and the dQ
    # accumulator as views of their words.
    delta = _launch.lse_after(buf, delta_at, lse.shape)
    dq_accum = _launch.lse_after(buf, accum_at, (1 if varlen else batch, h, rows, block_d)) \
        if fused else None
    tensors = _operands(q, k, v, dout, lse, delta, dk, dv, attn_mask, alibi_slopes,
                        cu_seqlens_q, cu_seqlens_k, out, dlse, dq, dq_accum, philox)
    if varlen:
        # Packed tensors as a batch of one whose batch stride the kernels must not use.
        dout4, q4, k4, v4, out4, dq4, dk4, dv4 = (
            x.unsqueeze(0) for x in (dout, q, k, v, out, dq, dk, dv))
        lse3 = lse.unsqueeze(0)
    else:
        dout4, q4, k4, v4, out4, dq4, dk4, dv4, lse3 = dout, q, k, v, out, dq, dk, dv, lse
    # The dK/dV kernel's batch index is the sequence's in varlen, and the row kernels
    # see one batch of packed rows: batch strides 0 there (configs.strides).
    pre_m = configs.PREPROCESS_BLOCK_M
    pre = _launch.first_launch(
        _bwd_preprocess_kernel, row_grid,
        (out, dout, tensors[13], delta, tensors[15], delta, delta,  # (Lse, Lse2 unused)
         *configs.strides(varlen, out4, dout4), *acc_strides, h, rows, d_v, 0),
        dict(BLOCK_M=pre_m, BLOCK_D=block_d, BLOCK_DV=configs.padded_head_dim(d_v),
             HAS_DLSE=dlse is not None, ZERO_DQ=fused, LSE2=False),
        _PRE_SLOTS if key is not None else None)
    mask, mask_strides, alibi, alibi_strides, flags = configs.feature_args(
        attn_mask, alibi_slopes, q, window_left=window_left, window_right=window_right,
        softcap=softcap, allow_tf32=allow_tf32, head_dim=d)
    flags.update(BLOCK_D=part_d, EVEN_D=part_d * parts == d, BLOCK_DV=part_dv,
                 EVEN_DV=part_dv * parts == d_v, DV_PARTS=parts)
    windowed, longest = window_left >= 0 or window_right >= 0, max(longest_q, longest_k)
    products = flags["INPUT_PRECISION"]
    # Varlen kernels read each sequence's lengths from cu_seqlens; seqlen_q/k unused.
    sizes = (0, 0, d, d_v) if varlen else (longest_q, longest_k, d, d_v)
    totals = (q.shape[0], k.shape[0]) if varlen else (0, 0)
    common = (*totals, *scalars[:2], diag_offset, window_left, window_right,
              softmax_scale, softcap, dropout_p)
    pick, name = ((configs.bwd_fused_config, "backward fused dk/dv/dq") if fused
                  else (configs.bwd_dkdv_config, "backward dk/dv"))
    dkdv = configs.launch(
        _bwd_dkdv_kernel,
        lambda cfg: (max(1, configs.cdiv(longest_k, cfg.block_n)) * parts, batch * hkv),
        pick(q, d_tiles, windowed, seqlen=longest, products=products), name, q, d,
        *tensors[:8], tensors[15], mask, alibi, *tensors[10:12], tensors[16],
        *configs.strides(varlen, q4, k4, v4, dout4, dk4, dv4), *acc_strides,
        *configs.strides(varlen, lse3),
        *mask_strides, *alibi_strides, h, hkv, *sizes, *common,
        IS_VARLEN=varlen, ATOMIC_DQ=fused, HAS_DROPOUT=philox is not None,
        slots=_DKDV_SLOTS if key is not None else None,
        **flags,
    )
    if fused:
        last = _launch.first_launch(
            _bwd_dq_convert_kernel, row_grid,
            (dq_accum, dq, None, None, None, None, *acc_strides,
             *configs.strides(varlen, dq4), 1 if varlen else batch, h, rows, d, 0,
             softmax_scale),
            dict(BLOCK_M=pre_m, BLOCK_D=block_d, SHARES=1),
            _CONVERT_SLOTS if key is not None else None)
    else:
        last = configs.launch(
            _bwd_dq_kernel,
            lambda cfg: (max(1, configs.cdiv(longest_q, cfg.block_m)) * parts, batch * h),
            configs.bwd_dq_config(q, d_tiles, windowed, seqlen=longest, products=products),
            "backward dq", q, d,
            *tensors[:6], dq, mask, alibi, *tensors[10:12], tensors[16],
            *configs.strides(varlen, q4, k4, v4, dout4, dq4, lse3),
            *mask_strides, *alibi_strides, h, h // hkv, *sizes, *common,
            IS_VARLEN=varlen, HAS_DROPOUT=philox is not None,
            slots=_DQ_SLOTS if key is not None else None, **flags,
        )
    if key is not None:
        _launch.store(key, (pre, dkdv, last))
    return dq, dk, dv
