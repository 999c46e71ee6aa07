"""A/B of decode launcher knobs on the same inputs, interleaved rounds (H200 studies).

`python3 benchmarks/ab_decode.py NAME=A,B [NAME=A,B ...]` sets flashtile.ops.decode.NAME
to each value in turn and times flashtile (contiguous, page 64, page 16) at the split
shapes of issue 4's table, three rounds, CUDA graphs, checking each result against the
unsplit contiguous output first. Each step rotates through copies of the inputs that
together exceed the L2 three times, as the decode table does (cold caches).
"""

import itertools
import sys

import torch
import triton

from flashtile.bench.decode import (_decode_inputs, _kvcache_fn, _paged_pool, cache_copies,
                                    in_turn, kv_bytes)
from flashtile.ops import decode

SHAPES = [(1, 8192), (8, 8192), (1, 131072)]


def main():
    knobs = {}
    for arg in sys.argv[1:]:
        name, values = arg.split("=")
        if not hasattr(decode, name):
            raise SystemExit(f"flashtile.ops.decode has no {name}")
        knobs[name] = [int(v) for v in values.split(",")]
    settings = [dict(zip(knobs, combo)) for combo in itertools.product(*knobs.values())]
    for batch, seqlen_k in SHAPES:
        sets = []
        for _ in range(cache_copies(batch, seqlen_k, "cuda")):
            q, k, v, seqlens = _decode_inputs(batch, seqlen_k, "cuda")
            caches = {"contiguous": (k, v)}
            caches.update({f"page{p}": _paged_pool(k, v, p) for p in (64, 16)})
            sets.append((q, seqlens, caches))
        q, seqlens, caches = sets[0]
        base = _kvcache_fn(q, seqlens, *caches["contiguous"], num_splits=1)()
        times = {}
        for _round in range(3):
            for setting in settings:
                for name, value in setting.items():
                    setattr(decode, name, value)
                for cache, args in caches.items():
                    err = (_kvcache_fn(q, seqlens, *args)().float() - base.float()).abs().max()
                    assert err.item() < 2e-2, (setting, cache, err.item())
                    fns = [_kvcache_fn(qc, sc, *cc[cache]) for qc, sc, cc in sets]
                    ms = triton.testing.do_bench_cudagraph(in_turn(fns), rep=50,
                                                           return_mode="median") / len(fns)
                    times.setdefault((str(setting), cache), []).append(ms * 1e3)
        for (setting, cache), us in times.items():
            gbps = kv_bytes(batch, seqlen_k) / (sorted(us)[1] * 1e3)
            print(f"({batch}, {seqlen_k}) {setting} {cache}: median of rounds "
                  f"{sorted(us)[1]:.2f} us ({gbps:.0f} GB/s), rounds "
                  + " ".join(f"{u:.2f}" for u in us), flush=True)
        del q, seqlens, caches, sets, base
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
