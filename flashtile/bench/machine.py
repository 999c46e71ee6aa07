"""Machine facts for ``flashtile info`` and the bench JSON: versions, device, backend, and
the device's measured ceilings (matrix-product rate and copy bandwidth).

The ceilings take a few seconds to measure, so they are cached per device name in
``ceilings.json`` under flashtile's cache folder (``FLASHTILE_CACHE_DIR``, default
``~/.cache/flashtile``); ``refresh=True`` measures again.
"""

from __future__ import annotations

import datetime
import os
import platform

import torch
import triton

import flashtile
from flashtile import _cache
from flashtile._backend import backend_name
from flashtile.bench.run import time_step
from flashtile.ops import configs

CEILINGS_FILE = "ceilings.json"


def versions() -> dict:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return dict(flashtile=flashtile.__version__, torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, cudnn=cudnn,
                python=platform.python_version())


def backend_label(device) -> str:
    try:
        return backend_name(torch.device(device))
    except (RuntimeError, ValueError, NotImplementedError) as err:
        return f"none ({err})"


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def machine_info(device, command: str = "") -> dict:
    device = torch.device(device)
    return dict(device=_cache.device_name(device), device_type=device.type,
                backend=backend_label(device), **versions(), platform=platform.platform(),
                cpu_count=os.cpu_count(), date=now(), command=command)


def measure_ceilings(device) -> dict:
    """CUDA: bf16 8192^3 matmul and a 1 GiB copy, timed by triton.testing.do_bench.
    CPU: fp32 512^3 matmul and a 64 MiB copy, median of 10 after a warm-up (sized for a
    shared 2-core machine: a fraction of a second in all). Copy bandwidth counts the
    bytes read plus the bytes written."""
    device = torch.device(device)
    if device.type == "cuda":
        import triton.testing

        n, dtype, copy_bytes = 8192, torch.bfloat16, 2**30
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        mm_ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    else:
        n, dtype, copy_bytes = 512, torch.float32, 64 * 2**20
        a, b = (torch.randn(n, n, dtype=dtype) for _ in range(2))
        mm_ms = time_step(lambda: a @ b, device, 10)[0]
        src = torch.ones(copy_bytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        copy_ms = time_step(lambda: dst.copy_(src), device, 10)[0]
    name = str(dtype).replace("torch.", "")
    return dict(
        matmul=f"{name} {n}x{n} @ {n}x{n}", matmul_flops_per_s=2 * n**3 / (mm_ms * 1e-3),
        copy=f"{copy_bytes // 2**20} MiB copy_ (read + write)",
        copy_bytes_per_s=2 * copy_bytes / (copy_ms * 1e-3),
        measured=now(), torch=torch.__version__)


def ceilings(device, refresh: bool = False) -> tuple[dict, bool]:
    """(ceilings of ``device``, whether they came from the cache)."""
    name = _cache.device_name(device)
    data = _cache.read_json(CEILINGS_FILE)
    if not refresh and isinstance(data.get(name), dict):
        return data[name], True
    entry = measure_ceilings(device)
    data[name] = entry
    _cache.write_json(CEILINGS_FILE, data)
    return entry, False


def _rate(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.1f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def info_text(device, refresh: bool = False) -> str:
    device = torch.device(device)
    v = versions()
    c, cached = ceilings(device, refresh)
    name = _cache.device_name(device)
    tuned = [k for k in configs.tuned_table() if k.startswith(name + "|")]
    where = _cache.cache_dir()
    lines = [
        f"flashtile {v['flashtile']}",
        f"torch     {v['torch']}",
        f"triton    {v['triton']}",
        f"CUDA      {v['cuda'] or 'n/a (CPU build of torch)'}",
        f"cuDNN     {v['cudnn'] or 'n/a'}",
        f"python    {v['python']}",
        f"device    {name} ({device.type})",
        f"backend   {backend_label(device)}",
        f"ceilings  ({'cached' if cached else 'measured now'} {c['measured']}; "
        f"{where / CEILINGS_FILE}; --refresh measures again)",
        f"  matmul  {_rate(c['matmul_flops_per_s'], 'FLOP/s')} ({c['matmul']})",
        f"  copy    {_rate(c['copy_bytes_per_s'], 'B/s')} ({c['copy']})",
        f"tuned     {len(tuned)} kernel config(s) for this device in "
        f"{where / configs.TUNED_FILE} (flashtile tune)",
    ]
    return "\n".join(lines)
