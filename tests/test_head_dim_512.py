"""head_dim above 256, up to 512 (issue 17 item 3): forward and backward (dense and
varlen) and decode over a paged cache with splits, against float64, with the accuracy
rule of the other tests. Small shapes: the interpreter runs (BLOCK, 512) tiles."""

import pytest
import torch

import flashtile
from flashtile.reference import attention_naive
from tests.utils import assert_close_rule, reference_pair


def _dtypes(device):
    return [torch.float16, torch.bfloat16] if device.type == "cuda" else \
        [torch.float32, torch.float16]


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-fused"], indirect=True)
@pytest.mark.parametrize("head_dim", [320, 512])  # 320: padded to 512 and masked
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_bwd(backend, device, head_dim, causal):
    for dtype in _dtypes(device):
        torch.manual_seed(0)
        q = torch.randn(1, 19, 2, head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(1, 23, 1, head_dim, dtype=dtype, device=device)
                for _ in range(2))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = flashtile.flash_attn_func(qg, kg, vg, causal=causal)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad((out * dout).sum(), (qg, kg, vg))
        (o64, _, g64), (o_pt, _, g_pt) = reference_pair(q, k, v, dout, causal=causal)
        assert_close_rule("out", out, o64, o_pt)
        for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
            assert_close_rule(name, ours, r64, rpt)


def test_varlen_forward(backend, device):
    torch.manual_seed(1)
    dtype = _dtypes(device)[-1]
    lens = [5, 17]
    q, k, v = (torch.randn(sum(lens), 2, 512, dtype=dtype, device=device)
               for _ in range(3))
    cu = torch.tensor([0, 5, 22], dtype=torch.int32, device=device)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 17, 17, causal=True)
    start = 0
    for n in lens:
        s = slice(start, start + n)
        o64 = attention_naive(*(x[s][None].double() for x in (q, k, v)), causal=True)[0]
        o_pt = attention_naive(*(x[s][None] for x in (q, k, v)), causal=True,
                               upcast=False)[0]
        assert_close_rule("out", out[s][None], o64, o_pt)
        start += n


def test_paged_decode_with_splits(backend, device):
    torch.manual_seed(2)
    dtype = _dtypes(device)[-1]
    b, ps, blocks, hkv, d = 2, 16, 8, 1, 512
    k_cache = torch.randn(blocks, ps, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn(blocks, ps, hkv, d, dtype=dtype, device=device)
    block_table = torch.tensor([[3, 0, 6, 1], [5, 2, 7, 4]], dtype=torch.int32,
                               device=device)
    seqlens = torch.tensor([37, 64], dtype=torch.int32, device=device)
    q = torch.randn(b, 1, 4, d, dtype=dtype, device=device)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                            block_table=block_table, num_splits=3)
    for i in range(b):
        n = int(seqlens[i])
        rows = torch.cat([torch.arange(p * ps, p * ps + ps) for p in block_table[i].tolist()])
        ks = k_cache.flatten(0, 1)[rows[:n].to(device)][None]
        vs = v_cache.flatten(0, 1)[rows[:n].to(device)][None]
        o64 = attention_naive(q[i:i + 1].double(), ks.double(), vs.double())[0]
        o_pt = attention_naive(q[i:i + 1], ks, vs, upcast=False)[0]
        assert_close_rule("out", out[i:i + 1], o64, o_pt)
