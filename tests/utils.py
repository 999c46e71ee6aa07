"""Accuracy rule and reference helpers shared by the tests."""

import datetime
import os
import pathlib
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtile.reference import attention_naive

# Absolute slack added to 2x PyTorch's own error, per dtype: covers the cases where
# PyTorch's same-dtype path happens to be nearly exact (tiny errors on both sides).
FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def assert_close_rule(name, ours, ref64, torch_same_dtype):
    """err(ours) <= 2 * err(torch at our dtype) + floor, both against float64 (flash-attn)."""
    assert not torch.isnan(ours).any(), f"{name}: NaN in output"
    e_ours = max_err(ours, ref64)
    e_torch = max_err(torch_same_dtype, ref64)
    bound = 2 * e_torch + FLOOR[ours.dtype]
    assert e_ours <= bound, f"{name}: max error {e_ours:.3g} > bound {bound:.3g} " \
                            f"(torch's own error {e_torch:.3g})"


def reference_pair(q, k, v, dout, dlse=None, **kw):
    """Float64 oracle and PyTorch-at-our-dtype results: ((out, lse, grads) x 2)."""
    results = []
    for upcast in (True, False):
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
        if upcast:
            qs, ks, vs = (x.detach().double().requires_grad_() for x in (q, k, v))
        out, lse = attention_naive(qs, ks, vs, upcast=upcast, **kw)
        loss = (out * dout.to(out.dtype)).sum()
        if dlse is not None:
            fin = torch.isfinite(lse)
            loss = loss + (torch.where(fin, lse, 0) * dlse.to(lse.dtype)).sum()
        grads = torch.autograd.grad(loss, (qs, ks, vs))
        results.append((out.detach(), lse.detach(), grads))
    return results


def _gloo_rank(rank, fn, world, port, out_dir, args):
    os.environ["FLASHTILE_BACKEND"] = "torch"  # the tiled PyTorch path, read at call time
    torch.set_num_threads(1)  # the processes share 2 cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(fn, world, out_dir, *args, timeout_s=150):
    """[fn(rank, world, *args) for each rank], each run in its own spawned process, the
    processes joined in one gloo group over 127.0.0.1 (flashtile's torch backend, one
    thread each). fn: a module-level function; what it returns goes through torch.save.
    A process that raises, or all of them running past timeout_s (gloo itself gives up
    on a hung collective after 60 s), fails the test with every rank's traceback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_gloo_rank, args=(fn, world, port, str(out_dir), args),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{world} processes running {fn.__name__} did not finish in "
                            f"{timeout_s} s")
    except mp.ProcessRaisedException:
        errors = sorted(pathlib.Path(out_dir).glob("rank*.err"))
        pytest.fail(f"a process running {fn.__name__} failed:\n" +
                    "\n".join(p.read_text() for p in errors))
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
