"""The ``bench``, ``info`` and ``tune`` commands of ``flashtile`` (registered by cli.py).

    flashtile bench [--quick] [--dtype bf16] [--headdim 64 128] [--seqlens 1k 4k]
                    [--providers flashtile sdpa-flash] [--causal both] [--modes fwd]
                    [--out DIR]
    flashtile bench --accuracy
    flashtile info [--refresh]
    flashtile tune [--headdim 64 128] [--dtype bf16] [--seqlen 4096] [--clear]
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import shlex
import signal
import sys
import time

import torch

from flashtile import _cache
from flashtile._backend import interpreting, resolve_device, select_backend
from flashtile.bench import machine, registry
from flashtile.ops import configs

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
          "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
CAUSAL = {"true": (True,), "false": (False,), "both": (False, True)}


def seqlen(text: str) -> int:  # named for argparse's "invalid seqlen value" message
    """'4096', '4k' or '64K' -> 4096 / 65536."""
    match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if match is None or int(match[1]) < 1:
        raise ValueError(text)
    return int(match[1]) * (1024 if match[2] else 1)


def _command(args) -> str:
    return shlex.join(["flashtile", *args.argv])


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48] or "device"


def default_out(device) -> str:
    day = datetime.date.today().isoformat()
    return os.path.join("bench-results", f"{day}-{_slug(_cache.device_name(device))}")


def _common(p):
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="default: bf16 on CUDA, fp32 on CPU")


def add_bench(commands):
    p = commands.add_parser(
        "bench", help="TFLOP/s, time and memory of flashtile and its peers; JSON, "
        "markdown and plots (--accuracy: the precision table)",
        epilog="flashtile bench serve -h, flashtile bench throughput -h: the engine's "
        "serving and offline benchmarks (options of their own)")
    _common(p)
    p.add_argument("--quick", action="store_true", help="a few small cells (< 1 min)")
    p.add_argument("--accuracy", action="store_true",
                   help="errors against float64 for fp32/TF32/fp16/bf16, not speed")
    p.add_argument("--decode", action="store_true",
                   help="decode over a KV cache (CUDA): GB/s beside SDPA and the copy "
                        "ceiling, contiguous and paged")
    p.add_argument("--headdim", type=int, nargs="+", help="default: 64 128 (CPU: 64)")
    p.add_argument("--seqlens", type=seqlen, nargs="+",
                   help="e.g. 512 1k 16k; default 512..64k on CUDA, 128..4k on CPU")
    p.add_argument("--providers", nargs="+",
                   help=f"default: all of {', '.join(registry.PROVIDERS)}")
    p.add_argument("--causal", choices=sorted(CAUSAL), help="default: both")
    p.add_argument("--modes", nargs="+", choices=registry.MODES,
                   help="default: fwd fwd_bwd")
    p.add_argument("--repeats", type=int, default=5,
                   help="CPU: timed calls per cell (CUDA: do_bench decides)")
    p.add_argument("--out", help="output folder; default bench-results/<date>-<device>/")
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
    if args.providers:
        unknown = [p for p in args.providers if p not in registry.PROVIDERS]
        if unknown:
            raise ValueError(f"--providers: unknown {unknown}; choose from "
                             f"{list(registry.PROVIDERS)}")
        changes["providers"] = tuple(args.providers)
    if args.causal:
        changes["causals"] = CAUSAL[args.causal]
    if args.modes:
        changes["modes"] = tuple(dict.fromkeys(args.modes))
    return dataclasses.replace(sweep, **changes)


def _bench(args) -> int:
    from flashtile.bench import report, run

    device = resolve_device(args.device)
    if args.accuracy:
        return _accuracy(args, device)
    if args.decode:
        return _decode(args, device)
    info = machine.machine_info(device, _command(args))
    out = args.out or default_out(device)
    try:
        sweep = build_sweep(args, device)
        settings = sweep.settings()
        previous = _previous(out) if args.append or args.resume else None
        if previous is not None:
            report.check_append(previous, info, settings)
    except ValueError as err:
        print(f"flashtile bench: {err}", file=sys.stderr)
        return 2
    done = set()  # --resume: measured cells; OOM and n/a are tried again
    if args.resume and previous is not None:
        done = {(r.cell.provider, r.cell.row())
                for r in map(run.Result.from_json, previous.get("results", []))
                if r.status == "ok"}
    todo = sum((c.provider, c.row()) not in done for c in sweep.cells())
    print(f"flashtile bench on {info['device']} (backend {info['backend']}): "
          f"{todo} cells", file=sys.stderr, flush=True)
    recorder = _Recorder(previous, info, settings, out, log=args.no_progress)
    stopped = False
    try:
        with _sigterm_as_interrupt():
            run.run_sweep(sweep, device, repeats=args.repeats,
                          progress=not args.no_progress, on_result=recorder, skip=done)
    except KeyboardInterrupt:  # Ctrl-C or a time limit: keep what was measured
        stopped = True
        print(f"flashtile bench: stopped after {len(recorder.results)} of {todo} cells; "
              "--resume goes on", file=sys.stderr)
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
    it measured. ``log``: a line per cell with its wall time (shows compile costs)."""

    def __init__(self, previous, info, settings, out, log=False):
        self.previous, self.info, self.settings, self.out = previous, info, settings, out
        self.log, self.results, self.clock = log, [], time.perf_counter()

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
        print("flashtile bench --decode: times replayed CUDA graphs and needs a CUDA "
              f"device (this run's device is {device}); the decode kernel's CPU checks "
              "are in tests/test_decode.py", file=sys.stderr)
        return 2
    copy_gbps = machine.ceilings(device)[0]["copy_bytes_per_s"] / 1e9
    rows = decode.run_decode_bench(device=device)
    text = decode.decode_markdown(rows, copy_gbps)
    print(text)
    out = args.out or default_out(device)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "decode.md"), "w") as f:
        f.write(f"Command: `{_command(args)}`; device copy ceiling {copy_gbps:.0f} GB/s\n\n"
                + text + "\n")
    with open(os.path.join(out, "decode.json"), "w") as f:
        json.dump(dict(copy_gbps=copy_gbps, rows=rows,
                       info=machine.machine_info(device, _command(args))), f, indent=1)
    print(f"wrote {out}/decode.md and decode.json")
    return 0


def _accuracy(args, device) -> int:
    from flashtile.bench import accuracy

    shape = accuracy.GPU_SHAPE if device.type == "cuda" else accuracy.CPU_SHAPE
    if args.headdim:
        shape = (*shape[:3], args.headdim[0])
    rows = accuracy.accuracy_table(device, shape, causal=args.causal == "true")
    info = machine.machine_info(device, _command(args))
    text = accuracy.markdown(rows, shape, info["device"])
    print(text)
    out = args.out or default_out(device)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "accuracy.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "accuracy.json"), "w") as f:
        json.dump(accuracy.to_json(rows, shape, info), f, indent=1)
    print(f"wrote {out}/accuracy.md and accuracy.json")
    return 0


def add_info(commands):
    p = commands.add_parser("info", help="versions, device, backend and the device's "
                            "measured matmul / copy ceilings (cached)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--refresh", action="store_true", help="measure the ceilings again")
    p.set_defaults(handler=_info)


def _info(args) -> int:
    print(machine.info_text(resolve_device(args.device), refresh=args.refresh))
    return 0


def add_tune(commands):
    p = commands.add_parser("tune", help="time candidate tiles of each kernel, check "
                            "their output, cache the fastest correct ones")
    _common(p)
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", choices=sorted(CAUSAL), default="both")
    p.add_argument("--seqlen", type=seqlen, default=4096,
                   help="the representative length (cached for its class: <=2k, <=8k, "
                   ">8k)")
    p.add_argument("--kinds", nargs="+", choices=configs.KINDS, default=list(configs.KINDS))
    p.add_argument("--repeats", type=int, default=3, help="CPU: timed calls per tile")
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
        print("flashtile tune times the Triton kernels: run it on a CUDA device, or set "
              "TRITON_INTERPRET=1 (slow; use a short --seqlen) to check the logic on CPU",
              file=sys.stderr)
        return 2
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
