"""What a batch-1 decode step could cost at best on this GPU (H200 study, NOTES 12).

Numbers for batch 1 x 8k keys (33.5 MB of K and V), each step rotating through
copies worth three times the L2, as the decode table does:
- a streaming read of the same bytes (a Triton kernel, two programs per SM, each summing
  its share): the cold read floor;
- flashtile's decode step with cache_seqlens = 64 over the same caches and split count:
  the fixed cost (launches, split partials, combine) with almost no bytes;
- the full step, beside cuDNN's SDPA;
- strided reads of the cache as the decode kernel reads it, each program taking the
  rows of 1, 2, 4 or all 8 KV heads (pieces of 256 B to the whole 2 KB token row): does
  reading one head's 256 B of each token cost DRAM efficiency?
`--warm-l2` times one copy instead (its bytes partly in the L2 from the last replay).
"""

import sys

import torch
import triton
import triton.language as tl

from flashtile.bench.decode import (HEAD_DIM, NHEADS_KV, _decode_inputs, _kvcache_fn,
                                    cache_copies, kv_bytes, median,
                                    time_rounds)

BATCH, SEQLEN_K = 1, 8192


@triton.jit
def _read_kernel(X, Out, n, per_program, BLOCK: tl.constexpr):
    start = tl.program_id(0) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(start, tl.minimum(start + per_program, n), BLOCK, num_stages=4):
        offs = off + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(Out + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _read_heads_kernel(X, Out, rows, rows_per_program, groups, HEADS: tl.constexpr,
                       BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, ROW: tl.constexpr):
    group = tl.program_id(0) % groups
    start = tl.program_id(0) // groups * rows_per_program
    offs_c = group * HEADS * HEAD_DIM + tl.arange(0, HEADS * HEAD_DIM)
    acc = tl.zeros([BLOCK_R, HEADS * HEAD_DIM], dtype=tl.float32)
    for r in tl.range(start, tl.minimum(start + rows_per_program, rows), BLOCK_R,
                      num_stages=3):
        offs_r = r + tl.arange(0, BLOCK_R)
        acc += tl.load(X + offs_r[:, None] * ROW + offs_c[None, :],
                       mask=offs_r[:, None] < rows, other=0.0).to(tl.float32)
    tl.store(Out + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


def read_heads_step(x, out, programs, heads):
    """Programs each read `heads` of the 8 KV heads' 256 B pieces of a token row range."""
    rows = x.numel() // (NHEADS_KV * HEAD_DIM)
    groups = NHEADS_KV // heads
    per = triton.cdiv(triton.cdiv(rows, programs // groups), 64) * 64
    return lambda: _read_heads_kernel[(groups * triton.cdiv(rows, per),)](
        x, out, rows, per, groups, HEADS=heads, BLOCK_R=64 // heads, HEAD_DIM=HEAD_DIM,
        ROW=NHEADS_KV * HEAD_DIM, num_warps=4)


def read_step(x, out, programs):
    n = x.numel()
    per_program = triton.cdiv(triton.cdiv(n, programs), 4096) * 4096
    return lambda: _read_kernel[(programs,)](x, out, n, per_program, BLOCK=4096,
                                             num_warps=8)


def main():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    copies = 1 if "--warm-l2" in sys.argv else cache_copies(BATCH, SEQLEN_K, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes = kv_bytes(BATCH, SEQLEN_K)
    sets = [_decode_inputs(BATCH, SEQLEN_K, "cuda") for _ in range(copies)]
    flat = [torch.cat([k.view(-1), v.view(-1)]) for _, k, v, _ in sets]
    out = torch.empty(64 * sms, device="cuda")
    short = torch.full((BATCH,), 64, dtype=torch.int32, device="cuda")

    def cudnn(q, k, v):
        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                      v.transpose(1, 2), enable_gqa=True)
        return run

    steps = {
        "read 2/SM": [read_step(x, out, 2 * sms) for x in flat],
        "read 4/SM": [read_step(x, out, 4 * sms) for x in flat],
        "torch.sum": [(lambda x=x: x.sum()) for x in flat],
        **{f"read {h} head(s) a program": [read_heads_step(x, out, 2 * sms, h) for x in flat]
           for h in (1, 2, 4, 8)},
        "decode, 64 keys": [_kvcache_fn(q, short, k, v) for q, k, v, _ in sets],
        "decode, 8k keys": [_kvcache_fn(q, s, k, v) for q, k, v, s in sets],
        "cudnn, 8k keys": [cudnn(q, k, v) for q, k, v, _ in sets],
    }
    times = time_rounds(steps)
    print(f"batch {BATCH} x {SEQLEN_K} keys, {nbytes / 1e6:.1f} MB of K and V, "
          f"{copies} copies rotated")
    for name, us in times.items():
        print(f"{name}: {median(us):.2f} us ({nbytes / median(us) / 1e3:.0f} GB/s of the K/V bytes), "
              "rounds " + " ".join(f"{u:.2f}" for u in us), flush=True)


if __name__ == "__main__":
    main()
