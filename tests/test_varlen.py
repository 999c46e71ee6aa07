"""flash_attn_varlen_func equals a per-sequence loop of the dense function, fwd and bwd;
bad input raises the same error in a fresh process and after good calls of its layouts."""

import re

import pytest
import torch

import flashtile
from flashtile import interface
from flashtile.reference import attention_naive
from utils import assert_close_rule


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


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after_good_calls"])
def test_varlen_bad_cu_seqlens(device, index_checks, warm):
    """Also after good calls of the same layouts: the values of cu_seqlens and
    max_seqlen are read every call (with the index checks on), never remembered."""
    q = torch.randn(10, 2, 16, device=device)
    k = torch.randn(12, 2, 16, device=device)
    good = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    good_k = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    interface._check_varlen_layouts.cache_clear()
    for _ in range(2):
        if warm:
            flashtile.flash_attn_varlen_func(q, k, k, good, good_k, 6, 7)
        with pytest.raises(TypeError, match="cu_seqlens_q.dtype"):
            flashtile.flash_attn_varlen_func(q, k, k, good.long(), good_k, 6, 7)
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            flashtile.flash_attn_varlen_func(q, k, k, torch.tensor(
                [0, 7, 4], dtype=torch.int32, device=device), good_k, 6, 7)
        with pytest.raises(ValueError, match="max_seqlen_q"):
            flashtile.flash_attn_varlen_func(q, k, k, good, good_k, 5, 7)
        with pytest.raises(ValueError, match="cu_seqlens_k"):
            flashtile.flash_attn_varlen_func(q, k, k, good, good_k[:2], 6, 7)
        with pytest.raises(ValueError, match="q"):
            flashtile.flash_attn_varlen_func(q[None], k, k, good, good_k, 6, 7)


def _good_varlen_call(device):
    """Keyword arguments of a valid call: 2 sequences, q 4 heads, k/v 2 (GQA)."""
    return dict(q=torch.randn(10, 4, 16, device=device),
                k=torch.randn(12, 2, 16, device=device),
                v=torch.randn(12, 2, 16, device=device),
                cu_seqlens_q=_cu([4, 6], device), cu_seqlens_k=_cu([5, 7], device),
                max_seqlen_q=6, max_seqlen_k=7, causal=True)


def _strided_last_dim(x):
    """x's values in a view whose last dim has stride 2."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return wide[..., ::2]


# Each case: (change to the good call's arguments, error type, literal message fragment).
# Every check flash_attn_varlen_func makes before a launch: of q, k, v and the cu_seqlens
# (their layouts: remembered per layout, issue 15), of max_seqlen_q/k (values) and of the
# options.
MAX = 2**31 - 1
BAD_VARLEN = [
    pytest.param(lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError,
                 "cu_seqlens_q.dtype: expected torch.int32, got torch.int64",
                 id="cu_q-int64"),
    pytest.param(lambda a: dict(cu_seqlens_k=a["cu_seqlens_k"].short()), TypeError,
                 "cu_seqlens_k.dtype: expected torch.int32, got torch.int16",
                 id="cu_k-int16"),
    pytest.param(lambda a: dict(cu_seqlens_k=a["cu_seqlens_k"][:2]), ValueError,
                 "cu_seqlens_k.shape: expected cu_seqlens_q's (3,), got (2,)",
                 id="cu_k-shorter"),
    pytest.param(lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"][None]), ValueError,
                 "cu_seqlens_q.shape: expected (batch + 1,), got (1, 3)", id="cu_q-2d"),
    pytest.param(lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"][:0]), ValueError,
                 "cu_seqlens_q.shape: expected (batch + 1,), got (0,)", id="cu_q-empty"),
    pytest.param(lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].tolist()), TypeError,
                 "cu_seqlens_q: expected an int32 torch.Tensor, got list", id="cu_q-list"),
    pytest.param(lambda a: dict(cu_seqlens_k=None), TypeError,
                 "cu_seqlens_k: expected an int32 torch.Tensor, got NoneType",
                 id="cu_k-None"),
    pytest.param(lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].to("meta")), ValueError,
                 "cu_seqlens_q.device: expected q's device", id="cu_q-device"),
    pytest.param(lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"][:1],
                                cu_seqlens_k=a["cu_seqlens_k"][:1]), ValueError,
                 "cu_seqlens_q: expected prefix sums from 0 to the packed length 10, got a "
                 "single entry (no sequence)", id="cu-no-sequence"),
    pytest.param(lambda a: dict(max_seqlen_q=-1), ValueError,
                 f"max_seqlen_q: expected an int from 0 to {MAX}, got -1",
                 id="max_q-negative"),
    pytest.param(lambda a: dict(max_seqlen_k=2**31), ValueError,
                 f"max_seqlen_k: expected an int from 0 to {MAX}, got {2**31}",
                 id="max_k-past-int32"),
    pytest.param(lambda a: dict(max_seqlen_q=6.0), TypeError,
                 "max_seqlen_q: expected an int, got float", id="max_q-float"),
    pytest.param(lambda a: dict(max_seqlen_k=True), TypeError,
                 "max_seqlen_k: expected an int, got bool", id="max_k-bool"),
    pytest.param(lambda a: dict(max_seqlen_q=torch.tensor(6)), TypeError,
                 "max_seqlen_q: expected an int, got Tensor", id="max_q-tensor"),
    pytest.param(lambda a: dict(k=a["k"][:, :1].expand(12, 3, 16).contiguous(),
                                v=a["v"][:, :1].expand(12, 3, 16).contiguous()), ValueError,
                 "k.shape[1] (nheads_kv): expected a divisor of q's nheads 4 (GQA/MQA), "
                 "got 3", id="heads-mismatch"),
    pytest.param(lambda a: dict(k=a["k"][..., :8].contiguous(),
                                v=a["v"][..., :8].contiguous()), ValueError,
                 "k.shape[-1] (head_dim): expected q's head_dim 16, got 8",
                 id="head_dim-mismatch"),
    pytest.param(lambda a: dict(v=a["v"][:11]), ValueError,
                 "v.shape[:-1]: expected k's (12, 2), got (11, 2)", id="v-rows"),
    pytest.param(lambda a: dict(k=a["k"].half()), TypeError,
                 "k.dtype: expected q's dtype torch.float32, got torch.float16",
                 id="k-dtype"),
    pytest.param(lambda a: dict(q=a["q"][None]), ValueError,
                 "q: expected a 3-d tensor, got shape (1, 10, 4, 16)", id="q-rank-4"),
    pytest.param(lambda a: dict(v=_strided_last_dim(a["v"])), ValueError,
                 "v.stride(-1): expected 1 (the head dim contiguous), got 2",
                 id="v-last-dim-strided"),
    pytest.param(lambda a: dict(k=a["k"].to("meta")), ValueError,
                 "k.device: expected q's device", id="k-device"),
    pytest.param(lambda a: dict(q=a["q"].cpu().numpy()), TypeError,
                 "q: expected a torch.Tensor, got ndarray", id="q-numpy"),
    pytest.param(lambda a: dict(q=torch.nn.Parameter(a["q"].double(), requires_grad=False)),
                 TypeError, "q: expected dtype float16, bfloat16, float32, float8_e4m3fn or "
                 "float8_e5m2, got torch.float64", id="q-parameter-float64"),
    pytest.param(lambda a: dict(seqused_k=a["cu_seqlens_k"][1:]), ValueError,
                 "seqused_k: expected None without block_table", id="seqused_k-unpaged"),
    pytest.param(lambda a: dict(softmax_scale=float("nan")), ValueError,
                 "softmax_scale: expected a finite float, got nan", id="scale-nan"),
    pytest.param(lambda a: dict(softcap=-1.0), ValueError,
                 "softcap: expected a finite float >= 0.0, got -1.0", id="softcap-negative"),
    pytest.param(lambda a: dict(window_size=(-2, 0)), ValueError,
                 "window_size: expected each bound >= 0, or -1 for unbounded, got (-2, 0)",
                 id="window-negative"),
    pytest.param(lambda a: dict(causal="yes"), TypeError,
                 "causal: expected a bool, got str 'yes'", id="causal-str"),
    pytest.param(lambda a: dict(return_lse=1), TypeError,
                 "return_lse: expected a bool, got int 1", id="return_lse-int"),
    pytest.param(lambda a: dict(dropout_p=1.0), ValueError,
                 "dropout_p: expected a probability in [0, 1), got 1.0", id="dropout-1"),
    pytest.param(lambda a: dict(alibi_slopes=torch.ones(3, device=a["q"].device)),
                 ValueError, "alibi_slopes.shape: expected (4,) or (2, 4), got (3,)",
                 id="alibi-shape"),
    pytest.param(lambda a: dict(out_dtype=torch.float16), ValueError,
                 "out_dtype: expected None or q's dtype torch.float32", id="out_dtype"),
    pytest.param(lambda a: dict(q_descale=torch.ones(2, 2, device=a["q"].device)),
                 ValueError, "q_descale: expected None with torch.float32 q, k, v",
                 id="descale-unquantised"),
    pytest.param(lambda a: dict(return_attn_probs=True, max_seqlen_q=2**20,
                                max_seqlen_k=2**20), ValueError,
                 "return_attn_probs: expected batch * nheads * seqlen_q * seqlen_k <= "
                 "ATTN_PROBS_MAX_ELEMENTS", id="probs-too-many"),
]


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after_good_calls"])
@pytest.mark.parametrize("change, error, message", BAD_VARLEN)
def test_varlen_bad_input_raises_cold_and_after_good_calls(change, error, message, warm,
                                                           device, monkeypatch, on_gpu):
    """Regression guard for the memo of checked layouts (issue 15): each bad argument
    raises its error with an empty memo and after good calls that filled it with the
    layouts of the same q, k, v and cu_seqlens, every time."""
    if not on_gpu:  # the good calls' numbers are not the point: the quick backend
        monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    good = _good_varlen_call(device)
    interface._check_varlen_layouts.cache_clear()
    for _ in range(2):
        if warm:
            flashtile.flash_attn_varlen_func(**good)
        with pytest.raises(error, match=re.escape(message)):
            flashtile.flash_attn_varlen_func(**{**good, **change(good)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_memo_serves_right_numbers_after_layouts_change(dtype, backend, device):
    """Calls that alternate between layouts (a heads-major q, strided k/v rows, a
    strided cu_seqlens, another token count) each give their own right answer: a memo
    or plan of another layout serving one would read the wrong rows."""
    f = dict(device=device, dtype=dtype)
    lens_q, lens_k = [5, 11, 3], [7, 4, 9]
    q = torch.randn(sum(lens_q), 4, 16, **f)
    k, v = (torch.randn(sum(lens_k), 2, 16, **f) for _ in range(2))
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    q_heads_major = q.transpose(0, 1).contiguous().transpose(0, 1)
    k_rows_apart, v_rows_apart = (torch.cat([x, x], dim=1)[:, :2] for x in (k, v))
    cu_k_strided = torch.stack([cu_k, cu_k], dim=1)[:, 0]
    calls = [(q, k, v, cu_q, cu_k), (q_heads_major, k, v, cu_q, cu_k),
             (q, k_rows_apart, v_rows_apart, cu_q, cu_k_strided), (q, k, v, cu_q, cu_k),
             (q[:16], k[:11], v[:11], cu_q[:3], cu_k[:3]), (q, k, v, cu_q, cu_k)]
    for q_, k_, v_, cq, ck in calls:
        out = flashtile.flash_attn_varlen_func(q_, k_, v_, cq, ck, 11, 9, causal=True)
        bounds = zip(cq[:-1].tolist(), cq[1:].tolist(), ck[:-1].tolist(), ck[1:].tolist())
        for qs, qe, ks, ke in bounds:
            args = (q_[None, qs:qe], k_[None, ks:ke], v_[None, ks:ke])
            ref64 = attention_naive(*args, causal=True)[0][0]
            ref_t = attention_naive(*args, causal=True, upcast=False)[0][0]
            assert_close_rule("out", out[qs:qe], ref64, ref_t)


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
