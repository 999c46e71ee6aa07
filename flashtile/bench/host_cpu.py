"""The host path of eager calls on a machine without a GPU (``python -m
flashtile.bench.host_cpu``): the rows of ``flashtile bench host``, run through the real
Python of flashtile (validation, dispatch, autograd, allocations, launch-plan keys and
lookups) with only the compiled kernels' launchers replaced by a no-op.

What a CPU run cannot show, and what an earlier simulation with the launches stubbed
higher up also hid (docs/benchmarks/NOTES.md, "Host path on the CPU, session 9"): the
C launcher and the driver's launch, CUDA allocations (the caching allocator and its
device guard, dearer than a CPU ``torch.empty``), and, for forward+backward, the
autograd engine's hand-off to the CUDA device's worker thread. So the table also
counts, per call, what those costs scale with: kernel launches, tensor allocations and
other torch operators, and Python function calls.

Stand-ins (restored on exit): each Triton kernel is an object that takes the launch
and returns a compiled kernel whose launcher does nothing, so launch plans are made
and used as on the GPU (a Gluon kernel's behind Triton's descriptor wrapper, its tensor
maps "encoded" by a fake driver); the device counts as sm_90, so forwards take the
Gluon kernel where the H200 does; ``_launch.ready`` accepts CPU tensors; the current device and
stream are 0; the split-KV heuristic sees the H200's 132 SMs (on the GPU it asks the
device), so the decode rows split and combine as they do there. TRITON_INTERPRET=1 is
set for the run so that CPU tensors select the Triton backend (the interpreter itself
never runs). Inputs are float16: the backend refuses bfloat16 under the interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import os
import pstats
import sys
import timeit

import torch

from flashtile.bench.host import DECODE_HEADS, DECODE_KEYS, HEAD_DIM, NHEADS, PAGE, SEQLEN

H200_SMS = 132
_HERE = os.path.abspath(__file__)
# torch operators that allocate a tensor (the rest are views or in-place).
_ALLOCATING = ("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::zeros",
               "aten::zeros_like", "aten::full", "aten::new_empty", "aten::new_zeros",
               "aten::clone")


class _Counter:
    launches = 0
    unplanned = 0  # of them through Triton's own path (no launch plan)


def _no_launch(*args):
    _Counter.launches += 1


class _Launcher:
    """A CompiledKernel's ``run``, as ``_launch.make`` reads it."""
    launch_cooperative_grid = launch_pdl = False
    global_scratch_size = profile_scratch_size = 0
    launch = staticmethod(_no_launch)


class _Compiled:
    packed_metadata = function = None
    run = _Launcher()


class _Kernel:
    """Stands for a JITFunction: ``kernel[grid](...)`` counts a launch, returns a
    compiled kernel. For a kernel that takes tensor descriptors (the Gluon kernels) the
    compiled kernel's launcher is Triton's own descriptor wrapper around the no-op, as
    on the GPU, so that plans take the same path as there (``_launch._tensormap_launch``)."""

    def __init__(self, real):
        self.arg_names = list(inspect.signature(real.fn).parameters)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            _Counter.launches += 1
            _Counter.unplanned += 1
            from flashtile.ops import _launch

            bound = [*args, *(kwargs[n] for n in self.arg_names[len(args):])]
            is_desc = [_launch._is_descriptor(x) for x in bound]
            return _described(self.arg_names, bound, is_desc) if any(is_desc) \
                else _Compiled()
        return run


def _described(names, bound, is_desc):
    """A compiled kernel whose launcher is Triton's descriptor wrapper over the no-op,
    with each descriptor's metadata (the fake driver's encoder ignores its values)."""
    from triton.backends.nvidia import driver as nvidia

    signature = {n: "tensordesc" if d else "i32" for n, d in zip(names, is_desc)}
    metas = [dict(swizzle=3, elem_size=x.base.element_size(), elem_type=6,
                  block_size=list(x.block_shape), fp4_padded=False)
             for x, d in zip(bound, is_desc) if d]

    class Run(_Launcher):
        launch = staticmethod(nvidia.wrap_handle_tensordesc(_no_launch, signature, metas))

    compiled = _Compiled()
    compiled.run = Run()
    return compiled


class _FakeUtils:
    """The driver's tensor-map encoder, as cheap as a C call can be."""

    @staticmethod
    def fill_tma_descriptor(*args):
        return args


class _FakeDriver:
    utils = _FakeUtils()


@contextlib.contextmanager
def stubbed_launches():
    """The stand-ins of the module docstring, for the duration of the block."""
    import triton

    from flashtile import custom_ops
    from flashtile.ops import _launch, bwd, combine, decode, fwd, fwd_hopper

    saved = []

    def put(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for module in (fwd, bwd, decode, combine, fwd_hopper):
        for name, obj in list(vars(module).items()):
            if hasattr(obj, "fn") and hasattr(obj, "__getitem__"):  # a Triton kernel
                put(module, name, _Kernel(obj))
    heuristic = decode.num_splits_heuristic
    put(decode, "num_splits_heuristic",
        lambda work, capacity, block_n, num_sms, per_sm=2: heuristic(
            work, capacity, block_n, H200_SMS, per_sm))
    # The forward's route on the H200: the Gluon kernel (16-bit, head dim 128, from 128
    # queries), its persistent grid over 132 SMs.
    put(fwd_hopper, "_on_hopper", lambda device: True)
    put(fwd_hopper, "_num_sms", lambda device: H200_SMS)
    put(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has none
    put(triton.runtime.driver, "_active", _FakeDriver())
    put(_launch, "ready", lambda x: True)
    put(_launch, "_device", lambda: 0)
    put(_launch, "_stream", lambda device: 0)
    interpret = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _launch.clear()
    custom_ops._GLUON_LAYOUTS.clear()  # answers for the sm_90 stand-in stay inside
    try:
        yield
    finally:
        _launch.clear()
        custom_ops._GLUON_LAYOUTS.clear()
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
        if interpret is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = interpret


def cases():
    """{row: fn}, the flashtile rows of ``flashtile bench host`` on CPU tensors."""
    import flashtile

    half = dict(dtype=torch.float16)
    q, k, v = (torch.randn(1, SEQLEN, NHEADS, HEAD_DIM, **half) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    cu = torch.tensor([0, SEQLEN // 4, SEQLEN], dtype=torch.int32)
    q1, k1, v1 = q[0], k[0], v[0]
    hq, hkv = DECODE_HEADS
    qd = torch.randn(1, 1, hq, HEAD_DIM, **half)
    kc, vc = (torch.randn(1, DECODE_KEYS, hkv, HEAD_DIM, **half) for _ in "kv")
    seqlens = torch.tensor([DECODE_KEYS - 1], dtype=torch.int32)
    pages = DECODE_KEYS // PAGE
    pool_k, pool_v = (x.view(pages, PAGE, hkv, HEAD_DIM) for x in (kc, vc))
    table = torch.randperm(pages).to(torch.int32)[None]
    k_new, v_new = (torch.randn(1, 1, hkv, HEAD_DIM, **half) for _ in "kv")

    def forward_backward():
        # On the GPU the gradients accumulate (three add_ launches); here they are
        # dropped first, so the CPU does not time the additions themselves.
        qg.grad = kg.grad = vg.grad = None
        flashtile.flash_attn_func(qg, kg, vg, causal=True).backward(do)

    return {
        "forward": lambda: flashtile.flash_attn_func(q, k, v, causal=True),
        "forward+backward": forward_backward,
        "varlen forward": lambda: flashtile.flash_attn_varlen_func(
            q1, k1, v1, cu, cu, SEQLEN * 3 // 4, SEQLEN * 3 // 4, causal=True),
        "decode, contiguous 8k": lambda: flashtile.flash_attn_with_kvcache(
            qd, kc, vc, cache_seqlens=seqlens, causal=True),
        "decode, paged 8k": lambda: flashtile.flash_attn_with_kvcache(
            qd, pool_k, pool_v, cache_seqlens=seqlens, block_table=table, causal=True),
        "decode, paged 8k + append": lambda: flashtile.flash_attn_with_kvcache(
            qd, pool_k, pool_v, k_new, v_new, cache_seqlens=seqlens, block_table=table,
            causal=True),
    }


def counts(fn) -> dict:
    """Per call of ``fn``: kernel launches (and of them those through Triton's own
    path: none once the plans are made), torch operators (allocating ones apart, views
    and in-place ops included; nested operators not counted), Python function calls
    (cProfile's count, C functions included) and of those the calls of flashtile's own
    functions (independent of the torch version)."""
    from torch.profiler import ProfilerActivity, profile

    _Counter.launches = _Counter.unplanned = 0
    fn()
    launches, unplanned = _Counter.launches, _Counter.unplanned
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = [e.name for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    allocs = sum(name in _ALLOCATING for name in ops)
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    stats = pstats.Stats(profiler)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own = sum(calls for (path, _, _), (_, calls, *_) in stats.stats.items()
              if path.startswith(package) and not path.startswith(_HERE))
    return dict(launches=launches, unplanned=unplanned, allocations=allocs,
                other_ops=len(ops) - allocs,
                python_calls=stats.total_calls, flashtile_calls=own)


def run(rows=None, number=2000, repeat=7):
    """[{call, us, launches, unplanned, allocations, other_ops, python_calls,
    flashtile_calls}]:
    us is the best of ``repeat`` loops of ``number`` calls (the least disturbed by
    other processes)."""
    results = []
    with stubbed_launches():
        for name, fn in cases().items():
            if rows and not any(r in name for r in rows):
                continue
            for _ in range(3):  # make the plans
                fn()
            us = min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6
            results.append(dict(call=name, us=round(us, 1), **counts(fn)))
    return results


def markdown(results) -> str:
    lines = ["| call | CPU us | launches | allocations | other torch ops | Python calls "
             "| of them flashtile's |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['call']} | {r['us']:.1f} | {r['launches']} | "
                     f"{r['allocations']} | {r['other_ops']} | {r['python_calls']} | "
                     f"{r['flashtile_calls']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashtile.bench.host_cpu",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", help="only the rows whose name contains one of these")
    p.add_argument("--number", type=int, default=2000, help="calls per timed loop")
    p.add_argument("--repeat", type=int, default=7, help="timed loops (best is kept)")
    p.add_argument("--profile", metavar="ROW", help="print cProfile's top functions "
                   "(own time) for the first row whose name contains ROW")
    args = p.parse_args(argv)
    print(markdown(run(args.rows, args.number, args.repeat)))
    if args.profile:
        with stubbed_launches():
            fn = next(f for name, f in cases().items() if args.profile in name)
            for _ in range(3):
                fn()
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [fn() for _ in range(500)])
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
