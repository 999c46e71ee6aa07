"""Triton helpers shared by the forward and backward kernels.

The mask geometry is written once for a tile of (rows, cols): in the forward and the dQ
pass rows are queries and cols are keys; the dK/dV pass works on the transposed tile,
rows are keys and cols queries, which is the same geometry with ``diag_offset`` negated
and the two window bounds swapped (see ``flashtile.reference.allowed_keys``).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    # Written with exp2 so the interpreter and the GPU share one formula; it saturates to
    # +-1 without NaN because 2 / (inf + 1) is 0.
    e = tl.exp2(x * (2.0 * LOG2E))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _block_range(start_r, n_rows, n_cols, diag_offset, window_left, window_right,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Column range seen by rows [r0, r0 + BLOCK_R), split for masking.

    Returns (lo, mid_lo, mid_hi, hi): columns [lo, mid_lo) and [mid_hi, hi) need the
    per-element mask, the blocks of [mid_lo, mid_hi) are visible to every row and in
    bounds, so they skip it. ``lo``, ``mid_lo`` and ``mid_hi`` are multiples of BLOCK_C.
    Integer divisions only see non-negative values: Triton truncates, Python floors.
    """
    r0 = start_r * BLOCK_R
    r_last = tl.minimum(r0 + BLOCK_R, n_rows) - 1
    lo = 0
    hi = n_cols
    mid_lo = 0
    mid_hi = (n_cols // BLOCK_C) * BLOCK_C
    if MASK_RIGHT:
        hi = tl.minimum(hi, tl.maximum(r_last + diag_offset + window_right + 1, 0))
        mid_hi = tl.minimum(
            mid_hi, (tl.maximum(r0 + diag_offset + window_right + 1, 0) // BLOCK_C) * BLOCK_C)
    if MASK_LEFT:
        lo = (tl.maximum(r0 + diag_offset - window_left, 0) // BLOCK_C) * BLOCK_C
        mid_lo = tl.cdiv(tl.maximum(r_last + diag_offset - window_left, 0), BLOCK_C) * BLOCK_C
    lo = tl.minimum(lo, hi)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _scores_log2(qk, offs_r, offs_c, n_cols, diag_offset, window_left, window_right,
                 softmax_scale, softcap, alibi_slope, p_mask, stride_mask_r, stride_mask_c,
                 m_mask_rc,
                 BOUNDARY: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                 HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr):
    """Raw q.k products (BLOCK_R, BLOCK_C) fp32 -> final scores times log2(e).

    Order as in flash-attn: scale, softcap, then ALiBi / additive mask, then the
    window, bounds and boolean masks set excluded scores to -inf.
    """
    if HAS_SOFTCAP:
        s = (softcap * LOG2E) * _tanh(qk * (softmax_scale / softcap))
    else:
        s = qk * (softmax_scale * LOG2E)
    # rel: key index minus the query's diagonal position; in the transposed tile the
    # caller passes -diag_offset, so rel flips sign, which the swapped window absorbs.
    rel = offs_c[None, :] - offs_r[:, None] - diag_offset
    if HAS_ALIBI:
        s = s - (alibi_slope * LOG2E) * tl.abs(rel).to(tl.float32)
    if HAS_MASK:
        b_mask = tl.load(p_mask + offs_r[:, None] * stride_mask_r
                         + offs_c[None, :] * stride_mask_c, mask=m_mask_rc, other=0)
        if MASK_IS_BOOL:
            s = tl.where(b_mask != 0, s, float("-inf"))
        else:
            s = s + b_mask.to(tl.float32) * LOG2E
    if BOUNDARY:
        m_valid = offs_c[None, :] < n_cols
        if MASK_RIGHT:
            m_valid = m_valid & (rel <= window_right)
        if MASK_LEFT:
            m_valid = m_valid & (rel >= -window_left)
        s = tl.where(m_valid, s, float("-inf"))
    return s


@triton.jit
def _load_tile(ptrs, offs_rows, n_rows, offs_d, head_dim,
               CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (rows, BLOCK_D) tile, zero-filling rows past n_rows and padded head dims."""
    if CHECK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=offs_rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(offs_rows[:, None] < n_rows)
                        & (offs_d[None, :] < head_dim), other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
    return x


@triton.jit
def _seq_bounds(CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset,
                IS_VARLEN: tl.constexpr):
    """(q_start, k_start, seqlen_q, seqlen_k, diag_offset) of sequence ``off_b``.

    Varlen: sequences are packed back to back and cu_seqlens holds their prefix sums;
    ``diag_offset`` is then relative to each sequence's own bottom-right corner.
    """
    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + off_b)
        seqlen_q = tl.load(CuSeqlensQ + off_b + 1) - q_start
        k_start = tl.load(CuSeqlensK + off_b)
        seqlen_k = tl.load(CuSeqlensK + off_b + 1) - k_start
        diag_offset = diag_offset + seqlen_k - seqlen_q
    else:
        q_start = 0
        k_start = 0
    return q_start, k_start, seqlen_q, seqlen_k, diag_offset


# ---- Index safety: the kernels never follow an index outside its tensor ----
# The index tensors (cu_seqlens, seqused_k, block_table, cache_seqlens, ...) are not read
# on the host by default (no device sync per call). The kernels check what they read:
# a valid index is used as is, an invalid one is replaced by a harmless one (no load or
# store leaves its tensor) and the rows it would have served come out NaN, out and lse.

PREFIX_BLOCK = tl.constexpr(128)


@triton.jit
def _prefix_sums_bad(Cu, batch, total, max_len):
    """How many entries of Cu[0 .. batch] break "prefix sums from 0 to ``total`` whose
    steps (the sequence lengths) lie in [0, max_len]" (0: valid). Every program checks
    the whole array (a few hundred bytes from L2): a wrong entry makes sequences overlap
    or leaves rows to no program, which no single sequence can see. int64, so no
    difference can wrap."""
    n_bad = 0
    for start in range(0, batch + 1, PREFIX_BLOCK):
        offs = start + tl.arange(0, PREFIX_BLOCK)
        m = offs <= batch
        cur = tl.load(Cu + offs, mask=m, other=0).to(tl.int64)
        prev = tl.load(Cu + offs - 1, mask=m & (offs > 0), other=0).to(tl.int64)
        step = cur - prev
        bad = m & (((offs == 0) & (cur != 0)) | ((offs == batch) & (cur != total))
                   | ((offs > 0) & ((step < 0) | (step > max_len))))
        n_bad += tl.sum(bad.to(tl.int32), 0)
    return n_bad


FILL_COLS = tl.constexpr(16)


@triton.jit
def _fill_nan_rows(P, stride_row, n_rows, n_cols, chunk, n_chunks,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """NaN into rows [0, n_rows) x cols [0, n_cols) of a (rows, cols) view with unit
    column stride: program ``chunk`` of ``n_chunks`` takes row blocks chunk, chunk +
    n_chunks, ..., so the grid covers every row whatever its size. Columns go by
    FILL_COLS (BLOCK_C is their padded count): a whole (rows, head_dim) tile of NaN
    raised the forward kernel's register use, in a branch that almost never runs."""
    COLS: tl.constexpr = FILL_COLS if BLOCK_C > FILL_COLS else BLOCK_C
    nan = tl.full([BLOCK_R, COLS], float("nan"), tl.float32).to(P.dtype.element_ty)
    for start in range(chunk * BLOCK_R, n_rows, n_chunks * BLOCK_R):
        offs_r = start + tl.arange(0, BLOCK_R)
        for col in tl.static_range(0, BLOCK_C, COLS):
            offs_c = col + tl.arange(0, COLS)
            tl.store(P + offs_r[:, None] * stride_row + offs_c[None, :], nan,
                     mask=(offs_r[:, None] < n_rows) & (offs_c[None, :] < n_cols))


@triton.jit
def _checked_page(page, num_blocks, softmax_scale):
    """The block-table entry of a whole key tile as the kernels use it: inside the pool
    of num_blocks as read; outside, block 0 with a NaN scale for the tile's scores (no
    extra work per score), so every row that sees one of its keys is NaN, as for a NaN
    key, and masked keys (past the sequence) still drop out. Returns (page, scale)."""
    bad = (page < 0) | (page >= num_blocks)
    return tl.where(bad, 0, page), tl.where(bad, float("nan"), softmax_scale)


@triton.jit
def _pages_bad(block_row, first, stop, num_blocks):
    """How many of the block-table entries block_row[first:stop] lie outside the pool
    of num_blocks (0: all inside)."""
    n_bad = 0
    for start in range(first, stop, PREFIX_BLOCK):
        offs = start + tl.arange(0, PREFIX_BLOCK)
        page = tl.load(block_row + offs, mask=offs < stop, other=0)
        n_bad += tl.sum(((page < 0) | (page >= num_blocks)).to(tl.int32), 0)
    return n_bad


@triton.jit
def _checked_rows(pages, num_blocks, m_rows):
    """The block-table entries of a tile's key rows (N,): inside the pool as read,
    outside block 0. Returns (pages, bad) where bad (N,) int32 marks the rows of m_rows
    whose entry was outside: the caller ORs them over its loop and makes its rows NaN
    at the end (a per-column NaN scale, as _checked_page's, cost the decode kernel 34
    registers a thread on sm_90)."""
    bad = (pages < 0) | (pages >= num_blocks)
    return tl.where(bad, 0, pages), (bad & m_rows).to(tl.int32)


# ---- Attention dropout (flash-attn 2's training semantics) ----
# P is dropped after the softmax, kept entries scaled by 1 / (1 - dropout_p); the lse is
# that of the undropped scores. One Philox-4x32-10 call draws four 32-bit words, one for
# each score of a 2x2 group: queries {i, i + 8} x keys {j, j + 8} of a (batch, head),
# i and j with bit 3 clear, at counter (j, row0 + i, offset low, offset high)
# (``_dropout_setup``, ``_dropout_keep``). The counter is the scores' place in the whole
# problem, never in a tile, so the forward and every backward kernel regenerate the same
# mask whatever their tiles (all start at multiples of 16: whole groups). A call per
# score, keeping one word, had made the mask cost several times the tensor-core work of
# q k^T at head dims 64-128 (H200: the d64 dropout forward+backward at a quarter of
# the plain one's TFLOP/s); the grouped draw makes 4x fewer calls (sm_90 PTX: 3.2x fewer
# mul.hi.u32, the first rounds' shared terms aside).
# ``flashtile.reference.Dropout`` draws the same mask in PyTorch.


@triton.jit
def _dropout_setup(Philox, off_b, off_h, nheads, seqlen_q, q_start, total_q,
                   IS_VARLEN: tl.constexpr):
    """(seed, offset, row0): Philox holds [seed, offset] (int64, drawn from PyTorch's
    generator on the device: see flashtile.interface._philox). Query i of this
    (sequence, head) takes the row counter row0 + i: dense (b * nheads + h) * seqlen_q
    + i, varlen h * total_q + packed row of i; keys count from their sequence's start
    (the row counter already tells sequences apart). Rows stay below 2**31, as q's
    element count does (MAX_OFFSET), so the counters are 32-bit: int64 tiles of one
    counter spilled 1-2 KB a thread in the d128 forward on sm_90."""
    seed = tl.load(Philox)
    offset = tl.load(Philox + 1)
    if IS_VARLEN:
        row0 = off_h * total_q + q_start
    else:
        row0 = (off_b * nheads + off_h) * seqlen_q
    return seed, offset, row0


@triton.jit
def _dropout_group_starts(start, BLOCK: tl.constexpr):
    """(BLOCK / 2,): start + the first index of each pair {i, i + 8} (bit 3 of i clear)
    of 0 .. BLOCK - 1."""
    tl.static_assert(BLOCK % 16 == 0, "dropout tiles are multiples of 16")
    a = tl.arange(0, BLOCK // 2)
    return start + (a // 8) * 16 + a % 8


@triton.jit
def _dropout_keep(seed, offset, row_start, start_n, dropout_p,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANS: tl.constexpr):
    """Which entries of the tile of queries start_m .. start_m + BLOCK_M - 1 and keys
    start_n .. start_n + BLOCK_N - 1 are kept (start_m, start_n multiples of 16;
    row_start = row0 + start_m, the first query's row counter): (BLOCK_M, BLOCK_N), or
    (BLOCK_N, BLOCK_M) when TRANS (the dK/dV kernel's transposed tile).

    One Philox call per group of queries {i, i + 8} x keys {j, j + 8} (bit 3 of i and j
    clear), counter (j, row0 + i, offset low, offset high): of its words, number
    2 * (bit 3 of the query) + (bit 3 of the key) is the element's. Those four scores
    are ones a thread holds in the tensor-core accumulator layouts (mma.sync and wgmma,
    in both orientations: row bit 3 and column bit 3 are register bits there), so the
    words go into place in registers; four neighbouring keys per call instead had the
    mask cross shared memory (sm_90: +16 KB, over the limit in the d128 forward).

    A word r is kept where r >= ceil(p * 2**32) (unsigned): probability within 2**-32
    of 1 - p, p being dropout_p as the kernel gets it (fp32, within 2**-25 of the
    caller's); all 32 bits count and no float conversion is needed."""
    q0 = _dropout_group_starts(row_start, BLOCK_M)                          # (M/2,)
    k0 = _dropout_group_starts(start_n, BLOCK_N)                            # (N/2,)
    if TRANS:
        c0 = (k0[:, None] + q0[None, :] * 0).to(tl.uint32)                  # (N/2, M/2)
        c1 = (q0[None, :] + k0[:, None] * 0).to(tl.uint32)
    else:
        c0 = (k0[None, :] + q0[:, None] * 0).to(tl.uint32)                  # (M/2, N/2)
        c1 = (q0[:, None] + k0[None, :] * 0).to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero + offset.to(tl.uint32),
                               zero + (offset >> 32).to(tl.uint32))
    # p * 2**32 and its ceil are exact in fp32 (a power-of-two scale; an integer above
    # 2**23); below 2**32 for dropout_p < 1.
    threshold = tl.math.ceil(dropout_p * 4294967296.0).to(tl.uint32)
    R: tl.constexpr = BLOCK_N if TRANS else BLOCK_M
    C: tl.constexpr = BLOCK_M if TRANS else BLOCK_N
    # Tile element (16 RI + 8 u + rr, 16 CI + 8 v + cc) takes word W(u, v) of group
    # (8 RI + rr, 8 CI + cc): W(u, v) = w[2u + v], or w[2v + u] when rows are keys.
    # join(join(W00, W01), join(W10, W11)) is [RI, rr, CI, cc, v, u]; permuted to
    # [RI, u, rr, CI, v, cc], it is the tile.
    if TRANS:
        k01, k10 = w2 >= threshold, w1 >= threshold
    else:
        k01, k10 = w1 >= threshold, w2 >= threshold
    k00, k11 = w0 >= threshold, w3 >= threshold
    SHAPE: tl.constexpr = (R // 16, 8, C // 16, 8)
    keep = tl.join(tl.join(tl.reshape(k00, SHAPE), tl.reshape(k01, SHAPE)),
                   tl.join(tl.reshape(k10, SHAPE), tl.reshape(k11, SHAPE)))
    return tl.reshape(tl.permute(keep, 0, 5, 1, 2, 4, 3), (R, C))
