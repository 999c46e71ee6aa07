"""Why is flashtile slow at seqlen 512 (batch 32) in `flashtile bench`? Host time per
call against GPU kernel time, fwd and fwd+bwd, d64/d128 at seqlen 512 and 1024.

Run on the GPU: PYTHONPATH=. python3 benchmarks/profile_short.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

import flashtile

from _host_timing import loop_us  # benchmarks/_host_timing.py


def step_fn(q, k, v, do, mode):
    def step():
        o = flashtile.flash_attn_func(q, k, v, causal=True)
        if mode == "fwd_bwd":
            torch.autograd.grad(o, (q, k, v), do)
    return step


for d in (64, 128):
    for n in (512, 1024):
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        for mode in ("fwd", "fwd_bwd"):
            step = step_fn(q, k, v, do, mode)
            host, total = (us / 1e3 for us in loop_us(step, n=50, warmup=5))  # ms
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step()
                torch.cuda.synchronize()
            kernels = {}
            for e in prof.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if t > 0 and e.count >= 10:
                    kernels[e.key[:40]] = t / 10 / 1e3
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[:5]
            print(f"d{d} N={n} b={b} {mode}: host {host:.3f} ms/step, wall {total:.3f} ms/step;"
                  " kernels ms/step: " + ", ".join(f"{k} {t:.3f}" for k, t in top), flush=True)
