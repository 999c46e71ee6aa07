"""Every tile table of flashtile, and the small launch helpers that go with them.

A config is (BLOCK_M, BLOCK_N, num_warps, num_stages). The tables are keyed by the
padded head dim and the element size; the GPU entries are what the sweep in
``benchmarks/`` measured best on an H200 (see docs/benchmarks/NOTES.md). Under the
Triton interpreter the blocks are small and unequal (BLOCK_M != BLOCK_N), so short test
sequences still cross several tiles and both mask-range computations get exercised.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass

import torch

from flashtile._backend import getenv
from flashtile.ops import _launch

logger = logging.getLogger("flashtile")


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 1
    # V's columns (the output's, and the backward's gradient columns) in this many
    # parts, one program each: set by _pick from the head dim (head_dim_parts) for the
    # forward and backward, by _wide_key_decode_config for the decode over a wide key.
    dv_parts: int = 1


# Tests set this to sweep tilings through the interpreter: {"fwd": TileConfig, ...}.
_override: dict[str, TileConfig] = {}


def set_override(kind: str, cfg: TileConfig | None) -> None:
    _launch.clear()  # plans hold the tiles they were made with
    if cfg is None:
        _override.pop(kind, None)
    else:
        _override[kind] = cfg


def cdiv(a: int, b: int) -> int:
    # Host code: triton.cdiv and triton.next_power_of_2 are constexpr functions that cost
    # microseconds per call outside a kernel; launchers call these several times a launch.
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def strides(varlen: bool, *tensors) -> tuple:
    """Every stride but the last (contiguous) one of each tensor, flattened in the order
    the kernels take them. Packed varlen tensors carry a leading batch of 1 whose stride
    the kernels must not use: 0."""
    return tuple(s for x in tensors for s in (0 if varlen else x.stride(0), *x.stride()[1:-1]))


def padded_head_dim(head_dim: int) -> int:
    # tl.dot needs K >= 16 and power-of-two tiles; the padding is masked on load/store.
    return max(16, next_power_of_2(head_dim))


# The widest fp32 accumulator a forward or backward program holds, in columns. Past it
# (head dims 257-512) the head dim's columns are split across programs (head_dim_parts):
# a (64, 512) fp32 accumulator over 4 warps is 256 registers a thread, so one program
# of the whole width took 32-row tiles (mma.sync, not wgmma, on Hopper) and still ran
# at 144-155 TFLOP/s forward, 52-58 forward+backward on the H200 (docs/benchmarks/
# h200-2026-12-02-s18/wide.md), below a naive matmul-softmax-matmul at 109-129.
MAX_PART_COLUMNS = 256


def head_dim_parts(head_dim: int) -> int:
    """Programs that share one block of rows (or keys) of a head, each holding 1/parts
    of the accumulators' columns: the forward's O and its part of V, the backward's dK
    and dV (its part of Q and dO) and dQ (its part of K). Each program recomputes the
    scores (and dP) over the whole head dim: at 2 parts 1.5x the forward's products and
    1.5-1.67x the backward's, for tiles that hold what a head dim of 256 holds."""
    return max(1, padded_head_dim(head_dim) // MAX_PART_COLUMNS)


def part_columns(head_dim: int, parts: int) -> int:
    """The columns of one part of a head dim (its tile, BLOCK_D or BLOCK_DV): at least
    16 (tl.dot's smallest K), so a narrow head dim beside a wide one (d 16, dv 512)
    gets parts past its padding, masked as padding is."""
    return max(16, padded_head_dim(head_dim) // parts)


# The rowsum(dO * O) preprocess holds two (BLOCK_M, head_dim) fp32 tiles per program;
# the fused backward's dQ conversion (fp32 accumulator -> dq) takes the same rows.
PREPROCESS_BLOCK_M = 32
# New tokens per program of the KV-cache append (decode appends 1, a verify step a few).
APPEND_BLOCK_T = 16
# Elements of one append tile, k's or v's: 16 tokens up to head_dim 512, fewer past it.
APPEND_TILE_ELEMENTS = 16 * 512


def append_block_t(block_d: int) -> int:
    """Tokens per append program for a (padded) head-dim tile of block_d."""
    return max(1, min(APPEND_BLOCK_T, APPEND_TILE_ELEMENTS // block_d))


# The widest key head-dim tile of the decode kernel. A wider head dim (DeepSeek's
# absorbed MLA: 576 = 512 latent + 64 rope) is this tile plus a tail tile, not one
# padded to 1024 (twice the registers and shared memory).
DECODE_MAX_BLOCK_D = 512


def decode_head_dim_tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DT) of the decode kernel for the key head dim: the tail tile
    BLOCK_DT is 0 up to DECODE_MAX_BLOCK_D."""
    if head_dim <= DECODE_MAX_BLOCK_D:
        return padded_head_dim(head_dim), 0
    return DECODE_MAX_BLOCK_D, padded_head_dim(head_dim - DECODE_MAX_BLOCK_D)


# The engine's elementwise kernels (engine/layernorm.py, activation.py, rope_store.py) are
# bound by memory: a program's tile of each operand is ELEMENTWISE_TILE elements, and its
# warps give each thread ELEMENTWISE_PER_THREAD of them (one 16-byte vector of a 16-bit
# dtype). On CPU (the interpreter) the tile is small, so that the tests' short rows span
# several column blocks, row blocks and head blocks.
ELEMENTWISE_TILE = 2048
ELEMENTWISE_TILE_INTERPRETER = 128
ELEMENTWISE_PER_THREAD = 8
# A row of RMSNorm stays whole in registers (one pass over memory): up to 16 warps, so
# up to 64 fp32 values a thread at hidden size 32k.
ELEMENTWISE_MAX_WARPS = 16


def _elementwise_tile(device: torch.device) -> int:
    return ELEMENTWISE_TILE_INTERPRETER if device.type == "cpu" else ELEMENTWISE_TILE


def elementwise_warps(elements: int) -> int:
    """Warps of a program holding ``elements`` of each operand."""
    return max(1, min(ELEMENTWISE_MAX_WARPS, elements // (32 * ELEMENTWISE_PER_THREAD)))


def rms_norm_tile(n: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) of RMSNorm over rows of n: the whole row (padded to a
    power of two) and as many rows as fill a tile (per-head norms of head_dim 64-128
    take 16-32 rows a program, hidden sizes one or two)."""
    block_n = next_power_of_2(n)
    rows = max(1, _elementwise_tile(device) // block_n)
    return block_n, rows, elementwise_warps(block_n * rows)


def silu_and_mul_tile(n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of SiLU-and-multiply over rows of n outputs: one row's
    column block a program."""
    block_n = min(next_power_of_2(n), _elementwise_tile(device))
    return block_n, elementwise_warps(block_n)


def rope_store_tile(heads: int, kv_heads: int, half: int,
                    device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_HALF, HEADS_Q, HEADS_KV, num_warps) of the rotary + cache-write kernel: a
    program rotates HEADS_Q q heads or HEADS_KV kv heads of one token, as many as fill a
    tile of (heads, 2 halves) (Qwen2.5-0.5B's 14 q heads of 64 and its 2 kv heads: one
    program each a token); the warps are sized for the q programs' tile of one half
    (its loads and stores are one half at a time)."""
    block_half = next_power_of_2(half)
    most = 1 << (max(1, _elementwise_tile(device) // (2 * block_half)).bit_length() - 1)
    heads_q = min(next_power_of_2(heads), most)
    heads_kv = min(next_power_of_2(kv_heads), most)
    return block_half, heads_q, heads_kv, elementwise_warps(heads_q * block_half)


# The engine's GEMV (engine/gemv.py) for decode steps of at most ENGINE_GEMV_MAX_M tokens:
# past 2 rows its FMA form loses to cuBLAS (session 38, NOTES.md section 48).
# FLASHTILE_ENGINE_GEMV: the largest step that takes it, "0" none. The default, 2: on an
# H100 (session 39, NOTES.md section 49; CUDA graphs, 1,024 keys) the decode step's
# forward at batch 1 went 0.901 -> 0.773 ms (0.5B) and 5.71 -> 5.35 ms (8B), at batch 2
# 0.883 -> 0.819 and 5.78 -> 5.63 ms.
ENGINE_GEMV_MAX_M = 2
ENGINE_GEMV = (str(ENGINE_GEMV_MAX_M),) + tuple(str(m) for m in range(ENGINE_GEMV_MAX_M))


def engine_gemv_max_tokens() -> int:
    """FLASHTILE_ENGINE_GEMV as the largest step (tokens) the engine's linears run
    through the GEMV; ENGINE_GEMV_MAX_M when unset."""
    return int(_env_choice("FLASHTILE_ENGINE_GEMV", ENGINE_GEMV))


# FLASHTILE_ENGINE_GEMV_FUSE=1 (opt-in until timed, stage engine-gemv): where the GEMV
# runs, each RMSNorm (with its residual add) runs inside the product after it and
# SiLU-and-multiply inside the down projection (gemv_norm, gemv_silu): three kernels a
# layer fewer, at a batch where each costs ~1-1.5 us, mostly its launch (session 16:
# 4.0 us a 0.5B layer at batch 1, NOTES.md section 26).
ENGINE_GEMV_FUSE = ("0", "1")


def engine_gemv_fuse() -> bool:
    """FLASHTILE_ENGINE_GEMV_FUSE: "1" fuses the norms and SiLU into the GEMV."""
    return _env_choice("FLASHTILE_ENGINE_GEMV_FUSE", ENGINE_GEMV_FUSE) == "1"


def gemv_tile(k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the engine's GEMV over rows of k inputs: the
    session 38 probe's winner at M = 1 and 2 for nearly every product of the 0.5B, 1B
    and 8B shapes, 4 features a program over 16 KB tiles of W where K allows (8 KB at K
    < 2048)."""
    return 4, 2048 if k >= 2048 else 1024, 4


_INTERPRETER = {
    "fwd": TileConfig(16, 32),
    "bwd_dkdv": TileConfig(32, 16),  # (BLOCK_M over queries, BLOCK_N over keys)
    "bwd_dq": TileConfig(16, 32),
    "bwd_fused": TileConfig(32, 16),  # as bwd_dkdv
}

# Hopper (sm90) fp16/bf16, keyed by padded head dim. d64/d128 entries are the best of
# the sweep on an H200 (docs/benchmarks/NOTES.md, run 2); 16/32 follow d64, 256 and 512
# are sized to compile without spilling (sm_90 AOT, tests/test_sm90_compile.py).
#
# Head dim 512 (and 257-511, padded to it) runs in 2 programs of 256 columns each
# (head_dim_parts): the tiles below are one part's. sm_90 AOT, bf16, registers
# full/causal, stack bytes, shared memory, against the whole-width tiles they replace
# (which held (rows, 512) fp32 accumulators: 32 rows, mma.sync; H200 144-155 TFLOP/s
# forward, 52-58 forward+backward, docs/benchmarks/h200-2026-12-02-s18/wide.md):
#   forward 128 x 32, 8 warps, 2 stages: 228/254, 0, 224 KiB; wgmma, each warpgroup its
#     own 64 rows (m64n32 for Q K^T over all 512 columns, m64n256 for P V's part), 415
#     instructions a 32-key tile. Was 32 x 32, 4 warps, 2: 255/255, 0, 98 KiB. 64 rows
#     spill over 4 warps (96-1144 B: the part's accumulator alone is 128 registers a
#     thread) and over 8 compute every score twice (Triton lays a dot that feeds a dot
#     with every warp along M: 2 warpgroups on 64 rows); 64-key tiles spill or pass
#     227 KiB; 128 x 16 does not spill but reads Q from shared memory twice as often.
#   dK/dV 32 queries x 16 keys, 8 warps, 2 stages: 182/254, 0, 97 KiB, mma.sync (64
#     keys, the least wgmma takes, spill 24-2320 B at every query block and warp count
#     tried, 1-3 stages). Was 32 x 16, 8, 1: 215/237, 0, 128 KiB, no copies in flight
#     (loads through registers). 64 x 16 (8, 2) runs 1.7x fewer instructions a
#     product, scores not duplicated, but keeps 64 B of scalars on the stack (reloaded
#     per query head, never in the walks): FLASHTILE_BWD_DKDV_CONFIG, stage d512-tiles.
#   dQ 32 x 32, 4 warps, 2 stages: 183/184, 0, 130 KiB, mma.sync, scores not duplicated.
#     Was 32 x 16, 8, 1: 232/236, 0, 96 KiB. 64 x 16 (8, 2; wgmma) spills 8 B causal.
#   fused 16 x 16, 8 warps, 2 stages: 166/248, 0, 80 KiB. Was 16 x 16, 8, 1: 236/254.
_FWD_16BIT = {
    16: TileConfig(128, 64, 8, 3), 32: TileConfig(128, 64, 8, 3),
    64: TileConfig(128, 64, 8, 3), 128: TileConfig(128, 128, 8, 3),
    256: TileConfig(64, 32, 4, 2),
    512: TileConfig(128, 32, 8, 2),
}
# Causal/windowed: the masked diagonal blocks cost more with large tiles at d64.
_FWD_16BIT_CAUSAL = {
    16: TileConfig(64, 64, 4, 3), 32: TileConfig(64, 64, 4, 3),
    64: TileConfig(64, 64, 4, 3), 128: TileConfig(128, 64, 8, 3),
    256: TileConfig(64, 32, 4, 2),
    512: TileConfig(128, 32, 8, 2),
}
_FWD_32BIT = {
    16: TileConfig(64, 64, 4, 2), 32: TileConfig(64, 64, 4, 2),
    64: TileConfig(64, 32, 4, 2), 128: TileConfig(64, 32, 4, 2),
    256: TileConfig(32, 32, 4, 1),
    512: TileConfig(32, 16, 8, 1),
}
# fp32 as tf32x3 (the default fp32 products, fp32_products): timed on the H200 (NOTES.md
# section 34, fp32 forward TFLOP/s at 2k/8k, full and causal): d64 128 x 64, 8 warps, 3
# stages 58.0-59.9 / 50.3-55.7 against the fp32 table's 64 x 32's 38.4-38.9 / 36.2-38.1
# (no spills for sm_90); d128 128 x 32, 1 stage 40.8 / 36.8-40.4 against 64 x 32's 25
# (both spill: 64-88 B against 88-176 B). The other head dims keep the fp32 table's.
_FWD_TF32X3 = {**_FWD_32BIT, 64: TileConfig(128, 64, 8, 3), 128: TileConfig(128, 32, 8, 1)}
# FP8 (e4m3/e5m2, forward only), keyed by padded head dim, at least FP8_MIN_BLOCK_D.
# Sized on CPU with tests/aot.py for sm_90: no spills with the dense path's V^T copy
# nor the varlen path's register transposition, causal or not
# (tests/test_sm90_compile.py); not yet timed on the GPU (a sweep: FLASHTILE_FWD_CONFIG).
_FWD_FP8 = {
    32: TileConfig(128, 64, 8, 3), 64: TileConfig(128, 128, 8, 3),
    128: TileConfig(128, 128, 8, 3), 256: TileConfig(128, 64, 8, 2),
}
# The FP8 wgmma's K step is 32: q k^T needs a head-dim tile of at least that.
FP8_MIN_BLOCK_D = 32
_BWD_DKDV_16BIT = {  # (BLOCK_M over queries, BLOCK_N over keys)
    16: TileConfig(32, 64, 4, 3), 32: TileConfig(32, 64, 4, 3),
    64: TileConfig(32, 64, 4, 3), 128: TileConfig(64, 128, 8, 2),
    256: TileConfig(32, 64, 8, 1),
    512: TileConfig(32, 16, 8, 2),
}
_BWD_DQ_16BIT = {
    16: TileConfig(64, 64, 4, 3), 32: TileConfig(64, 64, 4, 3),
    64: TileConfig(64, 64, 4, 3), 128: TileConfig(128, 64, 8, 3),
    256: TileConfig(64, 32, 8, 1),
    512: TileConfig(32, 32, 4, 2),
}
# fp32 at head dim 512, in parts too: 2 stages, whose copies go to shared memory without
# registers (the 1-stage tiles' register-staged loads of the other part spilled 8-952 B
# in parts: TF32 dK/dV causal, IEEE dK/dV and dQ). Registers full/causal at 16 x 16, 8
# warps: TF32 dK/dV 190/158, dQ 156/160; IEEE dK/dV 140/108, dQ 80/80. The forward's
# 32 x 16, 8 warps: TF32 1 stage 124/148; IEEE 2 stages 126/128 (1 stage: 8 B causal).
_BWD_32BIT = {
    16: TileConfig(32, 32, 4, 1), 32: TileConfig(32, 32, 4, 1),
    64: TileConfig(32, 32, 4, 1), 128: TileConfig(32, 32, 4, 1),
    256: TileConfig(16, 16, 4, 1),
    512: TileConfig(16, 16, 8, 2),
}
# fp32 with IEEE products (no TF32): the products are FFMA, not tensor-core instructions,
# and the fp32 tables' tiles, sized for TF32, spilled (sm_90 AOT: the d128 forward's 64x32
# tile held 8 KB of stack per thread; the H200 ran it 4x slower than SDPA's math backend).
# These compile without spills for sm_90 (tests/test_sm90_compile.py checks it).
_FWD_IEEE = {
    16: TileConfig(64, 32, 8, 2), 32: TileConfig(64, 32, 8, 2),
    64: TileConfig(64, 32, 8, 2), 128: TileConfig(32, 16, 4, 2),
    256: TileConfig(16, 16, 4, 2),
    512: TileConfig(32, 16, 8, 2),
}
_BWD_DKDV_IEEE = {
    16: TileConfig(32, 32, 8, 1), 32: TileConfig(32, 32, 8, 1),
    64: TileConfig(32, 32, 8, 1), 128: TileConfig(32, 32, 8, 1),
    256: TileConfig(16, 16, 8, 1),
    512: TileConfig(16, 16, 8, 2),
}
_BWD_DQ_IEEE = {
    16: TileConfig(32, 32, 8, 1), 32: TileConfig(32, 32, 8, 1),
    64: TileConfig(32, 32, 8, 1), 128: TileConfig(16, 16, 4, 1),
    256: TileConfig(16, 16, 8, 1),
    512: TileConfig(16, 16, 8, 2),
}
# The fused backward (ops/bwd.py: the dK/dV kernel also adds its share of dQ), (BLOCK_M
# over queries, BLOCK_N over keys). Not yet timed on a GPU: sized with tests/aot.py
# (sm_90, causal and not) as the largest tiles that compile without spilling; bf16
# registers causal/full: d16 238/232, d32 252/248, d64 254/228, d128 254/242 (123 KB
# of shared memory), d256 255/204, d512 (in parts, 2 stages) 248/166. The dK/dV
# accumulators stay in registers and the dQ product adds its own, so the query block is
# narrower than the split kernel's: 32 queries spill at d128 (32,64,8,2: 24 B causal),
# d256 (32,32,8,2: 160 B) and d512 (32,16,8,2 in parts: 8-48 B).
_BWD_FUSED_16BIT = {
    16: TileConfig(64, 128, 8, 2), 32: TileConfig(64, 128, 8, 2),
    64: TileConfig(32, 128, 8, 2), 128: TileConfig(16, 128, 8, 2),
    256: TileConfig(16, 32, 8, 2), 512: TileConfig(16, 16, 8, 2),
}
# fp32 stops at head_dim 128 (FUSED_BWD_FP32_MAX_HEAD_DIM): beyond, every fused tile we
# compiled spilled (IEEE 16,16,8,1: 16 B at d256, 168 B at d512; TF32 8 B at d512;
# tf32x3 320 B at d256), so the split kernels serve those calls. TF32 and tf32x3
# (registers causal/full at d128: 128/168 and 214/200):
_BWD_FUSED_32BIT = {
    16: TileConfig(16, 32, 8, 1), 32: TileConfig(16, 32, 8, 1),
    64: TileConfig(16, 32, 8, 1), 128: TileConfig(16, 16, 8, 1),
}
# IEEE products (FFMA; registers causal/full at d128: 180/172):
_BWD_FUSED_IEEE = {
    16: TileConfig(16, 32, 8, 1), 32: TileConfig(32, 32, 8, 1),
    64: TileConfig(32, 32, 8, 1), 128: TileConfig(32, 32, 8, 1),
}
FUSED_BWD_FP32_MAX_HEAD_DIM = 128


def fused_bwd_has_tiles(element_size: int, head_dim: int) -> bool:
    """Whether the fused backward has a tile for these inputs (else the split runs)."""
    return element_size == 2 or padded_head_dim(head_dim) <= FUSED_BWD_FP32_MAX_HEAD_DIM


# The Gluon forward for Hopper (ops/fwd_hopper.py), 16-bit inputs, keyed by head dim:
# BLOCK_M is two consumer warpgroups of 64 rows and num_warps the default partition's
# one warpgroup (the kernel adds the second and a producer warp: 12 warps in all).
# BLOCK_N and the K/V stages fill shared memory (Q 2 x 64 rows, stages x (K + V)), as
# FA3 sizes them: d64 112 KiB, d128 160 KiB (3 stages, 224 KiB, also fit), d256 192 KiB.
# Compile-checked on CPU (tests/test_gluon_compile.py); timed on the H200 in session 10
# (NOTES.md section 20): 1.26-1.75x the portable kernel at d128/d256, about even at d64.
HOPPER_FWD_16BIT = {
    64: TileConfig(128, 128, 4, 3), 128: TileConfig(128, 128, 4, 2),
    256: TileConfig(128, 64, 4, 2),
}
# d64 with three consumer warpgroups (BLOCK_M 192, FA3's tile there) where both lengths
# reach HOPPER_FWD_THREE_MIN_SEQLEN[causal]. On the H200 (session 20, NOTES.md section 30,
# beside two consumers in one run) it ran full attention +11% at 8k and +5% at 16k,
# causal +3% and +8%; at 1k and 4k causal lost (-21% and -11%: 192-row tiles leave
# ragged, unbalanced grids), full -2.5% at 1k. Session 27 (section 37, two alternating
# runs): full attention +6% at 2k and 4k, causal -13% at 2k and -7% at 4k. Session 31
# (section 41), with the tree row max three consumers take (HOPPER_FWD_TREE_MAX): causal
# -15% at 1k, -3% at 2k, +1.5% at 4k in both of two alternating rounds, so causal from 4k.
# Session 33 (section 43), once warpgroups wholly past seqlen_q stopped walking (a
# 192-row tile rarely divides a power-of-two length: 1,024 = 5 x 192 + 64): full +1.7% at
# 1k, causal +1.9% at 2k and -6% at 1k, both rounds each, so full from 1k, causal from 2k.
HOPPER_FWD_D64_THREE = TileConfig(192, 128, 4, 3)
HOPPER_FWD_THREE_MIN_SEQLEN = {False: 1024, True: 2048}
# 16-bit head dims the Gluon forward and backward run in a wider one's tile: their tensor
# maps keep the tensors' true head_dim and only the boxes are wider, so TMA zero-fills
# the columns past it on load (adding nothing to Q K^T, dS K or the dK/dV sums, making
# O's extra columns 0) and drops them on store; the compiled kernels are the wider
# dim's. Gluon's tiles must be powers of two, so this is the only way d96 gets a Hopper
# kernel; it pays 4/3 of d96's matrix work, as cuDNN appears to (its d96 forward runs
# at 0.75x its d128 TFLOP/s, session 25).
HOPPER_WIDER = {96: 128}
# On the H200 (session 26, NOTES.md section 36; beside cuDNN in one run, 1k-16k) d96 ran
# forward 1.17-1.57x the portable kernel (0.90-1.03x cuDNN) and forward+backward
# 1.25-1.36x (0.90-0.95x cuDNN), so auto takes both from the d128 thresholds.


def hopper_fwd_tile_dim(head_dim: int, fp8: bool = False) -> int | None:
    """The head dim of the Gluon forward's tile for ``head_dim`` (itself, or
    HOPPER_WIDER's for 16-bit inputs), None where it has none."""
    if head_dim in (HOPPER_FWD_FP8 if fp8 else HOPPER_FWD_16BIT):
        return head_dim
    return None if fp8 else HOPPER_WIDER.get(head_dim)


# FP8 (e4m3/e5m2) in the same kernel: half the bytes per K/V tile, and O gets a 16-bit
# buffer of its own (2 x 64 rows), so the ring is deeper: d64 120 KiB, d128 176 KiB,
# d256 192 KiB. d256 keeps 64 keys a block: O alone is 128 fp32 registers a thread.
# Timed at d128 only (H200, session 12: 640-799 TFLOP/s with P in shared memory).
HOPPER_FWD_FP8 = {
    64: TileConfig(128, 128, 4, 6), 128: TileConfig(128, 128, 4, 4),
    256: TileConfig(128, 64, 4, 3),
}
# FP8 P V summed tile by tile in fp32 (the portable kernel's PV_PER_TILE) up to this head
# dim: the product's own accumulator is a second O in registers, 128 a thread at d256.
HOPPER_FWD_FP8_PV_PER_TILE_MAX_D = 128
HOPPER_FWD_FP8_P = ("regs", "smem", "swap")


def hopper_fwd_fp8_p_smem() -> int:
    """FLASHTILE_HOPPER_FWD_FP8_P: how the Gluon forward's FP8 P reaches P V (the
    kernel's P_SMEM). "swap" (the default since session 35, 2): two shared buffers per
    warpgroup (16-32 KiB more), where the SASS keeps the wait for the previous P V after
    the softmax (FA3's in-warpgroup overlap), with each 32 keys of P and of V's copy in
    the order that gives a thread 8 adjacent bytes of P (fwd_hopper._p_stored): one
    8-byte store where "smem" (1) takes four of 2 bytes, and V's copy in one Triton pass
    (fwd._keys_contiguous_kernel: 23 us for 33.5 MB on the H200, where "smem"'s torch
    copies take 181). d128 on the H200 (session 35, NOTES.md section 45): swap 778-831
    TFLOP/s full, 657-809 causal (4k-16k) against smem's 658-797 and 486-744; the copy is
    most of the difference. "regs" (0, as 16-bit P): wgmma's A operand from registers,
    where ptxas waits for the previous P V before the softmax; smem ran at 1.26-1.40x
    regs (NOTES.md section 22). Read when a launch plan is made."""
    value = os.environ.get("FLASHTILE_HOPPER_FWD_FP8_P", "swap").strip() or "swap"
    if value not in HOPPER_FWD_FP8_P:
        raise ValueError(f"FLASHTILE_HOPPER_FWD_FP8_P must be one of {HOPPER_FWD_FP8_P}, "
                         f"got {value!r}")
    return {"regs": 0, "smem": 1, "swap": 2}[value]


HOPPER_FWD_FP8_PV = ("tile", "wgmma")


def hopper_fwd_fp8_pv_per_tile(head_dim: int) -> bool:
    """FLASHTILE_HOPPER_FWD_FP8_PV: how the Gluon forward sums FP8 P V. "tile" (the
    default): per tile in fp32 up to HOPPER_FWD_FP8_PV_PER_TILE_MAX_D, as the portable
    kernel does; "wgmma": in the wgmma's accumulator at every head dim (as at d256),
    which frees a second O tile of registers: with P in shared memory, BLOCK_N 256 at
    d128 then compiles without spills (FLASHTILE_HOPPER_FWD_CONFIG=128,256,4,2; O is
    staged in P's buffers). On the H200 (session 12, NOTES.md section 22) that pair ran
    full attention at 686/867 TFLOP/s (4k/16k, against 668/803 for the default) and
    causal at 433/749 (against 485/749); not the default: the FP8 accumulator keeps
    about 14 bits, and causal 4k loses. Read when a launch plan is made."""
    mode = _env_choice("FLASHTILE_HOPPER_FWD_FP8_PV", HOPPER_FWD_FP8_PV)
    return mode == "tile" and head_dim <= HOPPER_FWD_FP8_PV_PER_TILE_MAX_D


def _env_choice(name: str, choices: tuple) -> str:
    """The environment variable ``name``: one of ``choices``, the first when unset
    (read at each call through ``getenv``, the fast way: the Gluon forward reads one per
    call)."""
    value = getenv(name, "").strip() or choices[0]
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


# FLASHTILE_HOPPER_FWD=auto's cells (flashtile.custom_ops._hopper_fwd_wins): 16-bit
# inputs at head dims 64, 128 and 256 from this many queries. On the H200 (session 22,
# NOTES.md section 32; 16k tokens a batch, beside cuDNN in the same run) the Gluon
# forward ran 128-512 queries at 1.1-1.7x the portable kernel (d128 full at 512: 0.58x
# -> 0.97x cuDNN), level only at d64 causal 512; from 1k it was the default since
# sessions 10-13. Shorter query blocks were not timed (a 128-row tile would idle).
HOPPER_FWD_AUTO_MIN_SEQLEN = 128
# FP8 (flashtile.fp8) under auto: these head dims from this many queries. Session 12's
# rule was d128 from 4k (1.17-1.24x the portable kernel on the H200, NOTES.md section 22);
# on an H100 in session 39 (section 49; 16k tokens a batch, both masks) the Gluon kernel
# ran 1.10-1.27x the portable one at d64, 1.16-1.25x at d128 and 1.52-1.62x at d256 from
# 1k to 16k queries. Shorter calls were not timed.
HOPPER_FWD_FP8_AUTO_D = (64, 128, 256)
HOPPER_FWD_FP8_AUTO_MIN_SEQLEN = 1024
# FLASHTILE_HOPPER_BWD=auto (custom_ops._hopper_bwd_wins): the Gluon backward where both
# lengths reach this, by head dim. Session 22 (same run): forward+backward at 512 tokens
# 1.23-1.48x the portable backward at d64/d128, 2.5-3x at d256 from 128; at 128 and 256
# tokens d64/d128 lost up to 32%. Session 23 (section 33), its launch plan now encoding
# the tensor maps itself: at 256 tokens it won every d64/d128 cell by 8-33% (d128 full
# 0.75 -> 1.00x cuDNN); at 128 it won full by 4-8% and lost causal by 15%, so 256.
# d96 runs d128's kernel (HOPPER_WIDER) and takes its threshold; timed from 1k (session 26).
HOPPER_BWD_AUTO_MIN_SEQLEN = {64: 256, 96: 256, 128: 256, 256: 128}


HOPPER_FWD_SCHEDULE = ("auto", "tiles", "persistent")
# auto's persistent grid: the 16-bit head dims where it was timed ahead of "tiles", and
# d256 up to HOPPER_FWD_PERSISTENT_D256_MAX_SEQLEN queries.
HOPPER_FWD_PERSISTENT_AUTO_D = (64, 128)
HOPPER_FWD_PERSISTENT_D256_MAX_SEQLEN = 4096


def hopper_fwd_persistent(head_dim: int, fp8: bool, seqlen_q: int = 0) -> bool:
    """FLASHTILE_HOPPER_FWD_SCHEDULE: how the Gluon forward's grid covers the (query
    tile, batch-head) tiles. "tiles": one program a tile, causal tiles longest first;
    "persistent": one program per SM looping over tiles (FA3), causal ones longest first
    within groups of heads whose K and V fit L2, the next tile's Q, K and V loading while
    the consumers finish the current one. "auto" (the default): persistent for 16-bit
    inputs at HOPPER_FWD_PERSISTENT_AUTO_D, and at d256 up to
    HOPPER_FWD_PERSISTENT_D256_MAX_SEQLEN queries, tiles otherwise. On the H200 (session 12,
    NOTES.md section 22, d128) persistent ran bf16 at 1.11-1.15x tiles at 1k, 1.07x
    causal at 4k, level at 16k, and FP8 full attention 3% slower from 4k; at d64
    (session 13, section 23) persistent ran 1.04-1.21x the portable kernel, which tiles
    had only matched; at d256 (session 20, section 30) causal +5% at 1k and +8% at 4k,
    full +2% and +4%, but causal -7% at 16k. Its first call per geometry copies a tile
    list to the device, which a CUDA-graph capture cannot do: such a call takes the
    tiles grid (``fwd_hopper._persistent_schedule``). Read when a launch plan is made."""
    mode = _env_choice("FLASHTILE_HOPPER_FWD_SCHEDULE", HOPPER_FWD_SCHEDULE)
    if mode == "auto":
        return not fp8 and (head_dim in HOPPER_FWD_PERSISTENT_AUTO_D or (
            head_dim == 256 and seqlen_q <= HOPPER_FWD_PERSISTENT_D256_MAX_SEQLEN))
    return mode == "persistent"


# Q buffer sets of the Gluon forward's persistent grid (fwd_hopper._load_partition):
# "auto" (two at head_dim 64), "1", or "2" so that the next tile's Q and first K and V
# load during this tile. Session 32 on the H200 (NOTES.md section 42, two rounds beside
# cuDNN): d64 +3-5% at 1k (full and causal), level at 4k and 16k; d128 mixed (-2 to
# +5%), causal 16k 2-3% slower.
HOPPER_FWD_Q_BUFFERS = ("auto", "1", "2")


def hopper_fwd_q_buffers(head_dim: int) -> int:
    """FLASHTILE_HOPPER_FWD_Q_BUFFERS ("auto", "1" or "2"): the Q buffer sets the Gluon
    forward's persistent grid asks for at ``head_dim`` (the kernel's tile width); auto
    is two at 64, one elsewhere. With one, the producer loads the next tile's Q only
    once this tile's last S is done, and that tile's first K and V only after it; with
    two, as soon as it has issued this tile's last K and V. Taken where shared memory
    holds the second set beside O's own buffer (16-bit inputs: ``fwd_hopper._q_buffers``).
    Read at each call (part of the launch plan's key)."""
    choice = _env_choice("FLASHTILE_HOPPER_FWD_Q_BUFFERS", HOPPER_FWD_Q_BUFFERS)
    if choice == "auto":
        return 2 if head_dim <= 64 else 1
    return int(choice)


# The Gluon forward's row max as a tree (fwd_hopper._online_softmax's TREE_MAX): "auto"
# (three consumer warpgroups of 16-bit inputs), "0" or "1". Session 31 on the H200
# (NOTES.md section 41, two rounds beside cuDNN): the three-consumer d64 tiles ran 2-7%
# faster with it (2k-32k full, 8k-32k causal), two consumers 3-8% slower at d64 and
# level at d128, FP8 (three consumers, P in shared memory) 4-7% slower.
HOPPER_FWD_TREE_MAX = ("auto", "0", "1")


def hopper_fwd_tree_max_choice() -> str:
    """FLASHTILE_HOPPER_FWD_TREE_MAX, read at each call (part of the launch plan's key;
    ``hopper_fwd_tree_max`` turns it into the kernel's switch)."""
    return _env_choice("FLASHTILE_HOPPER_FWD_TREE_MAX", HOPPER_FWD_TREE_MAX)


def hopper_fwd_tree_max(choice: str, num_wg: int, fp8: bool) -> bool:
    """Whether the Gluon forward reduces its row max pairwise (the kernel's TREE_MAX) for
    ``choice`` (``hopper_fwd_tree_max_choice``) at ``num_wg`` consumer warpgroups:
    "auto" where three 16-bit consumers share the tensor cores (see
    HOPPER_FWD_TREE_MAX)."""
    return choice == "1" or (choice == "auto" and num_wg == 3 and not fp8)


# FLASHTILE_HOPPER_FWD_P_PACKED: "1" (the default since session 35) carries 16-bit P
# from its block to the next (where its P V issues) in packed 32-bit registers
# (fwd_hopper._p_operand's P_PACKED), "0" as the operand's 64 16-bit values, which ptxas
# re-packs with 32 PRMT a block (64 in the masked walks). sm_90 SASS, walk block
# instructions: d64 459 -> 427, d128 501 -> 469 (persistent, full); masked d64 635 ->
# 571. Three consumers on the persistent grid (160 registers) spill 16-24 bytes with it
# (the third consumer's walk 2 local stores a block) and still ran faster. On the H200
# (NOTES.md section 45): d64 causal 1k +7% (two consumers), d64 three consumers 2k-8k
# +2-5%, d128 full 1k-16k +2-4%, causal level within the run's noise.
HOPPER_FWD_P_PACKED = ("1", "0")  # the first is the default


def hopper_fwd_p_packed_choice() -> str:
    """FLASHTILE_HOPPER_FWD_P_PACKED, read at each call (part of the launch plan's key;
    ``hopper_fwd_p_packed`` turns it into the kernel's switch)."""
    return _env_choice("FLASHTILE_HOPPER_FWD_P_PACKED", HOPPER_FWD_P_PACKED)


def hopper_fwd_p_packed(choice: str, fp8: bool) -> bool:
    """Whether the Gluon forward carries P packed (the kernel's P_PACKED) for ``choice``:
    16-bit P only (FP8 P has FLASHTILE_HOPPER_FWD_FP8_P's ways)."""
    return choice == "1" and not fp8


def hopper_fwd_config(head_dim: int, fp8: bool = False, seqlen_q: int = 0,
                      seqlen_k: int = 0, causal: bool = True) -> TileConfig:
    """HOPPER_FWD_16BIT[head_dim] (HOPPER_FWD_FP8 for FP8 inputs; HOPPER_FWD_D64_THREE
    at 16-bit d64 where ``seqlen_q`` and ``seqlen_k`` reach
    HOPPER_FWD_THREE_MIN_SEQLEN[causal]), or
    FLASHTILE_HOPPER_FWD_CONFIG="BLOCK_M,BLOCK_N,4,STAGES" for sweeps: BLOCK_M is 64
    rows per consumer warpgroup, 128 (two) or 192 (three, each with 160 registers:
    16-bit at head_dim 64, FA3's tile there, and at 128 with at most 64 keys a block,
    since 128 keys spill; FP8 at head_dim 128 with P V summed in the wgmma); num_warps
    is the default partition's warpgroup."""
    cfg = _from_env("hopper_fwd")
    if cfg is None and not fp8 and head_dim == 64 \
            and min(seqlen_q, seqlen_k) >= HOPPER_FWD_THREE_MIN_SEQLEN[bool(causal)]:
        cfg = HOPPER_FWD_D64_THREE
    cfg = cfg or (HOPPER_FWD_FP8 if fp8 else HOPPER_FWD_16BIT)[head_dim]
    if fp8:  # S 64 and O 64 registers: P V summed in the wgmma, no second O
        three = head_dim == 128 and cfg.block_n <= 128 \
            and not hopper_fwd_fp8_pv_per_tile(head_dim)
    else:
        three = head_dim == 64 or (head_dim == 128 and cfg.block_n <= 64)
    if not (cfg.block_m == 128 or (cfg.block_m == 192 and three)) or cfg.num_warps != 4 \
            or cfg.block_n not in (16, 32, 64, 128, 256) or cfg.num_stages < 1:
        raise ValueError("FLASHTILE_HOPPER_FWD_CONFIG must be 'BLOCK_M,BLOCK_N,4,STAGES' with "
                         "BLOCK_M 128 (or 192 for 16-bit inputs at head_dim 64, or 128 with "
                         "BLOCK_N <= 64; FP8 at head_dim 128 with BLOCK_N <= 128 and "
                         "FLASHTILE_HOPPER_FWD_FP8_PV=wgmma), BLOCK_N a power of two from 16 "
                         f"to 256 and STAGES >= 1, got {cfg} for head_dim {head_dim}"
                         f"{' FP8' if fp8 else ''}")
    return cfg


# The Gluon backward for Hopper (ops/bwd_hopper.py), 16-bit only, keyed by head dim:
# BLOCK_N is two consumer warpgroups of 64 keys, num_warps the default partition's one
# warpgroup; BLOCK_M query rows per ring stage. 64 at both head dims: FA3 takes 128 at
# d64, but there its S^T and dP^T tiles (64 fp32 registers each) spilled 336 bytes
# (sm_90 compile, 240-register cap); at d128 dK and dV alone hold 128 registers. Shared
# memory: K, V 2 x 64 keys, stages x (Q + dO), dS^T 2 x 64 x BLOCK_M: d64 81 KiB, d128
# 145 KiB. Head dim 256 has no entry here: dK and dV alone would take 256 of a consumer's
# 240 registers; it has its own kernel (ops/bwd_hopper256.py, HOPPER_BWD_D256). Timed
# on the H200 in session 12 (0.78-0.84x cuDNN forward + backward). The sm_90 compile
# of STAGES 1-4 x BLOCK_M 64/128 (causal): BLOCK_M 128 spills inside the walk at d128
# (752+ bytes, and past shared memory from 3 stages) and at d64 with 1 stage (472); at
# d64 with 2 stages it keeps 64-80 bytes of scalars stored before the walks and none
# inside them (session 13; stage bwd-tiles times it); STAGES 1 spills at d128 too;
# STAGES 3 and 4 compile as clean as 2 (d64 99/115 KiB, d128 177/209 KiB) and are the
# A/B's ring sweep (FLASHTILE_HOPPER_BWD_CONFIG="64,128,4,3").
HOPPER_BWD_16BIT = {64: TileConfig(64, 128, 4, 2), 128: TileConfig(64, 128, 4, 2)}


# Head dim 256 (ops/bwd_hopper256.py): 64 keys a program, the two consumer warpgroups
# splitting the head dim; BLOCK_M 64 and 2 stages are what fits shared memory (K, V,
# 2 x (Q + dO), P^T and dS^T: 208 KiB of 227; a third stage would need 272). Not swept:
# FLASHTILE_HOPPER_BWD_CONFIG is the d64/d128 kernel's.
HOPPER_BWD_D256 = TileConfig(64, 64, 4, 2)


def hopper_bwd_config(head_dim: int) -> TileConfig:
    """HOPPER_BWD_16BIT[head_dim], or FLASHTILE_HOPPER_BWD_CONFIG="BLOCK_M,128,4,STAGES"
    for sweeps (BLOCK_N and num_warps are fixed by the kernel's two warpgroups); head
    dim 256: HOPPER_BWD_D256."""
    if head_dim == 256:
        return HOPPER_BWD_D256
    cfg = _from_env("hopper_bwd") or HOPPER_BWD_16BIT[head_dim]
    if (cfg.block_n, cfg.num_warps) != (128, 4) or cfg.block_m not in (64, 128) \
            or cfg.num_stages < 1:
        raise ValueError("FLASHTILE_HOPPER_BWD_CONFIG must be 'BLOCK_M,128,4,STAGES' with "
                         f"BLOCK_M 64 or 128 and STAGES >= 1, got {cfg}")
    return cfg


# Schedule variants of the Gluon backward, each a constexpr of its kernel, chosen by
# FLASHTILE_HOPPER_BWD_OPTS (comma-separated; "none" for none; unset: the default below)
# for the GPU A/B; bwd_hopper's docstring says what each changes. Read when a launch plan
# is made.
HOPPER_BWD_OPTS = ("lse_ahead", "dq_tma", "lse_smem", "ds_ring", "lpt", "skip_masked",
                   "lse_pre")
# lse_ahead is the default since session 15: forward + backward +6-10% at head_dim 64,
# +1-4% at 128 on the H200 (docs/benchmarks/NOTES.md section 25); dq_tma since session 17:
# +6-10% at 128, +1-3% at 64, transformers' d64 training step 98 -> 89 ms (section 27);
# lse_smem (lse and delta with Q and dO, by TMA) since session 21: +3-5% at 64, +2.5-4% at
# 128 over lse_ahead (section 30). Where lse_smem cannot run (kernel_flags: seqlen_q not a
# multiple of 4, or shorter than a block) lse_ahead runs in its place. ds_ring (dS^T in
# two buffers) since session 28: +2-3% at 64 (full attention; causal +0-1%), level at 128
# (section 38), whose 225 KiB it still fits. skip_masked (the second consumer skips the
# causal walk's first query block, whose rows see none of its keys) since session 33 at
# head_dim 128 alone (HOPPER_BWD_DEFAULT_BY_DIM): causal forward + backward +0.5-4% at
# 1k-16k there, two alternating rounds each, to 0.93-1.02x cuDNN; at 64 it lost 3% at 1k
# and was level at 4k (NOTES.md section 43). skip_peel, the same skips with the dead blocks
# in a loop of their own, lost 3-5% there at 1k and 4k (H100, session 39) and was removed.
# lse_pre (session 34; with lse_smem; +1.2-2.8% at d64, +1-2.4% d128 causal in session
# 35, NOTES.md section 45): the preprocess writes lse in base 2 and delta padded to whole
# query blocks (+inf and 0 in the padding), so the walks convert and mask neither (FA3's
# LSE_log2); the default since session 38, after the backward's whole GPU test files
# passed with it on at d64's and d128's options (438 each) and its memcheck slice had 0
# errors (H100). On that H100 (session 39) d64 causal forward + backward then ran at
# 1.02x cuDNN at 1k and 1.03-1.04x at 4k.
HOPPER_BWD_DEFAULT_OPTS = frozenset({"lse_smem", "dq_tma", "ds_ring", "lse_pre"})
HOPPER_BWD_DEFAULT_BY_DIM = {128: HOPPER_BWD_DEFAULT_OPTS | {"skip_masked"}}
# bwd_hopper256 (head_dim 256) takes dq_tma and lpt alone; there dq_tma (session 18, its fp32
# tiles in the block's own Q and dO buffers) took forward + backward +24-36% over the
# atomics, to 1.00-1.11x cuDNN (session 19, NOTES.md section 29).


def hopper_bwd_opts(head_dim: int | None = None) -> frozenset[str]:
    """The FLASHTILE_HOPPER_BWD_OPTS options of the Gluon backward, e.g. "lse_ahead,dq_tma";
    "none" for none, unset for the default of the kernel's tile ``head_dim``
    (HOPPER_BWD_DEFAULT_BY_DIM, else HOPPER_BWD_DEFAULT_OPTS). Each kernel takes the
    options it has (bwd_hopper.kernel_flags)."""
    raw = os.environ.get("FLASHTILE_HOPPER_BWD_OPTS")
    if raw is None:
        return HOPPER_BWD_DEFAULT_BY_DIM.get(head_dim, HOPPER_BWD_DEFAULT_OPTS)
    opts = frozenset(x.strip() for x in raw.split(",") if x.strip())
    if opts == {"none"}:
        return frozenset()
    unknown = sorted(opts.difference(HOPPER_BWD_OPTS))
    if unknown:
        raise ValueError(f"FLASHTILE_HOPPER_BWD_OPTS must be 'none' or a comma-separated "
                         f"subset of {HOPPER_BWD_OPTS}, got {raw!r} (unknown: {unknown})")
    return opts


def hopper_bwd_head_split(group_size: int) -> int | None:
    """FLASHTILE_HOPPER_BWD_HEAD_SPLIT: how many programs share a GQA group's query heads
    in the Gluon backward (``bwd_hopper.head_split``), for the GPU A/B: unset or "auto"
    (None: the launcher's rule), or a positive divisor of the group size (a larger
    number is clamped to the group). Anything else is a ValueError naming the
    variable. Read at each call; the split is part of the launch plans' key."""
    raw = getenv("FLASHTILE_HOPPER_BWD_HEAD_SPLIT", "").strip() or "auto"
    if raw == "auto":
        return None
    try:
        split = int(raw)
        if split < 1:
            raise ValueError
    except ValueError:
        raise ValueError("FLASHTILE_HOPPER_BWD_HEAD_SPLIT must be 'auto' or a positive "
                         f"integer, got {raw!r}") from None
    split = min(split, group_size)
    if group_size % split:
        raise ValueError(f"FLASHTILE_HOPPER_BWD_HEAD_SPLIT={split} does not divide the GQA "
                         f"group of {group_size} query heads")
    return split


def _from_env(kind: str) -> TileConfig | None:
    # FLASHTILE_FWD_CONFIG="128,64,8,3" (BLOCK_M, BLOCK_N, num_warps, num_stages): for sweeps.
    # FLASHTILE_DECODE_CONFIG may add dv_parts: "128,32,8,2,2".
    raw = os.environ.get(f"FLASHTILE_{kind.upper()}_CONFIG")
    if not raw:
        return None
    values = raw.split(",")
    decode = kind == "decode"
    try:
        if len(values) > (5 if decode else 4):
            raise ValueError
        return TileConfig(*[int(x) for x in values])
    except (TypeError, ValueError):
        more = "[,num_warps[,num_stages[,dv_parts]]]" if decode else "[,num_warps[,num_stages]]"
        raise ValueError(f"FLASHTILE_{kind.upper()}_CONFIG must be 'BLOCK_M,BLOCK_N{more}' "
                         f"of integers, got {raw!r}") from None


def _pick(kind: str, q: torch.Tensor, head_dim: int, table16: dict, table32: dict, *,
          causal_like: bool = False, seqlen: int | None = None, products_table=None):
    """The tile of _pick_tile, its dv_parts set from the head dim (head_dim_parts): the
    tables, tuned entries and FLASHTILE_*_CONFIG give the tile of one program."""
    cfg = _pick_tile(kind, q, head_dim, table16, table32, causal_like=causal_like,
                     seqlen=seqlen, products_table=products_table)
    parts = head_dim_parts(head_dim)
    return cfg if cfg.dv_parts == parts else dataclasses.replace(cfg, dv_parts=parts)


def _pick_tile(kind: str, q: torch.Tensor, head_dim: int, table16: dict, table32: dict, *,
               causal_like: bool = False, seqlen: int | None = None,
               products_table=None):
    """products_table: the table for fp32 inputs whose products are not TF32 (IEEE's,
    or tf32x3's where it has its own; None: not that case). `flashtile tune` times fp32
    with TF32 only, so its results skip that case."""
    if kind in _override:
        return _override[kind]
    env = _from_env(kind)
    if env is not None:
        return env
    own = products_table is not None and q.element_size() == 4
    if seqlen is not None and not own:  # `flashtile tune` results for this device
        tuned = tuned_config(kind, q, head_dim, causal_like, seqlen)
        if tuned is not None:
            return tuned
    if q.device.type == "cpu":
        return _INTERPRETER[kind]
    table = products_table if own else table32 if q.element_size() == 4 else table16
    return table[padded_head_dim(head_dim)]


# seqlen (the longer of seqlen_q and seqlen_k) and causal_like (causal or windowed) pick
# a tuned entry; a caller that passes no seqlen gets the static tables.
# products: the kernel's INPUT_PRECISION. With fp32 inputs "ieee" selects the IEEE tables,
# "tf32x3" its own tables where it has them (the forward; the backward takes the fp32
# tables, as "tf32" does, without tuned entries: `flashtile tune` times TF32 only).
def _products_table(products: str, ieee: dict, tf32x3: dict | None, table32: dict):
    if products == "ieee":
        return ieee
    if products == "tf32x3":
        return tf32x3 or table32
    return None


def fwd_config(q, head_dim, causal_like=False, *, seqlen=None, products="tf32"
               ) -> TileConfig:
    if q.element_size() == 1:
        return _pick("fwd", q, max(head_dim, FP8_MIN_BLOCK_D), _FWD_FP8, _FWD_FP8,
                     causal_like=causal_like, seqlen=seqlen)
    return _pick("fwd", q, head_dim, _FWD_16BIT_CAUSAL if causal_like else _FWD_16BIT,
                 _FWD_32BIT, causal_like=causal_like, seqlen=seqlen,
                 products_table=_products_table(products, _FWD_IEEE, _FWD_TF32X3,
                                                _FWD_32BIT))


def bwd_dkdv_config(q, head_dim, causal_like=False, *, seqlen=None, products="tf32"
                    ) -> TileConfig:
    return _pick("bwd_dkdv", q, head_dim, _BWD_DKDV_16BIT, _BWD_32BIT,
                 causal_like=causal_like, seqlen=seqlen,
                 products_table=_products_table(products, _BWD_DKDV_IEEE, None,
                                                _BWD_32BIT))


def bwd_dq_config(q, head_dim, causal_like=False, *, seqlen=None, products="tf32"
                  ) -> TileConfig:
    return _pick("bwd_dq", q, head_dim, _BWD_DQ_16BIT, _BWD_32BIT,
                 causal_like=causal_like, seqlen=seqlen,
                 products_table=_products_table(products, _BWD_DQ_IEEE, None, _BWD_32BIT))


def bwd_fused_config(q, head_dim, causal_like=False, *, seqlen=None, products="tf32"
                     ) -> TileConfig:
    """Only where ``fused_bwd_has_tiles``: the fp32 tables stop at head_dim 128."""
    return _pick("bwd_fused", q, head_dim, _BWD_FUSED_16BIT, _BWD_FUSED_32BIT,
                 causal_like=causal_like, seqlen=seqlen,
                 products_table=_products_table(products, _BWD_FUSED_IEEE, None,
                                                _BWD_FUSED_32BIT))


def smaller(cfg: TileConfig) -> TileConfig | None:
    """The next tile to try when a variant needs more shared memory than the chip has
    (an attn_mask tile or head_dim 256 add buffers): one pipeline stage less, then a
    narrower key block."""
    if cfg.num_stages > 1:
        return dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if max(cfg.block_m, cfg.block_n) > 16:
        if cfg.block_n >= cfg.block_m:
            return dataclasses.replace(cfg, block_n=cfg.block_n // 2, num_stages=1)
        return dataclasses.replace(cfg, block_m=cfg.block_m // 2, num_stages=1)
    return None


def launch(kernel, grid_fn, cfg: TileConfig, name: str, q, head_dim, *args, slots=None,
           **kwargs):
    """Launch with ``cfg``; on OutOfResources step down through ``smaller`` (logged).

    slots: the kernel parameters a later call fills (``_launch``): then returns the
    launch's plan (None where there is none to make), else None."""
    from triton.runtime.errors import OutOfResources

    while True:
        log_first_launch(name, q, head_dim, cfg, kwargs)
        try:
            grid = grid_fn(cfg)
            params = dict(kwargs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
            compiled = kernel[grid](*args, num_warps=cfg.num_warps,
                                    num_stages=cfg.num_stages, **params)
            if slots is None:
                return None
            return _launch.make(compiled, kernel, args, params, grid, slots, cfg)
        except OutOfResources as err:
            nxt = smaller(cfg)
            if nxt is None:
                raise
            logger.info("flashtile: %s tiles %s do not fit (%s); trying %s", name, cfg,
                        err, nxt)
            cfg = nxt


def fp32_products() -> str:
    """How fp32 inputs multiply when TF32 is not allowed: "tf32x3" (the default: each
    product as three TF32 tensor-core products of the operands' high and low parts,
    cuBLAS's fp32 emulation and SDPA efficient's fp32; on the H200 as accurate as IEEE
    products and 3-5x faster, NOTES.md section 34), or "ieee" with
    FLASHTILE_FP32_PRECISION=ieee (exact products, FFMA). Read when a launch plan is made
    (ops/_launch.py), like the FLASHTILE_*_CONFIG variables: set it before the first
    call, or call ``_launch.clear()`` after changing it. The CPU interpreter multiplies in
    fp32 either way."""
    mode = os.environ.get("FLASHTILE_FP32_PRECISION", "tf32x3")
    if mode not in ("ieee", "tf32x3"):
        raise ValueError("FLASHTILE_FP32_PRECISION must be 'ieee' or 'tf32x3', got "
                         f"{mode!r}")
    return mode


def feature_args(attn_mask, alibi_slopes, q, *, window_left, window_right, softcap,
                 allow_tf32, head_dim):
    """Pointers, strides and constexpr flags of the optional features, shared by the
    forward and backward launchers. Absent tensors get q as a never-read placeholder."""
    if attn_mask is None:
        mask, mask_strides, is_bool = q, (0, 0, 0, 0), False
    else:
        is_bool = attn_mask.dtype == torch.bool
        mask = attn_mask.view(torch.uint8) if is_bool else attn_mask
        mask_strides = mask.stride()
    if alibi_slopes is None:
        alibi, alibi_strides = q, (0, 0)
    else:
        alibi = alibi_slopes
        alibi_strides = (alibi.stride(0) if alibi.dim() == 2 else 0, alibi.stride(-1))
    block_d = padded_head_dim(head_dim)
    flags = dict(
        BLOCK_D=block_d, EVEN_D=block_d == head_dim,
        MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0,
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HAS_MASK=attn_mask is not None, MASK_IS_BOOL=is_bool,
        INPUT_PRECISION="tf32" if allow_tf32 else fp32_products(),
    )
    return mask, mask_strides, alibi, alibi_strides, flags


_seen_variants: set = set()


def log_first_launch(kernel: str, q, head_dim, cfg: TileConfig, flags=None) -> None:
    """One INFO line the first time a kernel variant is launched: it compiles now.

    ``flags`` are the launch's constexpr switches (causal/window, softcap, mask, ...):
    each combination is its own compiled variant, so each gets its line.
    """
    flags = flags or {}
    # The launchers pass their flags in a fixed order, so the raw items are a key.
    key = (kernel, q.device.type, q.dtype, padded_head_dim(head_dim), cfg,
           tuple(flags.items()))
    if key not in _seen_variants:
        _seen_variants.add(key)
        switches = sorted((k, v) for k, v in flags.items()
                          if k.isupper() and v not in (False, None))
        on = ", ".join(k if v is True else f"{k}={v}" for k, v in switches)
        logger.info("flashtile: compiling %s kernel (dtype=%s, head_dim=%d, tiles=%s%s)",
                    kernel, str(q.dtype).replace("torch.", ""), head_dim, cfg,
                    f"; {on}" if on else "")


DECODE_FP8_KEYS_M = ("1", "0")
# The most query rows (tokens x query heads per KV head) the KEYS_M decode takes: its
# rows are the products' N, 8 a step (mma.sync m16n8k16); 16 rows as N compiled to
# wgmma with keys as M and spilled nothing but ran 827 instructions a tile, more than
# the rows-on-M layout's 722 (sm_90 SASS, d128, bf16 q, e4m3 cache).
DECODE_FP8_KEYS_M_ROWS = 8


def decode_fp8_keys_m() -> bool:
    """FLASHTILE_DECODE_FP8_KEYS_M: how the decode kernel lays out the products of an
    FP8 cache read as column pairs (decode.v_pairs) for at most DECODE_FP8_KEYS_M_ROWS
    query rows. "1" (KEYS_M, the default since session 14): keys on the products' M
    side, S^T = K Q^T and O^T = V^T P^T, the query rows padded to 8 (the N step): half
    the HMMAs, half the softmax's exp2/max/sum and the accumulator; and each thread sums
    its own parts of P until the loop ends (no cross-warp sum per tile), V's word
    addresses come from halved strides, and K/V copies are not masked (rows past the
    split re-read its last key) but with a left pad over pages (masked by key rows alone
    when the head dims fill their tiles). "0": query rows on the M side, padded to 16
    rows (mma.sync's M), keys the N of QK^T and the reduction of PV. sm_90 SASS per
    128-key tile, d128, bf16 q, e4m3 cache, 4 query rows: 441 instructions a thread
    against 722, pages of 64: 572 against 829 (586 against 833 unsplit), 124 registers
    against 168 (tests/test_sm90_compile.py). H200, session 14 (`python -m
    flashtile.bench.decode --sweep-fp8`, docs/benchmarks/h200-2026-12-02-s14): 2-5%
    more bandwidth contiguous in every row (8x8k 3503 against 3422 GB/s, 8x32k 4105
    against 3896, 32x4k 4012 against 3832, 1x128k 3839 against 3753, 64x2k 3927
    against 3764) and 4-14% over pages of 64. Read when a launch plan is made."""
    return _env_choice("FLASHTILE_DECODE_FP8_KEYS_M", DECODE_FP8_KEYS_M) == "1"


def decode_config(q, head_dim, rows, split=True, fp8_cache=False, head_dim_v=None,
                  v_is_k=False, keys_m=False) -> TileConfig:
    """Decode tile: rows = query tokens x query heads per KV head (GQA packing); split:
    whether the cache length is split across programs; fp8_cache: K/V in a float8
    dtype; head_dim_v: V's head dim (None: head_dim); v_is_k: V read from K's tiles
    (a view of K's first columns); keys_m: the kernel's KEYS_M layout (at most
    DECODE_FP8_KEYS_M_ROWS rows, decode_fp8_keys_m): 8 rows a tile, not 16."""
    if "decode" in _override:
        return _override["decode"]
    env = _from_env("decode")
    if env is not None:
        return env
    block_m = min(64, max(DECODE_FP8_KEYS_M_ROWS if keys_m else 16, next_power_of_2(rows)))
    if q.device.type == "cpu":
        return TileConfig(block_m, 16)
    # Memory-bound: 64-key tiles with 4 warps keep enough loads in flight per SM; at
    # head_dim 256 (or fp32) a 32-key tile keeps the K/V buffers within shared memory.
    # Unsplit programs walk the whole cache: a fourth stage measured faster there (H200,
    # 64 x 2k: 4346 against 3898 GB/s; 32 x 4k equal), slower for short splits (NOTES 8).
    # FP8 queries compute in fp16 (2 bytes). An FP8 cache's tiles take twice the keys:
    # the same bytes per tile and in flight as the 16-bit tiles, and half the per-tile
    # work (softmax, P's exchange between warps, loop bookkeeping) per byte. sm_90 SASS,
    # bf16 q, d128, split: 64-key tiles 445 instructions a thread per 16 KB tile, 128-key
    # tiles 736 per 32 KB (the 16-bit cache: 384 per 32 KB); no spills (tests/aot.py).
    # (Issue 17: five stages of 64-key FP8 tiles, 786 instructions a tile before the
    # kernel's V_PAIRS and fp16 widening, ran no faster than the bf16 cache, H200.)
    if head_dim > DECODE_MAX_BLOCK_D:
        return _wide_key_decode_config(q, rows, block_m, split, v_is_k, fp8_cache)
    # The wider of K's and V's head dims sizes the tiles (MLA: they differ).
    widest = padded_head_dim(max(head_dim, head_dim_v or head_dim))
    wide = widest * max(2, q.element_size()) > 256
    stages = 3 if split else 4
    if q.element_size() == 4 and widest <= 256:
        rows, keys, warps, depth = _DECODE_FP32[max(widest, 32)][0 if split else 1]
        return TileConfig(min(block_m, rows), keys, warps, depth)
    if widest >= 512:
        # (rows, 512) fp32 accumulators: at most 32 rows, over 8 warps (sm_90 AOT: 64
        # rows spill 2 KB a thread, 32 rows x 32 keys with 8 warps hold 203 registers).
        return TileConfig(min(block_m, 32), 32 if q.element_size() <= 2 else 16, 8,
                          3 if split else 4)
    keys = 32 if wide else 64
    if fp8_cache and block_m <= 16:
        # Not past 16 rows (decode of up to 16 query heads per KV head): 64 rows x 128
        # keys spilled 8-208 bytes a thread, 32 rows over 16-key pages unsplit 8 (sm_90
        # AOT, d128, bf16 q, every feature on).
        keys *= 2
    return TileConfig(block_m, keys, 4, stages)


# fp32 decode tiles, (rows at most, keys, warps, stages) split and unsplit, by padded head
# dim: fp32 multiplies with FFMA (decode never allows TF32), and the 16-bit rule's 64-row
# tiles spilled 1.1-7.6 KB a thread at head dims 64-256. Sized with tests/aot.py for
# sm_90 (session 9; test_fp32_decode_tiles_do_not_spill holds them there); not timed.
_DECODE_FP32 = {
    32: ((64, 64, 4, 3), (32, 64, 4, 4)),
    64: ((16, 64, 4, 3), (16, 64, 4, 4)),
    128: ((32, 32, 4, 3), (16, 32, 8, 4)),
    256: ((16, 32, 4, 3), (16, 16, 4, 4)),
}


def _wide_key_decode_config(q, rows, block_m, split, v_is_k, fp8_cache) -> TileConfig:
    """A key head dim past DECODE_MAX_BLOCK_D (absorbed MLA: 576 over a V of 512 that is
    K's first columns, every query head on one KV head), by rows (query tokens x heads
    per KV head; block_m: decode_config's row block for them).

    Up to 32 rows (16 heads: bound by the cache's bytes), FP8 caches and fp32: (rows,
    512) fp32 accumulators over 8 warps with mma.sync (HMMA; wgmma takes 64 rows a
    warpgroup). 32 rows x 32 keys with V from K's tiles hold 208 registers and 113 KB
    of shared memory at 3 stages (150 KB at 4); with a V of its own, 4 stages of K and V
    take 248 KB (over the 227 KB an SM has), 3 take 178 KB.

    More rows, 16-bit (128 heads: bound by the products, 2 x 128 x 1088 flops per 1152
    bytes of a key): wgmma, Q resident in shared memory, one program an SM. Triton
    lays a dot whose result feeds another dot with every warp along M (warpsPerCTA
    [8, 1]), so with 8 warps over 64 rows both warpgroups compute the same 64 x BLOCK_N
    scores, as m64n16k16 products that each read 2.5 KB of Q and K from shared memory
    for 16K multiply-adds; 4 warps spill (a (64, 512) fp32 accumulator is 256 registers
    a thread). Past 64 rows, then: 128 rows over 8 warps (each warpgroup its own 64) and
    V's 512 columns in two programs of 256 (dv_parts; K's other 256 columns and its 64
    rope columns only add to the scores). Each program holds a (128, 256) accumulator
    (128 registers a thread) and computes its rows' scores once; the two programs of a
    row block both compute them, as the two warpgroups did. sm_90 SASS per 32-key tile,
    bf16, paged, split (tests/aot.py):

      tile (rows x keys, warps, stages, dv_parts)  64x32,8,3     128x32,8,2,2
      wgmma per thread                             72 m64n16k16  36 m64n32k16
                                                    2 m64n256k16   2 m64n256k16
      instructions per thread                      813           637
      shared memory read by wgmma, per program     392 KB        248 KB
      programs per 128 rows                        2             2
      registers, stack, shared memory (KiB)        255, 0, 180   248, 0, 216

    33-64 rows (64 heads: DeepSeek-V3 over two GPUs) take the 64-row tile, one program:
    padded to 128 rows in two parts they would compute 4x the scores, not 2x. It spills
    16-120 bytes with a left pad, with split page lists of 16-key pages or with every
    feature at once (255 registers); the 128-row tile spills in none of them (230-248).
    Also compiled: 64 rows x 64 keys spill 88-120 bytes, 128 rows x 512 columns 2 KB,
    64 rows over 4 warps 1.3 KB (80 bytes with dv_parts 2); 3 stages of 128 rows take
    252 KB; 16-key tiles do not spill but read Q twice as often (m64n8k16).

    PREDICTION (not yet timed), 128 heads, H200 at ~1.75 GHz: the 128-row tile is bound
    by wgmma's reads of shared memory (an m64n32k16 reads 3 KB for 16 cycles of
    products at 2048 multiply-adds a cycle: 192 B a cycle against 128): 248 KB / 128 B
    = 1940 cycles a tile, the softmax and loop (637 instructions x 2 warps a scheduler)
    partly beside it: 2000-2800 cycles, 1.1-1.6 us, for 128 x 32 x 1088 x 2 = 8.9 MFLOP
    over the two programs. b=64 x 8k (128 programs, 256 tiles each): 300-420 us
    (350-490 TFLOP/s) against 1403 today; b=32 x 4k (2 splits of 64 tiles, the combine
    reading 17 MB of fp32 partials): 80-120 us against 356; b=1 x 8k (64 splits of 4
    tiles, 17 MB of partials): 13-20 us against 41.8; b=1 x 32k (64 splits of 16
    tiles): 25-35 us against 110. 64 heads (the 64-row tile, 392 KB of shared memory
    read a tile: 3060 cycles and more, 1.8-2.4 us for 4.5 MFLOP): b=64 x 8k (2 splits
    of 128 tiles) 230-310 us, 240-320 TFLOP/s. 16 heads keep their tile and times.
    MEASURED (H200, session 14, docs/benchmarks/h200-2026-12-02-s14/mla-wgmma.txt; its
    GPU tests passed), 128 heads: b=64 x 8k 642 us (227.5 TFLOP/s), b=32 x 4k 176, b=1 x
    8k 30.5, b=1 x 32k 61.5: 1.4-2.2x the 32-row tile, half to two thirds of the
    prediction's speed; the stage `mla` has the A/B and the 64-head rows. Why (sm_90
    SASS of the 128-row tile, session 15): Q and two K stages fill shared memory, so
    tile i+1's K copies are issued at the end of tile i and waited for at the top of
    i+1, their latency hidden only under P V; Q K^T is three dots drained one after
    another; both warpgroups softmax at once behind a bar.sync; and the scores are
    computed twice. ops/decode_mla_hopper.py (FLASHTILE_DECODE_MLA=gluon) takes that
    shape without those."""
    if q.element_size() == 2 and not fp8_cache and rows > 32:
        if rows > 64 and v_is_k:
            return TileConfig(128, 32, 8, 2, dv_parts=2)
        # Q 72 KB; 4 stages of K (V from K's tiles) 144 KB, 2 of K and V 136 KB.
        return TileConfig(64, 32, 8, (3 if split else 4) if v_is_k else 2)
    stages = 4 if not split and v_is_k else 3
    return TileConfig(min(block_m, 32), 32 if q.element_size() <= 2 else 16, 8, stages)


# The Gluon absorbed-MLA decode (ops/decode_mla_hopper.py): past this many query rows
# per KV head (the portable kernel's wgmma tiles start there too; 32 rows or fewer are
# bound by the cache's bytes, not the products).
DECODE_MLA_HOPPER_MIN_ROWS = 32
DECODE_MLA = ("auto", "triton", "gluon")
# auto's Gluon cells: batch x the cache's capacity in keys (what the host knows; the
# split plan counts the same). On the H200 (session 25, NOTES.md section 35; bf16, pages
# of 64, us Gluon / portable) 128 heads: b1 x 8k 32.1 / 30.5, b1 x 32k 44.7 / 61.2,
# b32 x 4k 102 / 175, b64 x 8k 344 / 631; 64 heads: b1 x 8k 31.1 / 24.0, b1 x 32k
# 38.0 / 39.0, b32 x 4k 64.4 / 98.3, b64 x 8k 194 / 341. So from 32k keys in all.
DECODE_MLA_GLUON_MIN_KEYS = 32768
# (64 rows, keys a tile, the default partition's 4 warps, ring stages). 32 keys: a
# stage is 36 KiB beside Q's 72 KiB and P's 8 KiB, so 4 stages take 225 KiB of the 227;
# 64 keys would fit 2 stages only, and with 2 a tile's copies start once both
# warpgroups are done with the tile before it: their latency would stall the next S
# (the portable kernel's trouble), so 3 at least. m64n32k16 reads 3 KiB of shared
# memory for 16 cycles of products (Q's 2 KiB each time): S is bound by shared memory
# at 1.5x its product time, P V (m64n256k16) by its products.
HOPPER_MLA_DECODE = TileConfig(64, 32, 4, 4)


def decode_mla_kernel(batch: int, capacity: int) -> str:
    """FLASHTILE_DECODE_MLA: which kernel serves the absorbed MLA decode (576/512, V the
    cache's first 512 columns, more than DECODE_MLA_HOPPER_MIN_ROWS query rows per KV
    head) on an H100/H200. "triton": the portable kernel's wgmma tiles
    (_wide_key_decode_config); "gluon": the FlashMLA-style kernel of
    ops/decode_mla_hopper.py (its ``unsupported`` sends what it does not take back to
    the portable kernel); "auto" (the default): gluon where batch x capacity (keys a
    sequence's block table or cache row holds) reaches DECODE_MLA_GLUON_MIN_KEYS, where
    it was timed 1.0-1.8x the portable kernel; below, at one sequence of 8k keys, it
    lost by 5-23%. Read on every decode call."""
    mode = _env_choice("FLASHTILE_DECODE_MLA", DECODE_MLA)
    if mode == "auto":
        return "gluon" if batch * capacity >= DECODE_MLA_GLUON_MIN_KEYS else "triton"
    return mode


def hopper_mla_decode_config() -> TileConfig:
    """HOPPER_MLA_DECODE, or FLASHTILE_HOPPER_MLA_DECODE_CONFIG="64,BLOCK_N,4,STAGES"
    for sweeps (64 rows and 4 warps are fixed by the kernel's warpgroups). Read on every
    call of that kernel (parsed once per value)."""
    return _hopper_mla_decode_config(os.environ.get("FLASHTILE_HOPPER_MLA_DECODE_CONFIG"))


@functools.lru_cache(maxsize=8)
def _hopper_mla_decode_config(raw) -> TileConfig:
    cfg = _from_env("hopper_mla_decode") or HOPPER_MLA_DECODE
    if (cfg.block_m, cfg.num_warps) != (64, 4) or cfg.block_n not in (16, 32, 64) \
            or cfg.num_stages < 3:
        raise ValueError("FLASHTILE_HOPPER_MLA_DECODE_CONFIG must be '64,BLOCK_N,4,STAGES' "
                         f"with BLOCK_N 16, 32 or 64 and STAGES >= 3, got {cfg}")
    return cfg


def decode_programs_per_sm(head_dim: int, cfg: TileConfig) -> int:
    """Decode programs an SM holds at once, as the split heuristic plans them: 2, or 1
    for a key past DECODE_MAX_BLOCK_D at 64 rows or more (Q resident in shared memory
    beside the K stages: 180-216 KB, _wide_key_decode_config). A second wave of splits
    would re-load Q (147 KB at 128 rows) and double the fp32 partials the combine reads
    (b=1, 128 heads: 256 KB a split)."""
    return 1 if head_dim > DECODE_MAX_BLOCK_D and cfg.block_m >= 64 else 2


# ---- Tile study (`flashtile tune`): candidates, and the tuned cache `_pick` reads ----

# Candidates per kernel kind, from the issue-2 sweep lists (docs/benchmarks/NOTES.md),
# widened by comprehension and pruned: 8 warps for 128-row tiles, where 4 warps leave
# each warp a 32-row slice of the wgmma; the dK/dV kernel keeps K, V, dK and dV live, so
# 4 warps only for its small tiles. `candidates()` then drops what cannot fit in
# shared memory.
CANDIDATES = {
    "fwd": [TileConfig(m, n, 4 if m == 64 else 8, s)
            for m in (64, 128) for n in (32, 64, 128) for s in (2, 3, 4) if n <= m],
    "bwd_dkdv": [TileConfig(m, n, w, s)  # (BLOCK_M over queries, BLOCK_N over keys)
                 for m in (16, 32, 64) for n in (64, 128) for w in (4, 8) for s in (2, 3)
                 if w == 8 or m * n <= 32 * 64],
    "bwd_dq": [TileConfig(m, n, 4 if m == 64 else 8, s)
               for m in (64, 128) for n in (32, 64) for s in (2, 3)],
    # 8 warps: with 4 every fused tile we compiled at d64-256 spilled (tests/aot.py).
    "bwd_fused": [TileConfig(m, n, 8, s)
                  for m in (16, 32, 64) for n in (32, 64, 128) for s in (2, 3)],
}
KINDS = tuple(CANDIDATES)
SM90_SMEM_BYTES = 232448  # 227 KiB: the most one H100/H200 program may use


def smem_bytes(kind: str, cfg: TileConfig, head_dim: int, element_size: int) -> int:
    """Estimated shared memory of one program: the streamed pair of tiles is buffered
    num_stages times, the resident tiles once (fwd: Q resident, K/V streamed; dK/dV: K/V
    resident, Q/dO streamed; dQ: Q/dO resident, K/V streamed; fused: as dK/dV, plus K
    in the dQ product's layout and the fp32 dQ block on its way to the atomics). Triton
    adds some scratch of its own, so a tile near the limit may still step down. Past
    256 columns (head_dim_parts) the forward streams V's part only; the backward reads
    every operand whole."""
    d = padded_head_dim(head_dim)
    resident, streamed = {
        "fwd": (cfg.block_m, cfg.block_n + cfg.block_n // head_dim_parts(head_dim)),
        "bwd_dkdv": (2 * cfg.block_n, 2 * cfg.block_m),
        "bwd_dq": (2 * cfg.block_m, 2 * cfg.block_n),
        "bwd_fused": (3 * cfg.block_n + 2 * cfg.block_m, 2 * cfg.block_m),
    }[kind]
    return (resident + cfg.num_stages * streamed) * d * element_size


def candidates(kind: str, head_dim: int, element_size: int,
               smem_limit: int | None = SM90_SMEM_BYTES) -> list[TileConfig]:
    """CANDIDATES[kind] less the tiles over ``smem_limit`` bytes (None: keep all)."""
    if kind not in CANDIDATES:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return [c for c in CANDIDATES[kind] if smem_limit is None
            or smem_bytes(kind, c, head_dim, element_size) <= smem_limit]


TUNED_FILE = "tuned-configs.json"  # under flashtile._cache.cache_dir()
_SEQLEN_CLASSES = ((2048, "<=2k"), (8192, "<=8k"))  # longer: ">8k"


def seqlen_class(seqlen: int) -> str:
    for limit, name in _SEQLEN_CLASSES:
        if seqlen <= limit:
            return name
    return ">8k"


def tuned_key(device_name: str, dtype, head_dim: int, causal_like: bool, seqlen: int,
              kind: str) -> str:
    """'NVIDIA H200|bfloat16|d128|causal|<=8k|fwd': one line of the tuned cache."""
    return "|".join((device_name, str(dtype).replace("torch.", ""),
                     f"d{padded_head_dim(head_dim)}", "causal" if causal_like else "full",
                     seqlen_class(seqlen), kind))


# {"table": {key: TileConfig}} once read; reload_tuned() empties it so the next launch
# reads the file again. A dict, not a rebound global (STYLE.md).
_tuned: dict = {}


def tuned_table() -> dict:
    if "table" not in _tuned:
        # Imported here: this section was appended to a module whose imports belong to
        # the kernels; flashtile._cache imports only torch.
        from flashtile import _cache

        table = {}
        for key, entry in _cache.read_json(TUNED_FILE).get("entries", {}).items():
            try:
                table[key] = TileConfig(int(entry["block_m"]), int(entry["block_n"]),
                                        int(entry["num_warps"]), int(entry["num_stages"]))
            except (KeyError, TypeError, ValueError):
                logger.warning("flashtile: ignoring malformed tuned entry %r", key)
        _tuned["table"] = table
    return _tuned["table"]


def reload_tuned() -> None:
    _tuned.clear()
    _launch.clear()  # plans hold the tiles they were made with


def tuned_config(kind: str, q, head_dim: int, causal_like: bool,
                 seqlen: int) -> TileConfig | None:
    """The cached `flashtile tune` winner for this call's key, or None."""
    table = tuned_table()
    if not table:
        return None
    from flashtile._cache import device_name

    return table.get(tuned_key(device_name(q.device), q.dtype, head_dim, causal_like,
                               seqlen, kind))


def save_tuned(entries: dict) -> str:
    """Merge ``{key: {"block_m", "block_n", "num_warps", "num_stages", ...}}`` into the
    cache file (other keys are kept) and reload. Returns the file's path."""
    from flashtile import _cache

    data = _cache.read_json(TUNED_FILE)
    merged = {**data.get("entries", {}), **entries}
    path = _cache.write_json(TUNED_FILE, {"format": 1, "entries": merged})
    reload_tuned()
    return str(path)


def clear_tuned() -> str:
    """Delete the tuned cache file (if any) and reload. Returns its path."""
    from flashtile import _cache

    path = _cache.cache_dir() / TUNED_FILE
    path.unlink(missing_ok=True)
    reload_tuned()
    return str(path)
