"""Which implementation runs a call: the Triton kernels or the tiled PyTorch path.

CUDA/ROCm tensors use Triton; CPU tensors use the tiled PyTorch path, unless
TRITON_INTERPRET=1 is set, which runs the Triton kernels on CPU tensors (how CI tests
them). ``FLASHTILE_BACKEND=triton|torch`` overrides both. Read at call time, so a test
or a user can switch with the environment variable alone.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("triton", "torch")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# os.environ's own dict of encoded names and values (CPython on POSIX): the live
# environment that os.environ.get reads and os.environ[...] = / monkeypatch.setenv
# write, without Mapping.get's encode and decode round trip. A read costs ~0.1 us
# instead of ~0.5 here and ~1.2 on the H200's host, where an eager forward made three
# (issue 15). Elsewhere (Windows keys its dict by upper-cased str) os.environ.get.
_ENVIRON = os.environ
_RAW = getattr(_ENVIRON, "_data", None)
if not (os.name == "posix" and type(_RAW) is dict):
    _RAW = None
_KEYS: dict = {}  # name -> its encoded key in _RAW


def getenv(name: str, default: str) -> str:
    """os.environ.get(name, default), read at each call (never cached)."""
    if _RAW is None:
        return _ENVIRON.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENVIRON.encodekey(name)
    value = _RAW.get(key)
    return default if value is None else _ENVIRON.decodevalue(value)


def interpreting() -> bool:
    return getenv("TRITON_INTERPRET", "0") not in ("", "0")


def select_backend(device: torch.device, dtype: torch.dtype | None = None,
                   name: str = "q") -> str:
    """"triton" or "torch" for tensors on ``device``. With ``dtype`` (that of the
    argument ``name``), refuse bfloat16 where the Triton kernels would run in the
    interpreter: its numpy emulation of bfloat16 returns garbage (errors near 1e9),
    not an error."""
    backend = _choose(device)
    if backend == "torch":
        return backend
    if dtype in _FP8 and interpreting():
        from flashtile.ops._fp8 import interpreter_converts_fp8

        if not interpreter_converts_fp8():
            from flashtile._validate import _fail
            _fail(TypeError, f"{name}.dtype", "no float8 dtype while the Triton kernels run "
                  "in this Triton's interpreter (TRITON_INTERPRET=1)", dtype, "Its numpy "
                  "FP8 rounding loses carries (31.7 becomes 16 in e5m2), which would make "
                  "every P @ V product wrong: set FLASHTILE_BACKEND=torch for the PyTorch "
                  "path")
    if dtype == torch.bfloat16 and interpreting():
        from flashtile._validate import _fail
        _fail(TypeError, f"{name}.dtype", "float32 or float16 while the Triton kernels "
              "run in the Triton interpreter (TRITON_INTERPRET=1)", dtype,
              "The interpreter cannot compute in bfloat16 (its results are garbage): use "
              "float32 or float16, or set FLASHTILE_BACKEND=torch for the PyTorch path")
    return backend


def _choose(device: torch.device) -> str:
    forced = getenv("FLASHTILE_BACKEND", "")
    if forced:
        forced = forced.strip().lower()
        if forced and forced not in BACKENDS:
            raise ValueError(f"FLASHTILE_BACKEND must be one of {BACKENDS}, got {forced!r}")
    device_type = device.type
    if device_type == "cuda":
        return forced or "triton"
    if device_type == "cpu":
        if forced == "triton" and not interpreting():
            raise RuntimeError(
                "FLASHTILE_BACKEND=triton on CPU tensors needs the Triton interpreter: "
                "set TRITON_INTERPRET=1 before importing flashtile, or move the tensors "
                "to a CUDA device")
        return forced or ("triton" if interpreting() else "torch")
    if forced == "torch":
        return "torch"
    raise NotImplementedError(
        f"flashtile runs on CUDA/ROCm (Triton) and CPU (PyTorch) tensors, got device "
        f"{device}; set FLASHTILE_BACKEND=torch to use the tiled PyTorch path there")


def backend_name(device: torch.device) -> str:
    """select_backend's choice, saying when Triton runs in the interpreter (for tables)."""
    backend = select_backend(device)
    if backend == "triton" and device.type == "cpu" and interpreting():
        return "triton (interpreter)"
    return backend


def hopper_fwd_mode() -> str:
    """FLASHTILE_HOPPER_FWD: where dense forwards on sm_90 go to the Gluon kernel
    (flashtile/ops/fwd_hopper.py) instead of the portable one, wherever it supports the
    call. "auto" (the default): the cells where it was timed faster
    (``custom_ops._hopper_fwd_wins``: 16-bit at head dims 64, 96 (in d128's tiles), 128
    and 256 from 128 queries, FP8 at 64, 128 and 256 from 1k); "1": every call it
    supports; "0": never."""
    value = getenv("FLASHTILE_HOPPER_FWD", "auto")
    if value == "auto":
        return value
    value = value.strip() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"FLASHTILE_HOPPER_FWD must be 'auto', '0' or '1', got {value!r}")
    return value


def hopper_bwd_mode() -> str:
    """FLASHTILE_HOPPER_BWD: where dense 16-bit backwards on sm_90 go to the Gluon
    backward (flashtile/ops/bwd_hopper.py; head_dim 256 in bwd_hopper256.py) instead of
    the portable one. "auto" (the default): the calls it supports (head dims 64, 96 (in
    d128's tiles), 128 and 256, causal or full, no dropout) where both lengths reach
    ``configs.HOPPER_BWD_AUTO_MIN_SEQLEN`` (256 at d64/d96/d128, 128 at d256): forward+
    backward was timed at 1.09-1.22x the portable split backward at d64/d128 and
    2.0-2.5x at d256 from 1k tokens (docs/benchmarks/NOTES.md sections 22 and 24), and
    1.2-1.5x (d64/d128 at 512) and 2.5-3x (d256 from 128) below (section 32); d64/d128
    lost at 128 and 256 tokens then; since its plans encode their tensor maps it wins at
    256 by 8-33% (section 33). "1": every call it supports; "0": never. Deterministic
    calls always keep the portable split backward (its dQ atomics are not
    reproducible)."""
    value = getenv("FLASHTILE_HOPPER_BWD", "auto").strip() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"FLASHTILE_HOPPER_BWD must be 'auto', '0' or '1', got {value!r}")
    return value


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str) -> torch.device:
    """A command line's --device: "auto" is CUDA if available, else CPU."""
    return default_device() if name == "auto" else torch.device(name)
