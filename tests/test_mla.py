"""v's head dim different from q's and k's (issue 17 item 2): DeepSeek's multi-head latent
attention, 192/128 in prefill and training. The output takes v's head dim. Checked against
the float64 oracle, on both backends (Triton through the interpreter on CPU)."""

import pytest
import torch

import flashtile
from flashtile.reference import attention_naive
from tests.utils import assert_close_rule, reference_pair

# (d, dv): MLA's prefill shape, a smaller one, and dv > d with an odd dv.
HEAD_DIMS = [pytest.param(192, 128, id="d192-dv128"), pytest.param(64, 32, id="d64-dv32"),
             pytest.param(24, 40, id="d24-dv40")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]


def _qkv(b, sq, sk, h, hkv, d, dv, dtype, device, packed=False):
    lead_q, lead_k = ((b * sq,), (b * sk,)) if packed else ((b, sq), (b, sk))
    q = torch.randn(*lead_q, h, d, dtype=dtype, device=device)
    k = torch.randn(*lead_k, hkv, d, dtype=dtype, device=device)
    v = torch.randn(*lead_k, hkv, dv, dtype=dtype, device=device)
    return q, k, v


def _varlen_inputs(d, dv, dtype, device):
    """Three packed sequences, (q, k) lengths (5, 9), (17, 17), (1, 30); GQA 4 over 2."""
    cu_q = torch.tensor([0, 5, 22, 23], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 26, 56], dtype=torch.int32, device=device)
    q = torch.randn(23, 4, d, dtype=dtype, device=device)
    k = torch.randn(56, 2, d, dtype=dtype, device=device)
    v = torch.randn(56, 2, dv, dtype=dtype, device=device)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, dv", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_fwd(backend, d, dv, dtype, causal, device):
    # GQA (4 query heads over 2 KV heads), Sq != Sk and odd lengths.
    q, k, v = _qkv(2, 37, 53, 4, 2, d, dv, dtype, device)
    with torch.no_grad():
        out, lse = flashtile.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, 37, 4, dv)
    dout = torch.zeros_like(out)
    (o64, l64, _), (o_pt, _, _) = reference_pair(q, k, v, dout, causal=causal)
    assert_close_rule("out", out, o64, o_pt)
    torch.testing.assert_close(lse.double(), l64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, dv", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_fwd(backend, d, dv, dtype, causal, device):
    q, k, v, cu_q, cu_k = _varlen_inputs(d, dv, dtype, device)
    with torch.no_grad():
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 30, causal=causal)
    assert out.shape == (23, 4, dv)
    for b in range(3):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        qb, kb, vb = q[None, qs:qe], k[None, ks:ke], v[None, ks:ke]
        o64, _ = attention_naive(qb.double(), kb.double(), vb.double(), causal=causal)
        o_pt, _ = attention_naive(qb, kb, vb, causal=causal, upcast=False)
        assert_close_rule(f"out[{b}]", out[None, qs:qe], o64, o_pt)


def test_naive_reference_takes_v_head_dim():
    """The oracle is plain matmuls: its output has v's head dim and equals softmax @ v."""
    q, k, v = _qkv(1, 3, 5, 2, 2, 8, 4, torch.float64, "cpu")
    out, _ = attention_naive(q, k, v)
    p = torch.softmax(torch.einsum("bihd,bjhd->bhij", q, k) / 8 ** 0.5, -1)
    torch.testing.assert_close(out, torch.einsum("bhij,bjhd->bihd", p, v))


def test_k_v_other_dims_must_match():
    q, k, v = _qkv(1, 3, 5, 2, 2, 8, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"v.shape\[:-1\]: expected k's \(1, 5, 2\), "
                                         r"got \(1, 6, 2\)"):
        flashtile.flash_attn_func(q, k, torch.randn(1, 6, 2, 4))


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-fused"], indirect=True)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, dv", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_bwd(backend, d, dv, dtype, causal, device):
    q, k, v = _qkv(2, 37, 53, 4, 2, d, dv, dtype, device)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = flashtile.flash_attn_func(qg, kg, vg, causal=causal, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    loss = (out * dout).sum() + (lse * dlse).sum()
    grads = torch.autograd.grad(loss, (qg, kg, vg))
    (_, _, g64), (_, _, g_pt) = reference_pair(q, k, v, dout, dlse, causal=causal)
    for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert ours.shape == r64.shape, name
        assert_close_rule(name, ours, r64, rpt)


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-fused"], indirect=True)
@pytest.mark.parametrize("d, dv", HEAD_DIMS)
def test_varlen_bwd(backend, d, dv, device):
    q, k, v, cu_q, cu_k = _varlen_inputs(d, dv, torch.float16, device)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = flashtile.flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, 17, 30, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), (qg, kg, vg))
    for b in range(3):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        (_, _, g64), (_, _, g_pt) = reference_pair(
            q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], dout[None, qs:qe], causal=True)
        for name, ours, r64, rpt in zip(("dq", "dk", "dv"),
                                        (grads[0][None, qs:qe], grads[1][None, ks:ke],
                                         grads[2][None, ks:ke]), g64, g_pt):
            assert_close_rule(f"{name}[{b}]", ours, r64, rpt)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sdpa_drop_in(backend, is_causal, device):
    """The SDPA drop-in takes value's own head dim (it raised NotImplementedError), as
    PyTorch's does: out and gradients against PyTorch's SDPA in float64, with GQA."""
    dtype = torch.float16
    q = torch.randn(2, 4, 37, 64, dtype=dtype, device=device)
    k = torch.randn(2, 2, 53, 64, dtype=dtype, device=device)
    v = torch.randn(2, 2, 53, 32, dtype=dtype, device=device)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = flashtile.scaled_dot_product_attention(qg, kg, vg, is_causal=is_causal,
                                                 enable_gqa=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), (qg, kg, vg))
    refs = []
    for x64 in (True, False):
        xs = [(x.double() if x64 else x.float()).requires_grad_() for x in (q, k, v)]
        # The second reference: PyTorch in fp32 rounded to fp16, whose error is below
        # its own fp16 error, so the bound is stricter than the rule's.
        o = torch.nn.functional.scaled_dot_product_attention(
            *xs, is_causal=is_causal, enable_gqa=True)
        g = torch.autograd.grad((o * dout.to(o.dtype)).sum(), xs)
        refs.append((o.to(dtype if not x64 else o.dtype),
                     [t.to(dtype) if not x64 else t for t in g]))
    (o64, g64), (o_pt, g_pt) = refs
    assert out.shape == (2, 4, 37, 32)
    assert_close_rule("out", out, o64, o_pt)
    for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close_rule(name, ours, r64, rpt)


def test_ring_rejects_other_value_head_dim():
    """Ring attention's buffers are q-shaped: a clear error, not a shape mismatch."""
    from flashtile.distributed import _config

    q, k, v = _qkv(1, 4, 4, 2, 2, 8, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"v.shape\[-1\] \(head_dim\): expected q's "
                                         r"head_dim 8, got 4"):
        _config(q, k, v, False, None, (-1, -1), 0.0, "contiguous", 1)


def test_opcheck_fakes_take_value_head_dim(monkeypatch, on_gpu, device):
    """The custom ops' fake implementations allocate out with v's head dim (they took
    q's), checked by opcheck against the real op, dense and varlen."""
    from flashtile import custom_ops

    if not on_gpu:
        monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    q, k, v = _qkv(2, 19, 23, 4, 2, 16, 8, torch.float32, device)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.library.opcheck(custom_ops.attn_fwd,
                          (q, k, v, None, None, 0.25, 4, -1, 0, 0.0, False))
    q, k, v = _qkv(1, 12, 15, 4, 2, 16, 8, torch.float32, device, packed=True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 15], dtype=torch.int32, device=device)
    torch.library.opcheck(custom_ops.varlen_attn_fwd,
                          (q, k, v, cu_q, cu_k, 7, 9, None, 0.25, -1, 0, 0.0, False))
