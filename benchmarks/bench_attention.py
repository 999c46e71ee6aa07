"""Speed of flashtile's forward and forward+backward beside PyTorch SDPA, on one GPU.

    python benchmarks/bench_attention.py                 # the issue-2 table (markdown)
    python benchmarks/bench_attention.py --sweep         # tile-config study for configs.py

B * seqlen = 16384 tokens, nheads = 2048 / head_dim, bf16. Median of CUDA-event timings
(triton.testing.do_bench) after warm-up. FLOPs = 4 * B * H * Nq * Nk * D, x0.5 causal,
x3.5 for forward+backward (the backward does 2.5x the forward's matrix work).
"""

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flashtile  # noqa: E402


def attn_flops(b, h, sq, sk, d, causal, mode):
    f = 4 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return f * (3.5 if mode == "fwd_bwd" else 1.0)


def make_inputs(b, s, h, d, dtype=torch.bfloat16, layout="bshd"):
    shape = (b, s, h, d) if layout == "bshd" else (b, h, s, d)
    return [torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(3)]


def provider_fn(name, causal):
    if name == "flashtile":
        return "bshd", lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal)
    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION,
               "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return "bhsd", run


def time_ms(fn, mode, q, k, v):
    if mode == "fwd":
        def step():
            with torch.no_grad():
                fn(q, k, v)
    else:
        dout = torch.randn_like(q)

        def step():
            out = fn(q, k, v)
            torch.autograd.grad(out, (q, k, v), dout)
    return triton.testing.do_bench(step, warmup=50, rep=200, return_mode="median")


def bench_table(head_dims, seqlens, providers, modes):
    rows = []
    for d, causal, mode, s in itertools.product(head_dims, (False, True), modes, seqlens):
        b, h = 16384 // s, 2048 // d
        row = dict(head_dim=d, causal=causal, mode=mode, seqlen=s, batch=b, nheads=h)
        for p in providers:
            layout, fn = provider_fn(p, causal)
            q, k, v = make_inputs(b, s, h, d, layout=layout)
            try:
                ms = time_ms(fn, mode, q, k, v)
                row[p] = attn_flops(b, h, s, s, d, causal, mode) / ms / 1e9
            except Exception as e:  # a peer that cannot run this shape: n/a, go on
                row[p] = None
                print(f"# {p} d={d} s={s} causal={causal} {mode}: {type(e).__name__}: "
                      f"{str(e)[:120]}", file=sys.stderr)
            del q, k, v
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def print_markdown(rows, providers):
    print("\n| head_dim | causal | mode | seqlen | " + " | ".join(providers)
          + " | flashtile / sdpa-flash |")
    print("|---" * (5 + len(providers)) + "|")
    for r in rows:
        vals = ["n/a" if r[p] is None else f"{r[p]:.0f}" for p in providers]
        ratio = (f"{r['flashtile'] / r['sdpa-flash']:.2f}"
                 if r.get("sdpa-flash") and r.get("flashtile") else "n/a")
        print(f"| {r['head_dim']} | {r['causal']} | {r['mode']} | {r['seqlen']} | "
              + " | ".join(vals) + f" | {ratio} |")
    print("\nTFLOP/s (median); B*seqlen = 16384, nheads = 2048/head_dim, bf16.")


# Candidates for the tile study: (BLOCK_M, BLOCK_N, num_warps, num_stages).
FWD_CANDIDATES = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 8, 4),
                  (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3)]
DKDV_CANDIDATES = [(32, 128, 8, 3), (32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 8, 2),
                   (64, 64, 8, 3), (32, 64, 4, 3), (32, 64, 8, 2), (16, 64, 4, 2)]
DQ_CANDIDATES = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 2),
                 (128, 32, 8, 3), (64, 32, 4, 3), (64, 64, 4, 2)]


def sweep(head_dims, seqlen=4096):
    """Time every candidate tile per kernel; check each one's output against SDPA."""
    results = []
    for d, causal in itertools.product(head_dims, (False, True)):
        b, h = 16384 // seqlen, 2048 // d
        q, k, v = make_inputs(b, seqlen, h, d)
        dout = torch.randn_like(q)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
            ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            ref_grads = torch.autograd.grad(ref, (qt, kt, vt), dout.transpose(1, 2))
        ref = ref.transpose(1, 2)
        ref_grads = [g.transpose(1, 2) for g in ref_grads]
        for kind, cands in (("fwd", FWD_CANDIDATES), ("bwd_dkdv", DKDV_CANDIDATES),
                            ("bwd_dq", DQ_CANDIDATES)):
            for cfg in cands:
                os.environ[f"FLASHTILE_{kind.upper()}_CONFIG"] = ",".join(map(str, cfg))
                rec = dict(kernel=kind, head_dim=d, causal=causal, cfg=cfg)
                try:
                    out = flashtile.flash_attn_func(q, k, v, causal=causal)
                    grads = torch.autograd.grad(out, (q, k, v), dout)
                    err_o = (out.float() - ref.float()).abs().max().item()
                    err_g = max((a.float() - r.float()).abs().max().item()
                                for a, r in zip(grads, ref_grads))
                    rec["err_out"], rec["err_grad"] = err_o, err_g
                    mode = "fwd" if kind == "fwd" else "fwd_bwd"
                    ms = time_ms(lambda a, b_, c: flashtile.flash_attn_func(
                        a, b_, c, causal=causal), mode, q, k, v)
                    rec["ms"] = ms
                    rec["tflops"] = attn_flops(b, h, seqlen, seqlen, d, causal, mode) / ms / 1e9
                    rec["ok"] = bool(err_o < 0.05 and err_g < 0.5)
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {str(e)[:100]}"
                del os.environ[f"FLASHTILE_{kind.upper()}_CONFIG"]
                results.append(rec)
                print(json.dumps(rec), flush=True)
    print("\n| kernel | head_dim | causal | BLOCK_M, BLOCK_N, warps, stages | TFLOP/s | ok |")
    print("|---|---|---|---|---|---|")
    for r in results:
        tf = f"{r['tflops']:.0f}" if "tflops" in r else r.get("error", "?")[:40]
        print(f"| {r['kernel']} | {r['head_dim']} | {r['causal']} | {r['cfg']} | {tf} | "
              f"{r.get('ok', False)} |")
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--headdim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--providers", nargs="+",
                    default=["flashtile", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"])
    ap.add_argument("--json", help="write raw results here")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"triton {triton.__version__}")
    if args.sweep:
        rows = sweep(args.headdim)
    else:
        rows = bench_table(args.headdim, args.seqlens, args.providers, args.modes)
        print_markdown(rows, args.providers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
