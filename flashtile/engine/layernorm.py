"""RMSNorm over the last dim, with the residual add fused in: one Triton kernel.

The numerics are transformers' (its Llama/Qwen ``RMSNorm``, and ``rms_norm_reference``
below): the mean of squares in fp32, the normalised row cast to the input's dtype
BEFORE the weight multiply, the product rounded once more. With a residual, ``x +
residual`` is rounded to the stream's dtype first (the eager add) and normalised from
that rounded sum, so both outputs are those of the unfused modules.

Why a kernel of our own: the engine compiled these functions with
``torch.compile(dynamic=True)``, and each call of a compiled function cost 23-51 us of
host time on the development machine (2-3x that on the H200's host), for a kernel of a
few microseconds: a prompt step of 8 x 1024 tokens of Qwen2.5-0.5B spent 27 ms on the
host against 16 ms of kernels (session 16). Here a call is a plan lookup and one launch
(ops/_launch.py). The hidden size is a constexpr (one compiled variant per model), so
loads are 16-byte vectors and a row stays in registers: one read of x (and the residual),
one write of each output.

``rms_norm`` and ``add_rms_norm`` take CUDA tensors (or CPU ones under the Triton
interpreter); ``rms_norm_reference`` and ``add_rms_norm_reference`` are the same in
PyTorch, the engine's path on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashtile.ops import _launch, configs


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    X, Residual, Weight, Out, ResidualOut, n_rows,
    stride_xo, stride_xi, stride_ro, stride_ri, eps,
    N: tl.constexpr, INNER: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """ROWS rows of N a program. Row r of x is at (r // INNER) * stride_xo + (r % INNER)
    * stride_xi: INNER = 1 for hidden states (T, N), the heads a token for a per-head
    norm (Qwen3's q/k norm over a strided view (T, INNER, N) of the fused projection).
    Out and ResidualOut are contiguous rows of N. n_rows changes every step: not
    specialised (one variant serves every token count)."""
    o_r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)        # [ROWS]
    o_n = tl.arange(0, BLOCK_N)                                             # [BLOCK_N]
    m_n = o_n < N
    m = (o_r < n_rows)[:, None] & m_n[None, :]                              # [ROWS, BLOCK_N]
    o_out = o_r[:, None] * N + o_n[None, :]
    p_x = X + ((o_r // INNER) * stride_xo + (o_r % INNER) * stride_xi)[:, None] + o_n[None, :]
    b_x = tl.load(p_x, mask=m, other=0.0).to(tl.float32)                   # [ROWS, BLOCK_N]
    if HAS_RESIDUAL:
        p_r = (Residual + ((o_r // INNER) * stride_ro + (o_r % INNER) * stride_ri)[:, None]
               + o_n[None, :])
        # The eager add rounds the sum to the stream's dtype; the norm reads that sum.
        b_s = (b_x + tl.load(p_r, mask=m, other=0.0).to(tl.float32)).to(
            ResidualOut.dtype.element_ty)
        tl.store(ResidualOut + o_out, b_s, mask=m)
        b_x = b_s.to(tl.float32)
        dtype = ResidualOut.dtype.element_ty
    else:
        dtype = X.dtype.element_ty
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / N + eps)                  # [ROWS]
    b_w = tl.load(Weight + o_n, mask=m_n, other=0.0).to(tl.float32)        # [BLOCK_N]
    # Cast before the weight multiply, as transformers does.
    b_y = (b_x * b_rstd[:, None]).to(dtype).to(tl.float32) * b_w[None, :]
    tl.store(Out + o_out, b_y.to(Out.dtype.element_ty), mask=m)


# The kernel parameters a call of a plan fills, in this order (``_launch``).
_SLOTS = ("X", "Residual", "Weight", "Out", "ResidualOut", "n_rows")


def _check(x: Tensor, residual: Tensor | None, weight: Tensor) -> None:
    """Once per layout (a plan's key holds what is checked here)."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError("x: expected (rows, n) or (tokens, heads, n) with a unit last "
                         f"stride, got shape {tuple(x.shape)} strides {x.stride()}")
    if weight.shape != x.shape[-1:] or weight.stride(0) != 1:
        raise ValueError(f"weight: expected shape ({x.shape[-1]},) with a unit stride, got "
                         f"shape {tuple(weight.shape)} strides {weight.stride()}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual: expected x's shape {tuple(x.shape)} with a unit last "
                         f"stride, got shape {tuple(residual.shape)} strides "
                         f"{residual.stride()}")


def _rows(x: Tensor) -> tuple[int, int, int]:
    """(INNER, outer stride, inner stride) of x's rows (the kernel's docstring)."""
    if x.dim() == 2:
        return 1, x.stride(0), 0
    return x.shape[1], x.stride(0), x.stride(1)


def _rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float):
    """(normed, x + residual or None): the launcher of both public functions."""
    n = x.shape[-1]
    stream = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(stream, weight.dtype),
                      device=x.device)
    summed = None if residual is None else torch.empty(x.shape, dtype=stream, device=x.device)
    n_rows = x.numel() // n if n else 0
    if not n_rows:
        return out, summed
    # Absent tensors get x (never read) and out (never written) as placeholders.
    tensors = (x, x if residual is None else residual, weight, out,
               out if summed is None else summed)
    key = None
    if _launch.ready(x):
        p = _launch.pointers(tensors)
        # out and summed are left out of the alignment: fresh allocations are aligned.
        key = ("rms_norm", x.dtype, x.shape[1:], x.stride(), _launch.layout(residual),
               weight.dtype, weight.shape, weight.stride(), eps,
               _launch.misalignment(p[:3]))
        found = _launch.lookup(key)
        if found is not None:
            rows, plan = found
            plan((*p, n_rows), (configs.cdiv(n_rows, rows), 1, 1))
            return out, summed
    _check(x, residual, weight)
    inner, stride_xo, stride_xi = _rows(x)
    _, stride_ro, stride_ri = _rows(x if residual is None else residual)
    block_n, rows, warps = configs.rms_norm_tile(n, x.device)
    plan = _launch.first_launch(
        _rms_norm_kernel, (configs.cdiv(n_rows, rows),),
        (*tensors, n_rows, stride_xo, stride_xi, stride_ro, stride_ri, eps),
        dict(N=n, INNER=inner, BLOCK_N=block_n, ROWS=rows,
             HAS_RESIDUAL=residual is not None, num_warps=warps),
        _SLOTS if key is not None else None)
    if key is not None:
        _launch.store(key, (rows, plan))
    return out, summed


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x's rows. x (T, n), or (T, heads, n) for a per-head norm (either may
    be a strided view with a unit last stride); weight (n,); eps the variance epsilon.
    Returns a contiguous tensor of x's shape in the promotion of x's and weight's dtypes
    (x's in the engine)."""
    return _rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float
                 ) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; residual has x's shape. The
    sum is rounded to the stream's dtype before it is normalised, as the unfused add."""
    return _rms_norm(x, residual, weight, eps)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """rms_norm in PyTorch (transformers' numerics)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float
                           ) -> tuple[Tensor, Tensor]:
    """add_rms_norm in PyTorch."""
    x = x + residual
    return rms_norm_reference(x, weight, eps), x
