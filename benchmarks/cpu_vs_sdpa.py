"""flashtile's CPU path beside PyTorch's own CPU SDPA, forward and forward+backward.

    python benchmarks/cpu_vs_sdpa.py [--shapes 1x4096 2x2048 4x1024 4x512] [--nheads 8]
                                     [--headdim 64] [--rounds 5] [--dtype fp32]
                                     [--bottom-right 1x512x4096 1x1024x2048]

Providers from the bench registry (``flashtile bench``'s own): flashtile, sdpa-flash
(SDPA's flash backend: PyTorch's fused CPU kernel) and sdpa-math. On a shared CPU the
load changes from second to second, so every cell interleaves the providers: after each
one's warm-up, ``--rounds`` rounds time one call of each, in a rotating order, and the
table gives the median per provider. A second table takes bottom-right causal attention
with seqlen_q < seqlen_k (chunked prefill), which SDPA's is_causal (top-left) cannot
express: flashtile (two fused calls merged through the lse), flashtile's tiled path,
and SDPA's flash backend given the bool mask. Prints markdown (docs/benchmarks/cpu.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile import _torch_backend
from flashtile.bench import machine, registry, run
from flashtile.bench.commands import DTYPES

PROVIDERS = ("flashtile", "sdpa-flash", "sdpa-math")


def _shape(text: str) -> tuple[int, int]:
    batch, seqlen = text.lower().split("x")
    return int(batch), int(seqlen)


def _interleaved_ms(steps: dict, rounds: int) -> dict[str, float]:
    """Median ms of one call per step, the steps interleaved round by round."""
    for step in steps.values():
        run.time_step(step, "cpu", repeats=1)  # the runner's warm-up
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _cell_ms(cells, rounds: int) -> dict[str, float]:
    steps = {}
    for cell in cells:
        provider = registry.PROVIDERS[cell.provider]
        steps[cell.provider] = run.make_step(provider.build(cell, "cpu"), cell.mode,
                                             run.make_inputs(cell, provider.layout, "cpu"))
    return _interleaved_ms(steps, rounds)


def _tiled(q, k, v):
    with mock.patch.object(_torch_backend, "_plan", lambda *args, **kwargs: None):
        return flashtile.flash_attn_func(q, k, v, causal=True)


def _sdpa_flash_masked(q, k, v):
    sq, sk = q.shape[1], k.shape[1]
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)  # bottom-right causal
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                             attn_mask=mask)
    return out.transpose(1, 2)


def _bottom_right_ms(batch, sq, sk, args, mode, rounds):
    gen = torch.Generator().manual_seed(0)
    shapes = [(batch, s, args.nheads, args.headdim) for s in (sq, sk, sk, sq)]
    xs = [torch.randn(shape, generator=gen, dtype=DTYPES[args.dtype]) for shape in shapes]
    for x in xs[:3]:
        x.requires_grad_(mode == "fwd_bwd")
    attns = {"flashtile": lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True),
             "flashtile tiled": _tiled, "sdpa-flash + bool mask": _sdpa_flash_masked}
    return _interleaved_ms({name: run.make_step(attn, mode, [tuple(xs)])
                            for name, attn in attns.items()}, rounds)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=_shape, nargs="+",
                   default=[(1, 4096), (2, 2048), (4, 1024), (4, 512)],
                   help="BATCHxSEQLEN (seqlen_q = seqlen_k)")
    p.add_argument("--nheads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--bottom-right", type=lambda t: tuple(map(int, t.lower().split("x"))),
                   nargs="*", default=[(1, 512, 4096), (1, 1024, 2048)],
                   help="BATCHxSEQLEN_QxSEQLEN_K cases of the second table (none: skip it)")
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
    if not args.bottom_right:
        return
    print("\nBottom-right causal, seqlen_q < seqlen_k:\n")
    print("| batch x seqlen_q x seqlen_k | mode | flashtile ms | flashtile tiled ms "
          "| sdpa-flash + bool mask ms |")
    print("|---|---|---:|---:|---:|")
    for batch, sq, sk in args.bottom_right:
        for mode in registry.MODES:
            ms = _bottom_right_ms(batch, sq, sk, args, mode, args.rounds)
            print(f"| {batch} x {sq} x {sk} | {mode} | "
                  + " | ".join(f"{t:.1f}" for t in ms.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
