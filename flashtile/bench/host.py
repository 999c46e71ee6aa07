"""Host cost of one eager call (``flashtile bench host``): host microseconds per call,
beside PyTorch SDPA on its cuDNN backend and a bare Triton launch.

Eager calls (as Hugging Face models and most user code make them) cost host time for
argument checks, dispatch and kernel launches; with short kernels that host time is the
call's time. Here each call runs ``--calls`` times in a row after a long kernel
(``torch.cuda._sleep``) was enqueued, so the GPU is busy for the whole loop and the
loop's time is the host's alone. A call that waits for the GPU (a host read of a device
tensor) then waits for the sleep to end: its row is marked "synced" (if any of its loops
ended with the GPU idle) and its time is meaningless, so a hidden sync cannot pass for a
fast call.

The host's speed drifts: on the H200 machine two runs a minute apart timed the forward
at 42.9 us beside cuDNN SDPA's 76.6, then at 26.3 beside 37.6, and forward+backward at
572.8 beside 387.7, then 305.4 beside 327.6. Timed one variant's loops after the
other's, such a drift between them moves (and here flips) the ratio that issue 15's
claims rest on. So within a row the variants' loops are interleaved: after one untimed
warm-up loop each, round r times one loop of every variant (flashtile with its launch
plans, flashtile without them, cuDNN SDPA where the row has it), their order rotated by
r so none is always first. The time per call is the median over the ``--rounds``
rounds, and each flashtile row also gives the median over rounds of the per-round ratio
flashtile / cuDNN: loops a few milliseconds apart share the host's speed, so the ratio
holds where the absolute times drift.

Rows (bf16, head_dim 128): flash_attn_func forward (1 x 128 tokens, 8 heads) and
forward+backward (``out.backward``), flash_attn_varlen_func (two sequences), and
flash_attn_with_kvcache at batch 1 over 8k keys (32 query heads over 8 KV heads):
contiguous, paged (pages of 64), and paged with one new token appended. cuDNN SDPA runs
the same shapes (decode with enable_gqa); varlen has no SDPA counterpart. Rows named
"piece" time parts of the calls that ``flashtile.bench.host_cpu`` (the same
calls on a CPU, compiled launches stubbed) cannot: with them a CPU measurement of the
Python converts to this host's time (docs/benchmarks/NOTES.md, "Host path on the CPU,
session 9"). ``--profile ROW`` then runs flashtile's call of each row whose name
contains ROW under cProfile, the GPU kept busy as in the timed loops, and prints the
functions that took the most host time (what the CPU run cannot see: CUDA-side costs
of torch calls on a real device).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
import triton

NHEADS, NHEADS_KV, HEAD_DIM, SEQLEN, DECODE_KEYS, PAGE = 8, 8, 128, 128, 8192, 64
DECODE_HEADS = (32, 8)  # query and KV heads of the decode rows (GQA, as in Llama 3)


@triton.jit
def _empty_kernel(X, n):
    pass


def _timed_loop(fn, calls, sleep_cycles):
    """Host seconds per call over ``calls`` calls of ``fn`` in a row, and whether the GPU
    was still busy when they ended (else a call waited for it). ``sleep_cycles``: a GPU
    sleep enqueued first that keeps the GPU busy through the loop; 0: none (warm-up)."""
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    done = torch.cuda.Event()
    done.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    busy = not done.query()
    torch.cuda.synchronize()
    return elapsed / calls, busy


def _cycles_per_second(device):
    """torch.cuda._sleep's cycles per second on this GPU, measured."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 10_000_000 / (start.elapsed_time(end) / 1e3)


def _cases(device):
    """{row: {provider: fn}} for the table, each fn one eager call."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtile

    bf16 = dict(device=device, dtype=torch.bfloat16)
    q, k, v = (torch.randn(1, SEQLEN, NHEADS, HEAD_DIM, **bf16) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    qtg, ktg, vtg = (x.detach().clone().requires_grad_() for x in (qt, kt, vt))
    dot = do.transpose(1, 2)
    cu = torch.tensor([0, SEQLEN // 4, SEQLEN], dtype=torch.int32, device=device)

    hq, hkv = DECODE_HEADS
    qd = torch.randn(1, 1, hq, HEAD_DIM, **bf16)
    kc, vc = (torch.randn(1, DECODE_KEYS, hkv, HEAD_DIM, **bf16) for _ in "kv")
    seqlens = torch.tensor([DECODE_KEYS - 1], dtype=torch.int32, device=device)
    pages = DECODE_KEYS // PAGE
    pool_k, pool_v = (x.view(pages, PAGE, hkv, HEAD_DIM) for x in (kc, vc))
    table = torch.randperm(pages, device=device).to(torch.int32)[None]
    k_new, v_new = (torch.randn(1, 1, hkv, HEAD_DIM, **bf16) for _ in "kv")
    qdt, kct, vct = qd.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def cudnn(fn):
        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return fn()
        return run

    def fwd_bwd(fn, grad):
        def run():
            fn().backward(grad)
        return run

    return {
        "forward": dict(
            flashtile=lambda: flashtile.flash_attn_func(q, k, v, causal=True),
            sdpa_cudnn=cudnn(lambda: F.scaled_dot_product_attention(qt, kt, vt,
                                                                     is_causal=True))),
        "forward+backward": dict(
            flashtile=fwd_bwd(lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True), do),
            sdpa_cudnn=fwd_bwd(cudnn(lambda: F.scaled_dot_product_attention(
                qtg, ktg, vtg, is_causal=True)), dot)),
        "varlen forward": dict(
            flashtile=lambda: flashtile.flash_attn_varlen_func(
                q[0], k[0], v[0], cu, cu, SEQLEN * 3 // 4, SEQLEN * 3 // 4, causal=True)),
        "decode, contiguous 8k": dict(
            flashtile=lambda: flashtile.flash_attn_with_kvcache(
                qd, kc, vc, cache_seqlens=seqlens, causal=True),
            sdpa_cudnn=cudnn(lambda: F.scaled_dot_product_attention(qdt, kct, vct,
                                                                     enable_gqa=True))),
        "decode, paged 8k": dict(
            flashtile=lambda: flashtile.flash_attn_with_kvcache(
                qd, pool_k, pool_v, cache_seqlens=seqlens, block_table=table, causal=True)),
        "decode, paged 8k + append": dict(
            flashtile=lambda: flashtile.flash_attn_with_kvcache(
                qd, pool_k, pool_v, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                causal=True)),
        "bare Triton launch": dict(triton=lambda: _empty_kernel[(1,)](seqlens, 1)),
        **_pieces(q, k, v, qg, kg, vg, do, (qd, pool_k, pool_v, seqlens, table)),
    }


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.detach(), k.detach(), v.detach()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return dq, dk, dv


class _CallInBackward(torch.autograd.Function):
    """Identity whose backward first calls ``fn`` (where autograd runs a backward: on
    the CUDA device's worker thread), so that its piece minus the identity Function's
    is ``fn``'s host time there."""

    @staticmethod
    def forward(ctx, fn, q, k, v):
        ctx.fn = fn
        return q.detach(), k.detach(), v.detach()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.fn()
        return None, dq, dk, dv


def _pieces(q, k, v, qg, kg, vg, do, paged):
    """Rows that time the parts of a call the CPU harness (``flashtile.bench.host_cpu``)
    cannot: one CUDA allocation, the forward and paged decode launchers with and
    without their compiled launches, and the autograd engine's backward through a
    Python Function that launches nothing, beside the same through C++ view nodes (the
    difference is the Python node's own cost); the portable backward's launcher
    (``ops.bwd.attn_bwd``) on the main thread, and inside such a Function's backward,
    where autograd runs it (session 14 found ~70-100 us of the H200's eager backward
    that the CPU harness's count of its Python does not explain).
    ``paged``: q, the pools, cache_seqlens and block_table of the paged decode row."""
    from flashtile.custom_ops import _gluon_fwd
    from flashtile.ops import bwd, decode, fwd

    kw = dict(attn_mask=None, alibi_slopes=None, softmax_scale=HEAD_DIM ** -0.5,
              diag_offset=0, window_left=-1, window_right=0, softcap=0.0,
              allow_tf32=False)

    qd, pool_k, pool_v, seqlens, table = paged
    decode_kw = dict(cache_seqlens=seqlens, block_table=table, cache_batch_idx=None,
                     cache_leftpad=None, alibi_slopes=None,
                     softmax_scale=HEAD_DIM ** -0.5, window_left=-1, window_right=0,
                     softcap=0.0, num_splits=0, allow_tf32=False)

    def without_launch(fn):
        def run():
            with _plans_without_launch():
                return fn()
        return run

    def forward():
        return fwd.attn_fwd(q, k, v, **kw)

    def paged_decode():
        return decode.attn_decode(qd, pool_k, pool_v, **decode_kw)

    out, lse = forward()

    def backward_launcher():
        return bwd.attn_bwd(do, q, k, v, out, lse, None, **kw)

    def backward_launcher_in_engine():
        outs = _CallInBackward.apply(backward_launcher, qg, kg, vg)
        torch.autograd.backward(outs, (do, do, do))

    # The Gluon forward (sm_90; FLASHTILE_HOPPER_FWD=auto takes it from 128 queries at
    # head dim 128; its plans encode four tensor maps a call): its launcher beside the
    # portable one's at 1k queries.
    q1k, k1k, v1k = (torch.randn(1, 1024, NHEADS, HEAD_DIM, dtype=q.dtype, device=q.device)
                     for _ in range(3))
    gluon = {}
    fwd_hopper = _gluon_fwd()  # None with a triton before Gluon
    if fwd_hopper is not None and fwd_hopper.unsupported(q1k, k1k, v1k, **kw) is None:
        gluon = {
            "piece: forward launcher, 1k queries (portable)": dict(
                piece=lambda: fwd.attn_fwd(q1k, k1k, v1k, **kw)),
            "piece: forward launcher, 1k queries (Gluon, ops.fwd_hopper)": dict(
                piece=lambda: fwd_hopper.attn_fwd(q1k, k1k, v1k, **kw)),
        }

    def engine():
        outs = _Identity.apply(qg, kg, vg)
        torch.autograd.backward(outs, (do, do, do))

    def engine_cpp():
        # The same backward through C++ view nodes: the engine's device-thread hand-off
        # and the three gradient accumulations without a Python node, which is what
        # cuDNN SDPA's backward pays besides its kernels.
        outs = (qg.view_as(qg), kg.view_as(kg), vg.view_as(vg))
        torch.autograd.backward(outs, (do, do, do))

    return {
        "piece: torch.empty (one CUDA allocation)": dict(piece=lambda: torch.empty(
            q.shape, dtype=q.dtype, device=q.device)),
        "piece: forward launcher (ops.fwd.attn_fwd)": dict(piece=forward),
        "piece: forward launcher, compiled launch a no-op": dict(
            piece=without_launch(forward)),
        "piece: paged decode launcher (ops.decode.attn_decode)": dict(piece=paged_decode),
        "piece: paged decode launcher, compiled launches no-ops": dict(
            piece=without_launch(paged_decode)),
        "piece: autograd engine, identity Function backward": dict(piece=engine),
        "piece: autograd engine, the same through C++ view nodes": dict(piece=engine_cpp),
        "piece: backward launcher (ops.bwd.attn_bwd), main thread": dict(
            piece=backward_launcher),
        "piece: the same inside the identity Function's backward": dict(
            piece=backward_launcher_in_engine),
        **gluon,
    }


class _plans_without_launch:
    """Every stored plan's compiled launcher replaced by a no-op for the block."""

    def __enter__(self):
        from flashtile.ops import _launch

        self.saved = [(p, p.launch) for plans in _launch._plans.values()
                      for p in (plans if isinstance(plans, tuple) else (plans,))
                      if isinstance(p, _launch.Plan)]
        for p, _ in self.saved:
            p.launch = _no_launch

    def __exit__(self, *exc):
        for p, launch in self.saved:
            p.launch = launch


def _no_launch(*args):
    pass


def _variants(providers):
    """A row's timed variants as (label, fn, plans): flashtile with its launch plans and
    through Triton's own launch path (``_launch.set_enabled(False)``, the A/B of issue
    15), every other provider once."""
    variants = []
    for provider, fn in providers.items():
        variants.append((provider, fn, True))
        if provider == "flashtile":
            variants.append(("flashtile, no plans", fn, False))
    return variants


def time_row(call, providers, calls, rounds, cycles_per_s):
    """Rows of {"call", "provider", "host_us", "gpu_busy"} for one call's providers
    ({provider: fn}), the variants' loops interleaved in rotating order (module
    docstring). Where the call has an "sdpa_cudnn" provider, flashtile's rows get
    "vs_cudnn": the median over rounds of the per-round ratio of their host time to
    cuDNN's (None if either raised). A variant whose call raises RuntimeError (e.g.
    cuDNN SDPA refuses a shape) gets host_us None and "error" and leaves the rounds; the
    others go on."""
    from flashtile.ops import _launch

    variants = _variants(providers)
    rows = {label: dict(call=call, provider=label) for label, _, _ in variants}
    us = {label: [] for label in rows}  # host us per call, one a round
    busy = dict.fromkeys(rows, True)
    sleep_cycles, failed = {}, set()

    def loop(label, fn, plans, n, cycles):
        """One _timed_loop of the variant; None (the variant failed) if a call raised."""
        previous = _launch.set_enabled(plans)
        try:
            return _timed_loop(fn, n, cycles)
        except RuntimeError as err:
            rows[label].update(host_us=None, error=str(err).splitlines()[0][:120])
            failed.add(label)
            return None
        finally:
            _launch.set_enabled(previous)

    for label, fn, plans in variants:
        # Compile, make launch plans, warm the allocator; then an unhindered loop sizes
        # the variant's GPU sleep: twice the loop's host time plus 20 ms.
        warm = loop(label, fn, plans, 3, 0) and loop(label, fn, plans, calls, 0)
        if warm:
            sleep_cycles[label] = int((2 * warm[0] * calls + 0.02) * cycles_per_s)
    for r in range(rounds):
        shift = r % len(variants)
        for label, fn, plans in variants[shift:] + variants[:shift]:
            if label in failed:
                continue
            timed = loop(label, fn, plans, calls, sleep_cycles[label])
            if timed:
                us[label].append(timed[0] * 1e6)
                busy[label] &= timed[1]
    for label in rows.keys() - failed:
        rows[label].update(host_us=round(statistics.median(us[label]), 2),
                           gpu_busy=busy[label])
    if "sdpa_cudnn" in rows:
        for label in rows.keys() & {"flashtile", "flashtile, no plans"}:
            ratios = [a / b for a, b in zip(us[label], us["sdpa_cudnn"])]
            rows[label]["vs_cudnn"] = (None if failed & {label, "sdpa_cudnn"} else
                                       round(statistics.median(ratios), 3))
    return list(rows.values())


def run(calls=50, rounds=9, device=None):
    """time_row's rows for every call of the table, in its order (host_us None: n/a,
    with "error")."""
    device = torch.device(device or "cuda")
    cycles_per_s = _cycles_per_second(device)
    return [row for call, providers in _cases(device).items()
            for row in time_row(call, providers, calls, rounds, cycles_per_s)]


def markdown(rows) -> str:
    table, vs_cudnn = {}, {}
    for r in rows:
        cell = ("n/a" if r["host_us"] is None else
                f"{r['host_us']:.1f}" + ("" if r["gpu_busy"] else " (synced)"))
        table.setdefault(r["call"], {})[r["provider"]] = cell
        if r["provider"] == "flashtile" and "vs_cudnn" in r:
            vs_cudnn[r["call"]] = "n/a" if r["vs_cudnn"] is None else f"{r['vs_cudnn']:.2f}"
    lines = ["| call | flashtile (us) | flashtile, no plans (us) | cuDNN SDPA (us) "
             "| flashtile / cuDNN (median of per-round ratios) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    bare = table.pop("bare Triton launch", {}).get("triton", "n/a")
    pieces = {call: cells.pop("piece") for call, cells in table.items() if "piece" in cells}
    for call, cells in table.items():
        if call in pieces:
            continue
        lines.append(f"| {call} | {cells.get('flashtile', '-')} | "
                     f"{cells.get('flashtile, no plans', '-')} | "
                     f"{cells.get('sdpa_cudnn', '-')} | {vs_cudnn.get(call, '-')} |")
    text = "\n".join(lines) + "\n\nA bare Triton launch (Triton's own path, 2 " \
        f"arguments): {bare} us."
    if pieces:
        text += "\n\n| piece of a call | us |\n| --- | ---: |\n" + "\n".join(
            f"| {call[len('piece: '):]} | {cell} |" for call, cell in pieces.items())
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="flashtile bench host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=50, help="calls per timed loop (each "
                   "enqueues up to ~8 launches; CUDA queues about a thousand)")
    p.add_argument("--rounds", type=int, default=9, help="rounds, each one timed "
                   "loop of every variant of a row (median over rounds)")
    p.add_argument("--out", help="folder for host.md and host.json; default "
                   "bench-results/<date>-<device>/")
    p.add_argument("--profile", metavar="ROW", help="after the table, cProfile flashtile's "
                   "call of each row whose name contains ROW (e.g. decode) and print its "
                   "most expensive functions")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("flashtile bench host: needs a CUDA device (it times eager calls while the "
              "GPU is busy); none is available here", file=sys.stderr)
        return 2
    from flashtile.bench import commands, machine

    device = torch.device("cuda")
    rows = run(args.calls, args.rounds, device)
    text = markdown(rows)
    print(text)
    out = args.out or commands.default_out(device)
    os.makedirs(out, exist_ok=True)
    command = " ".join(["flashtile", "bench", "host", *(argv if argv is not None
                                                         else sys.argv[1:])])
    with open(os.path.join(out, "host.md"), "w") as f:
        f.write(f"Command: `{command}`\n\n{text}\n")
    with open(os.path.join(out, "host.json"), "w") as f:
        json.dump(dict(rows=rows, calls=args.calls, rounds=args.rounds,
                       info=machine.machine_info(device, command)), f, indent=1)
    print(f"wrote {out}/host.md and host.json")
    if args.profile:
        for call, fns in _cases(device).items():
            if args.profile in call and "flashtile" in fns:
                print(f"\n{call}: cProfile of {args.rounds} x {args.calls} calls, GPU busy")
                profile(fns["flashtile"], args.calls, args.rounds)
    return 0


def profile(fn, calls, rounds, top=25):
    """cProfile of ``rounds`` busy loops of ``calls`` calls (after a warm-up): the
    ``top`` functions by their own time, and by cumulative time, printed."""
    cycles_per_s = _cycles_per_second(torch.device("cuda"))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    for _ in range(rounds):
        # The sleep outlasts the loop (a 50-call loop runs in well under 50 ms here).
        torch.cuda._sleep(int(0.2 * cycles_per_s))
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


if __name__ == "__main__":
    sys.exit(main())
