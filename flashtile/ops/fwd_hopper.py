"""FlashAttention forward for Hopper (sm_90) in Gluon, scheduled as FlashAttention-3.

Algorithm: Shah et al., FlashAttention-3 (2024), sections 3.1-3.2, on top of the online
softmax of FlashAttention-2 in base 2 (``flashtile.ops.fwd``). Dense layout only:
q (batch, seqlen_q, nheads, head_dim), k/v (batch, seqlen_k, nheads_kv, head_dim); causal
(any ``diag_offset``) or not; writes ``out`` and the natural-log ``lse`` (batch, nheads,
seqlen_q) exactly as ``flashtile.ops.fwd.attn_fwd`` does, so either can serve a call.
Head dims 64, 128 and 256; 96 in d128's tiles (``configs.HOPPER_WIDER``: the tensor maps
keep head_dim 96 and their boxes are 128 wide, so TMA reads zeros past it and stores
nothing there).

A tile is BLOCK_M = 2 x 64 query rows of one (batch, head) (or 3 x 64: below), computed
in three warp-specialised partitions:
- a producer warp loads the tile's Q once and streams K and V blocks through a ring of
  STAGES shared-memory buffers with TMA. Each buffer has a "ready" mbarrier (the TMA
  bytes landed) and an "empty" one (both consumers are done with it).
- two consumer warpgroups own 64 query rows each. The two take turns issuing their
  matrix products (a pair of mbarriers), so one's softmax runs under the other's
  products (FA3's ping-pong). In block j a consumer issues S_j = Q K_j^T and
  O += P_{j-1} V_{j-1} back to back (asynchronous wgmma, P from registers) and waits
  for S_j only, to compute its softmax while P_{j-1} V_{j-1} runs (FA3's
  intra-warpgroup overlap). ptxas (Triton 3.6) undoes that second overlap: its
  scheduler hoists the wait for P_{j-1} V_{j-1} (WARPGROUP.DEPBAR, no register
  operands) into the row max, before the exp2 (sm_90 SASS; docs/benchmarks/NOTES.md
  sections 17 and 40). A block boundary before that wait (a second wait on V_{j-1}'s
  completed ready barrier) restored it in the SASS, all 66 exp2 under the product, and
  ran 2-10% slower on the H200 (session 31, NOTES.md section 41): the other consumer's
  products already fill the tensor cores during a softmax. TREE_MAX
  (``_online_softmax``) takes the row max pairwise: 10 dependent steps before the first
  exp2 where gl.max's chain takes 36; the three-consumer tiles gain 2-7% with it, two
  consumers and FP8 lose 3-8% (``configs.hopper_fwd_tree_max``). P_j crosses the
  walk's loop edge to its P V: P_PACKED (16-bit, ``configs.hopper_fwd_p_packed``)
  carries it in the 32-bit registers the casts fill (``_p_operand``), where the operand
  form leaves ptxas a PRMT per register at the top of every block.
- warp_specialize's register requests become setmaxnreg: the producer keeps 24
  registers per thread and each consumer gets 240 (S, P and O live in registers).
Three consumers (NUM_WG 3, FLASHTILE_HOPPER_FWD_CONFIG="192,BLOCK_N,4,STAGES", 16-bit:
head_dim 64 with 128 keys a block, FA3's tile there, or 128 with 64) take their turns
in a cycle, 160 registers each (S, O and P a thread: d64 64 + 32 + 32, d128 32 + 64 +
16; d128 with 128 keys spills 240-320 bytes). FP8 at head_dim 128 takes three too, with
128 keys a block and P V summed in the wgmma (FLASHTILE_HOPPER_FWD_FP8_PV=wgmma: per
tile the second O spills): its softmax is twice the share of a tile's time, as at
16-bit d64; P through six shared buffers. Session 15's Nsight Compute had the d64
forward's schedulers with no eligible warp 56% of the cycles: a third consumer brings
four more warps, and each softmax runs under two other consumers' products instead of
one. The sm_90 compile: no spills (tiles grid; the
persistent one keeps one 4-byte tile-loop scalar in local memory, outside the walks);
the two-consumer SASS is unchanged by it. On the H200 (session 20, NOTES.md section
30) d64 gained from 8k tokens a sequence (+3-11%) and lost at 1k-4k causal; with the tree
row max (session 31) and warpgroups past seqlen_q idle (session 33) auto takes it at
d64 from 1k full and 2k causal (``configs.hopper_fwd_config``); d128 with 64 keys lost 2-17%
and FP8 (864 TFLOP/s at 16k) stayed below BLOCK_N 256 (876): opt-in there.
The grid (FLASHTILE_HOPPER_FWD_SCHEDULE, ``configs.hopper_fwd_persistent``):
- "tiles": one program per (query tile, batch * nheads), causal query
  tiles longest first; the hardware hands out the programs, each with its own prologue
  (barriers, Q and the first K's latency) and epilogue (O's store).
- "persistent" (PERSISTENT, FA3's persistent kernel): one program per SM, each walking
  its row of a tile list the host computes once per geometry (``schedule_rows``): FA3's
  order (causal: longest first inside groups of heads whose K and V fit 32 MiB of L2;
  full: head by head) dealt greedily to the least loaded program, as FA3's dynamic
  scheduler deals it with an atomic counter. The K/V ring and the consumers' turns
  count on across tiles, so the next tile's K and V load under the current one's end;
  Q's buffer goes back to the producer (q_empty) once the tile's last S is done unless
  O leaves through it (16-bit d256: handed back after O's store); elsewhere O has a
  buffer of its own (16-bit d64 and d128, FP8) or P's (FP8 BLOCK_N 256) and its TMA
  store runs under the next tile. At d64 (FLASHTILE_HOPPER_FWD_Q_BUFFERS, Q_BUFS; 16-bit
  where it fits, ``_q_buffers``) Q has two buffer sets, tile i's in set i % 2: the
  producer then loads the next tile's Q, and its first K and V behind it, as soon as it
  has issued this tile's last K and V, rather than once this tile's last S is done
  (session 32: d64 +3-5% at 1k, level from 4k; d128 mixed). Compiled for sm_90 in CI
  (no spills, both schedules); timed on the H200 (session 12, NOTES.md section 22) at
  1.11-1.15x "tiles" for bf16 at 1k, 1.07x causal at 4k, level at 16k, FP8 full
  attention 3% slower; its GPU tests passed in session 13. "auto" (the default) takes it for 16-bit
  d64 and d128 (``configs.HOPPER_FWD_PERSISTENT_AUTO_D``; d64 1.04-1.21x the portable
  kernel, session 13) and "tiles" elsewhere.
K/V rows past seqlen_k and Q rows past seqlen_q are zero-filled by TMA (the descriptors
are 4-d, so a tile never reads the next sequence) and the TMA store of O drops rows past
seqlen_q. Gluon kernels do not run in the Triton interpreter: CI compiles this one for
sm_90 (tests/test_gluon_compile.py) and tests/test_fwd_hopper.py checks it on a GPU.

FP8 (q, k, v in float8_e4m3fn or float8_e5m2, out bfloat16 or float16) switches the
same kernel, with the numerics of the portable FP8 forward (flashtile.ops.fwd, docs/fp8.md):
- both products on 8-bit wgmma (instruction K 32). Its B operand must be K-major: K's
  rows are (head_dim-contiguous) for S = Q K^T; for P V the launcher copies V
  keys-contiguous (``fwd.keys_contiguous``, keys padded to FP8_V_PAD) and a TMA
  descriptor over (batch, nheads_kv, head_dim, seqlen_k) brings V^T tiles, viewed
  transposed in shared memory as K's are.
- P = exp2(s - max + P_LOG2_OFFSET), in [0, 256], cast to V's format in registers; l
  sums the same P and the lse takes the offset back. q_descale * k_descale (per batch
  and KV head) joins the scale of the scores, v_descale the final 1 / l.
- PV_PER_TILE (head_dim <= 128): each P V starts from zero and is added to O in fp32,
  as the portable kernel does (the FP8 wgmma's accumulator keeps ~14 bits). At 256 the
  second O tile spilled (328 bytes); there P V accumulates in the wgmma, as there.
  FLASHTILE_HOPPER_FWD_FP8_PV=wgmma (``configs.hopper_fwd_fp8_pv_per_tile``) does so at
  every head dim: with P in shared memory that lets BLOCK_N be 256 at head_dim 128
  without spills (FLASHTILE_HOPPER_FWD_CONFIG=128,256,4,2; per tile it spills 336-616
  bytes), half the per-block barriers, turns, row reductions and O rescales.
- O (16-bit) leaves through a shared buffer of its own (Q's is half its size), or, where
  that does not fit beside the ring and P's buffers (BLOCK_N 256 at head_dim 128),
  through each warpgroup's first P buffer (the same bytes), free after the last P V.
- P_SMEM (FLASHTILE_HOPPER_FWD_FP8_P=swap, the default; "smem"; "regs"): P_j reaches P V
  through two shared buffers per warpgroup instead of registers. With P in registers the
  SASS waits for P_{j-1} V_{j-1} before the softmax, as for 16-bit inputs (0-12 of the
  block's exp2 run under it); through shared memory the whole softmax runs under it (66
  exp2 a thread at BLOCK_N 128), at the cost of P's stores (2 bytes each: the
  accumulator layout) and 16-32 KiB of shared memory.
  16-bit inputs keep P in registers: through shared memory (two 16-bit buffers a
  warpgroup, O staged in the first at d128; 66 exp2 under P_{j-1} V_{j-1} in the SASS
  against 0-5) they ran 3-12% slower on the H200 (session 14, NOTES.md section 24): the
  stores of P and the extra shared-memory traffic cost more than the overlap won.
  P_SMEM 2 ("swap", the default since session 35; ``_p_stored``): each 32 keys of P,
  and of V's copy, in an order where a thread's eight FP8 values of P are adjacent, so
  P leaves in 8-byte stores (a quarter of the store instructions, half the
  shared-memory wavefronts; a walk block 3-6% fewer instructions in the sm_90 SASS,
  d128 482 against 507), and V's copy is one Triton pass (fwd._keys_contiguous_kernel).
  On the H200 the kernel ran level with P_SMEM 1 and the copy made the difference:
  +4-18% full, +9-35% causal at d128 4k-16k (NOTES.md section 45).
Timed on the H200 in session 12 at head_dim 128, 16k tokens a batch
(docs/benchmarks/h200-2026-12-01-s12/fp8.md, fp8-psmem.md): P in registers 374-614
TFLOP/s, P in shared memory 481-799 (4k-16k, causal or not), hence the default. BLOCK_N
256 with P V in the wgmma (FLASHTILE_HOPPER_FWD_FP8_PV=wgmma, opt-in) ran 433-867 (no
spills except causal on the persistent grid: 144 bytes). FLASHTILE_HOPPER_FWD=auto sends
dense FP8 calls at head dim 128 from 4k queries here; "1" every call it supports.
"""

from __future__ import annotations

import functools
import heapq
from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile.ops import _launch, configs
from flashtile.ops._common import LN2, LOG2E
from flashtile.ops.fwd import FP8_V_PAD, keys_contiguous
from flashtile.ops.fwd import P_LOG2_OFFSET as _P_LOG2_OFFSET

# Query rows of one consumer warpgroup: wgmma's M is 64 per warpgroup.
BLOCK_M_WG = gl.constexpr(64)
# Registers per thread (warp_specialize's requests): 24 is the fewest a warp may keep,
# 240 leaves 64 + 64 fp32 (S, O at head_dim 128), 32 for P and the rest for addresses
# and the softmax. 24 + 240 + 240 (the default partition's share) fit 64K registers.
PRODUCER_REGS = gl.constexpr(24)
CONSUMER_REGS = gl.constexpr(240)
# Three consumers (BLOCK_M 192, 16-bit, configs.hopper_fwd_config): 24 + 3 x 160 a
# thread's warpgroup share fit the same 64K registers.
CONSUMER_REGS_3WG = gl.constexpr(160)
# FP8: P is exp2(s - max + P_LOG2_OFFSET), in [0, 256], so that its small entries stay
# normal e4m3 numbers when cast for P V (the portable kernel's offset, the same numerics).
P_LOG2_OFFSET = gl.constexpr(_P_LOG2_OFFSET.value)
# Shared memory one program may use (227 KiB on the H100/H200).
SMEM_BYTES = gl.constexpr(configs.SM90_SMEM_BYTES)

@gluon.jit
def _tile_count(Schedule, schedule_row, PERSISTENT: gl.constexpr):
    """How many tiles this program computes: one, or (PERSISTENT) its row's count in the
    host's schedule (``schedule_rows``)."""
    if PERSISTENT:
        count = gl.load(Schedule + gl.program_id(0) * schedule_row)
    else:
        count = 1
    return count


@gluon.jit
def _tile_blocks(row0, seqlen_q, seqlen_k, diag_offset, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """(n_blocks, n_full) of the tile at row0: key blocks [0, n_blocks) are visible to
    some row of the tile; [0, n_full) to every row and inside seqlen_k, so they skip the
    mask. Divisions see non-negative values."""
    hi = seqlen_k
    n_full = seqlen_k // BLOCK_N
    if IS_CAUSAL:
        last_row = gl.minimum(row0 + BLOCK_M, seqlen_q) - 1
        hi = gl.minimum(hi, gl.maximum(last_row + diag_offset + 1, 0))
        n_full = gl.minimum(n_full, gl.maximum(row0 + diag_offset + 1, 0) // BLOCK_N)
    return gl.cdiv(hi, BLOCK_N), n_full


@gluon.jit
def _tile_at(i, Schedule, schedule_row, n_tiles_m, nheads, group_size, seqlen_q, seqlen_k,
             diag_offset, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             PERSISTENT: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """(off_bh, off_b, off_h, off_hkv, row0, n_blocks, n_full) of this program's i-th
    tile: the grid's, or (PERSISTENT) entry i of its row in the host's schedule,
    off_bh * n_tiles_m + query tile."""
    if PERSISTENT:
        t = gl.load(Schedule + gl.program_id(0) * schedule_row + 1 + i)
        start_m = t % n_tiles_m
        off_bh = t // n_tiles_m
    else:
        start_m = gl.program_id(0)
        off_bh = gl.program_id(1)
        if IS_CAUSAL:
            # The last query tiles see the most keys: start them first, so the tail of
            # the grid is short programs.
            start_m = n_tiles_m - 1 - start_m
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    row0 = start_m * BLOCK_M
    n_blocks, n_full = _tile_blocks(row0, seqlen_q, seqlen_k, diag_offset, BLOCK_M, BLOCK_N,
                                    IS_CAUSAL)
    return off_bh, off_b, off_h, off_h // group_size, row0, n_blocks, n_full


@gluon.jit
def _load_partition(args, IS_CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
                    Q_BUFS: gl.constexpr):
    """Producer warp: per tile, Q once (one part per consumer), then K_j and V_j into the
    ring. The ring's count runs on across a program's tiles (PERSISTENT), so the next
    tile's K and V load while the consumers finish this one. Q_BUFS 2 (PERSISTENT):
    tile i's Q goes to buffer set i % 2, so the next tile's Q, and behind it its first
    K and V, load as soon as the producer gets there (the ring's last blocks of this
    tile issued), not once this tile's last S is done."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
     v_ready, v_empty, nheads, group_size, seqlen_q, seqlen_k, diag_offset, n_tiles_m,
     Schedule, schedule_row) = args
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    NUM_WG: gl.constexpr = q_smem.type.shape[0] // Q_BUFS
    kv_base = 0  # K/V blocks loaded for the program's earlier tiles
    for i in range(_tile_count(Schedule, schedule_row, PERSISTENT)):
        off_bh, off_b, off_h, off_hkv, row0, n_blocks, n_full = _tile_at(
            i, Schedule, schedule_row, n_tiles_m, nheads, group_size, seqlen_q, seqlen_k,
            diag_offset, NUM_WG * BLOCK_M_WG, BLOCK_N, PERSISTENT, IS_CAUSAL)
        for w in gl.static_range(NUM_WG):
            q_at = (i % Q_BUFS) * NUM_WG + w
            if PERSISTENT:  # that buffer's previous tile's last S (and O store) done
                mbarrier.wait(q_empty.index(q_at), ((i // Q_BUFS) & 1) ^ 1)
            mbarrier.expect(q_ready.index(q_at), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [off_b, row0 + w * BLOCK_M_WG, off_h, 0],
                                            q_ready.index(q_at), q_smem.index(q_at))
        for j in range(n_blocks):
            stage = (kv_base + j) % STAGES
            # A fresh mbarrier counts as having completed the phase before its first, so
            # the first pass through the ring waits for nothing.
            phase = (((kv_base + j) // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [off_b, j * BLOCK_N, off_hkv, 0],
                                            k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            if v_desc.dtype.is_fp8():  # V^T: (batch, nheads_kv, head_dim, keys) boxes
                coords = [off_b, off_hkv, 0, j * BLOCK_N]
            else:
                coords = [off_b, j * BLOCK_N, off_hkv, 0]
            tma.async_copy_global_to_shared(v_desc, coords, v_ready.index(stage),
                                            v_smem.index(stage))
        kv_base += n_blocks


@gluon.jit
def _take_turn(turn, t, WG: gl.constexpr):
    # The consumers issue in a cycle, warpgroup 0 first: its first wait is on the phase
    # before the barrier's first, which counts as complete. Turn t of warpgroup WG waits
    # for the previous one's turn t (warpgroup 0: the last one's turn t - 1), which
    # arrives on WG's barrier (_pass_turn).
    if WG == 0:
        mbarrier.wait(turn.index(WG), (t & 1) ^ 1)
    else:
        mbarrier.wait(turn.index(WG), t & 1)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr):
    """The next consumer in the cycle may issue its products."""
    NUM_WG: gl.constexpr = turn.type.shape[0]
    mbarrier.arrive(turn.index((WG + 1) % NUM_WG), count=1)


@gluon.jit
def _online_softmax(s, m_i, l_i, offs_m, start_n, qk_scale, seqlen_k, diag_offset,
                    MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_FP8: gl.constexpr,
                    TREE_MAX: gl.constexpr, ONE_BOUND: gl.constexpr):
    """One block of the online softmax in base 2: s (64, N) raw q.k products ->
    (p, alpha, m_i, l_i), m_i in scaled units. softmax_scale > 0 (the launcher's
    condition), so the row max of the raw scores scales to that of the scaled ones and
    each score costs one FFMA and one exp2, as in FA3. FP8: P in [0, 2**P_LOG2_OFFSET]
    (see P_LOG2_OFFSET).

    TREE_MAX: the row max as a tree. A thread holds 2 rows x BLOCK_N / 4 columns of S,
    and gl.max reduces each row's in one dependent chain (FMNMX after FMNMX, the rows one
    after the other in ptxas's schedule: 36 deep before the first exp2 at BLOCK_N 128,
    sm_90 SASS); reducing the columns axis by axis of a (64, 2, 2, 2, BLOCK_N / 64, 8)
    view gives pairwise levels, 10 deep. The same maximum (max is exact in any order)."""
    if MASKED:  # the ragged last block, or one crossing the causal diagonal
        # Built here, from start_n: block-invariant column offsets would be hoisted out
        # of the walk, registers the unmasked blocks would keep live.
        offs_n = start_n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        if ONE_BOUND:
            # Key n kept where n <= min(row + diag_offset, seqlen_k - 1): one compare and
            # one select a score, where the two conditions apart take two selects and a
            # second compare (sm_90: 12-110 fewer instructions a masked walk). Its row
            # bound lives through the walk: three consumers at 160 registers a thread
            # spill 40 bytes with it, so they keep the conditions apart.
            last = seqlen_k - 1
            if IS_CAUSAL:
                last = gl.minimum(offs_m + diag_offset, last)
                keep = gl.expand_dims(offs_n, 0) <= gl.expand_dims(last, 1)
            else:
                keep = gl.expand_dims(offs_n <= last, 0)
        else:
            keep = gl.expand_dims(offs_n < seqlen_k, 0)
            if IS_CAUSAL:
                keep = keep & (gl.expand_dims(offs_n, 0) <=
                               gl.expand_dims(offs_m, 1) + diag_offset)
        s = gl.where(keep, s, float("-inf"))
    if TREE_MAX:
        # Columns c = 64a + 32b + 16c' + 8g + e: the first four axes in-thread (pairwise
        # levels), the last across 4 lanes (in-thread pairs, then the shuffles).
        s6 = gl.reshape(s, [s.shape[0], 2, 2, 2, s.shape[1] // 64, 8])
        row_max = gl.max(gl.max(gl.max(gl.max(gl.max(s6, 4), 3), 2), 1), 1)
        row_max = gl.convert_layout(row_max, m_i.type.layout)  # the same lanes: no move
    else:
        row_max = gl.max(s, 1)
    m_new = gl.maximum(m_i, row_max * qk_scale)                             # (64,)
    # A row that has seen no key keeps m = -inf; subtract 0 then, never -inf - -inf.
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_sub)
    if IS_FP8:
        # The offset rides on the max that is subtracted anyway; l sums the same scaled
        # P, so out = acc / l is unchanged and the lse takes it back at the end.
        m_sub = m_sub - P_LOG2_OFFSET
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))          # (64, N)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _p_operand(p, acc, dtype: gl.constexpr, P_PACKED: gl.constexpr):
    """P (fp32, the S layout) as wgmma's A operand for O += P V, from registers: cast to
    V's type, 32 bits per register (two 16-bit values, or four FP8 ones).

    P_PACKED (16-bit): P_j waits for its P V in block j + 1, so it crosses the walk's loop
    edge. As the operand it crosses as 64 16-bit values, which ptxas re-packs with a PRMT
    per register at the top of every block, on the way to P V's issue (32 a block, 64 in
    the masked walks; sm_90 SASS). Packed here by the cast itself (two fp32 to one
    32-bit register, ``cvt.rn.bf16x2.f32`` as ``p.to`` emits it) it crosses as 32 int32
    and ``_pv_operand`` makes the operand of them with no instruction."""
    if P_PACKED:
        M: gl.constexpr = p.type.shape[0]
        N: gl.constexpr = p.type.shape[1]
        lo, hi = p.reshape([M, N // 2, 2]).split()  # columns 2i and 2i + 1: one thread's
        # cvt packs its first source into the upper half.
        cvt: gl.constexpr = "cvt.rn.bf16x2.f32 $0, $2, $1;" if dtype == gl.bfloat16 \
            else "cvt.rn.f16x2.f32 $0, $2, $1;"
        op = gl.inline_asm_elementwise(cvt, "=r,f,f", [lo, hi], dtype=gl.int32,
                                       is_pure=True, pack=1)
    else:
        layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout,
                                                   k_width=32 // dtype.primitive_bitwidth)
        op = gl.convert_layout(p.to(dtype), layout)
    return op


@gluon.jit
def _pv_operand(p_op, acc, dtype: gl.constexpr, P_PACKED: gl.constexpr):
    """P V's A operand from what ``_p_operand`` made (or a shared P buffer): P_PACKED's
    registers split into their 16-bit halves and viewed as the operand, which packs them
    back: the same registers (no instruction in the SASS)."""
    if P_PACKED:
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [p_op],
                                           dtype=(gl.int16, gl.int16), is_pure=True, pack=1)
        p = gl.join(lo.to(dtype, bitcast=True), hi.to(dtype, bitcast=True))
        M: gl.constexpr = p.type.shape[0]
        N: gl.constexpr = p.type.shape[1] * 2
        layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout,
                                                   k_width=2)
        op = gl.convert_layout(p.reshape([M, N]), layout)
    else:
        op = p_op
    return op


@gluon.jit
def _p_stored(p, dtype: gl.constexpr, P_SMEM: gl.constexpr):
    """P (fp32, the S layout) cast to V's type for its shared buffer. P_SMEM 2 ("swap",
    FP8): within each 32 keys, column 8j + 2q + r goes to 8q + 2j + r. A thread's
    accumulator holds columns 8j + 2q + {0, 1} of its rows (q = lane % 4), so in that
    order its eight FP8 values of each 32 are adjacent: one 8-byte store (sm_90 SASS,
    d128: 8 STS.64 a block, the casts packing in pairs) where the keys' order takes 32
    stores of 2 bytes. A view, no data movement; V's copy holds its keys in the same
    order (``fwd.keys_contiguous``'s swap32), so P V is unchanged."""
    p = p.to(dtype)
    if P_SMEM == 2:
        M: gl.constexpr = p.type.shape[0]
        N: gl.constexpr = p.type.shape[1]
        p = p.reshape([M, N // 32, 4, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([M, N])
    return p


@gluon.jit
def _v_operand(v_smem, stage, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """V_stage as the (BLOCK_N, HEAD_DIM) B operand of P V. FP8 V arrives as V^T
    (HEAD_DIM, BLOCK_N), keys contiguous: the K-major B operand that 8-bit wgmma needs
    (K is the key axis here), viewed transposed as K's tile is for Q K^T."""
    if v_smem.dtype.is_fp8():
        b = v_smem.index(stage).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))
    else:
        b = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    return b


@gluon.jit
def _kv_block(j, kv_base, turn_base, q, k_smem, v_smem, p_smem, k_ready, k_empty, v_ready,
              v_empty, turn, acc, p_op, alpha_o, m_i, l_i, s_init, o_init, offs_m, qk_scale,
              seqlen_k, diag_offset, WG: gl.constexpr, MASKED: gl.constexpr,
              IS_CAUSAL: gl.constexpr, PV_PER_TILE: gl.constexpr, P_SMEM: gl.constexpr,
              P_PACKED: gl.constexpr, TREE_MAX: gl.constexpr, ONE_BOUND: gl.constexpr):
    """Block j >= 1 of a consumer: S_j = Q K_j^T and P_{j-1} V_{j-1} issued in one
    turn, the softmax of S_j while P_{j-1} V_{j-1} runs, then O updated.

    16-bit: the product accumulates into O, which is then moved to the new maximum
    (alpha). PV_PER_TILE (FP8): each P V starts from zero and is added to O in fp32, as
    the portable kernel does (Hopper's FP8 wgmma keeps a narrower accumulator, about 14
    bits); O lags one block behind so that the add is one FMA: O holds the blocks
    before j-1 scaled to m_{j-2}, alpha_o (block j-1's alpha) moves it to m_{j-1}.

    P_SMEM: P_j goes to wgmma through shared memory, two buffers per warpgroup
    (P_{j-1} V_{j-1} reads the other), instead of registers: ptxas then keeps the wait
    for P_{j-1} V_{j-1} after the softmax (sm_90 SASS), the overlap that P in registers
    loses (module docstring).

    kv_base and turn_base: the K/V blocks and turns of the program's earlier tiles (0
    unless PERSISTENT), where the ring's and the turns' counts start for this tile."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[4]
    c = kv_base + j
    stage = c % STAGES
    prev = (c - 1) % STAGES
    mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
    _take_turn(turn, turn_base + j, WG)
    k_t = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
    s = warpgroup_mma(q, k_t, s_init, use_acc=False, is_async=True)
    v_op = _v_operand(v_smem, prev, BLOCK_N, HEAD_DIM)
    p_op = _pv_operand(p_op, acc, v_smem.dtype, P_PACKED)
    if PV_PER_TILE:
        pv = warpgroup_mma(p_op, v_op, o_init, use_acc=False, is_async=True)
    else:
        acc = warpgroup_mma(p_op, v_op, acc, is_async=True)
    _pass_turn(turn, WG)
    s = warpgroup_mma_wait(1, deps=(s,))  # S_j done; P_{j-1} V_{j-1} may still run
    mbarrier.arrive(k_empty.index(stage), count=1)
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, offs_m, j * BLOCK_N, qk_scale,
                                         seqlen_k, diag_offset, MASKED, IS_CAUSAL,
                                         v_smem.dtype.is_fp8(), TREE_MAX, ONE_BOUND)
    alpha = gl.convert_layout(alpha, alpha_o.type.layout)
    if P_SMEM:
        # Buffer j % 2 was last read by P_{j-2} V_{j-2}, complete since block j-1.
        p_next = p_smem.index(2 * WG + j % 2)
        p_next.store(_p_stored(p, v_smem.dtype, P_SMEM))
        fence_async_shared()  # the generic-proxy writes before wgmma reads them
    if PV_PER_TILE:
        pv = warpgroup_mma_wait(0, deps=(pv,))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(alpha_o, 1) + pv
    else:
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
        # O holds sum_{i<j} exp2(s_i - m_{j-1}) v_i: move it to the new maximum.
        acc = acc * gl.expand_dims(alpha, 1)
    if not P_SMEM:
        p_next = _p_operand(p, acc, v_smem.dtype, P_PACKED)
    return acc, p_next, alpha, m_i, l_i


@gluon.jit
def _mma_tile(i, kv_base, turn_base, q_smem, k_smem, v_smem, o_smem, p_smem, q_ready,
              q_empty, k_ready, k_empty, v_ready, v_empty, turn, o_desc, Lse, VDescale,
              off_b, off_h, row0, n_blocks, n_full, seqlen_q, seqlen_k, diag_offset,
              qk_scale, lse_row0, v_descale_off, WG: gl.constexpr, IS_CAUSAL: gl.constexpr,
              HAS_V_DESCALE: gl.constexpr, PV_PER_TILE: gl.constexpr, P_SMEM: gl.constexpr,
              PERSISTENT: gl.constexpr, O_IN_Q: gl.constexpr, O_IN_P: gl.constexpr,
              Q_BUFS: gl.constexpr, TREE_MAX: gl.constexpr, P_PACKED: gl.constexpr):
    """Consumer warpgroup WG on rows row0 + 64 * WG + [0, 64) of the program's i-th tile,
    its K/V blocks counted in the ring from kv_base and its turns from turn_base.

    Causal: the warpgroup computes the key blocks its own 64 rows see, not the tile's
    (n_blocks and n_full by the tile's first and last rows). With 192-row tiles of
    128-key blocks the first warpgroup would compute a block of fully masked scores
    every tile and the second every second tile; with 128-row tiles of 64-key blocks
    (d256) the first, every tile; 128 rows over 128 keys lose nothing. Past its own
    walk it keeps the protocol: it waits for each remaining block's K and V, releases
    them and passes its turns on, so the others issue back to back. (Session 32 on the
    H200, against walking the tile's blocks: d64 causal 4k +3-5%, d256 causal 1k
    +7-11% and 4k +4-5%; NOTES.md section 42.) A warpgroup whose rows all lie past
    seqlen_q computes block 0 only and keeps the protocol for the rest (causal, and
    full attention's three consumers: OWN_BLOCKS).

    PERSISTENT: Q's buffer is handed back to the producer (q_empty) for the next tile as
    soon as this tile's last S is done, unless O leaves through it (O_IN_Q): then once
    O's TMA store has left it. Otherwise O's store overlaps the next tile, waited for
    before the next O is written, or before the next P_0 where O leaves through the
    warpgroup's first P buffer (O_IN_P)."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[4]
    IS_FP8: gl.constexpr = q_smem.dtype.is_fp8()
    EARLY_Q_RELEASE: gl.constexpr = PERSISTENT and not O_IN_Q
    p_dtype: gl.constexpr = v_smem.dtype
    # wgmma accumulators: 4 warps along M, instruction N = the whole tile width, K = 32
    # bytes of operands (16 for 16-bit inputs, 32 for FP8).
    MMA_K: gl.constexpr = 256 // q_smem.dtype.primitive_bitwidth
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, MMA_K])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    # Q_BUFS 2: tile i's Q in buffer set i % 2 (``_load_partition``).
    q_at = (i % Q_BUFS) * (q_smem.type.shape[0] // Q_BUFS) + WG
    q = q_smem.index(q_at).reshape([BLOCK_M_WG, HEAD_DIM])
    offs_m = row0 + WG * BLOCK_M_WG + gl.arange(0, BLOCK_M_WG, layout=row_layout)
    m_i = gl.full([BLOCK_M_WG], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M_WG], gl.float32, row_layout)
    acc = gl.zeros([BLOCK_M_WG, HEAD_DIM], gl.float32, o_layout)
    s_init = gl.zeros([BLOCK_M_WG, BLOCK_N], gl.float32, s_layout)  # ignored: use_acc=False
    o_init = acc  # likewise, for PV_PER_TILE's products
    mbarrier.wait(q_ready.index(q_at), (i // Q_BUFS) & 1)

    NUM_WG: gl.constexpr = turn.type.shape[0]  # consumer warpgroups, one turn each
    # The masked blocks' one-bound mask (``_online_softmax``) with two consumers only.
    ONE_BOUND: gl.constexpr = NUM_WG == 2
    # A walk of the warpgroup's own: causal, and full attention's 192-row tiles, whose
    # last tile at a power-of-two length has one or two warpgroups wholly past seqlen_q.
    # (Full 128-row tiles have one only where seqlen_q % 128 is 1-64: their walks keep
    # the tile's, and their SASS the loop below's absence.)
    OWN_BLOCKS: gl.constexpr = IS_CAUSAL or NUM_WG == 3
    n_tile = n_blocks
    row0_wg = row0 + WG * BLOCK_M_WG
    if IS_CAUSAL:  # this warpgroup's rows' walk (at least block 0, as the tile's)
        n_blocks, n_full = _tile_blocks(row0_wg, seqlen_q, seqlen_k, diag_offset,
                                        BLOCK_M_WG, BLOCK_N, IS_CAUSAL)
        n_blocks = gl.minimum(gl.maximum(n_blocks, 1), n_tile)
    if OWN_BLOCKS:
        if row0_wg >= seqlen_q:
            # Every row past seqlen_q: block 0 only, whose output the TMA store and the
            # lse mask drop. _tile_blocks clamps the last row to seqlen_q - 1, so such a
            # warpgroup would walk the tile's whole causal (or full) length: at 4k
            # causal d64, two of 66 warpgroups walking 32 blocks each, ~6% of the
            # products; 2k and 4k full, ~3%.
            n_blocks = gl.minimum(n_blocks, 1)
        # n_full counts from the first row, n_blocks to the last real one: rows all past
        # seqlen_q would count full blocks beyond n_blocks (d128's third consumer at q 1:
        # 2 full 64-key blocks against 1), blocks the producer never loads for it.
        n_full = gl.minimum(n_full, n_blocks)
    if n_blocks > 0:
        # Block 0: S_0 alone (there is no P yet).
        first = kv_base % STAGES
        mbarrier.wait(k_ready.index(first), (kv_base // STAGES) & 1)
        _take_turn(turn, turn_base, WG)
        k_t = k_smem.index(first).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        s = warpgroup_mma(q, k_t, s_init, use_acc=False, is_async=True)
        _pass_turn(turn, WG)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(first), count=1)
        # Masked whatever n_full says: once per tile, and no branch.
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, offs_m, 0, qk_scale, seqlen_k,
                                             diag_offset, True, IS_CAUSAL, IS_FP8,
                                             TREE_MAX, ONE_BOUND)
        # Block 0's alpha is 0 (or NaN with NaN scores): O is 0 before it either way.
        alpha_o = gl.convert_layout(alpha, o_row_layout)
        if P_SMEM:
            p_op = p_smem.index(2 * WG)
            if PERSISTENT and O_IN_P:
                tma.store_wait(0)  # the previous tile's O has left this buffer
            p_op.store(_p_stored(p, p_dtype, P_SMEM))
            fence_async_shared()
        else:
            p_op = _p_operand(p, acc, p_dtype, P_PACKED)
        # Blocks every row sees in full skip the mask; the masked ones (the causal
        # diagonal, the ragged end) follow in a loop of their own: no branch per block.
        for j in range(1, n_full):
            acc, p_op, alpha_o, m_i, l_i = _kv_block(
                j, kv_base, turn_base, q, k_smem, v_smem, p_smem, k_ready, k_empty, v_ready,
                v_empty, turn, acc, p_op, alpha_o, m_i, l_i, s_init, o_init, offs_m, qk_scale,
                seqlen_k, diag_offset, WG, False, IS_CAUSAL, PV_PER_TILE, P_SMEM,
                P_PACKED, TREE_MAX, ONE_BOUND)
        for j in range(gl.maximum(n_full, 1), n_blocks):
            acc, p_op, alpha_o, m_i, l_i = _kv_block(
                j, kv_base, turn_base, q, k_smem, v_smem, p_smem, k_ready, k_empty, v_ready,
                v_empty, turn, acc, p_op, alpha_o, m_i, l_i, s_init, o_init, offs_m, qk_scale,
                seqlen_k, diag_offset, WG, True, IS_CAUSAL, PV_PER_TILE, P_SMEM,
                P_PACKED, TREE_MAX, ONE_BOUND)
        if EARLY_Q_RELEASE:  # every S of the tile is done: Q may take the next tile's
            mbarrier.arrive(q_empty.index(q_at), count=1)
        last_kv = kv_base + n_blocks - 1
        last = last_kv % STAGES
        mbarrier.wait(v_ready.index(last), (last_kv // STAGES) & 1)
        _take_turn(turn, turn_base + n_blocks, WG)
        v_op = _v_operand(v_smem, last, BLOCK_N, HEAD_DIM)
        p_op = _pv_operand(p_op, acc, p_dtype, P_PACKED)
        if PV_PER_TILE:
            pv = warpgroup_mma(p_op, v_op, o_init, use_acc=False, is_async=True)
        else:
            acc = warpgroup_mma(p_op, v_op, acc, is_async=True)
        _pass_turn(turn, WG)
        if PV_PER_TILE:
            pv = warpgroup_mma_wait(0, deps=(pv,))
            acc = acc * gl.expand_dims(alpha_o, 1) + pv
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last), count=1)
        if OWN_BLOCKS:
            # The tile's blocks past this warpgroup's own (causal walks, rows past
            # seqlen_q): only the protocol, so the other warpgroups issue back to back.
            for j in range(n_blocks, n_tile):
                c = kv_base + j
                stage = c % STAGES
                phase = (c // STAGES) & 1
                mbarrier.wait(k_ready.index(stage), phase)
                mbarrier.arrive(k_empty.index(stage), count=1)
                mbarrier.wait(v_ready.index(stage), phase)
                mbarrier.arrive(v_empty.index(stage), count=1)
                _take_turn(turn, turn_base + j + 1, WG)
                _pass_turn(turn, WG)
    elif EARLY_Q_RELEASE:  # no key for this tile: Q was not read
        mbarrier.arrive(q_empty.index(q_at), count=1)

    # Rows that saw no key (l == 0): out 0 and lse -inf, as flashtile.ops.fwd writes them,
    # even where a NaN value reached acc as 0 * NaN; a NaN that reached l stays NaN.
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    log2_l = gl.log2(l_safe)
    if IS_FP8:
        log2_l -= P_LOG2_OFFSET  # l summed P scaled by 2**P_LOG2_OFFSET
    lse = gl.where(empty, float("-inf"), (m_i + log2_l) * LN2)
    inv_l = 1.0 / l_safe
    if HAS_V_DESCALE:  # FP8: v's factor multiplies the output, once per row
        inv_l = inv_l * gl.load(VDescale + v_descale_off)
    inv_l = gl.convert_layout(inv_l, o_row_layout)
    out = gl.where(gl.expand_dims(gl.convert_layout(empty, o_row_layout), 1), 0.0,
                   acc * gl.expand_dims(inv_l, 1))
    if EARLY_Q_RELEASE:
        tma.store_wait(0)  # the previous tile's O has left the buffer
    if O_IN_P:
        o_tile = o_smem.index(2 * WG)  # the warpgroup's first P buffer
    else:
        o_tile = o_smem.index(WG)
    o_tile.reshape([BLOCK_M_WG, HEAD_DIM]).store(out.to(o_smem.dtype))
    fence_async_shared()  # the generic-proxy writes above before the TMA engine reads
    tma.async_copy_shared_to_global(o_desc, [off_b, row0 + WG * BLOCK_M_WG, off_h, 0],
                                    o_tile)
    gl.store(Lse + lse_row0 + offs_m, lse, mask=offs_m < seqlen_q)
    if not EARLY_Q_RELEASE:
        tma.store_wait(0)
        if PERSISTENT:  # O left through Q's buffer: now the next tile's Q may come
            mbarrier.arrive(q_empty.index(WG), count=1)


@gluon.jit
def _mma_partition(args, WG: gl.constexpr, IS_CAUSAL: gl.constexpr,
                   HAS_Q_DESCALE: gl.constexpr, HAS_K_DESCALE: gl.constexpr,
                   HAS_V_DESCALE: gl.constexpr, PV_PER_TILE: gl.constexpr,
                   P_SMEM: gl.constexpr, PERSISTENT: gl.constexpr,
                   O_IN_Q: gl.constexpr, O_IN_P: gl.constexpr, Q_BUFS: gl.constexpr,
                   TREE_MAX: gl.constexpr, P_PACKED: gl.constexpr):
    """Consumer warpgroup WG: rows 64 * WG + [0, 64) of each tile of the program, in the
    producer's order (``_tile_at``)."""
    (q_smem, k_smem, v_smem, o_smem, p_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
     v_empty, turn, o_desc, Lse, QDescale, KDescale, VDescale, nheads, group_size,
     seqlen_q, seqlen_k, diag_offset, stride_qdesc_b, stride_qdesc_h, stride_kdesc_b,
     stride_kdesc_h, stride_vdesc_b, stride_vdesc_h, softmax_scale, n_tiles_m, Schedule,
     schedule_row) = args
    BLOCK_N: gl.constexpr = k_smem.type.shape[2]
    NUM_WG: gl.constexpr = q_smem.type.shape[0] // Q_BUFS
    kv_base = 0  # K/V blocks and turns of the program's earlier tiles
    turn_base = 0
    for i in range(_tile_count(Schedule, schedule_row, PERSISTENT)):
        off_bh, off_b, off_h, off_hkv, row0, n_blocks, n_full = _tile_at(
            i, Schedule, schedule_row, n_tiles_m, nheads, group_size, seqlen_q, seqlen_k,
            diag_offset, NUM_WG * BLOCK_M_WG, BLOCK_N, PERSISTENT, IS_CAUSAL)
        # FP8 descales of (batch, KV head): q's and k's multiply every score, so they join
        # the exp2's scale (as in flashtile.ops.fwd); v's multiplies the output.
        scale = softmax_scale
        if HAS_Q_DESCALE:
            scale *= gl.load(QDescale + off_b * stride_qdesc_b + off_hkv * stride_qdesc_h)
        if HAS_K_DESCALE:
            scale *= gl.load(KDescale + off_b * stride_kdesc_b + off_hkv * stride_kdesc_h)
        _mma_tile(i, kv_base, turn_base, q_smem, k_smem, v_smem, o_smem, p_smem, q_ready,
                  q_empty, k_ready, k_empty, v_ready, v_empty, turn, o_desc, Lse, VDescale,
                  off_b, off_h, row0, n_blocks, n_full, seqlen_q, seqlen_k, diag_offset,
                  scale * LOG2E, off_bh * seqlen_q,  # lse: (batch, nheads, seqlen_q)
                  off_b * stride_vdesc_b + off_hkv * stride_vdesc_h, WG, IS_CAUSAL,
                  HAS_V_DESCALE, PV_PER_TILE, P_SMEM, PERSISTENT, O_IN_Q, O_IN_P, Q_BUFS,
                  TREE_MAX, P_PACKED)
        kv_base += n_blocks
        turn_base += n_blocks + (n_blocks > 0).to(gl.int32)  # the last P V's turn
    if PERSISTENT and not O_IN_Q:
        tma.store_wait(0)


@gluon.jit
def _attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, Lse, QDescale, KDescale,
                            VDescale, seqlen_q, seqlen_k, nheads, group_size, diag_offset,
                            stride_qdesc_b, stride_qdesc_h, stride_kdesc_b, stride_kdesc_h,
                            stride_vdesc_b, stride_vdesc_h, softmax_scale, n_tiles_m, Schedule,
                            schedule_row, IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                            HAS_Q_DESCALE: gl.constexpr, HAS_K_DESCALE: gl.constexpr,
                            HAS_V_DESCALE: gl.constexpr, PV_PER_TILE: gl.constexpr,
                            P_SMEM: gl.constexpr, PERSISTENT: gl.constexpr,
                            NUM_WG: gl.constexpr, Q_BUFS: gl.constexpr,
                            TREE_MAX: gl.constexpr, P_PACKED: gl.constexpr):
    """One program a (query tile, batch-head) of the (n_tiles_m, batch * nheads) grid,
    or (PERSISTENT) a program per SM walking its row of the host's Schedule. NUM_WG
    consumer warpgroups of 64 rows each: 2, or 3 (BLOCK_M 192, where the module
    docstring and configs.hopper_fwd_config allow it). Q_BUFS: 1, or 2 (PERSISTENT with
    O in a buffer of its own: the next tile's Q loads during this one,
    ``_load_partition``)."""
    gl.static_assert(NUM_WG == 2 or NUM_WG == 3, "2 or 3 consumer warpgroups")
    gl.static_assert(Q_BUFS == 1 or (Q_BUFS == 2 and PERSISTENT),
                     "a second Q buffer set serves the persistent grid only")
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(q_desc.dtype,
                                       [Q_BUFS * NUM_WG] + q_desc.block_type.shape,
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape,
                                       k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape,
                                       v_desc.layout)
    # Where O is staged for its TMA store. A buffer of its own where shared memory has
    # room and it is needed: FP8 (16-bit O, twice Q's bytes) and PERSISTENT (16-bit d64
    # and d128; d256's 64 KiB would pass 227 KiB), so that Q's is free for the next tile
    # once the last S is done and O's store overlaps the next tile. Else FP8 with P in
    # shared memory where O does not fit (BLOCK_N 256 at d128): the warpgroup's first P
    # buffer, the same bytes, free once the last P V is done. Else (16-bit) Q's buffer:
    # S_{n-1}, its last reader, has completed when O is stored.
    O_BYTES: gl.constexpr = NUM_WG * o_desc.block_type.nbytes
    P_BYTES: gl.constexpr = 2 * NUM_WG * BLOCK_M_WG * BLOCK_N \
        * v_desc.dtype.primitive_bitwidth // 8 if P_SMEM else 0
    USED_BYTES: gl.constexpr = Q_BUFS * NUM_WG * q_desc.block_type.nbytes + STAGES * (
        k_desc.block_type.nbytes + v_desc.block_type.nbytes) + P_BYTES
    O_FITS: gl.constexpr = USED_BYTES + O_BYTES <= SMEM_BYTES - 1024
    O_IN_P: gl.constexpr = P_SMEM and not O_FITS
    O_IN_Q: gl.constexpr = o_desc.dtype == q_desc.dtype and not (PERSISTENT and O_FITS)
    gl.static_assert(Q_BUFS == 1 or not (O_IN_Q or O_IN_P),
                     "a second Q buffer set needs O in a buffer of its own")
    if not (O_IN_P or O_IN_Q):
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [NUM_WG] + o_desc.block_type.shape,
                                           o_desc.layout)
    if P_SMEM:  # two P buffers per consumer warpgroup, in V's format
        p_smem = gl.allocate_shared_memory(
            v_desc.dtype, [2 * NUM_WG, BLOCK_M_WG, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M_WG, BLOCK_N], v_desc.dtype))
    else:
        p_smem = q_smem  # not read: P stays in registers
    if O_IN_P:
        gl.static_assert(o_desc.block_type.nbytes == P_BYTES // (2 * NUM_WG),
                         "O staged in P's buffers needs a P buffer of O's bytes")
        o_smem = p_smem._reinterpret(o_desc.dtype, [2 * NUM_WG] + o_desc.block_type.shape,
                                     o_desc.layout)
    elif O_IN_Q:
        o_smem = q_smem
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS * NUM_WG, 1],
                                        mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS * NUM_WG, 1],
                                        mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_WG):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)  # its consumer warpgroup's
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(NUM_WG, Q_BUFS * NUM_WG):  # the second Q set's
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=NUM_WG)

    # The partitions' runtime arguments in one tuple each; their constants (WG, the
    # flags) stay outside it: a tuple held in a variable turns constants into runtime
    # values.
    load_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                 k_empty, v_ready, v_empty, nheads, group_size, seqlen_q, seqlen_k,
                 diag_offset, n_tiles_m, Schedule, schedule_row)
    mma_args = (q_smem, k_smem, v_smem, o_smem, p_smem, q_ready, q_empty, k_ready, k_empty,
                v_ready, v_empty, turn, o_desc, Lse, QDescale, KDescale, VDescale, nheads,
                group_size, seqlen_q, seqlen_k, diag_offset, stride_qdesc_b, stride_qdesc_h,
                stride_kdesc_b, stride_kdesc_h, stride_vdesc_b, stride_vdesc_h,
                softmax_scale, n_tiles_m, Schedule, schedule_row)
    # Two calls, not one list built by NUM_WG: the frontend takes the partition list as
    # a literal only (and a partition, function and arguments, cannot be held in a
    # variable).
    if NUM_WG == 3:
        gl.warp_specialize([
            (_mma_partition, (mma_args, 0, IS_CAUSAL, HAS_Q_DESCALE, HAS_K_DESCALE,
                              HAS_V_DESCALE, PV_PER_TILE, P_SMEM, PERSISTENT, O_IN_Q,
                              O_IN_P, Q_BUFS, TREE_MAX, P_PACKED)),
            (_load_partition, (load_args, IS_CAUSAL, PERSISTENT, Q_BUFS)),
            (_mma_partition, (mma_args, 1, IS_CAUSAL, HAS_Q_DESCALE, HAS_K_DESCALE,
                              HAS_V_DESCALE, PV_PER_TILE, P_SMEM, PERSISTENT, O_IN_Q,
                              O_IN_P, Q_BUFS, TREE_MAX, P_PACKED)),
            (_mma_partition, (mma_args, 2, IS_CAUSAL, HAS_Q_DESCALE, HAS_K_DESCALE,
                              HAS_V_DESCALE, PV_PER_TILE, P_SMEM, PERSISTENT, O_IN_Q,
                              O_IN_P, Q_BUFS, TREE_MAX, P_PACKED)),
        ], [1, 4, 4], [PRODUCER_REGS, CONSUMER_REGS_3WG, CONSUMER_REGS_3WG])
    else:
        gl.warp_specialize([
            (_mma_partition, (mma_args, 0, IS_CAUSAL, HAS_Q_DESCALE, HAS_K_DESCALE,
                              HAS_V_DESCALE, PV_PER_TILE, P_SMEM, PERSISTENT, O_IN_Q,
                              O_IN_P, Q_BUFS, TREE_MAX, P_PACKED)),
            (_load_partition, (load_args, IS_CAUSAL, PERSISTENT, Q_BUFS)),
            (_mma_partition, (mma_args, 1, IS_CAUSAL, HAS_Q_DESCALE, HAS_K_DESCALE,
                              HAS_V_DESCALE, PV_PER_TILE, P_SMEM, PERSISTENT, O_IN_Q,
                              O_IN_P, Q_BUFS, TREE_MAX, P_PACKED)),
        ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16,
              torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}
# FP8 outputs this kernel writes (through a TMA store from a 16-bit tile): flash-attn 3's
# bfloat16 default and float16; float32 stays on the portable kernel.
_FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _on_hopper(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) == (9, 0))


def unsupported(q, k, v, *, softmax_scale=1.0, attn_mask=None, alibi_slopes=None,
                window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0,
                out_dtype=None, **_) -> str | None:
    """Why this kernel cannot serve the call (None: it can). The arguments are those of
    ``flashtile.ops.fwd.attn_fwd`` for a dense call, already validated (FP8: q, k, v in
    one float8 dtype, descales checked by ``flashtile.fp8``). Three parts: the call's
    options, what q's, k's and v's layout fixes (a caller may remember that answer per
    layout), and their addresses."""
    return options_unsupported(
        q, softmax_scale=softmax_scale, attn_mask=attn_mask, alibi_slopes=alibi_slopes,
        window_left=window_left, window_right=window_right, softcap=softcap,
        dropout_p=dropout_p, out_dtype=out_dtype) \
        or layout_unsupported(q, k, v) or (_TMA if misaligned(q, k, v) else None)


def options_unsupported(q, *, softmax_scale, attn_mask, alibi_slopes, window_left,
                        window_right, softcap, dropout_p, out_dtype=None) -> str | None:
    """``unsupported``'s checks of the call's options."""
    if not softmax_scale > 0:
        return f"softmax_scale {softmax_scale}: > 0 only (the row max is taken unscaled)"
    if q.element_size() == 1 and (out_dtype or torch.bfloat16) not in _FP8_OUT_DTYPES:
        return f"out_dtype {out_dtype}: bfloat16 or float16 only for float8 inputs"
    if attn_mask is not None or alibi_slopes is not None or softcap > 0 \
            or window_left >= 0 or window_right > 0:
        return "causal or full attention only (no attn_mask, ALiBi, softcap or window)"
    if dropout_p > 0:
        return "dropout_p > 0 (no dropout mask in this kernel)"
    return None


_TMA = "TMA needs 16-byte aligned data and strides, and a contiguous last dim"


def layout_unsupported(q, k, v) -> str | None:
    """``unsupported``'s checks of what a layout fixes (dtype, shapes, strides, device):
    a caller may remember the answer per layout and check only ``options_unsupported``
    and ``misaligned`` per call."""
    if not _on_hopper(q.device):
        return "it needs an sm_90 (Hopper) CUDA device"
    if q.dtype not in _GL_DTYPES:
        return f"dtype {q.dtype}: float16, bfloat16 or float8 (e4m3fn, e5m2) only"
    fp8 = q.element_size() == 1
    if configs.hopper_fwd_tile_dim(q.shape[-1], fp8) is None:
        table = configs.HOPPER_FWD_FP8 if fp8 else configs.HOPPER_FWD_16BIT
        dims = sorted(table) if fp8 else sorted([*table, *configs.HOPPER_WIDER])
        return f"head_dim {q.shape[-1]}: one of {dims} only"
    if v.shape[-1] != q.shape[-1]:
        return f"value head_dim {v.shape[-1]} != query head_dim {q.shape[-1]} (one tile)"
    if q.numel() == 0 or k.numel() == 0:
        return "an empty q or k (TMA descriptors need every size >= 1)"
    # FP8 v is read through its keys-contiguous copy, which the launcher allocates.
    # TMA: strides of 16 bytes, unit inner stride (and aligned data: ``misaligned``).
    size = q.element_size()
    if not (_tma_strides(q.stride(), size) and _tma_strides(k.stride(), size)
            and (fp8 or _tma_strides(v.stride(), size))):
        return _TMA
    return None


def misaligned(q, k, v) -> bool:
    """Whether a tensor map cannot start at q's, k's or (16-bit) v's address."""
    return bool((q.data_ptr() | k.data_ptr()
                 | (0 if q.element_size() == 1 else v.data_ptr())) & 15)


@functools.lru_cache(maxsize=4096)
def _tma_strides(strides: tuple, element_size: int) -> bool:
    """Strides a tensor map takes: unit inner stride, the others positive multiples of
    16 bytes (a zero stride, an expanded tensor, is not a tensor map). Cached: the
    layouts of a process are few, and the check runs on every call."""
    return strides[-1] == 1 and all(s > 0 and s * element_size % 16 == 0
                                    for s in strides[:-1])


@functools.lru_cache(maxsize=None)
def _smem_layout(box: tuple, dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(box), dtype)


def _descriptor(x, box) -> TensorDescriptor:
    """A 4-d tensor map over x with ``box``-shaped boxes: (1, rows, 1, head_dim) over
    (batch, seqlen, heads, head_dim), or FP8 V^T's (1, 1, head_dim, keys) over (batch,
    heads, head_dim, seqlen). Boxes past the end are zero-filled on load, dropped on
    store."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), list(box),
                            _smem_layout(tuple(box), _GL_DTYPES[x.dtype]))


def _keys_contiguous_t(v, p_smem: int):
    """FP8 v through the portable kernel's keys-contiguous copy (the K-major B operand
    8-bit wgmma needs for P V), viewed (batch, nheads_kv, head_dim, seqlen_k): keys
    contiguous, rows padded to FP8_V_PAD keys (16-byte strides, as TMA needs); each 32
    keys in P's "swap" order where the kernel stores P so (p_smem 2, ``_p_stored``)."""
    return keys_contiguous(v, FP8_V_PAD, swap32=p_smem == 2).permute(0, 2, 3, 1)


def _v_descriptor(v, block_n: int, d: int, p_smem: int = 1) -> TensorDescriptor:
    """V's tensor map in boxes of ``block_n`` keys and the tile's head dim ``d``."""
    if v.element_size() != 1:
        return _descriptor(v, (1, block_n, 1, d))
    return _descriptor(_keys_contiguous_t(v, p_smem), (1, 1, d, block_n))


def attn_fwd(q, k, v, *, attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
             window_right, softcap, allow_tf32, q_descale=None, k_descale=None,
             v_descale=None, out_dtype=None):
    """``flashtile.ops.fwd.attn_fwd`` for the dense calls ``unsupported`` accepts: q (b,
    sq, h, d), k/v (b, sk, hkv, d); returns out (b, sq, h, d) contiguous in q's dtype
    (FP8: out_dtype, default bfloat16) and lse (b, h, sq) fp32. Causal is
    ``window_right == 0`` with ``diag_offset``'s alignment; allow_tf32 is moot for 16-bit
    and FP8 inputs. FP8: q_descale/k_descale/v_descale None (1.0) or fp32 (b, hkv), any
    strides, as ``flashtile.ops.fwd.attn_fwd`` takes them."""
    reason = unsupported(q, k, v, softmax_scale=softmax_scale, attn_mask=attn_mask,
                         alibi_slopes=alibi_slopes, window_left=window_left,
                         window_right=window_right, softcap=softcap, out_dtype=out_dtype)
    if reason is not None:
        raise ValueError(f"flashtile.ops.fwd_hopper cannot run this call: {reason}; "
                         "use flashtile.ops.fwd.attn_fwd")
    return forward(q, k, v, softmax_scale, diag_offset, causal=window_right == 0,
                   q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                   out_dtype=out_dtype)


# The parameters a launch plan fills per call, in the kernel's order.
_SLOTS = ("q_desc", "k_desc", "v_desc", "o_desc", "Lse", "QDescale", "KDescale",
          "VDescale", "softmax_scale", "Schedule")


def forward(q, k, v, softmax_scale, diag_offset, causal, q_descale=None, k_descale=None,
            v_descale=None, out_dtype=None, return_lse=True):
    """``attn_fwd`` without its check, for a caller that has had ``unsupported`` answer
    None for these tensors (flashtile's custom ops do). After the first call of a
    layout, a launch plan (``flashtile.ops._launch``) launches the compiled kernel
    directly, encoding the four tensor maps from the call's tensors: Triton's own path
    binds and specialises the arguments and validates four tensor descriptors on every
    call, 4x the portable kernel's planned host time at 1k queries
    (docs/benchmarks/host-h200.md, session 11). return_lse=False: lse is written into
    out's allocation (one allocation less) and None is returned for it."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    fp8 = q.element_size() == 1
    out_dtype = (out_dtype or torch.bfloat16) if fp8 else q.dtype
    tile_d = configs.hopper_fwd_tile_dim(d, fp8)  # the kernel's (boxes past d read 0)
    if return_lse:
        out = torch.empty((b, sq, h, d), dtype=out_dtype, device=q.device)
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
        lse_ptr = lse.data_ptr()
    else:
        out, buf, lse_at = _launch.out_with_lse((b, sq, h, d), out_dtype, b * h * sq,
                                                q.device)
        lse, lse_ptr = None, buf.data_ptr() + lse_at
    descales = (q_descale, k_descale, v_descale)
    p_smem = fp8 and configs.hopper_fwd_fp8_p_smem()
    persistent = configs.hopper_fwd_persistent(tile_d, fp8, sq)
    q_bufs = configs.hopper_fwd_q_buffers(tile_d) if persistent and not fp8 else 1
    tree_choice = configs.hopper_fwd_tree_max_choice()
    packed_choice = configs.hopper_fwd_p_packed_choice()
    pv_per_tile = fp8 and configs.hopper_fwd_fp8_pv_per_tile(tile_d)
    key = None
    if _launch.ready(q):
        # unsupported() has checked q's and k's (and 16-bit v's) addresses for TMA's
        # 16-byte alignment; out, lse and FP8 v's copy are allocated here (aligned). The
        # descales' strides are arguments and their addresses are specialised on.
        # Absent descales: lse's address stands in (never read: HAS_*_DESCALE is False).
        if fp8:
            scales = tuple(lse_ptr if x is None else x.data_ptr() for x in descales)
            fp8_key = (out_dtype, v.shape, p_smem, pv_per_tile,
                       *map(_launch.layout, descales), _launch.misalignment(scales))
        else:  # 16-bit: the key's FP8 part is constant
            scales, fp8_key = (lse_ptr, lse_ptr, lse_ptr), None
        key = ("hopper_fwd", q.dtype, q.shape, k.shape, q.stride(), k.stride(),
               None if fp8 else v.stride(), causal, diag_offset, persistent, q_bufs,
               tree_choice, packed_choice, fp8_key)
        found = _launch.lookup(key)
        if found is not None:
            plan, schedule = found  # the plan encodes the tensor maps from the tensors
            plan((q, k, _keys_contiguous_t(v, p_smem) if fp8 else v, out, lse_ptr, *scales,
                  softmax_scale, lse_ptr if schedule is False else schedule.data_ptr()))
            return out, lse
    if lse is None:  # Triton's own launch takes tensors
        lse = _launch.lse_after(buf, lse_at, (b, h, sq))
    scales = tuple(lse if x is None else x for x in descales)
    schedule = lse  # the tiles grid reads no schedule (lse's address stands in)
    if persistent:
        schedule = _persistent_schedule(q, k, causal, diag_offset)
        if schedule is None:  # capturing a CUDA graph: the tiles grid, and no plan
            persistent, key = False, None
        schedule = lse if schedule is None else schedule
    cfg = configs.hopper_fwd_config(tile_d, fp8, sq, sk, causal)
    if not persistent:  # (a CUDA-graph capture takes the tiles grid)
        q_bufs = 1
    num_wg = cfg.block_m // BLOCK_M_WG.value
    flags = dict(IS_CAUSAL=causal, STAGES=cfg.num_stages,
                 HAS_Q_DESCALE=q_descale is not None, HAS_K_DESCALE=k_descale is not None,
                 HAS_V_DESCALE=v_descale is not None,
                 PV_PER_TILE=pv_per_tile, P_SMEM=p_smem, PERSISTENT=persistent,
                 NUM_WG=num_wg, Q_BUFS=_q_buffers(q_bufs, tile_d, cfg),
                 TREE_MAX=configs.hopper_fwd_tree_max(tree_choice, num_wg, fp8),
                 P_PACKED=configs.hopper_fwd_p_packed(packed_choice, fp8))
    configs.log_first_launch("hopper forward", q, d, cfg, flags)
    n_tiles_m = configs.cdiv(sq, cfg.block_m)
    grid = (schedule.shape[0],) if persistent else (n_tiles_m, b * h)
    rows = BLOCK_M_WG.value
    descs = (_descriptor(q, (1, rows, 1, tile_d)),
             _descriptor(k, (1, cfg.block_n, 1, tile_d)),
             _v_descriptor(v, cfg.block_n, tile_d, p_smem), _descriptor(out, (1, rows, 1, tile_d)))
    strides = tuple(s for x in descales for s in ((0, 0) if x is None else x.stride()))
    plan = _launch.first_launch(
        _attn_fwd_hopper_kernel, grid,
        (*descs, lse, *scales, sq, sk, h, h // hkv, diag_offset, *strides, softmax_scale,
         n_tiles_m, schedule, schedule.stride(0) if persistent else 0),
        dict(flags, num_warps=cfg.num_warps), slots=_SLOTS if key is not None else None)
    if key is not None and plan is not None:
        # The schedule itself, not its address: the plan keeps it alive. (False, not
        # None, for the tiles grid: store() drops a tuple holding None.)
        _launch.store(key, (plan, schedule if persistent else False))
    return out, lse if return_lse else None


def _q_buffers(requested: int, tile_d: int, cfg) -> int:
    """The kernel's Q_BUFS for a 16-bit persistent launch that asks for ``requested``
    Q buffer sets: 2 where two sets, the K/V ring and O's own buffer fit shared memory
    (the kernel's O_FITS, which a second set must not turn off), else 1."""
    if requested == 1:
        return 1
    q_set = cfg.block_m * tile_d * 2  # one Q set; O's buffer is as large
    ring = cfg.num_stages * 2 * cfg.block_n * tile_d * 2
    return 2 if 3 * q_set + ring <= configs.SM90_SMEM_BYTES - 1024 else 1


# K and V bytes the persistent causal order keeps in L2 at once (FA3's tile scheduler
# takes 32 MiB of the H100's 50 MiB L2 for K and V; the H200's is the same size).
L2_KV_BYTES = 32 << 20
# A tile's prologue and epilogue (Q's load, the first K's latency, O's store) in key
# blocks, for the schedule's cost model: about one block's time at head_dim 128.
TILE_OVERHEAD_BLOCKS = 1


def schedule_rows(seqlen_q, seqlen_k, head_dim, element_size, n_bh, group_size,
                  diag_offset, block_m, block_n, num_programs) -> list[list[int]]:
    """The persistent forward's tiles per program: row p lists program p's tiles in
    order, each off_bh * n_tiles_m + query tile; diag_offset None for full attention.

    Tiles are dealt in FA3's order to whichever program has the least work so far (its
    dynamic scheduler's greedy list schedule, computed here once per geometry instead of
    with an atomic counter): batch-heads in groups whose K and V fit L2_KV_BYTES (causal;
    full attention takes one head at a time, heads of one batch in turn), inside a group
    the query tiles from the most keys to the fewest with the group's heads interleaved
    (longest processing time first). A tile costs its key blocks plus
    TILE_OVERHEAD_BLOCKS."""
    n_tiles_m = -(-seqlen_q // block_m)
    if diag_offset is None:
        heads = 1
        blocks = [-(-seqlen_k // block_n)] * n_tiles_m
    else:
        kv_heads = max(1, L2_KV_BYTES // (seqlen_k * 2 * head_dim * element_size))
        heads = min(n_bh, kv_heads * group_size)
        # _tile_blocks' n_blocks per query tile (the keys its last row sees).
        blocks = [-(-min(seqlen_k, max(min(m * block_m + block_m, seqlen_q) + diag_offset,
                                       0)) // block_n) for m in range(n_tiles_m)]
    tiles = sorted(range(n_tiles_m), key=lambda m: -blocks[m])  # stable: ties in order
    rows = [[] for _ in range(min(num_programs, n_tiles_m * n_bh))]
    load = [(0, p) for p in range(len(rows))]  # a heap of (work so far, program)
    for first in range(0, n_bh, heads):
        group = range(first, min(first + heads, n_bh))
        for m in tiles:
            for bh in group:
                work, p = heapq.heappop(load)
                rows[p].append(bh * n_tiles_m + m)
                heapq.heappush(load, (work + blocks[m] + TILE_OVERHEAD_BLOCKS, p))
    return rows


# The persistent grid's tile tables by (device, geometry): a few KiB each, made once.
_SCHEDULES: dict = {}


def _persistent_schedule(q, k, causal, diag_offset) -> Optional[torch.Tensor]:
    """The persistent grid's tile lists for this call (``_schedule_table``), or None
    when the table is not made yet and a CUDA graph is being captured on the current
    stream: copying it to the device there would break the capture, so that call takes
    the tiles grid (a capture made after an eager call of the same geometry gets the
    persistent one)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    fp8 = q.element_size() == 1
    cfg = configs.hopper_fwd_config(configs.hopper_fwd_tile_dim(d, fp8), fp8, sq, sk,
                                    causal)
    key = (q.device, sq, sk, d, q.element_size(), b * h, h // hkv,
           diag_offset if causal else None, cfg.block_m, cfg.block_n)
    table = _SCHEDULES.get(key)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        table = _SCHEDULES[key] = _schedule_table(*key)
    return table


def _schedule_table(device, *geometry) -> torch.Tensor:
    """``schedule_rows`` for this device's SMs as the kernel reads it: int32 (programs,
    1 + most tiles), each row its count and then its tiles (a few KiB a geometry)."""
    rows = schedule_rows(*geometry, num_programs=_num_sms(device))
    width = 1 + max(map(len, rows))
    table = [[len(r), *r] + [0] * (width - 1 - len(r)) for r in rows]
    return torch.tensor(table, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count

