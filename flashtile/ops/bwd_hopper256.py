"""FlashAttention backward for Hopper (sm_90) in Gluon at head_dim 256.

The algorithm, layouts, masks and launcher are bwd_hopper's (its docstring): P is
recomputed from the forward's lse in base 2, dS = P * (dP - delta), dQ summed over the
key blocks in fp32 by TMA reduce-adds (dq_tma, below) or relaxed atomics; dense
layout, GQA/MQA with the same ``head_split``, causal (any ``diag_offset``) or full.
What changes is the split of the work, because bwd_hopper's does not fit: there each
consumer warpgroup holds dK and dV of its 64 keys in fp32 registers, 2 x 64 x head_dim /
128 threads = 256 registers a thread at head_dim 256, over the 240 that setmaxnreg gives
a consumer.

One program owns 64 keys of one (batch, KV head) (bwd_hopper: 128) and walks every query
block of the group's query heads. Three warp-specialised partitions:
- the producer warp (bwd_hopper's ``_load_partition``) loads K and V (64 x 256 each) once
  and streams Q_i and dO_i (BLOCK_M = 64 rows x 256) through a ring of 2 stages by TMA;
- two consumer warpgroups split the head dim of the accumulators: warpgroup w owns
  dK[:, 128w:128w+128] and dV[:, 128w:128w+128], and no product is computed twice.
  Per query block, warpgroup 0 computes S^T = K Q^T (64 x 64, the whole 256 contraction
  from shared memory) and P^T, and stores P^T (16-bit) to shared memory; warpgroup 1
  computes dP^T = V dO^T meanwhile, reads P^T, forms dS^T = P^T * (dP^T - delta) and
  stores it (16-bit) to shared memory. Then each warpgroup w adds
  dV_w += P^T dO[:, w-half] and dK_w += dS^T Q[:, w-half] (warpgroup 0: P^T from its
  registers, dS^T from shared memory; warpgroup 1: both from its registers), and
  dQ_partial = dS K for head dims [128w, 128w + 128) in two products of 64 (dS^T read
  transposed from shared memory), each added to the fp32 accumulator by a TMA
  reduce-add (dq_tma, below) or with relaxed two-value atomics straight from the wgmma
  layout, as bwd_hopper's.
  Hand-offs, each an mbarrier: pt_full (P^T stored) / pt_empty (warpgroup 1 read it),
  ds_full (dS^T stored, fenced for wgmma) / ds_empty (both warpgroups' dK and dQ
  products that read it have completed); out_ready (both halves of dK and dV staged in
  K's and V's buffers, fenced for TMA) before warpgroup 0 stores them.
  P^T goes to warpgroup 1 in 16 bits, so its dS^T = P^T * (dP^T - delta) uses P rounded
  once more than bwd_hopper's (2^-9 relative, the size of dS^T's own rounding to 16 bits
  before its products); dV's product takes the same 16-bit P in both kernels.

Register budget of a consumer (240 a thread under setmaxnreg; 128 threads): dK_w and dV_w
64 x 128 fp32 each, 64 + 64 = 128 live across the walk; S^T or dP^T 64 x 64 fp32, 32;
P^T and dS^T as 16-bit A operands, 16 each; a dQ piece 64 x 64 fp32, 32, once S^T/dP^T
are dead: at most ~128 + 32 + 2 x 16 + 32 tiles plus addresses. The producer keeps 24.
Shared memory (bytes): K 32K + V 32K + Q 2 x 32K + dO 2 x 32K + P^T 8K + dS^T 8K = 208
KiB (+ barriers) of the 227 KiB limit (configs.SM90_SMEM_BYTES); a third ring stage
would need 272. dK and dV leave through K's and V's buffers once the last product that
reads them (each warpgroup's last dQ, behind its S^T or dP^T) has completed: ds_empty's
last phase. dq_tma adds none (its tiles are the block's Q and dO buffers).

dq_tma (DQ_TMA; FLASHTILE_HOPPER_BWD_OPTS' option, the default since session 19): each dQ
piece leaves as bwd_hopper's dq_tma (``_dq_piece``): stored (fp32, 16 two-value shared stores a
thread) into a 64 x 64 tile and added into the accumulator by one TMA reduce-add
(cp.reduce.async.bulk.tensor .add, two 32-column messages), in place of 16 REDG.F32x2 a
thread and their row-mask branches; the TMA drops the rows past seqlen_q. At this head
dim each block adds a 64 x 256 fp32 piece per 64 keys, twice bwd_hopper's dQ bytes per
FLOP, and both consumers add theirs every block. There is no room for bwd_hopper's own
tiles (4 x 16 KiB; 18 KiB is left), and one 16 KiB tile for both warpgroups, or 8 KiB
each, would make every piece (or half) wait for the previous one's reduce-add to read
the tile. So the tiles are the block's Q and dO buffers, dead by then: Q's and dO's
last readers are S^T and dP^T (all 256 columns) and each warpgroup's dK and dV (its
half), and TMA loads each as four 64-column boxes, so bytes [16K w, 16K w + 16K) of
each buffer are head dims [128w, 128w + 128), which after its own dV and dK waits only
warpgroup w's products can still be reading: warpgroup 1 knows S^T has completed (P^T
was handed over after it, pt_full), warpgroup 0 knows dP^T has (ds_full). Warpgroup w
stores its first piece into Q's half w, its second into dO's, and arrives on the
stage's qdo_empty not after dV and dK but once its reduce-adds have read both: waited
for (tma.store_wait) at the next block's first product, about one block after they
were issued, so the producer gets the stage back one dQ phase later than with the
atomics (~1,000 of a block's ~9,000 clocks; it then has the rest of a block to load
it). The accumulator's tensor map spans (1, batch * nheads, seqlen_q, 256)
(``_dq_descriptor``): with a (batch, head) pair of coordinates ptxas stored and
reloaded 2 words a block inside warpgroup 1's causal walk.
Prediction (session 18, not run on a GPU): forward + backward +5-12% (the backward ~86%
of the time; +6-10% at d128 from half the dQ bytes per FLOP), least at causal 1k; 16k
tokens a batch, full 1k/4k/16k 289/326/334 -> ~305-320/345-365/355-375 TFLOP/s, causal
237/304/340 -> ~245-260/320-340/360-380. Within +-2% of the atomics at every length
would say the atomics are not a bound here (the chain of wgmma round trips and hand-offs
is); a loss would point at the later stage release (the ring) or the shared-memory
traffic (64 KiB more stored and read a block).

Rows past seqlen_q, keys past seqlen_k, rows that saw no key (lse = -inf) and NaN are
handled as in bwd_hopper: keys past seqlen_k masked in S^T, lse read as +inf past
seqlen_q and where it is -inf (P = 0), dK/dV rows past seqlen_k dropped by the TMA
store, dQ rows past seqlen_q by the atomics' mask (dq_tma: by the TMA reduce-add). Of
bwd_hopper's schedule options (FLASHTILE_HOPPER_BWD_OPTS) this kernel takes dq_tma and
lpt (its grid's order) alone (the others change a schedule it does not have); its STAGES
sweep is bwd_hopper's own.

Status: first run on the H200 in session 14 (docs/benchmarks/NOTES.md section 24): its
GPU tests passed and memcheck found 0 errors; forward+backward 288-335 TFLOP/s full and
236-327 causal (1k-8k tokens), 2.0-2.5x the portable split backward, 1.2-1.4x SDPA's
flash backend, 0.78-0.85x cuDNN's; since then FLASHTILE_HOPPER_BWD's default (auto, from
1k tokens, from 128 since session 22) runs it. tests/test_gluon_compile.py compiles it
for sm_90 on the CPU (Triton 3.6's ptxas): full and causal, bf16 and fp16, 213,648 bytes
of shared memory with and without dq_tma, no local-memory stores inside the walks,
HGMMA, setmaxnreg 24/240 (.maxnreg 168 at entry). The atomics: 32 REDG.F32x2 a thread a
block; causal, ptxas keeps the shared-memory base, 4 bytes, stored before the walk and
reloaded once a query block (8 bytes of stack; full: none). dq_tma: no REDG, 4 UTMAREDG,
no local memory at all. tests/test_bwd_hopper.py has its GPU tests (both dQ paths).
Session 19 (NOTES.md section 29): dq_tma GPU-correct, memcheck clean; forward+backward
at 16k tokens a batch 387-454 TFLOP/s full and 293-454 causal against the atomics'
289-335 and 236-340 (+24-36%), 1.06-1.11x and 1.00-1.07x cuDNN in the same runs. The
atomics were the bound: at 256 columns each dQ piece is 32 REDG.F32x2 a thread, twice
bwd_hopper's at d128.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from flashtile.ops._common import LOG2E
from flashtile.ops.bwd_hopper import (BLOCK_N_WG, CONSUMER_REGS, DQ_PIECE, PRODUCER_REGS,
                                      _a_operand, _acc_layout, _dq_piece, _load_partition,
                                      _lse2, _p_t, _program_walk, _row_vector)


@gluon.jit
def _dq_tile(ring, stage, WG: gl.constexpr, dq_desc):
    """DQ_TMA: warpgroup WG's fp32 dQ tile (64 x 64, dq_desc's box and layout) in stage
    ``stage`` of the Q or dO ring: the buffer's bytes [16K WG, 16K WG + 16K), which hold
    head dims [128 WG, 128 WG + 128) of its 64 x 256 16-bit tile (TMA loads it as four
    64-column boxes of 8 KiB, in order) and whose last readers are this warpgroup's own
    products (the module docstring)."""
    # The stage's 32 KiB as two fp32 tiles: (2, 1, 1, 64, 64).
    tiles = ring.index(stage)._reinterpret(gl.float32, [2] + dq_desc.block_type.shape,
                                           dq_desc.layout)
    return tiles.index(WG)


@gluon.jit
def _release_previous_stage(qdo_empty, it, STAGES: gl.constexpr):
    """DQ_TMA: the previous block's stage of the Q/dO ring back to the producer (none
    before the first block) once this warpgroup's TMA reduce-adds have read its dQ tiles
    there. Called at this block's first product (ptxas issues the wait just before it):
    since the reduce-adds were issued, the walk has loaded lse or delta and waited for
    this block's Q or dO, so their ~64 KiB of shared reads are done."""
    tma.store_wait(0)
    mbarrier.arrive(qdo_empty.index((it + STAGES - 1) % STAGES), count=1, pred=it > 0)


@gluon.jit
def _mma256_partition(args, WG: gl.constexpr, IS_CAUSAL: gl.constexpr,
                      DQ_TMA: gl.constexpr):
    """Consumer warpgroup WG: head dims [128 WG, 128 WG + 128) of dK and dV of the
    program's 64 keys, against every query block; WG 0 computes P^T, WG 1 dS^T.
    DQ_TMA: DQAccum is the accumulator's tensor map, and the dQ pieces go through
    ``_dq_tile``'s tiles in the block's Q and dO buffers by TMA reduce-adds."""
    (q_smem, k_smem, v_smem, do_smem, pt_smem, ds_smem, kv_ready, q_ready, do_ready,
     qdo_empty, pt_full, pt_empty, ds_full, ds_empty, out_ready, dk_desc, dv_desc, Lse,
     Delta, DQAccum, off_b, off_dkv, key0, h0, n_heads, m_lo, n_m, nheads, seqlen_q,
     seqlen_k, dq_rows, diag_offset, softmax_scale) = args
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = q_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[4]
    HALF: gl.constexpr = HEAD_DIM // 2
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _acc_layout(BLOCK_M)
    h_layout: gl.constexpr = _acc_layout(HALF)
    dq_layout: gl.constexpr = _acc_layout(DQ_PIECE)
    qk_scale = softmax_scale * LOG2E

    bh0 = off_b * nheads + h0  # the first query head's row of lse, delta and dQ's heads
    k = k_smem.reshape([BLOCK_N_WG, HEAD_DIM])                                # (64, D)
    v = v_smem.index(0).reshape([BLOCK_N_WG, HEAD_DIM])                       # (64, D)
    k_half = k.slice(WG * HALF, HALF, dim=1)                                  # (64, D/2)
    v_half = v.slice(WG * HALF, HALF, dim=1)                                  # (64, D/2)
    o_n = key0 + gl.arange(0, BLOCK_N_WG, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([BLOCK_N_WG, HALF], gl.float32, h_layout)
    dv = gl.zeros([BLOCK_N_WG, HALF], gl.float32, h_layout)
    s_init = gl.zeros([BLOCK_N_WG, BLOCK_M], gl.float32, s_layout)  # ignored: use_acc=False
    dq_init = gl.zeros([BLOCK_M, DQ_PIECE], gl.float32, dq_layout)  # ignored: use_acc=False
    mbarrier.wait(kv_ready, 0)

    n_iter = n_heads * n_m
    for it in range(n_iter):
        row0 = (m_lo + it % n_m) * BLOCK_M
        stage = it % STAGES
        phase = (it // STAGES) & 1
        p_row = (bh0 + it // n_m).to(gl.int64) * seqlen_q
        q = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])                 # (M, D)
        b_do = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])             # (M, D)
        q_half = q.slice(WG * HALF, HALF, dim=1)                             # (M, D/2)
        do_half = b_do.slice(WG * HALF, HALF, dim=1)                         # (M, D/2)
        if WG == 0:
            lse2 = _lse2(Lse + p_row, row0, seqlen_q, BLOCK_M, s_layout)
            o_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            mbarrier.wait(q_ready.index(stage), phase)
            s_t = warpgroup_mma(k, q.permute((1, 0)), s_init, use_acc=False,
                                is_async=True)                               # (64, M)
            if DQ_TMA:
                _release_previous_stage(qdo_empty, it, STAGES)
            s_t = warpgroup_mma_wait(0, deps=(s_t,))
            # The mask only where the program's keys cross seqlen_k or (causal) the
            # block's first row does not see its last key (bwd_hopper's walk).
            masked = key0 + BLOCK_N_WG - 1 >= seqlen_k
            if IS_CAUSAL:
                masked = masked | (key0 + BLOCK_N_WG - 1 > row0 + diag_offset)
            p_t = _p_t(s_t, o_n, o_m, seqlen_k, diag_offset, qk_scale, lse2,
                       IS_CAUSAL, masked)                                    # (64, M)
            p_op = _a_operand(p_t, h_layout, dtype)
            # P^T for warpgroup 1, from the operand's registers. It reads it with plain
            # loads (the generic proxy, as these stores): the mbarrier orders them.
            mbarrier.wait(pt_empty, (it & 1) ^ 1)
            pt_smem.store(p_op)
            mbarrier.arrive(pt_full, count=1)
            mbarrier.wait(do_ready.index(stage), phase)
            dv = warpgroup_mma(p_op, do_half, dv, is_async=True)
            mbarrier.wait(ds_full, it & 1)
            dk = warpgroup_mma(ds_smem, q_half, dk, is_async=True)
        else:
            delta = _row_vector(Delta + p_row, row0, seqlen_q, 0.0, BLOCK_M, s_layout)
            mbarrier.wait(do_ready.index(stage), phase)
            dp_t = warpgroup_mma(v, b_do.permute((1, 0)), s_init, use_acc=False,
                                 is_async=True)                              # (64, M)
            if DQ_TMA:
                _release_previous_stage(qdo_empty, it, STAGES)
            dp_t = warpgroup_mma_wait(0, deps=(dp_t,))
            mbarrier.wait(pt_full, it & 1)
            p_t = pt_smem.load(s_layout).to(gl.float32)                      # (64, M)
            mbarrier.arrive(pt_empty, count=1)
            ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))                   # (64, M)
            ds_op = _a_operand(ds_t, h_layout, dtype)
            mbarrier.wait(ds_empty, (it & 1) ^ 1)
            ds_smem.store(ds_op)
            fence_async_shared()  # the generic-proxy writes above before wgmma reads them
            mbarrier.arrive(ds_full, count=1)
            dv = warpgroup_mma(_a_operand(p_t, h_layout, dtype), do_half, dv,
                               is_async=True)
            mbarrier.wait(q_ready.index(stage), phase)
            dk = warpgroup_mma(ds_op, q_half, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        if DQ_TMA:
            p_dq = DQAccum  # the stage goes back once the reduce-adds have read it
        else:
            mbarrier.arrive(qdo_empty.index(stage), count=1)  # Q, dO read the last time
            p_dq = DQAccum + (bh0 + it // n_m).to(gl.int64) * dq_rows * HEAD_DIM
        # dQ_partial = dS K for this warpgroup's head dims, 64 at a time: the first
        # piece through Q's tile, the second through dO's with DQ_TMA; the last product
        # is this warpgroup's last read of dS^T and K (ds_empty).
        gl.static_assert(HALF == 2 * DQ_PIECE, "one dQ tile in Q's buffer, one in dO's")
        for piece in gl.static_range(2):
            if DQ_TMA:
                dq_tile = _dq_tile(q_smem if piece == 0 else do_smem, stage, WG, DQAccum)
            else:
                dq_tile = ds_smem  # unused: the atomics need no buffer
            # The tensor map's heads are the (batch, query head) pairs: coordinates
            # (0, bh0 + head, ...), not (off_b, h0 + head, ...) (the module docstring).
            _dq_piece(ds_smem, k_half.slice(piece * DQ_PIECE, DQ_PIECE, dim=1), dq_init,
                      p_dq, dq_tile, row0, WG * HALF + piece * DQ_PIECE, seqlen_q,
                      ds_empty, 0, bh0 + it // n_m, HEAD_DIM, piece == 1, DQ_TMA)

    if DQ_TMA:
        tma.store_wait(0)  # the last block's reduce-adds have read its stage

    # dK and dV leave through K's and V's buffers, each warpgroup writing its half, once
    # both warpgroups' last products (which read K and V) have completed: ds_empty's
    # last phase (a fresh barrier passes: no walk; K and V were waited for above, so no
    # load lands after these stores). TMA drops the rows past seqlen_k.
    mbarrier.wait(ds_empty, (n_iter & 1) ^ 1)
    k_half.store((dk * softmax_scale).to(dtype))
    v_half.store(dv.to(dtype))
    fence_async_shared()  # the generic-proxy writes above before the TMA engine reads
    mbarrier.arrive(out_ready, count=1)
    if WG == 0:
        mbarrier.wait(out_ready, 0)
        tma.async_copy_shared_to_global(dk_desc, [off_b, key0, off_dkv, 0], k_smem)
        tma.async_copy_shared_to_global(dv_desc, [off_b, key0, off_dkv, 0],
                                        v_smem.index(0))
        tma.store_wait(0)


@gluon.jit
def _attn_bwd_hopper256_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse,
                               Delta, DQAccum, seqlen_q, seqlen_k, nheads, nheads_kv,
                               head_split, dq_rows, diag_offset, softmax_scale,
                               IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                               DQ_TMA: gl.constexpr, LPT: gl.constexpr):
    """dK, dV of 64 keys of one (batch, KV head) at head_dim 256, dQ added into DQAccum:
    fp32 (batch, nheads, dq_rows, head_dim), zeroed by the preprocess (DQ_TMA: its tensor
    map, bwd_hopper's ``_dq_descriptor``). The arguments are bwd_hopper's kernel's
    (head_split the same; dq_rows is seqlen_q here)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    key0, off_b, off_dkv, off_hkv, h0, n_heads, m_lo, n_m = _program_walk(
        BLOCK_N_WG, BLOCK_M, seqlen_q, nheads, nheads_kv, head_split, diag_offset,
        IS_CAUSAL, LPT)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape,
                                       q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape,
                                       k_desc.layout)
    # One tile of 64 keys (_load_partition loads v_smem.type.shape[0] of them).
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [1] + v_desc.block_type.shape,
                                       v_desc.layout)
    t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N_WG, BLOCK_M],
                                                                   q_desc.dtype)
    pt_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_N_WG, BLOCK_M], t_layout)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_N_WG, BLOCK_M], t_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pt_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    pt_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    out_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(pt_full, count=1)  # warpgroup 0 stored P^T
    mbarrier.init(pt_empty, count=1)  # warpgroup 1 loaded it
    mbarrier.init(ds_full, count=1)  # warpgroup 1 stored dS^T
    mbarrier.init(ds_empty, count=2)  # both warpgroups' products that read it completed
    mbarrier.init(out_ready, count=2)  # both halves of dK and dV staged
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)  # one arrival per consumer warpgroup

    # Runtime arguments in one tuple, constants outside it (bwd_hopper's kernel says why).
    mma_args = (q_smem, k_smem, v_smem, do_smem, pt_smem, ds_smem, kv_ready, q_ready,
                do_ready, qdo_empty, pt_full, pt_empty, ds_full, ds_empty, out_ready,
                dk_desc, dv_desc, Lse, Delta, DQAccum, off_b, off_dkv, key0, h0, n_heads,
                m_lo, n_m, nheads, seqlen_q, seqlen_k, dq_rows, diag_offset,
                softmax_scale)
    # lse and delta stay in global memory here: the producer's tensor-map slots take
    # placeholders (LSE_SMEM False).
    load_args = (q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
                 q_ready, do_ready, qdo_empty, off_b, off_hkv, key0, h0, n_heads, m_lo, n_m,
                 q_desc, q_desc, q_smem, q_smem, seqlen_q, nheads)
    gl.warp_specialize([
        (_mma256_partition, (mma_args, 0, IS_CAUSAL, DQ_TMA)),
        (_load_partition, (load_args, False)),
        (_mma256_partition, (mma_args, 1, IS_CAUSAL, DQ_TMA)),
    ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])
