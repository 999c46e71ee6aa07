"""The engine's linear layers for decode steps of one or two tokens: y = x W^T (+ b) as a
GEMV, one Triton kernel.

Why (session 38, docs/benchmarks/NOTES.md section 48): at M = 1 cuBLAS's products run
latency-bound at the engine's shapes. Measured on an H100 with both captured in CUDA
graphs and the weights read from DRAM, this kernel took 0.66-0.76x cuBLAS's time for
Qwen2.5-0.5B's q/k/v and o products, 0.82-0.86x for the down projections of the 0.5B and
1B shapes, 0.83-0.97x for the rest (the LM head 0.90x): ~115 us off a 0.5B decode step of
one sequence, ~0.4 ms off an 8B one. At M = 4 and beyond it loses (1.35x on the 0.5B's
down projection): without tensor cores each extra row is another pass of FMAs.

Each program owns BLOCK_N output features over all of K, so the result is one kernel and
deterministic (no split-K partial sums): a [M, BLOCK_N, BLOCK_K] product of fp32 FMAs
summed over K. With BLOCK_N 4 a program reads 4 rows of W in 8-16 KB tiles; gate_up's
9,728 features make 2,432 programs, and many of them resident per SM keep enough bytes
in flight (the loads are not software-pipelined: sm_90 compiles showed stages change
nothing for loads that feed no dot).

The engine's linears take it for CUDA steps of at most ``FLASHTILE_ENGINE_GEMV`` tokens
(``configs.engine_gemv_max_tokens``: 2 by default, 1, or 0 for none; its tiles:
``configs.gemv_tile``) through ``linear``. In the engine's decode step (session 39, an
H100, CUDA graphs) it took the forward at batch 1 from 0.90 to 0.77 ms at 0.5B and from
5.71 to 5.35 ms at 8B; at batch 2 -7% and -3%. ``gemv_reference`` is F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from flashtile._validate import _fail
from flashtile.ops import _launch, configs


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(X, W, Bias, Out, M, stride_xm,
                 N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program j: out[:, j * BLOCK_N : (j + 1) * BLOCK_N] for the M (<= BLOCK_M) rows of
    x. W is (N, K) contiguous, Out (M, N) contiguous."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BLOCK_N]
    o_m = tl.arange(0, BLOCK_M)                                              # [BLOCK_M]
    o_k = tl.arange(0, BLOCK_K)                                              # [BLOCK_K]
    m_n = o_n < N
    m_m = o_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + o_k
        m_k = k < K
        b_w = tl.load(W + o_n[:, None].to(tl.int64) * K + k[None, :],
                      mask=m_n[:, None] & m_k[None, :], other=0.0)          # [BLOCK_N, BLOCK_K]
        b_x = tl.load(X + o_m[:, None] * stride_xm + k[None, :],
                      mask=m_m[:, None] & m_k[None, :], other=0.0)          # [BLOCK_M, BLOCK_K]
        acc += tl.sum(b_x.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(Bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + o_m[:, None] * N + o_n[None, :], acc.to(Out.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


# The kernel parameters a call of a plan fills, in this order (``_launch``).
_SLOTS = ("X", "W", "Bias", "Out", "M")
MAX_M = configs.ENGINE_GEMV_MAX_M  # rows a call takes


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (M, K) with M <= MAX_M and a unit last stride, weight (N, K) contiguous, bias (N,)
    or None: x @ weight^T + bias as (M, N) in x's dtype, accumulated in fp32."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_M or x.stride(1) != 1:
        _fail(ValueError, "x", f"(M, K) with 1 <= M <= {MAX_M} and a unit last stride",
              f"shape {tuple(x.shape)} strides {x.stride()}")
    n, k = weight.shape
    if x.shape[1] != k or not weight.is_contiguous() or weight.dtype != x.dtype:
        _fail(ValueError, "weight", f"a contiguous (N, {x.shape[1]}) {x.dtype} tensor",
              f"shape {tuple(weight.shape)} {weight.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        _fail(ValueError, "bias", f"a contiguous ({n},) tensor", f"shape {tuple(bias.shape)}")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = configs.gemv_tile(k)
    grid = (configs.cdiv(n, block_n), 1, 1)
    b = weight if bias is None else bias  # (never read without HAS_BIAS)
    key = None
    if _launch.ready(x):
        # out is left out of the alignment: a fresh allocation is aligned.
        key = ("gemv", x.dtype, n, k, m, x.stride(0), bias is not None,
               _launch.misalignment((x.data_ptr(), weight.data_ptr(), b.data_ptr())))
        plan = _launch.lookup(key)
        if plan is not None:
            plan((x.data_ptr(), weight.data_ptr(), b.data_ptr(), out.data_ptr(), m), grid)
            return out
    plan = _launch.first_launch(
        _gemv_kernel, grid, (x, weight, b, out, m, x.stride(0)),
        dict(N=n, K=k, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
             HAS_BIAS=bias is not None, num_warps=warps),
        _SLOTS if key is not None else None)
    if key is not None:
        _launch.store(key, plan)
    return out


def gemv_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """gemv in PyTorch."""
    return F.linear(x, weight, bias)


# configs.engine_gemv_max_tokens(), read at the first CUDA call: a step calls linear ~100
# times.
_max_tokens = None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, or ``gemv`` for CUDA steps of at most FLASHTILE_ENGINE_GEMV tokens."""
    global _max_tokens
    if x.is_cuda:
        if _max_tokens is None:
            _max_tokens = configs.engine_gemv_max_tokens()
        if 0 < x.shape[0] <= _max_tokens and x.dim() == 2 and x.stride(1) == 1 \
                and weight.is_contiguous() and weight.dtype == x.dtype \
                and (bias is None or bias.is_contiguous()):
            return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
