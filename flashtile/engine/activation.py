"""SiLU-and-multiply of the fused gate/up projection (SwiGLU): one Triton kernel.

x (T, 2n) holds gate | up per row; the output is silu(gate) * up, (T, n). The numerics
are the eager functions' (``silu_and_mul_reference``, transformers' MLP): silu in fp32
(PyTorch upcasts 16-bit inputs internally), rounded to x's dtype, then the product in
fp32 rounded once more.

Why a kernel of our own: torch.compile(dynamic=True) of the same function made every
dim symbolic, so inductor could not prove the up half's offset or the row length
16-byte aligned and emitted scalar loads: 150 us a layer for a prompt step of 8 x 1024
tokens of Qwen2.5-0.5B on the H200 (240 MB at ~37% of the copy bandwidth), and its call
cost 23-51 us of host time (session 16). Here n is a constexpr (one variant per model),
the row stride is specialised by Triton (a multiple of 16 at the engine's shapes), so
gate, up and the output move in 16-byte vectors; a call is a plan lookup and a launch
(ops/_launch.py).

``silu_and_mul`` takes CUDA tensors (or CPU ones under the Triton interpreter);
``silu_and_mul_reference`` is the same in PyTorch, the engine's path on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from flashtile.ops import _launch, configs


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_xt, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (t, j): columns [j * BLOCK_N, (j + 1) * BLOCK_N) of row t. Out is
    contiguous rows of N."""
    t = tl.program_id(0).to(tl.int64)
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)               # [BLOCK_N]
    m_n = o_n < N
    p_x = X + t * stride_xt + o_n
    b_gate = tl.load(p_x, mask=m_n, other=0.0).to(tl.float32)              # [BLOCK_N]
    b_up = tl.load(p_x + N, mask=m_n, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    # PyTorch's silu formula, x / (1 + exp(-x)), rounded as F.silu's output is.
    b_act = (b_gate / (1.0 + tl.exp(-b_gate))).to(dtype).to(tl.float32)
    tl.store(Out + t * N + o_n, (b_act * b_up).to(dtype), mask=m_n)


# The kernel parameters a call of a plan fills, in this order (``_launch``).
_SLOTS = ("X", "Out")


def silu_and_mul(x: Tensor) -> Tensor:
    """silu(x[:, :n]) * x[:, n:] for x (T, 2n) with a unit last stride (any row
    stride); returns (T, n) contiguous in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError("x: expected (tokens, 2 * n) with a unit last stride (gate | up), "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if not t * n:
        return out
    key = None
    if _launch.ready(x):
        # out is left out of the alignment: a fresh allocation is aligned.
        key = ("silu_and_mul", x.dtype, n, x.stride(0), x.data_ptr() & 15)
        found = _launch.lookup(key)
        if found is not None:
            block_n, plan = found
            plan((x.data_ptr(), out.data_ptr()), (t, configs.cdiv(n, block_n), 1))
            return out
    block_n, warps = configs.silu_and_mul_tile(n, x.device)
    plan = _launch.first_launch(
        _silu_and_mul_kernel, (t, configs.cdiv(n, block_n)), (x, out, x.stride(0)),
        dict(N=n, BLOCK_N=block_n, num_warps=warps), _SLOTS if key is not None else None)
    if key is not None:
        _launch.store(key, (block_n, plan))
    return out


def silu_and_mul_reference(x: Tensor) -> Tensor:
    """silu_and_mul in PyTorch."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
