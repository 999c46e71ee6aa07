"""FP8 test helpers: the Triton interpreter's FP8 conversions done right, and inputs.

Triton 3.6's interpreter converts to and from FP8 with a numpy routine that truncates
(31.7 becomes 16 in e5m2: the rounding carry into the exponent is lost), does not
saturate, and decodes NaN and e5m2 subnormals wrongly. flashtile refuses FP8 under the
interpreter while that is so (``flashtile.ops._fp8.interpreter_converts_fp8``); the
``fp8_interpreter`` fixture swaps the routine for torch's conversion, rounded to nearest
even and saturated as sm_90's cvt.rn.satfinite does, so the Triton kernels' FP8 logic
runs on CPU.
"""

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

_TORCH = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
          tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
          tl.float32: torch.float32, tl.float64: torch.float64}
_BITS = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_ORIGINAL = interpreter._convert_float


def _convert_float(input, input_dtype, output_dtype, rounding_mode):
    if 8 not in (input_dtype.primitive_bitwidth, output_dtype.primitive_bitwidth):
        return _ORIGINAL(input, input_dtype, output_dtype, rounding_mode)
    if rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ:
        raise NotImplementedError("round-toward-zero FP8 conversion in the test patch")
    bits = np.ascontiguousarray(input).view(_BITS[input_dtype.primitive_bitwidth])
    x = torch.from_numpy(bits.astype(bits.dtype)).view(_TORCH[input_dtype])
    dst = _TORCH[output_dtype]
    if output_dtype.primitive_bitwidth == 8:
        bound = torch.finfo(dst).max
        x = x.double().clamp(-bound, bound)  # clamp keeps NaN, as satfinite does
    y = x.to(dst)
    return y.view(_TORCH_UINT[output_dtype.primitive_bitwidth]).numpy().reshape(input.shape)


_TORCH_UINT = {8: torch.uint8, 16: torch.uint16, 32: torch.uint32, 64: torch.uint64}


@pytest.fixture
def fp8_interpreter(monkeypatch):
    """The interpreter's FP8 conversions replaced by torch's (see the module doc)."""
    monkeypatch.setattr(interpreter, "_convert_float", _convert_float)


# ---- The error bound of an attention output whose P was rounded before P @ V ----
#
# The kernels compute P = exp(s - m) from fp32 scores, sum the unrounded P into l, and
# round P once to the dtype of the P @ V product (FP8 after a 2**8 scale, see
# ops/fwd.py; 16-bit in the decode kernel). With p_j the exact probabilities of the
# dequantised inputs (row max 1) and P rounded as p_j (1 + e_j) + a_j:
#
#   |out - ref| <= sum_j max(u p_j, a) |v_j| / sum_j p_j          (rounding of P)
#                + ds * (sum_j p_j |v_j| / sum_j p_j + |ref|)      (error ds of the scores)
#                + eps(out_dtype) * |ref|                          (rounding of out)
#
# (the second: d out / d s_j = p_j (v_j - ref) / sum p, and |v_j - ref| <= |v_j| + |ref|)
#
# u: relative rounding of a normal number, 2**-(mantissa bits + 1). a: absolute rounding
# below the smallest normal, half the subnormal step, in units of P (the FP8 2**8 scale
# divided out). A key masked out has P exactly 0 and no error. The bound of P's rounding
# holds relative to the running max the kernel used too: a later, larger max rescales
# the tile by a factor <= 1.
P_ROUNDING = {
    # 3 mantissa bits: u = 2**-4; smallest normal 2**-6, step 2**-9: a = 2**-10 / 2**8.
    torch.float8_e4m3fn: (2.0**-4, 2.0**-18),
    # 2 mantissa bits: u = 2**-3; smallest normal 2**-14, step 2**-16: a = 2**-17 / 2**8.
    torch.float8_e5m2: (2.0**-3, 2.0**-25),
    # 10 mantissa bits: u = 2**-11; smallest normal 2**-14, step 2**-24: a = 2**-25.
    torch.float16: (2.0**-11, 2.0**-25),
    # 7 mantissa bits: u = 2**-8; its normals reach 2**-126: a negligible.
    torch.bfloat16: (2.0**-8, 2.0**-133),
    None: (0.0, 0.0),  # P not rounded (the PyTorch path: fp32 throughout)
}
# Scores: products of FP8 or 16-bit values are exact, their sum is fp32, except that
# Hopper's FP8 wgmma keeps about 14 bits of its accumulator (DeepSeek-V3 report, section
# 3.3.2): each 32-wide step of the head_dim truncates (not rounds) the running sum by up
# to 2**-13 of its magnitude, itself at most sum_d |q_d k_d|, so head_dim / 32 steps lose
# up to (head_dim / 32) * 2**-13 of it. (Session 9 on the H200: 2**-12 for every head_dim
# was exceeded 1.2-1.7x by the lse at head_dim 128 and 256, e4m3.) The absolute 1e-5
# covers fp32 exp2/log2, the softcap's tanh and the lse's sum.
SCORE_ABS = 1e-5


def score_rel(head_dim):
    return -(-head_dim // 32) * 2.0**-13


def error_bound(q, k, v, ref, *, p_dtype, out_dtype, softmax_scale, causal=False,
                window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Per-element bounds (out_bound like ref, lse_bound (batch, nheads, seqlen_q)) for
    q (b, sq, h, d), k/v (b, sk, hkv, d) given dequantised (float64) and ref, the float64
    output of those inputs (see the formula above)."""
    from flashtile.reference import _expand_kv, _scores

    b, sq, h, d = q.shape
    sk = k.shape[1]
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    left, right = window
    if causal:
        right = 0
    rows, cols = (torch.arange(n, device=q.device) for n in (sq, sk))
    s = _scores(q, k, rows, cols, softmax_scale=softmax_scale,
                softcap=softcap, alibi_slopes=alibi_slopes, attn_mask=None,
                diag_offset=sk - sq, window_left=left, window_right=right, seqlen_q=sq,
                seqlen_k=sk, dtype=torch.float64)                          # (b, h, sq, sk)
    seen = torch.isfinite(s)
    m = torch.where(seen, s, float("-inf")).amax(-1, keepdim=True)
    p = torch.where(seen, torch.exp(s - torch.where(torch.isfinite(m), m, 0.0)), 0.0)
    l = p.sum(-1, keepdim=True)
    l = torch.where(l == 0, 1.0, l)
    u, a = P_ROUNDING[p_dtype]
    vh = v.transpose(1, 2)                                                  # (b, h, sk, d)
    r = ref.transpose(1, 2)                                                 # (b, h, sq, d)
    rounding = (torch.where(seen, torch.maximum(u * p, torch.full_like(p, a)), 0.0)
                @ vh.abs()) / l
    qk_abs = torch.einsum("bihd,bjhd->bhij", q.abs(), k.abs()) * softmax_scale
    ds = (score_rel(d) * torch.where(seen, qk_abs, 0.0).amax(-1, keepdim=True) + SCORE_ABS)
    spread = (p @ vh.abs()) / l + r.abs()
    out = rounding + ds * spread + torch.finfo(out_dtype).eps * r.abs()
    return out.transpose(1, 2), ds.squeeze(-1) + SCORE_ABS


def assert_within(name, out, ref, bound):
    """Every |out - ref| <= bound (NaN fails), with the worst ratio in the message."""
    err = (out.double() - ref.double()).abs()
    assert not torch.isnan(out).any(), f"{name}: NaN"
    if err.numel() and (err > bound).any():
        ratio = (err / bound).max().item()
        raise AssertionError(f"{name}: error {err.max().item():.3g}, up to {ratio:.3g}x "
                             "its bound")
