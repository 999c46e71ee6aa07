"""flashtile's on-disk cache: small JSON files keyed by device name.

``flashtile info`` keeps the measured ceilings of each device here (``ceilings.json``)
and ``flashtile tune`` the best tile of each kernel (``tuned-configs.json``). The folder
is ``$FLASHTILE_CACHE_DIR`` if set, else ``~/.cache/flashtile``; it is read when used,
so a test can point it at a temporary folder with the environment variable alone.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger("flashtile")


def cache_dir() -> Path:
    raw = os.environ.get("FLASHTILE_CACHE_DIR", "").strip()
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "flashtile"


def read_json(name: str) -> dict:
    """The cached file's content, or {} if it is missing or unreadable (logged)."""
    path = cache_dir() / name
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        logger.warning("flashtile: ignoring unreadable cache file %s (%s)", path, err)
        return {}
    return data if isinstance(data, dict) else {}


def write_json(name: str, data: dict) -> Path:
    """Write atomically (temporary file, then rename), so a reader never sees half."""
    path = cache_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


@functools.cache  # /proc/cpuinfo is read once per process
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device) -> str:
    """What the caches are keyed by: the CUDA device name, or "CPU (<model>)"."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_name(index)
    if device.type == "cpu":
        return f"CPU ({_cpu_model()})"
    return device.type


@functools.cache  # the kernel launcher asks on every call when a tuned cache exists
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)
