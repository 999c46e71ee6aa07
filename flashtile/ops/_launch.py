"""Launch plans: after its first launch, a kernel variant is called through its compiled
launcher directly.

Triton's ``kernel[grid](...)`` binds every argument, specialises each one (dtype,
16-byte alignment of pointers, integers equal to 1 or divisible by 16), builds the cache
key and looks the compiled kernel up, on every call: about 100 us of Python per launch
on the H200's host for our ~50-argument kernels (NOTES.md sections 7-8,
docs/benchmarks/launch-cost-h200.txt), where the kernels of a short call take a few
microseconds. A launcher here computes a ``key`` that
fixes everything Triton specialises on except a few per-call arguments (the tensors'
addresses and the float scalars), makes its first launch with that key through Triton
(``make``, ``store``), and from then on only fills those arguments into the recorded
argument list and calls the compiled kernel's launcher (``Plan.__call__``). Tensors are
passed as their addresses (``pointers``): Triton's launcher then skips its per-pointer
driver query, which is there to refuse CPU tensors (a plan is only made for CUDA ones).

What a key must hold, so that the recorded arguments and the compiled kernel are right
for every call that finds it: the device, the dtype, shape and strides of every tensor
whose strides or sizes are passed, every integer and constexpr argument the launcher
derives (or their inputs), and for every tensor argument whether its address is a
multiple of 16 (Triton compiles aligned and unaligned pointers into different kernels;
the outputs a launcher allocates itself are always aligned). Per-call integers (a
varlen batch's max_seqlen) are ``do_not_specialize`` kernel parameters.

A key may hold an integer only up to what Triton compiles on (``spec_class``) where the
launcher replaces the recorded value in a copy of the plan (``Plan.with_args``): the
decode launcher does so for a contiguous cache that grows between calls (its capacity
and strides; ``flashtile.ops.decode._find_plans``).

A kernel's host tensor descriptors (the Gluon kernels' TMA) are slots too: a call
passes the tensor, and the plan encodes its tensor map (``_tensormap_launch``), every
other part of the descriptor being fixed by the key.

Plans are used for CUDA tensors with Triton's NVIDIA launcher only; the interpreter
(``TRITON_INTERPRET=1``), CPU tensors and launch hooks (a profiler such as proton) take
Triton's own path on every call. Tile choices are part of a plan: ``configs`` clears
the plans when its overrides or tuned table change; the FLASHTILE_*_CONFIG and
FLASHTILE_DECODE_PDL environment variables are read when a plan is made, so set them
before the first call (or call ``clear()``).
"""

from __future__ import annotations

import functools
import math
import os
from functools import reduce
from itertools import starmap
from operator import or_

import torch
import triton
from triton import knobs

_plans: dict = {}
# FLASHTILE_LAUNCH_PLANS=0 sends every launch through Triton's own path (A/B timing,
# or to rule plans out when chasing a bug); read at import, ``set_enabled`` changes it.
_enabled = {"on": os.environ.get("FLASHTILE_LAUNCH_PLANS", "1").strip() != "0"}
# Shapes a long-running process has seen (one plan each): far below this in practice; a
# process that exceeds it starts over rather than grow without bound.
MAX_PLANS = 4096


def clear() -> None:
    _plans.clear()


def set_enabled(on: bool) -> bool:
    """Use plans (True, the default) or Triton's path for every launch; returns the
    previous setting."""
    previous, _enabled["on"] = _enabled["on"], bool(on)
    return previous


# Plans call Triton's NVIDIA launcher; ROCm builds take Triton's path on every call.
_NVIDIA = torch.version.hip is None


def ready(x: torch.Tensor) -> bool:
    """Whether a launch for tensors like ``x`` may use (and make) plans: CUDA, and no
    Triton launch hook set (a profiler such as proton wants every launch to go through
    Triton's own path, which calls the hooks)."""
    if not (x.is_cuda and _NVIDIA and _enabled["on"]):
        return False
    runtime = knobs.runtime
    return not (getattr(runtime.launch_enter_hook, "calls", runtime.launch_enter_hook)
                or getattr(runtime.launch_exit_hook, "calls", runtime.launch_exit_hook))


def _device() -> int:
    return torch._C._cuda_getDevice()


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def lookup(key):
    """The plans stored under ``key`` (only after ``ready``), or None: then launch
    through Triton and ``store`` what ``make`` builds. The current CUDA device is part
    of the key: Triton compiles and launches for it."""
    return _plans.get((_device(), key))


def store(key, plans) -> None:
    """Keep ``plans`` (one Plan, or a tuple of them for a launcher of several kernels)
    for later calls with ``key``; nothing if any is None."""
    if plans is None or (isinstance(plans, tuple) and any(p is None for p in plans)):
        return
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[(_device(), key)] = plans


class Plan:
    """A compiled kernel and its argument list, the per-call slots left to fill.

    ``slots``: indices into the argument list (kernel parameter order) of the values a
    call passes, in the order it passes them; kept as runs of consecutive indices,
    filled by slice (a kernel's per-call parameters sit together: its tensors, then its
    floats). ``grid``: the grid of the recorded launch; a caller whose grid depends on
    per-call values passes its own. ``cfg``: the tile config the launch used (after any
    step-down for shared memory). ``maps``: (argument index, encode) of each tensor
    descriptor slot: a call passes the tensor there, and ``encode(tensor)`` makes what
    the launcher takes (``make``).
    """

    __slots__ = ("launch", "head", "template", "runs", "grid", "cfg", "device", "maps")

    def __init__(self, launch, head, template, slots, grid, cfg, device, maps=()):
        self.launch, self.head, self.template = launch, head, template
        self.grid, self.cfg, self.device, self.maps = grid, cfg, device, maps
        runs = []  # [args slice, values slice] of each run of consecutive slots
        for j, i in enumerate(slots):
            if runs and runs[-1][0].stop == i and runs[-1][1].stop == j:
                a, b = runs[-1]
                runs[-1] = (slice(a.start, i + 1), slice(b.start, j + 1))
            else:
                runs.append((slice(i, i + 1), slice(j, j + 1)))
        self.runs = tuple(runs)

    def with_args(self, changes):
        """A copy of this plan whose recorded arguments at the given indices (kernel
        parameter order; a kernel without tensor descriptors) hold other values:
        {index: value}. For integers a key fixes only up to what Triton specialises on
        (``spec_class``), such as the strides of a cache that grows between calls."""
        copy = object.__new__(Plan)
        for name in Plan.__slots__:
            setattr(copy, name, getattr(self, name))
        copy.template = list(self.template)
        for i, value in changes.items():
            copy.template[i] = value
        return copy

    def __call__(self, values, grid=None):
        args = self.template.copy()
        for to, take in self.runs:
            args[to] = values[take]
        for at, encode in self.maps:
            args[at] = encode(args[at])
        g = self.grid if grid is None else grid
        self.launch(g[0], g[1], g[2], _stream(self.device), *self.head, *args)


def make(compiled, kernel, args, kwargs, grid, slots, cfg=None):
    """The plan of a launch just made through Triton: ``compiled`` is what
    ``kernel[grid](*args, **kwargs)`` returned; ``slots`` names the parameters a call of
    the plan passes. None where there is nothing to plan (the interpreter) or this
    Triton does not expose what a plan needs: every call then goes through Triton."""
    launcher = getattr(compiled, "run", None)
    needed = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size",
              "profile_scratch_size")
    if launcher is None or not all(hasattr(launcher, n) for n in needed) \
            or not hasattr(compiled, "packed_metadata") or not hasattr(kernel, "arg_names"):
        return None
    names = kernel.arg_names
    if any(n not in kwargs for n in names[len(args):]):
        return None  # a parameter left to its default: not recorded here
    template = [*args, *(kwargs[n] for n in names[len(args):])]
    slot_index = tuple(names.index(n) for n in slots)
    maps = tuple((i, template[i]) for i in slot_index if _is_descriptor(template[i]))
    for i in slot_index:
        # Every call fills these: the first call's tensors must not be kept alive here
        # (a leak, and under torch.compile's CUDA graphs memory the graph thinks free).
        template[i] = None
    if any(isinstance(a, torch.Tensor) or _is_descriptor(a) for a in template):
        return None  # a tensor outside the slots would launch with a stale address
    if launcher.global_scratch_size or launcher.profile_scratch_size:
        # Scratch memory is allocated per launch by the launcher's Python wrapper.
        launch = launcher
        head = (compiled.function, compiled.packed_metadata, None, None, None)
    else:
        launch = launcher.launch
        head = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                None, None, compiled.packed_metadata, None, None, None)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    direct = _tensormap_launch(launch, template, slot_index, maps) if maps else None
    if direct is not None:
        launch, template, slot_index, maps = direct
    else:  # Triton's wrapper encodes the tensor maps from descriptors over the tensors
        maps = tuple((i, functools.partial(rebased, rebased(desc, None))) for i, desc in maps)
    return Plan(launch, head, template, slot_index, grid, cfg, _device(), maps)


def _is_descriptor(x) -> bool:
    return type(x).__name__ == "TensorDescriptor"


def rebased(desc, base):
    """Host tensor descriptor ``desc`` over another tensor ``base`` of the same shape,
    strides and dtype, without ``TensorDescriptor``'s checks (a plan's key fixes what
    they checked)."""
    copy = object.__new__(type(desc))
    copy.__dict__.update(desc.__dict__, base=base)
    return copy


def _tensormap_launch(launch, template, slot_index, maps):
    """For a kernel that takes host tensor descriptors (the Gluon kernels' TMA), Triton
    3.6's launcher is a Python wrapper (``wrap_handle_tensordesc``'s ``inner``) that
    walks every argument and encodes each descriptor's tensor map from its
    TensorDescriptor on every launch: most of the 26 us by which a Gluon forward's
    launcher (47 us) exceeded the portable kernel's (20) on the H200 (session 22). Here
    the plan calls the compiled launcher under it, each descriptor expanded as the
    wrapper expands it (the tensor map, then the shape and strides, which the plan's key
    fixes) and the map encoded from the call's tensor by the driver function the
    wrapper calls: (launch, template, slot indices, maps) over the expanded argument
    list. None where the wrapper is not the one known here (another Triton): the plan
    then keeps Triton's wrapper."""
    try:
        from triton.backends.nvidia import driver as nvidia
        code = launch.__code__
        if launch.__qualname__ != "wrap_handle_tensordesc.<locals>.inner" \
                or launch.__module__ != nvidia.__name__:
            return None
        free = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
        raw, indices, metas = (free["launcher"], free["tensordesc_indices"],
                               free["tensordesc_meta"])
        fill = triton.runtime.driver.active.utils.fill_tma_descriptor
        to_host = nvidia.TMA_DTYPE_DEVICE_TO_HOST
        expand = nvidia.make_tensordesc_arg
    except (AttributeError, KeyError, ImportError, TypeError):
        return None
    descs = dict(maps)
    order = sorted(indices)
    if order != sorted(descs) or len(metas) != len(order):
        return None
    meta_of = dict(zip(order, metas))
    out, position, encoders = [], [], []
    for i, x in enumerate(template):
        position.append(len(out))
        if i not in descs:
            out.append(x)
            continue
        desc, meta = descs[i], meta_of[i]
        if not isinstance(meta, dict) or meta.get("fp4_padded"):
            return None
        shape, strides = list(desc.shape), list(desc.strides)
        # The wrapper's own expansion of this first call's descriptor must be ours.
        if list(expand(desc, meta)[1:]) != shape + strides:
            return None
        encoders.append((len(out), functools.partial(
            _encode, fill, meta["swizzle"], meta["elem_size"], to_host[meta["elem_type"]],
            meta["block_size"], shape, strides, 1 if desc.padding == "nan" else 0)))
        out += [None, *shape, *strides]
    return raw, out, tuple(position[i] for i in slot_index), tuple(encoders)


def _encode(fill, swizzle, elem_size, elem_type, block, shape, strides, padding, tensor):
    """The tensor map of ``tensor`` (the plan's key fixes everything else)."""
    return fill(tensor.data_ptr(), swizzle, elem_size, elem_type, block, shape, strides,
                padding)


def layout(x):
    """An optional tensor's part of a key: None, or its dtype and strides."""
    return None if x is None else (x.dtype, x.stride())


_data_ptr = torch.Tensor.data_ptr


def pointers(tensors) -> tuple:
    """The tensors' addresses: what a plan passes for them."""
    return tuple(map(_data_ptr, tensors))


def misalignment(addresses):
    """Part of every key: Triton compiles a pointer whose address is a multiple of 16
    into another kernel than one whose address is not. 0 when all are aligned (the
    usual case, one OR), else each address modulo 16."""
    return 0 if not reduce(or_, addresses) & 15 else tuple([p & 15 for p in addresses])


@functools.lru_cache(maxsize=4096)  # a few strides a call, a few us of host time uncached
def spec_class(n: int) -> tuple:
    """What Triton 3.6 compiles an integer argument on: equal to 1, divisible by 16, and
    32 or 64 bits; with its parity (the decode kernel's V_PAIRS reads it). Two values of
    one class launch the same compiled kernel."""
    return n == 1, n % 16 == 0, n % 2 == 0, -2**31 <= n < 2**31


def _contiguous(shape, size):
    """(strides, nbytes): a contiguous tensor of ``shape`` ((batch, m, h, d), or
    (m, h, d) for packed varlen) and ``size``-byte elements, its bytes rounded up to a
    multiple of 16 (what follows it then starts aligned like an allocation of its
    own)."""
    m, h, d = shape[-3:]
    strides = (m * h * d, h * d, d, 1)[4 - len(shape):]
    return strides, -(-shape[0] * strides[0] * size // 16) * 16


def out_with_lse(shape, dtype, n_lse, device):
    """(out, buf, lse_at): one allocation ``buf`` for a launch whose caller does not
    return lse: a contiguous ``out`` of ``shape`` and ``dtype``, a view of its start,
    then ``n_lse`` float32 words for the kernel's lse at byte offset ``lse_at``, 16-byte
    aligned. An allocation is ~7-11 us of host time on the H200, as much as a launch;
    the lse words cost out 4 bytes a row more. (``carve`` for several tensors.)"""
    size = dtype.itemsize
    strides, lse_at = _contiguous(shape, size)
    buf = torch.empty((lse_at + 4 * n_lse) // size, dtype=dtype, device=device)
    return buf.as_strided(shape, strides), buf, lse_at


def carve(shapes, dtype, n_words, device):
    """(views, buf, words_at): ``out_with_lse`` for several tensors: one allocation
    ``buf`` for contiguous tensors of ``shapes`` in ``dtype``, its views in that order
    (the first at buf's start), then ``n_words`` float32 words from byte offset
    ``words_at``; each part 16-byte aligned. A view costs ~1 us here, an allocation
    several on the H200. The views share buf's storage: only where that is allowed
    (not for the outputs of one custom op, which must not alias each other)."""
    size = dtype.itemsize
    views, at = (), 0
    for shape in shapes:
        strides, nbytes = _contiguous(shape, size)
        views += ((shape, strides, at // size),)
        at += nbytes
    buf = torch.empty((at + 4 * n_words) // size, dtype=dtype, device=device)
    return tuple(starmap(buf.as_strided, views)), buf, at


def lse_after(buf, lse_at, shape):
    """The float32 words of a ``carve`` allocation from byte offset ``lse_at`` (lse's
    after ``out_with_lse``'s out, the backward's delta after the gradients) as a tensor
    of ``shape``, for Triton's own launch path (which takes tensors, not addresses).
    From ``buf``, not from a view's ``_base``: views made under torch.inference_mode
    have none."""
    start = lse_at // 4
    return buf.view(torch.float32)[start:start + math.prod(shape)].view(shape)


def first_launch(kernel, grid, args, kwargs, slots=None):
    """``kernel[grid](*args, **kwargs)`` through Triton; with ``slots``, its plan."""
    compiled = kernel[grid](*args, **kwargs)
    return None if slots is None else make(compiled, kernel, args, kwargs, grid, slots)
