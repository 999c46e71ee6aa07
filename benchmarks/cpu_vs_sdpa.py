"""flashtile's CPU path beside PyTorch's own CPU SDPA, forward and forward+backward.

    python benchmarks/cpu_vs_sdpa.py [--shapes 1x4096 2x2048 4x1024 4x512] [--nheads 8]
                                     [--headdim 64] [--rounds 5] [--dtype fp32]

Providers from the bench registry (``flashtile bench``'s own): flashtile, sdpa-flash
(SDPA's flash backend: PyTorch's fused CPU kernel) and sdpa-math. On a shared CPU the
load changes from second to second, so every cell interleaves the providers: after each
one's warm-up, ``--rounds`` rounds time one call of each, in a rotating order, and the
table gives the median per provider. Prints markdown (docs/benchmarks/cpu.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashtile.bench import machine, registry, run
from flashtile.bench.commands import DTYPES

PROVIDERS = ("flashtile", "sdpa-flash", "sdpa-math")


def _shape(text: str) -> tuple[int, int]:
    batch, seqlen = text.lower().split("x")
    return int(batch), int(seqlen)


def _cell_ms(cells, rounds: int) -> dict[str, float]:
    """Median ms of one call per provider, the providers interleaved round by round."""
    steps = {}
    for cell in cells:
        provider = registry.PROVIDERS[cell.provider]
        steps[cell.provider] = run.make_step(provider.build(cell, "cpu"), cell.mode,
                                             run.make_inputs(cell, provider.layout, "cpu"))
        run.time_step(steps[cell.provider], "cpu", repeats=1)  # the runner's warm-up
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=_shape, nargs="+",
                   default=[(1, 4096), (2, 2048), (4, 1024), (4, 512)],
                   help="BATCHxSEQLEN (seqlen_q = seqlen_k)")
    p.add_argument("--nheads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    info = machine.machine_info(torch.device("cpu"))
    print(f"{info['device']}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {args.dtype}, nheads {args.nheads}, head_dim {args.headdim}, "
          f"median of {args.rounds} interleaved rounds\n")
    print("| batch x seqlen | causal | mode | flashtile ms | sdpa-flash ms | sdpa-math ms "
          "| flashtile / best peer (time) |")
    print("|---|---|---|---:|---:|---:|---:|")
    for batch, seqlen in args.shapes:
        for causal in (False, True):
            for mode in registry.MODES:
                cells = [registry.Cell(name, args.headdim, causal, mode, seqlen, batch,
                                       args.nheads, dtype) for name in PROVIDERS]
                ms = _cell_ms(cells, args.rounds)
                best = min(ms[name] for name in PROVIDERS[1:])
                print(f"| {batch} x {seqlen} | {causal} | {mode} | "
                      + " | ".join(f"{ms[name]:.1f}" for name in PROVIDERS)
                      + f" | {ms['flashtile'] / best:.2f} |", flush=True)


if __name__ == "__main__":
    main()
