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
