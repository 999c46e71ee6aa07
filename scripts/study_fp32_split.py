"""Study (session 23, issue 15 item 5; retire it once it has decided): does fp32 attention
on the H200 gain from splitting K and V into TF32 high and low parts once per call,
instead of Triton's tf32x3 splitting both operands of every product inside the loop?

One minimal forward kernel (non-causal, no masks, head dims 64 and 128) in two modes:
- MODE 0: ``tl.dot(..., input_precision="tf32x3")``, what FLASHTILE_FP32_PRECISION=tf32x3
  asks of the product kernels.
- MODE 1: K and V split on the host (hi = the top 19 bits, lo = x - hi: exact), Q and P
  split in registers the same way, three TF32 products each (lo x hi + hi x lo + hi x hi,
  the small terms first). The sm_90 compile (CPU, session 23) has half MODE 0's ALU
  instructions and a third of its shared-memory stores, at more shared memory: at d128
  128 x 32 with 2 stages it needs 256 KiB (n/a on the GPU), with 1 stage 176.

Printed per (head dim, tiles): each mode's time and its max error against float64, MODE
1's host split timed on its own, flashtile's own forward under tf32x3 and SDPA's
efficient backend (whose fp32 is CUTLASS's 3xTF32) beside them. Usage on the GPU:
``python3 scripts/study_fp32_split.py``.
"""

import os

import torch
import triton
import triton.language as tl

HI_MASK = -8192  # 0xFFFFE000 as an int32: keeps sign, exponent and TF32's 10 mantissa bits


@triton.jit
def _hi(x):
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _attn(Q, K, V, KLO, VLO, O, n_ctx, qk_scale, D: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, MODE: tl.constexpr):
    pid, bh = tl.program_id(0), tl.program_id(1)
    offs_m = pid * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    base = bh.to(tl.int64) * n_ctx * D
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    if MODE == 1:
        q_hi = _hi(q)
        q_lo = q - q_hi
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, n_ctx, BN):
        kv = base + (start + offs_n)[:, None] * D + offs_d[None, :]
        k = tl.load(K + kv)
        v = tl.load(V + kv)
        if MODE == 0:
            s = tl.dot(q, tl.trans(k), input_precision="tf32x3")
        else:
            k_lo = tl.load(KLO + kv)
            s = tl.dot(q_lo, tl.trans(k), input_precision="tf32")
            s = tl.dot(q_hi, tl.trans(k_lo), s, input_precision="tf32")
            s = tl.dot(q_hi, tl.trans(k), s, input_precision="tf32")
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MODE == 0:
            acc = tl.dot(p, v, acc, input_precision="tf32x3")
        else:
            v_lo = tl.load(VLO + kv)
            p_hi = _hi(p)
            p_lo = p - p_hi
            pv = tl.dot(p_lo, v, input_precision="tf32")
            pv = tl.dot(p_hi, v_lo, pv, input_precision="tf32")
            acc = tl.dot(p_hi, v, acc + pv, input_precision="tf32")
        m_i = m_new
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], acc / l_i[:, None])


def split(x):
    """(hi, lo) with hi + lo == x exactly, hi TF32-representable."""
    hi = (x.view(torch.int32) & HI_MASK).view(torch.float32)
    return hi, x - hi


def run(q, k, v, mode, tiles, parts=None):
    """q, k, v: (batch * heads, n, d) contiguous fp32."""
    bh, n, d = q.shape
    bm, bn, warps, stages = tiles
    if mode == 1:
        (k, k_lo), (v, v_lo) = parts or (split(k), split(v))
    else:
        k_lo, v_lo = k, v
    out = torch.empty_like(q)
    _attn[(n // bm, bh)](q, k, v, k_lo, v_lo, out, n, d ** -0.5 * 1.4426950408889634,
                         D=d, BM=bm, BN=bn, MODE=mode, num_warps=warps, num_stages=stages)
    return out


def main():
    import flashtile

    torch.manual_seed(0)
    bench = triton.testing.do_bench
    for d, tile_list in ((64, [(64, 32, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2)]),
                         (128, [(64, 32, 4, 2), (128, 32, 8, 1), (128, 32, 8, 2)])):
        b, h, n = 2, 16, 4096
        q, k, v = (torch.randn(b * h, n, d, device="cuda") for _ in "qkv")
        ref = torch.softmax((q.double() @ k.double().transpose(1, 2)) * d ** -0.5,
                            -1) @ v.double()
        flops = 4 * b * h * n * n * d
        parts = (split(k), split(v))
        t_split = bench(lambda: (split(k), split(v)), warmup=25, rep=100)
        print(f"d{d} host split of K and V: {t_split:.3f} ms")
        for tiles in tile_list:
            for mode in (0, 1):
                try:
                    err = (run(q, k, v, mode, tiles) - ref).abs().max().item()
                    ms = bench(lambda: run(q, k, v, mode, tiles, parts), warmup=25, rep=200)
                    print(f"d{d} {tiles} mode {mode}: {ms:.3f} ms "
                          f"{flops / ms / 1e9:.1f} TFLOP/s, max err {err:.2e}")
                except Exception as e:  # a tile that does not fit: say so, go on
                    print(f"d{d} {tiles} mode {mode}: n/a ({type(e).__name__}: "
                          f"{str(e)[:80]})")
        qb, kb, vb = (x.view(b, h, n, d).transpose(1, 2) for x in (q, k, v))
        os.environ["FLASHTILE_FP32_PRECISION"] = "tf32x3"
        ours = flashtile.flash_attn_func(qb, kb, vb)
        err = (ours.transpose(1, 2).reshape(b * h, n, d) - ref).abs().max().item()
        ms = bench(lambda: flashtile.flash_attn_func(qb, kb, vb), warmup=25, rep=200)
        print(f"d{d} flashtile tf32x3: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s, "
              f"max err {err:.2e}")
        del os.environ["FLASHTILE_FP32_PRECISION"]
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qs, ks, vs = (x.view(b, h, n, d) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            sd = torch.nn.functional.scaled_dot_product_attention
            err = (sd(qs, ks, vs).reshape(b * h, n, d) - ref).abs().max().item()
            ms = bench(lambda: sd(qs, ks, vs), warmup=25, rep=200)
        print(f"d{d} sdpa-efficient: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s, "
              f"max err {err:.2e}")


if __name__ == "__main__":
    main()
