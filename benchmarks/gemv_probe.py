"""Probe (session 38, issue 14): can a Triton GEMV beat cuBLAS's skinny products at the
engine's decode shapes (M = 1-16 tokens)?

y[M, N] = x[M, K] @ W[N, K]^T, bf16 in, fp32 accumulation, bf16 out, no split-K (each
program owns BLOCK_N output features over all of K, so the result is deterministic and
needs no second kernel). M rows are handled by a 3D broadcast product [BM, BN, BK] summed
over K: no tensor cores, which at M <= 16 would idle 7/8 of an m64 wgmma anyway.

Timing: each provider's launches captured R at a time in a CUDA graph (as the engine
replays its decode step), cycling through enough weight copies that the set is 4x the L2,
so every launch reads its weights from DRAM as a decode step does. Reports us per launch,
the weight bytes' share of the copy bandwidth, and the best config per shape.

    python3 benchmarks/gemv_probe.py [--check]   (--check: correctness only, any device)
"""

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_ok = offs_n < N
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        if DOT:  # mma.sync over M padded to 16 rows
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


def gemv(x, w, cfg):
    bn, bk, warps, stages, dot = cfg
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    bm = max(16 if dot else 1, triton.next_power_of_2(M))
    gemv_kernel[(triton.cdiv(N, bn),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT=dot, num_warps=warps,
                                       num_stages=stages)
    return y


# (name, N, K) of each model's decode products: qkv, o, gate_up, down, lm_head.
SHAPES = {
    "qwen2.5-0.5b": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896),
                     ("down", 896, 4864), ("lm_head", 151936, 896)],
    "llama-3.2-1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048),
                     ("down", 2048, 8192)],
    "llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                   ("down", 4096, 14336)],
}
# (BLOCK_N, BLOCK_K, warps, stages, DOT): weight tiles of at most 16 KB. sm_90 compiles
# showed the FMA form's loads unpipelined (stages change nothing), and DOT's 64 x 256
# spilling.
CONFIGS = [c + (1, False) for c in itertools.product((4, 8, 16, 32), (256, 512, 1024, 2048),
                                                     (4, 8)) if c[0] * c[1] <= 8192]
CONFIGS += [(bn, bk, 4, 3, True) for bn, bk in ((16, 128), (16, 256), (32, 128), (32, 256),
                                                 (64, 128))]


def fits(cfg, m):
    """At most ~64 fp32 registers a thread for the FMA form's [M, BN, BK] product."""
    bn, bk, warps, _, dot = cfg
    return dot or triton.next_power_of_2(m) * bn * bk <= 64 * 32 * warps


def check(device, dtype):
    torch.manual_seed(0)
    for (m, n, k), cfg in itertools.product([(1, 37, 200), (3, 64, 896), (5, 100, 130),
                                             (16, 48, 1000)], [(4, 128, 2, 1, False), (16, 256, 4, 3, False), (16, 128, 4, 3, True)]):
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        ref = (x.double() @ w.double().T)
        got = gemv(x, w, cfg).double()
        err = (got - ref).abs().max().item()
        tol = 2e-2 * ref.abs().max().item() if dtype != torch.float32 else 1e-4 * k
        assert err <= tol, (m, n, k, cfg, err, tol)
    print("check passed", device, dtype)


def graph_time(fn, copies, reps=64, rounds=5):
    """us per call of fn(i) captured reps at a time in a CUDA graph, median of rounds."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i % copies)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 16])
    p.add_argument("--models", nargs="+", default=list(SHAPES))
    p.add_argument("--json")
    a = p.parse_args()
    if a.check or not torch.cuda.is_available():
        # fp32 on the CPU (the interpreter); on the GPU DOT's fp32 products would be TF32.
        check("cuda" if torch.cuda.is_available() else "cpu",
              torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        return
    check("cuda", torch.bfloat16)
    props = torch.cuda.get_device_properties(0)
    bw = 4.24e12 if "H200" in props.name else 3.0e12  # copy bandwidth measured (KINDS.md)
    l2 = props.L2_cache_size
    rows = []
    print(f"# {props.name}; copy bandwidth taken as {bw / 1e12:.2f} TB/s")
    print("| model | product | N | K | M | cuBLAS us | best Triton us | config | Triton/cuBLAS "
          "| cuBLAS % copy | Triton % copy |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for model in a.models:
        for name, n, k in SHAPES[model]:
            nbytes = n * k * 2
            copies = max(2, -(-4 * l2 // nbytes))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            for m in a.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ ws[0].float().T
                t_cublas = graph_time(lambda i: torch.nn.functional.linear(x, ws[i]), copies)
                best = (float("inf"), None)
                for cfg in CONFIGS:
                    if not fits(cfg, m):
                        continue
                    try:
                        got = gemv(x, ws[0], cfg).float()
                    except Exception as e:  # noqa: BLE001 - a config that cannot compile
                        print(f"  skip {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    err = (got - ref).abs().max().item()
                    assert err <= 2e-2 * ref.abs().max().item(), (model, name, m, cfg, err)
                    t = graph_time(lambda i, c=cfg: gemv(x, ws[i], c), copies)
                    best = min(best, (t, cfg))
                row = dict(model=model, product=name, N=n, K=k, M=m, cublas_us=t_cublas,
                           triton_us=best[0], config=best[1])
                rows.append(row)
                t_copy = nbytes / bw * 1e6
                print(f"| {model} | {name} | {n} | {k} | {m} | {t_cublas:.2f} | {best[0]:.2f} "
                      f"| {best[1]} | {best[0] / t_cublas:.2f} | {100 * t_copy / t_cublas:.0f}% "
                      f"| {100 * t_copy / best[0]:.0f}% |", flush=True)
            del ws
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
