"""The ``bench``, ``info`` and ``tune`` commands of ``flashtile`` (registered by cli.py).

    flashtile bench [--quick] [--dtype bf16] [--headdim 64 128] [--seqlens 1k 4k]
                    [--providers flashtile sdpa-flash] [--causal both] [--modes fwd]
                    [--out DIR] [--overwrite | --append | --resume]
    flashtile bench --accuracy
    flashtile info [--refresh]
    flashtile tune [--headdim 64 128] [--dtype bf16] [--seqlen 4096] [--clear]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import glob
import itertools
import json
import os
import re
import shlex
import signal
import sys
import time

import torch

from flashtile import _cache
from flashtile._validate import MAX_HEAD_DIM
from flashtile._backend import interpreting, resolve_device, select_backend
from flashtile.bench import machine, registry
from flashtile.ops import configs

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
          "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
CAUSAL = {"true": (True,), "false": (False,), "both": (False, True)}


class UsageError(Exception):
    """A mistake on the command line found after parsing: cli.main prints the message
    as ``flashtile <command>: error: <message>`` and exits with status 2."""


# argparse types: an ArgumentTypeError becomes the one-line error "argument --x: ..."
# with exit status 2 (cli.Parser.error).

def seqlen(text: str) -> int:
    """'4096', '4k' or '64K' -> 4096 / 65536."""
    match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if match is None or int(match[1]) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive length such as 512, 4k "
                                         f"or 64K, got {text!r}")
    return int(match[1]) * (1024 if match[2] else 1)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def head_dim(text: str) -> int:
    value = positive_int(text)
    if value > MAX_HEAD_DIM:
        raise argparse.ArgumentTypeError(f"expected a head_dim from 1 to {MAX_HEAD_DIM}, "
                                         f"got {text!r}")
    return value


def device(text: str) -> str:
    """--device: auto (CUDA if available, else CPU), cpu, or cuda where torch sees a GPU."""
    if text not in ("auto", "cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected auto, cpu or cuda, got {text!r}")
    if text == "cuda" and not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               and torch.version.hip is None else "torch sees no CUDA device")
        raise argparse.ArgumentTypeError(f"cuda is not available here ({why}); use "
                                         "--device cpu, or auto (the default)")
    return text


def add_device(p):
    p.add_argument("--device", default="auto", type=device,
                   help="auto, cpu or cuda; default auto: cuda if available, else cpu")


def _command(args) -> str:
    return shlex.join(["flashtile", *args.argv])


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48] or "device"


def default_out(device) -> str:
    day = datetime.date.today().isoformat()
    return os.path.join("bench-results", f"{day}-{_slug(_cache.device_name(device))}")


# What flashtile bench writes into a results folder (report.write_outputs, report.plot,
# --accuracy, --decode), the files --overwrite removes; anything else there stays.
_OUTPUT_FILES = ("results.json", "results.md", "accuracy.json", "accuracy.md",
                 "decode.json", "decode.md", "tflops-*.png", "memory-*.png", "*.tmp")


def _holds_files(folder: str) -> bool:
    return os.path.isdir(folder) and any(os.scandir(folder))


def output_folder(args, device, adds: bool = False) -> str:
    """Where this run writes: never a folder holding an earlier run's files unless asked.

    The default, bench-results/<date>-<device>, gets a suffix -2, -3, ... per run on the
    same day; ``adds`` (--append/--resume) picks the newest of them instead. An
    explicit --out that already holds files is refused (UsageError) unless ``adds`` or
    --overwrite (whose clearing is ``clear_outputs``, done at the first write).
    """
    if args.out is not None:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise UsageError(f"--out {args.out} is a file; give a folder")
        if adds or args.overwrite or not _holds_files(args.out):
            return args.out
        raise UsageError(f"--out {args.out} already holds an earlier run's files; add "
                         "--overwrite to replace them, --append to add to them, or "
                         "choose another --out")
    base = default_out(device)
    if args.overwrite:
        return base
    runs = (base if n == 1 else f"{base}-{n}" for n in itertools.count(1))
    if not adds:
        return next(folder for folder in runs if not _holds_files(folder))
    newest = base
    for folder in runs:
        if not os.path.isdir(folder):
            return newest
        newest = folder


def clear_outputs(folder: str) -> None:
    """--overwrite: remove the results, tables and plots flashtile wrote in ``folder``
    (an old plot of a setting this run does not have would sit beside the new tables)."""
    for pattern in _OUTPUT_FILES:
        for path in glob.glob(os.path.join(glob.escape(folder), pattern)):
            os.remove(path)


def _common(p):
    add_device(p)
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="default: bf16 on CUDA, fp32 on CPU")


def add_bench(commands):
    p = commands.add_parser(
        "bench", help="TFLOP/s, time and memory of flashtile and its peers; JSON, "
        "markdown and plots (--accuracy: the precision table)",
        epilog="flashtile bench serve -h, flashtile bench throughput -h, flashtile bench "
        "kv-waste -h: the engine's serving, offline and KV-memory benchmarks; flashtile "
        "bench hf -h: transformers with attn_implementation='flashtile' beside sdpa and "
        "eager; flashtile bench host -h: the host time of one eager call (options of "
        "their own)")
    _common(p)
    p.add_argument("--quick", action="store_true", help="a few small cells (< 1 min)")
    p.add_argument("--accuracy", action="store_true",
                   help="errors against float64 for fp32/TF32/fp16/bf16, not speed")
    p.add_argument("--decode", action="store_true",
                   help="decode over a KV cache (CUDA): GB/s beside SDPA and the copy "
                        "ceiling, contiguous and paged")
    p.add_argument("--headdim", type=head_dim, nargs="+",
                   help="default: 64 128 (CPU: 64)")
    p.add_argument("--seqlens", type=seqlen, nargs="+",
                   help="e.g. 512 1k 16k; default 512..64k on CUDA, 128..4k on CPU")
    p.add_argument("--tokens", type=positive_int,
                   help="tokens per batch (batch = tokens // seqlen, at least 1); default "
                        "16384 on CUDA: --tokens 1024 --seqlens 1k times batch 1, where an "
                        "eager call's host time shows")
    p.add_argument("--providers", nargs="+", choices=list(registry.PROVIDERS),
                   metavar="PROVIDER",
                   help=f"default: all of {', '.join(registry.ALL)}")
    p.add_argument("--causal", choices=sorted(CAUSAL), help="default: both")
    p.add_argument("--modes", nargs="+", choices=registry.MODES,
                   help="default: fwd fwd_bwd")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="CPU: timed calls per cell (CUDA: do_bench decides)")
    p.add_argument("--out", help="output folder; default bench-results/<date>-<device>/, "
                   "with -2, -3, ... added for each further run that day")
    p.add_argument("--overwrite", action="store_true",
                   help="write into --out (or the day's first folder) even if it holds "
                   "an earlier run, removing that run's results, tables and plots first")
    p.add_argument("--append", action="store_true",
                   help="add to the results.json already in --out (a sweep split over "
                   "several runs); cells measured again replace the old ones")
    p.add_argument("--resume", action="store_true",
                   help="--append, skipping the cells already in --out's results.json "
                   "(a sweep cut short by a time limit goes on where it stopped)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_bench)


def build_sweep(args, device) -> registry.Sweep:
    sweep = registry.default_sweep(device, args.quick)
    changes = {}
    if args.dtype:
        changes["dtype"] = DTYPES[args.dtype]
    if args.headdim:
        changes["head_dims"] = tuple(args.headdim)
    if args.seqlens:
        changes["seqlens"] = tuple(args.seqlens)
    if args.tokens:
        changes["tokens"] = args.tokens
    if args.providers:
        changes["providers"] = tuple(dict.fromkeys(args.providers))
    if args.causal:
        changes["causals"] = CAUSAL[args.causal]
    if args.modes:
        changes["modes"] = tuple(dict.fromkeys(args.modes))
    return dataclasses.replace(sweep, **changes)


def _bench(args) -> int:
    from flashtile.bench import report, run

    device = resolve_device(args.device)
    if args.overwrite and (args.append or args.resume):
        raise UsageError("--overwrite replaces the folder's run, --append and --resume "
                         "add to it: give one of them")
    if args.accuracy:
        return _accuracy(args, device)
    if args.decode:
        return _decode(args, device)
    info = machine.machine_info(device, _command(args))
    out = output_folder(args, device, adds=args.append or args.resume)
    sweep = build_sweep(args, device)
    settings = sweep.settings()
    previous = _previous(out) if args.append or args.resume else None
    if previous is not None:
        try:
            report.check_append(previous, info, settings)
        except ValueError as err:
            raise UsageError(f"{err} ({out})") from None
    done = set()  # --resume: measured cells; OOM and n/a are tried again
    if args.resume and previous is not None:
        done = {(r.cell.provider, r.cell.row())
                for r in map(run.Result.from_json, previous.get("results", []))
                if r.status == "ok"}
    todo = sum((c.provider, c.row()) not in done for c in sweep.cells())
    print(f"flashtile bench on {info['device']} (backend {info['backend']}): "
          f"{todo} cells", file=sys.stderr, flush=True)
    recorder = _Recorder(previous, info, settings, out, log=args.no_progress,
                         clear=args.overwrite)
    stopped = False
    try:
        with _sigterm_as_interrupt():
            run.run_sweep(sweep, device, repeats=args.repeats,
                          progress=not args.no_progress, on_result=recorder, skip=done)
    except KeyboardInterrupt:  # Ctrl-C or a time limit: keep what was measured
        stopped = True
        print(f"flashtile bench: stopped after {len(recorder.results)} of {todo} cells; "
              f"--resume --out {out} goes on", file=sys.stderr)
    if stopped and not recorder.results:
        return 130  # nothing measured: leave --out as it was
    results, info, settings = recorder.tables()
    print(report.markdown(results, info, settings))
    paths = report.write_outputs(results, info, settings, out)
    print(f"wrote {paths['json']}, {paths['markdown']} and {len(paths['plots'])} plots")
    return 130 if stopped else 0


class _Recorder:
    """Collects a sweep's results and rewrites results.json/md after every cell (merged
    into the folder's previous run, if any), so a run stopped by a time limit keeps what
    it measured. ``log``: a line per cell with its wall time (shows compile costs).
    ``clear``: --overwrite, the folder's old outputs go just before the first write, so
    a run stopped before its first cell leaves the folder as it was."""

    def __init__(self, previous, info, settings, out, log=False, clear=False):
        self.previous, self.info, self.settings, self.out = previous, info, settings, out
        self.log, self.results, self.clock = log, [], time.perf_counter()
        self.clear = clear

    def tables(self):
        """(results, machine, settings), in the order report.write_outputs takes them."""
        from flashtile.bench import report

        if self.previous is None:
            return self.results, self.info, self.settings
        merged, settings, machine = report.merge(self.previous, self.results,
                                                 self.settings, self.info)
        return merged, machine, settings

    def __call__(self, result):
        from flashtile.bench import report

        self.results.append(result)
        if self.clear:
            clear_outputs(self.out)
            self.clear = False
        report.write_outputs(*self.tables(), self.out, plots=False)
        if self.log:
            now = time.perf_counter()
            print(f"{now - self.clock:6.1f}s {result.cell.label()}: {result.status}",
                  file=sys.stderr, flush=True)
            self.clock = now


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """`timeout` sends SIGTERM: treat it as Ctrl-C so the tables and plots get written."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _previous(out: str) -> dict | None:
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _decode(args, device) -> int:
    from flashtile.bench import decode

    if device.type != "cuda":
        raise UsageError(f"--decode times replayed CUDA graphs and needs a CUDA device "
                         f"(this run's device is {device}); the decode kernel's CPU "
                         "checks are in tests/test_decode.py")
    out = output_folder(args, device)
    copy_gbps = machine.ceilings(device)[0]["copy_bytes_per_s"] / 1e9
    rows = decode.run_decode_bench(device=device)
    text = decode.decode_markdown(rows, copy_gbps)
    print(text)
    _prepare(out, args.overwrite)
    with open(os.path.join(out, "decode.md"), "w") as f:
        f.write(f"Command: `{_command(args)}`; device copy ceiling {copy_gbps:.0f} GB/s\n\n"
                + text + "\n")
    with open(os.path.join(out, "decode.json"), "w") as f:
        json.dump(dict(copy_gbps=copy_gbps, rows=rows,
                       info=machine.machine_info(device, _command(args))), f, indent=1)
    print(f"wrote {out}/decode.md and decode.json")
    return 0


def _prepare(out: str, overwrite: bool) -> None:
    if overwrite:
        clear_outputs(out)
    os.makedirs(out, exist_ok=True)


def _accuracy(args, device) -> int:
    from flashtile.bench import accuracy

    out = output_folder(args, device)
    shape = accuracy.GPU_SHAPE if device.type == "cuda" else accuracy.CPU_SHAPE
    if args.headdim:
        shape = (*shape[:3], args.headdim[0])
    rows = accuracy.accuracy_table(device, shape, causal=args.causal == "true")
    info = machine.machine_info(device, _command(args))
    text = accuracy.markdown(rows, shape, info["device"])
    print(text)
    _prepare(out, args.overwrite)
    with open(os.path.join(out, "accuracy.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "accuracy.json"), "w") as f:
        json.dump(accuracy.to_json(rows, shape, info), f, indent=1)
    print(f"wrote {out}/accuracy.md and accuracy.json")
    return 0


def add_info(commands):
    p = commands.add_parser("info", help="versions, device, backend and the device's "
                            "measured matmul / copy ceilings (cached)")
    add_device(p)
    p.add_argument("--refresh", action="store_true", help="measure the ceilings again")
    p.set_defaults(handler=_info)


def _info(args) -> int:
    print(machine.info_text(resolve_device(args.device), refresh=args.refresh))
    return 0


def add_tune(commands):
    p = commands.add_parser("tune", help="time candidate tiles of each kernel, check "
                            "their output, cache the fastest correct ones")
    _common(p)
    p.add_argument("--headdim", type=head_dim, nargs="+", default=[64, 128])
    p.add_argument("--causal", choices=sorted(CAUSAL), default="both")
    p.add_argument("--seqlen", type=seqlen, default=4096,
                   help="the representative length (cached for its class: <=2k, <=8k, "
                   ">8k)")
    p.add_argument("--kinds", nargs="+", choices=configs.KINDS, default=list(configs.KINDS))
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="CPU: timed calls per tile")
    p.add_argument("--dry-run", action="store_true", help="print, do not cache")
    p.add_argument("--clear", action="store_true", help="delete the tuned cache and exit")
    p.set_defaults(handler=_tune)


def _tune(args) -> int:
    from flashtile.bench import tune

    if args.clear:
        print(f"removed {configs.clear_tuned()}")
        return 0
    device = resolve_device(args.device)
    if select_backend(device) != "triton":
        raise UsageError("tune times the Triton kernels: run it on a CUDA device, or set "
                         "TRITON_INTERPRET=1 (slow; use a short --seqlen) to check the "
                         "logic on CPU")
    dtype = DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    where = "interpreter" if device.type == "cpu" and interpreting() else device.type
    print(f"flashtile tune on {_cache.device_name(device)} ({where}), "
          f"{str(dtype).replace('torch.', '')}, seqlen {args.seqlen}\n")
    print(tune.TABLE_HEADER, flush=True)
    trials, entries = tune.tune(device, dtype, tuple(args.headdim), CAUSAL[args.causal],
                                args.seqlen, tuple(args.kinds), repeats=args.repeats,
                                on_trial=lambda t: print(tune.format_trial(t), flush=True))
    print("\nwinners:")
    for t in trials:
        if t.best:
            print(tune.format_trial(t))
    if device.type == "cpu":
        # Interpreter timings say nothing about a GPU, and the interpreter's small,
        # unequal tiles are what make the tests' short sequences cross tile edges.
        print("\nnothing cached (interpreter run: a check of the logic only)")
    elif args.dry_run or not entries:
        print("\nnothing cached" + (" (--dry-run)" if args.dry_run else ""))
    else:
        print(f"\ncached {len(entries)} config(s) in {configs.save_tuned(entries)}")
    return 0
