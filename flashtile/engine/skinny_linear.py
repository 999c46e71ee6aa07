"""Skinny linear layers of decode batches, with the elementwise work around them fused in.

``skinny_linear`` computes ``y = prologue(x) @ weight^T (+ bias) (+ residual)`` for 1-256
rows in one kernel. A decode step of a small model is made of such products and of the
elementwise kernels between them: the Qwen2.5-0.5B shape at batch 1 runs 11 kernels a
layer in 34 us against 7 us of weight bytes, each graphed kernel at least 1.3 us, and
cuBLAS's skinny GEMMs at latency (o_proj 4.5 us for 0.4 us of bytes; down 5.3 us plus a
1.7 us split-K reduce) with no way to fuse a norm or an activation into them
(docs/benchmarks/NOTES.md section 26). Here:

- prologue ``"rmsnorm"``: x's rows normalised as engine/layernorm.py's RMSNorm (fp32
  statistics, the normalised row cast to x's dtype before the norm weight multiplies it,
  that product rounded to x's dtype), optionally after ``x + norm_residual`` (rounded to
  x's dtype, as the unfused add), whose sum is then returned too: the next layer's
  residual stream. Each program computes its rows' statistics over all of K (x is at
  most a few hundred KB at decode batches and in the L2), then streams its slice of W;
- prologue ``"silu_mul"``: x is (M, 2K), gate then up (as the fused gate_up projection
  writes them), and the product's input is ``silu(gate) * up``, computed on the fly;
- epilogue: ``+ bias``, then ``+ residual``, each rounded to the output dtype where the
  unfused sequence rounds (F.linear's output, then the add).

Tiling for the memory-bound regime: a program per BLOCK_N columns of W (BLOCK_N 16-256,
configs.skinny_linear_config), the rows padded to 16 (or 32, 64) in one tl.dot, K
streamed in BLOCK_K steps through Triton's software pipeline. Past 64 rows (the decode
batches of a throughput run) the rows come in tiles of 64, a program per (row tile,
column tile): the row tiles of a column tile are adjacent in the launch order, so they
run together and W's tile comes from memory once and from the L2 for the others. Where
the tiles give too few programs for a long reduction (the down projection at N 896,
K 4864), the reduction is split over SPLIT_K programs: each stores its fp32 partial
tile, then counts itself in with an atomic (a counter per row tile and column tile); the
last of a tile to arrive sums the partials in split order (the result does not depend
on which program arrives last), applies the epilogue once and resets the counter to
zero for the next call. The partials and counters are a
workspace per device, shared by consecutive calls on one stream (each call leaves the
counters at zero); calls that split must not run concurrently on two streams.

Rounding against the unfused PyTorch sequence (``skinny_linear_reference``):

- rmsnorm: the same roundings (engine/layernorm.py's: statistics of the rounded sum
  x + norm_residual); the fp32 sum of squares is added in another order and ``rsqrt``
  is the GPU's approximate one, so the normalised value can differ in fp32's last bits
  and, rarely, in the 16-bit rounding that follows;
- silu_mul: ``silu(gate)`` is rounded to x's dtype before the multiply by up, as
  eager ``F.silu(gate) * up`` in 16 bits does (and engine/activation.py's kernel).
  ``exp`` is the GPU's fast one here and ``expf`` in PyTorch: a 16-bit result can differ
  by one unit in the last place where the fp32 value lies within exp's error of a
  rounding boundary;
- the product accumulates in fp32 in another order than cuBLAS, as any two GEMMs do.

No autograd: this is for inference. CUDA tensors, or CPU tensors under the Triton
interpreter (TRITON_INTERPRET=1; not bfloat16, which the interpreter computes wrongly).
An eager call launches through a launch plan (flashtile/ops/_launch.py) after the first
call of each layout; the first call of a layout that splits K must come before any CUDA
graph capture (it sizes the workspace), as the engine's warm-up forwards do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from flashtile import _backend
from flashtile import _validate as V
from flashtile.engine import activation, layernorm
from flashtile.ops import _launch, configs

PROLOGUES = (None, "rmsnorm", "silu_mul")
_PROLOGUE_CODES = {None: 0, "rmsnorm": 1, "silu_mul": 2}
# Decode batches, up to the engine's default max_num_seqs: rows in tiles of at most 64
# (configs.skinny_block_m); a prompt's thousands of rows are a compute-bound GEMM whose
# tiles want both dimensions wide, cuBLAS's regime.
MAX_ROWS = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_x(X, NormResidual, offs_m, offs_k, m_mk, stride_xm, stride_nrm,
            HAS_NORM_RESIDUAL: tl.constexpr):
    """x[offs_m, offs_k], plus norm_residual's, rounded to x's dtype as the unfused add
    (BLOCK_M, BLOCK_K)."""
    b_x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mk, other=0.0)
    if HAS_NORM_RESIDUAL:
        b_r = tl.load(NormResidual + offs_m[:, None] * stride_nrm + offs_k[None, :],
                      mask=m_mk, other=0.0)
        b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(X.dtype.element_ty)
    return b_x


@triton.jit
def _epilogue(acc, Bias, Residual, Out, offs_m, offs_n, m_m, m_n, N, stride_rm,
              HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Out = acc (+ bias), rounded to Out's dtype as F.linear's output, (+ residual,
    rounded again as the unfused add); acc (BLOCK_M, BLOCK_N) fp32."""
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    b_y = acc.to(Out.dtype.element_ty)                                  # (BLOCK_M, BLOCK_N)
    m_mn = m_m[:, None] & m_n[None, :]
    if HAS_RESIDUAL:
        b_r = tl.load(Residual + offs_m[:, None] * stride_rm + offs_n[None, :], mask=m_mn,
                      other=0.0)
        b_y = (b_y.to(tl.float32) + b_r.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + offs_m[:, None] * N + offs_n[None, :], b_y, mask=m_mn)


@triton.jit
def _skinny_linear_kernel(
    X, W, Bias, Residual, NormWeight, NormResidual, XSum, Out, Partials, Counters, eps,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_rm, stride_nrm,
    PROLOGUE: tl.constexpr, HAS_NORM_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Out[rows, cols] = prologue(X)[rows, ks] @ W[cols, ks]^T (+ epilogue) for the
    BLOCK_M rows of program_id(0), the BLOCK_N columns of program_id(1) and the
    K_SPLIT-long slice ks of program_id(2). PROLOGUE: 0 none, 1 rmsnorm (NormWeight;
    with HAS_NORM_RESIDUAL, X + NormResidual, which the programs of the first column
    tile store to XSum, each its rows), 2 silu_mul (X holds gate then up, K each).
    SPLIT_K > 1: partial tiles through Partials, Counters per row tile and column tile
    (the module docstring)."""
    dtype = X.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = offs_n < N
    # 64-bit row offsets: an lm_head-sized W passes 2**31 elements.
    p_w = W + offs_n.to(tl.int64)[:, None] * stride_wn                  # (BLOCK_N, 1)
    if PROLOGUE == 1:
        # Each row's statistics over all of K before any product: the normalised row is
        # rounded before the norm weight multiplies it, so 1/rms cannot be applied to
        # the accumulator afterwards.
        b_ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            b_h = _load_x(X, NormResidual, offs_m, offs_k,
                          m_m[:, None] & (offs_k < K)[None, :], stride_xm, stride_nrm,
                          HAS_NORM_RESIDUAL).to(tl.float32)             # (BLOCK_M, BLOCK_K)
            b_ss += tl.sum(b_h * b_h, axis=1)
        b_rstd = tl.math.rsqrt(b_ss / K + eps)                          # (BLOCK_M,)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        m_k = offs_k < k_hi
        m_mk = m_m[:, None] & m_k[None, :]
        if PROLOGUE == 1:
            b_h = _load_x(X, NormResidual, offs_m, offs_k, m_mk, stride_xm, stride_nrm,
                          HAS_NORM_RESIDUAL)                            # (BLOCK_M, BLOCK_K)
            if HAS_NORM_RESIDUAL:
                if pid_n == 0:  # the residual stream, written once (per row tile)
                    tl.store(XSum + offs_m[:, None] * K + offs_k[None, :], b_h, mask=m_mk)
            b_g = tl.load(NormWeight + offs_k, mask=m_k, other=0.0)     # (BLOCK_K,)
            b_x = (b_h.to(tl.float32) * b_rstd[:, None]).to(dtype)
            b_x = (b_x.to(tl.float32) * b_g.to(tl.float32)[None, :]).to(dtype)
        elif PROLOGUE == 2:
            p_x = X + offs_m[:, None] * stride_xm + offs_k[None, :]
            b_gate = tl.load(p_x, mask=m_mk, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_K)
            b_up = tl.load(p_x + K, mask=m_mk, other=0.0)
            b_x = (b_gate / (1.0 + tl.exp(-b_gate))).to(dtype)
            b_x = (b_x.to(tl.float32) * b_up.to(tl.float32)).to(dtype)
        else:
            b_x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mk,
                          other=0.0)                                    # (BLOCK_M, BLOCK_K)
        b_w = tl.load(p_w + offs_k[None, :], mask=m_n[:, None] & m_k[None, :],
                      other=0.0)                                        # (BLOCK_N, BLOCK_K)
        acc = tl.dot(b_x, tl.trans(b_w), acc, input_precision=INPUT_PRECISION)
    if SPLIT_K > 1:
        o_part = offs_m[:, None] * N + offs_n[None, :]                  # (BLOCK_M, BLOCK_N)
        m_mn = m_m[:, None] & m_n[None, :]
        tl.store(Partials + pid_k * M * N + o_part, acc, mask=m_mn)
        # Every thread's partial is stored before the one atomic releases them.
        tl.debug_barrier()
        p_count = Counters + pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(p_count, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # The last of the tile: every partial in split order (.cg: from the L2,
            # where the other programs' stores are), whichever program came last.
            acc = tl.load(Partials + o_part, mask=m_mn, other=0.0, cache_modifier=".cg")
            # A loop, not unrolled: 8 splits' tiles hoisted at once spilled (sm_90 AOT).
            for s in range(1, SPLIT_K):
                acc += tl.load(Partials + s * M * N + o_part, mask=m_mn, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(p_count, 0)  # zero for the next call
            _epilogue(acc, Bias, Residual, Out, offs_m, offs_n, m_m, m_n, N, stride_rm,
                      HAS_BIAS, HAS_RESIDUAL)
    else:
        _epilogue(acc, Bias, Residual, Out, offs_m, offs_n, m_m, m_n, N, stride_rm,
                  HAS_BIAS, HAS_RESIDUAL)


def _check(x, weight, bias, residual, norm_weight, norm_residual, *, prologue):
    """The arguments' kinds, dtypes, shapes and devices (once per layout: the
    ``_CHECKS`` below)."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual),
                    ("norm_weight", norm_weight), ("norm_residual", norm_residual)):
        if t is not None and not isinstance(t, torch.Tensor):
            V._fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    for name, t, rank in (("x", x, 2), ("weight", weight, 2)):
        if t.dim() != rank:
            V._fail(ValueError, name, f"a {rank}-d tensor", f"shape {tuple(t.shape)}")
    if x.dtype not in _DTYPES:
        V._fail(TypeError, "x.dtype", "float16, bfloat16 or float32", x.dtype)
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if k == 0:
        V._fail(ValueError, "weight.shape[1]", "at least 1 (a reduction to compute)", k)
    if m > MAX_ROWS:
        V._fail(ValueError, "x.shape[0]", f"at most {MAX_ROWS} rows (decode batches)", m,
                "Use F.linear for more rows (a prompt's GEMM is compute-bound)")
    x_cols = 2 * k if prologue == "silu_mul" else k
    if x.shape[1] != x_cols:
        what = "2 * weight.shape[1] (gate then up)" if prologue == "silu_mul" \
            else "weight.shape[1]"
        V._fail(ValueError, "x.shape[1]", f"{what} = {x_cols}", x.shape[1])
    if prologue == "rmsnorm":
        if norm_weight is None:
            V._fail(ValueError, "norm_weight", "a (K,) tensor with prologue='rmsnorm'",
                    None)
    else:
        for name, t in (("norm_weight", norm_weight), ("norm_residual", norm_residual)):
            if t is not None:
                V._fail(ValueError, name, "None unless prologue='rmsnorm'",
                        f"a tensor with prologue={prologue!r}")
    expected = {"weight": (n, k), "bias": (n,), "residual": (m, n), "norm_weight": (k,),
                "norm_residual": (m, k)}
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual),
                    ("norm_weight", norm_weight), ("norm_residual", norm_residual)):
        if t is None:
            continue
        if tuple(t.shape) != expected[name]:
            V._fail(ValueError, name, f"shape {expected[name]}", f"shape {tuple(t.shape)}")
        if t.dtype != x.dtype:
            V._fail(TypeError, f"{name}.dtype", f"x's dtype {x.dtype}", t.dtype,
                    "Cast the arguments to one dtype, as F.linear needs")
        if t.device != x.device:
            V._fail(ValueError, f"{name}.device", f"x's device {x.device}", t.device)
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual),
                    ("norm_weight", norm_weight), ("norm_residual", norm_residual)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            V._fail(ValueError, f"{name}.stride(-1)", "1 (rows contiguous)", t.stride(-1),
                    "Call .contiguous() on it")


_CHECKS = {p: V.once_per_layout(lambda *t, p=p: _check(*t, prologue=p)) for p in PROLOGUES}
_SLOTS = ("X", "W", "Bias", "Residual", "NormWeight", "NormResidual", "XSum", "Out",
          "Partials", "Counters", "eps")
_workspaces: dict = {}  # device -> (fp32 partials, int32 counters kept at zero)


# Workspaces a larger one replaced: never freed, since a CUDA graph captured with one
# keeps its address (a few, each at least twice its predecessor).
_retired: list = []


def reserve_workspace(device: torch.device, rows: int, n: int):
    """Size ``device``'s split-K workspace for every call of at most ``rows`` rows and
    ``n`` outputs: before capturing CUDA graphs, so that no call of theirs needs a larger
    one (one cannot be allocated during a capture)."""
    # Partials: at most SKINNY_MAX_SPLIT splits of the (rows, n) output; counters: one
    # per row tile and column tile, at the narrowest BLOCK_N (16, tl.dot's least).
    row_tiles = configs.cdiv(rows, configs.skinny_block_m(rows))
    _workspace(torch.device(device), configs.SKINNY_MAX_SPLIT * rows * n,
               row_tiles * configs.cdiv(n, 16))


def _workspace(device: torch.device, partials: int, counters: int):
    """The split-K workspace of ``device``, at least this large."""
    ws = _workspaces.get(device)
    if ws is None or ws[0].numel() < partials or ws[1].numel() < counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "skinny_linear: a split-K layout's first call came inside a CUDA graph "
                "capture, which cannot allocate its workspace; call it once before "
                "capturing (the engine's warm-up forwards do)")
        if ws is not None:
            _retired.append(ws)
        partials = max(partials, 0 if ws is None else ws[0].numel())
        counters = max(counters, 0 if ws is None else ws[1].numel())
        ws = (torch.empty(configs.next_power_of_2(partials), dtype=torch.float32,
                          device=device),
              torch.zeros(configs.next_power_of_2(counters), dtype=torch.int32,
                          device=device))
        _workspaces[device] = ws
    return ws


def _plain(t):
    # nn.Parameter -> its tensor: once_per_layout (and so the launch plans) remember
    # plain tensors only.
    return t.data if isinstance(t, torch.nn.Parameter) else t


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                  prologue: str | None = None, norm_weight: Tensor | None = None,
                  eps: float = 1e-6, norm_residual: Tensor | None = None,
                  residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """``prologue(x) @ weight^T (+ bias) (+ residual)`` in one kernel, for 1-256 rows.

    Args:
        x: (M, K), or (M, 2K) with ``prologue="silu_mul"`` (gate then up); M <= 256;
            float16, bfloat16 or float32, rows contiguous (any row stride).
        weight: (N, K) in x's dtype, rows contiguous: an nn.Linear's weight.
        bias: (N,) or None.
        prologue: None; ``"rmsnorm"`` (x's rows RMS-normalised with ``norm_weight``
            and ``eps`` first, as engine/layernorm.py's); ``"silu_mul"``
            (``silu(gate) * up`` first).
        norm_weight: (K,), with ``prologue="rmsnorm"`` only.
        eps: the RMSNorm epsilon.
        norm_residual: (M, K) or None, with ``prologue="rmsnorm"`` only: normalise
            ``x + norm_residual`` and return that sum too.
        residual: (M, N) or None: added to the output.

    Returns: y (M, N) in x's dtype, contiguous; with ``norm_residual`` the pair (y,
    x + norm_residual), the sum (M, K) contiguous. The module docstring lists where the
    rounding can differ from the unfused PyTorch sequence (``skinny_linear_reference``).
    """
    if prologue not in _PROLOGUE_CODES:
        raise ValueError(f"prologue: expected one of {PROLOGUES}, got {prologue!r}")
    weight, bias, norm_weight = _plain(weight), _plain(bias), _plain(norm_weight)
    tensors = (x, weight, bias, residual, norm_weight, norm_residual)
    _, layout = _CHECKS[prologue].with_id(*tensors)
    if not x.is_cuda:
        if not _backend.interpreting():
            raise RuntimeError("skinny_linear runs Triton on CUDA tensors, or on CPU "
                               "tensors under TRITON_INTERPRET=1; on CPU use "
                               "skinny_linear_reference")
        if x.dtype == torch.bfloat16:
            V._fail(TypeError, "x.dtype", "float32 or float16 while the Triton kernels run "
                    "in the Triton interpreter (TRITON_INTERPRET=1)", x.dtype,
                    "The interpreter computes bfloat16 wrongly (errors near 1e9): use "
                    "float32 or float16, or skinny_linear_reference")
    m, (n, k) = x.shape[0], weight.shape
    device = x.device
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    x_sum = None if norm_residual is None else torch.empty((m, k), dtype=x.dtype,
                                                           device=device)
    result = out if x_sum is None else (out, x_sum)
    if m == 0 or n == 0:
        return result
    eps = float(eps)
    # Absent tensors pass x's address: the kernel never reads them (constexpr flags).
    inputs = tuple(x if t is None else t for t in tensors)
    key = None
    if _launch.ready(x) and layout is not None:
        p = _launch.pointers(inputs)
        key = ("skinny_linear", layout, _launch.misalignment(p))
        plan = _launch.lookup(key)
        if plan is not None:
            # The grid is (row tiles, column tiles, splits): the workspace a split plan
            # needs.
            row_tiles, col_tiles, split = plan.grid
            ws = (x, x) if split == 1 else _workspace(device, split * m * n,
                                                      row_tiles * col_tiles)
            plan((*p, (x_sum if x_sum is not None else x).data_ptr(), out.data_ptr(),
                  ws[0].data_ptr(), ws[1].data_ptr(), eps))
            return result
    cfg = configs.skinny_linear_config(
        x, m, n, k, 2 if prologue == "silu_mul" or norm_residual is not None else 1)
    steps = configs.cdiv(k, cfg.block_k)
    steps_per_split = configs.cdiv(steps, cfg.split_k)
    split = configs.cdiv(steps, steps_per_split)  # no split left without a step
    block_m = configs.skinny_block_m(m)
    # Row tiles first: a column tile's row tiles launch together and share its W tile
    # through the L2.
    grid = (configs.cdiv(m, block_m), configs.cdiv(n, cfg.block_n), split)
    ws = (x, x) if split == 1 else _workspace(device, split * m * n, grid[0] * grid[1])
    kwargs = dict(
        X=inputs[0], W=inputs[1], Bias=inputs[2], Residual=inputs[3],
        NormWeight=inputs[4], NormResidual=inputs[5],
        XSum=x if x_sum is None else x_sum, Out=out, Partials=ws[0], Counters=ws[1],
        eps=eps, M=m, N=n, K=k, K_SPLIT=steps_per_split * cfg.block_k,
        stride_xm=x.stride(0), stride_wn=weight.stride(0),
        stride_rm=inputs[3].stride(0), stride_nrm=inputs[5].stride(0),
        PROLOGUE=_PROLOGUE_CODES[prologue], HAS_NORM_RESIDUAL=norm_residual is not None,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split, INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    plan = _launch.first_launch(_skinny_linear_kernel, grid, (), kwargs,
                                _SLOTS if key is not None else None)
    if key is not None:
        _launch.store(key, plan)
    return result


def prologue_reference(x: Tensor, prologue: str | None = None,
                       norm_weight: Tensor | None = None, eps: float = 1e-6,
                       norm_residual: Tensor | None = None
                       ) -> tuple[Tensor, Tensor | None]:
    """(the product's input, x + norm_residual or None): ``skinny_linear``'s prologue as
    the engine computes it on CPU (engine/layernorm.py's and activation.py's PyTorch
    references, whose numerics their CUDA kernels share)."""
    x_sum = None
    if prologue == "rmsnorm":
        if norm_residual is None:
            x = layernorm.rms_norm_reference(x, norm_weight, eps)
        else:
            x, x_sum = layernorm.add_rms_norm_reference(x, norm_residual, norm_weight, eps)
    elif prologue == "silu_mul":
        x = activation.silu_and_mul_reference(x)
    elif prologue is not None:
        raise ValueError(f"prologue: expected one of {PROLOGUES}, got {prologue!r}")
    return x, x_sum


def skinny_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                            prologue: str | None = None, norm_weight: Tensor | None = None,
                            eps: float = 1e-6, norm_residual: Tensor | None = None,
                            residual: Tensor | None = None
                            ) -> Tensor | tuple[Tensor, Tensor]:
    """``skinny_linear`` as the unfused PyTorch ops in the engine's order and dtypes:
    ``prologue_reference``, F.linear, then the residual add. Any row count."""
    x, x_sum = prologue_reference(x, prologue, norm_weight, eps, norm_residual)
    y = F.linear(x, weight, bias)
    if residual is not None:
        y = y + residual
    return y if x_sum is None else (y, x_sum)
