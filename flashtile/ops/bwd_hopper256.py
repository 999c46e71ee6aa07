"""FlashAttention backward for Hopper (sm_90) in Gluon at head_dim 256.

The algorithm, layouts, masks and launcher are bwd_hopper's (its docstring): P is
recomputed from the forward's lse in base 2, dS = P * (dP - delta), dQ summed over the
key blocks in fp32 by relaxed atomics; dense layout, GQA/MQA with the same ``head_split``,
causal (any ``diag_offset``) or full. What changes is the split of the work, because
bwd_hopper's does not fit: there each consumer warpgroup holds dK and dV of its 64 keys
in fp32 registers, 2 x 64 x head_dim / 128 threads = 256 registers a thread at head_dim
256, over the 240 that setmaxnreg gives a consumer.

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
  transposed from shared memory), each added to the fp32 accumulator with
  relaxed two-value atomics straight from the wgmma layout, as bwd_hopper's.
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
last phase.

Rows past seqlen_q, keys past seqlen_k, rows that saw no key (lse = -inf) and NaN are
handled as in bwd_hopper: keys past seqlen_k masked in S^T, lse read as +inf past
seqlen_q and where it is -inf (P = 0), dK/dV rows past seqlen_k dropped by the TMA
store, dQ rows past seqlen_q by the atomics' mask. bwd_hopper's schedule options
(FLASHTILE_HOPPER_BWD_OPTS) and STAGES sweep are its own: this kernel has none.

Status: first run on the H200 in session 14 (docs/benchmarks/NOTES.md section 24): its
GPU tests passed and memcheck found 0 errors; forward+backward 288-335 TFLOP/s full and
236-327 causal (1k-8k tokens), 2.0-2.5x the portable split backward, 1.2-1.4x SDPA's
flash backend, 0.78-0.85x cuDNN's; since then FLASHTILE_HOPPER_BWD's default (auto,
from 1k tokens) runs it. tests/test_gluon_compile.py compiles it for sm_90 on the CPU (Triton 3.6's ptxas): full
and causal, bf16 and fp16, 213,648 bytes of shared memory, no local-memory stores inside
the walks (causal: ptxas keeps the shared-memory base, 4 bytes, stored before the walk
and reloaded once a query block: 8 bytes of stack; full: none), HGMMA, setmaxnreg 24/240
(.maxnreg 168 at entry). tests/test_bwd_hopper.py has its GPU tests.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from flashtile.ops._common import LOG2E
from flashtile.ops.bwd_hopper import (BLOCK_N_WG, CONSUMER_REGS, DQ_PIECE, PRODUCER_REGS,
                                      _a_operand, _acc_layout, _load_partition, _lse2,
                                      _p_t, _program_walk, _row_vector)


@gluon.jit
def _dq_half(ds_smem, k_half, dq_init, p_dq, row0, seqlen_q):
    """dQ_partial = dS K[:, half] for the 128 head dims of ``k_half`` (64 keys x 128, a
    column slice of K), added into rows row0 + [0, M) of the accumulator at p_dq (already
    at the half's first column; rows 256 wide) in pieces of 64 head dims: 32 registers a
    piece beside dK and dV."""
    HEAD_DIM: gl.constexpr = 2 * k_half.type.shape[1]
    BLOCK_M: gl.constexpr = dq_init.type.shape[0]
    dq_layout: gl.constexpr = dq_init.type.layout
    o_dq_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))  # (M,)
    o_dq_d = gl.arange(0, DQ_PIECE, layout=gl.SliceLayout(0, dq_layout))        # (64,)
    for piece in gl.static_range(k_half.type.shape[1] // DQ_PIECE):
        k_piece = k_half.slice(piece * DQ_PIECE, DQ_PIECE, dim=1)             # (64, 64)
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_piece, dq_init, use_acc=False,
                           is_async=True)                                    # (M, 64)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        o_dq = gl.expand_dims(o_dq_m, 1) * HEAD_DIM \
            + gl.expand_dims(piece * DQ_PIECE + o_dq_d, 0)                  # (M, 64)
        # Relaxed: nothing reads a reduction's result before the conversion kernel.
        gl.atomic_add(p_dq + o_dq, dq, mask=gl.expand_dims(o_dq_m < seqlen_q, 1),
                      sem="relaxed")


@gluon.jit
def _mma256_partition(args, WG: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Consumer warpgroup WG: head dims [128 WG, 128 WG + 128) of dK and dV of the
    program's 64 keys, against every query block; WG 0 computes P^T, WG 1 dS^T."""
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
            s_t = warpgroup_mma_wait(0, deps=(s_t,))
            p_t = _p_t(s_t, o_n, o_m, seqlen_k, diag_offset, qk_scale, lse2,
                       IS_CAUSAL)                                            # (64, M)
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
        mbarrier.arrive(qdo_empty.index(stage), count=1)  # Q and dO read for the last time
        _dq_half(ds_smem, k_half, dq_init,
                 DQAccum + (bh0 + it // n_m).to(gl.int64) * dq_rows * HEAD_DIM + WG * HALF,
                 row0, seqlen_q)
        mbarrier.arrive(ds_empty, count=1)  # this warpgroup's last read of dS^T and K

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
                               IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """dK, dV of 64 keys of one (batch, KV head) at head_dim 256, dQ added into DQAccum:
    fp32 (batch, nheads, dq_rows, head_dim). The arguments are bwd_hopper's kernel's
    (head_split the same; dq_rows is seqlen_q here)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    key0, off_b, off_dkv, off_hkv, h0, n_heads, m_lo, n_m = _program_walk(
        BLOCK_N_WG, BLOCK_M, seqlen_q, nheads, nheads_kv, head_split, diag_offset,
        IS_CAUSAL)

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
    load_args = (q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
                 q_ready, do_ready, qdo_empty, off_b, off_hkv, key0, h0, n_heads, m_lo, n_m)
    gl.warp_specialize([
        (_mma256_partition, (mma_args, 0, IS_CAUSAL)),
        (_load_partition, load_args),
        (_mma256_partition, (mma_args, 1, IS_CAUSAL)),
    ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])
