"""Decoding over a KV cache: split-KV ("flash-decoding"), paged or contiguous cache.

One program owns (split of the cache length, batch entry, KV head, block of query rows).
The rows of a tile are the (query token, query head) pairs that share one KV head, so
with GQA each K/V tile is read from memory once for the whole group. When batch * KV
heads cannot fill the GPU, the cache length is split across programs (Dao et al.,
Flash-Decoding, 2023); each split writes its normalized partial output and lse, and
``flashtile.ops.combine`` merges them exactly through the lse. On Hopper its combine
kernel is a programmatic dependent launch: its programs are scheduled while the decode
programs finish and wait (griddepcontrol) for their results, which hides part of the
second launch's cost (batch 1 x 8k keys on the H200: 11.9 -> 11.4 us, NOTES.md section 9).

V's head dim may differ from K's (MLA): its own tile for V, the accumulator and the
output. A key head dim past 512 (absorbed MLA's 576 = 512 latent + 64 rope dims) is a
512 tile plus a tail tile whose scores add (FlashMLA's split: a tile padded to 1024 would
double registers and shared memory), and a V that is a view of K's first columns (the
shared latent rows) is taken from K's tiles, so the cache is read once. Past 64 query
rows (absorbed MLA's 128 heads) V's columns are split across programs (DV_PARTS): each
takes its part of K's tile as V and adds the other parts to its scores, so a 128-row
tile's accumulator fits in registers and wgmma gets 64 rows a warpgroup
(configs._wide_key_decode_config).

Key j of sequence b lives at cache position ``cache_leftpad[b] + j``; with a
``block_table`` that position is looked up page by page, so pages may lie anywhere in
the pool in any order. Page sizes and key tiles are powers of two, so without a left pad
a tile lies inside one page (one scalar page lookup per tile, rows contiguous from it, as
in the contiguous cache) or spans TILE_PAGES whole pages (one scalar lookup per page,
broadcast to its rows). A split of at most MAX_SPLIT_PAGES pages loads them all before
its loop instead, and each tile picks its pages from registers. A left pad shifts tiles
off the page boundaries: then each row of the tile looks up its own page.

Indices are checked where they are read, never on the host: a sequence whose key count
(cache_seqlens + the appended tokens) exceeds what its cache row or block-table row
holds, whose cache_leftpad is outside [0, key count] or whose cache_batch_idx is outside
the cache reads nothing and its rows are NaN (out and lse); a block-table entry outside
the pool is never followed (block 0 is read instead) and the rows that would see its
keys are NaN: exactly those when a tile lies in one page (the rule of a NaN key), every
row of the program when its pages are looked up per key row.
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from flashtile._validate import _fail, cache_capacity
from flashtile.ops import _launch, combine, configs
from flashtile.ops._common import LN2, _checked_page, _checked_rows, _scores_log2
from flashtile.ops._fp8 import _fp8_pairs_to_fp16, _fp16_rows, _load_descale, _quantize


@triton.jit
def _row_pages(block_row, start, offs_n0, max_blocks, PAGE_SIZE: tl.constexpr,
               TILE_PAGES: tl.constexpr):
    """The pool block of each key row ``start + offs_n0`` (0 past the block table).

    TILE_PAGES > 0: ``start`` is page-aligned and the rows are that many whole pages,
    so one scalar lookup per page, broadcast to its rows (a vector load of every row's
    entry measured slower on the H200, NOTES.md section 8). 0: a left pad shifts rows
    off the page boundaries, and each row looks up its own page.
    """
    if TILE_PAGES == 0:
        index = (start + offs_n0) // PAGE_SIZE
        return tl.load(block_row + index, mask=index < max_blocks, other=0)
    first = start // PAGE_SIZE
    rows = tl.zeros_like(offs_n0)
    for p in tl.static_range(TILE_PAGES):
        page = tl.load(block_row + first + p, mask=first + p < max_blocks, other=0)
        rows = tl.where(offs_n0 // PAGE_SIZE == p, page, rows)
    return rows


@triton.jit
def _tile_pages(block_row, start, max_blocks, PAGE_SIZE: tl.constexpr,
                TILE_PAGES: tl.constexpr):
    """The TILE_PAGES pool blocks of the key rows from ``start`` (page-aligned), a
    tuple of scalars (0 past the block table): _row_pages' lookups, kept apart."""
    first = start // PAGE_SIZE
    pages = ()
    for p in tl.static_range(TILE_PAGES):
        pages = pages + (tl.load(block_row + first + p, mask=first + p < max_blocks,
                                 other=0),)
    return pages


@triton.jit
def _pick(pages, index, FIRST: tl.constexpr, STEP: tl.constexpr, COUNT: tl.constexpr):
    """pages[FIRST + index * STEP] of a tuple of COUNT scalars, for a run-time index:
    a chain of selects on registers (one per candidate)."""
    page = pages[FIRST]
    for j in tl.static_range(1, (COUNT - FIRST + STEP - 1) // STEP):
        page = tl.where(index == j, pages[FIRST + j * STEP], page)
    return page


# Integers that follow the batch (the partial lse's split stride) or the cache's and the
# block table's sizes, not the model: Triton would compile one variant for 1, one for a
# multiple of 16 and one for any other value, which an eager engine met mid-serving.
# They bound index checks and scalar addresses only: the sm_90 PTX is the same with
# them marked multiples of 16 (tests/aot.py).
@triton.jit(do_not_specialize=["stride_block_table_b", "max_blocks", "stride_ls",
                               "cache_rows", "capacity"])
def _decode_kernel(
    Q, KCache, VCache, Out, Lse, BlockTable, CacheSeqlens, CacheBatchIdx, CacheLeftpad,
    Alibi, QDescale, KDescale, VDescale,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_block_table_b, max_blocks,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh,
    stride_alibi_b, stride_alibi_h,
    stride_qdesc_b, stride_qdesc_h, stride_kdesc_b, stride_kdesc_h,
    stride_vdesc_b, stride_vdesc_h,
    nheads_kv, group_size, seqlen_q, head_dim, head_dim_v, keys_per_split,
    cache_rows, capacity, new_tokens,
    window_left, window_right, softmax_scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DT: tl.constexpr, BLOCK_DV: tl.constexpr, V_IS_K: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
    TILE_PAGES: tl.constexpr, SPLIT_PAGES: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr, HAS_K_DESCALE: tl.constexpr, HAS_V_DESCALE: tl.constexpr,
    V_PAIRS: tl.constexpr, PAIRS_ASM: tl.constexpr, KEYS_M: tl.constexpr,
    DV_PARTS: tl.constexpr,
):
    # Pages looked up per key row (a vector of entries per tile), not per tile.
    ROW_PAGES: tl.constexpr = TILE_PAGES > 0 or (not PAGE_ALIGNED and SPLIT_PAGES == 0)
    # KEYS_M: rows past the split's last key read that key again, unmasked (see the
    # loop), wherever a row's page needs no lookup of its own (not with a left pad).
    CLAMPED: tl.constexpr = KEYS_M and not (PAGED and ROW_PAGES and TILE_PAGES == 0)
    # Pages smaller than the tile, looked up a tile ahead: CLAMPED keeps them as
    # scalars (_tile_pages) to give the rows past the split's end the last key's page.
    PAGE_TUPLE: tl.constexpr = CLAMPED and PAGED and ROW_PAGES and SPLIT_PAGES == 0
    split = tl.program_id(0)
    off_b = tl.program_id(1) // nheads_kv
    off_hkv = tl.program_id(1) % nheads_kv
    start_m = tl.program_id(2)
    if DV_PARTS > 1:
        # V's columns in DV_PARTS parts of BLOCK_DV, one a program: each part's programs
        # compute the same scores (configs._wide_key_decode_config says why). V is K's
        # first columns (V_IS_K), so the program's part of K is its V.
        tl.static_assert(V_IS_K and BLOCK_DV == BLOCK_D and BLOCK_DT > 0 and not KEYS_M
                         and not KCache.dtype.element_ty.is_fp8())
        part = start_m % DV_PARTS
        start_m = start_m // DV_PARTS

    # Row r of the tile is query token r // group_size of query head r % group_size.
    offs_r = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_t = offs_r // group_size
    offs_h = off_hkv * group_size + offs_r % group_size
    m_row = offs_r < seqlen_q * group_size
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if DV_PARTS > 1:
        offs_d += part * BLOCK_D  # K's tile that holds this program's V columns
    m_d = offs_d < head_dim
    # V's head dim (the accumulator's and the output's) may differ from K's: MLA.
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    m_dv = offs_dv < head_dim_v
    if BLOCK_DT > 0:
        # A key head dim past one power-of-two tile (absorbed MLA: 576 = 512 + 64) is
        # a BLOCK_D tile plus this tail tile, its scores the sum of two products, as in
        # FlashMLA: one padded 1024-wide tile would double the registers and bytes.
        offs_dt = DV_PARTS * BLOCK_D + tl.arange(0, BLOCK_DT)
        m_dt = offs_dt < head_dim

    # Keys including the new_tokens just appended; cache positions [leftpad, stop).
    stop = tl.load(CacheSeqlens + off_b) + new_tokens
    seq_bad = (stop < 0) | (stop > capacity)
    leftpad = 0
    if HAS_LEFTPAD:
        leftpad = tl.load(CacheLeftpad + off_b)
        seq_bad |= (leftpad < 0) | (leftpad > stop)
    cache_b = off_b
    if HAS_BATCH_IDX:
        cache_b = tl.load(CacheBatchIdx + off_b)
        seq_bad |= (cache_b < 0) | (cache_b >= cache_rows)
    # A bad sequence reads no key (its rows are NaN: see l_i).
    leftpad = tl.where(seq_bad, 0, leftpad)
    seqlen_k = tl.where(seq_bad, 0, stop - leftpad)
    cache_b = tl.where(seq_bad, 0, cache_b)
    diag_offset = seqlen_k - seqlen_q  # bottom-right, as flash_attn_func

    p_q = Q + off_b * stride_qb + offs_t[:, None] * stride_qm + offs_h[:, None] * stride_qh
    b_q = tl.load(p_q + offs_d[None, :], mask=m_row[:, None] & m_d[None, :],
                  other=0.0)                                                # (M, D)
    b_qt = b_q
    if BLOCK_DT > 0:
        b_qt = tl.load(p_q + offs_dt[None, :], mask=m_row[:, None] & m_dt[None, :],
                       other=0.0)                                          # (M, DT)
    if DV_PARTS > 1:
        # The other parts' tiles of q, in the order the loop adds their scores.
        b_qo = ()
        for j in tl.static_range(1, DV_PARTS):
            offs_do = ((part + j) % DV_PARTS) * BLOCK_D + tl.arange(0, BLOCK_D)
            b_qo = b_qo + (tl.load(p_q + offs_do[None, :],
                                   mask=m_row[:, None] & (offs_do < head_dim)[None, :],
                                   other=0.0),)                            # (M, D)
    # An FP8 cache is read as FP8 (half the bytes: decode is bound by them) and widened
    # in registers to fp16, exactly, whatever q's type: FP8 and fp16 q as they are, bf16
    # rows scaled into fp16 by a power of two each (_fp16_rows) that the scores' scale
    # divides out. (Widening to bf16 took two more instructions per pair of keys' values
    # on sm_90.) P is fp16 for P @ V. q_descale * k_descale joins the exp2 scale,
    # v_descale the output.
    if Q.dtype.element_ty.is_fp8() or Q.dtype.element_ty == tl.float16:
        b_q = b_q.to(tl.float16)
        b_qt = b_qt.to(tl.float16)
    elif KCache.dtype.element_ty.is_fp8():
        b_q, b_qt, row_scale = _fp16_rows(b_q, b_qt, BLOCK_DT > 0)
        softmax_scale = softmax_scale / row_scale                          # (M, 1)
    softmax_scale *= (_load_descale(QDescale, off_b, off_hkv, stride_qdesc_b,
                                    stride_qdesc_h, HAS_Q_DESCALE)
                      * _load_descale(KDescale, off_b, off_hkv, stride_kdesc_b,
                                      stride_kdesc_h, HAS_K_DESCALE))
    v_descale = _load_descale(VDescale, off_b, off_hkv, stride_vdesc_b, stride_vdesc_h,
                              HAS_V_DESCALE)
    alibi_slope = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + off_b * stride_alibi_b + offs_h * stride_alibi_h,
                              mask=m_row, other=0.0)[:, None]

    # Keys this split may need: its slice of the cache, cut to what the masks allow.
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, seqlen_k)
    if MASK_RIGHT:
        hi = tl.minimum(hi, seqlen_q - 1 + diag_offset + window_right + 1)
    if MASK_LEFT:
        lo = tl.maximum(lo, (tl.maximum(diag_offset - window_left, 0) // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # A bad sequence reads no key, and a NaN sum makes its out and lse NaN at the end
    # (a select on the output tile there made ptxas spill 8 bytes on sm_90).
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32) + tl.where(seq_bad, float("nan"), 0.0)
    bad_rows = tl.zeros([BLOCK_N], dtype=tl.int32)  # key rows behind a bad page
    if KEYS_M:
        l_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # l's parts, see below
    # V_PAIRS: V's even and odd columns accumulate apart (see the V load below).
    acc = tl.zeros([BLOCK_M, BLOCK_DV // (1 + V_PAIRS)], dtype=tl.float32)
    acc_odd = tl.zeros([BLOCK_M, BLOCK_DV // (1 + V_PAIRS)], dtype=tl.float32)
    if KEYS_M:
        # Keys on the products' M side (configs.decode_fp8_keys_m): the accumulators
        # transposed, (DV/2, M), query rows their N.
        acc = tl.zeros([BLOCK_DV // 2, BLOCK_M], dtype=tl.float32)
        acc_odd = tl.zeros([BLOCK_DV // 2, BLOCK_M], dtype=tl.float32)
    if V_PAIRS:
        # An FP8 V read as int16 words of two neighbouring columns (even, odd).
        VWords = VCache.to(tl.pointer_type(tl.int16))
        offs_w = tl.arange(0, BLOCK_DV // 2)
        m_w = offs_w < head_dim_v // 2
        if KEYS_M:
            # Word strides (even: v_pairs): a row's word address then takes 3
            # instructions in the loop, not 7 with the signed int64 halving (sm_90
            # SASS; 8 rows a thread a 128-key tile).
            stride_vb = stride_vb // 2
            stride_vn = stride_vn // 2
            stride_vh = stride_vh // 2
    # The page(s) of a tile are loaded one tile ahead: the software pipeliner does not
    # run scalar loads ahead, and a K/V address waiting on its block-table entry in the
    # same iteration stalls every tile (NOTES.md section 4). The first tile's pages are
    # masked by the block table's width, not by the sequence length, so their load does
    # not wait for cache_seqlens (entries past the sequence only address masked rows).
    # Loading pages two tiles ahead stops Triton's software pipelining altogether
    # (NOTES.md section 8).
    block_row = BlockTable + off_b * stride_block_table_b
    page = 0
    if SPLIT_PAGES > 0:
        # A short split's pages, loaded as scalars before the loop: each tile then picks
        # its own with selects on registers, so no K/V address waits on a block-table
        # load inside the loop and the pipeliner issues copies tiles ahead as for the
        # contiguous cache. (A page per row gathered through shared memory cost as much
        # as the loads it replaced, NOTES.md section 12.)
        # SPLIT_PAGES is the span rounded up to a power of two (split_plan), so entries
        # past the split's last page are never picked: masked, not loaded. The mask uses
        # keys_per_split, not the sequence length, so these loads need no cache_seqlens.
        split_lo = split * keys_per_split
        first_page = split_lo // PAGE_SIZE
        last_page = tl.minimum((split_lo + keys_per_split - 1) // PAGE_SIZE, max_blocks - 1)
        split_pages = ()
        for j in tl.static_range(SPLIT_PAGES):
            split_pages = split_pages + (tl.load(block_row + first_page + j,
                                                 mask=first_page + j <= last_page, other=0),)
    elif PAGE_ALIGNED:
        page = tl.load(block_row + lo // PAGE_SIZE, mask=lo // PAGE_SIZE < max_blocks,
                       other=0)
    elif PAGE_TUPLE:
        page = _tile_pages(block_row, lo, max_blocks, PAGE_SIZE, TILE_PAGES)
    elif PAGED:
        page = _row_pages(block_row, leftpad + lo, offs_n0, max_blocks, PAGE_SIZE,
                          TILE_PAGES)
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        m_n = offs_n < hi
        pos = leftpad + offs_n                                             # cache position
        offs_nc = offs_n0
        pos_c = pos
        if CLAMPED:
            # Rows past the split's last key read that key again instead of being
            # masked: their scores are -inf (_scores_log2) and their P 0, and a key of
            # the sequence holds no NaN that the sequence does not already see in this
            # tile. The copies then need no mask (a compare and two selects fewer
            # each, sm_90 SASS).
            offs_nc = tl.minimum(offs_n, hi - 1) - start_n
            pos_c = leftpad + start_n + offs_nc
        # Pages outside the pool: block 0 and NaN scores (_checked_page).
        scale = softmax_scale
        if SPLIT_PAGES > 0:
            if TILE_PAGES > 0:
                # Pages smaller than the tile: the split starts on a page boundary.
                tile = (start_n - split_lo) // BLOCK_N
                last = (hi - 1 - start_n) // PAGE_SIZE  # the page of the last key
                rows = tl.zeros_like(offs_n0)
                for p in tl.static_range(TILE_PAGES):
                    picked = _pick(split_pages, tile, p, TILE_PAGES, SPLIT_PAGES)
                    if CLAMPED and p > 0:
                        # Past the last key's page, rows re-read that key: its page.
                        picked = tl.where(p <= last, picked, page)
                    page = picked
                    rows = tl.where(offs_n0 // PAGE_SIZE == p, page, rows)
                rows, bad = _checked_rows(rows, cache_rows, m_n)
                bad_rows |= bad
                row_k = rows.to(tl.int64) * stride_kb + (pos_c % PAGE_SIZE) * stride_kn
                row_v = rows.to(tl.int64) * stride_vb + (pos_c % PAGE_SIZE) * stride_vn
            else:
                page = _pick(split_pages, start_n // PAGE_SIZE - first_page, 0, 1,
                             SPLIT_PAGES)
                page, scale = _checked_page(page, cache_rows, softmax_scale)
                in_page = start_n % PAGE_SIZE + offs_nc
                row_k = page.to(tl.int64) * stride_kb + in_page * stride_kn
                row_v = page.to(tl.int64) * stride_vb + in_page * stride_vn
        elif PAGE_ALIGNED:
            # The tile starts at a multiple of BLOCK_N, which divides PAGE_SIZE: one page.
            in_page = start_n % PAGE_SIZE + offs_nc
            page, scale = _checked_page(page, cache_rows, softmax_scale)
            row_k = page.to(tl.int64) * stride_kb + in_page * stride_kn
            row_v = page.to(tl.int64) * stride_vb + in_page * stride_vn
            next_n = start_n + BLOCK_N
            page = tl.load(block_row + next_n // PAGE_SIZE, mask=next_n < hi, other=0)
        elif PAGE_TUPLE:
            # No left pad: the tile starts on a page boundary. Pages past the one of
            # the split's last key hold only rows that re-read that key: its page.
            last = (hi - 1 - start_n) // PAGE_SIZE
            rows = tl.zeros_like(offs_n0)
            kept = page[0]
            for p in tl.static_range(TILE_PAGES):
                kept = tl.where(p <= last, page[p], kept)
                rows = tl.where(offs_n0 // PAGE_SIZE == p, kept, rows)
            rows, bad = _checked_rows(rows, cache_rows, m_n)
            bad_rows |= bad
            row_k = rows.to(tl.int64) * stride_kb + (pos_c % PAGE_SIZE) * stride_kn
            row_v = rows.to(tl.int64) * stride_vb + (pos_c % PAGE_SIZE) * stride_vn
            page = _tile_pages(block_row, start_n + BLOCK_N, max_blocks, PAGE_SIZE,
                               TILE_PAGES)
        elif PAGED:
            page, bad = _checked_rows(page, cache_rows, m_n)
            bad_rows |= bad
            row_k = page.to(tl.int64) * stride_kb + (pos % PAGE_SIZE) * stride_kn
            row_v = page.to(tl.int64) * stride_vb + (pos % PAGE_SIZE) * stride_vn
            page = _row_pages(block_row, leftpad + start_n + BLOCK_N, offs_n0, max_blocks,
                              PAGE_SIZE, TILE_PAGES)
        else:
            row_k = cache_b.to(tl.int64) * stride_kb + pos_c * stride_kn
            row_v = cache_b.to(tl.int64) * stride_vb + pos_c * stride_vn
        p_k = KCache + row_k[:, None] + off_hkv * stride_kh
        # Key rows past the split read nothing (or, CLAMPED, its last key again).
        m_k = (m_n | CLAMPED)[:, None] & m_d[None, :]
        if KEYS_M and EVEN_D:
            # Every column is in the head dim: the key rows alone mask the copies (a
            # select and a compare fewer per 16-byte copy, sm_90 SASS).
            m_k = (m_n | CLAMPED)[:, None]
        b_k = tl.load(p_k + offs_d[None, :], mask=m_k, other=0.0).to(b_q.dtype)  # (N, D)
        if KEYS_M:
            qk = tl.dot(b_k, tl.trans(b_q), input_precision=INPUT_PRECISION)  # (N, M)
        else:
            qk = tl.dot(b_q, tl.trans(b_k), input_precision=INPUT_PRECISION)  # (M, N)
        if DV_PARTS > 1:
            for j in tl.static_range(1, DV_PARTS):
                offs_do = ((part + j) % DV_PARTS) * BLOCK_D + tl.arange(0, BLOCK_D)
                b_ko = tl.load(p_k + offs_do[None, :],
                               mask=m_n[:, None] & (offs_do < head_dim)[None, :],
                               other=0.0).to(b_q.dtype)                    # (N, D)
                qk = tl.dot(b_qo[j - 1], tl.trans(b_ko), qk,
                            input_precision=INPUT_PRECISION)
        if BLOCK_DT > 0:
            b_kt = tl.load(p_k + offs_dt[None, :], mask=m_n[:, None] & m_dt[None, :],
                           other=0.0).to(b_q.dtype)                        # (N, DT)
            if KEYS_M:
                qk = tl.dot(b_kt, tl.trans(b_qt), qk, input_precision=INPUT_PRECISION)
            else:
                qk = tl.dot(b_qt, tl.trans(b_kt), qk, input_precision=INPUT_PRECISION)
        if KEYS_M:
            qk = tl.trans(qk)  # (M, N): a relabelling of registers, no data moves
        s = _scores_log2(qk, offs_t, offs_n, hi, diag_offset, window_left, window_right,
                         scale, softcap, alibi_slope, Q, 0, 0, m_row[:, None],
                         True, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, False, False)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        if KEYS_M:
            # Each thread keeps its own parts of the rows' sums, rescaled as the
            # accumulators are, and sums them once after the loop: no sum across the
            # warps (shuffles, shared memory, two barriers) per tile. Still the fp32
            # sum of the unrounded P, in another order.
            l_acc = l_acc * alpha[:, None] + p
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        if V_PAIRS:
            # An FP8 V tile is the B operand of P @ V with the keys (its rows, a cache
            # row apart) the reduction: one byte per key and column is all that
            # Triton's FP8 layout gives a thread. Read as 16-bit words, the tile is
            # copied into the operand layout as a bf16 V is (ldmatrix), each word is
            # two columns of one key, and the even and odd columns go to two products.
            if KEYS_M:
                # O^T = V^T P^T: V's words the A operand (their columns its M), P^T
                # the B operand, so the query rows are the product's N (8 a step, not
                # 16): half the products and half the accumulator of M = rows.
                # Loaded as V^T: a transpose of the loaded tile in registers would
                # leave the words in a layout whose neighbours are not two keys.
                m_vt = (m_n | CLAMPED)[None, :]
                if not EVEN_DV:
                    m_vt = m_w[:, None] & m_vt
                b_wt = tl.load(VWords + row_v[None, :] + off_hkv * stride_vh
                               + offs_w[:, None], mask=m_vt, other=0)      # (DV/2, N)
                b_ve, b_vo = _fp8_pairs_to_fp16(b_wt, VCache.dtype.element_ty, PAIRS_ASM)
                p16 = tl.trans(p.to(tl.float16))                           # (N, M)
                acc = tl.dot(b_ve, p16, acc * alpha[None, :],
                             input_precision=INPUT_PRECISION)              # (DV/2, M)
                acc_odd = tl.dot(b_vo, p16, acc_odd * alpha[None, :],
                                 input_precision=INPUT_PRECISION)
            else:
                b_w = tl.load(VWords + (row_v[:, None] + off_hkv * stride_vh) // 2
                              + offs_w[None, :], mask=m_n[:, None] & m_w[None, :],
                              other=0)                                     # (N, DV/2)
                b_ve, b_vo = _fp8_pairs_to_fp16(b_w, VCache.dtype.element_ty, PAIRS_ASM)
                p16 = p.to(tl.float16)
                acc = tl.dot(p16, b_ve, acc * alpha[:, None],
                             input_precision=INPUT_PRECISION)
                acc_odd = tl.dot(p16, b_vo, acc_odd * alpha[:, None],
                                 input_precision=INPUT_PRECISION)
        else:
            if V_IS_K:
                # V is a view of K's first columns (absorbed MLA's shared latent rows):
                # the K tile already holds them, so the cache is read once.
                b_v = b_k                                                  # (N, DV)
            else:
                b_v = tl.load(VCache + row_v[:, None] + off_hkv * stride_vh
                              + offs_dv[None, :], mask=m_n[:, None] & m_dv[None, :],
                              other=0.0).to(b_q.dtype)                     # (N, DV)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new

    if KEYS_M:
        l_i += tl.sum(l_acc, 1)  # l_i: 0, or NaN for a sequence that reads nothing
        acc = tl.trans(acc)                                                # (M, DV/2)
        acc_odd = tl.trans(acc_odd)
    if V_PAIRS:
        acc = tl.reshape(tl.join(acc, acc_odd), (BLOCK_M, BLOCK_DV))        # (M, DV)
    if LAUNCH_DEPENDENTS:
        # The combine's programs may be scheduled now; they wait for this grid to end.
        gdc_launch_dependents()
    if PAGED and ROW_PAGES:
        # A bad page among the key rows makes every row NaN (a NaN sum).
        l_i = tl.where(tl.max(bad_rows, 0) > 0, float("nan"), l_i)
    # As in the forward kernel: empty rows (and empty splits) are (0, -inf) whatever
    # their key block held; a NaN that reached a row stays NaN in out and lse.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    if HAS_V_DESCALE:
        out *= v_descale  # linear: split partials scaled alike combine unchanged
    # Out/Lse are either the final (b, sq, h, d)/(b, h, sq) tensors (stride_os = 0) or
    # the fp32 per-split partials that combine._combine_kernel merges.
    m_lse = m_row
    if DV_PARTS > 1:
        # One part stores lse. The parts add the score tiles in different orders, so
        # their sums may differ in the last bits of fp32.
        m_lse &= part == 0
    tl.store(Lse + split * stride_ls + off_b * stride_lb + offs_h * stride_lh + offs_t,
             lse, mask=m_lse)
    p_o = (Out + split * stride_os + off_b * stride_ob + offs_t[:, None] * stride_om
           + offs_h[:, None] * stride_oh + offs_dv[None, :])
    tl.store(p_o, out.to(Out.dtype.element_ty), mask=m_row[:, None] & m_dv[None, :])


# Splits spanning at most this many pages (a power of two) load their page list before
# the K/V loop (SPLIT_PAGES); longer ones look pages up a tile ahead inside it.
MAX_SPLIT_PAGES = 16


def num_splits_heuristic(work_items: int, max_seqlen_k: int, block_n: int,
                         num_sms: int, per_sm: int = 2) -> int:
    """Split the cache length into as many splits as keep every SM at per_sm programs
    (configs.decode_programs_per_sm) or fewer, at least two key blocks per split (a
    split's fixed cost is its q load and store). Rounding the split count up instead
    left some SMs with a third program of a memory-bound grid: H200, 8 x 8k keys, 5
    splits 3731 GB/s, 4 splits 3972 (NOTES.md section 9)."""
    if work_items >= num_sms:
        return 1
    max_splits = max(1, configs.cdiv(max_seqlen_k, 2 * block_n))
    return max(1, min(per_sm * num_sms // work_items, max_splits, 128))


def split_plan(work_items: int, capacity: int, block_n: int, page_size: int,
               num_splits: int, num_sms: int, leftpad: bool,
               per_sm: int = 2) -> tuple[int, int, int]:
    """(splits, keys per split, SPLIT_PAGES) of a decode launch of work_items programs
    per split over caches of capacity keys in block_n-key tiles; page_size 0: a
    contiguous cache; num_splits 0: num_splits_heuristic's; leftpad: a cache_leftpad is
    given (its tiles look pages up per key row, never a page list); per_sm: as
    num_splits_heuristic's.

    SPLIT_PAGES, the length of a short split's page list, is the pages a split spans
    rounded up to a power of two from 2 to MAX_SPLIT_PAGES: it follows the longest
    cache and the batch (through the split count), and each value is a compiled
    variant, which an eager engine compiled mid-serving (120-144 ms decode steps,
    H200). The kernel masks the entries past the split, so the rounding costs at most
    a few selects per tile on registers, never a key or a block-table load. Not 1: a
    list of one page spilled where two did not (sm_90 AOT, fp32 d128: 584 bytes a
    thread), and is one variant fewer. Keys per split
    stay a multiple of the tile, not of the page: whole pages per split would cut the
    split count for short caches with large pages (1 x 8 heads x 4k keys, 256-key
    pages: 16 splits instead of 32), and would not bound the span."""
    if num_splits <= 0:
        num_splits = num_splits_heuristic(work_items, capacity, block_n, num_sms, per_sm)
    keys_per_split = configs.cdiv(configs.cdiv(max(capacity, 1), num_splits),
                                 block_n) * block_n
    num_splits = max(1, configs.cdiv(capacity, keys_per_split))
    split_pages = 0
    if page_size and num_splits > 1 and not leftpad:
        # One page more when pages are larger than the tile and a split starts inside one.
        spanned = configs.cdiv(keys_per_split, page_size) + int(
            keys_per_split % page_size != 0)
        if spanned <= MAX_SPLIT_PAGES:
            split_pages = max(2, configs.next_power_of_2(spanned))
    return num_splits, keys_per_split, split_pages


@functools.lru_cache(maxsize=None)
def _gpu_traits(device: torch.device) -> tuple[int, int]:
    """(compute capability major, SM count): asked on every split decode call."""
    props = torch.cuda.get_device_properties(device)
    return props.major, props.multi_processor_count


def _num_sms(q) -> int:
    return _gpu_traits(q.device)[1] if q.is_cuda else 1


def v_pairs(v_cache, v_is_k) -> bool:
    """The decode kernel reads an FP8 V as int16 words of two columns (V_PAIRS): a V of
    its own (not K's tiles) whose head dim, row strides and address are even, the head
    dim past 16 (each half a product at least 16 wide, as tl.dot asks in general)."""
    return (v_cache.element_size() == 1 and not v_is_k and v_cache.shape[-1] % 2 == 0
            and v_cache.shape[-1] > 16
            and all(s % 2 == 0 for s in v_cache.stride()[:3])
            and v_cache.data_ptr() % 2 == 0)


def pairs_asm(q) -> bool:
    """V_PAIRS widens its words with sm_90's paired FP8 -> fp16 cvt (PTX, NVIDIA Hopper
    and later); elsewhere, and in the interpreter, with Triton's own conversion."""
    return q.is_cuda and torch.version.hip is None and _gpu_traits(q.device)[0] >= 9


def _v_is_k(k_cache, v_cache) -> bool:
    """V is read from K's tiles: the same rows (a view of K's first dv columns) and a V
    tile as wide as K's first."""
    return (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.dtype == k_cache.dtype
            and v_cache.stride() == k_cache.stride()
            and configs.padded_head_dim(v_cache.shape[-1])
            == configs.decode_head_dim_tiles(k_cache.shape[-1])[0])


def keys_m(q, k_cache, v_cache, v_is_k) -> bool:
    """The decode kernel puts keys on its products' M side (KEYS_M): asked for
    (configs.decode_fp8_keys_m), an FP8 V read as column pairs, and at most
    configs.DECODE_FP8_KEYS_M_ROWS query rows per KV head."""
    rows = q.shape[1] * (q.shape[2] // k_cache.shape[2])
    return (configs.decode_fp8_keys_m() and rows <= configs.DECODE_FP8_KEYS_M_ROWS
            and v_pairs(v_cache, v_is_k))


def _row_programs(q, hkv, cfg) -> int:
    """Programs of a decode per split, batch entry and KV head: the blocks of query rows
    times V's column parts (cfg.dv_parts)."""
    return configs.cdiv(q.shape[1] * (q.shape[2] // hkv), cfg.block_m) * cfg.dv_parts


def _check_dv_parts(cfg, head_dim, v_is_k, k_cache) -> None:
    """V's columns split across programs (dv_parts > 1, FLASHTILE_DECODE_CONFIG's fifth
    value) only where the kernel takes them: V read from K's tiles of a key past
    DECODE_MAX_BLOCK_D, a 16-bit or fp32 cache (an FP8 one scales q's rows as a whole),
    parts of a power of two of at least 16 columns."""
    parts = cfg.dv_parts
    if parts == 1:
        return
    if not (v_is_k and head_dim > configs.DECODE_MAX_BLOCK_D
            and k_cache.element_size() > 1):
        _fail(ValueError, "decode tile dv_parts", "1 unless v_cache is k_cache's first "
              "columns, head_dim is past 512 (absorbed MLA) and the cache is not FP8",
              f"{parts} ({cfg}, head_dim {head_dim}, v_cache "
              f"{'a view of k_cache' if v_is_k else 'its own'}, {k_cache.dtype})")
    if parts < 1 or parts & (parts - 1) or configs.DECODE_MAX_BLOCK_D // parts < 16:
        _fail(ValueError, "decode tile dv_parts",
              f"a power of two from 1 to {configs.DECODE_MAX_BLOCK_D // 16}", parts)


def _tile(q, k_cache, v_cache, v_is_k, split=True) -> configs.TileConfig:
    """The decode tile of q (b, sq, h, d) over the caches: the query rows of one KV head
    (GQA packing), K's and V's head dims."""
    sq, h, d = q.shape[1:]
    return configs.decode_config(q, d, sq * (h // k_cache.shape[2]), split=split,
                                 fp8_cache=k_cache.element_size() == 1,
                                 head_dim_v=v_cache.shape[-1], v_is_k=v_is_k,
                                 keys_m=keys_m(q, k_cache, v_cache, v_is_k))


def paged_decode_warm_shapes(q, k_cache, v_cache, batch_sizes,
                             widths) -> list[tuple[int, int]]:
    """(batch, block-table width) pairs whose paged decodes compile, between them, every
    decode and combine variant that decodes of queries like q (b, sq, h, d; any b) over
    this pool (num_blocks, page_size, hkv, d) meet at the given batch sizes and widths,
    without a left pad and with the heuristic's split count. The variants differ there
    in splitting or not, SPLIT_PAGES and the combine's BLOCK_S: the integers that follow
    the batch and the width are not specialised on (_decode_kernel). An engine that
    decodes eagerly runs these before serving, so that no decode step compiles."""
    hkv, page_size = k_cache.shape[2], k_cache.shape[1]
    cfg = _tile(q, k_cache, v_cache, _v_is_k(k_cache, v_cache))
    rows = _row_programs(q, hkv, cfg) * hkv
    per_sm = configs.decode_programs_per_sm(q.shape[-1], cfg)
    shapes, seen = [], set()
    for b in batch_sizes:
        for width in widths:
            splits, _, split_pages = split_plan(b * rows, width * page_size, cfg.block_n,
                                                page_size, 0, _num_sms(q), False, per_sm)
            variants = {("decode", splits > 1, split_pages)}
            if splits > 1:
                variants.add(("combine", configs.next_power_of_2(splits)))
            if not variants <= seen:
                seen |= variants
                shapes.append((b, width))
    return shapes


# The kernel parameters a call of a decode plan fills, in this order (``_launch``).
_DECODE_SLOTS = ("Q", "KCache", "VCache", "Out", "Lse", "BlockTable", "CacheSeqlens",
                 "CacheBatchIdx", "CacheLeftpad", "Alibi", "QDescale", "KDescale",
                 "VDescale", "softmax_scale", "softcap")


def _f32_words(n: int) -> int:
    """n float32 elements rounded up to a multiple of 4: what follows them in a shared
    allocation starts 16-byte aligned, as a tensor of its own would (Triton compiles
    aligned and unaligned pointers apart, and a plan's key assumes aligned outputs)."""
    return -(-n // 4) * 4


def _outputs(q, dv, out_dtype, num_splits, return_lse):
    """out, lse (None unless return_lse), the allocation holding lse and the byte
    offsets in it of lse, the partial outputs (num_splits, b, sq, h, dv) and the partial
    lse (num_splits, b, h, sq) (0 unsplit), in as few allocations as the outputs allow:
    each is 6-10 us of host time on the H200, the price of a kernel launch.

    - split: one allocation (``out_with_lse``): out, then float32 words for lse, the
      partial outputs and the partial lse, each 16-byte aligned. out and a returned lse
      are contiguous views of it (either keeps the scratch alive while it is kept);
    - unsplit without lse: one allocation, out then lse's words (``out_with_lse``);
    - unsplit with lse: out and lse, each its own.
    Every piece belongs to this call alone: nothing is shared between calls, streams
    or CUDA graphs."""
    b, sq, h, _ = q.shape
    n_out, n_lse, device = b * sq * h * dv, b * h * sq, q.device
    shape = (b, sq, h, dv)
    if num_splits > 1:
        partials_at = 4 * _f32_words(n_lse)  # after lse's words, from lse_at
        partials_lse_at = partials_at + 4 * _f32_words(num_splits * n_out)
        out, buf, lse_at = _launch.out_with_lse(
            shape, out_dtype, partials_lse_at // 4 + num_splits * n_lse, device)
        lse = _launch.lse_after(buf, lse_at, (b, h, sq)) if return_lse else None
        return (out, lse, buf, lse_at, lse_at + partials_at,
                lse_at + partials_lse_at)
    if return_lse:
        out = torch.empty(shape, dtype=out_dtype, device=device)
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=device)
        return out, lse, lse, 0, 0, 0
    out, buf, lse_at = _launch.out_with_lse(shape, out_dtype, n_lse, device)
    return out, None, buf, lse_at, 0, 0


def _output_tensors(q, dv, num_splits, out, lse, buf, lse_at, dst_at, dst_lse_at):
    """_outputs' pieces as the tensors Triton's own path takes (the first launch of a
    variant): lse, and the partial outputs and partial lse when split."""
    b, sq, h, _ = q.shape
    if lse is None:
        lse = _launch.lse_after(buf, lse_at, (b, h, sq))
    if num_splits == 1:
        return lse, None, None
    n_out = num_splits * b * sq * h * dv
    words = buf.view(torch.float32)
    dst = words[dst_at // 4:dst_at // 4 + n_out].view(num_splits, b, sq, h, dv)
    dst_lse = words[dst_lse_at // 4:dst_lse_at // 4 + num_splits * b * h * sq]
    return lse, dst, dst_lse.view(num_splits, b, h, sq)


def _plan_key(q, k_cache, v_cache, block_table, cache_batch_idx, cache_leftpad,
              alibi_slopes, descales, scaled, window_left, window_right, softcap,
              num_splits, allow_tf32, new_tokens, out_dtype, v_is_k, layout, addresses):
    """attn_decode's launch-plan key (``layout``: its argument, None to build it here)."""
    if layout is None:
        paged = block_table is not None
        layout = (q.dtype, k_cache.dtype, q.shape, q.stride(), k_cache.shape,
                  k_cache.stride(), v_cache.shape[-1], v_cache.stride(),
                  paged and (block_table.shape, block_table.stride(0)),
                  cache_batch_idx is None, cache_leftpad is None, new_tokens)
    # out and lse are left out of the alignment: _outputs aligns them.
    return ("decode", layout, out_dtype, v_is_k, _launch.layout(alibi_slopes),
            scaled and tuple(_launch.layout(x) for x in descales),
            window_left, window_right, softcap > 0, num_splits, allow_tf32,
            _launch.misalignment(addresses))


# A contiguous cache that grows between calls (transformers' DynamicCache concatenates
# each step's keys, so every decode step sees a new capacity and new batch and head
# strides) would miss its plans on every step: a launch through Triton and a new plan,
# twice a step in transformers' generate (~38 us a layer on this CPU's harness, where
# Triton's own launch costs nothing). Its plans are found again instead from the last
# ones made for the same layout up to those integers (the "family"), whose recorded
# arguments take the call's strides, capacity and keys per split (``_find_plans``).
_GROWING = ("stride_kb", "stride_kn", "stride_kh", "stride_vb", "stride_vn", "stride_vh",
            "keys_per_split", "capacity")


def _family(key, q, k_cache, v_cache, cache_batch_idx, cache_leftpad, new_tokens):
    """The key of a contiguous-cache call's plans up to the capacity and the cache
    strides (each kept as what Triton compiles on, ``_launch.spec_class``)."""
    spec = _launch.spec_class
    layout = (q.dtype, k_cache.dtype, q.shape, q.stride(), k_cache.shape[0],
              k_cache.shape[2:], tuple(map(spec, k_cache.stride())), v_cache.shape[0],
              v_cache.shape[2:], tuple(map(spec, v_cache.stride())),
              cache_batch_idx is None, cache_leftpad is None, new_tokens)
    # key[1], the exact layout (or the caller's id for it), is replaced; the rest holds.
    return ("decode family", layout, *key[2:])


def _split_args(q, k_cache, v_cache, v_is_k):
    """split_plan's arguments for a contiguous-cache call but the capacity, num_splits
    and leftpad (attn_decode's): (work items, keys a tile, SMs, programs an SM)."""
    cfg = _tile(q, k_cache, v_cache, v_is_k)
    hkv = k_cache.shape[2]
    return (q.shape[0] * hkv * _row_programs(q, hkv, cfg), cfg.block_n, _num_sms(q),
            configs.decode_programs_per_sm(q.shape[-1], cfg))


def _store(key, plans, splits, q, k_cache, v_cache, block_table, cache_batch_idx,
           cache_leftpad, new_tokens):
    """``_launch.store``, and for a contiguous cache also as its family's plans, with
    the split count they launch, split_plan's other arguments and the positions of the
    arguments a relocation replaces (``_find_plans``)."""
    _launch.store(key, plans)
    if block_table is None and all(x is not None for x in plans):
        names = _decode_kernel.arg_names
        _launch.store(_family(key, q, k_cache, v_cache, cache_batch_idx, cache_leftpad,
                              new_tokens),
                      (plans, splits, _split_args(q, k_cache, v_cache, key[3]),
                       tuple(names.index(n) for n in _GROWING)))


def _find_plans(key, q, k_cache, v_cache, block_table, cache_batch_idx, cache_leftpad,
                new_tokens, num_splits):
    """The plans stored under ``key``; else, for a contiguous cache, its family's with
    the recorded strides, capacity and keys per split replaced by this call's, where
    the call launches the same split count (then stored under ``key``); else None (a
    launch through Triton makes them)."""
    plans = _launch.lookup(key)
    if plans is not None or block_table is not None:
        return plans
    found = _launch.lookup(_family(key, q, k_cache, v_cache, cache_batch_idx,
                                   cache_leftpad, new_tokens))
    if found is None:
        return None
    family, splits, (work, block_n, num_sms, per_sm), at = found
    capacity = k_cache.shape[1]
    again, keys_per_split, _ = split_plan(work, capacity, block_n, 0, num_splits, num_sms,
                                          cache_leftpad is not None, per_sm)
    if again != splits:
        return None
    decode = family[-2 if splits > 1 else 0].with_args(dict(zip(at, (
        *k_cache.stride()[:3], *v_cache.stride()[:3], keys_per_split, capacity))))
    plans = (splits, decode, family[2]) if splits > 1 else (decode,)
    _launch.store(key, plans)
    return plans


def _run_plans(plans, q, dv, out_dtype, return_lse, p, scale_ptrs, softmax_scale,
               softcap):
    """(out, lse) of a call whose plans were found: the outputs allocated (``_outputs``),
    the decode kernel launched on the addresses ``p`` of attn_decode's inputs and the
    descales' ``scale_ptrs`` (() when none is given), then the combine when split."""
    split = len(plans) == 3
    out, lse, buf, lse_at, dst_at, dst_lse_at = _outputs(
        q, dv, out_dtype, plans[0] if split else 1, return_lse)
    o, base = out.data_ptr(), buf.data_ptr()
    lse_ptr = base + lse_at
    scales = tuple(lse_ptr if x == 0 else x for x in scale_ptrs) if scale_ptrs \
        else (lse_ptr, lse_ptr, lse_ptr)
    if not split:  # the kernel writes out and lse itself
        plans[0]((*p[:3], o, lse_ptr, *p[3:], *scales, softmax_scale, softcap))
        return out, lse
    dst, dst_lse = base + dst_at, base + dst_lse_at
    plans[1]((*p[:3], dst, dst_lse, *p[3:], *scales, softmax_scale, softcap))
    plans[2]((dst, dst_lse, o, lse_ptr))
    return out, lse


def _plain_pointers(q, k_cache, v_cache, cache_seqlens, cache_leftpad) -> tuple:
    """The addresses of attn_decode's inputs for a call without block table, batch
    index, alibi or descales: cache_seqlens and q stand for the absent ones (never
    read), as in attn_decode."""
    return _launch.pointers((q, k_cache, v_cache, cache_seqlens, cache_seqlens,
                             cache_seqlens,
                             cache_seqlens if cache_leftpad is None else cache_leftpad, q))


class Bound:
    """attn_decode's plan path bound to one key, for eager callers that repeat a call
    signature many times in a row (transformers' layers in a decode step: the same
    shapes, strides, dtypes, options and stream): ``bound(q, k_cache, v_cache,
    cache_seqlens, cache_leftpad)`` returns out, or None when the call's addresses are
    aligned otherwise than the bound key's or another CUDA device is current (then
    attn_decode decides). The caller guarantees the rest of the key: everything
    attn_decode's key reads but the addresses (``bind``'s docstring)."""

    __slots__ = ("plans", "device", "misaligned", "shared", "dv", "out_dtype",
                 "softmax_scale", "softcap")

    def __init__(self, plans, device, misaligned, shared, dv, out_dtype, softmax_scale,
                 softcap):
        self.plans, self.device, self.misaligned = plans, device, misaligned
        # Whether K and V had one address (V read from K's tiles is part of the key).
        self.shared, self.dv, self.out_dtype = shared, dv, out_dtype
        self.softmax_scale, self.softcap = softmax_scale, softcap

    def __call__(self, q, k_cache, v_cache, cache_seqlens, cache_leftpad):
        p = _plain_pointers(q, k_cache, v_cache, cache_seqlens, cache_leftpad)
        if (_launch.misalignment(p) != self.misaligned or (p[1] == p[2]) != self.shared
                or _launch._device() != self.device):
            return None
        return _run_plans(self.plans, q, self.dv, self.out_dtype, False, p, (),
                          self.softmax_scale, self.softcap)[0]


def bind(q, k_cache, v_cache, *, cache_seqlens, cache_leftpad, softmax_scale,
         window_left, window_right, softcap) -> Bound | None:
    """A ``Bound`` for calls like ``attn_decode(q, k_cache, v_cache,
    cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, block_table=None,
    cache_batch_idx=None, alibi_slopes=None, softmax_scale=softmax_scale,
    window_left=window_left, window_right=window_right, softcap=softcap, num_splits=0,
    allow_tf32=False, return_lse=False)`` just made, whose plans it finds: None where
    there are none (the interpreter, the Gluon MLA kernel's route, a Triton without
    plans). Its calls must have the same shapes, strides, dtypes and devices as this one
    (q, k_cache, v_cache and cache_leftpad's), the same options, and run on the same
    stream, eagerly and outside a CUDA graph capture: what the key holds and a bound
    call does not read again."""
    if not _launch.ready(q) or (q.shape[-1] > configs.DECODE_MAX_BLOCK_D and q.is_cuda):
        return None
    p = _plain_pointers(q, k_cache, v_cache, cache_seqlens, cache_leftpad)
    v_is_k = p[1] == p[2] and _v_is_k(k_cache, v_cache)
    key = _plan_key(q, k_cache, v_cache, None, None, cache_leftpad, None, (None,) * 3,
                    False, window_left, window_right, softcap, 0, False, 0, q.dtype,
                    v_is_k, None, p)
    plans = _find_plans(key, q, k_cache, v_cache, None, None, cache_leftpad, 0, 0)
    if plans is None:
        return None
    return Bound(plans, _launch._device(), key[-1], p[1] == p[2], v_cache.shape[-1],
                 q.dtype, softmax_scale, softcap)


def attn_decode(q, k_cache, v_cache, *, cache_seqlens, block_table, cache_batch_idx,
                cache_leftpad, alibi_slopes, softmax_scale, window_left, window_right,
                softcap, num_splits, allow_tf32, new_tokens=0, q_descale=None,
                k_descale=None, v_descale=None, out_dtype=None, return_lse=True,
                layout=None):
    """Launch the decode kernel (and the combine kernel when split). Shapes, dtypes and
    devices validated by the caller; index values are checked by the kernel.

    q (b, sq, h, d); k_cache (b_cache, max_seqlen, hkv, d), or with block_table
    (num_blocks, page_size, hkv, d); v_cache likewise with its own head dim dv (MLA),
    possibly a view of k_cache's first dv columns (then read from K's tiles); d up to
    512, or 576 (a 512 tile plus a tail); every index tensor int32 with unit stride;
    cache_seqlens (b,) plus new_tokens counts the keys to attend (new_tokens: those
    just appended). Returns out (b, sq, h, dv) and lse (b, h, sq) fp32, or None in
    lse's place with return_lse=False (then lse takes no allocation of its own).
    out and lse are contiguous; either may be a view of a larger allocation of this
    call (``_outputs``).
    FP8: the caches in a float8 dtype with 16-bit q, or q too in the caches' dtype;
    q_descale (FP8 q), k_descale and v_descale (FP8 caches) None (1.0) or fp32
    (b, hkv) with any strides; out in out_dtype (default q's dtype).
    layout: None, or an id the caller gives to one combination of the dtypes, shapes,
    strides and devices of q, k_cache, v_cache, block_table, cache_batch_idx and
    cache_leftpad and of new_tokens, and to no other (``_validate.once_per_layout``'s):
    the plan key holds it in their place (fewer values to read and hash per call).
    """
    b, sq, h, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    out_dtype = out_dtype or q.dtype
    if not b * sq * h * dv:
        out, lse = _outputs(q, dv, out_dtype, 1, True)[:2]
        return out, lse if return_lse else None
    paged = block_table is not None
    descales = (q_descale, k_descale, v_descale)
    if d > configs.DECODE_MAX_BLOCK_D and q.is_cuda and configs.decode_mla_kernel(
            b, cache_capacity(k_cache, block_table)) == "gluon":
        # The Gluon kernel for the absorbed MLA shape where it applies and wins
        # (configs.decode_mla_kernel).
        from flashtile.ops import decode_mla_hopper
        if decode_mla_hopper.unsupported(
                q, k_cache, v_cache, v_is_k=_v_is_k(k_cache, v_cache),
                block_table=block_table, cache_batch_idx=cache_batch_idx,
                cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes,
                window_left=window_left, window_right=window_right, softcap=softcap,
                descales=descales) is None:
            return decode_mla_hopper.attn_decode(
                q, k_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                softmax_scale=softmax_scale, causal=window_right == 0,
                num_splits=num_splits, new_tokens=new_tokens, out_dtype=out_dtype,
                return_lse=return_lse)
    scaled = q_descale is not None or k_descale is not None or v_descale is not None
    # The kernel's tensors but out and lse (allocated once the split count is known):
    # absent index tensors get cache_seqlens as a never-read placeholder, alibi q, a
    # descale lse (at launch).
    inputs = (q, k_cache, v_cache, block_table if paged else cache_seqlens, cache_seqlens,
              cache_seqlens if cache_batch_idx is None else cache_batch_idx,
              cache_seqlens if cache_leftpad is None else cache_leftpad,
              q if alibi_slopes is None else alibi_slopes)
    key = None
    if _launch.ready(q):
        p = _launch.pointers(inputs)
        scale_ptrs = tuple(0 if x is None else x.data_ptr() for x in descales) \
            if scaled else ()
        v_is_k = p[1] == p[2] and _v_is_k(k_cache, v_cache)
        key = _plan_key(q, k_cache, v_cache, block_table, cache_batch_idx, cache_leftpad,
                        alibi_slopes, descales, scaled, window_left, window_right, softcap,
                        num_splits, allow_tf32, new_tokens, out_dtype, v_is_k, layout,
                        p + scale_ptrs)
        plans = _find_plans(key, q, k_cache, v_cache, block_table, cache_batch_idx,
                            cache_leftpad, new_tokens, num_splits)
        if plans is not None:
            return _run_plans(plans, q, dv, out_dtype, return_lse, p, scale_ptrs,
                              softmax_scale, softcap)
    else:
        v_is_k = _v_is_k(k_cache, v_cache)
    group = h // hkv
    capacity = cache_capacity(k_cache, block_table)
    cfg = _tile(q, k_cache, v_cache, v_is_k)
    _check_dv_parts(cfg, d, v_is_k, k_cache)
    m_blocks = _row_programs(q, hkv, cfg)
    # Page sizes are powers of two (validated), so a constexpr page size makes the
    # per-row lookup shifts and masks; one variant per page size in use.
    page_size = k_cache.shape[1] if paged else 1
    num_splits, keys_per_split, split_pages = split_plan(
        b * hkv * m_blocks, capacity, cfg.block_n, page_size if paged else 0, num_splits,
        _num_sms(q), cache_leftpad is not None, configs.decode_programs_per_sm(d, cfg))
    out, lse, *pieces = _outputs(q, dv, out_dtype, num_splits, return_lse)
    lse_t, dst, dst_lse = _output_tensors(q, dv, num_splits, out, lse, *pieces)
    if num_splits == 1:
        # The tile does not depend on the split; the pipeline depth does.
        cfg = _tile(q, k_cache, v_cache, v_is_k, split=False)
        dst, dst_lse = out, lse_t
        dst_strides = (0, *out.stride()[:3])
        dst_lse_strides = (0, *lse_t.stride()[:2])
    else:
        dst_strides = dst.stride()[:4]
        dst_lse_strides = dst_lse.stride()[:3]
    _, _, alibi, alibi_strides, flags = configs.feature_args(
        None, alibi_slopes, q, window_left=window_left, window_right=window_right,
        softcap=softcap, allow_tf32=allow_tf32, head_dim=d)
    flags.pop("HAS_MASK")
    flags.pop("MASK_IS_BOOL")
    block_d, block_dt = configs.decode_head_dim_tiles(d)
    block_dv = configs.padded_head_dim(dv)
    # dv_parts > 1: K's first tile in parts of V's columns, one of them each program's V.
    parts = cfg.dv_parts
    flags.update(BLOCK_D=block_d // parts, BLOCK_DT=block_dt, EVEN_D=block_d + block_dt == d,
                 BLOCK_DV=block_dv // parts, EVEN_DV=block_dv == dv, V_IS_K=v_is_k,
                 DV_PARTS=parts)
    page_aligned = paged and page_size % cfg.block_n == 0 and cache_leftpad is None
    # Pages smaller than the tile: whole pages per tile unless a left pad (0: per row).
    tile_pages = (cfg.block_n // page_size
                  if paged and not page_aligned and cache_leftpad is None else 0)
    pdl, early = combine.combine_pdl(q) if num_splits > 1 else (False, False)
    switches = dict(
        flags, PAGED=paged, PAGE_SIZE=page_size, PAGE_ALIGNED=page_aligned,
        TILE_PAGES=tile_pages, SPLIT_PAGES=split_pages,
        HAS_BATCH_IDX=cache_batch_idx is not None, HAS_LEFTPAD=cache_leftpad is not None,
        LAUNCH_DEPENDENTS=early, HAS_Q_DESCALE=q_descale is not None,
        HAS_K_DESCALE=k_descale is not None, HAS_V_DESCALE=v_descale is not None,
        V_PAIRS=v_pairs(v_cache, v_is_k), PAIRS_ASM=pairs_asm(q),
        KEYS_M=keys_m(q, k_cache, v_cache, v_is_k))
    configs.log_first_launch("decode", q, d, cfg, dict(
        switches, PAGE_SIZE=page_size if paged else None, SPLIT=num_splits > 1, PDL=pdl))
    decode = _launch.first_launch(
        _decode_kernel, (num_splits, b * hkv, m_blocks),
        (*inputs[:3], dst, dst_lse, *inputs[3:],
         *(lse_t if x is None else x for x in descales),
         q.stride(0), q.stride(1), q.stride(2),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
         block_table.stride(0) if paged else 0, block_table.shape[1] if paged else 0,
         *dst_strides, *dst_lse_strides, *alibi_strides,
         *(s for x in descales for s in ((0, 0) if x is None else x.stride())),
         hkv, group, sq, d, dv, keys_per_split, k_cache.shape[0], capacity, new_tokens,
         window_left, window_right, softmax_scale, softcap),
        dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
             num_stages=cfg.num_stages, **switches),
        _DECODE_SLOTS if key is not None else None)
    if num_splits == 1:
        if key is not None:
            _store(key, (decode,), 1, q, k_cache, v_cache, block_table,
                   cache_batch_idx, cache_leftpad, new_tokens)
        return out, lse
    merge = combine.launch_combine(q, dv, num_splits, dst, dst_lse, out, lse_t, pdl,
                                   key is not None)
    if key is not None:
        _store(key, (num_splits, decode, merge), num_splits, q, k_cache, v_cache,
               block_table, cache_batch_idx, cache_leftpad, new_tokens)
    return out, lse


@triton.jit
def _append_kernel(KNew, VNew, KCache, VCache, CacheSeqlens, BlockTable, CacheBatchIdx,
                   KDescale, VDescale,
                   stride_nb, stride_nn, stride_nh, stride_vnb, stride_vnn, stride_vnh,
                   stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                   stride_block_table_b, stride_kdesc_b, stride_kdesc_h, stride_vdesc_b,
                   stride_vdesc_h, cache_rows, capacity, new_tokens, nheads_kv,
                   head_dim, head_dim_v,
                   BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   PAGED: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
                   HAS_K_DESCALE: tl.constexpr, HAS_V_DESCALE: tl.constexpr):
    """Write k (b, new_tokens, hkv, d) and v (..., dv) into the cache at positions
    cache_seqlens[b] + t, t < new_tokens (through the block table when PAGED). A
    sequence whose new tokens do not fit its row (cache_seqlens outside [0, capacity -
    new_tokens]) or whose cache_batch_idx is outside the cache writes nothing, and a
    token whose block-table entry is outside the pool is not written: the decode
    kernel then makes the rows that would have seen them NaN (same checks), never a
    read of stale keys.
    16-bit k/v into an FP8 cache are quantised on the way: k / k_descale[b, h], rounded
    to nearest even and saturated (flashtile.fp8.quantize, bit for bit)."""
    QUANTIZE: tl.constexpr = (KCache.dtype.element_ty.is_fp8()
                              and not KNew.dtype.element_ty.is_fp8())
    off_b = tl.program_id(1) // nheads_kv
    off_h = tl.program_id(1) % nheads_kv
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    start = tl.load(CacheSeqlens + off_b)
    ok = (start >= 0) & (start <= capacity - new_tokens)
    cache_b = off_b
    if HAS_BATCH_IDX:
        cache_b = tl.load(CacheBatchIdx + off_b)
        ok &= (cache_b >= 0) & (cache_b < cache_rows)
    m_t = (offs_t < new_tokens) & ok                                        # (T,)
    pos = start + offs_t
    if PAGED:
        page = tl.load(BlockTable + off_b * stride_block_table_b + pos // PAGE_SIZE,
                       mask=m_t, other=0)
        m_t &= (page >= 0) & (page < cache_rows)
        row_k = page.to(tl.int64) * stride_kb + (pos % PAGE_SIZE) * stride_kn
        row_v = page.to(tl.int64) * stride_vb + (pos % PAGE_SIZE) * stride_vn
    else:
        row_k = cache_b.to(tl.int64) * stride_kb + pos.to(tl.int64) * stride_kn
        row_v = cache_b.to(tl.int64) * stride_vb + pos.to(tl.int64) * stride_vn
    m_new = offs_t[:, None] < new_tokens
    m_d, m_dv = offs_d[None, :] < head_dim, offs_dv[None, :] < head_dim_v
    b_k = tl.load(KNew + off_b * stride_nb + offs_t[:, None] * stride_nn + off_h * stride_nh
                  + offs_d[None, :], mask=m_new & m_d, other=0.0)           # (T, D)
    b_v = tl.load(VNew + off_b * stride_vnb + offs_t[:, None] * stride_vnn
                  + off_h * stride_vnh + offs_dv[None, :], mask=m_new & m_dv,
                  other=0.0)                                                # (T, DV)
    if QUANTIZE:
        b_k = _quantize(b_k, _load_descale(KDescale, off_b, off_h, stride_kdesc_b,
                                           stride_kdesc_h, HAS_K_DESCALE),
                        KCache.dtype.element_ty)
        b_v = _quantize(b_v, _load_descale(VDescale, off_b, off_h, stride_vdesc_b,
                                           stride_vdesc_h, HAS_V_DESCALE),
                        VCache.dtype.element_ty)
    tl.store(KCache + row_k[:, None] + off_h * stride_kh + offs_d[None, :], b_k,
             mask=m_t[:, None] & m_d)
    tl.store(VCache + row_v[:, None] + off_h * stride_vh + offs_dv[None, :], b_v,
             mask=m_t[:, None] & m_dv)


_APPEND_SLOTS = ("KNew", "VNew", "KCache", "VCache", "CacheSeqlens", "BlockTable",
                 "CacheBatchIdx", "KDescale", "VDescale")


def append_kv(k, v, k_cache, v_cache, *, cache_seqlens, block_table, cache_batch_idx,
              k_descale=None, v_descale=None, layout=None):
    """Write k (b, n, hkv, d) and v (b, n, hkv, dv) into the caches in place at
    positions cache_seqlens[b] ... (``_append_kernel``); one launch, no host read of
    the indices. 16-bit k/v into
    FP8 caches are quantised with k_descale/v_descale (None: 1.0; fp32 (b, hkv)).
    layout: None, or an id of the layouts of k, v, k_cache, v_cache, block_table and
    cache_batch_idx, as attn_decode's."""
    b, n, hkv, d = k.shape
    dv = v.shape[-1]
    if not k.numel():
        return
    paged = block_table is not None
    descales = tuple(cache_seqlens if x is None else x for x in (k_descale, v_descale))
    tensors = (k, v, k_cache, v_cache, cache_seqlens,
               block_table if paged else cache_seqlens,
               cache_seqlens if cache_batch_idx is None else cache_batch_idx, *descales)
    key = None
    if _launch.ready(k):
        p = _launch.pointers(tensors)
        if layout is None:
            layout = (k.dtype, k_cache.dtype, k.shape, k.stride(), dv, v.stride(),
                      k_cache.shape, k_cache.stride(), v_cache.stride(),
                      paged and (block_table.shape, block_table.stride(0)),
                      cache_batch_idx is None)
        key = ("append", layout, _launch.layout(k_descale), _launch.layout(v_descale),
               _launch.misalignment(p))
        plan = _launch.lookup(key)
        if plan is not None:
            plan(p)
            return
    capacity = cache_capacity(k_cache, block_table)
    block_d, block_dv = configs.padded_head_dim(d), configs.padded_head_dim(dv)
    block_t = min(configs.append_block_t(max(block_d, block_dv)), configs.next_power_of_2(n))
    plan = _launch.first_launch(
        _append_kernel, (configs.cdiv(n, block_t), b * hkv),
        (*tensors, *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3],
         *v_cache.stride()[:3], block_table.stride(0) if paged else 0,
         *(s for x in (k_descale, v_descale) for s in ((0, 0) if x is None else x.stride())),
         k_cache.shape[0], capacity, n, hkv, d, dv),
        dict(BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_DV=block_dv, PAGED=paged,
             PAGE_SIZE=k_cache.shape[1] if paged else 1,
             HAS_BATCH_IDX=cache_batch_idx is not None,
             HAS_K_DESCALE=k_descale is not None, HAS_V_DESCALE=v_descale is not None),
        _APPEND_SLOTS if key is not None else None)
    if key is not None:
        _launch.store(key, plan)
