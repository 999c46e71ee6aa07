"""FlashAttention backward for Hopper (sm_90) in Gluon, scheduled after FlashAttention-3.

Algorithm: Dao, FlashAttention-2 (2023), Algorithm 2 in its fused form
(``flashtile.ops.bwd`` with ``fused=True``), laid out on Hopper as Shah et al.,
FlashAttention-3 (2024), section 3.3 and appendix B: P is recomputed from the forward's
lse in base 2 (the scale folded into one FFMA per score), dS = P * (dP - delta) with
delta = rowsum(dO * O) - dlse (the portable preprocess kernel), dQ summed over the key
blocks in fp32 by atomics, then scaled into dq by the portable conversion kernel. Dense
layout only: q (batch, seqlen_q, nheads, head_dim), k/v (batch, seqlen_k, nheads_kv,
head_dim), GQA/MQA; causal (any ``diag_offset``: key j is visible to row i when
j <= i + diag_offset) or full. Head dims 64 and 128 here (96 in 128's tiles:
``tile_dim``); 256 in bwd_hopper256 (its consumers split the head dim, not the keys),
launched by this module's ``backward``.

One program owns BLOCK_N = 2 x 64 keys of one (batch, KV head) and walks every query
block of every query head of the group (the group sum of dK/dV happens in registers, as
in bwd.py); where that grid would be small for the device (GQA, few KV heads, short
sequences: ``head_split``), the group's heads are dealt to several programs whose dK/dV
shares the dQ conversion's launch sums after the kernel. Three warp-specialised partitions:
- a producer warp loads the program's K and V once (one 64-key half per consumer) and
  streams Q and dO blocks through a ring of STAGES shared buffers with TMA; each stage
  has a "ready" mbarrier per tensor and one "empty" mbarrier (both consumers done).
- two consumer warpgroups own 64 keys each and compute the transposed products, keys as
  rows, so that P^T and dS^T, the A operands of dV += P^T dO and dK += dS^T Q, stay in
  registers (wgmma's A may come from registers, B only from shared memory):
  S^T = K Q^T, dP^T = V dO^T (both from shared memory), then dV and dK together. Both
  write dS^T to shared memory; dQ_partial = dS K over all 128 keys (dS^T read
  transposed) is then computed by one of them, the two taking turns by query block
  (two mbarriers: both dS^T stored; the product done, the buffers free), in pieces of
  64 head dims. dQ_partial goes to an fp32 accumulator with ``gl.atomic_add``
  (relaxed, two values an instruction: atom.global.relaxed.add.v2.f32) straight from
  the wgmma accumulator layout: one reduction per 128 keys, as the portable fused
  backward's and FA3's.
  Triton 3.6's Gluon wraps no TMA reduce (its hopper ``tma`` module has loads, stores
  and store_wait only, blackwell's adds gather/scatter; ``desc.atomic_add`` is
  triton.language's), nor gives a shared-memory address that inline PTX (``cp.reduce.
  async.bulk``) could take: ``gl.inline_asm_elementwise`` reads register tensors only.
  Its op builder binds the tensor form, though (``create_async_tma_reduce``): option
  dq_tma below reaches FA3's reduce-add of a shared tile through a wrapper of it
  (``_tma_reduce_add``, session 15).
- warp_specialize's register requests become setmaxnreg: 24 for the producer, 240 for
  each consumer (dK and dV accumulators, 64 x head_dim fp32 each, live across the walk).

Schedule options, each a constexpr chosen by FLASHTILE_HOPPER_BWD_OPTS (comma-separated,
"none" for the schedule above alone; lse_ahead by default since session 15, dq_tma
with it since session 17, lse_smem in lse_ahead's place since session 21, ds_ring since
session 28) for the GPU A/B, all compile-checked on the CPU:
- lse_ahead (LSE_AHEAD): lse and delta of query block it + 1 are loaded (one value a
  thread each, masked off past the walk) during block it, so no global load is waited
  for inside a block: without it lse's load is issued and waited for (its value stored
  for the layout conversion) right before S^T's issue, an L2 round trip on every
  block's path (delta's overlaps dP^T). ptxas then also issues most of the softmax's
  exp2 before the dP^T wait, under dP^T (14-32 of a thread's 32 in the sm_90 SASS, 0-4
  by default; one d128 consumer keeps them behind). As FA3, which has the producer copy
  LSE and dPsum into shared memory beside Q and dO.
  Prediction (session 14, not yet run on a GPU; a toy model of the two consumers sharing
  the tensor cores, not kept): per block and program (d128, 64 rows, 128 keys) the five
  products are 10.5 MFLOP, 2560 clocks at the SM's 4096 FLOP/clock, but ~393 TFLOP/s
  means ~6000 clocks, so each consumer's serial chain (lse round trip ~500-1000 clocks
  with the atomics loading the L2, two wgmma round trips, the exp2 behind them, the
  dV/dK wait) is the bound, not the tensor cores. Taking 500-800 clocks off each chain:
  backward +8-15% at d128, +15-25% at d64 (its blocks are half as long, the same
  latency); forward + backward +5-10% / +10-18%.
- dq_tma (DQ_TMA): dQ_partial leaves as FA3's does, without its writer warp: the owner
  stores each 64-dim piece, fp32, into a tile
  of its own in shared memory and issues a TMA reduce-add of it into the accumulator
  (cp.reduce.async.bulk.tensor .add; DQAccum is then the accumulator's tensor map,
  ``_dq_descriptor``), waited for (the tile read) only before the tile's next use two
  blocks later. ds_empty is arrived on when the last product has completed (the
  reduce-adds read the tile, not dS^T); the TMA drops the rows past seqlen_q. Shared
  memory: + 2 x 16 KiB at d64 (113 KiB), + 4 x 16 KiB at d128 (209 KiB). The sm_90
  compile: no REDG left, 16 STS.64 a piece a thread and one UTMAREDG (two 32-column
  messages); no stores inside the walks; at d128 ptxas keeps 80-120 bytes of scalars in
  local memory (56 with the atomics).
  Why: a piece's 16 REDG.F32x2 a thread each touch 8 rows, 32 bytes a row: 512 sector
  requests from each consumer's L1 a piece, 1,024 in a d128 owner block, plus a branch
  a REDG for the row mask; the next product writing the same registers waits until the
  REDGs have read them. Nsight Compute (session 15): the L2 61% busy at d128 (DRAM 4.6%)
  and 31% of the stall samples on L1TEX at d64 (transformers' step), most plausibly the
  atomics. The TMA engine adds whole 128-byte lines from one instruction.
  Prediction (session 15, not run on a GPU): backward +4-10% at d128 and +3-8% at d64,
  forward + backward about 0.7x that (+3-7% / +2-6%). If lse_ahead + dq_tma is within
  +-2% of lse_ahead, the
  atomics were not on the chain and the remaining gap is the chain's wgmma round trips.
  Measured (session 17, NOTES.md section 27): forward + backward +6-10% at d128
  (16k tokens: 1k 401 -> 434, 4k 451 -> 495 TFLOP/s; causal +6-7%), +1-3% at d64;
  transformers' d64 training step 98 -> 89 ms. The default since. Its tiles leave no
  room for a third Q/dO stage at d128 (``check_fits``). bwd_hopper256 takes the option
  too (session 18), its tiles in the Q/dO ring (no room is left there for tiles).
- lse_smem (LSE_SMEM; supersedes lse_ahead): lse and delta come as FA3 brings them,
  with Q and dO: the producer loads each block's BLOCK_M values of both by TMA (tensor
  maps over the (batch * nheads, seqlen_q) tensors, ``_rows_descriptor``) into rings
  beside Q's and dO's, on the same mbarriers; each consumer reads the values of its own
  columns from shared memory (8 LDS.64 a thread) while S^T (lse) or dP^T (delta) runs,
  and masks the rows past seqlen_q. A TMA load's innermost coordinate must fall on 16
  bytes (session 20: coordinate 5 of an fp32 map stopped the H200 with an illegal
  instruction, 0 and 8 loaded), so lse_smem needs seqlen_q a multiple of 4 (rows 16
  bytes apart) and at least BLOCK_M; other lengths run lse_ahead (``kernel_flags``).
  Without it each block converts both from one value a thread to S^T's column layout
  through shared memory: two warpgroup barriers (BAR.SYNC) each, delta's between dP^T's completion and
  dS, on the chain that session 15's Nsight Compute found bound by waits (37% of the
  d128 stall samples at a barrier). The sm_90 compile: 3 of 11 (d64) and 12 (d128)
  barriers a block gone, no global load in the walks, 2 x STAGES x BLOCK_M x 4 bytes
  more shared memory, 0 (d64) and 112-136 (d128) bytes of scalars in local memory
  stored before the walks (lse_ahead: 0 and 80-120). An lse that is not 16-byte aligned
  is copied first (``_aligned``). Prediction (session 19): backward +3-8% at d64, +1-4%
  at d128 over lse_ahead (forward + backward about 0.7x that); measured (session 20,
  NOTES.md section 30, forward + backward at 1k and 4k): +3-5% at d64, +2-4% at d128.
- ds_ring (DS_RING): dS^T in two buffers, block it's in buffer it % 2, each with its
  own full and empty mbarriers. The single buffer ties the consumers together every
  block: the one that did not own block it - 1's dQ product may store block it's dS^T
  only once that product has completed, so it waits out the owner's product (and, with
  dq_tma, its stores to the tile) on its own chain. With two buffers a store waits for
  block it - 2's product, which (owner = it % 2 = the buffer) this consumer's partner
  issued a whole block earlier; what stays is the owner's wait for its partner's dS^T.
  +16 KiB at BLOCK_M 64 (d64 129 KiB, d128 with dq_tma 225 KiB). Session 28's three consumers (192 keys,
  the hand-off among three, each product 1.5x as long) ran forward + backward 4-12%
  slower at d64 (NOTES.md section 38), whether or not their lse spilled: the coupling
  is the suspect. Prediction: backward +2-6% at d64, +1-4% at d128 (forward + backward
  about 0.7x that); if within +-1%, the hand-off is not on the chain. Measured (session
  28, forward + backward): d64 full +2-3%, causal +0-1%, d128 level; in the default
  since.
- lpt (LPT; session 29, opt-in; GPU tests pass, one noisy timing): the grid (heads, key
  blocks) instead of (key blocks, heads), for causal attention. The hardware hands
  programs out in grid order; a causal walk is longest at a head's first key block (it
  sees every query block) and shortest at its last, so by default the last head's
  longest walks start in the last wave and the others wait for them (greedy list
  scheduling: up to the longest program past the average; transformers' Llama-3.2-1B
  step at 4k, 1,024 programs of 2-64 query blocks on 132 SMs: up to ~64 of an SM's ~256
  blocks). With lpt every head's first key block goes first, longest first overall
  (Graham's LPT order), and the last wave holds the shortest walks. The price is L2: the
  first wave reads every head's Q and dO at once, where the default order's waves share
  one head's; ``backward`` takes lpt only where all of them fit LPT_QDO_BYTES (the
  training step's 32 heads x 4k x 64 x 2 x 2 bytes = 32 MiB do) and the key blocks fit
  the grid's y (65535: ``lpt_fits``). Prediction: causal backward +2-8% at 1k-4k, level
  at 16k (dropped there by the L2 rule). Session 30 (section 40): one noisy round at 4k,
  below the default's warm run; not shown to win.
- skip_masked (SKIP_MASKED; session 32; the default at head_dim 128 since session 33): a causal
  program's walk starts at the query block holding row key0 - diag_offset for both
  consumers, and no row of that block sees a key of the second consumer (keys key0 + 64
  on): its S^T, dP^T, dV and dK products there are fully masked, once per query head.
  With the option that consumer waits for the block's Q and dO, releases them, stores a
  zero dS^T for the block's dQ product (which it still takes in its turns) and skips its
  four products; so does a consumer whose keys all lie past seqlen_k. Work saved: ~1.5%
  of the backward's products at 4k causal, ~6% at 1k. Predicted causal forward +
  backward +0.5-1.5% at 4k, +2-4% at 1k. Measured (section 43, two alternating rounds):
  head_dim 128 +0.5-4% at 1k-16k; head_dim 64 -3% at 1k, level at 4k (its walk loops,
  holding both arms, cost more than the skipped block saves), so the default at 128
  alone (configs.HOPPER_BWD_DEFAULT_BY_DIM).
- skip_peel (session 33) put skip_masked's dead blocks in a loop of their own before the
  walk; on an H100 (session 39, NOTES.md section 49) d64 causal forward + backward lost
  3-5% at 1k and 4k, and it was removed.
- lse_pre (LSE_SMEM 2, with lse_smem; session 34; H200 session 35: forward + backward
  +1.2-2.8% at d64, +1-2.4% d128 causal, level d128 full; the default since session
  38, when the backward's whole GPU test files passed with it on): FA3's LSE_log2. The
  preprocess writes lse in base 2 (+inf where it is -inf) and delta into one (2, batch,
  nheads, rows) allocation, rows seqlen_q rounded up to BLOCK_M with +inf and 0 in the
  padding, which the row maps then read: a walk block converts and masks neither (16
  FMUL, 16 FSETP and 48 FSEL a thread at d64 go, and ptxas packs the rest tighter).
  sm_90 SASS: d64 530 -> 433 instructions a block (causal 564 -> 472), d128 causal with
  skip_masked 850 -> 723 (a word more in local memory there). Its padded rows suit the
  row maps at every seqlen_q, so with it lse_smem runs where it would otherwise give way
  to lse_ahead (``kernel_flags``).
Tried and removed (H200, the sections of docs/benchmarks/NOTES.md):
- sdp (head dim 64), FA3's order: dP^T issued right behind S^T, the consumer waiting
  for S^T alone and computing P^T while dP^T runs. ptxas hoists dP^T's wait (no register
  operands) into P^T's exp2 (10-21 of a thread's 32 under dP^T); a second wait on dO's
  completed ready barrier before it, a block boundary, put all 32 under dP^T. Both ran
  0-4% slower than none at d64, the training step level (sessions 12, 29 and 31,
  sections 22, 39 and 41): the other consumer's products already fill the tensor cores.
- pipe, software pipelining across query blocks: block it issued S^T and dP^T, then
  block it - 1's dV and dK from the operands it had left in registers (block 0 with zero
  operands against its own stage, the walk's end the last block's), so three products
  were queued under each softmax. d64 and BLOCK_M 64 only (at d128 or BLOCK_M 128
  ptxas serialized every wgmma, C7512, and spilled); FA3's form, dK and dV in flight
  across the back edge, made ptxas 12.8 serialize every wgmma at d64 already (session
  15); P^T and dS^T had to be cast only after the previous products' wait (C7513).
  Predicted +1.5-3.5% forward + backward; measured -1.7 to +1.5% (session 18, section
  28) and, on session 28's default, -4% at 1k, -2% at 4k, level at 16k (session 29).
  Removed in session 29.
- dq_split, FA3's dQ split (AtomLayoutMdQ): both consumers a share of every block's dQ
  product (half the head dims at d128, half the rows at d64 with BLOCK_M 128), two dS^T
  buffers, one barrier a block: -2 to -9% alone, level with lse_ahead when combined
  (d128, session 15, section 25): the consumers meet every block, so their softmax
  phases line up. Removed in session 28.
- FA3's dQ writer warp (the dQ owner stored dQ_partial to shared memory; a fourth
  partition, one warp beside the producer, added it to the accumulator with four-value
  atomics) ran 2-13% slower than the default at d64 and d128 (session 14, section 24):
  the consumers issue fewer atomics, but every block's dQ tile is written to and read
  back from shared memory (2 x 16-32 KiB).
- dq_early (the dQ owner released dS^T's buffer before its last dQ piece's atomics)
  and dq_unmasked (the accumulator's rows rounded up to BLOCK_M, so the atomics needed
  no row mask, a branch around each REDG) ran, with sdp, 0-3% slower than none
  (session 12, section 22).
- dkv_late (the dQ owner's first dQ product queued behind dV and dK, one wait for the
  three) ran forward + backward -1 to -2% at d64 against +2-5% predicted (session 15,
  section 25).
Not FA3's: no ping-pong between the two consumers, no bulk dQ reduce but with dq_tma; the
softmax runs under dP^T only with lse_ahead, and not in every consumer (ptxas
schedules it).

Rows past seqlen_q and keys past seqlen_k are zero-filled by TMA; keys past seqlen_k are
masked (a zero key still scores 0, and exp2(0 - lse) can overflow where lse is very
negative, making 0 * inf in dQ); rows past seqlen_q read lse = +inf, so their P is 0;
dK/dV rows past seqlen_k are dropped by the TMA store, dQ rows past seqlen_q by the
atomics' mask (dq_tma: by the TMA reduce-add).
Rows that saw no key (lse = -inf) read +inf too: zero gradients.

Status (FLASHTILE_HOPPER_BWD, flashtile._backend.hopper_bwd_mode, says where this is the
default): first run on an H200 in GPU session 12
(docs/benchmarks/h200-2026-12-01-s12/bwd-ab.md): tests/test_bwd_hopper.py passed and
memcheck found 0 errors; forward + backward 0.78-0.84x cuDNN's at head dims 64/128, the
backward alone ~0.76x (~390 against ~513 TFLOP/s at d128, 4k). tests/test_gluon_compile.py
compiles every variant and option for sm_90 on the CPU (shared memory, no local-memory
stores inside the walks, each option visible in the SASS; ptxas keeps 48 bytes of
scalars in local memory at head_dim 128, stored before the walk). Session 12's options
(NOTES.md section 22) ran 0-3% slower than none.
Session 13 (section 23): the options' GPU tests passed; the GQA head split
(``head_split``) passed its tests and memcheck and cut transformers' Llama-3.2-1B
backward (32 query over 8 KV heads, 4k tokens, batch 1) from 0.55x to 0.72x cuDNN's.
Session 14 (section 24): 128 query rows at d64 ran +5% full, -1 to -3% causal, a third
stage level: the default tiles stay. Session 15 (section 25): lse_ahead ran forward +
backward +6-10% at d64 and +1-4% at d128 (predicted +10-18% and +5-10%), so it is the
default. Nsight Compute (d128, 4k, lse_ahead): one instruction issued every 4.6 cycles
a scheduler, 0.25 of 3 warps eligible, no tile spills: a latency-bound chain, not the
tensor cores.
"""

from __future__ import annotations

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile import _validate as V
from flashtile.ops import _launch, bwd, configs, fwd_hopper
from flashtile.ops._common import LOG2E

# Keys of one consumer warpgroup: wgmma's M is 64 per warpgroup, and the keys are the
# rows of every product whose A operand lives in registers.
BLOCK_N_WG = gl.constexpr(64)
# As in fwd_hopper: 24 registers for the producer warp, 240 for each consumer (dK and
# dV: 2 x 64 at head_dim 128; S^T and dP^T: 2 x 32 at 64 query rows; then a piece of
# dQ_partial, 32, once they are dead). 24 + 240 + 240 fit the 64K registers.
PRODUCER_REGS = gl.constexpr(24)
CONSUMER_REGS = gl.constexpr(240)
# Head dims of dQ_partial per product and atomics pass (see _dq_partial).
DQ_PIECE = gl.constexpr(64)


@gluon.jit
def _load_block(desc, coords, bar, smem, rows_desc, rows_coords, rows_ring, stage,
                WITH_ROWS: gl.constexpr):
    """One TMA load of a Q or dO block into its ring stage, with (WITH_ROWS) the block's
    lse or delta values at ``rows_coords`` into stage ``stage`` of ``rows_ring``, on the
    same mbarrier."""
    if WITH_ROWS:
        mbarrier.expect(bar, desc.block_type.nbytes + rows_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(rows_desc, rows_coords, bar, rows_ring.index(stage))
    else:
        mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, coords, bar, smem)


@gluon.jit
def _load_partition(args, LSE_SMEM: gl.constexpr):
    """Producer warp: K and V once (in v_smem.type.shape[0] tiles of 64 keys: one half
    per consumer here, one tile in bwd_hopper256), then Q_i and dO_i of every (query
    head h0 + [0, n_heads), query block) into the ring. LSE_SMEM: the block's lse rows
    with Q (on q_ready) and its delta rows with dO (on do_ready), from
    (batch * nheads, seqlen_q) tensor maps, into their rings (lse_smem, delta_smem;
    unused otherwise)."""
    (q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_ready, q_ready,
     do_ready, qdo_empty, off_b, off_hkv, key0, h0, n_heads, m_lo, n_m, lse_desc,
     delta_desc, lse_smem, delta_smem, seqlen_q, nheads) = args
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    STAGES: gl.constexpr = q_smem.type.shape[0]
    KV_TILES: gl.constexpr = v_smem.type.shape[0]
    mbarrier.expect(kv_ready, KV_TILES * (k_desc.block_type.nbytes
                                          + v_desc.block_type.nbytes))
    for w in gl.static_range(KV_TILES):
        k_half = k_smem.slice(w * BLOCK_N_WG, BLOCK_N_WG, dim=1)  # rows: keys
        tma.async_copy_global_to_shared(k_desc, [off_b, key0 + w * BLOCK_N_WG, off_hkv, 0],
                                        kv_ready, k_half)
        tma.async_copy_global_to_shared(v_desc, [off_b, key0 + w * BLOCK_N_WG, off_hkv, 0],
                                        kv_ready, v_smem.index(w))
    for it in range(n_heads * n_m):
        off_h = h0 + it // n_m
        row0 = (m_lo + it % n_m) * BLOCK_M
        stage = it % STAGES
        # A fresh mbarrier counts as having completed the phase before its first, so the
        # first pass through the ring waits for nothing.
        mbarrier.wait(qdo_empty.index(stage), ((it // STAGES) & 1) ^ 1)
        # LSE_SMEM: rows past seqlen_q are zeros (out of the map): the consumers mask
        # them.
        rows = [off_b * nheads + off_h, row0]
        _load_block(q_desc, [off_b, row0, off_h, 0], q_ready.index(stage),
                    q_smem.index(stage), lse_desc, rows, lse_smem, stage, LSE_SMEM)
        _load_block(do_desc, [off_b, row0, off_h, 0], do_ready.index(stage),
                    do_smem.index(stage), delta_desc, rows, delta_smem, stage, LSE_SMEM)


@gluon.jit
def _a_operand(x, acc_layout: gl.constexpr, dtype: gl.constexpr):
    """x (fp32, a wgmma accumulator of 64 rows) as the A operand, from registers, of a
    product accumulating in ``acc_layout``: cast to the inputs' 16-bit type, two values
    per 32-bit register."""
    layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                               k_width=2)
    return gl.convert_layout(x.to(dtype), layout)


@gluon.jit
def _row_flat(ptr, row0, seqlen_q, other, BLOCK_M: gl.constexpr):
    """ptr[row0 + i] for i < BLOCK_M (``other`` past seqlen_q), one value per thread of
    the warpgroup."""
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    o_m = row0 + gl.arange(0, BLOCK_M, layout=flat)
    return gl.load(ptr + o_m, mask=o_m < seqlen_q, other=other)


@gluon.jit
def _row_vector(ptr, row0, seqlen_q, other, BLOCK_M: gl.constexpr, s_layout: gl.constexpr):
    """``_row_flat`` in the layout of S^T's columns (converted through shared memory)."""
    x = _row_flat(ptr, row0, seqlen_q, other, BLOCK_M)
    return gl.convert_layout(x, gl.SliceLayout(0, s_layout))


@gluon.jit
def _base2(lse):
    """lse * log2(e), +inf where lse = -inf (a row that saw no key): P = 0 there, not
    NaN."""
    return gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@gluon.jit
def _lse2(p_lse, row0, seqlen_q, BLOCK_M: gl.constexpr, s_layout: gl.constexpr):
    """``_base2`` of the lse of query rows row0 + [0, BLOCK_M) in the layout of S^T's
    columns; +inf past seqlen_q."""
    return _base2(_row_vector(p_lse, row0, seqlen_q, float("inf"), BLOCK_M, s_layout))


@gluon.constexpr_function
def _acc_layout(n):
    """A wgmma accumulator of 64 rows and n columns: 4 warps along M, instruction N =
    the whole tile width."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, n, 16])


@gluon.jit
def _p_t(s_t, o_n, o_m, seqlen_k, diag_offset, qk_scale, lse2, IS_CAUSAL: gl.constexpr,
         masked=True):
    """P^T from S^T (keys o_n as rows, query rows o_m as columns): keys past seqlen_k
    and, with causal, keys past row + diag_offset masked; lse2 in base 2 (``_lse2``).
    ``masked`` (a scalar, the same in the warpgroup) False: no key is to be masked,
    and the mask's compares and selects (two or three instructions a score, on the
    consumer's chain) are branched over."""
    if masked:
        if IS_CAUSAL:
            # Query row m sees key n where m >= n - diag_offset and n < seqlen_k: one
            # bound a key (past seqlen_k none is met), so one compare and one select a
            # score, where the two conditions apart take two of each.
            first = gl.where(o_n < seqlen_k, o_n - diag_offset, 2147483647)
            keep = gl.expand_dims(o_m, 0) >= gl.expand_dims(first, 1)
        else:
            keep = gl.expand_dims(o_n < seqlen_k, 1)
        s_t = gl.where(keep, s_t, float("-inf"))
    return gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))


@gluon.jit
def _dq_add(p_dq, dq, row0, col0, seqlen_q, HEAD_DIM: gl.constexpr):
    """dq (a wgmma accumulator) added into rows row0 + [0, M), columns col0 + [0, N) of
    the fp32 accumulator at p_dq (rows HEAD_DIM wide) by relaxed atomics: nothing reads
    a reduction's result before the conversion kernel, so it needs no ordering."""
    dq_layout: gl.constexpr = dq.type.layout
    o_dq_m = row0 + gl.arange(0, dq.type.shape[0], layout=gl.SliceLayout(1, dq_layout))
    o_dq_d = col0 + gl.arange(0, dq.type.shape[1], layout=gl.SliceLayout(0, dq_layout))
    o_dq = gl.expand_dims(o_dq_m, 1) * HEAD_DIM + gl.expand_dims(o_dq_d, 0)     # (M, N)
    gl.atomic_add(p_dq + o_dq, dq, mask=gl.expand_dims(o_dq_m < seqlen_q, 1),
                  sem="relaxed")


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA's reduce-add (cp.reduce.async.bulk.tensor, .add) of the shared tile ``src``
    into the box of ``tensor_desc`` at ``coord``; waited for as a TMA store is
    (tma.store_wait: the engine has read ``src``). Triton 3.6 binds the operation
    (GluonOpBuilder.create_async_tma_reduce, which its tl.tensor_descriptor.atomic_add
    also reaches) but its Gluon hopper.tma module wraps only the copies: this is
    tma.async_copy_shared_to_global's wrapper with the reduction kind."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                              tensor_desc.handle, coord, src.handle)


@gluon.jit
def _dq_reduce(dq_desc, dq_buf, dq, off_b, head, row0, col0):
    """dq (a wgmma accumulator, M x N) added into rows row0 + [0, M), columns col0 +
    [0, N) of query head ``head`` of batch off_b of the fp32 accumulator behind dq_desc
    (box (1, 1, M, N)) by a TMA reduce-add through dq_buf (this warpgroup's shared
    tile, free: the caller waited for its previous reduce): 16 two-value shared stores a
    thread where the atomics take 16 REDGs and their row-mask branches; the TMA drops
    the rows past the accumulator's."""
    dq_buf.reshape(dq.type.shape).store(dq)
    fence_async_shared()  # the generic-proxy writes above before the TMA engine reads
    _tma_reduce_add(dq_desc, [off_b, head, row0, col0], dq_buf)


@gluon.jit
def _dq_piece(ds_all, k_piece, dq_init, p_dq, dq_tile, row0, col0, seqlen_q, ds_empty,
              off_b, head, HEAD_DIM: gl.constexpr, LAST: gl.constexpr,
              DQ_TMA: gl.constexpr):
    """One piece of dQ_partial = dS K: dS (``ds_all``, dS^T read transposed, M x keys)
    times ``k_piece`` (keys x 64: K's columns col0 + [0, 64)), added into rows row0 +
    [0, M), columns col0 + [0, 64) of the fp32 accumulator: by atomics at p_dq (rows
    HEAD_DIM wide), or with DQ_TMA through ``dq_tile`` (free: the caller waited for its
    previous reduce) by a TMA reduce-add into query head ``head`` of batch off_b of the
    accumulator's tensor map p_dq (``_dq_reduce``). LAST: the product is the caller's
    last read of dS^T and K, so ds_empty is arrived on once it has completed (DQ_TMA: the
    reduce-add reads the tile, not dS^T or K) or after its atomics. bwd_hopper256's
    consumers take their dQ pieces through here too."""
    dq = warpgroup_mma(ds_all.permute((1, 0)), k_piece, dq_init, use_acc=False,
                       is_async=True)                                        # (M, 64)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    if DQ_TMA:
        if LAST:
            mbarrier.arrive(ds_empty, count=1)
        _dq_reduce(p_dq, dq_tile, dq, off_b, head, row0, col0)
    else:
        _dq_add(p_dq, dq, row0, col0, seqlen_q, HEAD_DIM)
        if LAST:
            mbarrier.arrive(ds_empty, count=1)


@gluon.jit
def _dq_partial(ds_all, k_all, dq_init, p_dq, row0, seqlen_q, ds_empty, dq_smem, off_b,
                head, WG: gl.constexpr, DQ_TMA: gl.constexpr):
    """dQ_partial = dS K over the program's 128 keys, added into rows row0 + [0, M) of
    the fp32 accumulator at p_dq (head_dim wide), in pieces of 64 head dims (K's
    columns, a whole 128-byte swizzle atom each; ``_dq_piece``) addressed by 32-bit
    offsets from one pointer: at head_dim 128 the whole (64, 128) fp32 tile with 64-bit
    addresses, beside dK and dV, spilled under the 240-register cap. Arrives on ds_empty
    once dS^T and K are read for the last time: after the atomics. DQ_TMA: p_dq is the
    accumulator's tensor map, each piece goes through warpgroup WG's tile of dq_smem for
    it and a TMA reduce-add (``_dq_reduce``) into query head ``head`` of batch off_b, and
    ds_empty is arrived on as soon as the last product has completed."""
    HEAD_DIM: gl.constexpr = k_all.type.shape[1]
    DQ_PIECE: gl.constexpr = dq_init.type.shape[1]
    N_PIECES: gl.constexpr = HEAD_DIM // DQ_PIECE
    if DQ_TMA:
        # This warpgroup's reduces of its previous dQ (two blocks back) have read its
        # tiles: long done, the wait only orders the stores below after them.
        tma.store_wait(0)
    for piece in gl.static_range(N_PIECES):
        _dq_piece(ds_all, k_all.slice(piece * DQ_PIECE, DQ_PIECE, dim=1), dq_init, p_dq,
                  dq_smem.index(WG * N_PIECES + piece) if DQ_TMA else dq_smem, row0,
                  piece * DQ_PIECE, seqlen_q, ds_empty, off_b, head, HEAD_DIM,
                  piece == N_PIECES - 1, DQ_TMA)


@gluon.jit
def _ds_slot(ds_smem, ds_full, ds_empty, it, DS_RING: gl.constexpr):
    """Block it's dS^T buffer, its full and empty barriers and their phase.

    dQ_partial = dS K needs dS as the A operand, rows the queries: through shared
    memory, read transposed. Both warpgroups' dS^T (128 keys) go into one product, taken
    by the two in turn (owner it % 2): half the atomics of a product per warpgroup, as
    FA3 sums dQ over its 128 keys before reducing. ds_empty: the previous owner's
    product, the last reader of both buffers, has completed. DS_RING: buffer it % 2,
    last read by block it - 2's product (the k-th use of a buffer waits for k
    completions of its empty barrier, then for k + 1 of its full one)."""
    if DS_RING:
        return ds_smem.index(it % 2), ds_full.index(it % 2), ds_empty.index(it % 2), \
            (it // 2) & 1
    else:
        return ds_smem, ds_full, ds_empty, it & 1


@gluon.jit
def _key_block(k, v, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, qdo_empty,
               ds_smem, ds_full, ds_empty, it, stage, phase, s_init, o_n, o_m, row0, key0,
               seqlen_q, seqlen_k, diag_offset, qk_scale, lse2, delta_flat, Delta, p_row,
               dk, dv, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, LSE_AHEAD: gl.constexpr,
               LSE_SMEM: gl.constexpr, DS_RING: gl.constexpr):
    """Query block ``row0`` (the walk's it-th) of warpgroup WG: S^T, P^T, dP^T and dS^T
    of its 64 keys, dV and dK accumulated, its dS^T handed to the block's dQ product
    (``_ds_slot``), the stage's Q and dO released. lse2 (LSE_SMEM: read here) and
    delta_flat (LSE_AHEAD) as the walk has them."""
    BLOCK_M: gl.constexpr = q_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[4]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _acc_layout(BLOCK_M)
    d_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    q = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])                 # (M, D)
    b_do = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])             # (M, D)

    mbarrier.wait(q_ready.index(stage), phase)
    s_t = warpgroup_mma(k, q.permute((1, 0)), s_init, use_acc=False,
                        is_async=True)                                   # (64, M)
    if LSE_SMEM:
        # The block's lse landed with Q: read while S^T runs, each thread its own
        # columns (no layout conversion, so no barrier); rows past seqlen_q +inf.
        # (LSE_SMEM 2, lse_pre: the preprocess wrote it so, in base 2.)
        lse_row = lse_smem.index(stage).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_layout))
        if LSE_SMEM == 2:
            lse2 = lse_row
        else:
            lse2 = gl.where(o_m < seqlen_q, _base2(lse_row), float("inf"))
    s_t = warpgroup_mma_wait(0, deps=(s_t,))
    # This warpgroup's keys need a mask only where they cross seqlen_k or, with
    # causal, where the block's first row does not see its last key: the other
    # blocks branch over it (session 28: forward + backward causal +4-6% at d64
    # and d128 from 4k, though at d128 ptxas then stores a few words inside the
    # causal walks).
    last_key = key0 + WG * BLOCK_N_WG + BLOCK_N_WG - 1
    masked = last_key >= seqlen_k
    if IS_CAUSAL:
        masked = masked | (last_key > row0 + diag_offset)
    p_t = _p_t(s_t, o_n, o_m, seqlen_k, diag_offset, qk_scale, lse2, IS_CAUSAL,
               masked)                                                   # (64, M)

    mbarrier.wait(do_ready.index(stage), phase)
    dp_t = warpgroup_mma(v, b_do.permute((1, 0)), s_init, use_acc=False,
                         is_async=True)                                  # (64, M)
    if LSE_SMEM:  # delta landed with dO: read while dP^T runs; rows past seqlen_q 0
        delta = delta_smem.index(stage).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_layout))
        if LSE_SMEM != 2:  # (lse_pre: 0 there already)
            delta = gl.where(o_m < seqlen_q, delta, 0.0)
    dp_t = warpgroup_mma_wait(0, deps=(dp_t,))
    # dV's product is issued after dP^T completes, not beside it: its P^T operand
    # and accumulators held in flight through dS spilled 104-128 bytes at head_dim
    # 128 (dK, dV: 128 registers; S^T/P^T, dP^T: 32 each; the operands 16 each).
    # The other consumer's products fill the tensor cores meanwhile.
    p_op = _a_operand(p_t, d_layout, dtype)
    if LSE_AHEAD:
        delta = gl.convert_layout(delta_flat, gl.SliceLayout(0, s_layout))
    elif not LSE_SMEM:
        delta = _row_vector(Delta + p_row, row0, seqlen_q, 0.0, BLOCK_M, s_layout)
    ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))                       # (64, M)
    ds_op = _a_operand(ds_t, d_layout, dtype)
    dv = warpgroup_mma(p_op, b_do, dv, is_async=True)
    dk = warpgroup_mma(ds_op, q, dk, is_async=True)
    # (selected here, not before S^T: held through the block, ptxas kept 16 more bytes
    # of d128's walk in local memory)
    ds_buf, ds_full_b, ds_empty_b, ds_phase = _ds_slot(ds_smem, ds_full, ds_empty, it,
                                                       DS_RING)
    mbarrier.wait(ds_empty_b, ds_phase ^ 1)
    # From the operand's registers: no second 16-bit copy of dS^T.
    ds_buf.slice(WG * BLOCK_N_WG, BLOCK_N_WG).store(ds_op)
    fence_async_shared()  # the generic-proxy writes above before wgmma reads them
    mbarrier.arrive(ds_full_b, count=1)
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    mbarrier.arrive(qdo_empty.index(stage), count=1)  # Q, dO read last
    return dk, dv


@gluon.jit
def _skip_key_block(q_ready, do_ready, qdo_empty, ds_smem, ds_full, ds_empty, it, stage,
                    phase, WG: gl.constexpr, DS_RING: gl.constexpr):
    """A query block none of whose rows sees a key of warpgroup WG (SKIP_MASKED): its
    dS^T is zero, so the warpgroup stores zeros for the block's dQ product and keeps
    the protocol, without its four products. It waits for the block's Q and dO first:
    they land only after the producer saw the stage's previous use released by both
    warpgroups, so this release counts for this block."""
    mbarrier.wait(q_ready.index(stage), phase)
    mbarrier.wait(do_ready.index(stage), phase)
    mbarrier.arrive(qdo_empty.index(stage), count=1)
    ds_buf, ds_full_b, ds_empty_b, ds_phase = _ds_slot(ds_smem, ds_full, ds_empty, it,
                                                       DS_RING)
    BLOCK_M: gl.constexpr = ds_buf.type.shape[1]
    zero_ds = gl.zeros([BLOCK_N_WG, BLOCK_M], ds_buf.dtype, _acc_layout(BLOCK_M))
    mbarrier.wait(ds_empty_b, ds_phase ^ 1)
    ds_buf.slice(WG * BLOCK_N_WG, BLOCK_N_WG).store(zero_ds)
    fence_async_shared()  # the generic-proxy writes above before wgmma reads them
    mbarrier.arrive(ds_full_b, count=1)


@gluon.jit
def _walk_block(it, dead, dk, dv, lse_next, delta_next, walk, WG: gl.constexpr,
                IS_CAUSAL: gl.constexpr, LSE_AHEAD: gl.constexpr, DQ_TMA: gl.constexpr,
                LSE_SMEM: gl.constexpr, DS_RING: gl.constexpr):
    """The walk's it-th block for warpgroup WG: its keys' part (``_key_block``, or
    ``_skip_key_block`` where ``dead``: no row sees them), then, every second block, the
    block's dQ product. Returns dk, dv and, with LSE_AHEAD, the next block's lse and
    delta (loaded here, a block ahead). walk: _mma_partition's operands."""
    (k, k_all, v, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, qdo_empty,
     ds_smem, ds_full, ds_empty, dq_smem, DQAccum, Lse, Delta, s_init, dq_init, o_n, key0,
     bh0, off_b, h0, m_lo, n_m, n_iter, seqlen_q, seqlen_k, diag_offset, qk_scale) = walk
    BLOCK_M: gl.constexpr = q_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[4]
    STAGES: gl.constexpr = q_smem.type.shape[0]
    s_layout: gl.constexpr = _acc_layout(BLOCK_M)
    row0 = (m_lo + it % n_m) * BLOCK_M
    o_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))  # (M,)
    stage = it % STAGES
    phase = (it // STAGES) & 1
    # lse and delta: BLOCK_M fp32 each, loaded here (not by TMA: a row of lse is
    # seqlen_q * 4 bytes, a 16-byte multiple only when seqlen_q is a multiple of 4),
    # one value per thread, then spread to the columns of S^T through shared memory:
    # loaded in S^T's column layout, each thread would hold 16 values and their 16
    # 64-bit addresses (48 registers), which spilled at head_dim 128.
    p_row = (bh0 + it // n_m).to(gl.int64) * seqlen_q
    if LSE_AHEAD:
        # This block's, loaded during the previous one: no global load latency on
        # the walk's path (the load sat right before S^T's issue, its result needed
        # to convert it); the next block's issued now, masked off past the walk.
        lse2 = gl.convert_layout(_base2(lse_next), gl.SliceLayout(0, s_layout))
        delta_flat = delta_next
        nx = it + 1
        p_row_nx = (bh0 + nx // n_m).to(gl.int64) * seqlen_q
        rows_nx = gl.where(nx < n_iter, seqlen_q, 0)
        row0_nx = (m_lo + nx % n_m) * BLOCK_M
        lse_next = _row_flat(Lse + p_row_nx, row0_nx, rows_nx, float("inf"), BLOCK_M)
        delta_next = _row_flat(Delta + p_row_nx, row0_nx, rows_nx, 0.0, BLOCK_M)
    elif not LSE_SMEM:
        lse2 = _lse2(Lse + p_row, row0, seqlen_q, BLOCK_M, s_layout)
    if LSE_SMEM:
        lse2 = None  # _key_block reads it from the stage once Q has landed
    if not LSE_AHEAD:
        delta_flat = None
    if dead:
        _skip_key_block(q_ready, do_ready, qdo_empty, ds_smem, ds_full, ds_empty, it,
                        stage, phase, WG, DS_RING)
    else:
        dk, dv = _key_block(
            k, v, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, qdo_empty,
            ds_smem, ds_full, ds_empty, it, stage, phase, s_init, o_n, o_m, row0, key0,
            seqlen_q, seqlen_k, diag_offset, qk_scale, lse2, delta_flat, Delta, p_row,
            dk, dv, WG, IS_CAUSAL, LSE_AHEAD, LSE_SMEM, DS_RING)
    ds_buf, ds_full_b, ds_empty_b, ds_phase = _ds_slot(ds_smem, ds_full, ds_empty, it,
                                                       DS_RING)
    if it % 2 == WG:
        mbarrier.wait(ds_full_b, ds_phase)  # the other warpgroup's dS^T stored too
        p_dq = DQAccum if DQ_TMA else DQAccum + p_row * HEAD_DIM
        _dq_partial(ds_buf, k_all, dq_init, p_dq, row0, seqlen_q, ds_empty_b,
                    dq_smem, off_b, h0 + it // n_m, WG, DQ_TMA)
    return dk, dv, lse_next, delta_next


@gluon.jit
def _mma_partition(args, dq_smem, WG: gl.constexpr, IS_CAUSAL: gl.constexpr,
                   LSE_AHEAD: gl.constexpr, DQ_TMA: gl.constexpr, LSE_SMEM: gl.constexpr,
                   DS_RING: gl.constexpr, SKIP_MASKED: gl.constexpr):
    """Consumer warpgroup WG: keys key0 + 64 * WG + [0, 64) against every query block.
    ds_smem: one dS^T buffer (128 keys, BLOCK_M), two with DS_RING (then ds_full and
    ds_empty are two barriers, one a buffer).
    DQ_TMA: DQAccum is the accumulator's tensor map and dq_smem holds each warpgroup's
    dQ tiles on their way to its TMA reduce-adds (one a 64-dim piece, the first half of
    them warpgroup 0's); unused otherwise. LSE_SMEM: lse and delta come with Q and dO
    in lse_smem and delta_smem (the option lse_smem). SKIP_MASKED: blocks where no row
    sees a key of the warpgroup skip its products (the option skip_masked)."""
    (q_smem, k_smem, v_smem, do_smem, ds_smem, kv_ready, q_ready, do_ready, qdo_empty,
     ds_full, ds_empty, dk_desc, dv_desc, Lse, Delta, DQAccum, off_b, off_dkv, key0, h0,
     n_heads, m_lo, n_m, nheads, seqlen_q, seqlen_k, diag_offset, softmax_scale, lse_smem,
     delta_smem) = args
    BLOCK_M: gl.constexpr = q_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[4]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _acc_layout(BLOCK_M)
    d_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    dq_layout: gl.constexpr = _acc_layout(DQ_PIECE)
    qk_scale = softmax_scale * LOG2E

    # lse, delta and the dQ accumulator are (batch, nheads, seqlen_q, ...): the program's
    # first query head is row bh0 of their (batch * nheads) heads.
    bh0 = off_b * nheads + h0
    # K of both warpgroups (ds_smem: their dS^T): the 128 keys of the dQ product.
    k_all = k_smem.reshape([2 * BLOCK_N_WG, HEAD_DIM])                       # (128, D)
    k = k_all.slice(WG * BLOCK_N_WG, BLOCK_N_WG)                             # (64, D)
    v = v_smem.index(WG).reshape([BLOCK_N_WG, HEAD_DIM])                     # (64, D)
    o_n = key0 + WG * BLOCK_N_WG + gl.arange(0, BLOCK_N_WG,
                                             layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([BLOCK_N_WG, HEAD_DIM], gl.float32, d_layout)
    dv = gl.zeros([BLOCK_N_WG, HEAD_DIM], gl.float32, d_layout)
    s_init = gl.zeros([BLOCK_N_WG, BLOCK_M], gl.float32, s_layout)  # ignored: use_acc=False
    dq_init = gl.zeros([BLOCK_M, DQ_PIECE], gl.float32, dq_layout)  # ignored: use_acc=False
    mbarrier.wait(kv_ready, 0)

    n_iter = n_heads * n_m
    lse_next = 0  # (LSE_AHEAD: the next block's lse and delta, loaded a block ahead)
    delta_next = 0
    if LSE_AHEAD:  # the first block's lse and delta (see the walk)
        p_row0 = bh0.to(gl.int64) * seqlen_q
        lse_next = _row_flat(Lse + p_row0, m_lo * BLOCK_M, seqlen_q, float("inf"), BLOCK_M)
        delta_next = _row_flat(Delta + p_row0, m_lo * BLOCK_M, seqlen_q, 0.0, BLOCK_M)
    first_key = key0 + WG * BLOCK_N_WG
    # The walk's runtime operands in one tuple (the constants stay out: see the kernel).
    walk = (k, k_all, v, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready,
            qdo_empty, ds_smem, ds_full, ds_empty, dq_smem, DQAccum, Lse, Delta, s_init,
            dq_init, o_n, key0, bh0, off_b, h0, m_lo, n_m, n_iter, seqlen_q, seqlen_k,
            diag_offset, qk_scale)
    for it in range(n_iter):
        dead = False  # (a constant without SKIP_MASKED: its branch is then static)
        if SKIP_MASKED:  # no row of the block sees a key of this warpgroup
            dead = first_key >= seqlen_k
            if IS_CAUSAL:
                row0 = (m_lo + it % n_m) * BLOCK_M
                dead = dead | (first_key > row0 + (BLOCK_M - 1) + diag_offset)
        dk, dv, lse_next, delta_next = _walk_block(
            it, dead, dk, dv, lse_next, delta_next, walk, WG, IS_CAUSAL, LSE_AHEAD,
            DQ_TMA, LSE_SMEM, DS_RING)

    # dK and dV leave through this warpgroup's K and V buffers once the last dQ product,
    # which reads both halves of K, has completed (a fresh barrier passes: no walk). TMA
    # drops the rows past seqlen_k.
    if DS_RING:  # each buffer's last product: buffer b served blocks b, b + 2, ...
        for b in gl.static_range(2):
            mbarrier.wait(ds_empty.index(b), (((n_iter + 1 - b) // 2) & 1) ^ 1)
    else:
        mbarrier.wait(ds_empty, (n_iter & 1) ^ 1)
    k_out = k_smem.slice(WG * BLOCK_N_WG, BLOCK_N_WG, dim=1)
    v_out = v_smem.index(WG)
    k.store((dk * softmax_scale).to(dtype))  # k_out's rows, through the 2-d view
    v_out.reshape([BLOCK_N_WG, HEAD_DIM]).store(dv.to(dtype))
    fence_async_shared()  # the generic-proxy writes above before the TMA engine reads
    row = key0 + WG * BLOCK_N_WG
    tma.async_copy_shared_to_global(dk_desc, [off_b, row, off_dkv, 0], k_out)
    tma.async_copy_shared_to_global(dv_desc, [off_b, row, off_dkv, 0], v_out)
    tma.store_wait(0)


@gluon.jit
def _program_walk(BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, seqlen_q, nheads,
                  nheads_kv, head_split, diag_offset, IS_CAUSAL: gl.constexpr,
                  LPT: gl.constexpr):
    """What this program owns and walks: its first key key0 (BLOCK_N keys), batch off_b,
    the head off_dkv of dK/dV it stores (its KV head off_hkv's share with head_split),
    query heads h0 + [0, n_heads), and query blocks m_lo + [0, n_m). The grid is (key
    blocks, heads), or with LPT (heads, key blocks): the hardware hands programs out
    in grid order, so every head's first key block, a causal walk's longest, goes first
    (the option lpt of the module docstring)."""
    if LPT:
        key0 = gl.program_id(1) * BLOCK_N
        off_bh = gl.program_id(0)
    else:
        key0 = gl.program_id(0) * BLOCK_N
        off_bh = gl.program_id(1)
    off_b = off_bh // (nheads_kv * head_split)
    off_dkv = off_bh % (nheads_kv * head_split)  # the head of dK/dV this program stores
    off_hkv = off_dkv // head_split
    n_heads = nheads // nheads_kv // head_split  # query heads this program walks
    h0 = off_hkv * (nheads // nheads_kv) + off_dkv % head_split * n_heads
    # Query blocks [m_lo, m_hi) hold a row that sees one of these keys: with causal, row
    # i sees key j when j <= i + diag_offset, so the first is key0 - diag_offset.
    m_lo = 0
    if IS_CAUSAL:
        m_lo = gl.maximum(key0 - diag_offset, 0) // BLOCK_M
    n_m = gl.maximum(gl.cdiv(seqlen_q, BLOCK_M) - m_lo, 0)
    return key0, off_b, off_dkv, off_hkv, h0, n_heads, m_lo, n_m


@gluon.jit
def _attn_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta,
                            DQAccum, seqlen_q, seqlen_k, nheads, nheads_kv, head_split,
                            dq_rows, diag_offset, softmax_scale, IS_CAUSAL: gl.constexpr,
                            STAGES: gl.constexpr, LSE_AHEAD: gl.constexpr,
                            DQ_TMA: gl.constexpr, LSE_SMEM: gl.constexpr,
                            DS_RING: gl.constexpr, LPT: gl.constexpr,
                            SKIP_MASKED: gl.constexpr):
    """dK, dV of 128 keys of one (batch, KV head), dQ added into DQAccum: fp32 (batch,
    nheads, seqlen_q, head_dim), zeroed by the preprocess (DQ_TMA: its tensor map,
    ``_dq_descriptor``). head_split > 1 (GQA): the
    group's query heads are dealt to head_split programs, each storing its share of dK
    and dV into head off_hkv * head_split + its index of dk_desc/dv_desc (the dQ conversion's
    launch sums the shares). dq_rows: seqlen_q, unused here (bwd_hopper256's kernel, which
    reads it, takes the same arguments). LSE_AHEAD, DQ_TMA, LSE_SMEM, DS_RING, LPT:
    the schedule options of the module docstring."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    key0, off_b, off_dkv, off_hkv, h0, n_heads, m_lo, n_m = _program_walk(
        2 * BLOCK_N_WG, BLOCK_M, seqlen_q, nheads, nheads_kv, head_split, diag_offset,
        IS_CAUSAL, LPT)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape,
                                       q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    # K in one buffer of both halves (rows: keys), so that the dQ product reads 128 keys.
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [1, 2 * BLOCK_N_WG, 1, HEAD_DIM],
                                       k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape,
                                       v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [2 * BLOCK_N_WG, BLOCK_M], q_desc.dtype)
    if DS_RING:  # two buffers, alternating by query block
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, 2 * BLOCK_N_WG, BLOCK_M],
                                            ds_layout)
    else:
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * BLOCK_N_WG, BLOCK_M],
                                            ds_layout)
    if DQ_TMA:
        # dQ_partial's tiles on their way to the TMA reduce-add, (BLOCK_M, 64) fp32 each:
        # one a 64-dim piece a warpgroup (each owns its tiles: a TMA's completion is
        # tracked by the thread issuing it).
        dq_tiles: gl.constexpr = 2 * (HEAD_DIM // DQ_PIECE)
        dq_smem = gl.allocate_shared_memory(
            gl.float32, [dq_tiles] + DQAccum.block_type.shape, DQAccum.layout)
    else:
        dq_smem = ds_smem  # a placeholder: the atomics need no buffer
    if LSE_SMEM:  # Lse and Delta are tensor maps of rows: a ring of BLOCK_M values each
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + Lse.block_type.shape,
                                             Lse.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32,
                                               [STAGES] + Delta.block_type.shape,
                                               Delta.layout)
    else:
        lse_smem = ds_smem  # placeholders: lse and delta are read from global memory
        delta_smem = ds_smem
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    if DS_RING:  # a full and an empty barrier for each dS^T buffer
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(ds_full.index(b), count=2)
            mbarrier.init(ds_empty.index(b), count=1)
    else:
        ds_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(ds_full, count=2)  # both warpgroups stored their dS^T
        mbarrier.init(ds_empty, count=1)  # the owner's dQ product has completed
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)  # one arrival per consumer warpgroup

    # The consumers' runtime arguments in one tuple; their constants (WG, the flags)
    # stay outside it: a tuple held in a variable turns constants into runtime values.
    mma_args = (q_smem, k_smem, v_smem, do_smem, ds_smem, kv_ready, q_ready, do_ready,
                qdo_empty, ds_full, ds_empty, dk_desc, dv_desc, Lse, Delta, DQAccum, off_b,
                off_dkv, key0, h0, n_heads, m_lo, n_m, nheads, seqlen_q, seqlen_k,
                diag_offset, softmax_scale, lse_smem, delta_smem)
    load_args = (q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
                 q_ready, do_ready, qdo_empty, off_b, off_hkv, key0, h0, n_heads, m_lo, n_m,
                 Lse, Delta, lse_smem, delta_smem, seqlen_q, nheads)
    gl.warp_specialize([
        (_mma_partition, (mma_args, dq_smem, 0, IS_CAUSAL, LSE_AHEAD, DQ_TMA, LSE_SMEM,
                          DS_RING, SKIP_MASKED)),
        (_load_partition, (load_args, LSE_SMEM)),
        (_mma_partition, (mma_args, dq_smem, 1, IS_CAUSAL, LSE_AHEAD, DQ_TMA, LSE_SMEM,
                          DS_RING, SKIP_MASKED)),
    ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


# Head dims with a kernel: this module's, and bwd_hopper256's at 256.
HEAD_DIMS = (*sorted(configs.HOPPER_BWD_16BIT), 256)


def tile_dim(head_dim: int) -> int | None:
    """The head dim of the kernel that serves ``head_dim``: itself, or the wider tile
    configs.HOPPER_WIDER runs it in (its tensor maps read zeros past head_dim and store
    nothing there; the dQ accumulator is the tile's width), None where none does."""
    return head_dim if head_dim in HEAD_DIMS else configs.HOPPER_WIDER.get(head_dim)


def unsupported(q, k, v, out, dout, *, softmax_scale=1.0, attn_mask=None,
                alibi_slopes=None, window_left=-1, window_right=-1, softcap=0.0,
                dropout_p=0.0, **_) -> str | None:
    """Why this kernel cannot serve the backward of a dense call (None: it can). The
    arguments are those of ``flashtile.ops.bwd.attn_bwd``, already validated."""
    if q.element_size() != 2:  # the forward kernel also takes FP8, which has no backward
        return f"dtype {q.dtype}: float16 or bfloat16 only"
    if tile_dim(q.shape[-1]) is None:
        dims = sorted([*HEAD_DIMS, *configs.HOPPER_WIDER])
        return f"head_dim {q.shape[-1]}: one of {dims} only"
    # The forward kernel's conditions: device, dtype, features, TMA layouts of q, k, v.
    reason = fwd_hopper.unsupported(q, k, v, softmax_scale=softmax_scale,
                                    attn_mask=attn_mask, alibi_slopes=alibi_slopes,
                                    window_left=window_left, window_right=window_right,
                                    softcap=softcap, dropout_p=dropout_p)
    if reason is not None:
        return reason
    if dout.data_ptr() % 16 or dout.stride(-1) != 1 or any(
            s <= 0 or s % 8 for s in dout.stride()[:-1]):
        return ("TMA needs 16-byte aligned data and strides, and a contiguous last dim "
                "(dout)")
    return None


def _descriptor(x, rows: int, tile_d: int):
    """fwd_hopper's tensor map over (batch, seqlen, heads, head_dim) in (1, rows, 1,
    tile_d) boxes (tile_d >= head_dim: ``tile_dim``)."""
    return fwd_hopper._descriptor(x, (1, rows, 1, tile_d))


def _dq_descriptor(dq_accum, rows: int) -> TensorDescriptor:
    """dq_tma: a tensor map over the fp32 dQ accumulator (batch, nheads, seqlen_q,
    head_dim) in (1, 1, rows, 64) boxes, one dQ_partial tile (a query block's rows),
    128-byte swizzled (Triton sends each box as two 32-column messages); the reduce-adds
    drop rows past seqlen_q. Head dim 256 (bwd_hopper256's kernel): over the (1, batch *
    nheads, seqlen_q, 256) view, since that kernel names a (batch, query head) pair by
    one coordinate: with two, ptxas stored and reloaded 2 words a block inside warpgroup
    1's causal walk (sm_90 compile)."""
    if dq_accum.shape[-1] == 256:
        dq_accum = dq_accum.view(1, -1, *dq_accum.shape[2:])
    box = (1, 1, rows, DQ_PIECE.value)
    return TensorDescriptor(dq_accum, list(dq_accum.shape), list(dq_accum.stride()),
                            list(box), fwd_hopper._smem_layout(box, gl.float32))


def _rows_descriptor(x, rows: int) -> TensorDescriptor:
    """lse_smem: a tensor map over x (batch, nheads, seqlen_q) fp32, contiguous and
    16-byte aligned, seqlen_q a multiple of 4, as (batch * nheads, seqlen_q), in boxes
    of one row of ``rows`` values: a query block's lse or delta. No swizzle: the
    consumers read the row by column."""
    b, h, sq = x.shape
    return TensorDescriptor(x.view(b * h, sq), [b * h, sq], [sq, 1], [1, rows],
                            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                 rank=2))


# lpt: every head's Q and dO at once, which the first wave's programs (one a head and key
# block) read, must stay in L2 (the H200's 50 MB; the forward's persistent order keeps
# 32 MiB of K and V there, as FA3's), else each Q/dO block would come from DRAM once a
# program where the default order (a head's key blocks side by side) reads it about once.
LPT_QDO_BYTES = 40 << 20


def lpt_fits(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
             itemsize: int, block_n: int) -> bool:
    """Where lpt applies: every head's Q and dO fit LPT_QDO_BYTES, and the key blocks fit
    the grid's y dimension (lpt puts them there; CUDA stops it at 65535)."""
    return (batch * nheads * seqlen_q * head_dim * 2 * itemsize <= LPT_QDO_BYTES
            and configs.cdiv(seqlen_k, block_n) <= V.MAX_GRID_Y)


def kernel_flags(head_dim: int, causal: bool, opts: frozenset[str], block_m: int,
                 seqlen_q: int | None = None) -> dict:
    """The kernel's constexpr switches (but STAGES) for FLASHTILE_HOPPER_BWD_OPTS ``opts``
    (``configs.hopper_bwd_opts()``) at BLOCK_M ``block_m``; lse_smem runs as lse_ahead
    where ``seqlen_q`` (None: any that suits it) is not a multiple of 4 (the module
    docstring) or is shorter than a block (a box wider than its tensor's innermost
    dimension, never tried on the GPU), unless lse_pre pads its rows to whole blocks.
    bwd_hopper256's kernel (head_dim 256) takes dq_tma and lpt alone (its docstring):
    the other options change a schedule it does not have, and the default's lse_ahead is
    passed over there. lpt and skip_masked apply to causal attention only (``backward``
    drops lpt where ``lpt_fits`` says no)."""
    lpt = "lpt" in opts and causal  # (full attention: every walk is as long)
    if head_dim == 256:
        return dict(IS_CAUSAL=causal, DQ_TMA="dq_tma" in opts, LPT=lpt)
    # lse_smem brings lse and delta with Q and dO: lse_ahead's loads have nothing to do.
    # (lse_pre's rows are padded to whole blocks: its maps suit every seqlen_q.)
    short = seqlen_q is not None and (seqlen_q % 4 or seqlen_q < block_m) \
        and "lse_pre" not in opts
    if "lse_smem" in opts and short:
        opts = opts - {"lse_smem"} | {"lse_ahead"}
    lse_smem = "lse_smem" in opts
    return dict(IS_CAUSAL=causal, LSE_AHEAD="lse_ahead" in opts and not lse_smem,
                DQ_TMA="dq_tma" in opts, DS_RING="ds_ring" in opts,
                LSE_SMEM=2 if lse_smem and "lse_pre" in opts else lse_smem,
                LPT=lpt, SKIP_MASKED=causal and "skip_masked" in opts)


def smem_bytes(head_dim: int, block_m: int, stages: int, flags: dict) -> int:
    """The shared memory the kernel allocates at 16 bits (its barriers and a few hundred
    bytes of layout-conversion scratch aside): the Q and dO ring (LSE_SMEM: with lse and
    delta rows), K and V, dS^T (two with DS_RING) and DQ_TMA's fp32 dQ_partial tiles
    (``_attn_bwd_hopper_kernel``).
    tests/test_gluon_compile.py holds it to the compiled kernel's figure."""
    bits16 = 2
    ring = 2 * stages * block_m * head_dim * bits16
    if flags.get("LSE_SMEM"):  # lse and delta rows beside Q and dO, fp32
        ring += 2 * stages * block_m * 4
    k_v = 2 * (2 * BLOCK_N_WG.value) * head_dim * bits16
    ds = (2 if flags.get("DS_RING") else 1) * 2 * BLOCK_N_WG.value * block_m * bits16
    dq = 0
    if flags.get("DQ_TMA"):
        dq = 2 * (head_dim // DQ_PIECE.value) * block_m * DQ_PIECE.value * 4
    return ring + k_v + ds + dq


def check_fits(head_dim: int, cfg, flags: dict) -> None:
    """A ValueError naming the knobs when FLASHTILE_HOPPER_BWD_CONFIG's STAGES and
    BLOCK_M with FLASHTILE_HOPPER_BWD_OPTS's options need more shared memory than a
    Hopper program has (``smem_bytes``), instead of Triton's OutOfResources at compile
    time: at head_dim 128, dq_tma's four 16 KiB tiles leave room for two stages of Q and
    dO, not three."""
    need = smem_bytes(head_dim, cfg.block_m, cfg.num_stages, flags)
    if need > configs.SM90_SMEM_BYTES:
        opts = sorted(k.lower() for k, v in flags.items() if v and k != "IS_CAUSAL")
        raise ValueError(
            f"FLASHTILE_HOPPER_BWD_CONFIG={cfg.block_m},{cfg.block_n},{cfg.num_warps},"
            f"{cfg.num_stages} with FLASHTILE_HOPPER_BWD_OPTS={','.join(opts) or 'none'} "
            f"at head_dim {head_dim} needs {need} bytes of shared memory, more than the "
            f"{configs.SM90_SMEM_BYTES} a Hopper program has: fewer STAGES, BLOCK_M 64 or "
            "fewer options")


# The parameters each plan of the backward fills per call, in its kernel's order.
_PRE_SLOTS = ("Out", "DOut", "DLse", "Delta", "DQAccum", "Lse", "Lse2")
_MAIN_SLOTS = ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc", "Lse",
               "Delta", "DQAccum", "softmax_scale")
_CONVERT_SLOTS = ("DQAccum", "DQ", "DKShares", "DVShares", "DK", "DV", "softmax_scale")


# GQA: below this many programs a wave (of the device's SMs) the backward's grid
# splits each group's query heads among programs (``head_split``). One program a
# (key block, KV head) walks the whole group: transformers' Llama-3.2-1B training step
# (batch 1, 4k tokens, 32 query over 8 KV heads, 256 programs on 132 SMs) ran this
# kernel at 0.55x cuDNN's backward (session 13, NOTES.md section 23).
HEAD_SPLIT_WAVES = 4


def head_split(group_size: int, programs: int, num_sms: int) -> int:
    """The programs that share one (key block, KV head)'s group of ``group_size`` query
    heads: the smallest divisor of the group that gives the grid of ``programs`` (at one
    a group) HEAD_SPLIT_WAVES waves of ``num_sms``, else one a query head. Each stores
    its share of dK and dV (16-bit, as flash-attn 2 stores GQA's per-head dK and dV
    before summing them); the dQ conversion's launch sums the shares in fp32 (one
    rounding)."""
    for split in range(1, group_size):
        if group_size % split == 0 and programs * split >= HEAD_SPLIT_WAVES * num_sms:
            return split
    return group_size


def backward(dout, q, k, v, out, lse, dlse, softmax_scale, diag_offset, causal):
    """(dq, dk, dv) shaped like q, k, v in their dtype, for a call ``unsupported``
    accepted (the caller checks). lse and dlse (or None): (batch, nheads, seqlen_q) fp32.
    Three launches: the portable preprocess (delta, dq_accum zeroed), this module's
    kernel, the portable dQ conversion. After the first call of a layout, launch plans
    (``flashtile.ops._launch``) launch the compiled kernels directly, encoding the six
    tensor maps from the call's tensors. GQA with a small grid (``head_split``): dK and dV
    are the kernel's shares, summed by the dQ conversion's launch (``bwd.convert_grid``)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    tile_d = tile_dim(d)
    # Keys a program: 128 (two warpgroups of 64), 64 at head_dim 256 (bwd_hopper256).
    block_n = configs.HOPPER_BWD_D256.block_n if tile_d == 256 else 2 * BLOCK_N_WG.value
    split = configs.hopper_bwd_head_split(h // hkv) or head_split(
        h // hkv, configs.cdiv(sk, block_n) * b * hkv, fwd_hopper._num_sms(q.device))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # split > 1: the shares, each share's KV heads split times over (see the kernel),
    # summed into dk and dv by the dQ conversion's launch; else dK and dV themselves.
    dk_shares = torch.empty((b, sk, hkv * split, d), dtype=k.dtype, device=q.device)
    dv_shares = torch.empty((b, sk, hkv * split, d), dtype=v.dtype, device=q.device)
    dk, dv = (dk_shares, dv_shares) if split == 1 else (
        torch.empty(k.shape, dtype=k.dtype, device=q.device),
        torch.empty(v.shape, dtype=v.dtype, device=q.device))
    lse = lse.contiguous()
    has_dlse = dlse is not None
    dlse = dlse.contiguous() if has_dlse else lse  # lse: a never-read placeholder

    def row_buffers(pad):
        """delta, and lse in base 2 (lse_pre, LSE_SMEM 2: the preprocess writes both
        ``pad`` rows long, padding included, in one allocation; else delta stands in for
        lse2, which the preprocess then does not write)."""
        if not pad:
            delta = torch.empty_like(lse)
            return delta, delta
        both = torch.empty((2, b, h, pad), dtype=torch.float32, device=q.device)
        return both[0], both[1]

    # Rows tile_d wide: the kernel's atomics and the conversion address them so (a wider
    # tile's extra columns sum zeros: K's columns past d are read as 0).
    def accumulator():
        return torch.empty((b, h, sq, tile_d), dtype=torch.float32, device=q.device)

    key = None
    if _launch.ready(q):
        # unsupported() checked q, k, v and dout for TMA's alignment; the preprocess
        # also reads out, dlse and lse through plain pointers: their alignment is keyed.
        key = ("hopper_bwd", q.dtype, q.shape, k.shape, q.stride(), k.stride(), v.stride(),
               dout.stride(), out.stride(), causal, diag_offset, has_dlse, split,
               _launch.misalignment(_launch.pointers((out, dout, dlse, lse))))
        plans = _launch.lookup(key)
        if plans is not None:
            pre, main, convert, dq_tma, lse_smem, pad = plans
            dq_accum = accumulator()
            delta, lse2 = row_buffers(pad)
            pre((out.data_ptr(), dout.data_ptr(), dlse.data_ptr(), delta.data_ptr(),
                 dq_accum.data_ptr(), lse.data_ptr(), lse2.data_ptr()))
            # Tensor map slots take the tensor (the plan encodes the map), others its
            # address; lse_smem's row maps read lse where a map may (its alignment is in
            # the key), or lse_pre's lse2.
            lse = lse2 if pad else _aligned(lse) if lse_smem else lse
            rows = (lse, delta) if lse_smem else (lse.data_ptr(), delta.data_ptr())
            main((q, k, v, dout, dk_shares, dv_shares, *rows,
                  dq_accum if dq_tma else dq_accum.data_ptr(), softmax_scale))
            convert((dq_accum.data_ptr(), dq.data_ptr(), dk_shares.data_ptr(),
                     dv_shares.data_ptr(), dk.data_ptr(), dv.data_ptr(), softmax_scale))
            return dq, dk, dv
    cfg = configs.hopper_bwd_config(tile_d)
    flags = kernel_flags(tile_d, causal, configs.hopper_bwd_opts(tile_d), cfg.block_m, sq)
    flags["LPT"] = flags["LPT"] and lpt_fits(b, h, sq, sk, tile_d, q.element_size(),
                                             cfg.block_n)
    if tile_d != 256:  # bwd_hopper256's tiles are fixed and fit (configs.HOPPER_BWD_D256)
        check_fits(tile_d, cfg, flags)
    dq_accum = accumulator()
    configs.log_first_launch("hopper backward", q, d, cfg, flags)
    pre_m = configs.PREPROCESS_BLOCK_M
    # lse_pre: delta and lse2 padded to whole query blocks (the kernel's row maps read
    # every block whole, and the padding is what they mask with).
    pad = configs.cdiv(sq, cfg.block_m) * cfg.block_m if flags.get("LSE_SMEM") == 2 else 0
    delta, lse2 = row_buffers(pad)
    row_grid = (configs.cdiv(max(sq, pad), pre_m), b * h)
    # delta = rowsum(dO * O) - dlse, and dq_accum zeroed, by the portable preprocess.
    pre = _launch.first_launch(
        bwd._bwd_preprocess_kernel, row_grid,
        (out, dout, dlse, delta, dq_accum, lse, lse2,
         *configs.strides(False, out, dout), *dq_accum.stride()[:2], h, sq, d, pad),
        dict(BLOCK_M=pre_m, BLOCK_D=tile_d, BLOCK_DV=tile_d, HAS_DLSE=has_dlse,
             ZERO_DQ=True, LSE2=bool(pad)),
        _PRE_SLOTS if key is not None else None)
    keys = BLOCK_N_WG.value
    descs = tuple(_descriptor(x, rows, tile_d) for x, rows in (
        (q, cfg.block_m), (k, keys), (v, keys), (dout, cfg.block_m), (dk_shares, keys),
        (dv_shares, keys)))
    if tile_d == 256:  # its own module, which imports this one's pieces
        from flashtile.ops.bwd_hopper256 import _attn_bwd_hopper256_kernel as kernel
    else:
        kernel = _attn_bwd_hopper_kernel
    # dq_tma: the kernel takes the accumulator's tensor map, not its address.
    dq_arg = _dq_descriptor(dq_accum, cfg.block_m) \
        if flags.get("DQ_TMA") else dq_accum
    lse_arg, delta_arg = lse, delta
    if flags.get("LSE_SMEM"):
        lse = lse2 if pad else _aligned(lse)
        lse_arg, delta_arg = (_rows_descriptor(x, cfg.block_m) for x in (lse, delta))
    grid = (configs.cdiv(sk, cfg.block_n), b * hkv * split)
    main = _launch.first_launch(
        kernel, grid[::-1] if flags["LPT"] else grid,
        (*descs, lse_arg, delta_arg, dq_arg, sq, sk, h, hkv, split, sq, diag_offset,
         softmax_scale),
        dict(flags, STAGES=cfg.num_stages, num_warps=cfg.num_warps),
        _MAIN_SLOTS if key is not None else None)
    # dq from the accumulator; with split > 1 the same launch sums dK's and dV's shares.
    kv_rows = b * sk * hkv if split > 1 else 0
    convert = _launch.first_launch(
        bwd._bwd_dq_convert_kernel, bwd.convert_grid(b, h, sq, kv_rows),
        (dq_accum, dq, dk_shares, dv_shares, dk, dv, *dq_accum.stride()[:2],
         *configs.strides(False, dq), b, h, sq, d, kv_rows, softmax_scale),
        dict(BLOCK_M=pre_m, BLOCK_D=tile_d, SHARES=split),
        _CONVERT_SLOTS if key is not None else None)
    if key is not None and None not in (pre, main, convert):
        _launch.store(key, (pre, main, convert, bool(flags.get("DQ_TMA")),
                            bool(flags.get("LSE_SMEM")), pad))
    return dq, dk, dv


def _aligned(lse):
    """lse where a tensor map may read it: itself, or a copy where its address is not
    16-byte aligned (a forward may hand it over as a view into a larger allocation)."""
    return lse if lse.data_ptr() % 16 == 0 else lse.clone()


