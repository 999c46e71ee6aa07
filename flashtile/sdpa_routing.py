"""flashtile.sdpa_override: route torch.nn.functional.scaled_dot_product_attention to
flashtile in code that was written against PyTorch's SDPA.

Switching on rebinds ``torch.nn.functional.scaled_dot_product_attention`` (what
``F.scaled_dot_product_attention(...)`` and torch.nn.MultiheadAttention's SDPA path
look up at call time) and every module-level name outside torch and flashtile that
holds PyTorch's function (``from torch.nn.functional import scaled_dot_product_attention
[as sdpa]`` run before the switch) to one routing function. That function sends a call
to ``flashtile.scaled_dot_product_attention`` when flashtile takes its arguments, and to
PyTorch's own function otherwise, logging the reason once per reason (logger
``flashtile``, WARNING). Switching off restores every name it rebound.

A reference held elsewhere (an attribute of a class or object, a closure, a default
argument) is not found and keeps calling PyTorch's SDPA.
"""

from __future__ import annotations

import logging
import sys
import threading

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from flashtile import _backend
from flashtile import _validate as V
from flashtile.interface import scaled_dot_product_attention as _flashtile_sdpa

logger = logging.getLogger("flashtile")

# PyTorch's function, taken from the C module, which the switch never rebinds.
_TORCH_SDPA = torch._C._nn.scaled_dot_product_attention
_DEVICE_TYPES = ("cpu", "cuda")


class _State:
    """The switch and what it rebound: module-level bindings found so far, and the names
    of the modules already scanned (each is scanned once, when first seen)."""

    def __init__(self):
        self.enabled = False
        self.lock = threading.Lock()
        self.bindings = []          # (module, attribute name)
        self.scanned = set()
        self.reasons_logged = set()


_state = _State()


@torch.compiler.assume_constant_result
def _log_fallback(reason: str) -> bool:
    # Under torch.compile this runs when the call is traced, so a compiled graph logs
    # once as an eager run does, and adds no node.
    if reason not in _state.reasons_logged:
        _state.reasons_logged.add(reason)
        logger.warning("flashtile.sdpa_override: this scaled_dot_product_attention call "
                       "runs PyTorch's implementation: %s", reason)
    return True


@torch.compiler.assume_constant_result
def _interpreter_refuses_bfloat16(device_type: str) -> bool:
    # The Triton interpreter's bfloat16 is garbage and flashtile refuses it there.
    backend = _backend._choose(torch.device(device_type))
    return backend == "triton" and _backend.interpreting()


def _plain_tensor(x):
    return isinstance(x, torch.Tensor) and not x.is_nested \
        and not is_traceable_wrapper_subclass(x)


def _unsupported(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                 extra):
    """Why flashtile cannot take this call, or None. Only cheap checks on shapes and
    types (no device read); a call that is wrong for PyTorch too goes to PyTorch, which
    raises its own error."""
    if extra:
        return f"arguments flashtile does not know: {sorted(extra)}"
    if not all(_plain_tensor(x) for x in (query, key, value)):
        return "a query, key or value that is not a plain dense tensor (nested or a " \
               "tensor subclass)"
    dtype, device = query.dtype, query.device
    if dtype not in V.SUPPORTED_DTYPES:
        return f"dtype {dtype} (flashtile computes in float16, bfloat16 and float32)"
    if device.type not in _DEVICE_TYPES:
        return f"device type {device.type!r} (flashtile runs on CUDA and CPU tensors)"
    if dtype == torch.bfloat16 and _interpreter_refuses_bfloat16(device.type):
        return "bfloat16 while the Triton kernels run in the Triton interpreter"
    if any(x.dtype != dtype or x.device != device for x in (key, value)):
        return "query, key and value of different dtypes or devices"
    if not query.dim() == key.dim() == value.dim() or query.dim() < 3:
        return "tensors that are not all of one rank, 3 or more"
    if key.shape[-1] != query.shape[-1]:
        return "a key head_dim different from the query's"
    if not all(1 <= x.shape[-1] <= V.MAX_HEAD_DIM for x in (query, value)):
        return f"a head_dim outside 1 to {V.MAX_HEAD_DIM}"
    batch_dims = -3 if query.dim() >= 4 else -2
    if key.shape[:-1] != value.shape[:-1] or \
            key.shape[:batch_dims] != query.shape[:batch_dims]:
        return "key/value shapes that differ from each other or from the query's batch"
    if query.dim() >= 4:
        h, hkv = query.shape[-3], key.shape[-3]
        if hkv == 0 or (h != hkv and not (enable_gqa is True and h % hkv == 0)):
            return "key/value heads that do not divide the query heads (enable_gqa)"
    if any(x.shape[-1] > 1 and x.stride(-1) != 1 for x in (query, key, value)):
        return "a head dim that is not contiguous (stride(-1) != 1)"
    if attn_mask is not None:
        if is_causal:
            return "attn_mask together with is_causal=True"
        if not _plain_tensor(attn_mask) or attn_mask.device != device or \
                attn_mask.dtype not in (torch.bool, dtype):
            return "an attn_mask that is not a bool or query-dtype tensor on the " \
                   "query's device"
        target = (*query.shape[:-1], key.shape[-2])      # (batch, [heads,] L, S)
        if not V.broadcastable(attn_mask.shape, target):
            return "an attn_mask not broadcastable to the scores' shape"
        if attn_mask.requires_grad and torch.is_grad_enabled():
            return "an attn_mask that requires grad (flashtile returns no mask gradient)"
    if not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
        return "is_causal or enable_gqa that is not a bool"
    return None


def routed_scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                        is_causal=False, scale=None, enable_gqa=False,
                                        **extra):
    """What torch.nn.functional.scaled_dot_product_attention is while the override is
    on: flashtile.scaled_dot_product_attention where it takes the arguments, PyTorch's
    function otherwise (with a one-time log line per reason)."""
    if _state.enabled:
        reason = _unsupported(query, key, value, attn_mask, is_causal, scale,
                              enable_gqa, extra)
        if reason is None:
            return _flashtile_sdpa(query, key, value, attn_mask, dropout_p, is_causal,
                                   scale, enable_gqa)
        _log_fallback(reason)
    # enable_gqa only when set: PyTorch before 2.5 has no such argument.
    gqa = {"enable_gqa": enable_gqa} if enable_gqa else {}
    return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                       is_causal=is_causal, scale=scale, **gqa, **extra)


def _skipped(module_name):
    # torch's own modules keep PyTorch's function (torch.nn.functional is rebound by
    # name); flashtile's hold it on purpose.
    return module_name.split(".", 1)[0] in ("torch", "flashtile")


def _rebind(target):
    """Point torch.nn.functional's name and every module-level binding of PyTorch's (or
    the routing) function at target. Modules are scanned once each, so a switch costs
    one pass over the modules imported since the last one (~10 ms for the first)."""
    F.scaled_dot_product_attention = target
    ours = (_TORCH_SDPA, routed_scaled_dot_product_attention)
    for name, module in list(sys.modules.items()):
        if name in _state.scanned:
            continue
        _state.scanned.add(name)
        namespace = getattr(module, "__dict__", None)
        if _skipped(name) or not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if any(value is f for f in ours):
                _state.bindings.append((module, attr))
                logger.info("flashtile.sdpa_override: %s.%s (bound before the switch) is "
                            "rebound too", name, attr)
    for module, attr in _state.bindings:
        if any(getattr(module, attr, None) is f for f in ours):
            setattr(module, attr, target)


def _set_enabled(enable):
    with _state.lock:
        _rebind(routed_scaled_dot_product_attention if enable else _TORCH_SDPA)
        _state.enabled = enable


class sdpa_override:
    """Route torch.nn.functional.scaled_dot_product_attention to flashtile.

    ``flashtile.sdpa_override()`` switches it on for the whole process (and
    ``flashtile.sdpa_override(False)`` off); ``with flashtile.sdpa_override(): ...``
    switches it on inside the block and back to the previous state after it, as
    ``torch.set_grad_enabled`` does.

    A routed call runs ``flashtile.scaled_dot_product_attention`` when flashtile takes
    its arguments; otherwise it runs PyTorch's function and logs why, once per reason
    (logger ``flashtile``, WARNING): a dtype other than float16, bfloat16 and float32, a
    device other than CUDA and CPU, a key head_dim different from the query's, batch
    dims of key/value that broadcast to the query's rather than match, nested tensors
    and tensor subclasses, an attn_mask of another dtype or needing a gradient, unknown
    arguments.

    Reach: calls through ``torch.nn.functional.scaled_dot_product_attention`` (looked
    up when called), torch.nn.MultiheadAttention and nn.Transformer* layers when they
    use SDPA (training, or with grad; their fused inference fast path calls another
    kernel: ``torch.backends.mha.set_fastpath_enabled(False)`` sends it to SDPA), and
    module-level names bound to PyTorch's function before the switch. Not references
    held elsewhere (class attributes, closures, default arguments).

    The switch is process-wide (all threads). torch.compile: switch outside the compiled
    function; a function compiled while the override is on has flashtile's op in its
    graph (no graph break), and switching makes torch.compile recompile it (its guards
    see the rebound function).
    """

    def __init__(self, enable: bool = True):
        V.check_bool(enable, "enable")
        self.previous = _state.enabled
        _set_enabled(enable)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        _set_enabled(self.previous)
        return False

    @staticmethod
    def is_enabled() -> bool:
        return _state.enabled
