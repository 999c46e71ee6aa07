"""``python -m flashtile <command>`` (or the ``flashtile`` console script).

``demo`` is a self-check: it runs flashtile's forward and backward on a few shapes on the
best device here (CUDA if present, else CPU), compares ``out`` and ``dq`` with the naive
oracle ``flashtile.reference.attention_naive``, times both, and prints a markdown table.
It exits 1 if any error is over its tolerance.

``bench``, ``info`` and ``tune`` (speed and accuracy tables, versions and device
ceilings, the kernel tile study) live in ``flashtile.bench.commands``.

Each command is one ``add_<command>`` function that registers its parser and handler.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import flashtile
from flashtile._backend import backend_name, default_device, resolve_device, select_backend
from flashtile.bench import commands as bench_commands
from flashtile.bench.run import peak_extra_mib
from flashtile.engine.cli import add_convert_gguf, add_generate
from flashtile.reference import attention_naive, error_bound, max_abs_error, sdpa_math_bshd

MiB = 2**20


@dataclass(frozen=True)
class Shape:
    """One demo case: q, k, v are (batch, seqlen, nheads, head_dim), all one dtype."""

    batch: int
    nheads: int
    seqlen: int
    head_dim: int
    causal: bool
    dtype: torch.dtype = torch.float32

    def label(self) -> str:
        return f"{self.batch}x{self.nheads}x{self.seqlen}x{self.head_dim}"


def _grid(batch_seqlens, head_dims, nheads, dtype):
    return [Shape(b, nheads, s, d, causal, dtype) for b, s in batch_seqlens
            for d in head_dims for causal in (False, True)]


# CPU: the tiled PyTorch backend in fp32; about 20 s on 2 cores for the whole set.
CPU_SHAPES = _grid([(2, 128), (2, 512), (1, 1024)], [64], nheads=4, dtype=torch.float32)
# CUDA: bf16 at the sizes FlashAttention is for; tokens per batch kept near 8k-16k.
CUDA_SHAPES = _grid([(8, 1024), (2, 4096), (1, 8192)], [64, 128], nheads=16,
                    dtype=torch.bfloat16)

# The accuracy rule is reference.error_bound. When the naive path cannot run there is
# no torch error to compare with: these tolerances, scaled by max(1, |reference|), alone.
_FALLBACK_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@dataclass
class Row:
    """One line of the demo table. Errors are max |x - reference| over all elements."""

    shape: Shape
    backend: str
    out_err: float
    dq_err: float
    out_tol: float
    dq_tol: float
    flash_ms: float
    naive_ms: float | None
    flash_mib: float
    naive_mib: float | None
    memory_measured: bool  # True: CUDA peak-allocation deltas; False: computed sizes

    @property
    def checked(self) -> bool:  # False when no reference fitted in memory
        return not math.isnan(self.out_err)

    @property
    def ok(self) -> bool:
        return not self.checked or (self.out_err <= self.out_tol
                                    and self.dq_err <= self.dq_tol)


def _forward_backward(attn, q, k, v, dout):
    """out and dq of one forward + backward (dk, dv computed too, then dropped)."""
    out = attn(q, k, v)
    dq, _, _ = torch.autograd.grad(out, (q, k, v), dout)
    return out, dq


def _flash(causal):
    return lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal)


def _naive(causal, upcast):
    return lambda q, k, v: attention_naive(q, k, v, causal=causal, upcast=upcast)[0]


# PyTorch's own SDPA math backend on (b, s, h, d) inputs (the demo has seqlen_q == seqlen_k).
_torch_math = sdpa_math_bshd


def _median_ms(fn, device, repeats):
    """Median wall time of ``fn`` in ms after one warm-up call (which also compiles)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _computed_mib(s: Shape, backend: str):
    """CPU: what each path must hold beyond its inputs and outputs, by formula.

    naive: the (B, H, S, S) score matrix in the compute dtype (autograd keeps several
    of them, so this is a lower bound). flashtile: lse (B, H, S) fp32, plus, on the
    tiled PyTorch path, one (B, H, S, 128) block of scores in fp32.
    """
    rows = s.batch * s.nheads * s.seqlen
    flash = rows * 4 + (rows * 128 * 4 if backend == "torch" else 0)
    naive = rows * s.seqlen * torch.finfo(s.dtype).bits // 8
    return flash / MiB, naive / MiB


def _naive_fits(s: Shape, device, dtype) -> bool:
    """Whether the naive path's ~6 live (B, H, S, S) matrices fit in half of free memory."""
    if device.type != "cuda":
        return True
    need = 6 * s.batch * s.nheads * s.seqlen**2 * torch.finfo(dtype).bits // 8
    return need < torch.cuda.mem_get_info(device)[0] // 2


_max_err = max_abs_error


def _tolerance(s: Shape, torch_err: float | None, ref) -> float:
    if torch_err is None:
        return _FALLBACK_TOL[s.dtype] * max(1.0, ref.abs().max().item())
    return error_bound(torch_err, ref, s.dtype)


def run_shape(s: Shape, device, repeats: int = 3) -> Row:
    """Check and time one shape; see ``run_demo``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(s.batch, s.seqlen, s.nheads, s.head_dim, generator=gen)
                     .to(device=device, dtype=s.dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    backend = backend_name(device)

    # Reference: float64 on CPU; fp32 (upcast from the inputs) on CUDA.
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    ref_out = ref_dq = None
    if _naive_fits(s, device, ref_dtype):
        q_ref, k_ref, v_ref = (x.detach().to(ref_dtype).requires_grad_()
                               for x in (q, k, v))
        ref_out, ref_dq = _forward_backward(_naive(s.causal, upcast=False), q_ref, k_ref,
                                            v_ref, dout.to(ref_dtype))
        ref_out, ref_dq = ref_out.detach(), ref_dq.detach()
        del q_ref, k_ref, v_ref

    out, dq = _forward_backward(_flash(s.causal), q, k, v, dout)
    flash_fn = lambda: _forward_backward(_flash(s.causal), q, k, v, dout)  # noqa: E731
    flash_ms = _median_ms(flash_fn, device, repeats)

    naive_ms = naive_mib = torch_out_err = torch_dq_err = None
    if _naive_fits(s, device, s.dtype):
        if ref_out is not None:  # torch's own error at this dtype, for the tolerance
            t_out, t_dq = _forward_backward(_torch_math(s.causal), q, k, v, dout)
            torch_out_err, torch_dq_err = _max_err(t_out, ref_out), _max_err(t_dq, ref_dq)
            del t_out, t_dq
        naive_fn = lambda: _forward_backward(_naive(s.causal, upcast=False),  # noqa: E731
                                             q, k, v, dout)
        naive_ms = _median_ms(naive_fn, device, repeats)
        if device.type == "cuda":
            naive_mib = peak_extra_mib(naive_fn, device)

    if device.type == "cuda":
        flash_mib, measured = peak_extra_mib(flash_fn, device), True
    else:
        flash_mib, naive_mib = _computed_mib(s, select_backend(device))
        measured = False

    if ref_out is None:  # no reference fits: nothing to compare against
        out_err = dq_err = out_tol = dq_tol = math.nan
    else:
        out_err, dq_err = _max_err(out, ref_out), _max_err(dq, ref_dq)
        out_tol = _tolerance(s, torch_out_err, ref_out)
        dq_tol = _tolerance(s, torch_dq_err, ref_dq)
    return Row(s, backend, out_err, dq_err, out_tol, dq_tol, flash_ms, naive_ms, flash_mib,
               naive_mib, measured)


def run_demo(shapes=None, device=None, repeats: int = 3, progress=None) -> list[Row]:
    """Run flashtile forward + backward on each shape against the naive oracle.

    Arguments:
        shapes: list of ``Shape``; default ``CUDA_SHAPES`` on CUDA, ``CPU_SHAPES`` on CPU.
        device: torch.device or str; default CUDA if available, else CPU.
        repeats: timed runs per path (after one warm-up); the median is reported.
        progress: optional callable given each ``Row`` as it is done.

    Returns one ``Row`` per shape. Errors are measured against float64 (CPU) or fp32
    (CUDA) naive attention; a row is ok when its error is at most 2 x the error of
    PyTorch's SDPA math backend at the same dtype plus a floor (style rule 9).
    """
    device = torch.device(device) if device is not None else default_device()
    if shapes is None:
        shapes = CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES
    rows = []
    for s in shapes:
        rows.append(run_shape(s, device, repeats))
        if progress is not None:
            progress(rows[-1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fmt(x, spec=".1f"):
    missing = x is None or (isinstance(x, float) and math.isnan(x))
    return "n/a" if missing else format(x, spec)


TABLE_HEADER = ("| shape BxHxSxD | dtype | causal | backend | out err (tol) | dq err (tol) "
                "| flashtile ms | naive ms | flashtile MiB | naive MiB | ok |\n"
                "|---|---|---|---|---|---|---:|---:|---:|---:|---|")


def format_row(r: Row) -> str:
    s = r.shape
    verdict = "unchecked" if not r.checked else "yes" if r.ok else "NO"
    return (f"| {s.label()} | {str(s.dtype).replace('torch.', '')} | {s.causal} "
            f"| {r.backend} | {_fmt(r.out_err, '.1e')} ({_fmt(r.out_tol, '.0e')}) "
            f"| {_fmt(r.dq_err, '.1e')} ({_fmt(r.dq_tol, '.0e')}) | {_fmt(r.flash_ms)} "
            f"| {_fmt(r.naive_ms)} | {_fmt(r.flash_mib)} | {_fmt(r.naive_mib)} "
            f"| {verdict} |")


def _footnotes(device, repeats, rows) -> str:
    ref = "float64" if device.type == "cpu" else "fp32 (upcast)"
    lines = [
        f"Errors: max |x - ref| of out and dq, ref = naive attention in {ref}; tol = 2 x "
        "the error of PyTorch's SDPA math backend at the same dtype + a floor.",
        f"Times: forward + backward, median of {repeats} after a warm-up; naive = "
        "flashtile.reference.attention_naive at the same dtype.",
    ]
    if any(r.memory_measured for r in rows):
        lines.append("Memory (measured): peak torch.cuda.max_memory_allocated during "
                     "forward + backward, above what was allocated before.")
    else:
        lines.append("Memory (computed, not measured): naive = one BxHxSxS score matrix "
                     "(a lower bound); flashtile = lse (BxHxS fp32) plus, on the tiled "
                     "PyTorch path, one BxHxSx128 score block.")
    return "\n".join(lines)


def _demo(args) -> int:
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"flashtile {flashtile.__version__} demo on {name}, torch {torch.__version__}, "
          f"backend {backend_name(device)}\n", flush=True)
    print(TABLE_HEADER, flush=True)
    rows = run_demo(device=device, repeats=args.repeats,
                    progress=lambda r: print(format_row(r), flush=True))
    print("\n" + _footnotes(device, args.repeats, rows))
    bad = [r.shape.label() for r in rows if not r.ok]
    if bad:
        print(f"\nFAILED: error over tolerance for {', '.join(bad)}", file=sys.stderr)
        return 1
    print(f"\nOK: all {len(rows)} shapes within tolerance.")
    return 0


def _add_demo(commands):
    p = commands.add_parser("demo", help="self-check: accuracy, time and memory vs naive")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="default: cuda if available, else cpu")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path (median)")
    p.set_defaults(handler=_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtile", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log INFO from the 'flashtile' logger (kernel compiles)")
    commands = parser.add_subparsers(dest="command", metavar="command")
    for add in (_add_demo, bench_commands.add_bench, bench_commands.add_info,
                bench_commands.add_tune, add_generate, add_convert_gguf):
        add(commands)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # recorded in the bench JSON as the command line
    if args.command is None:
        parser.print_help()
        return 2
    if args.verbose:
        logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
        logging.getLogger("flashtile").setLevel(logging.INFO)
    return args.handler(args)
