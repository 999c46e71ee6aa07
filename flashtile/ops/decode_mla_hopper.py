"""Absorbed MLA decode for Hopper (sm_90) in Gluon: scores computed once per key tile.

DeepSeek's absorbed decode (q/k head dim 576 = 512 latent + 64 rope, V the latent 512
columns of the same cache rows, every query head on one KV head) is bound by its
products at 64+ heads: 2 x heads x (576 + 512) flops per 1152-byte key. The portable
kernel (``flashtile.ops.decode``) runs at ~30% of the tensor-core rate there (H200,
issue 17, 128 heads, b=64 x 8k: 633 us, 230 TFLOP/s). Its sm_90 SASS shows why:
- the K tile's copies for tile i+1 are issued at the end of iteration i and waited for
  at the top of i+1 (``DEPBAR.LE SB0, 0x0``): Q (128 x 576, 144 KiB) and two 36 KiB K
  stages fill shared memory, so the pipeline is two stages deep and only the P V
  products of a tile run under the next tile's load latency;
- Q K^T is three dots (V's part, the other part, the rope tail), each drained
  (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) before the next is issued, and both warpgroups
  run the softmax at the same time (bar.sync every tile), so nothing runs on the
  tensor cores meanwhile;
- Triton puts every warp of a dot chained into another along M, so the scores are
  computed twice: by both warpgroups of the 64-row tile, or by both V-column programs
  of the 128-row tile (dv_parts 2): 1.53x the useful products.

This kernel takes FlashMLA's division of the work (DeepSeek, 2025): a program owns 64
query rows (heads) of one sequence and a split of its keys, with three partitions:
- a producer warp streams the key tiles (512 latent + 64 rope columns, two TMA boxes)
  through a ring of STAGES buffers, page by page through the block table;
- two consumer warpgroups each own half of O (64 x 256 fp32, 128 registers a thread)
  and take the key tiles in turn: warpgroup j % 2 computes S_j = Q K_j^T once (all 576
  columns, one chain of wgmma), its online softmax, and hands P_j (bf16) and the new
  row maximum to the other through shared memory; both then add P_j V_j to their half
  of O (V_j: K_j's first 512 columns, already in shared memory). A warpgroup issues
  S_j and P_{j-1} V_{j-1} back to back once P_{j-1} has arrived, and runs the softmax
  of S_j while both warpgroups' P_{j-1} V_{j-1} keep the tensor cores busy; the tile's
  time is then its products' (S bound by shared memory, see PREDICTION), as long as
  the softmax and the hand-over take less than the two P V.
  Each warpgroup sums the rows of its own tiles' P (rescaled by every tile's alpha);
  the two sums are added once at the end.
Shared memory at BLOCK_N 32: Q 72 KiB, 36 KiB a stage, P 2 x 4 KiB: 4 stages 225 KiB.

Keys past the sequence inside the last tile read whatever the page holds: their scores
are masked to -inf, and the owner of that tile zeroes their V rows in shared memory
before P V (0 x NaN would be NaN). A block-table entry outside the pool is not
followed (block 0 is read) and the tile's scores are NaN, so every row that sees its
keys is NaN, as in the portable kernel; a sequence whose key count is outside its
cache reads nothing and its rows are NaN.

Outputs are those of the portable kernel: unsplit, out (b, sq, h, 512) and lse; split,
the fp32 partials its ``_combine_kernel`` merges. Calls it does not take (FP8, a V of
its own, pages smaller than the tile, a left pad, cache_batch_idx, ALiBi, softcap, a
window other than causal, fewer than 33 query rows per KV head) go to the portable
kernel (``unsupported``). Gluon kernels do not run in the Triton interpreter: CI
compiles this one for sm_90 (tests/test_gluon_compile.py); tests/test_mla_cache.py
checks it on a GPU. The default from batch x capacity 32k keys (FLASHTILE_DECODE_MLA=auto;
=gluon or =triton force one kernel; configs.decode_mla_kernel).

PREDICTION (session 15, before any GPU run; H200 at ~1.75 GHz): a 32-key tile is 1376
cycles of tensor-core work per program (S: 36 m64n32k16, bound by their 3 KiB reads of
shared memory at 128 B a cycle, 864; P V: four m64n256k16, 512), the chain through the
softmax (S_t, softmax, hand-over: ~1300) fits under it: ~1500 cycles a tile. 128 heads,
b=64 x 8k (128 programs of 256 tiles): ~220 us if nothing else binds, but both row
blocks of a sequence read its K (5.4 TB/s out of L2 at that pace): 250-350 us, 420-585
TFLOP/s, against 633 us for the portable kernel; 3 stages the same or up to 10% slower.
b=32 x 4k (2 splits): 65-90 us (175); b=1 x 8k (64 splits of 4 tiles, 17 MB of fp32
partials for the combine): 14-22 us of GPU time (30), where the host's ~30-40 us a call
may show instead; b=1 x 32k: 22-30 us (61). 64 heads, b=64 x 8k (2 splits): 115-170 us,
430-640 TFLOP/s (356 us).
MEASURED (H200, session 25, bench.decode beside the portable kernel, its GPU tests and
memcheck clean; NOTES.md section 35): 128 heads b=64 x 8k 344 us (425 TFLOP/s, 1.83x),
b=32 x 4k 102 (1.72x), b=1 x 32k 44.7 (1.37x), b=1 x 8k 32.1 (0.95x: the split's fp32
partials and the combine, not the tiles); 64 heads b=64 x 8k 194 us (377 TFLOP/s,
1.76x), b=32 x 4k 64.4 (1.53x), b=1 x 32k 38.0 (1.03x), b=1 x 8k 31.1 (0.77x). The b=64
rows are within the prediction; 3 stages ran level with 4.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile._validate import cache_capacity
from flashtile.ops import _launch, combine, configs
from flashtile.ops._common import LN2, LOG2E

# Query rows of a program: one warpgroup's wgmma M, shared by both consumers.
BLOCK_M = gl.constexpr(64)
# The absorbed cache's columns: the latent (V, and the first 512 of K) and the rope tail.
LATENT = gl.constexpr(configs.DECODE_MAX_BLOCK_D)
ROPE = gl.constexpr(64)
# O's columns per consumer warpgroup: 64 x 256 fp32 is 128 registers a thread.
DV_HALF = gl.constexpr(LATENT.value // 2)
# warp_specialize's register requests (setmaxnreg), as in fwd_hopper: 24 for the
# producer, 240 a consumer thread (O 128, S 16 at BLOCK_N 32, P, addresses, softmax).
PRODUCER_REGS = gl.constexpr(24)
CONSUMER_REGS = gl.constexpr(240)


@gluon.jit
def _split_keys(CacheSeqlens, off_b, split, keys_per_split, new_tokens, capacity,
                BLOCK_N: gl.constexpr):
    """(lo, hi, n_tiles, seqlen_k, seq_bad) of this program's split: keys [lo, hi) in
    n_tiles tiles of BLOCK_N from lo; a sequence whose key count is outside its cache
    (seq_bad) reads none, as in the portable kernel."""
    stop = gl.load(CacheSeqlens + off_b) + new_tokens
    seq_bad = (stop < 0) | (stop > capacity)
    seqlen_k = gl.where(seq_bad, 0, stop)
    lo = split * keys_per_split
    hi = gl.minimum(lo + keys_per_split, seqlen_k)
    n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    return lo, hi, n_tiles, seqlen_k, seq_bad


@gluon.jit
def _program(CacheSeqlens, keys_per_split, new_tokens, capacity, BLOCK_N: gl.constexpr):
    """(split, batch entry, first query row, lo, hi, n_tiles, seqlen_k, seq_bad) of this
    program (``_split_keys``)."""
    split = gl.program_id(0)
    off_b = gl.program_id(1)
    lo, hi, n_tiles, seqlen_k, seq_bad = _split_keys(CacheSeqlens, off_b, split,
                                                     keys_per_split, new_tokens, capacity,
                                                     BLOCK_N)
    return split, off_b, gl.program_id(2) * BLOCK_M, lo, hi, n_tiles, seqlen_k, seq_bad


@gluon.jit
def _tile_page(block_row, start_n, max_blocks, PAGE_SIZE: gl.constexpr):
    """The block-table entry of the tile at key start_n (0 past the table's width)."""
    index = start_n // PAGE_SIZE
    return gl.load(block_row + index, mask=index < max_blocks, other=0)


@gluon.jit
def _load_partition(q_lat_desc, q_rope_desc, k_lat_desc, k_rope_desc, q_lat, q_rope,
                    k_lat, k_rope, q_ready, k_ready, k_empty, BlockTable, CacheSeqlens,
                    stride_block_table_b, max_blocks, cache_rows, keys_per_split,
                    new_tokens, capacity, PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Producer warp: Q's 64 rows once, then the split's key tiles into the ring, each
    as its latent and rope boxes on one "ready" barrier. A tile lies in one page
    (PAGE_SIZE % BLOCK_N == 0): one block-table entry, read before the wait for the
    tile's buffer so that its latency hides there."""
    BLOCK_N: gl.constexpr = k_lat_desc.block_type.shape[1]
    STAGES: gl.constexpr = k_lat.type.shape[0]
    split, off_b, row0, lo, hi, n_tiles, seqlen_k, seq_bad = _program(
        CacheSeqlens, keys_per_split, new_tokens, capacity, BLOCK_N)
    mbarrier.expect(q_ready.index(0),
                    q_lat_desc.block_type.nbytes + q_rope_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_lat_desc, [off_b, row0, 0], q_ready.index(0),
                                    q_lat.index(0))
    tma.async_copy_global_to_shared(q_rope_desc, [off_b, row0, LATENT], q_ready.index(0),
                                    q_rope.index(0))
    block_row = BlockTable + off_b * stride_block_table_b
    tile_bytes: gl.constexpr = k_lat_desc.block_type.nbytes + k_rope_desc.block_type.nbytes
    for j in range(n_tiles):
        start_n = lo + j * BLOCK_N
        if PAGED:
            page = _tile_page(block_row, start_n, max_blocks, PAGE_SIZE)
            # Outside the pool: block 0 (the consumers make the tile's scores NaN).
            block = gl.where((page < 0) | (page >= cache_rows), 0, page)
            row = start_n % PAGE_SIZE
        else:
            block = off_b
            row = start_n
        stage = j % STAGES
        # A fresh mbarrier counts as having completed the phase before its first, so
        # the first pass through the ring waits for nothing.
        mbarrier.wait(k_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), tile_bytes)
        tma.async_copy_global_to_shared(k_lat_desc, [block, row, 0, 0], k_ready.index(stage),
                                        k_lat.index(stage))
        tma.async_copy_global_to_shared(k_rope_desc, [block, row, 0, LATENT],
                                        k_ready.index(stage), k_rope.index(stage))


@gluon.jit
def _v_half(k_lat, stage, WG: gl.constexpr):
    """This warpgroup's V columns of the tile in ``stage``: (BLOCK_N, 256) of K's latent
    rows, the B operand of P V with V's columns (its N) contiguous."""
    BLOCK_N: gl.constexpr = k_lat.type.shape[2]
    return k_lat.index(stage).reshape([BLOCK_N, LATENT]).slice(WG * DV_HALF, DV_HALF, dim=1)


@gluon.jit
def _zero_rows_past(k_lat, stage, n_valid):
    """Zero the latent (V) rows n_valid.. of the tile in ``stage``: keys past the
    sequence, whose P is 0 but whose cache rows may hold anything (0 x NaN is NaN).
    Generic-proxy stores: the caller fences before wgmma reads them."""
    BLOCK_N: gl.constexpr = k_lat.type.shape[2]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    tile = k_lat.index(stage).reshape([BLOCK_N, LATENT])
    keep = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout)) < n_valid, 1)
    for c in gl.static_range(LATENT // 64):
        part = tile.slice(c * 64, 64, dim=1)  # one 128-byte swizzle column of the tile
        x = part.load(layout)
        part.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _other_scale(x, acc, m_i, l_i, m_smem, p_ready, row_layout: gl.constexpr,
                 o_row_layout: gl.constexpr):
    """Tile x, the other warpgroup's: wait for its P and row maximum, and move O
    (complete: no product in flight on it) and this warpgroup's row sums to that
    maximum. Returns (O, m_x, l)."""
    buf = x % 2  # tile x's P buffer: its owner's (x % 2 == the other warpgroup)
    mbarrier.wait(p_ready.index(buf), (x // 2) & 1)
    m_new = m_smem.index(buf).load(row_layout)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_sub)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row_layout), 1)
    return acc, m_new, l_i * alpha


@gluon.jit
def _own_tile(t, acc, m_i, l_i, q_lat, q_rope, k_lat, k_rope, p_smem, m_smem, k_ready,
              k_empty, p_ready, p_empty, block_row, max_blocks, cache_rows, lo, hi,
              seqlen_k, offs_t, diag_offset, qk_scale, s_init,
              row_layout: gl.constexpr, col_layout: gl.constexpr,
              o_row_layout: gl.constexpr, WG: gl.constexpr, FIRST: gl.constexpr,
              IS_CAUSAL: gl.constexpr, PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Tile t, this warpgroup's (t % 2 == WG): (not FIRST) O moved to the maximum of the
    other warpgroup's tile t - 1 (``_other_scale``); S_t = Q K_t^T and P_{t-1} V_{t-1}
    issued back to back; the softmax of S_t while P_{t-1} V_{t-1} runs; P_t and the new
    maximum handed over; O moved to it and P_t V_t done."""
    STAGES: gl.constexpr = k_lat.type.shape[0]
    BLOCK_N: gl.constexpr = k_lat.type.shape[2]
    stage = t % STAGES
    start_n = lo + t * BLOCK_N
    scale = qk_scale
    if PAGED:
        # A block-table entry outside the pool: the producer read block 0; NaN scores.
        page = _tile_page(block_row, start_n, max_blocks, PAGE_SIZE)
        scale = gl.where((page < 0) | (page >= cache_rows), float("nan"), qk_scale)
    mbarrier.wait(k_ready.index(stage), (t // STAGES) & 1)
    if start_n + BLOCK_N > seqlen_k:  # the sequence's last, partial tile: once a split
        # Before S_t (its scores of those keys are masked anyway), with no product in
        # flight: here, not after S_t, it spills nothing (sm_90, 240 registers).
        _zero_rows_past(k_lat, stage, seqlen_k - start_n)
        fence_async_shared()  # the generic-proxy writes before wgmma reads them
        gl.thread_barrier()  # every thread of the warpgroup has written
    if not FIRST:
        # The other warpgroup's tile t - 1 first: its P V goes in behind S_t. (Waiting
        # for its P with S_t already in flight made ptxas wait for S_t before O's
        # rescale: a warpgroup.wait it injects (C7517) when wgmma registers are read
        # after the wait's spin loop, sm_90 SASS.)
        acc, m_i, l_i = _other_scale(t - 1, acc, m_i, l_i, m_smem, p_ready, row_layout,
                                     o_row_layout)
    k_t = k_lat.index(stage).reshape([BLOCK_N, LATENT]).permute((1, 0))
    kr_t = k_rope.index(stage).reshape([BLOCK_N, ROPE]).permute((1, 0))
    # Q's operands through an index that is 0 but not known to be: each of the 36
    # steps of S has its own descriptor of Q, and as loop invariants they were all kept
    # in registers across the loop (72 of them), where ptxas then spilled (sm_90).
    z = t >> 30
    q_t = q_lat.index(z).reshape([BLOCK_M, LATENT])
    qr_t = q_rope.index(z).reshape([BLOCK_M, ROPE])
    s = warpgroup_mma(q_t, k_t, s_init, use_acc=False, is_async=True)
    s = warpgroup_mma(qr_t, kr_t, s, is_async=True)
    if FIRST:
        s = warpgroup_mma_wait(0, deps=(s,))
    else:
        acc = warpgroup_mma(p_smem.index(1 - WG), _v_half(k_lat, (t - 1) % STAGES, WG),
                            acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))  # S_t done; P_{t-1} V_{t-1} may run on

    s = s * scale
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=col_layout)
    keep = gl.expand_dims(offs_n < hi, 0)
    if IS_CAUSAL:
        keep = keep & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_t, 1) + diag_offset)
    s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # A row that has seen no key keeps m = -inf; subtract 0 then, never -inf - -inf.
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - gl.expand_dims(m_sub, 1))
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    # Hand P_t and m_t over. The buffer held P_{t-2}: wait until the other warpgroup's
    # P_{t-2} V_{t-2} is done (this one's finished before S_t's wait returned).
    mbarrier.wait(p_empty.index(WG), ((t // 2) & 1) ^ 1)
    p_smem.index(WG).store(p.to(p_smem.dtype))
    m_smem.index(WG).store(m_new)
    fence_async_shared()  # P's generic-proxy writes before wgmma reads them
    gl.thread_barrier()  # every thread of the warpgroup has written
    mbarrier.arrive(p_ready.index(WG))

    if not FIRST:  # P_{t-1} V_{t-1} done: tile t-1's buffers go back
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(k_empty.index((t - 1) % STAGES))
        mbarrier.arrive(p_empty.index(1 - WG))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row_layout), 1)
    acc = warpgroup_mma(p_smem.index(WG), _v_half(k_lat, stage, WG), acc, is_async=True)
    # Waited for here, not under the next tile's S: a product in flight across the
    # loop's back edge has its accumulator copied there, and ptxas then serializes
    # every wgmma of the kernel (C7514, sm_90 SASS: a wait after each one).
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(k_empty.index(stage))
    return acc, m_new, l_i


@gluon.jit
def _mma_partition(args, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, PAGED: gl.constexpr,
                   PAGE_SIZE: gl.constexpr):
    """Consumer warpgroup WG: the tiles t % 2 == WG of the split in full, the others'
    P V on its half of O (columns 256 * WG ...), then out and lse. ``args``: the
    kernel's shared buffers, barriers and arguments both consumers take."""
    (q_lat, q_rope, k_lat, k_rope, p_smem, m_smem, l_smem, q_ready, k_ready, k_empty,
     p_ready, p_empty, l_ready, Out, Lse, BlockTable, CacheSeqlens, stride_os, stride_ob,
     stride_om, stride_oh, stride_ls, stride_lb, stride_lh, stride_block_table_b,
     max_blocks, cache_rows, nheads, seqlen_q, keys_per_split, new_tokens, capacity,
     softmax_scale) = args
    STAGES: gl.constexpr = k_lat.type.shape[0]
    BLOCK_N: gl.constexpr = k_lat.type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV_HALF, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    split, off_b, row0, lo, hi, n_tiles, seqlen_k, seq_bad = _program(
        CacheSeqlens, keys_per_split, new_tokens, capacity, BLOCK_N)
    diag_offset = seqlen_k - seqlen_q  # bottom-right, as flash_attn_func
    # Row r is query token r // nheads of head r % nheads (one KV head).
    offs_r = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
    offs_t = offs_r // nheads
    qk_scale = softmax_scale * LOG2E
    block_row = BlockTable + off_b * stride_block_table_b

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    # A bad sequence reads no key; a NaN sum makes its out and lse NaN at the end.
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout) + gl.where(seq_bad, float("nan"), 0.0)
    acc = gl.zeros([BLOCK_M, DV_HALF], gl.float32, o_layout)
    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # ignored: use_acc=False
    mbarrier.wait(q_ready.index(0), 0)

    # This warpgroup's tiles: WG, WG + 2, ... < n_tiles. Warpgroup 0's first has no
    # tile before it.
    n_own = gl.cdiv(gl.maximum(n_tiles - WG, 0), 2)
    first = 0
    if WG == 0:
        first = 1
        if n_tiles > 0:
            acc, m_i, l_i = _own_tile(
                0, acc, m_i, l_i, q_lat, q_rope, k_lat, k_rope, p_smem, m_smem,
                k_ready, k_empty, p_ready, p_empty, block_row, max_blocks, cache_rows, lo,
                hi, seqlen_k, offs_t, diag_offset, qk_scale, s_init, row_layout, col_layout,
                o_row_layout, WG, True, IS_CAUSAL, PAGED, PAGE_SIZE)
    for i in range(first, n_own):
        acc, m_i, l_i = _own_tile(
            WG + 2 * i, acc, m_i, l_i, q_lat, q_rope, k_lat, k_rope, p_smem, m_smem,
            k_ready, k_empty, p_ready, p_empty, block_row, max_blocks, cache_rows, lo, hi,
            seqlen_k, offs_t, diag_offset, qk_scale, s_init, row_layout, col_layout,
            o_row_layout, WG, False, IS_CAUSAL, PAGED, PAGE_SIZE)
    # The split's last tile, when it is the other warpgroup's.
    last = n_tiles - 1
    if (last >= 0) & (last % 2 != WG):
        acc, m_i, l_i = _other_scale(last, acc, m_i, l_i, m_smem, p_ready, row_layout,
                                     o_row_layout)
        acc = warpgroup_mma(p_smem.index(1 - WG), _v_half(k_lat, last % STAGES, WG), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))

    # The row sums: each warpgroup summed its own tiles' P.
    l_smem.index(WG).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(l_ready.index(0))
    mbarrier.wait(l_ready.index(0), 0)
    l_i = l_smem.index(0).load(row_layout) + l_smem.index(1).load(row_layout)

    # Rows that saw no key (l == 0): out 0 and lse -inf, as the portable kernel writes
    # them; a NaN that reached l stays NaN.
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    # Empty rows are 0 even where a NaN value reached acc as 0 x NaN (a key the causal
    # mask hides).
    out = gl.where(gl.expand_dims(gl.convert_layout(empty, o_row_layout), 1), 0.0,
                   acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, o_row_layout), 1))
    m_row = offs_r < seqlen_q * nheads
    offs_h = offs_r % nheads
    if WG == 0:  # one warpgroup stores lse
        gl.store(Lse + split * stride_ls + off_b * stride_lb + offs_h * stride_lh + offs_t,
                 lse, mask=m_row)
    o_rows = gl.arange(0, BLOCK_M, layout=o_row_layout) + row0
    o_cols = WG * DV_HALF + gl.arange(0, DV_HALF, layout=gl.SliceLayout(0, o_layout))
    p_o = (Out + split * stride_os + off_b * stride_ob
           + gl.expand_dims((o_rows // nheads) * stride_om + (o_rows % nheads) * stride_oh, 1)
           + gl.expand_dims(o_cols, 0))
    gl.store(p_o, out.to(Out.dtype.element_ty),
             mask=gl.expand_dims(o_rows < seqlen_q * nheads, 1))


# Integers that follow the batch, the cache's and the block table's sizes (as in the
# portable kernel, decode._decode_kernel): one compiled variant for them all, not one
# for 1, multiples of 16 and other values, met mid-serving.
@gluon.jit(do_not_specialize=["stride_os", "stride_ls", "stride_block_table_b",
                              "max_blocks", "cache_rows", "keys_per_split", "capacity"])
def _mla_decode_hopper_kernel(q_lat_desc, q_rope_desc, k_lat_desc, k_rope_desc, Out, Lse,
                              BlockTable, CacheSeqlens, stride_os, stride_ob, stride_om,
                              stride_oh, stride_ls, stride_lb, stride_lh,
                              stride_block_table_b, max_blocks, cache_rows, nheads,
                              seqlen_q, keys_per_split, new_tokens, capacity, softmax_scale,
                              STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                              PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Grid (splits, batch, 64-row blocks of the sequence's query tokens x heads)."""
    BLOCK_N: gl.constexpr = k_lat_desc.block_type.shape[1]
    # Q with a leading dim of 1 (_own_tile indexes it).
    q_lat = gl.allocate_shared_memory(q_lat_desc.dtype, [1] + q_lat_desc.block_type.shape,
                                      q_lat_desc.layout)
    q_rope = gl.allocate_shared_memory(q_rope_desc.dtype, [1] + q_rope_desc.block_type.shape,
                                       q_rope_desc.layout)
    k_lat = gl.allocate_shared_memory(k_lat_desc.dtype, [STAGES] + k_lat_desc.block_type.shape,
                                      k_lat_desc.layout)
    k_rope = gl.allocate_shared_memory(k_rope_desc.dtype,
                                       [STAGES] + k_rope_desc.block_type.shape,
                                       k_rope_desc.layout)
    # P of the last tile of each warpgroup (buffer WG), wgmma's A operand for both.
    p_smem = gl.allocate_shared_memory(
        k_lat_desc.dtype, [2, BLOCK_M, BLOCK_N],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], k_lat_desc.dtype))
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_layout)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    l_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready.index(0), count=1)
    mbarrier.init(l_ready.index(0), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both read V from every tile
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)  # the owner's
        mbarrier.init(p_empty.index(i), count=1)  # the other warpgroup's

    consumer = (q_lat, q_rope, k_lat, k_rope, p_smem, m_smem, l_smem, q_ready, k_ready,
                k_empty, p_ready, p_empty, l_ready, Out, Lse, BlockTable, CacheSeqlens,
                stride_os, stride_ob, stride_om, stride_oh, stride_ls, stride_lb, stride_lh,
                stride_block_table_b, max_blocks, cache_rows, nheads, seqlen_q,
                keys_per_split, new_tokens, capacity, softmax_scale)
    gl.warp_specialize([
        (_mma_partition, (consumer, 0, IS_CAUSAL, PAGED, PAGE_SIZE)),
        (_load_partition, (q_lat_desc, q_rope_desc, k_lat_desc, k_rope_desc, q_lat, q_rope,
                           k_lat, k_rope, q_ready, k_ready, k_empty, BlockTable,
                           CacheSeqlens, stride_block_table_b, max_blocks, cache_rows,
                           keys_per_split, new_tokens, capacity, PAGED, PAGE_SIZE)),
        (_mma_partition, (consumer, 1, IS_CAUSAL, PAGED, PAGE_SIZE)),
    ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@functools.lru_cache(maxsize=None)
def _on_hopper(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) == (9, 0))


def _tma_ready(x, dims) -> bool:
    """TMA: a 16-byte aligned base, 16-byte aligned strides over ``dims``, a unit last
    stride."""
    size = x.element_size()
    return (x.data_ptr() % 16 == 0 and x.stride(-1) == 1
            and all(x.stride(i) > 0 and x.stride(i) * size % 16 == 0 for i in dims))


def unsupported(q, k_cache, v_cache, *, v_is_k, block_table, cache_batch_idx, cache_leftpad,
                alibi_slopes, window_left, window_right, softcap, descales) -> str | None:
    """Why this kernel cannot serve a decode call (None: it can). The arguments are
    ``flashtile.ops.decode.attn_decode``'s, already validated; v_is_k: V is read from
    K's tiles (decode._v_is_k)."""
    b, sq, h, d = q.shape
    if not _on_hopper(q.device):
        return "it needs an sm_90 (Hopper) CUDA device"
    if q.dtype not in _GL_DTYPES or k_cache.dtype != q.dtype:
        return "float16 or bfloat16 q and cache of one dtype only"
    if (d, v_cache.shape[-1], k_cache.shape[2]) != (LATENT.value + ROPE.value, LATENT.value, 1):
        return "the absorbed MLA shape only: head_dim 576, V's 512, one KV head"
    if not v_is_k:
        return "v_cache must be k_cache's first 512 columns (the shared latent rows)"
    if sq * h <= configs.DECODE_MLA_HOPPER_MIN_ROWS:
        return f"{sq * h} query rows: more than {configs.DECODE_MLA_HOPPER_MIN_ROWS} only"
    if any(x is not None for x in (cache_batch_idx, cache_leftpad, alibi_slopes, *descales)) \
            or softcap > 0 or window_left >= 0 or window_right > 0:
        return "no cache_batch_idx, cache_leftpad, ALiBi, descales, softcap or window " \
               "(causal or full attention only)"
    block_n = configs.hopper_mla_decode_config().block_n
    if block_table is not None and k_cache.shape[1] % block_n:
        return f"page size {k_cache.shape[1]}: a multiple of the {block_n}-key tile only"
    # Q's rows are (token, head) pairs at one stride: a 3-d tensor map over them.
    if sq > 1 and q.stride(1) != h * q.stride(2):
        return "q's tokens must be h heads apart (rows of one stride)"
    if not (_tma_ready(q, (0, 2)) and _tma_ready(k_cache, (0, 1, 2))):
        return "TMA needs 16-byte aligned data and strides, and a contiguous last dim"
    return None


@functools.lru_cache(maxsize=None)
def _smem_layout(box: tuple, dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(box), _GL_DTYPES[dtype])


def descriptors(q, k_cache, block_n: int) -> tuple:
    """The kernel's tensor maps: q as (batch, tokens x heads, 576) rows in boxes of 64
    rows, latent and rope apart; the cache (blocks or batch, keys, 1, 576) in boxes of
    block_n keys. Rows past the tensors are zero-filled."""
    b, sq, h, d = q.shape
    q_shape, q_strides = [b, sq * h, d], [q.stride(0), q.stride(2), 1]
    k_shape, k_strides = list(k_cache.shape), list(k_cache.stride())

    def desc(x, shape, strides, box):
        return TensorDescriptor(x, shape, strides, box, _smem_layout(tuple(box), x.dtype))

    return (desc(q, q_shape, q_strides, [1, BLOCK_M.value, LATENT.value]),
            desc(q, q_shape, q_strides, [1, BLOCK_M.value, ROPE.value]),
            desc(k_cache, k_shape, k_strides, [1, block_n, 1, LATENT.value]),
            desc(k_cache, k_shape, k_strides, [1, block_n, 1, ROPE.value]))


# The parameters a launch plan fills per call, in the kernel's order.
_SLOTS = ("q_lat_desc", "q_rope_desc", "k_lat_desc", "k_rope_desc", "Out", "Lse",
          "BlockTable", "CacheSeqlens", "softmax_scale")


def attn_decode(q, k_cache, *, cache_seqlens, block_table, softmax_scale, causal,
                num_splits, new_tokens, out_dtype, return_lse):
    """``flashtile.ops.decode.attn_decode`` for the calls ``unsupported`` accepts (V
    read from k_cache's first 512 columns): the same outputs, split or not, the splits
    merged by the portable kernel's combine."""
    from flashtile.ops import decode

    b, sq, h, d = q.shape
    dv = LATENT.value
    paged = block_table is not None
    cfg = configs.hopper_mla_decode_config()
    key = None
    if _launch.ready(q):
        # q's and the cache's addresses are TMA-checked (16-byte aligned) by
        # ``unsupported``; out and lse are allocated here (aligned).
        key = ("mla_hopper", q.dtype, out_dtype, q.shape, q.stride(), k_cache.shape,
               k_cache.stride(), paged and (block_table.shape, block_table.stride(0)),
               new_tokens, causal, num_splits, cfg, _launch.misalignment(
                   _launch.pointers((block_table if paged else cache_seqlens,
                                     cache_seqlens))))
        plans = _launch.lookup(key)
        if plans is not None:
            splits, plan, merge = plans
            out, lse, buf, lse_at, dst_at, dst_lse_at = decode._outputs(
                q, dv, out_dtype, splits, return_lse)
            base = buf.data_ptr()
            lse_ptr = base + lse_at
            table = block_table.data_ptr() if paged else cache_seqlens.data_ptr()
            descs = (q, q, k_cache, k_cache)  # the plan encodes their tensor maps
            if not merge:  # unsplit: the kernel writes out and lse itself
                plan((*descs, out.data_ptr(), lse_ptr, table, cache_seqlens.data_ptr(),
                      softmax_scale))
            else:
                dst, dst_lse = base + dst_at, base + dst_lse_at
                plan((*descs, dst, dst_lse, table, cache_seqlens.data_ptr(), softmax_scale))
                merge((dst, dst_lse, out.data_ptr(), lse_ptr))
            return out, lse
    rows = sq * h
    m_blocks = configs.cdiv(rows, BLOCK_M.value)
    page_size = k_cache.shape[1] if paged else 0
    capacity = cache_capacity(k_cache, block_table)
    # One program an SM (shared memory): the split heuristic plans one a SM.
    num_splits, keys_per_split, _ = decode.split_plan(
        b * m_blocks, capacity, cfg.block_n, page_size, num_splits, decode._num_sms(q),
        False, per_sm=1)
    out, lse, *pieces = decode._outputs(q, dv, out_dtype, num_splits, return_lse)
    lse_t, dst, dst_lse = decode._output_tensors(q, dv, num_splits, out, lse, *pieces)
    if num_splits == 1:
        dst, dst_lse = out, lse_t
        dst_strides, dst_lse_strides = (0, *out.stride()[:3]), (0, *lse_t.stride()[:2])
    else:
        dst_strides, dst_lse_strides = dst.stride()[:4], dst_lse.stride()[:3]
    flags = dict(STAGES=cfg.num_stages, IS_CAUSAL=causal, PAGED=paged,
                 PAGE_SIZE=page_size if paged else 1)
    configs.log_first_launch("hopper MLA decode", q, d, cfg,
                             dict(flags, SPLIT=num_splits > 1))
    descs = descriptors(q, k_cache, cfg.block_n)
    plan = _launch.first_launch(
        _mla_decode_hopper_kernel, (num_splits, b, m_blocks),
        (*descs, dst, dst_lse, block_table if paged else cache_seqlens, cache_seqlens,
         *dst_strides, *dst_lse_strides, block_table.stride(0) if paged else 0,
         block_table.shape[1] if paged else 0, k_cache.shape[0], h, sq, keys_per_split,
         new_tokens, capacity, softmax_scale),
        dict(flags, num_warps=4), _SLOTS if key is not None else None)
    merge = None
    if num_splits > 1:
        merge = combine.launch_combine(q, dv, num_splits, dst, dst_lse, out, lse_t,
                                       combine.combine_pdl(q)[0], key is not None)
    if key is not None and plan is not None and (merge is not None or num_splits == 1):
        _launch.store(key, (num_splits, plan, merge or False))
    return out, lse
