"""Where does a batch-1 decode step's time go? Kernel start/end times under CUDA-graph replay.

For (1, 8k) keys (bf16, 32/8 heads, d128), the contiguous cache and pages of 64 and 16, with
the combine kernel a dependent launch or not (FLASHTILE_DECODE_PDL): the step period, the
decode kernel's duration, and the time from the decode's end to the combine's end (with a
dependent launch the combine starts before the decode ends and waits). Kernel times come
from the profiler's trace (CUPTI), 40 steps captured in one graph, the middle 30 read.
Then the floor: an empty kernel's duration, and the combine kernel alone per warp count.

Run on the GPU: PYTHONPATH=. python3 benchmarks/profile_decode.py
"""
import json
import os
import statistics
import tempfile

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from flashtile.bench.decode import _decode_inputs, _kvcache_fn, _paged_pool

STEPS = 40


def kernel_spans(fn):
    """[(name, start_us, end_us)] of the GPU kernels of STEPS graph-replayed calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(STEPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    spans = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(spans, key=lambda s: s[1])


def summarize(spans):
    decodes = [s for s in spans if "_decode_kernel" in s[0]]
    combines = [s for s in spans if "_combine_kernel" in s[0]]
    if len(decodes) != STEPS or len(combines) != STEPS:
        return dict(error=f"{len(decodes)} decode and {len(combines)} combine kernels seen")
    mid = slice(5, STEPS - 5)
    d, c = decodes[mid], combines[mid]
    period = (d[-1][1] - d[0][1]) / (len(d) - 1)
    return dict(period_us=period,
                decode_us=statistics.median(e - s for _, s, e in d),
                combine_us=statistics.median(e - s for _, s, e in c),
                decode_end_to_combine_end_us=statistics.median(
                    ce - de for (_, _, de), (_, _, ce) in zip(d, c)),
                combine_end_to_next_decode_start_us=statistics.median(
                    nd - ce for (_, _, ce), (_, nd, _) in zip(c, d[1:])))


@triton.jit
def _empty_kernel(X):
    pass


def floor_spans():
    """The duration of a kernel that does nothing (grid 32, as the combine at (1, 8k)),
    and of the combine kernel itself at 1, 2, 4 and 8 warps, graph-replayed."""
    from flashtile.ops.decode import _combine_kernel

    x = torch.empty(1, device="cuda")
    spans = kernel_spans(lambda: _empty_kernel[(32,)](x))
    print(f"empty kernel: {statistics.median(e - s for _, s, e in spans[5:-5]):.2f} us")
    splits, h, d = 32, 32, 128
    part = torch.randn(splits, 1, 1, h, d, device="cuda")
    part_lse = torch.randn(splits, 1, h, 1, device="cuda")
    out = torch.empty(1, 1, h, d, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(1, h, 1, device="cuda")
    for warps in (1, 2, 4, 8):
        spans = kernel_spans(lambda: _combine_kernel[(h,)](
            part, part_lse, out, lse, *part.stride()[:4], *part_lse.stride()[:3],
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            splits, h, 1, d, BLOCK_S=32, BLOCK_D=128, USE_PDL=False, num_warps=warps))
        print(f"combine alone, {warps} warps: "
              f"{statistics.median(e - s for _, s, e in spans[5:-5]):.2f} us", flush=True)


def main():
    q, k, v, seqlens = _decode_inputs(1, 8192, "cuda")
    caches = {"contiguous": (k, v, None), "paged64": _paged_pool(k, v, 64),
              "paged16": _paged_pool(k, v, 16)}
    for mode in ("1", "0"):
        os.environ["FLASHTILE_DECODE_PDL"] = mode
        for name, cache in caches.items():
            row = summarize(kernel_spans(_kvcache_fn(q, seqlens, *cache)))
            print(f"pdl={mode} {name}: " + ", ".join(
                f"{key} {val:.2f}" if isinstance(val, float) else f"{key} {val}"
                for key, val in row.items()), flush=True)
    os.environ.pop("FLASHTILE_DECODE_PDL")
    floor_spans()


if __name__ == "__main__":
    main()
