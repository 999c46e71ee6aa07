"""FP8 pieces of the Triton kernels: descale loads, quantisation, and whether the Triton
interpreter converts to FP8 correctly.

Inputs in float8_e4m3fn or float8_e5m2 carry flash-attn 3's descale factors: the real
value of q[b, i, h] is ``q_descale[b, h // group] * q[b, i, h]`` (likewise k and v). The
kernels never dequantise a tile: q_descale * k_descale is folded into the exp2 scale of
the scores and v_descale into the output, once per program.
"""

import torch
import triton
import triton.language as tl

# torch dtype -> largest finite value (the saturation bound of a quantisation).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {dtype: torch.finfo(dtype).max for dtype in FP8_DTYPES}  # 448, 57344


@triton.jit
def _load_descale(ptr, off_b, off_h, stride_b, stride_h, HAS: tl.constexpr):
    """descale[off_b, off_h] as fp32, or 1.0 where the caller gave none (flash-attn 3's
    default)."""
    value = 1.0
    if HAS:
        value = tl.load(ptr + off_b * stride_b + off_h * stride_h).to(tl.float32)
    return value


@triton.jit
def _quantize(x, descale, DTYPE: tl.constexpr):
    """x / descale rounded to the nearest DTYPE value (fp8e4nv or fp8e5), saturated at
    its largest finite value; NaN stays NaN. The division is IEEE (div_rn), so the result
    is bit for bit ``flashtile.fp8.quantize``'s (torch: x / descale, clamp, round)."""
    if DTYPE == tl.float8e4nv:
        bound: tl.constexpr = 448.0
    else:
        bound: tl.constexpr = 57344.0
    xf = x.to(tl.float32)
    y = tl.math.div_rn(xf, tl.zeros_like(xf) + descale)  # div_rn takes no broadcast
    y = tl.clamp(y, -bound, bound, propagate_nan=tl.PropagateNan.ALL)
    return y.to(DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def _cast_probe(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tl.load(X + offs).to(Y.dtype.element_ty, fp_downcast_rounding="rtne"))


# Values whose rounding needs a carry into the exponent (31.7 -> 32 in e5m2, 15.9 -> 16 in
# e4m3) and a subnormal result: Triton 3.6's interpreter truncates them (its numpy
# conversion loses the carry), which would make every P @ V product of the FP8 kernels
# wrong without an error.
_PROBE = (31.7, 15.9, 0.003, -1.0)


def interpreter_converts_fp8() -> bool:
    """Whether the Triton interpreter rounds fp32 to both FP8 formats as the GPU does
    (round to nearest even). Runs a 4-element kernel; only called under
    TRITON_INTERPRET=1."""
    x = torch.tensor(_PROBE, dtype=torch.float32)
    for dtype in FP8_DTYPES:
        y = torch.empty(len(_PROBE), dtype=dtype)
        try:
            _cast_probe[(1,)](x, y, N=len(_PROBE))
        except Exception:  # a kernel that cannot run here proves nothing: refuse FP8
            return False
        if not torch.equal(y.view(torch.uint8), x.to(dtype).view(torch.uint8)):
            return False
    return True
