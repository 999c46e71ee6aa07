"""FlashAttention forward: Q in row tiles, K/V streamed in column tiles, online softmax.

Algorithm: Dao et al., FlashAttention-2 (2023), Algorithm 1, in base 2: scores are
scaled by log2(e) once so every exponential is an ``exp2``. Writes ``out`` and the
natural-log ``lse`` per row; nothing of size seqlen_q x seqlen_k touches memory.
"""

import torch
import triton
import triton.language as tl

from flashtile.ops import configs
from flashtile.ops._common import LN2, _block_range, _load_tile, _scores_log2, _seq_bounds


@triton.jit
def _fwd_block(acc, l_i, m_i, b_q, p_k, p_v, start, stop,
               offs_m, offs_n0, offs_d, seqlen_q, seqlen_k, head_dim,
               stride_kn, stride_vn, diag_offset, window_left, window_right,
               softmax_scale, softcap, alibi_slope, p_mask, stride_mask_m, stride_mask_n,
               BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, BOUNDARY: tl.constexpr,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
               INPUT_PRECISION: tl.constexpr):
    # A row can have seen nothing yet only where masks apply (a bool mask, or an additive
    # one holding -inf); only then guard -inf - -inf.
    CAN_BE_EMPTY: tl.constexpr = BOUNDARY or HAS_MASK
    for start_n in tl.range(start, stop, BLOCK_N):
        offs_n = start_n + offs_n0
        b_k = _load_tile(p_k + start_n * stride_kn, offs_n, seqlen_k, offs_d, head_dim,
                         BOUNDARY, EVEN_D)                                  # (N, D)
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=INPUT_PRECISION)   # (M, N)
        m_mask = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
        s = _scores_log2(qk, offs_m, offs_n, seqlen_k, diag_offset, window_left,
                         window_right, softmax_scale, softcap, alibi_slope, p_mask,
                         stride_mask_m, stride_mask_n, m_mask, BOUNDARY, MASK_LEFT,
                         MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL)
        m_new = tl.maximum(m_i, tl.max(s, 1))                               # (M,)
        if CAN_BE_EMPTY:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])                                     # (M, N)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        b_v = _load_tile(p_v + start_n * stride_vn, offs_n, seqlen_k, offs_d, head_dim,
                         BOUNDARY, EVEN_D)                                  # (N, D)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, Mask, Alibi, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_alibi_b, stride_alibi_h,
    nheads, group_size, seqlen_q, seqlen_k, head_dim,
    diag_offset, window_left, window_right, softmax_scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, INPUT_PRECISION: tl.constexpr, REVERSE_M: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    start_m = tl.program_id(0)
    if REVERSE_M:
        # With a causal or window mask the last query blocks see the most keys: start
        # them first so the tail of the grid is short programs.
        start_m = tl.num_programs(0) - 1 - start_m
    off_bh = tl.program_id(1)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    off_hkv = off_h // group_size
    q_start, k_start, seqlen_q, seqlen_k, diag_offset = _seq_bounds(
        CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset, IS_VARLEN)
    if start_m * BLOCK_M >= seqlen_q:  # varlen: the grid covers the longest sequence
        return

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    Q += off_b * stride_qb + q_start * stride_qm
    K += off_b * stride_kb + k_start * stride_kn
    V += off_b * stride_vb + k_start * stride_vn
    Out += off_b * stride_ob + q_start * stride_om
    p_q = Q + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    p_k = K + off_hkv * stride_kh + offs_n0[:, None] * stride_kn + offs_d[None, :]
    p_v = V + off_hkv * stride_vh + offs_n0[:, None] * stride_vn + offs_d[None, :]
    b_q = _load_tile(p_q, offs_m, seqlen_q, offs_d, head_dim, True, EVEN_D)  # (M, D)

    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + off_b * stride_alibi_b + off_h * stride_alibi_h)
    p_mask = Mask
    if HAS_MASK:
        p_mask = Mask + off_b * stride_mask_b + off_h * stride_mask_h

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _block_range(start_m, seqlen_q, seqlen_k, diag_offset,
                                          window_left, window_right, BLOCK_M, BLOCK_N,
                                          MASK_LEFT, MASK_RIGHT)
    # Three spans: masked left edge, unmasked middle, masked right edge (and the ragged
    # last key block). The middle one is where the time goes.
    acc, l_i, m_i = _fwd_block(
        acc, l_i, m_i, b_q, p_k, p_v, lo, mid_lo, offs_m, offs_n0, offs_d, seqlen_q,
        seqlen_k, head_dim, stride_kn, stride_vn, diag_offset, window_left, window_right,
        softmax_scale, softcap, alibi_slope, p_mask, stride_mask_m, stride_mask_n,
        BLOCK_N, EVEN_D, True, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK,
        MASK_IS_BOOL, INPUT_PRECISION)
    acc, l_i, m_i = _fwd_block(
        acc, l_i, m_i, b_q, p_k, p_v, mid_lo, mid_hi, offs_m, offs_n0, offs_d, seqlen_q,
        seqlen_k, head_dim, stride_kn, stride_vn, diag_offset, window_left, window_right,
        softmax_scale, softcap, alibi_slope, p_mask, stride_mask_m, stride_mask_n,
        BLOCK_N, EVEN_D, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK,
        MASK_IS_BOOL, INPUT_PRECISION)
    acc, l_i, m_i = _fwd_block(
        acc, l_i, m_i, b_q, p_k, p_v, mid_hi, hi, offs_m, offs_n0, offs_d, seqlen_q,
        seqlen_k, head_dim, stride_kn, stride_vn, diag_offset, window_left, window_right,
        softmax_scale, softcap, alibi_slope, p_mask, stride_mask_m, stride_mask_n,
        BLOCK_N, EVEN_D, True, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK,
        MASK_IS_BOOL, INPUT_PRECISION)

    # Rows that saw no key (l == 0): out 0, lse -inf, never 0/0, and 0 even where a NaN
    # value of their key block reached acc as 0 * NaN. A NaN that reached a row makes l
    # NaN, which "== 0" does not take for empty: its out and lse stay NaN.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)

    m_row = offs_m < seqlen_q
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + q_start + offs_m, lse, mask=m_row)
    p_o = Out + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(p_o, out.to(Out.dtype.element_ty),
             mask=m_row[:, None] & (offs_d[None, :] < head_dim))


def attn_fwd(q, k, v, *, attn_mask, alibi_slopes, softmax_scale, diag_offset,
             window_left, window_right, softcap, allow_tf32,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None):
    """Launch the forward kernel. Inputs are validated by the caller.

    Dense: q (b, sq, h, d), k/v (b, sk, hkv, d), last dim contiguous, any other strides;
    attn_mask, if given, already expanded to (b, h, sq, sk); returns out (b, sq, h, d)
    contiguous in q's dtype and lse (b, h, sq) fp32.
    Varlen (cu_seqlens_q/k int32 (batch + 1,)): q (total_q, h, d), k/v (total_k, hkv, d);
    returns out (total_q, h, d) and lse (h, total_q); diag_offset is relative to each
    sequence's bottom-right corner.
    """
    varlen = cu_seqlens_q is not None
    if varlen:
        batch, seqlen_q, seqlen_k = cu_seqlens_q.numel() - 1, max_seqlen_q, 0
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.empty((b, sq, h, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if not varlen:
        batch, seqlen_q, seqlen_k = b, sq, sk
    if out.numel() and batch and seqlen_q:
        windowed = window_right >= 0 or window_left >= 0
        mask, mask_strides, alibi, alibi_strides, flags = configs.feature_args(
            attn_mask, alibi_slopes, q, window_left=window_left, window_right=window_right,
            softcap=softcap, allow_tf32=allow_tf32, head_dim=d)
        configs.launch(
            _attn_fwd_kernel, lambda cfg: (configs.cdiv(seqlen_q, cfg.block_m), batch * h),
            configs.fwd_config(q, d, causal_like=windowed, seqlen=max(seqlen_q, sk)),
            "forward", q, d,
            q, k, v, out, lse, mask, alibi,
            cu_seqlens_q if varlen else q, cu_seqlens_k if varlen else q,
            *configs.strides(varlen, q, k, v, out, lse),
            *mask_strides, *alibi_strides,
            h, h // hkv, seqlen_q, seqlen_k, d,
            diag_offset, window_left, window_right, softmax_scale, softcap,
            REVERSE_M=windowed, IS_VARLEN=varlen, **flags,
        )
    if varlen:
        return out[0], lse[0]
    return out, lse
