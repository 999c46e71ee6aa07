"""FlashAttention forward: Q in row tiles, K/V streamed in column tiles, online softmax.

Algorithm: Dao et al., FlashAttention-2 (2023), Algorithm 1, in base 2: scores are
scaled by log2(e) once so every exponential is an ``exp2``. Writes ``out`` and the
natural-log ``lse`` per row; nothing of size seqlen_q x seqlen_k touches memory.

Head dims past 256 (``configs.head_dim_parts``): a row block's output is computed by
DV_PARTS programs, each holding the accumulator of its part of V's columns and computing
the scores over q and k's whole head dim (at 2 parts, 1.5x the products, for tiles of
what a head dim of 256 holds: 128 rows and wgmma on Hopper instead of 32 and mma.sync).

Varlen with a block table (PAGED): K/V are a paged pool (num_blocks, page_size, hkv, d)
and key j of sequence b is row ``j % page_size`` of block ``block_table[b, j //
page_size]`` (vLLM's PagedAttention layout, flash-attn's ``block_table``). Key tiles start
at multiples of BLOCK_N and both sizes are powers of two, so a tile lies inside one page
(one block-table entry per tile) or covers whole pages (one entry per row).

Indices are checked where they are read, never on the host (``_common``): prefix sums
that are not valid make every row NaN; a key count past the block table's reach makes
its sequence's rows NaN; a block-table entry outside the pool is never followed (block 0
is read instead) and the rows that would see its keys are NaN: exactly those when a
tile lies in one page (the rule of a NaN key), the program's whole block of queries
when pages are smaller than the tile.
"""

import torch
import triton
import triton.language as tl

from flashtile._backend import interpreting
from flashtile.ops import _launch, configs
from flashtile.ops._fp8 import _load_descale
from flashtile.ops._common import (LN2, _block_range, _checked_page, _dropout_keep,
                                   _dropout_setup, _fill_nan_rows, _load_tile, _pages_bad,
                                   _prefix_sums_bad, _scores_log2, _seq_bounds)

_data_ptr = torch.Tensor.data_ptr

# FP8: P is computed as exp2(s - max + P_LOG2_OFFSET), in [0, 256] (see _fwd_block).
P_LOG2_OFFSET = tl.constexpr(8.0)


@triton.jit
def _tile_pages(block_row, start_n, offs_n0, max_blocks, PAGE_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """(pool block, row within it) of keys start_n + offs_n0 of one sequence, start_n a
    multiple of BLOCK_N: the block a scalar when the tile lies in one page, else one per
    row. Entries past the block table read block 0: only rows past the sequence's
    keys, which the caller masks, can reach them."""
    if PAGE_SIZE >= BLOCK_N:
        # BLOCK_N divides PAGE_SIZE: the whole tile lies in one page.
        index = start_n // PAGE_SIZE
        in_page = start_n % PAGE_SIZE + offs_n0
    else:
        index = (start_n + offs_n0) // PAGE_SIZE                            # (N,)
        in_page = (start_n + offs_n0) % PAGE_SIZE
    page = tl.load(block_row + index, mask=index < max_blocks, other=0)
    return page.to(tl.int64), in_page


@triton.jit
def _load_vt(ptrs, offs_d, head_dim, EVEN_D: tl.constexpr):
    """A (BLOCK_D, BLOCK_N) tile of V^T from the keys-contiguous copy, whose keys are
    zero-padded to whole tiles (keys_contiguous): only padded head dims are masked, so
    the copy into shared memory stays vectorised and asynchronous (a mask along the
    contiguous axis made it byte by byte, and spilled 104 bytes at 128 x 128 tiles)."""
    if EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs_d[:, None] < head_dim, other=0.0)
    return x


@triton.jit
def _fwd_block(acc, l_i, m_i, b_q, p_k, p_v, start, stop,
               offs_m, offs_n0, offs_d, offs_dv, seqlen_q, seqlen_k, head_dim,
               head_dim_v, stride_kb, stride_kn, stride_vb, stride_vn, block_row,
               max_blocks, num_blocks, diag_offset, window_left, window_right,
               softmax_scale, softcap, alibi_slope, p_mask, stride_mask_m, stride_mask_n,
               drop_seed, drop_offset, drop_row_start, dropout_p,
               BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
               BOUNDARY: tl.constexpr,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
               INPUT_PRECISION: tl.constexpr, PAGED: tl.constexpr,
               PAGE_SIZE: tl.constexpr, IS_FP8: tl.constexpr,
               V_KEYS_CONTIGUOUS: tl.constexpr, PV_PER_TILE: tl.constexpr,
               HAS_DROPOUT: tl.constexpr):
    # A row can have seen nothing yet only where masks apply (a bool mask, or an additive
    # one holding -inf); only then guard -inf - -inf.
    CAN_BE_EMPTY: tl.constexpr = BOUNDARY or HAS_MASK
    if PAGED:
        # Each tile's page is looked up one tile ahead: a K/V address that waits on a
        # block-table load of its own iteration costs the pipeliner a stage (sm_90
        # compile, d128: 2 K/V buffers instead of 3), as in the paged decode kernel.
        page, in_page = _tile_pages(block_row, start, offs_n0, max_blocks, PAGE_SIZE,
                                    BLOCK_N)
    for start_n in tl.range(start, stop, BLOCK_N):
        offs_n = start_n + offs_n0
        scale = softmax_scale
        if PAGED:
            # A block outside the pool: block 0 read instead, and NaN rows (a NaN scale
            # for a tile's page; a page per row is checked after the loop).
            if PAGE_SIZE >= BLOCK_N:
                page, scale = _checked_page(page, num_blocks, softmax_scale)
            else:
                page = tl.where((page < 0) | (page >= num_blocks), 0, page)
            # p_k/p_v are (1, D) at the KV head; each row adds its place in the pool.
            p_k_n = p_k + (page * stride_kb + in_page * stride_kn)[:, None]
            p_v_n = p_v + (page * stride_vb + in_page * stride_vn)[:, None]
            page, in_page = _tile_pages(block_row, start_n + BLOCK_N, offs_n0, max_blocks,
                                        PAGE_SIZE, BLOCK_N)
        else:
            p_k_n = p_k + start_n * stride_kn
            if V_KEYS_CONTIGUOUS:
                # Every span starts at a multiple of BLOCK_N (_block_range), so the V^T
                # rows of a tile are 16-byte aligned and its copy into shared memory can
                # be asynchronous (pipelined), as K's is; written as a multiple so that
                # Triton sees it (tl.multiple_of on a scalar is dropped).
                p_v_n = p_v + (start_n // BLOCK_N) * BLOCK_N
            else:
                p_v_n = p_v + start_n * stride_vn
        # .to: a float8 pool under 16-bit q (PAGED) is widened to q's dtype, exactly;
        # where k has q's dtype it is no instruction.
        b_k = _load_tile(p_k_n, offs_n, seqlen_k, offs_d, head_dim,
                         BOUNDARY, EVEN_D).to(b_q.dtype)                    # (N, D)
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=INPUT_PRECISION)   # (M, N)
        m_mask = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
        s = _scores_log2(qk, offs_m, offs_n, seqlen_k, diag_offset, window_left,
                         window_right, scale, softcap, alibi_slope, p_mask,
                         stride_mask_m, stride_mask_n, m_mask, BOUNDARY, MASK_LEFT,
                         MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_MASK, MASK_IS_BOOL)
        m_new = tl.maximum(m_i, tl.max(s, 1))                               # (M,)
        if CAN_BE_EMPTY:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        if IS_FP8:
            # P in [0, 2**P_LOG2_OFFSET] rather than [0, 1] (flash-attn 3's max offset):
            # its small entries stay normal FP8 numbers when cast for the P @ V product
            # (e4m3's smallest normal is 2**-6). Free: the offset rides on the max that
            # is subtracted anyway; l sums the same scaled P, so out = acc / l is unchanged
            # and the lse takes the offset back at the end.
            p = tl.exp2(s - (m_new - P_LOG2_OFFSET)[:, None])                # (M, N)
        else:
            p = tl.exp2(s - m_new[:, None])                                 # (M, N)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            # After l: the lse is the undropped one. The 1 / (1 - dropout_p) scale is
            # applied once to the output.
            p = tl.where(_dropout_keep(drop_seed, drop_offset, drop_row_start, start_n,
                                       dropout_p, offs_m.shape[0], BLOCK_N, False),
                         p, 0.0)
        if V_KEYS_CONTIGUOUS:
            b_v = tl.trans(_load_vt(p_v_n, offs_dv, head_dim_v, EVEN_DV))  # (N, DV)
        else:
            b_v = _load_tile(p_v_n, offs_n, seqlen_k, offs_dv, head_dim_v,
                             BOUNDARY, EVEN_DV).to(b_q.dtype)               # (N, DV)
        if PV_PER_TILE:
            # Each tile's P @ V starts from zero and the tiles are summed in fp32: Hopper's
            # FP8 wgmma keeps a narrower accumulator (about 14 bits, DeepSeek-V3 report
            # section 3.3.2) that a whole row of tiles would otherwise add into. Same
            # instruction count (the rescale's multiply becomes the add's FMA), but a
            # second accumulator tile live: only where registers allow (PV_PER_TILE).
            acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v,
                                                input_precision=INPUT_PRECISION)
        else:
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# max_seqlen_q/k change from call to call (a varlen batch's longest sequence): not
# specialised, so one compiled kernel (and one launch plan) serves them all. Nor are the
# packed token counts total_q/total_k and the lse strides (a varlen call's lse is
# (nheads, total_q)): Triton would compile a variant for a count divisible by 16, another
# for one that is not and a third for 1, and an engine met them mid-serving, after its
# warm-up (NOTES.md sections 15 and 18). They only bound index checks and one scalar
# store per row, which need no hint.
@triton.jit(do_not_specialize=["max_seqlen_q", "max_seqlen_k", "stride_lb", "stride_lh",
                               "total_q", "total_k"])
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, Mask, Alibi, CuSeqlensQ, CuSeqlensK, BlockTable, SequsedK,
    QDescale, KDescale, VDescale, Philox,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_alibi_b, stride_alibi_h,
    stride_qdesc_b, stride_qdesc_h, stride_kdesc_b, stride_kdesc_h,
    stride_vdesc_b, stride_vdesc_h,
    stride_block_table_b, max_blocks, num_blocks,
    nheads, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v,
    total_q, total_k, max_seqlen_q, max_seqlen_k,
    diag_offset, window_left, window_right, softmax_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, INPUT_PRECISION: tl.constexpr, REVERSE_M: tl.constexpr,
    IS_VARLEN: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SEQUSED_K: tl.constexpr, HAS_Q_DESCALE: tl.constexpr, HAS_K_DESCALE: tl.constexpr,
    HAS_V_DESCALE: tl.constexpr, V_KEYS_CONTIGUOUS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DV_PARTS: tl.constexpr,
):
    # FP8 q, k, v (one format): both products run on the FP8 tensor cores.
    IS_FP8: tl.constexpr = Q.dtype.element_ty.is_fp8()
    # FP8 P @ V summed tile by tile in fp32 (_fwd_block) where its second accumulator
    # fits: the keys-contiguous path up to head_dim 128. At head_dim 256, or with Triton
    # transposing V tiles through registers (varlen), it spilled 24-300 bytes on sm_90.
    PV_PER_TILE: tl.constexpr = IS_FP8 and V_KEYS_CONTIGUOUS and BLOCK_DV <= 128
    start_m = tl.program_id(0)
    part = 0
    if DV_PARTS > 1:
        # V's and the output's columns in DV_PARTS parts of BLOCK_DV, one a program,
        # each computing its rows' scores over q and k's whole head dim
        # (configs.head_dim_parts says why). A row block's parts are neighbours in the
        # grid: they read the same K tiles at about the same time, from L2.
        part = start_m % DV_PARTS
        start_m = start_m // DV_PARTS
    if REVERSE_M:
        # With a causal or window mask the last query blocks see the most keys: start
        # them first so the tail of the grid is short programs.
        start_m = tl.num_programs(0) // DV_PARTS - 1 - start_m
    off_bh = tl.program_id(1)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    off_hkv = off_h // group_size
    if IS_VARLEN:
        # Packed rows (total_q, total_k) and the prefix sums that split them; paged keys
        # have no packed rows, only per-sequence counts (checked below).
        n_bad = _prefix_sums_bad(CuSeqlensQ, tl.num_programs(1) // nheads, total_q,
                                 max_seqlen_q)
        if not PAGED:
            n_bad += _prefix_sums_bad(CuSeqlensK, tl.num_programs(1) // nheads, total_k,
                                      max_seqlen_k)
        if n_bad > 0:
            # Every row of q is NaN, written by a fixed partition of the grid (the
            # sequences cannot say which rows are whose).
            chunk = off_b * tl.num_programs(0) + tl.program_id(0)
            n_chunks = tl.num_programs(1) // nheads * tl.num_programs(0)
            _fill_nan_rows(Out + off_h * stride_oh, stride_om, total_q, head_dim_v, chunk,
                           n_chunks, BLOCK_M, BLOCK_DV * DV_PARTS)
            _fill_nan_rows(Lse + off_h * stride_lh, 1, total_q, 1, chunk, n_chunks,
                           BLOCK_M, 1)
            return
    q_start, k_start, seqlen_q, seqlen_k, diag_offset = _seq_bounds(
        CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset, IS_VARLEN)
    if SEQUSED_K:
        # The key count is given per sequence (CuSeqlensK was a placeholder): move the
        # bottom-right alignment to it.
        used = tl.load(SequsedK + off_b)
        diag_offset += used - seqlen_k
        seqlen_k = used
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PAGED:
        # More keys than the block table row names (or fewer than none): no keys are
        # read, and a NaN sum makes the sequence's out and lse NaN at the end.
        seq_bad = (seqlen_k < 0) | (seqlen_k > max_blocks * PAGE_SIZE)
        seqlen_k = tl.where(seq_bad, 0, seqlen_k)
        l_i += tl.where(seq_bad, float("nan"), 0.0)
    if start_m * BLOCK_M >= seqlen_q:  # varlen: the grid covers the longest sequence
        return

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # V's head dim, the output's (MLA: 128 beside 192). offs_d itself where the tiles
    # match, so equal-dim calls compile the IR they had before.
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    if DV_PARTS > 1:
        offs_dv += part * BLOCK_DV

    Q += off_b * stride_qb + q_start * stride_qm
    Out += off_b * stride_ob + q_start * stride_om
    p_q = Q + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    block_row = BlockTable + off_b * stride_block_table_b
    if PAGED:
        # Row offsets come per tile from the block table (_tile_pages).
        p_k = K + off_hkv * stride_kh + offs_d[None, :]                    # (1, D)
        p_v = V + off_hkv * stride_vh + offs_dv[None, :]
    else:
        K += off_b * stride_kb + k_start * stride_kn
        V += off_b * stride_vb + k_start * stride_vn
        p_k = K + off_hkv * stride_kh + offs_n0[:, None] * stride_kn + offs_d[None, :]
        if V_KEYS_CONTIGUOUS:
            # V^T tiles (D, N), keys contiguous (stride_vn == 1: the FP8 launcher's
            # copy), transposed in shared memory as K is for q k^T: the K-major B
            # operand the FP8 wgmma needs, with K = the key axis.
            p_v = V + off_hkv * stride_vh + offs_dv[:, None] * stride_vd + offs_n0[None, :]
        else:
            p_v = V + off_hkv * stride_vh + offs_n0[:, None] * stride_vn + offs_dv[None, :]
    b_q = _load_tile(p_q, offs_m, seqlen_q, offs_d, head_dim, True, EVEN_D)  # (M, D)

    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + off_b * stride_alibi_b + off_h * stride_alibi_h)
    p_mask = Mask
    if HAS_MASK:
        p_mask = Mask + off_b * stride_mask_b + off_h * stride_mask_h

    # FP8 descales (1.0 where not given): q's and k's multiply every score, so they
    # join the scale of the exp2; v's multiplies the output (below).
    softmax_scale *= (_load_descale(QDescale, off_b, off_hkv, stride_qdesc_b,
                                    stride_qdesc_h, HAS_Q_DESCALE)
                      * _load_descale(KDescale, off_b, off_hkv, stride_kdesc_b,
                                      stride_kdesc_h, HAS_K_DESCALE))
    v_descale = _load_descale(VDescale, off_b, off_hkv, stride_vdesc_b, stride_vdesc_h,
                              HAS_V_DESCALE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    drop_seed, drop_offset, drop_row_start = 0, 0, 0  # unused
    if HAS_DROPOUT:
        drop_seed, drop_offset, row0 = _dropout_setup(
            Philox, off_b, off_h, nheads, seqlen_q, q_start, total_q, IS_VARLEN)
        drop_row_start = row0 + start_m * BLOCK_M

    lo, mid_lo, mid_hi, hi = _block_range(start_m, seqlen_q, seqlen_k, diag_offset,
                                          window_left, window_right, BLOCK_M, BLOCK_N,
                                          MASK_LEFT, MASK_RIGHT)
    # Three spans: masked left edge, unmasked middle, masked right edge (and the ragged
    # last key block). The middle one is where the time goes. Unrolled at compile time:
    # span is a constexpr, so each call gets its own bounds and MASKED.
    for span in tl.static_range(3):
        start = lo if span == 0 else (mid_lo if span == 1 else mid_hi)
        stop = mid_lo if span == 0 else (mid_hi if span == 1 else hi)
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, b_q, p_k, p_v, start, stop, offs_m, offs_n0, offs_d, offs_dv,
            seqlen_q, seqlen_k, head_dim, head_dim_v, stride_kb, stride_kn, stride_vb,
            stride_vn, block_row, max_blocks, num_blocks, diag_offset, window_left,
            window_right, softmax_scale, softcap, alibi_slope, p_mask, stride_mask_m,
            stride_mask_n, drop_seed, drop_offset, drop_row_start, dropout_p,
            BLOCK_N, EVEN_D, EVEN_DV, span != 1, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP,
            HAS_ALIBI, HAS_MASK, MASK_IS_BOOL,
            INPUT_PRECISION, PAGED, PAGE_SIZE, IS_FP8, V_KEYS_CONTIGUOUS, PV_PER_TILE,
            HAS_DROPOUT)


    if PAGED and PAGE_SIZE < BLOCK_N:
        # The pages of keys [lo, hi), checked after the loop: a bad one makes every row
        # NaN (a NaN sum). In the loop a flag per key row (or a NaN scale per column)
        # spilled the d128 tile's registers on sm_90.
        bad = _pages_bad(block_row, lo // PAGE_SIZE, tl.cdiv(hi, PAGE_SIZE), num_blocks)
        l_i = tl.where(bad > 0, float("nan"), l_i)
    # Rows that saw no key (l == 0): out 0, lse -inf, never 0/0, and 0 even where a NaN
    # value of their key block reached acc as 0 * NaN. A NaN that reached a row makes l
    # NaN, which "== 0" does not take for empty: its out and lse stay NaN.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    log2_l = tl.log2(l_safe)
    if IS_FP8:
        log2_l -= P_LOG2_OFFSET  # l summed P scaled by 2**P_LOG2_OFFSET
    lse = tl.where(empty, float("-inf"), (m_i + log2_l) * LN2)
    if HAS_V_DESCALE:
        out *= v_descale
    if HAS_DROPOUT:
        out *= 1.0 / (1.0 - dropout_p)

    m_row = offs_m < seqlen_q
    m_lse = m_row
    if DV_PARTS > 1:  # every part computed the same lse: the first writes it
        m_lse = m_row & (part == 0)
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + q_start + offs_m, lse,
             mask=m_lse)
    p_o = Out + off_h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :]
    tl.store(p_o, out.to(Out.dtype.element_ty),
             mask=m_row[:, None] & (offs_dv[None, :] < head_dim_v))


# The kernel parameters a call of a forward plan fills, in this order (``_launch``): the
# tensors, the values a varlen call's token counts change (so that one plan serves every
# packed batch of one layout), and the floats.
_FWD_SLOTS = ("Q", "K", "V", "Out", "Lse", "Mask", "Alibi", "CuSeqlensQ", "CuSeqlensK",
              "BlockTable", "SequsedK", "QDescale", "KDescale", "VDescale", "Philox",
              "stride_lb", "stride_lh", "total_q", "total_k",
              "max_seqlen_q", "max_seqlen_k", "softmax_scale", "softcap", "dropout_p")


# A varlen plan key leaves the batch and token counts out (the grid and the slots carry
# them): one plan serves every packed batch of a layout. The id the caller's check gave
# the layouts cannot stand in the key as a dense call's does (it holds the counts), but
# it names the key's part for q, k and v: kept here per id, so a call of a checked
# layout looks it up instead of reading shapes and strides again.
_varlen_qkv_keys: dict = {}


# Keys of the FP8 V^T copy are padded to a multiple of this: every key tile of the tile
# tables and of `flashtile tune`'s candidates divides it.
FP8_V_PAD = 128


def keys_contiguous(v, block_n, swap32=False):
    """Dense v (batch, seqlen, nheads, head_dim) copied so that consecutive keys are
    adjacent (stride 1 along seqlen), same shape: the layout the FP8 P @ V product reads
    (the FP8 wgmma takes its B operand K-major only, and K is the key axis there). The
    keys are zero-padded to a multiple of block_n (never read as keys: their scores are
    masked), so the kernel loads whole tiles without a mask and every row starts 16-byte
    aligned. One read and one write of v: 2 x 33.5 MB for batch 2, 8k keys, 16 heads of
    128, some 20-45 us beside the ~1.1 ms of that attention at 1000 TFLOP/s (2-4%, twice
    that causal). The bytes are moved as uint8: not every torch build has FP8 copy and
    fill kernels.

    swap32 (the Gluon forward's FP8 P in "swap" order, ``fwd_hopper._p_stored``): within
    each 32 keys, key 8j + 2q + r (j, q < 4, r < 2) is stored at 8q + 2j + r, the order
    P's columns take there. The view then holds keys in that order, up to the next
    multiple of 32 (a partial last 32's keys are spread over all of it; its other places
    hold zeros).

    On the GPU (and in the interpreter) either order is one Triton pass,
    ``_keys_contiguous_kernel``: 23 us for 2 x 8k keys x 16 heads of 128 on the H200,
    where torch's strided copy and fill took 181 (a byte transpose, 370 GB/s; NOTES.md
    section 45)."""
    batch, seqlen, nheads, head_dim = v.shape
    padded = configs.cdiv(seqlen, block_n) * block_n
    vt = torch.empty((batch, nheads, head_dim, padded), dtype=v.dtype, device=v.device)
    raw = vt.view(torch.uint8)
    assert not swap32 or block_n % 32 == 0, block_n
    keys = configs.cdiv(seqlen, 32) * 32 if swap32 else seqlen  # the view's
    if (v.is_cuda or interpreting()) and v.stride(3) == 1 \
            and padded % COPY_BLOCK_K == 0:  # one pass: _keys_contiguous_kernel
        grid = (padded // COPY_BLOCK_K, batch * nheads)
        _keys_contiguous_kernel[grid](
            v.view(torch.uint8), raw, seqlen, nheads, head_dim, *v.stride()[:3], padded,
            SWAP=swap32, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_K=COPY_BLOCK_K,
            num_warps=4 if head_dim <= 128 else 8)
        return vt.permute(0, 3, 1, 2)[:, :keys]
    # (Below, the PyTorch form of each order: the kernel's reference.)
    src = v.view(torch.uint8).permute(0, 2, 3, 1)
    if not swap32:
        raw[..., :seqlen].copy_(src)
        raw[..., seqlen:].zero_()
    else:
        whole = seqlen // 32 * 32
        if whole:  # the whole 32s: (group, j, q, r) of v's keys into (group, q, j, r)
            groups = (whole // 32, 4, 4, 2)
            raw[..., :whole].unflatten(-1, groups).transpose(-3, -2).copy_(
                src[..., :whole].unflatten(-1, groups))
        raw[..., whole:].zero_()
        if whole < seqlen:  # the last, partial 32: copied in order, then swapped
            tail = raw[..., whole:whole + 32]
            tail[..., :seqlen - whole].copy_(src[..., whole:])
            tail.copy_(tail.unflatten(-1, (4, 4, 2)).transpose(-3, -2).contiguous()
                       .view(tail.shape))
    return vt.permute(0, 3, 1, 2)[:, :keys]


# Keys a program of _keys_contiguous_kernel (a multiple of 32: whole groups of the swap
# order).
COPY_BLOCK_K = 64


@triton.jit
def _keys_contiguous_kernel(V, VT, seqlen, nheads, head_dim, stride_vb, stride_vs,
                            stride_vh, stride_td, SWAP: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """keys_contiguous's copy in one pass (the PyTorch form takes two to four strided
    copies): a (BLOCK_K keys, head_dim) tile of v's bytes (head dim contiguous), zeros
    past seqlen, transposed (with SWAP each 32 keys in the swap order) into row (batch,
    head) of the (batch, nheads, head_dim, stride_td) copy, its padded key count
    stride_td a multiple of BLOCK_K: padding included, every byte written."""
    off_bh = tl.program_id(1)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < head_dim
    x = tl.load(V + off_b.to(tl.int64) * stride_vb + off_h * stride_vh
                + offs_k[:, None].to(tl.int64) * stride_vs + offs_d[None, :],
                mask=(offs_k[:, None] < seqlen) & in_d[None, :], other=0)
    x = tl.trans(x)
    if SWAP:
        # (d, key) -> (d, 32-key group, j, q, r) -> (d, group, q, j, r): key 8j + 2q + r
        # of each 32 lands at 8q + 2j + r, and the store is contiguous along the keys.
        x = tl.reshape(x, (BLOCK_D, BLOCK_K // 32, 4, 4, 2))
        x = tl.reshape(tl.permute(x, (0, 1, 3, 2, 4)), (BLOCK_D, BLOCK_K))
    tl.store(VT + off_bh.to(tl.int64) * head_dim * stride_td + offs_d[:, None] * stride_td
             + offs_k[None, :], x, mask=in_d[:, None])


def attn_fwd(q, k, v, *, attn_mask, alibi_slopes, softmax_scale, diag_offset,
             window_left, window_right, softcap, allow_tf32,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             block_table=None, seqused_k=None, q_descale=None, k_descale=None,
             v_descale=None, out_dtype=None, dropout_p=0.0, philox=None,
             return_lse=True, layout=None):
    """Launch the forward kernel. Inputs are validated by the caller (shapes, dtypes,
    devices; index values are checked by the kernel).

    Dense: q (b, sq, h, d), k (b, sk, hkv, d), v (b, sk, hkv, dv), last dim contiguous,
    any other strides; attn_mask, if given, already expanded to (b, h, sq, sk); returns
    out (b, sq, h, dv) contiguous in q's dtype and lse (b, h, sq) fp32. dv may differ
    from d (DeepSeek's MLA: 192/128); the output takes v's head dim.
    Varlen (cu_seqlens_q/k int32 (batch + 1,), unit stride): q (total_q, h, d), k/v
    (total_k, hkv, d); returns out (total_q, h, d) and lse (h, total_q); diag_offset is
    relative to each sequence's bottom-right corner.
    Paged varlen (block_table int32 (batch, max_blocks), unit inner stride): k/v are the
    pool (num_blocks, page_size, hkv, d), page_size a power of two; sequence b has
    seqused_k[b] keys if given, else cu_seqlens_k[b + 1] - cu_seqlens_k[b].
    FP8 (q, k, v in one float8 dtype): q_descale/k_descale/v_descale, each None (1.0) or
    fp32 (batch, nheads_kv) with any strides (stride 0 where a scale is shared); out in
    out_dtype. Dense v is read through a keys-contiguous copy (keys_contiguous).
    Dropout (dense and packed varlen, 16/32-bit inputs): dropout_p in (0, 1) with
    philox, the int64 [seed, offset] device tensor of ``_common._dropout_setup``.
    return_lse=False: lse is None, its words kept after out's in out's allocation
    (``_launch.out_with_lse``: one allocation instead of two).
    layout: None, or an id the caller gives to one combination of the dtypes, shapes,
    strides and devices of q, k and v (and, varlen, of the index tensors), and to
    no other (``_validate.once_per_layout``'s): the plan key holds it in their place
    (dense) or what it names (varlen, ``_varlen_qkv_keys``).
    """
    varlen = cu_seqlens_q is not None
    paged = block_table is not None
    q_shape, k_shape, dtype, device = q.shape, k.shape, q.dtype, q.device
    fp8 = q.element_size() == 1
    dv = v.shape[-1]
    lse_at = None  # lse's byte offset in out's allocation, when it has none of its own
    if varlen:
        total_q, h, d = q_shape
        batch, longest_q = cu_seqlens_q.shape[0] - 1, max_seqlen_q
        longest_k = max_seqlen_k if paged else k_shape[0]
        if return_lse or not total_q or not batch or not h:
            out = torch.empty((*q_shape[:-1], dv), dtype=out_dtype or dtype, device=device)
            lse = torch.empty((h, total_q), dtype=torch.float32, device=device)
            if not total_q or not batch:
                return out, lse if return_lse else None
        else:
            out, lse_buf, lse_at = _launch.out_with_lse(
                (total_q, h, dv), out_dtype or dtype, h * total_q, device)
            lse = out  # a placeholder until lse's address replaces it, as below
    else:
        batch, longest_q, h, d = q_shape
        longest_k = k_shape[1]
        if return_lse or not batch or not longest_q or not h:
            out = torch.empty((*q_shape[:-1], dv), dtype=out_dtype or dtype, device=device)
            lse = torch.empty((batch, h, longest_q), dtype=torch.float32, device=device)
            if not batch or not longest_q or not h:
                return out, lse if return_lse else None
        else:
            out, lse_buf, lse_at = _launch.out_with_lse(
                (batch, longest_q, h, dv), out_dtype or dtype, batch * h * longest_q, device)
            # Placeholders and the key's alignment until lse's address replaces it:
            # out's, as aligned as lse's.
            lse = out
        if fp8:
            # Packed and paged varlen read V as it is instead: Triton transposes each
            # tile through registers (a packed sequence's keys start anywhere, so V^T
            # rows would not be aligned; a pool is shared by calls).
            v = keys_contiguous(v, FP8_V_PAD)
    # The placeholder for an absent pointer: never read (but for seqused_k without
    # cu_seqlens_k, whose key count is read from it and replaced).
    cu_q = cu_seqlens_q if varlen else q
    tensors = (q, k, v, out, lse, q if attn_mask is None else attn_mask,
               q if alibi_slopes is None else alibi_slopes, cu_q,
               cu_q if cu_seqlens_k is None else cu_seqlens_k,
               block_table if paged else cu_q, cu_q if seqused_k is None else seqused_k,
               lse if q_descale is None else q_descale,
               lse if k_descale is None else k_descale,
               lse if v_descale is None else v_descale,
               lse if philox is None else philox)
    # lse strides, token counts (packed q; packed k, the pool's reads are bounded by the
    # block table instead), longest sequences, scale, cap and dropout: _FWD_SLOTS's order.
    packed_k = varlen and not paged
    scalars = ((0, total_q) if varlen else (h * longest_q, longest_q)) + (
        total_q if varlen else 0, k_shape[0] if packed_k else 0,
        max_seqlen_q if varlen else 0, max_seqlen_k if varlen else 0, softmax_scale, softcap,
        dropout_p)
    key = None
    if _launch.ready(q):
        plain = (attn_mask is None and alibi_slopes is None and q_descale is None
                 and k_descale is None and v_descale is None and philox is None)
        if plain and lse_at is not None:
            # The usual eager forward: q, k, v, out and (varlen) the index tensors are
            # the only tensors, the other slots hold q's, cu_seqlens_q's or lse's
            # address (lse's after out's): 4 to 8 addresses, not 15 (as ``tensors``).
            pq, po = _data_ptr(q), _data_ptr(out)
            lp = po + lse_at
            if varlen:
                pc = _data_ptr(cu_q)
                index = (pc, pc if cu_seqlens_k is None else _data_ptr(cu_seqlens_k),
                         _data_ptr(block_table) if paged else pc,
                         pc if seqused_k is None else _data_ptr(seqused_k))
            else:
                index = (pq, pq, pq, pq)
            ptrs = (pq, _data_ptr(k), _data_ptr(v), po, lp, pq, pq, *index,
                    lp, lp, lp, lp)
            misaligned = ((pq | ptrs[1] | ptrs[2] | lp | index[0] | index[1] | index[2]
                           | index[3]) & 15 and _launch.misalignment(ptrs))
        else:
            ptrs = _launch.pointers(tensors)
            if lse_at is not None:  # lse's address, in its slot and the placeholders'
                lp = ptrs[3] + lse_at
                tail = tuple(lp if x is out else p for x, p in zip(tensors[11:], ptrs[11:]))
                ptrs = (*ptrs[:4], lp, *ptrs[5:11], *tail)
            misaligned = _launch.misalignment(ptrs)
        if varlen:
            qkv = _varlen_qkv_keys.get(layout)
            if qkv is None:
                # k's dtype too: a float8 pool under 16-bit q (widened in the kernel).
                qkv = (dtype, k.dtype, q_shape[1:], q.stride(),
                       k_shape[1:] if packed_k else k_shape, k.stride(), v.shape[-1],
                       v.stride())
                if layout is not None:
                    if len(_varlen_qkv_keys) >= _launch.MAX_PLANS:
                        _varlen_qkv_keys.clear()
                    _varlen_qkv_keys[layout] = qkv
        else:
            qkv = layout if layout is not None else (
                dtype, k.dtype, q_shape, q.stride(), k_shape, k.stride(), v.shape[-1],
                v.stride())
        key = ("fwd", qkv, out.dtype,
               plain or (_launch.layout(attn_mask), _launch.layout(alibi_slopes),
                         _launch.layout(q_descale), _launch.layout(k_descale),
                         _launch.layout(v_descale), philox is not None),
               diag_offset, window_left, window_right, softcap > 0, allow_tf32,
               varlen and (cu_seqlens_k is None, seqused_k is None,
                           configs.seqlen_class(max(longest_q, longest_k))),
               paged and (block_table.shape[1], block_table.stride(0)), misaligned)
        plan = _launch.lookup(key)
        if plan is not None:
            # Varlen: the grid covers the longest sequence of this call (at least one
            # block, so bad prefix sums still get their rows written as NaN).
            plan((*ptrs, *scalars),
                 ((-(-longest_q // plan.cfg.block_m) or 1) * plan.cfg.dv_parts, batch * h, 1)
                 if varlen else None)
            return out, lse if lse_at is None else None
    if lse_at is not None:  # Triton's own path takes lse as a tensor
        lse = _launch.lse_after(lse_buf, lse_at, (h, total_q) if varlen
                                else (batch, h, longest_q))
        tensors = (*tensors[:4], *(lse if x is out else x for x in tensors[4:]))
    windowed = window_right >= 0 or window_left >= 0
    mask, mask_strides, alibi, alibi_strides, flags = configs.feature_args(
        attn_mask, alibi_slopes, q, window_left=window_left, window_right=window_right,
        softcap=softcap, allow_tf32=allow_tf32, head_dim=d)
    # Tiles for the wider of the two head dims: the register tiles grow with either.
    cfg = configs.fwd_config(q, max(d, dv), causal_like=windowed,
                             seqlen=max(longest_q, longest_k),
                             products=flags["INPUT_PRECISION"])
    if fp8 and not varlen and FP8_V_PAD % cfg.block_n:
        raise ValueError(f"FP8 forward tiles: BLOCK_N must divide {FP8_V_PAD} (V's copy is "
                         f"padded to it), got {cfg}")
    # V's head dim, the accumulator's and the output's: its own tile (equal to BLOCK_D,
    # the same compiled kernel, when dv == d), a part of it past 256 columns
    # (configs.head_dim_parts: the accumulator in cfg.dv_parts programs).
    block_dv = configs.part_columns(dv, cfg.dv_parts)
    flags.update(BLOCK_DV=block_dv, EVEN_DV=block_dv * cfg.dv_parts == dv,
                 DV_PARTS=cfg.dv_parts)
    if fp8:
        for name, real in (("D", d), ("DV", dv)):
            if flags[f"BLOCK_{name}"] < configs.FP8_MIN_BLOCK_D:
                flags.update({f"BLOCK_{name}": configs.FP8_MIN_BLOCK_D,
                              f"EVEN_{name}": False})
    if varlen:
        # Packed tensors as a batch of one whose batch stride the kernel must not use.
        q4, out4, lse3 = q.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0)
        k4, v4 = (k, v) if paged else (k.unsqueeze(0), v.unsqueeze(0))
    else:
        q4, k4, v4, out4, lse3 = q, k, v, out, lse
    if paged:
        # The pool's own strides: block, row in the block, head (and v's head dim).
        strides = (*configs.strides(True, q4), *k.stride()[:3], *v.stride(),
                   *configs.strides(True, out4, lse3))
    else:
        strides = (*configs.strides(varlen, q4, k4, v4), v.stride(-1),
                   *configs.strides(varlen, out4, lse3))
    descale_strides = tuple(s for x in (q_descale, k_descale, v_descale)
                            for s in ((0, 0) if x is None else x.stride()))
    plan = configs.launch(
        _attn_fwd_kernel,
        lambda cfg: (max(1, configs.cdiv(longest_q, cfg.block_m)) * cfg.dv_parts, batch * h),
        cfg, "forward", q, d,
        *tensors[:5], mask, alibi, *tensors[7:],
        *strides, *mask_strides, *alibi_strides, *descale_strides,
        block_table.stride(0) if paged else 0, block_table.shape[1] if paged else 0,
        k.shape[0] if paged else 0,
        h, h // k4.shape[2], 0 if varlen else longest_q, 0 if varlen else longest_k,
        d, dv, *scalars[2:6], diag_offset, window_left, window_right, softmax_scale, softcap,
        dropout_p, REVERSE_M=windowed, IS_VARLEN=varlen, PAGED=paged,
        PAGE_SIZE=k.shape[1] if paged else 1, SEQUSED_K=seqused_k is not None,
        HAS_Q_DESCALE=q_descale is not None, HAS_K_DESCALE=k_descale is not None,
        HAS_V_DESCALE=v_descale is not None,
        V_KEYS_CONTIGUOUS=fp8 and not varlen, HAS_DROPOUT=philox is not None,
        slots=_FWD_SLOTS if key is not None else None, **flags,
    )
    if key is not None:
        _launch.store(key, plan)
    return out, lse if lse_at is None else None
