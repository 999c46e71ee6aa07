"""``flashtile bench --accuracy``: how close flashtile and PyTorch come to exact attention.

For each precision (fp32, fp32 through flashtile's IEEE products, TF32, fp16, bf16,
FP8 e4m3 and e5m2) and two input kinds (standard normal q/k/v; the same with 5% of the q
and k entries multiplied by 20, so a few scores dominate their rows), the forward output
of flashtile and of PyTorch's SDPA math and efficient backends at the same dtype is
compared with attention computed in float64 from the same (rounded) inputs: max |out -
ref| and ||out - ref|| / ||ref||, with each path's median time. A row that cannot run
here (TF32 on a CPU; SDPA's efficient backend is CUDA's) or a path that raises is "n/a"
with a reason.

Why the efficient column: it is PyTorch's fastest fp32 backend, and on sm_80 and later
its fp32 products are CUTLASS's 3xTF32 (OpMultiplyAddFastF32 in its DefaultGemmType:
each product as three TF32 tensor-core products of the operands' rounded high and low
parts), flashtile's default fp32 products (configs.fp32_products). So "fp32" against
sdpa-efficient compares the same accuracy class, and "fp32-ieee" (IEEE products,
FLASHTILE_FP32_PRECISION=ieee) against sdpa-math the exact one.

FP8 rows: q, k, v quantised with a scale per (batch, head) (flashtile.fp8.quantize), the
reference is float64 attention of the dequantised inputs, so the error is the kernel's
own (P rounded to FP8 for P @ V, the scores' accumulation), output in fp32. PyTorch's
SDPA has no FP8 path: its column runs the math backend on the dequantised inputs
rounded to bf16, the alternative to an FP8 kernel.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch

import flashtile
from flashtile import fp8 as F8
from flashtile.bench.run import env_var, time_step
from flashtile.reference import attention_naive, sdpa_bshd, sdpa_math_bshd

# (label, dtype, torch.get_float32_matmul_precision during the row). "fp32-ieee":
# flashtile with FLASHTILE_FP32_PRECISION=ieee for the row; the SDPA paths as for fp32.
PRECISIONS = (("fp32", torch.float32, "highest"), ("fp32-ieee", torch.float32, "highest"),
              ("tf32", torch.float32, "high"),
              ("fp16", torch.float16, "highest"), ("bf16", torch.bfloat16, "highest"),
              ("fp8-e4m3", torch.float8_e4m3fn, "highest"),
              ("fp8-e5m2", torch.float8_e5m2, "highest"))
INPUT_KINDS = ("normal", "outliers")
OUTLIER_FRACTION, OUTLIER_SCALE = 0.05, 20.0
# (batch, seqlen, nheads, head_dim): the float64 reference holds (B, H, N, N) scores.
GPU_SHAPE = (2, 2048, 8, 128)
CPU_SHAPE = (1, 512, 4, 64)


@dataclass
class PathResult:
    max_abs: float | None = None
    rel: float | None = None
    ms: float | None = None
    reason: str | None = None  # why it is n/a


@dataclass
class AccuracyRow:
    precision: str
    inputs: str
    flashtile: PathResult
    sdpa_math: PathResult
    sdpa_efficient: PathResult


def make_qkv(kind: str, shape, seed: int = 0):
    """float64 q, k, v on the CPU; "outliers" scales a random 5% of q and k by 20."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    if kind == "outliers":
        for x in (q, k):
            hit = torch.rand(shape, generator=gen) < OUTLIER_FRACTION
            x[hit] *= OUTLIER_SCALE
    elif kind != "normal":
        raise ValueError(f"kind must be one of {INPUT_KINDS}, got {kind!r}")
    return q, k, v


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = out.double() - ref
    return diff.abs().max().item(), (diff.norm() / ref.norm()).item()


def _flashtile(q, k, v, causal):
    return flashtile.flash_attn_func(q, k, v, causal=causal)


def _sdpa_math(q, k, v, causal):
    return sdpa_math_bshd(causal)(q, k, v)


def _sdpa_efficient(q, k, v, causal):
    from torch.nn.attention import SDPBackend

    return sdpa_bshd(causal, SDPBackend.EFFICIENT_ATTENTION)(q, k, v)


@contextlib.contextmanager
def _fp32_products(mode: str | None):
    """FLASHTILE_FP32_PRECISION=mode for one row (None: as set). Launch plans keep the
    mode they were made with (configs.fp32_products), so they are dropped on the way in
    and out."""
    if mode is None:
        yield
        return
    from flashtile.ops import _launch

    with env_var("FLASHTILE_FP32_PRECISION", mode):
        _launch.clear()
        try:
            yield
        finally:
            _launch.clear()


def _fp8_paths(q64, k64, v64, dtype, device):
    """FP8 rows: the quantised inputs, the float64 of their dequantised values, and the
    two paths (flashtile with descales; SDPA math on the dequantised inputs in bf16)."""
    quantised = [F8.quantize(x.to(device, torch.float32), dtype=dtype)
                 for x in (q64, k64, v64)]
    exact = [x.double() * d.double()[:, None, :, None] for x, d in quantised]
    (q, qd), (k, kd), (v, vd) = quantised
    bf16 = [x.to(torch.bfloat16) for x in exact]

    def ours(q, k, v, causal):
        return flashtile.flash_attn_func(q, k, v, causal=causal, q_descale=qd,
                                         k_descale=kd, v_descale=vd,
                                         out_dtype=torch.float32)

    def theirs(q, k, v, causal):
        return sdpa_math_bshd(causal)(*bf16)
    return (q, k, v), exact, ours, theirs


def _run_path(attn, q, k, v, ref, causal, device, repeats) -> PathResult:
    try:
        with torch.no_grad():
            max_abs, rel = errors(attn(q, k, v, causal), ref)
            ms = time_step(lambda: attn(q, k, v, causal), device, repeats)[0]
    except Exception as err:  # report the row as n/a, keep going
        return PathResult(reason=f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
    return PathResult(max_abs, rel, ms)


def _skip_reason(label: str, device) -> str | None:
    if label == "tf32" and device.type != "cuda":
        return "no TF32 on CPU: same as fp32"
    return None


def _efficient_skip(dtype, device) -> str | None:
    if device.type != "cuda":
        return "sdpa-efficient: CUDA only"
    if F8.is_fp8(dtype):
        return "sdpa-efficient: no FP8"
    return None


def accuracy_table(device, shape=None, causal: bool = False, repeats: int = 3,
                   precisions=PRECISIONS, kinds=INPUT_KINDS) -> list[AccuracyRow]:
    device = torch.device(device)
    shape = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    rows = []
    for kind in kinds:
        q64, k64, v64 = make_qkv(kind, shape)
        for label, dtype, precision in precisions:
            skip = _skip_reason(label, device)
            if skip is not None:
                rows.append(AccuracyRow(label, kind, PathResult(reason=skip),
                                        PathResult(reason=skip), PathResult(reason=skip)))
                continue
            if F8.is_fp8(dtype):
                (q, k, v), exact, ours_fn, theirs_fn = _fp8_paths(q64, k64, v64, dtype,
                                                                  device)
            else:
                q, k, v = (x.to(device=device, dtype=dtype) for x in (q64, k64, v64))
                exact = [x.double() for x in (q, k, v)]
                ours_fn, theirs_fn = _flashtile, _sdpa_math
            # The reference sees the inputs each path sees: rounded to dtype first.
            ref = attention_naive(*exact, causal=causal, upcast=True)[0]
            before = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision(precision)
            try:
                with _fp32_products("ieee" if label == "fp32-ieee" else None):
                    ours = _run_path(ours_fn, q, k, v, ref, causal, device, repeats)
                theirs = _run_path(theirs_fn, q, k, v, ref, causal, device, repeats)
                skip = _efficient_skip(dtype, device)
                efficient = PathResult(reason=skip) if skip else _run_path(
                    _sdpa_efficient, q, k, v, ref, causal, device, repeats)
            finally:
                torch.set_float32_matmul_precision(before)
            rows.append(AccuracyRow(label, kind, ours, theirs, efficient))
            del q, k, v, ref
    return rows


def _fmt(x, spec):
    missing = x is None or (isinstance(x, float) and math.isnan(x))
    return "n/a" if missing else format(x, spec)


def markdown(rows: list[AccuracyRow], shape, device_name: str) -> str:
    b, n, h, d = shape
    lines = [
        f"**Accuracy against float64 attention** ({device_name}; q/k/v {b}x{n}x{h}x{d} "
        f"(batch, seqlen, nheads, head_dim), forward; rel = ||out - ref|| / ||ref||)",
        "",
        "| precision | inputs | flashtile max abs | flashtile rel | flashtile ms "
        "| sdpa-math max abs | sdpa-math rel | sdpa-math ms "
        "| sdpa-efficient max abs | sdpa-efficient rel | sdpa-efficient ms | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        cols = []
        paths = (r.flashtile, r.sdpa_math, r.sdpa_efficient)
        for p in paths:
            cols += [_fmt(p.max_abs, ".2e"), _fmt(p.rel, ".2e"), _fmt(p.ms, ".3g")]
        notes = dict.fromkeys(p.reason for p in paths if p.reason)
        lines.append(f"| {r.precision} | {r.inputs} | " + " | ".join(cols)
                     + f" | {'; '.join(notes)} |")
    lines += ["", f"outliers: {OUTLIER_FRACTION:.0%} of the q and k entries x "
              f"{OUTLIER_SCALE:g}. sdpa-math: torch SDPA with the MATH backend forced, "
              "same dtype; sdpa-efficient: its EFFICIENT_ATTENTION backend (fp32 as "
              "3xTF32 on sm_80+, as flashtile's fp32 by default). fp32-ieee: "
              "flashtile with FLASHTILE_FP32_PRECISION=ieee. "
              "TF32: torch.set_float32_matmul_precision('high') for that row. "
              "fp8-*: q, k, v quantised per (batch, head) with flash-attn 3's descales, "
              "reference and sdpa-math on the dequantised inputs (sdpa-math rounded to "
              "bf16: PyTorch's SDPA has no FP8 path), flashtile's output in fp32."]
    return "\n".join(lines) + "\n"


def to_json(rows: list[AccuracyRow], shape, machine: dict) -> dict:
    return dict(schema="flashtile-accuracy/1", machine=machine, shape=list(shape),
                rows=[asdict(r) for r in rows])
