"""``flashtile tune``: the kernel tile study for this device, cached for the launcher.

For each head_dim and causal setting, at one seqlen (4096 by default), for each kernel
kind ("fwd", "bwd_dkdv", "bwd_dq", "bwd_fused") and each candidate tile of
``configs.candidates``, the candidate is set for that kernel (the others keep their
static defaults) with ``configs.set_override``, then (the backward kinds with the
backward that runs them: FLASHTILE_BWD=fused for "bwd_fused", split for the others):

1. checked: forward + backward on small inputs (batch 1, up to 4 heads, the same seqlen
   and head_dim) against float64 attention. out, dq, dk and dv must be finite and each
   error at most 2x the error of PyTorch's SDPA math backend at the same dtype plus a
   floor (STYLE.md rule 9, the demo's rule). A launch that stepped down to a smaller
   tile (it did not fit in shared memory) is rejected too: it did not run as listed.
2. timed, if accepted: the forward alone for "fwd", forward + backward for the backward
   kinds, at the bench shape (batch * seqlen = 16384 tokens, nheads = 2048 / head_dim).

The fastest accepted candidate per (device, dtype, head_dim, causal, seqlen class,
kind) goes to the tuned cache (``configs.save_tuned``), which ``configs._pick`` reads
when the launcher passes ``seqlen``. A rejected candidate is never cached.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

import flashtile
from flashtile import _cache
from flashtile.bench import run
from flashtile.bench.machine import now
from flashtile.bench.registry import Cell
from flashtile.ops import configs
from flashtile.ops.configs import TileConfig
from flashtile.reference import attention_naive, error_bound, max_abs_error, sdpa_math_bshd

GRAD_NAMES = ("out", "dq", "dk", "dv")


@dataclass
class Trial:
    """One candidate tile of one kernel. status: "ok", "rejected" or "error"."""

    kind: str
    head_dim: int
    causal: bool
    seqlen: int
    config: TileConfig
    status: str
    reason: str | None = None
    ms: float | None = None
    tflops: float | None = None
    default: bool = False  # the static table's choice
    best: bool = False  # cached as the winner


def _fwd_bwd(q, k, v, dout, attn):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def _flashtile(causal):
    return lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal)


def make_check(q, k, v, dout, causal):
    """A function ``check() -> reason or None`` for the current tile override: the
    float64 reference and torch's own errors are computed once, here."""
    ref = _fwd_bwd(*(x.double() for x in (q, k, v, dout)),
                   lambda a, b, c: attention_naive(a, b, c, causal=causal)[0])
    theirs = _fwd_bwd(q, k, v, dout, sdpa_math_bshd(causal))
    tols = [error_bound(max_abs_error(t, r), r, q.dtype) for t, r in zip(theirs, ref)]

    def check() -> str | None:
        ours = _fwd_bwd(q, k, v, dout, _flashtile(causal))
        for name, x, r, tol in zip(GRAD_NAMES, ours, ref, tols):
            if not torch.isfinite(x).all():
                return f"{name} has NaN/inf"
            err = max_abs_error(x, r)
            if not err <= tol:
                return f"{name} error {err:.2e} > tolerance {tol:.2e}"
        return None
    return check


class _StepDowns(logging.Handler):
    """Collects configs.launch's "tiles ... do not fit" records during one trial."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if "do not fit" in message:
            self.messages.append(message)


@contextlib.contextmanager
def _watch_step_downs():
    log, handler = logging.getLogger("flashtile"), _StepDowns()
    level = log.level
    log.addHandler(handler)
    if log.getEffectiveLevel() > logging.INFO:  # launch logs the step-down at INFO
        log.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def static_defaults(q, head_dim: int, causal: bool) -> dict[str, TileConfig]:
    """What the launcher uses without tuning (the static tables, or the env override)."""
    return {"fwd": configs.fwd_config(q, head_dim, causal),
            "bwd_dkdv": configs.bwd_dkdv_config(q, head_dim, causal),
            "bwd_dq": configs.bwd_dq_config(q, head_dim, causal),
            "bwd_fused": configs.bwd_fused_config(q, head_dim, causal)}


def _smem_limit(device) -> int | None:
    if device.type != "cuda":
        return None  # the interpreter has no shared memory to run out of
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(
            device.index if device.index is not None else torch.cuda.current_device())
        return int(props["max_shared_mem"])
    except Exception:  # an older Triton without the query: Hopper's limit
        return configs.SM90_SMEM_BYTES


@contextlib.contextmanager
def _backward_path(kind):
    """FLASHTILE_BWD set to the backward that runs ``kind``'s kernel, for one trial."""
    with run.env_var("FLASHTILE_BWD", "fused" if kind == "bwd_fused" else "split"):
        yield


def _trial(kind, cfg, defaults, check, cell, device, repeats) -> Trial:
    trial = Trial(kind, cell.head_dim, cell.causal, cell.seqlen, cfg, "error",
                  default=cfg == defaults[kind])
    for k in configs.KINDS:
        configs.set_override(k, cfg if k == kind else defaults[k])
    try:
        with _watch_step_downs() as step_downs, _backward_path(kind):
            reason = check()
        if reason is None and step_downs:
            reason = f"did not fit: {step_downs[0]}"
        if reason is not None:
            trial.status, trial.reason = "rejected", reason
            return trial
        sets = run.make_inputs(cell, "bshd", device, 3 if device.type == "cuda" else 1)
        step = run.make_step(_flashtile(cell.causal), cell.mode, sets)
        with _backward_path(kind):
            trial.ms = run.time_step(step, device, repeats)[0]
        trial.tflops = cell.flops() / trial.ms / 1e9
        trial.status = "ok"
    except Exception as err:  # a tile that fails to compile or run: rejected, go on
        trial.reason = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    finally:
        for k in configs.KINDS:
            configs.set_override(k, None)
    return trial


def tune(device, dtype=torch.bfloat16, head_dims=(64, 128), causals=(False, True),
         seqlen: int = 4096, kinds=configs.KINDS, candidates=None, timing_shape=None,
         repeats: int = 3, on_trial=None) -> tuple[list[Trial], dict]:
    """Run the study; returns (every trial, the cache entries of the winners).

    candidates: {kind: [TileConfig]} to try instead of ``configs.candidates``.
    timing_shape: (batch, nheads) of the timed inputs; default (16384 // seqlen,
    2048 // head_dim) on CUDA, (1, 2) on CPU. ``on_trial(trial)`` after each trial.
    The entries are not saved: pass them to ``configs.save_tuned``.
    """
    device = torch.device(device)
    name, trials, entries = _cache.device_name(device), [], {}
    for d in head_dims:
        for causal in causals:
            gen = torch.Generator().manual_seed(0)
            small = (1, seqlen, 4, d)
            q, k, v, dout = (torch.randn(small, generator=gen).to(device, dtype)
                             for _ in range(4))
            defaults = static_defaults(q, d, causal)
            check = make_check(q, k, v, dout, causal)
            batch, nheads = timing_shape or ((max(1, 16384 // seqlen), max(1, 2048 // d))
                                             if device.type == "cuda" else (1, 2))
            for kind in kinds:
                mode = "fwd" if kind == "fwd" else "fwd_bwd"
                cell = Cell("flashtile", d, causal, mode, seqlen, batch, nheads, dtype)
                cands = (candidates or {}).get(kind) or configs.candidates(
                    kind, d, torch.finfo(dtype).bits // 8, _smem_limit(device))
                done = []
                for cfg in cands:
                    done.append(_trial(kind, cfg, defaults, check, cell, device, repeats))
                    if on_trial is not None:
                        on_trial(done[-1])
                ok = [t for t in done if t.status == "ok"]
                if ok:
                    best = max(ok, key=lambda t: t.tflops)
                    best.best = True
                    key = configs.tuned_key(name, dtype, d, causal, seqlen, kind)
                    entries[key] = dict(
                        block_m=best.config.block_m, block_n=best.config.block_n,
                        num_warps=best.config.num_warps, num_stages=best.config.num_stages,
                        tflops=best.tflops, seqlen=seqlen, tuned=now())
                trials += done
    return trials, entries


TABLE_HEADER = ("| kernel | head_dim | causal | BLOCK_M, BLOCK_N, warps, stages | TFLOP/s "
                "| status |\n|---|---|---|---|---:|---|")


def format_trial(t: Trial) -> str:
    c = t.config
    tags = [s for s, on in (("default", t.default), ("best: cached", t.best)) if on]
    status = t.status + (f" ({t.reason})" if t.reason else "")
    if tags:
        status += f" [{', '.join(tags)}]"
    tflops = "n/a" if t.tflops is None else f"{t.tflops:.3g}"
    return (f"| {t.kind} | {t.head_dim} | {t.causal} | {c.block_m}, {c.block_n}, "
            f"{c.num_warps}, {c.num_stages} | {tflops} | {status} |")
