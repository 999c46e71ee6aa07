"""Checks on user input, run in Python before any kernel launch.

Each raises TypeError (wrong kind or dtype) or ValueError (wrong value or shape) naming
the argument, what was expected and what was given, so a mistake never reaches a kernel
as a compile error, an illegal memory access or a silent wrong number.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Where FP8 is taken (flash_attn_func, its varlen form, flash_attn_with_kvcache):
# flashtile.fp8 checks the descales and the rest of the FP8 rules.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
WITH_FP8 = SUPPORTED_DTYPES + FP8_DTYPES
_DTYPE_NAMES = {SUPPORTED_DTYPES: "dtype float16, bfloat16 or float32",
                WITH_FP8: "dtype float16, bfloat16, float32, float8_e4m3fn or float8_e5m2"}
MAX_HEAD_DIM = 512
# DeepSeek's absorbed MLA decode: q and k of 512 latent + 64 rope dims, v the 512 latent
# ones. Only flash_attn_with_kvcache takes it (its kernel splits the key head dim into a
# 512 tile and a 64 tile); elsewhere head dims stop at MAX_HEAD_DIM.
MLA_HEAD_DIM = 576
_MLA_ONLY_IN_KVCACHE = (f"head_dim {MLA_HEAD_DIM} (absorbed MLA) is taken by "
                        "flash_attn_with_kvcache only")


def _fail(kind, name, expected, got, fix=""):
    # One f-string, no concatenation: torch.compile can then build the message when a
    # check fails while tracing, even around symbolic sizes.
    raise kind(f"{name}: expected {expected}, got {got}{'. ' if fix else ''}{fix}")


# Layouts a long-running process meets: a few per model and batch size; a memo past this
# starts over rather than grow without bound.
MAX_LAYOUTS = 1024


def layouts(tensors):
    """(dtype, shape, strides, device) of each tensor, None for an absent one: the key of
    once_per_layout; None when one is not a plain torch.Tensor."""
    key = []
    for x in tensors:
        if x is None:
            key.append(None)
        elif type(x) is torch.Tensor:
            key.append((x.dtype, x.shape, x.stride(), x.device))
        else:
            return None
    return tuple(key)


# Ids of checked layouts, unique in the process (once_per_layout's with_id).
_layout_ids = itertools.count(1)


def once_per_layout(check):
    """``check(*tensors)`` (tensors or None), run once per combination of the tensors'
    layouts in eager calls, its result remembered: for a check that reads nothing but
    their types, dtypes, shapes, strides and devices (no address, no value, no global
    state), a call with the layouts of one that passed passes too. A new layout, an
    argument that is not a plain tensor (a subclass, a Parameter, a wrong type) and
    every traced call (symbolic shapes; no host state in a graph) are checked in full,
    so bad input raises as before; a check that raised stores nothing. Host time of
    the checks is most of a decode call's (issue 15). No tensor is held.

    ``checked.with_id(*tensors)``: (the result, the id of this combination of layouts,
    or None where it was checked in full): an int no other combination gets in this
    process, which a launcher's plan key may hold in place of the layouts."""
    results = {}

    def with_id(*tensors):
        key = None if torch.compiler.is_compiling() else layouts(tensors)
        if key is None:
            return check(*tensors), None
        entry = results.get(key)
        if entry is None:
            entry = (check(*tensors), next(_layout_ids))
            if len(results) >= MAX_LAYOUTS:
                results.clear()
            results[key] = entry
        return entry

    @functools.wraps(check)
    def checked(*tensors):
        return with_id(*tensors)[0]

    checked.with_id = with_id
    checked.cache_clear = results.clear
    return checked


# The kernels index with 32-bit offsets (batch * stride + row * stride + col); past
# this a tensor would wrap around, so it is refused instead.
MAX_OFFSET = 2**31 - 1


def offset_reach(x):
    """Offset, in elements, of the farthest element of x from its first."""
    return sum((size - 1) * abs(stride) for size, stride in zip(x.shape, x.stride())
               if size > 0)


def check_offsets(x, name, dense=True):
    """The farthest element a kernel can address in x must fit a 32-bit offset.

    dense: an output or gradient of x's shape is allocated contiguous, so x's element
    count must fit too (a stride-0 q/k/v reaches little but its out/dk/dv do not). An
    expanded attn_mask has no such twin: only its reach counts.
    """
    if dense and x.is_contiguous():  # reach = numel - 1: the element count says it all
        if x.numel() > MAX_OFFSET:
            _fail(ValueError, name, "a tensor whose elements are reachable with 32-bit "
                  "offsets (< 2**31 elements from its first)", f"shape {tuple(x.shape)}",
                  "Split the batch into calls of fewer than 2**31 elements each")
        return
    if offset_reach(x) > MAX_OFFSET or (dense and x.numel() > MAX_OFFSET):
        _fail(ValueError, name, "a tensor whose elements are reachable with 32-bit offsets "
              "(< 2**31 elements from its first)", f"shape {tuple(x.shape)}, strides "
              f"{tuple(x.stride())}", "Split the batch into calls of fewer than 2**31 "
              "elements each")


def check_tensor(x, name, rank, offsets32=True, dtypes=SUPPORTED_DTYPES):
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    if x.dtype not in dtypes:
        _fail(TypeError, name, _DTYPE_NAMES[dtypes], x.dtype)
    shape = x.shape
    if len(shape) != rank:
        _fail(ValueError, name, f"a {rank}-d tensor", f"shape {tuple(shape)}")
    if shape[-1] > 1 and x.stride(-1) != 1:
        _fail(ValueError, f"{name}.stride(-1)", "1 (the head dim contiguous)",
              x.stride(-1), "Call .contiguous() on it, or slice only the other dims")
    if offsets32:  # the decode kernel addresses KV-cache rows with 64-bit offsets
        check_offsets(x, name)


def check_qkv(q, k, v, names=("q", "k", "v"), packed=False, dtypes=SUPPORTED_DTYPES,
              fp8_pool=False):
    """q (b, sq, h, d), k/v (b, sk, hkv, d), or with ``packed`` (varlen) q (total_q, h,
    d), k/v (total_k, hkv, d); v's head dim may differ. Returns (b, sq, sk, h, hkv, d)
    with q's head dim d, b = 1 when packed.

    ``names`` are the caller's argument names, used in the messages (the SDPA drop-in
    passes ("query", "key", "value")). ``dtypes``: WITH_FP8 where FP8 is taken.
    ``fp8_pool``: k and v may also be a float8 KV pool (one format) under float16 or
    bfloat16 q (paged varlen, as flash_attn_with_kvcache's FP8 cache).
    """
    qn, kn, vn = names
    rank = 3 if packed else 4
    check_tensor(q, qn, rank, dtypes=dtypes)
    check_tensor(k, kn, rank, dtypes=dtypes)
    check_tensor(v, vn, rank, dtypes=dtypes)
    dtype, device = q.dtype, q.device
    mixed = (fp8_pool and dtype in (torch.float16, torch.bfloat16)
             and k.dtype in FP8_DTYPES)
    for x, name in ((k, kn), (v, vn)):
        if x.dtype != (k.dtype if mixed else dtype):
            if fp8_pool:
                _fail(TypeError, f"{name}.dtype", f"{qn}'s dtype {dtype}, or with float16 "
                      f"or bfloat16 {qn} a float8 pool ({kn} and {vn} in one format)",
                      x.dtype)
            _fail(TypeError, f"{name}.dtype", f"{qn}'s dtype {dtype}", x.dtype,
                  f"{qn}, {kn} and {vn} must share one dtype")
        if x.device != device:
            _fail(ValueError, f"{name}.device", f"{qn}'s device {device}", x.device)
    k_shape = k.shape
    if packed:
        (sq, h, d), (sk, hkv, kd), b, kb = q.shape, k_shape, 1, 1
    else:
        (b, sq, h, d), (kb, sk, hkv, kd) = q.shape, k_shape
    # v's head dim may differ from q's and k's (DeepSeek's MLA: 192/128); the output
    # takes v's.
    if k_shape[:-1] != v.shape[:-1]:
        _fail(ValueError, f"{vn}.shape[:-1]", f"{kn}'s {tuple(k_shape[:-1])}",
              tuple(v.shape[:-1]), f"{kn} and {vn} differ only in head_dim")
    if kb != b:
        _fail(ValueError, f"{kn}.shape[0] (batch)", f"{qn}'s batch {b}", kb)
    if kd != d:
        _fail(ValueError, f"{kn}.shape[-1] (head_dim)", f"{qn}'s head_dim {d}", kd,
              f"{qn} and {kn} must share one head_dim ({vn}'s may differ)")
    if not 1 <= d <= MAX_HEAD_DIM:
        _fail(ValueError, f"{qn}.shape[-1] (head_dim)", f"1 to {MAX_HEAD_DIM}", d,
              _MLA_ONLY_IN_KVCACHE if d == MLA_HEAD_DIM else "")
    if not 1 <= v.shape[-1] <= MAX_HEAD_DIM:
        _fail(ValueError, f"{vn}.shape[-1] (head_dim)", f"1 to {MAX_HEAD_DIM}",
              v.shape[-1])
    if hkv == 0 or h % hkv != 0:
        _fail(ValueError, f"{kn}.shape[{rank - 2}] (nheads_kv)",
              f"a divisor of {qn}'s nheads {h} (GQA/MQA)", hkv)
    if b * h > MAX_GRID_Y:
        check_grid(b * h, device)
    return b, sq, sk, h, hkv, d


# CUDA's second and third grid dimensions stop at 65535; the kernels put batch * heads
# there.
MAX_GRID_Y = 65535


def views_overlap(a, b):
    """Whether some element of b is also one of a (eager only: reads addresses).

    Exact for views of one storage that share their sizes and strides but the last
    dim's, each stride spanning the dims inside it (the cache layouts:
    kv[..., :512] overlaps kv; kv[0] and kv[1], kv[:, :, 0] and kv[:, :, 1], or
    kv[..., :d] and kv[..., d:] do not); other views of one storage count as
    overlapping when their address ranges do.
    """
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() \
            or not a.numel() or not b.numel():
        return False
    delta = b.storage_offset() - a.storage_offset()
    if delta < 0:
        a, b, delta = b, a, -delta
    ranges_meet = delta <= offset_reach(a)  # a starts first
    if a.shape[:-1] != b.shape[:-1] or a.stride()[:-1] != b.stride()[:-1]:
        return ranges_meet
    dims = sorted(range(a.dim() - 1), key=a.stride)  # innermost first
    # Each stride must pass the farthest element inside it: then b's first element has
    # one index in a (greedy division by the strides, outermost first).
    reach = max(a.shape[-1], b.shape[-1]) - 1
    for i in dims:
        if a.stride(i) <= reach:
            return ranges_meet
        reach += (a.shape[i] - 1) * a.stride(i)
    for i in reversed(dims):
        index, delta = divmod(delta, a.stride(i))
        if index >= a.shape[i]:
            return False
    row = a.stride(dims[0]) if dims else a.numel()
    if delta + b.shape[-1] > row:  # b's rows run into a's next ones
        return ranges_meet
    # The same rows, b's columns from column delta of a's.
    return delta < a.shape[-1]


def check_kvcache_head_dims(d, dv):
    """flash_attn_with_kvcache's head dims: q/k's d up to MAX_HEAD_DIM or exactly
    MLA_HEAD_DIM, v's dv (MLA: may differ from d) up to MAX_HEAD_DIM."""
    if not (1 <= d <= MAX_HEAD_DIM or d == MLA_HEAD_DIM):
        _fail(ValueError, "q.shape[-1] (head_dim)", f"1 to {MAX_HEAD_DIM}, or "
              f"{MLA_HEAD_DIM} (absorbed MLA: 512 latent + 64 rope dims)", d)
    if not 1 <= dv <= MAX_HEAD_DIM:
        _fail(ValueError, "v_cache.shape[-1] (head_dim_v)", f"1 to {MAX_HEAD_DIM}", dv)


def check_grid(batch_heads, device):
    if device.type == "cuda" and batch_heads > MAX_GRID_Y:
        _fail(ValueError, "batch * nheads", f"at most {MAX_GRID_Y} (a CUDA grid limit)",
              batch_heads, "Split the batch into several calls")


def check_float(x, name, *, minimum=None, allow_none=False):
    if x is None and allow_none:
        return
    # type() first: numbers.Real's isinstance goes through the ABC machinery.
    if type(x) is not float and (isinstance(x, bool) or not isinstance(x, numbers.Real)):
        _fail(TypeError, name, "a float", type(x).__name__)
    # x != x is NaN. Not math.isfinite: under torch.compile(dynamic=True) a float
    # argument, even a default such as dropout_p=0.0, is a SymFloat, which isfinite
    # cannot take; comparisons trace (as guards).
    if x != x or abs(x) == math.inf or (minimum is not None and x < minimum):
        bound = f"a finite float >= {minimum}" if minimum is not None else "a finite float"
        _fail(ValueError, name, bound, x)


def check_softmax_scale(scale, name="softmax_scale"):
    check_float(scale, name, allow_none=True)


_F32_BELOW_ONE = 1.0 - 2.0 ** -24  # the largest float32 below 1


def check_dropout(dropout_p, name="dropout_p"):
    check_float(dropout_p, name, minimum=0.0)
    # The kernels take p in fp32: a p that rounds to 1.0 there would drop every score
    # and scale by 1 / (1 - p) = inf (NaN out), and its keep threshold ceil(p * 2**32)
    # would overflow 32 bits.
    if dropout_p >= 1.0:
        _fail(ValueError, name, "a probability in [0, 1)", dropout_p)
    if dropout_p > _F32_BELOW_ONE:
        _fail(ValueError, name, f"at most {_F32_BELOW_ONE!r} (below 1 in float32, as the "
              "kernels take it)", dropout_p)


def check_no_dropout(dropout_p, where):
    """Paths without a dropout mask (FP8, a paged KV pool) refuse dropout_p > 0."""
    if dropout_p > 0.0:
        _fail(ValueError, "dropout_p", f"0.0 {where} (it has no dropout)", dropout_p,
              "Dropout is for training: use 16/32-bit inputs and packed or dense k/v")


def check_bool(x, name):
    """A flag must be a bool: a string such as 'yes' or 'False' is truthy in Python and
    would silently turn the option on."""
    if not isinstance(x, bool):
        _fail(TypeError, name, "a bool", f"{type(x).__name__} {x!r}")


def check_bools(**flags):
    for name, x in flags.items():
        if x is not True and x is not False:
            check_bool(x, name)


def _is_int_tensor(x):
    return (isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex()
            and x.dtype != torch.bool)


_WINDOW_TYPES = "a pair of ints (left, right), or a 2-element integer tensor"


def check_window(window_size):
    """(left, right) as ints. flash-attn also takes a 2-element integer tensor (its tests
    draw windows with torch.randint) or a pair of 0-d ones, on the CPU: their values are
    read on the host. Not a GPU tensor (reading it would make every call wait for the
    GPU), and not inside torch.compile (a compiled graph would bake in the values of its
    first call while the tensor may change between calls)."""
    if type(window_size) is tuple and len(window_size) == 2 \
            and type(window_size[0]) is int and type(window_size[1]) is int:
        left, right = window_size  # the common case, without the general checks below
        if left < -1 or right < -1:
            _fail(ValueError, "window_size", "each bound >= 0, or -1 for unbounded",
                  (left, right))
        return left, right
    tensors = ([window_size] if isinstance(window_size, torch.Tensor) else
               [w for w in window_size if isinstance(w, torch.Tensor)]
               if isinstance(window_size, (tuple, list)) else [])
    if tensors and torch.compiler.is_compiling():
        _fail(TypeError, "window_size", "a pair of ints (left, right) under torch.compile",
              "a tensor", "Convert it before the compiled call: "
              "tuple(int(w) for w in window_size)")
    on_device = [w.device for w in tensors if w.device.type != "cpu"]
    if on_device:
        _fail(TypeError, "window_size", "a pair of ints (left, right) or a CPU tensor",
              f"a tensor on {on_device[0]}", "Reading it would make every call wait for "
              "the device: convert it once, tuple(window_size.tolist())")
    if isinstance(window_size, torch.Tensor):
        ok = _is_int_tensor(window_size) and tuple(window_size.shape) == (2,)
        bounds = window_size.tolist() if ok else None
    elif isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
            (isinstance(w, numbers.Integral) and not isinstance(w, bool))
            or (_is_int_tensor(w) and w.dim() == 0) for w in window_size):
        bounds = [int(w) for w in window_size]
    else:
        bounds = None
    if bounds is None:
        _fail(TypeError, "window_size", _WINDOW_TYPES, repr(window_size))
    left, right = bounds
    if left < -1 or right < -1:
        _fail(ValueError, "window_size", "each bound >= 0, or -1 for unbounded",
              (left, right))
    return left, right


def check_alibi(alibi_slopes, batch, nheads, device):
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        _fail(TypeError, "alibi_slopes", "a torch.Tensor or None",
              type(alibi_slopes).__name__)
    if not alibi_slopes.is_floating_point():
        _fail(TypeError, "alibi_slopes.dtype", "a floating dtype (float32)",
              alibi_slopes.dtype)
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        _fail(ValueError, "alibi_slopes.shape", f"({nheads},) or ({batch}, {nheads})",
              tuple(alibi_slopes.shape))
    if alibi_slopes.device != device:
        _fail(ValueError, "alibi_slopes.device", f"q's device {device}",
              alibi_slopes.device)
    return alibi_slopes.float()


def check_flash_options(dropout_p, softmax_scale, softcap, window_size, causal):
    """The scalar options shared by flash_attn_func, its varlen and KV-cache forms and
    the ring (the last two have no dropout: they pass 0.0).

    Returns (window_left, window_right) with causal folded in (right bound 0).
    """
    # Values that pass at a glance (a bool, plain floats in range; NaN fails every
    # comparison) skip the checks' calls: an eager call's host time (issue 15).
    if causal is not True and causal is not False:
        check_bool(causal, "causal")
    if not (type(dropout_p) is float and 0.0 <= dropout_p <= _F32_BELOW_ONE):
        check_dropout(dropout_p)
    if softmax_scale is not None and not (type(softmax_scale) is float
                                          and -math.inf < softmax_scale < math.inf):
        check_softmax_scale(softmax_scale)
    if not (type(softcap) is float and 0.0 <= softcap < math.inf):
        check_float(softcap, "softcap", minimum=0.0)
    left, right = check_window(window_size)
    return left, 0 if causal else right


def broadcastable(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (no more dims; each 1 or equal), checked
    by hand: under torch.compile expand's error is raised by the tracer, which no except
    clause in traced code can catch, and on symbolic sizes these comparisons are guards."""
    return len(shape) <= len(target) and all(
        m == 1 or m == t for m, t in zip(reversed(shape), reversed(target)))


def check_attn_mask(attn_mask, batch, nheads, seqlen_q, seqlen_k, device, dtype):
    """SDPA mask: bool (True = attend) or additive float, broadcastable to (b, h, sq, sk).

    Returns it expanded to (b, h, sq, sk) without copying (stride 0 where broadcast).
    """
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        _fail(TypeError, "attn_mask", "a torch.Tensor or None", type(attn_mask).__name__)
    if attn_mask.dtype != torch.bool and attn_mask.dtype != dtype:
        _fail(TypeError, "attn_mask.dtype", f"torch.bool or the query's dtype {dtype}",
              attn_mask.dtype, "Pass a bool mask or attn_mask.to(query.dtype), as "
              "torch.nn.functional.scaled_dot_product_attention requires")
    if attn_mask.device != device:
        _fail(ValueError, "attn_mask.device", f"the query's device {device}",
              attn_mask.device)
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "attn_mask.requires_grad=True: flashtile returns no gradient for the mask; "
            "pass attn_mask.detach()")
    target = (batch, nheads, seqlen_q, seqlen_k)
    shape = tuple(attn_mask.shape)
    if not broadcastable(shape, target):
        _fail(ValueError, "attn_mask.shape", f"broadcastable to {target}", shape)
    expanded = attn_mask.expand(target)
    check_offsets(expanded, "attn_mask", dense=False)
    return expanded


def check_max_seqlen(x, name):
    """A max_seqlen: an int the kernels take as int32 (not a tensor: it sizes the grid
    on the host, so reading it from the device would be a sync)."""
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, torch.SymInt)):
        _fail(TypeError, name, "an int", type(x).__name__)
    if not 0 <= x <= MAX_OFFSET:
        _fail(ValueError, name, f"an int from 0 to {MAX_OFFSET}", x)


def check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The prefix sums of packed varlen (one host read each): the index check."""
    check_prefix_sums(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q,
                      "max_seqlen_q")
    check_prefix_sums(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k,
                      "max_seqlen_k")


def check_prefix_sums(cu, name, total, max_len, max_name):
    """cu (one host read) must be non-decreasing prefix sums from 0 to total, none of its
    lengths above max_len: a wrong one would send the kernel outside the tensors."""
    vals = cu.tolist()
    diffs = [b - a for a, b in zip(vals, vals[1:])]
    if vals[0] != 0 or vals[-1] != total or any(x < 0 for x in diffs):
        _fail(ValueError, name, f"non-decreasing prefix sums from 0 to the packed "
              f"length {total}", vals if len(vals) <= 8 else f"{vals[:8]}...")
    if diffs and max(diffs) > max_len:
        _fail(ValueError, max_name, f">= the longest sequence {max(diffs)}", max_len)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 dtypes=SUPPORTED_DTYPES):
    """Packed q (total_q, h, d), k/v (total_k, hkv, d) and their int32 prefix sums:
    shapes, dtypes and devices (the values are the kernels' to check, or
    ``check_varlen_values``'s where index checks are on). Returns (batch, h, hkv, d).
    """
    _, _, _, h, hkv, d = check_qkv(q, k, v, packed=True, dtypes=dtypes)
    lengths = {}
    for cu, name, total, max_len, max_name in (
            (cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q"),
            (cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k")):
        if not isinstance(cu, torch.Tensor):
            _fail(TypeError, name, "an int32 torch.Tensor", type(cu).__name__)
        if cu.dtype != torch.int32:
            _fail(TypeError, f"{name}.dtype", "torch.int32", cu.dtype)
        if cu.dim() != 1 or cu.numel() < 1:
            _fail(ValueError, f"{name}.shape", "(batch + 1,)", tuple(cu.shape))
        if cu.device != q.device:
            _fail(ValueError, f"{name}.device", f"q's device {q.device}", cu.device)
        check_max_seqlen(max_len, max_name)
        lengths[name] = cu.numel()
        if cu.numel() == 1 and total:
            # No sequence, yet rows: known from the shapes alone.
            _fail(ValueError, name, f"prefix sums from 0 to the packed length {total}",
                  "a single entry (no sequence)")
    if lengths["cu_seqlens_q"] != lengths["cu_seqlens_k"]:
        _fail(ValueError, "cu_seqlens_k.shape", f"cu_seqlens_q's ({lengths['cu_seqlens_q']},)",
              f"({lengths['cu_seqlens_k']},)")
    check_grid((lengths["cu_seqlens_q"] - 1) * h, q.device)
    return lengths["cu_seqlens_q"] - 1, h, hkv, d


# ---- Index tensors and paged caches: flash_attn_with_kvcache and the paged varlen ----

# The values of the index tensors (cu_seqlens, seqused_k, block_table, cache_seqlens,
# cache_batch_idx, cache_leftpad) live on the device. By default nothing reads them on
# the host: a read is a sync that costs more than a short call's kernels (the index
# check was ~50 us of a 260 us decode call on the H200, launch-cost-h200.txt), and the
# kernels make bad values harmless (no access outside a tensor)
# and visible (NaN in the rows they serve). With the index checks on, every call reads
# them first and raises ValueError naming the bad index. The PyTorch path checks always
# (its indices are read on the host anyway).
_INDEX_CHECKS = {
    "on": os.environ.get("FLASHTILE_CHECK_INDICES", "0").strip() not in ("", "0")}


def set_index_checks(enabled: bool) -> bool:
    """Turn the host-side index checks on or off for every flashtile call in this
    process; returns the previous setting (to restore it). The environment variable
    FLASHTILE_CHECK_INDICES=1 turns them on at import.

    On: flash_attn_varlen_func (cu_seqlens_q/k, seqused_k, block_table),
    flash_attn_with_kvcache (cache_seqlens, block_table, cache_batch_idx,
    cache_leftpad, the rotary table's length) and KVCache.update (input_pos) read the
    index tensors before any work (one device sync per call) and raise ValueError for a
    bad value. Off (the default): no read; the kernels clamp every index so that no
    load or store leaves its tensor, and the rows a bad index serves come out NaN (out
    and lse). Inside torch.compile graphs the check runs when the op runs; while a CUDA
    graph is being captured it is skipped (no sync is possible there).
    """
    check_bool(enabled, "enabled")
    previous = _INDEX_CHECKS["on"]
    _INDEX_CHECKS["on"] = enabled
    return previous


def index_checks_enabled() -> bool:
    return _INDEX_CHECKS["on"]

MIN_PAGE_SIZE, MAX_PAGE_SIZE = 16, 256


def check_page_size(page_size, name):
    """A power of two from 16 to 256: the kernels' key tiles (powers of two) then lie
    inside one page or cover whole pages."""
    if not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE or page_size & (page_size - 1):
        _fail(ValueError, name, f"a power of two from {MIN_PAGE_SIZE} to {MAX_PAGE_SIZE}",
              page_size)


def check_index_tensor(x, name, shape, device):
    """Dtype, shape and device of an int32 index tensor (its values are checked later)."""
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, "an int32 torch.Tensor", type(x).__name__)
    if x.dtype != torch.int32:
        _fail(TypeError, f"{name}.dtype", "torch.int32", x.dtype)
    if x.shape != shape:
        _fail(ValueError, f"{name}.shape", shape, tuple(x.shape))
    if x.device != device:
        _fail(ValueError, f"{name}.device", f"q's device {device}", x.device)


def can_read_indices(q) -> bool:
    """A host read of the indices is possible: not a meta tensor, not inside
    torch.compile's tracing, not while a CUDA graph is being captured."""
    return not (q.device.type == "meta" or torch.compiler.is_compiling()
                or (q.is_cuda and torch.cuda.is_current_stream_capturing()))


def cache_capacity(k_cache, block_table) -> int:
    """Keys a sequence's cache holds: its block table's pages, or its cache row."""
    if block_table is None:
        return k_cache.shape[1]
    return block_table.shape[1] * k_cache.shape[1]


def check_index_values(k_cache, block_table, cache_seqlens, cache_batch_idx, cache_leftpad,
                       sn, seqlens_name="cache_seqlens"):
    """Every index the kernel will follow, with one host sync: a wrong index must be an
    error, not a wild access. sn: tokens about to be appended after cache_seqlens;
    seqlens_name: what the caller calls the key counts, for the message."""
    if not cache_seqlens.numel():  # batch 0: nothing is read (aminmax refuses empties)
        return
    capacity = cache_capacity(k_cache, block_table)
    stats = list(torch.aminmax(cache_seqlens))
    if cache_leftpad is not None:
        stats += [cache_leftpad.min(), (cache_seqlens - cache_leftpad).min()]
    if block_table is not None and block_table.numel():
        stats += [block_table.min(), block_table.max()]
    if cache_batch_idx is not None:
        stats += [cache_batch_idx.min(), cache_batch_idx.max()]
    vals = torch.stack(stats).tolist()
    lo, hi = vals[0], vals[1]
    if lo < 0 or hi + sn > capacity:
        if sn:
            _fail(ValueError, seqlens_name, f"values in [0, {capacity - sn}] (cache "
                  f"capacity {capacity} minus {sn} new tokens)", f"range [{lo}, {hi}]",
                  "Grow the cache or evict before appending")
        _fail(ValueError, seqlens_name, f"values in [0, {capacity}] (the cache capacity)",
              f"range [{lo}, {hi}]")
    i = 2
    if cache_leftpad is not None:
        if vals[i] < 0 or vals[i + 1] < 0:
            _fail(ValueError, "cache_leftpad", "0 <= cache_leftpad <= cache_seqlens",
                  f"min {vals[i]}, min(cache_seqlens - cache_leftpad) {vals[i + 1]}")
        i += 2
    if block_table is not None and block_table.numel():
        if vals[i] < 0 or vals[i + 1] >= k_cache.shape[0]:
            _fail(ValueError, "block_table", f"block indices in [0, {k_cache.shape[0] - 1}]"
                  " (the pool's num_blocks)", f"range [{vals[i]}, {vals[i + 1]}]")
        i += 2
    if cache_batch_idx is not None and (vals[i] < 0 or vals[i + 1] >= k_cache.shape[0]):
        _fail(ValueError, "cache_batch_idx", f"indices in [0, {k_cache.shape[0] - 1}]",
              f"range [{vals[i]}, {vals[i + 1]}]")


def _check_int(x, name, minimum=0):
    # SymInt too: under torch.compile with dynamic shapes a length arrives symbolic.
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, torch.SymInt)):
        _fail(TypeError, name, "an int", type(x).__name__)
    if x < minimum:
        _fail(ValueError, name, f"an int >= {minimum}", x)


def check_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       block_table, seqused_k, dtypes=SUPPORTED_DTYPES):
    """flash_attn_varlen_func over a paged KV pool: packed q (total_q, h, d), k/v
    (num_blocks, page_size, hkv, d), block_table int32 (batch, max_blocks_per_seq), the
    key lengths from cu_seqlens_k (batch + 1,) or seqused_k (batch,). Shapes, dtypes and
    devices only (no device read: ``check_paged_varlen_values`` reads the indices).
    Returns (batch, h, hkv, d)."""
    check_tensor(q, "q", 3, dtypes=dtypes)
    for x, name in ((k, "k"), (v, "v")):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            _fail(ValueError, name, "a paged cache (num_blocks, page_size, nheads_kv, "
                  "head_dim) with block_table", getattr(x, "shape", type(x).__name__))
        # Rows of the pool are addressed as an int64 block offset plus a small in-page
        # offset, so the pool may pass 2**31 elements (as in flash_attn_with_kvcache).
        check_tensor(x, name, 4, offsets32=False, dtypes=dtypes)
    # v's head dim may differ (MLA); the pool's other dims are shared.
    if k.shape[:-1] != v.shape[:-1]:
        _fail(ValueError, "v.shape[:-1]", f"k's {tuple(k.shape[:-1])}",
              tuple(v.shape[:-1]), "k and v differ only in head_dim")
    if k.shape[0] == 0:
        _fail(ValueError, "k.shape[0] (num_blocks)", "at least 1 block", 0)
    # One block stands for the pool: dtypes, devices, head_dim and GQA as check_qkv.
    _, _, _, h, hkv, d = check_qkv(q.unsqueeze(0), k[:1], v[:1], dtypes=dtypes,
                                   fp8_pool=FP8_DTYPES[0] in dtypes)
    check_page_size(k.shape[1], "k.shape[1] (page_size)")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        _fail(ValueError, "block_table", "an int32 tensor (batch, max_blocks_per_seq)",
              getattr(block_table, "shape", type(block_table).__name__))
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 \
            or cu_seqlens_q.numel() < 1:
        _fail(ValueError, "cu_seqlens_q", "an int32 tensor (batch + 1,)",
              getattr(cu_seqlens_q, "shape", type(cu_seqlens_q).__name__))
    batch = cu_seqlens_q.numel() - 1
    check_index_tensor(cu_seqlens_q, "cu_seqlens_q", (batch + 1,), q.device)
    check_index_tensor(block_table, "block_table", (batch, block_table.shape[1]), q.device)
    if cu_seqlens_k is None and seqused_k is None:
        _fail(ValueError, "cu_seqlens_k/seqused_k", "one of them with block_table (the "
              "key length of each sequence)", "both None")
    if seqused_k is not None:
        check_index_tensor(seqused_k, "seqused_k", (batch,), q.device)
    if cu_seqlens_k is not None:
        check_index_tensor(cu_seqlens_k, "cu_seqlens_k", (batch + 1,), q.device)
    check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    if batch == 0 and q.shape[0]:
        _fail(ValueError, "cu_seqlens_q", f"prefix sums from 0 to the packed length "
              f"{q.shape[0]}", "a single entry (no sequence)")
    capacity = block_table.shape[1] * k.shape[1]
    if max_seqlen_k > capacity:
        _fail(ValueError, "max_seqlen_k", f"at most block_table.shape[1] * page_size = "
              f"{capacity} (the keys a block table row can name)", max_seqlen_k)
    check_grid(batch * h, q.device)
    return batch, h, hkv, d


def check_paged_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                              seqused_k):
    """The indices the paged varlen kernel follows (two host reads): cu_seqlens_q must
    be prefix sums of q's rows, each key length within the sequence's block table row,
    each block index within the pool."""
    check_prefix_sums(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q,
                      "max_seqlen_q")
    if seqused_k is not None:
        lengths, name = seqused_k, "seqused_k"
    else:
        lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        name = "cu_seqlens_k[b + 1] - cu_seqlens_k[b] (the key lengths)"
    check_index_values(k, block_table, lengths, None, None, 0, seqlens_name=name)
