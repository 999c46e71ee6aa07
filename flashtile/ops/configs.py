"""Every tile table of flashtile, and the small launch helpers that go with them.

A config is (BLOCK_M, BLOCK_N, num_warps, num_stages). The tables are keyed by the
padded head dim and the element size; the GPU entries are what the sweep in
``benchmarks/`` measured best on an H200 (see docs/benchmarks/NOTES.md). Under the
Triton interpreter the blocks are small and unequal (BLOCK_M != BLOCK_N), so short test
sequences still cross several tiles and both mask-range computations get exercised.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import triton

logger = logging.getLogger("flashtile")


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 1


# Tests set this to sweep tilings through the interpreter: {"fwd": TileConfig, ...}.
_override: dict[str, TileConfig] = {}


def set_override(kind: str, cfg: TileConfig | None) -> None:
    if cfg is None:
        _override.pop(kind, None)
    else:
        _override[kind] = cfg


def padded_head_dim(head_dim: int) -> int:
    # tl.dot needs K >= 16 and power-of-two tiles; the padding is masked on load/store.
    return max(16, triton.next_power_of_2(head_dim))


# The rowsum(dO * O) preprocess holds two (BLOCK_M, head_dim) fp32 tiles per program.
PREPROCESS_BLOCK_M = 32

_INTERPRETER = {
    "fwd": TileConfig(16, 32),
    "bwd_dkdv": TileConfig(32, 16),  # (BLOCK_M over queries, BLOCK_N over keys)
    "bwd_dq": TileConfig(16, 32),
}

# Hopper (sm90) fp16/bf16, keyed by padded head dim. d64/d128 entries are the best of
# the sweep on an H200 (docs/benchmarks/NOTES.md, run 2); 16/32 follow d64, 256 is sized
# to compile without spilling.
_FWD_16BIT = {
    16: TileConfig(128, 64, 8, 3), 32: TileConfig(128, 64, 8, 3),
    64: TileConfig(128, 64, 8, 3), 128: TileConfig(128, 128, 8, 3),
    256: TileConfig(64, 32, 4, 2),
}
# Causal/windowed: the masked diagonal blocks cost more with large tiles at d64.
_FWD_16BIT_CAUSAL = {
    16: TileConfig(64, 64, 4, 3), 32: TileConfig(64, 64, 4, 3),
    64: TileConfig(64, 64, 4, 3), 128: TileConfig(128, 64, 8, 3),
    256: TileConfig(64, 32, 4, 2),
}
_FWD_32BIT = {
    16: TileConfig(64, 64, 4, 2), 32: TileConfig(64, 64, 4, 2),
    64: TileConfig(64, 32, 4, 2), 128: TileConfig(64, 32, 4, 2),
    256: TileConfig(32, 32, 4, 1),
}
_BWD_DKDV_16BIT = {  # (BLOCK_M over queries, BLOCK_N over keys)
    16: TileConfig(32, 64, 4, 3), 32: TileConfig(32, 64, 4, 3),
    64: TileConfig(32, 64, 4, 3), 128: TileConfig(64, 128, 8, 2),
    256: TileConfig(32, 64, 8, 1),
}
_BWD_DQ_16BIT = {
    16: TileConfig(64, 64, 4, 3), 32: TileConfig(64, 64, 4, 3),
    64: TileConfig(64, 64, 4, 3), 128: TileConfig(128, 64, 8, 3),
    256: TileConfig(64, 32, 8, 1),
}
_BWD_32BIT = {
    16: TileConfig(32, 32, 4, 1), 32: TileConfig(32, 32, 4, 1),
    64: TileConfig(32, 32, 4, 1), 128: TileConfig(32, 32, 4, 1),
    256: TileConfig(16, 16, 4, 1),
}


def _from_env(kind: str) -> TileConfig | None:
    # FLASHTILE_FWD_CONFIG="128,64,8,3" (BLOCK_M, BLOCK_N, num_warps, num_stages): for sweeps.
    raw = os.environ.get(f"FLASHTILE_{kind.upper()}_CONFIG")
    if not raw:
        return None
    try:
        return TileConfig(*[int(x) for x in raw.split(",")])
    except (TypeError, ValueError):
        raise ValueError(f"FLASHTILE_{kind.upper()}_CONFIG must be 'BLOCK_M,BLOCK_N"
                         f"[,num_warps[,num_stages]]' of integers, got {raw!r}") from None


def _pick(kind: str, q: torch.Tensor, head_dim: int, table16: dict, table32: dict):
    if kind in _override:
        return _override[kind]
    env = _from_env(kind)
    if env is not None:
        return env
    if q.device.type == "cpu":
        return _INTERPRETER[kind]
    table = table32 if q.element_size() == 4 else table16
    return table[padded_head_dim(head_dim)]


def fwd_config(q, head_dim, causal_like=False) -> TileConfig:
    return _pick("fwd", q, head_dim, _FWD_16BIT_CAUSAL if causal_like else _FWD_16BIT,
                 _FWD_32BIT)


def bwd_dkdv_config(q, head_dim) -> TileConfig:
    return _pick("bwd_dkdv", q, head_dim, _BWD_DKDV_16BIT, _BWD_32BIT)


def bwd_dq_config(q, head_dim) -> TileConfig:
    return _pick("bwd_dq", q, head_dim, _BWD_DQ_16BIT, _BWD_32BIT)


def smaller(cfg: TileConfig) -> TileConfig | None:
    """The next tile to try when a variant needs more shared memory than the chip has
    (an attn_mask tile or head_dim 256 add buffers): one pipeline stage less, then a
    narrower key block."""
    if cfg.num_stages > 1:
        return TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages - 1)
    if max(cfg.block_m, cfg.block_n) > 16:
        if cfg.block_n >= cfg.block_m:
            return TileConfig(cfg.block_m, cfg.block_n // 2, cfg.num_warps, 1)
        return TileConfig(cfg.block_m // 2, cfg.block_n, cfg.num_warps, 1)
    return None


def launch(kernel, grid_fn, cfg: TileConfig, name: str, q, head_dim, *args, **kwargs):
    """Launch with ``cfg``; on OutOfResources step down through ``smaller`` (logged)."""
    from triton.runtime.errors import OutOfResources

    while True:
        log_first_launch(name, q, head_dim, cfg)
        try:
            return kernel[grid_fn(cfg)](*args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                        num_warps=cfg.num_warps,
                                        num_stages=cfg.num_stages, **kwargs)
        except OutOfResources as err:
            nxt = smaller(cfg)
            if nxt is None:
                raise
            logger.info("flashtile: %s tiles %s do not fit (%s); trying %s", name, cfg,
                        err, nxt)
            cfg = nxt


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
        INPUT_PRECISION="tf32" if allow_tf32 else "ieee",
    )
    return mask, mask_strides, alibi, alibi_strides, flags


_seen_variants: set = set()


def log_first_launch(kernel: str, q, head_dim, cfg: TileConfig) -> None:
    """One INFO line the first time a kernel variant is launched: it compiles now."""
    key = (kernel, q.device.type, q.dtype, padded_head_dim(head_dim), cfg)
    if key not in _seen_variants:
        _seen_variants.add(key)
        logger.info("flashtile: compiling %s kernel (dtype=%s, head_dim=%d, tiles=%s)",
                    kernel, str(q.dtype).replace("torch.", ""), head_dim, cfg)
