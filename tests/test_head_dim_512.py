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


# ---- Past 256 columns the kernels split the head dims across programs (head_dim_parts:
# the forward's O and V, the backward's dK, dV and dQ); each part recomputes the scores
# over the whole head dim. The tests below cross every code path the parts touch.

def test_head_dims_past_256_run_in_parts():
    from flashtile.ops import configs

    q = torch.zeros(1, dtype=torch.float16)
    for head_dim, parts in ((256, 1), (257, 2), (320, 2), (512, 2)):
        for pick in (configs.fwd_config, configs.bwd_dkdv_config, configs.bwd_dq_config,
                     configs.bwd_fused_config):
            assert pick(q, head_dim).dv_parts == parts, (pick.__name__, head_dim)
    # A narrow head dim beside a wide one still gets tl.dot's 16 columns a part.
    assert configs.part_columns(16, 2) == 16 and configs.part_columns(320, 2) == 256


def _fwd_bwd_against_reference(q, k, v, with_lse=True, **kw):
    """out, lse and the gradients of flash_attn_func against the float64 reference and
    PyTorch at q's dtype (the accuracy rule)."""
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = flashtile.flash_attn_func(qg, kg, vg, return_lse=True, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), (qg, kg, vg))
    (o64, lse64, g64), (o_pt, lse_pt, g_pt) = reference_pair(q, k, v, dout, **kw)
    assert_close_rule("out", out, o64, o_pt)
    if with_lse:
        fin = torch.isfinite(lse64)
        assert torch.equal(torch.isfinite(lse), fin)
        assert_close_rule("lse", lse[fin], lse64[fin], lse_pt[fin].float())
    for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close_rule(name, ours, r64, rpt)


# (head_dim, options): every score feature at once, at a head dim padded to 512 (EVEN_D
# False: the second part's columns past 400 are masked) and at 512.
FEATURES = {
    "d400-window-softcap-alibi": (400, dict(window_size=(9, 4), softcap=6.0, alibi=True)),
    "d512-causal-alibi-softcap": (512, dict(causal=True, softcap=4.0, alibi=True)),
}


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-fused"], indirect=True)
@pytest.mark.parametrize("case", list(FEATURES))
def test_features_fwd_bwd(backend, device, case):
    head_dim, kw = FEATURES[case]
    kw = dict(kw)
    for dtype in _dtypes(device):
        torch.manual_seed(3)
        q = torch.randn(2, 21, 4, head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(2, 29, 2, head_dim, dtype=dtype, device=device)
                for _ in range(2))
        if kw.pop("alibi", False):
            kw["alibi_slopes"] = torch.rand(2, 4, device=device)
        _fwd_bwd_against_reference(q, k, v, **kw)


# (d, dv): v's head dim in parts beside a narrower q/k (and the other way), and a q/k of
# 16 beside a v of 320: each part still takes 16 of q's columns (part_columns), the
# second all padding.
@pytest.mark.parametrize("backend", ["triton", "triton-fused"], indirect=True)
@pytest.mark.parametrize("d, dv", [(512, 128), (192, 512), (16, 320)],
                         ids=["d512-dv128", "d192-dv512", "d16-dv320"])
def test_value_head_dim_of_its_own(backend, device, d, dv):
    torch.manual_seed(4)
    dtype = _dtypes(device)[-1]
    q = torch.randn(1, 19, 2, d, dtype=dtype, device=device)
    k = torch.randn(1, 26, 1, d, dtype=dtype, device=device)
    v = torch.randn(1, 26, 1, dv, dtype=dtype, device=device)
    _fwd_bwd_against_reference(q, k, v, causal=True)


@pytest.mark.parametrize("backend", ["triton", "triton-fused"], indirect=True)
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_sdpa_mask_fwd_bwd(backend, device, mask_kind):
    """An attn_mask read tile by tile in every part (the sdpa drop-in's layout)."""
    torch.manual_seed(5)
    dtype = _dtypes(device)[-1]
    b, h, hkv, sq, sk, d = 1, 4, 2, 23, 31, 512
    q = torch.randn(b, sq, h, d, dtype=dtype, device=device)
    k, v = (torch.randn(b, sk, hkv, d, dtype=dtype, device=device) for _ in range(2))
    if mask_kind == "bool":
        mask = torch.rand(b, h, sq, sk, device=device) > 0.3
    else:
        mask = torch.randn(b, 1, sq, sk, device=device).to(dtype)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = flashtile.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (qg, kg, vg)), attn_mask=mask,
        enable_gqa=True).transpose(1, 2)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), (qg, kg, vg))
    (o64, _, g64), (o_pt, _, g_pt) = reference_pair(q, k, v, dout, attn_mask=mask,
                                                    diag_offset=0)
    assert_close_rule("out", out, o64, o_pt)
    for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close_rule(name, ours, r64, rpt)


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-fused"], indirect=True)
def test_dropout_fwd_bwd(backend, device):
    """The parts of a row block draw the same dropout mask (it depends on the row and
    key only): out and gradients equal the reference that applies the mask the call
    returned."""
    torch.manual_seed(6)
    dtype = _dtypes(device)[-1]
    q = torch.randn(1, 21, 2, 512, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(1, 27, 1, 512, dtype=dtype, device=device, requires_grad=True)
            for _ in range(2))
    p = 0.3
    out, _, probs = flashtile.flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                              return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = ~torch.signbit(probs)
    assert 0 < keep.sum() < keep.numel()
    (o64, _, g64), (o_pt, _, g_pt) = reference_pair(q, k, v, dout, causal=True,
                                                    dropout_p=p, dropout_mask=keep)
    assert_close_rule("out", out, o64, o_pt)
    for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close_rule(name, ours, r64, rpt)


def _cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


@pytest.mark.parametrize("backend", ["triton", "triton-fused"], indirect=True)
def test_varlen_fwd_bwd(backend, device):
    """Packed sequences (one with no query, Sq != Sk), GQA, head dim 400: each sequence's
    out and gradients against the reference on its own rows."""
    torch.manual_seed(7)
    dtype = _dtypes(device)[-1]
    lens_q, lens_k, d = [7, 0, 18], [11, 5, 18], 400
    q = torch.randn(sum(lens_q), 4, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, d, dtype=dtype, device=device, requires_grad=True)
            for _ in range(2))
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                           causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lens_q)):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sq.start == sq.stop:  # no query: its keys get no gradient
            assert not grads[1][sk].any() and not grads[2][sk].any()
            continue
        (o64, _, g64), (o_pt, _, g_pt) = reference_pair(
            q[sq][None], k[sk][None], v[sk][None], dout[sq][None], causal=True)
        assert_close_rule("out", out[sq][None], o64, o_pt)
        for name, ours, r64, rpt in zip(("dq", "dk", "dv"),
                                        (grads[0][sq], grads[1][sk], grads[2][sk]), g64,
                                        g_pt):
            assert_close_rule(name, ours[None], r64, rpt)


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_paged_varlen_forward(backend, device):
    """Keys in a paged pool (block_table, pages of 16 in a shuffled order): V's part is
    read through the same page lookups as K."""
    torch.manual_seed(8)
    dtype = _dtypes(device)[-1]
    lens_q, lens_k, ps, d = [3, 12], [37, 20], 16, 512
    pages = [-(-n // ps) for n in lens_k]
    order = torch.randperm(sum(pages) + 2).tolist()
    pool_k = torch.randn(sum(pages) + 2, ps, 1, d, dtype=dtype, device=device)
    pool_v = torch.randn(sum(pages) + 2, ps, 1, d, dtype=dtype, device=device)
    table = torch.tensor([order[:pages[0]] + [0] * (max(pages) - pages[0]),
                          order[pages[0]:sum(pages)] + [0] * (max(pages) - pages[1])],
                         dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), 2, d, dtype=dtype, device=device)
    cu_q = _cu(lens_q, device)
    out = flashtile.flash_attn_varlen_func(q, pool_k, pool_v, cu_q, _cu(lens_k, device),
                                           max(lens_q), max(lens_k), causal=True,
                                           block_table=table)
    for b, n in enumerate(lens_k):
        rows = torch.cat([torch.arange(p * ps, p * ps + ps)
                          for p in table[b, :pages[b]].tolist()])[:n].to(device)
        ks, vs = (pool.flatten(0, 1)[rows][None] for pool in (pool_k, pool_v))
        qs = q[int(cu_q[b]):int(cu_q[b + 1])][None]
        o64 = attention_naive(qs.double(), ks.double(), vs.double(), causal=True)[0]
        o_pt = attention_naive(qs, ks, vs, causal=True, upcast=False)[0]
        assert_close_rule("out", out[int(cu_q[b]):int(cu_q[b + 1])][None], o64, o_pt)


@pytest.mark.parametrize("backend", ["triton", "triton-fused"], indirect=True)
def test_bad_prefix_sums_make_every_column_nan(backend, device):
    """Prefix sums that are not valid make every row NaN, each part's programs filling
    whole rows: the columns past the first part's 256 too (out, dq, dk and dv)."""
    dtype = _dtypes(device)[-1]
    q = torch.randn(13, 2, 512, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(14, 1, 512, dtype=dtype, device=device, requires_grad=True)
            for _ in range(2))
    cu_q = torch.tensor([0, 9, 7, 13], dtype=torch.int32, device=device)  # decreasing
    cu_k = torch.tensor([0, 5, 12, 14], dtype=torch.int32, device=device)
    out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 7, causal=True,
                                                return_lse=True)
    out.float().sum().backward()
    for x in (out, lse, q.grad, k.grad, v.grad):
        assert torch.isnan(x).all()
