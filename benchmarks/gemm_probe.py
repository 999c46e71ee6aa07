"""Probe (session 40, issue 14): can a Triton matrix product beat cuBLAS's at the engine's
decode batches of 64-256 rows, where the Qwen2.5-0.5B shape spends ~0.83 ms of a 2.04 ms
batch-256 step in products running at 2-3x their floors (NOTES.md sections 26-28)?

y[M, N] = x[M, K] @ W[N, K]^T, bf16 in, fp32 accumulation, bf16 out, with tensor cores
(tl.dot: wgmma on sm_90) fed by TMA (Hopper's way; pointer tiles spilled at BLOCK_K 128). At these sizes a product is a few output tiles (qkv at M 256:
2 x 9 tiles of 128 x 128 on 132 SMs), so the candidates trade tile size against the
grid: smaller tiles, and split-K (SPLIT programs share an output tile over slices of K,
adding fp32 partials with atomics into a zeroed buffer, then one cast: two more
kernels, counted). Timing as session 38's GEMV probe: each provider's launches captured
64 at a time in a CUDA graph over enough weight copies to be 4x the L2 (every launch
reads its weights from DRAM, as a decode step does); us per product, the best config per
shape, and a layer's sum (qkv + o + gate_up + down) beside cuBLAS's.

    python3 benchmarks/gemm_probe.py [--check]   (--check: correctness only, any device)

The configs (a few dozen), each compiled once (~2-3 min), then timed at every shape (~1-2 min).
"""

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashtile.bench.step_kernels import graph_us


@triton.jit
def gemm_kernel(x_desc, w_desc, y_desc, M, N, K, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """Program (tile, split): output tile `tile` over K slice `split` of SPLIT, every
    operand through a TMA descriptor (no pointer tiles in registers; TMA fills rows and
    columns past the tensor with zeros and stores none of them); with SPLIT > 1 y is a
    zeroed fp32 buffer the slices add into (TMA reduce-adds)."""
    pid, split = tl.program_id(0), tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    off_m = (pid // tiles_n) * BLOCK_M
    off_n = (pid % tiles_n) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(split * per_split, tl.minimum(K, (split + 1) * per_split), BLOCK_K):
        x = x_desc.load([off_m, k0])
        w = w_desc.load([off_n, k0])
        acc = tl.dot(x, tl.trans(w), acc)
    if SPLIT > 1:
        y_desc.atomic_add([off_m, off_n], acc)
    else:
        y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


def gemm(x, w, cfg):
    """x @ w.T with cfg = (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT)."""
    bm, bn, bk, warps, stages, split = cfg
    (m, k), n = x.shape, w.shape[0]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    if split == 1:
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    else:
        y = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    gemm_kernel[grid](TensorDescriptor.from_tensor(x, [bm, bk]),
                      TensorDescriptor.from_tensor(w, [bn, bk]),
                      TensorDescriptor.from_tensor(y, [bm, bn]), m, n, k,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, num_warps=warps,
                      num_stages=stages)
    return y if split == 1 else y.to(x.dtype)


# (name, N, K) of the decode products: qkv, o, gate_up, down (the LM head runs at 680
# TFLOP/s there already, section 26).
SHAPES = {
    "qwen2.5-0.5b": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896),
                     ("down", 896, 4864)],
    "llama-3.2-1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048),
                     ("down", 2048, 8192)],
}


def smem_bytes(bm, bn, bk, stages, split):
    """The ring of x and W tiles and the output's staging tile (fp32 when split): the
    sm_90 compiles of this kernel match it to within 24 bytes."""
    return stages * (bm + bn) * bk * 2 + bm * bn * (4 if split > 1 else 2)


CONFIGS = [(bm, bn, bk, warps, stages, split)
           for bm, bn, bk, warps, stages, split in itertools.product(
               (64, 128), (64, 128, 256), (64, 128), (4, 8), (3,), (1, 2, 4, 8))
           if (bm * bn <= 128 * 128 or warps == 8)
           and smem_bytes(bm, bn, bk, stages, split) <= 224 * 1024]


def check(device, dtype):
    torch.manual_seed(0)
    # The interpreter has no TMA reduce-add: split-K is checked on the GPU (and every
    # timed config is validated first there).
    small = [(16, 16, 16, 4, 1, 1), (16, 32, 16, 4, 1, 1), (32, 16, 32, 4, 1, 1)]
    cfgs = small if device == "cpu" else [CONFIGS[0], CONFIGS[-1], (64, 128, 64, 4, 3, 4)]
    # TMA: every row 16-byte aligned (the engine's shapes are).
    for (m, n, k), cfg in itertools.product([(37, 40, 96), (64, 72, 160), (5, 32, 48)],
                                            cfgs):
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        ref = x.double() @ w.double().T
        err = (gemm(x, w, cfg).double() - ref).abs().max().item()
        tol = 2e-2 * ref.abs().max().item() if dtype != torch.float32 else 1e-3 * k
        assert err <= tol, (m, n, k, cfg, err, tol)
    print("check passed", device, dtype)


def graph_time(fn, copies, reps=64):
    """us per call of fn(i), reps calls over the weight copies captured in one CUDA graph
    (step_kernels.graph_us: the median of its replays)."""
    return graph_us([lambda i=i: fn(i % copies) for i in range(reps)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--ms", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--models", nargs="+", default=list(SHAPES))
    p.add_argument("--json")
    a = p.parse_args()
    if a.check or not torch.cuda.is_available():
        # fp32 on the CPU (the interpreter); bf16 on the GPU.
        check("cuda" if torch.cuda.is_available() else "cpu",
              torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        return
    check("cuda", torch.bfloat16)
    props = torch.cuda.get_device_properties(0)
    rows, layer = [], {}
    print(f"# {props.name}")
    print("| model | product | N | K | M | cuBLAS us | best Triton us | config "
          "| Triton / cuBLAS |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    for model, m in itertools.product(a.models, a.ms):
        for name, n, k in SHAPES[model]:
            copies = max(2, 4 * props.L2_cache_size // (n * k * 2) + 1)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                  for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, ws[0])
            cublas = graph_time(lambda i: torch.nn.functional.linear(x, ws[i]), copies)
            best = None
            for cfg in CONFIGS:
                if cfg[0] > 2 * triton.next_power_of_2(m) or cfg[5] * cfg[2] > k:
                    continue
                try:
                    got = gemm(x, ws[0], cfg)
                    # Validated before it is timed (a config that compiles wrong is out).
                    if (got.float() - ref.float()).abs().max() > 0.05 * ref.abs().max():
                        continue
                    us = graph_time(lambda i, c=cfg: gemm(x, ws[i], c), copies)
                except Exception:  # out of shared memory or registers: not a candidate
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            del ws
            row = dict(model=model, product=name, n=n, k=k, m=m, cublas_us=cublas,
                       triton_us=best and best[0], config=best and best[1])
            rows.append(row)
            sums = layer.setdefault((model, m), [0.0, 0.0])
            sums[0] += cublas
            sums[1] += best[0] if best else cublas
            print(f"| {model} | {name} | {n} | {k} | {m} | {cublas:.2f} | "
                  + (f"{best[0]:.2f} | {best[1]} | {best[0] / cublas:.2f} |" if best
                     else "- | - | - |"), flush=True)
    print("\n| model | M | layer: cuBLAS us | layer: best Triton per product us | ratio |")
    print("|---|---:|---:|---:|---:|")
    for (model, m), (c, t) in layer.items():
        print(f"| {model} | {m} | {c:.1f} | {t:.1f} | {t / c:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
