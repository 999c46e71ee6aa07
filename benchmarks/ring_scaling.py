"""Ring attention on several GPUs: a correctness check, then a scaling table.

    PYTHONPATH=. torchrun --nproc-per-node 8 benchmarks/ring_scaling.py
    PYTHONPATH=. torchrun --nproc-per-node 8 benchmarks/ring_scaling.py --worlds 2 4 8 \
        --seqlens 131072 524288 --json ring.json
    PYTHONPATH=. python benchmarks/ring_scaling.py --dry-run   # 2 gloo CPU processes

One launch measures rings of every size in --worlds (default 1, 2, 4, ... up to the number
of processes) on sub-groups of the launched ranks; ranks outside a ring wait at a barrier.

Each row is one forward+backward step of ``ring_flash_attn_func`` on a sequence of
``seqlen`` tokens in total (batch 1, bf16, nheads 32 over 8 KV heads, head_dim 128;
causal uses the zig-zag layout, non-causal the contiguous one):

- ``T_ring``: the step's wall time, median over --reps after --warmup steps, the slowest
  rank (max over the ring).
- ``TFLOP/s/GPU``: 4 * h * S^2 * d * 3.5 (x0.5 causal) / world / T_ring; the same FLOP
  count as benchmarks/bench_attention.py.
- ``T_share``: T_1gpu(work/world), the time one GPU takes for one rank's share of the work
  with no communication: every rank runs its own kernel calls and merges of the whole
  ring (the same plan, masks and shapes) while keeping its own K/V instead of passing it
  on; the largest over the ranks. ``efficiency = T_share / T_ring``: 1.0 means the
  K/V and dK/dV transfers are hidden entirely behind the compute.
- ``scaling``: T_ring(world 1) / (world * T_ring), when world 1 was measured (one GPU on
  the whole sequence; only up to --max-single tokens, 128k by default: at 512k one step
  is ~40 s non-causal).

Run time on 8 H200s with the defaults (warm-up 1, reps 2, ring and share timed): about
6 minutes, most of it at 512k on 2 GPUs (~20 s a step non-causal). ``--worlds 4 8`` or
``--seqlens 131072`` for a shorter run.

Before timing, every ring size is checked at a small size (4096 tokens, 8/2 heads) against
the float64 naive attention with the project's accuracy rule (error <= 2x PyTorch's own
bf16 error + 1.5e-2) on out, dq, dk, dv; the script exits nonzero if a check fails.
"""

import os

# No NVLink SHARP multicast on the lent machines (see the device notes): set before NCCL
# or symmetric memory initialize.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flashtile import distributed as fd  # noqa: E402
from flashtile._ring import Ready, RingAttention  # noqa: E402
from flashtile.reference import attention_naive  # noqa: E402

FLOOR = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def attn_flops(seqlen, nheads, head_dim, causal, batch=1):
    return 4 * batch * nheads * seqlen * seqlen * head_dim * 3.5 * (0.5 if causal else 1.0)


def _layout(causal):
    return "zigzag" if causal else "contiguous"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _OwnShareRing:
    """The ring's schedule for one rank with no transfer: K/V never leave home."""

    def __init__(self, group):
        self.world = dist.get_world_size(group)
        self.ranks = (dist.get_rank(group),)

    def shift(self, buffers, tag):
        return Ready(buffers)


def check(group, device, dtype, seqlen, nheads, nheads_kv, head_dim):
    """Ring vs float64 naive attention on the full sequence; True if within the rule."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ok = True
    for causal in (True, False):
        layout = _layout(causal)
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(1, seqlen, n, head_dim, device=device, dtype=dtype,
                                     generator=gen)
                         for n in (nheads, nheads_kv, nheads_kv, nheads))
        mine = [fd.split(x, world, rank, layout).clone().requires_grad_()
                for x in (q, k, v)]
        out = fd.ring_flash_attn_func(*mine, group=group, causal=causal, layout=layout)
        grads = torch.autograd.grad(out, mine, fd.split(dout, world, rank, layout))
        errs = {}
        for upcast in (True, False):
            xs = [(x.double() if upcast else x).requires_grad_() for x in (q, k, v)]
            ref, _ = attention_naive(*xs, causal=causal, upcast=upcast)
            ref_grads = torch.autograd.grad(ref, xs, dout.to(ref.dtype))
            for name, r in zip(("out", "dq", "dk", "dv"), (ref, *ref_grads)):
                errs.setdefault(name, []).append(fd.split(r, world, rank, layout))
        for name, ours in zip(("out", "dq", "dk", "dv"), (out, *grads)):
            r64, r_pt = errs[name]
            e_ours = (ours.double() - r64).abs().max().item()
            e_torch = (r_pt.double() - r64).abs().max().item()
            bound = 2 * e_torch + FLOOR[dtype]
            if e_ours > bound:
                ok = False
                print(f"# CHECK FAILED world={world} rank={rank} causal={causal} {name}: "
                      f"{e_ours:.3g} > {bound:.3g}", flush=True)
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, group=group)
    return flag.item() == 0


def _time_steps(step, group, device, warmup, reps):
    times = []
    for i in range(warmup + reps):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.item()


def measure(group, device, dtype, seqlen, nheads, nheads_kv, head_dim, causal, warmup,
            reps):
    """(T_ring, T_share) in seconds for one forward+backward step."""
    world = dist.get_world_size(group)
    layout = _layout(causal)
    local = seqlen // world
    q, k, v, dout = (torch.randn(1, local, n, head_dim, device=device, dtype=dtype)
                     for n in (nheads, nheads_kv, nheads_kv, nheads))
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def ring_step():
        out = fd.ring_flash_attn_func(q, k, v, group=group, causal=causal, layout=layout)
        torch.autograd.grad(out, (q, k, v), dout)

    # The ring's own config and autograd Function, driven by a ring that never sends.
    cfg = fd._config(q, k, v, causal, None, (-1, -1), 0.0, layout, world)
    own = _OwnShareRing(group)

    def share_step():
        out, _ = RingAttention.apply(own, cfg, q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    t_ring = _time_steps(ring_step, group, device, warmup, reps)
    if world == 1:  # nothing to send: the share is the ring
        return t_ring, t_ring
    return t_ring, _time_steps(share_step, group, device, warmup, reps)


def run(args):
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    n_proc, rank = dist.get_world_size(), dist.get_rank()
    worlds = args.worlds or [w for w in (1, 2, 4, 8, 16, 32) if w <= n_proc]
    if any(w > n_proc for w in worlds):
        raise SystemExit(f"--worlds {worlds}: at most {n_proc} processes were launched")
    groups = {w: dist.new_group(list(range(w))) for w in worlds}  # every rank calls it
    if rank == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(f"# {n_proc} x {name}, torch {torch.__version__}, {dist.get_backend()}, "
              f"{dtype}, nheads {args.nheads}/{args.nheads_kv}, head_dim {args.head_dim}",
              flush=True)

    failed = False
    for w in worlds:
        if rank < w:
            ok = check(groups[w], device, dtype, args.check_seqlen, args.check_nheads,
                       args.check_nheads_kv, args.head_dim)
            if rank == 0:
                print(f"# check world={w}: {'ok' if ok else 'FAILED'}", flush=True)
            failed |= not ok
        dist.barrier()
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    dist.all_reduce(flag)
    if flag.item():
        return 1

    rows = []
    for seqlen in args.seqlens:
        for causal in args.causal:
            base = None
            for w in worlds:
                if seqlen % (2 * w) or (w == 1 and seqlen > args.max_single):
                    continue
                if rank < w:
                    t_ring, t_share = measure(groups[w], device, dtype, seqlen, args.nheads,
                                              args.nheads_kv, args.head_dim, causal,
                                              args.warmup, args.reps)
                    if w == 1:
                        base = t_ring
                    row = dict(seqlen=seqlen, causal=causal, world=w,
                               t_ring_ms=t_ring * 1e3, t_share_ms=t_share * 1e3,
                               efficiency=t_share / t_ring,
                               tflops_per_gpu=attn_flops(seqlen, args.nheads, args.head_dim,
                                                         causal) / w / t_ring / 1e12,
                               scaling=base / (w * t_ring) if base else None)
                    if rank == 0:
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if rank == 0:
        print("\n| seqlen | causal | world | T_ring (ms) | TFLOP/s/GPU | T_share (ms) | "
              "efficiency | scaling |")
        print("|---" * 8 + "|")
        for r in rows:
            scaling = "n/a" if r["scaling"] is None else f"{r['scaling']:.2f}"
            print(f"| {r['seqlen']} | {r['causal']} | {r['world']} | "
                  f"{r['t_ring_ms']:.1f} | {r['tflops_per_gpu']:.1f} | "
                  f"{r['t_share_ms']:.1f} | {r['efficiency']:.2f} | {scaling} |")
        print("\nefficiency = T_share / T_ring, T_share = one GPU's share of the work "
              "with no communication; scaling = T_ring(1) / (world * T_ring).")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="2 gloo processes on CPU, tiny sizes (checks the script itself)")
    ap.add_argument("--worlds", type=int, nargs="+", help="ring sizes to measure")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"),
                    nargs="+", default=[True, False])
    ap.add_argument("--nheads", type=int, default=32)
    ap.add_argument("--nheads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--check-seqlen", type=int, default=4096)
    ap.add_argument("--check-nheads", type=int, default=8)
    ap.add_argument("--check-nheads-kv", type=int, default=2)
    ap.add_argument("--max-single", type=int, default=131072,
                    help="measure world 1 (one GPU, whole sequence) only up to this seqlen")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.seqlens, args.nheads, args.nheads_kv, args.head_dim = [64], 4, 2, 16
        args.check_seqlen, args.check_nheads, args.check_nheads_kv = 32, 4, 2
        args.warmup, args.reps = 1, 2
    return args


def _dry_run_worker(rank, world, port, argv):
    os.environ["FLASHTILE_BACKEND"] = "torch"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        code = run(parse_args(argv))
    finally:
        dist.destroy_process_group()
    if code:
        raise SystemExit(code)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.dry_run:
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_dry_run_worker, args=(2, port, argv), nprocs=2,
                           start_method="spawn")
        return 0
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10))
    try:
        return run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
