"""flash_attn_varlen_func equals a per-sequence loop of the dense function, fwd and bwd."""

import pytest
import torch

import flashtile


def _cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


CASES = {
    "mixed": ([5, 0, 1, 37, 13], [7, 3, 0, 37, 29], dict(causal=True)),
    "primes_window": ([17, 31, 2], [23, 31, 11], dict(window_size=(4, 2))),
    "full": ([19, 41], [41, 19], dict()),
    "alibi_softcap": ([11, 29], [29, 11], dict(causal=True, softcap=3.0, alibi="bh")),
}


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-fused"], indirect=True)
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_equals_loop(case, backend, device, on_gpu):
    lens_q, lens_k, kw = CASES[case]
    kw = dict(kw)
    h, hkv, d = 4, 2, 40
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if on_gpu:
        lens_q = [x * 13 for x in lens_q]
        lens_k = [x * 13 for x in lens_k]
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, h, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(tk, hkv, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(tk, hkv, d, device=device, dtype=dtype, requires_grad=True)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = torch.rand(len(lens_q), h, device=device)
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q),
                                                max(lens_k), return_lse=True, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    outs, lses, ref_grads = [], [], [torch.zeros_like(x) for x in (q, k, v)]
    for b, (qs, qe, ks, ke) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(),
                                             cu_k[:-1].tolist(), cu_k[1:].tolist())):
        kw_b = dict(kw)
        if "alibi_slopes" in kw:
            kw_b["alibi_slopes"] = kw["alibi_slopes"][b:b + 1]
        qb, kb, vb = (x.detach()[None, s:e].clone().requires_grad_()
                      for x, s, e in ((q, qs, qe), (k, ks, ke), (v, ks, ke)))
        o, l = flashtile.flash_attn_func(qb, kb, vb, return_lse=True, **kw_b)
        outs.append(o[0])
        lses.append(l[0])
        if o.numel() and kb.shape[1]:
            g = torch.autograd.grad(o, (qb, kb, vb), dout[None, qs:qe])
            for acc, gb, s, e in zip(ref_grads, g, (qs, ks, ks), (qe, ke, ke)):
                acc[s:e] = gb[0]
    tol = dict(rtol=0, atol=0) if not on_gpu else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, torch.cat(outs), **tol)
    torch.testing.assert_close(lse, torch.cat(lses, dim=1), **tol)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, **(tol if on_gpu else dict(rtol=1e-5, atol=1e-5)))


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-fused"], indirect=True)
def test_varlen_grad_through_lse_only(backend, device, on_gpu):
    """A loss on lse alone: out's gradient arrives as None and counts as zero."""
    lens_q, lens_k = [3, 0, 7], [5, 2, 11]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    q = torch.randn(sum(lens_q), 4, 32, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 32, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    _, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                              causal=True, return_lse=True)
    dlse = torch.randn_like(lse)
    grads = torch.autograd.grad((lse * dlse).sum(), (q, k, v))
    ref = [torch.zeros_like(x) for x in (q, k, v)]
    for qs, qe, ks, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                              cu_k[1:].tolist()):
        if qe == qs:
            continue
        qb, kb, vb = (x.detach()[None, s:e].clone().requires_grad_()
                      for x, s, e in ((q, qs, qe), (k, ks, ke), (v, ks, ke)))
        _, lb = flashtile.flash_attn_func(qb, kb, vb, causal=True, return_lse=True)
        g = torch.autograd.grad((lb * dlse[None, :, qs:qe]).sum(), (qb, kb, vb))
        for acc, gb, s, e in zip(ref, g, (qs, ks, ks), (qe, ke, ke)):
            acc[s:e] = gb[0]
    tol = dict(rtol=2e-2, atol=2e-2) if on_gpu else dict(rtol=1e-5, atol=1e-5)
    for a, r in zip(grads, ref):
        torch.testing.assert_close(a, r, **tol)


def test_varlen_bad_cu_seqlens(device, index_checks):
    q = torch.randn(10, 2, 16, device=device)
    k = torch.randn(12, 2, 16, device=device)
    good = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    good_k = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="cu_seqlens_q.dtype"):
        flashtile.flash_attn_varlen_func(q, k, k, good.long(), good_k, 6, 7)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        flashtile.flash_attn_varlen_func(q, k, k, torch.tensor([0, 7, 4], dtype=torch.int32,
                                                              device=device), good_k, 6, 7)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flashtile.flash_attn_varlen_func(q, k, k, good, good_k, 5, 7)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        flashtile.flash_attn_varlen_func(q, k, k, good, good_k[:2], 6, 7)
    with pytest.raises(ValueError, match="q"):
        flashtile.flash_attn_varlen_func(q[None], k, k, good, good_k, 6, 7)


def test_varlen_strided_cu_seqlens(backend, device):
    """Regression: the kernels read cu_seqlens with unit stride; a strided view of a
    valid prefix sum must give the same answer as its contiguous copy."""
    lens = [5, 9, 3]
    q = torch.randn(sum(lens), 2, 16, device=device)
    k = torch.randn(sum(lens), 2, 16, device=device)
    cu = _cu(lens, device)
    strided = torch.stack([cu, cu * 0 - 7], dim=1)[:, 0]  # stride 2
    assert strided.stride(0) == 2
    out = flashtile.flash_attn_varlen_func(q, k, k, strided, strided, 9, 9, causal=True)
    ref = flashtile.flash_attn_varlen_func(q, k, k, cu, cu, 9, 9, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_varlen_meta_tensors_skip_the_host_check():
    """Regression: check_varlen read cu_seqlens on the host for meta tensors too (there
    is nothing to read: NotImplementedError) and, the same way, while a CUDA graph is
    captured (transformers' generate_batch captures its varlen steps). It now reads
    them only where can_read_indices says it can."""
    q = torch.empty(7, 2, 16, device="meta")
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device="meta")
    out = flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, causal=True)
    assert out.shape == (7, 2, 16) and out.device.type == "meta"


@pytest.mark.gpu
def test_varlen_in_a_cuda_graph():
    """Captured once, replayed with new values in the same buffers: the output of an
    eager call on those values."""
    lens = [5, 9, 3]
    q, k, v = (torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    cu = _cu(lens, "cuda")
    flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)
    for x in (q, k, v):
        x.normal_()
    cu.copy_(_cu([9, 3, 5], "cuda"))
    graph.replay()
    want = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
