"""Batch-1 decode kernels under Nsight Compute, and the same caches timed (H200 study).

`python3 benchmarks/ncu_decode.py --time` times one batch x 8k-key decode step (CUDA graph
replay of one input set, so L2-warm: NOTES.md section 12; interleaved rounds) for four
caches: contiguous, page 64 and page 16 in random
pool order, and page 16 in pool order (the block table is 0, 1, 2, ...: the contiguous
cache's exact memory layout read through the paged kernel). Without --time it runs one
step per cache between cudaProfilerStart/Stop, for
`ncu --profile-from-start off -k regex:_decode_kernel ... python3 benchmarks/ncu_decode.py`.
"""

import sys

import torch

from flashtile.bench.decode import (HEAD_DIM, NHEADS_KV, _decode_inputs, _kvcache_fn,
                                    _paged_pool, kv_bytes, median, time_rounds)

BATCH, SEQLEN_K = 1, 8192


def caches(k, v):
    pages = SEQLEN_K // 16
    shape = (BATCH * pages, 16, NHEADS_KV, HEAD_DIM)
    table = torch.arange(BATCH * pages, dtype=torch.int32, device=k.device)
    in_order = (k.reshape(shape), v.reshape(shape), table.view(BATCH, pages))
    return {"contiguous": (k, v), "page64": _paged_pool(k, v, 64),
            "page16": _paged_pool(k, v, 16), "page16_in_order": in_order}


def main():
    q, k, v, seqlens = _decode_inputs(BATCH, SEQLEN_K, "cuda")
    fns = {name: _kvcache_fn(q, seqlens, *args) for name, args in caches(k, v).items()}
    base = _kvcache_fn(q, seqlens, k, v, num_splits=1)()
    for name, fn in fns.items():
        for _ in range(3):
            out = fn()
        err = (out.float() - base.float()).abs().max().item()
        assert err < 2e-2, (name, err)
    torch.cuda.synchronize()
    if "--time" not in sys.argv:
        torch.cuda.profiler.start()
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("profiled:", " ".join(fns))
        return
    times = time_rounds({name: [fn] for name, fn in fns.items()}, rounds=5, rep=50)
    for name, us in times.items():
        med = median(us)
        print(f"({BATCH}, {SEQLEN_K}) {name}: median {med:.2f} us "
              f"({kv_bytes(BATCH, SEQLEN_K) / (med * 1e3):.0f} GB/s), rounds "
              + " ".join(f"{u:.2f}" for u in us), flush=True)


if __name__ == "__main__":
    main()
