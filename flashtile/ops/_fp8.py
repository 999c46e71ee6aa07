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
def _fp16_rows(b_q, b_qt, HAS_TAIL: tl.constexpr):
    """16-bit query rows (M, D) (and their tail tile (M, DT) when HAS_TAIL) as fp16,
    each row times a power of two 2**(14 - e) that brings its largest magnitude into
    [2**14, 2**15), and those factors (M, 1) fp32. Exact for bf16 rows: every bf16
    value down to 2**-31 of the row's largest is an fp16 number once scaled (8
    significant bits above fp16's subnormal step), and the few below it round by at most
    2**-39 of the largest, far under the fp32 sum of the products. A zero, inf or NaN
    row keeps its zeros, infs and NaNs. (The decode kernel over an FP8 cache computes in
    fp16: e4m3/e5m2 -> fp16 is one instruction per pair on sm_90, -> bf16 three.)"""
    q_max = tl.max(tl.abs(b_q.to(tl.float32)), 1)
    if HAS_TAIL:
        q_max = tl.maximum(q_max, tl.max(tl.abs(b_qt.to(tl.float32)), 1))
    # e = the largest magnitude's fp32 exponent field; 2**(14 - (e - 127)) has the
    # field 268 - e, kept inside the normal numbers (a zero row: 2**127).
    field = (q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF
    row_scale = (tl.minimum(tl.maximum(268 - field, 1), 254) << 23).to(
        tl.float32, bitcast=True)[:, None]                                  # (M, 1)
    b_q16 = (b_q.to(tl.float32) * row_scale).to(tl.float16)
    b_qt16 = b_qt
    if HAS_TAIL:
        b_qt16 = (b_qt.to(tl.float32) * row_scale).to(tl.float16)
    return b_q16, b_qt16, row_scale


@triton.jit
def _fp8_pairs_to_fp16(words, FP8: tl.constexpr, ASM: tl.constexpr):
    """int16 words each holding two FP8 values of FP8's format (the first, lower
    address, in the low byte) -> (fp16 of the first values, fp16 of the second), exact.

    ASM (sm_90): a prmt gathers the first bytes of two words (the two keys a thread
    holds per V column in the mma.sync operand layout) into one 16-bit pair and the
    second bytes into another, and one cvt widens each pair: 4 instructions per two
    words. Triton's own conversion of an FP8 V tile read in that layout loads every
    byte from shared memory on its own and packs them with integer ops (about 200 of
    the 612 instructions a 64-key d128 tile took per thread, sm_90 SASS). Without ASM
    (the interpreter): the same values through bit masks and Triton's conversion."""
    if ASM:
        if FP8 == tl.float8e4nv:
            cvt: tl.constexpr = "cvt.rn.f16x2.e4m3x2"
        else:
            cvt: tl.constexpr = "cvt.rn.f16x2.e5m2x2"
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; "
            "mov.b32 {lo, hi}, t; " + cvt + " $0, lo; " + cvt + " $1, hi; }",
            "=r,=r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    first = (words & 0xFF).to(tl.uint8).to(FP8, bitcast=True).to(tl.float16)
    second = ((words >> 8) & 0xFF).to(tl.uint8).to(FP8, bitcast=True).to(tl.float16)
    return first, second


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
