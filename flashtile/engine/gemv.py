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

At that size the kernels around the products cost their launch too, so the GEMV can
take them in (``FLASHTILE_ENGINE_GEMV_FUSE=1``, opt-in until timed): ``gemv_norm`` adds
the residual and applies RMSNorm to x before the product, ``gemv_silu`` applies
SiLU-and-multiply to x = [gate | up]. Every program reads all of x anyway, so it
recomputes these from x (and the residual) in registers; the norm's 1/RMS takes one
more pass over the row (from L2), with W's tile already requested where K fits one
tile. The values the product reads are those the unfused kernels (layernorm.py,
activation.py) would have written, roundings included; program 0 writes the next
residual. ``gemv_norm_reference`` and ``gemv_silu_reference`` are the unfused pairs in
PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from flashtile._validate import _fail
from flashtile.engine.activation import silu_and_mul_reference
from flashtile.engine.layernorm import add_rms_norm_reference, rms_norm_reference
from flashtile.ops import _launch, configs


# What a program applies to x's tiles before the product (PROLOGUE): nothing; RMSNorm
# (engine/layernorm.py's numerics), with the residual added first (ADD_NORM); or
# SiLU-and-multiply of x = [gate | up] (engine/activation.py's). Fused here, at one or two
# tokens a step, each saves a kernel whose time at that size is its launch.
NONE, NORM, ADD_NORM, SILU = 0, 1, 2, 3
# The same for the kernels (a @triton.jit function reads only constexpr globals).
_NONE, _NORM, _ADD_NORM, _SILU = (tl.constexpr(p) for p in (NONE, NORM, ADD_NORM, SILU))


@triton.jit
def _x_tile(X, Residual, NormW, o_m, m_m, k, m_k, stride_xm, stride_rm, rstd,
            K: tl.constexpr, PROLOGUE: tl.constexpr):
    """x's [BLOCK_M, BLOCK_K] tile at columns k as the product reads it: fp32 holding
    the values the unfused kernels would have written (their roundings included)."""
    dtype = X.dtype.element_ty
    m = m_m[:, None] & m_k[None, :]
    b_x = tl.load(X + o_m[:, None] * stride_xm + k[None, :], mask=m, other=0.0)
    if PROLOGUE == _SILU:
        b_g = b_x.to(tl.float32)
        b_up = tl.load(X + o_m[:, None] * stride_xm + K + k[None, :], mask=m, other=0.0)
        b_act = (b_g / (1.0 + tl.exp(-b_g))).to(dtype).to(tl.float32)
        b_x = (b_act * b_up.to(tl.float32)).to(dtype)
    elif PROLOGUE != _NONE:
        if PROLOGUE == _ADD_NORM:
            b_r = tl.load(Residual + o_m[:, None] * stride_rm + k[None, :], mask=m, other=0.0)
            b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(dtype)
        b_nw = tl.load(NormW + k, mask=m_k, other=0.0).to(tl.float32)
        b_x = ((b_x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
               * b_nw[None, :]).to(dtype)
    return b_x.to(tl.float32)


@triton.jit
def _rstd(X, Residual, ResOut, o_m, m_m, o_k, stride_xm, stride_rm, eps, write,
          K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
          PROLOGUE: tl.constexpr):
    """1 / RMS of each row of x (+ residual, rounded: the stream); ``write`` (program 0
    with ADD_NORM) stores that sum to ResOut, the next residual."""
    b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + o_k
        m = m_m[:, None] & (k < K)[None, :]
        b_h = tl.load(X + o_m[:, None] * stride_xm + k[None, :], mask=m, other=0.0)
        if PROLOGUE == _ADD_NORM:
            b_r = tl.load(Residual + o_m[:, None] * stride_rm + k[None, :], mask=m, other=0.0)
            b_h = (b_h.to(tl.float32) + b_r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(ResOut + o_m[:, None] * K + k[None, :], b_h, mask=m & write)
        b_h = b_h.to(tl.float32)
        b_ss += tl.sum(b_h * b_h, axis=1)
    return tl.rsqrt(b_ss / K + eps)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(X, W, Bias, Out, Residual, NormW, ResOut, M, stride_xm, stride_rm, eps,
                 N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PROLOGUE: tl.constexpr):
    """Program j: out[:, j * BLOCK_N : (j + 1) * BLOCK_N] for the M (<= BLOCK_M) rows of
    x, after x's PROLOGUE. W is (N, K) contiguous, Out (M, N) and ResOut (M, K)
    contiguous; with SILU x holds 2K columns a row."""
    pid = tl.program_id(0)
    o_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)                             # [BLOCK_N]
    o_m = tl.arange(0, BLOCK_M)                                              # [BLOCK_M]
    o_k = tl.arange(0, BLOCK_K)                                              # [BLOCK_K]
    m_n = o_n < N
    m_m = o_m < M
    p_w = W + o_n[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)  # (read with NORM and ADD_NORM only)
    if K <= BLOCK_K:
        # One tile of W: its load goes first, so that the DRAM read overlaps the norm's
        # reduction over the row.
        m_k = o_k < K
        b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        if PROLOGUE == _NORM or PROLOGUE == _ADD_NORM:
            rstd = _rstd(X, Residual, ResOut, o_m, m_m, o_k, stride_xm, stride_rm, eps,
                         pid == 0, K, BLOCK_M, BLOCK_K, PROLOGUE)
        b_x = _x_tile(X, Residual, NormW, o_m, m_m, o_k, m_k, stride_xm, stride_rm, rstd,
                      K, PROLOGUE)
        acc += tl.sum(b_x[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
    else:
        if PROLOGUE == _NORM or PROLOGUE == _ADD_NORM:
            rstd = _rstd(X, Residual, ResOut, o_m, m_m, o_k, stride_xm, stride_rm, eps,
                         pid == 0, K, BLOCK_M, BLOCK_K, PROLOGUE)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + o_k
            m_k = k < K
            b_w = tl.load(p_w + k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
            b_x = _x_tile(X, Residual, NormW, o_m, m_m, k, m_k, stride_xm, stride_rm, rstd,
                          K, PROLOGUE)                                       # [BLOCK_M, BLOCK_K]
            acc += tl.sum(b_x[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(Bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + o_m[:, None] * N + o_n[None, :], acc.to(Out.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


# The kernel parameters a call of a plan fills, in this order (``_launch``).
_SLOTS = ("X", "W", "Bias", "Out", "Residual", "NormW", "ResOut", "M")
MAX_M = configs.ENGINE_GEMV_MAX_M  # rows a call takes


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, k: int) -> None:
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_M or x.stride(1) != 1:
        _fail(ValueError, "x", f"(M, K) with 1 <= M <= {MAX_M} and a unit last stride",
              f"shape {tuple(x.shape)} strides {x.stride()}")
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous() \
            or weight.dtype != x.dtype:
        _fail(ValueError, "weight", f"a contiguous (N, {k}) {x.dtype} tensor",
              f"shape {tuple(weight.shape)} {weight.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        _fail(ValueError, "bias", f"a contiguous ({n},) tensor", f"shape {tuple(bias.shape)}")
    _check_devices(x, weight=weight, bias=bias)


def _check_devices(x: Tensor, **tensors) -> None:
    """Each tensor given (None: absent) on x's device. A plan's key holds no device: a
    tensor elsewhere would be launched as an address."""
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            _fail(ValueError, name, f"a tensor on x's device {x.device}", f"one on {t.device}")


def _gemv(x, weight, bias, prologue, residual=None, norm_weight=None, eps=0.0):
    """The launcher: (out, the next residual or None)."""
    m, k = x.shape[0], weight.shape[-1]
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) \
        if prologue == ADD_NORM else None
    block_n, block_k, warps = configs.gemv_tile(k)
    grid = (configs.cdiv(n, block_n), 1, 1)
    # Absent tensors get a present one's address (never read or written without their
    # PROLOGUE or HAS_BIAS).
    b = weight if bias is None else bias
    r = x if residual is None else residual
    nw = weight if norm_weight is None else norm_weight
    ro = out if res_out is None else res_out
    tensors = (x, weight, b, out, r, nw, ro)
    key = None
    if _launch.ready(x):
        p = _launch.pointers(tensors)
        # out and res_out are left out of the alignment: fresh allocations are aligned.
        key = ("gemv", x.dtype, n, k, m, x.stride(0), r.stride(0), bias is not None,
               prologue, eps, _launch.misalignment(p[:3] + p[4:6]))
        plan = _launch.lookup(key)
        if plan is not None:
            plan((*p, m), grid)
            return out, res_out
    plan = _launch.first_launch(
        _gemv_kernel, grid, (*tensors, m, x.stride(0), r.stride(0), eps),
        dict(N=n, K=k, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
             HAS_BIAS=bias is not None, PROLOGUE=prologue, num_warps=warps),
        _SLOTS if key is not None else None)
    if key is not None:
        _launch.store(key, plan)
    return out, res_out


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (M, K) with M <= MAX_M and a unit last stride, weight (N, K) contiguous, bias (N,)
    or None: x @ weight^T + bias as (M, N) in x's dtype, accumulated in fp32."""
    _check(x, weight, bias, x.shape[-1])
    return _gemv(x, weight, bias, NONE)[0]


def gemv_norm(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
              weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(gemv(h', weight, bias), h) with h = x + residual (rounded to x's dtype; x itself
    where residual is None) and h' = RMSNorm(h) with ``norm_weight`` (K,) and ``eps``: the
    engine's add_rms_norm (or rms_norm) and the product after it in one kernel."""
    _check(x, weight, bias, x.shape[-1])
    k = x.shape[1]
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1
                                 or residual.dtype != x.dtype):
        _fail(ValueError, "residual", f"x's shape {tuple(x.shape)} and dtype {x.dtype} with "
              "a unit last stride", f"shape {tuple(residual.shape)} {residual.dtype}")
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous() \
            or norm_weight.dtype != x.dtype:
        _fail(ValueError, "norm_weight", f"a contiguous ({k},) {x.dtype} tensor",
              f"shape {tuple(norm_weight.shape)} {norm_weight.dtype}")
    _check_devices(x, residual=residual, norm_weight=norm_weight)
    out, res_out = _gemv(x, weight, bias, NORM if residual is None else ADD_NORM, residual,
                         norm_weight, eps)
    return out, x if residual is None else res_out


def gemv_silu(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """gemv(silu(x[:, :K]) * x[:, K:], weight, bias) for x (M, 2K) = [gate | up]: the
    engine's silu_and_mul and the down projection after it in one kernel."""
    if x.dim() != 2 or x.shape[1] % 2:
        _fail(ValueError, "x", "(M, 2 * K): gate | up", f"shape {tuple(x.shape)}")
    _check(x, weight, bias, x.shape[1] // 2)
    return _gemv(x, weight, bias, SILU)[0]


def gemv_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """gemv in PyTorch."""
    return F.linear(x, weight, bias)


def gemv_norm_reference(x, residual, norm_weight, eps, weight, bias=None):
    """gemv_norm in PyTorch: the engine's norm references, then F.linear."""
    if residual is None:
        return F.linear(rms_norm_reference(x, norm_weight, eps), weight, bias), x
    normed, stream = add_rms_norm_reference(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), stream


def gemv_silu_reference(x, weight, bias=None):
    """gemv_silu in PyTorch."""
    return F.linear(silu_and_mul_reference(x), weight, bias)


# configs.engine_gemv_max_tokens() and engine_gemv_fuse(), read at the first CUDA call: a
# step calls linear ~100 times.
_max_tokens = _fuse = None


def _on_device(x: Tensor) -> bool:
    """Where the engine's linears may take the kernel: CUDA (tests force CPU tensors
    through the interpreter)."""
    return x.is_cuda


def takes(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether the engine's product x @ weight^T (+ bias) runs as ``gemv``: a CUDA step of
    at most FLASHTILE_ENGINE_GEMV tokens, in layouts the kernel reads."""
    global _max_tokens, _fuse
    if not _on_device(x):
        return False
    if _max_tokens is None:
        _max_tokens, _fuse = configs.engine_gemv_max_tokens(), configs.engine_gemv_fuse()
    return 0 < x.shape[0] <= _max_tokens and x.dim() == 2 and x.stride(1) == 1 \
        and weight.is_contiguous() and weight.dtype == x.dtype \
        and (bias is None or bias.is_contiguous())


def fuses(x: Tensor, weight: Tensor, bias: Tensor | None = None,
          norm_weight: Tensor | None = None) -> bool:
    """``takes``, with FLASHTILE_ENGINE_GEMV_FUSE on (``gemv_norm`` and ``gemv_silu``) and
    the norm's weight, if any, contiguous in x's dtype."""
    return takes(x, weight, bias) and _fuse and (
        norm_weight is None or (norm_weight.is_contiguous() and norm_weight.dtype == x.dtype))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, or ``gemv`` where it ``takes`` the step."""
    if takes(x, weight, bias):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
