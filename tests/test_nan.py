"""A NaN in the input comes out as NaN wherever it reaches, on every backend (issue 13).

The rule, the one torch's SDPA follows: a row whose visible keys include a NaN key (or
whose query, ALiBi slope or additive mask entry is NaN) gets an all-NaN output and a NaN
lse; rows that cannot see the NaN are unchanged. A NaN in ``v`` reaches (at least) the
output columns of every row that sees its key; the lse does not depend on ``v``. A row
that sees no key at all (bottom-right causal with seqlen_q > seqlen_k, a window, an
all-False mask) is still 0 with lse -inf, whatever the keys hold. Gradients the NaN
reaches are NaN, never a plausible finite number; those of the other head stay finite.
Before the fix the tiled PyTorch backend returned 0 and lse -inf for every row, and the
Triton kernels NaN outputs with an lse of -inf.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile import _torch_backend
from flashtile.reference import allowed_keys, attention_naive
from tests.conftest import triton_available_here
from tests.utils import max_err

NAN = float("nan")
# The Triton interpreter's numpy max over a row of NaN warns; the NaN is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")


@pytest.fixture(params=["torch", "torch-tiled", "triton"])
def backend(request, monkeypatch, on_gpu):
    """The torch backend (PyTorch's fused CPU kernel where it fits), the same backend
    with its tiled path forced, and the Triton kernels; "triton-fused" (backward tests
    name it) takes the fused Triton backward (FLASHTILE_BWD=fused)."""
    name = request.param
    if not name.startswith("triton") and on_gpu:
        pytest.skip("GPU runs the Triton kernels")
    if name.startswith("triton") and not triton_available_here(on_gpu):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (set by make test)")
    if name == "torch-tiled":
        monkeypatch.setattr(_torch_backend, "_plan", lambda *args, **kwargs: None)
    monkeypatch.setenv("FLASHTILE_BACKEND", name.split("-")[0])
    monkeypatch.setenv("FLASHTILE_BWD", "fused" if name == "triton-fused" else "split")
    return name


def _on(device, *xs):
    """The inputs on the test's device (CUDA under --gpu); they are built on CPU, and the
    results are checked there."""
    return [x.to(device) for x in xs]


def _reach(sq, sk, causal, key):
    """(sq,) bool: the rows that see ``key``; (sq,) bool: the rows that see no key."""
    ok = allowed_keys(sq, sk, sk - sq, -1, 0 if causal else -1, torch.device("cpu"))
    return ok[:, key], ~ok.any(1)


# (seqlen_q, seqlen_k, causal, the poisoned key): with causal the key is seen by the
# later rows only, and with seqlen_q > seqlen_k the first rows see no key at all.
GEOMETRIES = {
    "full": (37, 150, False, 90),
    "causal_q<k": (37, 150, True, 130),
    "causal_q>k": (150, 37, True, 20),
    # Calls of the CPU kernel shorter than one vector of keys (_torch_backend._SHORT_CALL):
    # all 7 keys in one call, and a causal tail whose first key row 0 alone sees there.
    "short": (5, 7, False, 3),
    "causal_tail": (5, 150, True, 145),
}


def _inputs(sq, sk, h=2, d=16, requires_grad=False):
    q = torch.randn(1, sq, h, d)
    k, v = torch.randn(1, sk, h, d), torch.randn(1, sk, h, d)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def _check_rows(out, lse, ref, ref_lse, nan_rows, empty_rows, col=slice(None)):
    """Head 0: nan_rows NaN (lse too unless col is a single column of v), empty rows 0
    and -inf, the rest equal to the float64 oracle; head 1 equal to the oracle."""
    o0, l0 = out[0, :, 0], lse[0, 0]
    assert torch.isnan(o0[nan_rows][:, col]).all()
    if col == slice(None):
        assert torch.isnan(l0[nan_rows]).all()
    else:
        assert torch.isfinite(l0[~empty_rows]).all()
    assert (o0[empty_rows] == 0).all() and (l0[empty_rows] == float("-inf")).all()
    rest = ~nan_rows & ~empty_rows
    if col == slice(None):
        assert max_err(o0[rest], ref[0, :, 0][rest]) < 1e-5
        assert max_err(l0[rest], ref_lse[0, 0][rest]) < 1e-5
    assert max_err(out[0, :, 1], ref[0, :, 1]) < 1e-5


@pytest.mark.parametrize("where", ["q", "k", "v", "alibi"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_flash_attn_func_nan_reaches_exactly_its_rows(geometry, where, backend, device):
    sq, sk, causal, key = GEOMETRIES[geometry]
    q, k, v = _inputs(sq, sk)
    seen_key, empty = _reach(sq, sk, causal, key)
    alibi = torch.tensor([0.1, 0.2])
    col = slice(None)
    if where == "q":
        row = int((~empty).nonzero()[0])  # the first row that sees any key
        q[0, row, 0, 3] = NAN
        nan_rows = torch.zeros(sq, dtype=torch.bool)
        nan_rows[row] = True
    elif where == "k":
        k[0, key, 0, 3] = NAN
        nan_rows = seen_key
    elif where == "v":
        v[0, key, 0, 3] = NAN
        nan_rows, col = seen_key, 3
    else:
        alibi[0] = NAN
        nan_rows = ~empty
    # ALiBi only where it is the poison: it sends the torch backend down its tiled path,
    # so the other cases would never reach PyTorch's fused CPU kernel.
    alibi = alibi if where == "alibi" else None
    out, lse = flashtile.flash_attn_func(
        *_on(device, q, k, v), causal=causal, return_lse=True,
        alibi_slopes=None if alibi is None else alibi.to(device))
    out, lse = out.cpu(), lse.cpu()
    ref, ref_lse = attention_naive(q, k, v, causal=causal, alibi_slopes=alibi)
    _check_rows(out, lse, ref, ref_lse, nan_rows, empty, col)


@pytest.mark.parametrize("backend", ["torch", "torch-tiled", "triton", "triton-fused"],
                         indirect=True)
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("geometry", ["full", "causal_q<k", "short"])
def test_backward_nan_is_not_a_finite_gradient(geometry, where, backend, device):
    """The gradients a NaN reaches are NaN; head 1 (no NaN) stays finite. A NaN score
    poisons its whole softmax row, so dv of every key such a row sees is NaN (the float64
    oracle's autograd agrees). dv does not depend on v: a NaN in v leaves dv finite."""
    sq, sk, causal, key = GEOMETRIES[geometry]
    q, k, v = _inputs(sq, sk)
    ok = allowed_keys(sq, sk, sk - sq, -1, 0 if causal else -1, torch.device("cpu"))
    seen_key = ok[:, key]
    row = int(seen_key.nonzero()[0])
    {"q": q, "k": k, "v": v}[where][0, row if where == "q" else key, 0, 3] = NAN
    q, k, v = (x.requires_grad_() for x in _on(device, q, k, v))
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    dq, dk, dv = (g.cpu() for g in grads)
    for g in (dq, dk, dv):
        assert torch.isfinite(g[0, :, 1]).all()
    nan_rows = seen_key.clone() if where != "q" else torch.arange(sq) == row
    assert torch.isnan(dq[0, nan_rows, 0]).all() and torch.isnan(dk[0, key, 0]).all()
    if where == "v":
        assert torch.isfinite(dv).all()
    else:
        assert torch.isnan(dv[0, ok[nan_rows].any(0), 0]).all()


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_nan_stays_in_its_sequence(causal, backend, device):
    lens_q, lens_k = [5, 0, 40], [30, 7, 50]
    q, k, v = torch.randn(45, 2, 16), torch.randn(87, 2, 16), torch.randn(87, 2, 16)
    key = 45  # key 45 of sequence 2 (packed row 37 + 45): rows 35.. see it when causal
    k[37 + key, 0, 3] = NAN
    out, lse = flashtile.flash_attn_varlen_func(
        *_on(device, q, k, v, _cu(lens_q), _cu(lens_k)), 40, 50, causal=causal,
        return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    seen_key, _ = _reach(40, 50, causal, key)
    out2, lse2 = out[5:], lse[0, 5:]  # sequence 2 (sequence 1 has no query)
    assert torch.isnan(out2[seen_key, 0]).all() and torch.isnan(lse2[seen_key]).all()
    assert torch.isfinite(out2[~seen_key]).all() and torch.isfinite(lse2[~seen_key]).all()
    assert torch.isfinite(out[:5]).all() and torch.isfinite(lse[:, :5]).all()
    assert torch.isfinite(out[:, 1]).all()


def test_sdpa_nan_matches_torch(backend, device):
    """The drop-in's NaN rows are torch's own (top-left causal, a NaN key)."""
    q, k, v = (torch.randn(2, 2, 33, 16) for _ in range(3))
    k[1, 0, 20, 5] = NAN
    for is_causal in (False, True):
        out = flashtile.scaled_dot_product_attention(*_on(device, q, k, v),
                                                     is_causal=is_causal).cpu()
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        assert torch.isnan(out).any()
        fin = ~torch.isnan(ref)
        assert max_err(out[fin], ref[fin]) < 1e-5


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_mask_nan_and_empty_rows(kind, backend, device):
    """A bool mask hides a NaN key from the rows it masks, and a row it empties is 0. An
    additive mask adds: a NaN entry poisons its row only, a row of -inf is 0, but a NaN
    key reaches every row, masked or not (-inf + NaN is NaN, as in torch's SDPA)."""
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    allowed = torch.rand(1, 1, 40, 70) > 0.3
    allowed[..., 5, :] = False
    allowed[..., :, 60] = False  # nobody sees key 60
    nan_rows = torch.zeros(40, dtype=torch.bool)
    if kind == "bool":
        mask = allowed
        k[0, :, 60] = NAN  # hidden from every row by the mask
    else:
        mask = torch.zeros(1, 1, 40, 70).masked_fill(~allowed, float("-inf"))
        allowed[..., 9, 3] = True
        mask[..., 9, 3] = NAN
        nan_rows[9] = True
    out = flashtile.scaled_dot_product_attention(*_on(device, q, k, v, mask)).cpu()
    assert (out[:, :, 5] == 0).all()
    ref = attention_naive(*(x.transpose(1, 2) for x in (q, k.nan_to_num(), v)),
                          attn_mask=mask, diag_offset=0)[0].transpose(1, 2)
    assert torch.isnan(out[:, :, nan_rows]).all()
    assert max_err(out[:, :, ~nan_rows], ref[:, :, ~nan_rows]) < 1e-5
    if kind == "additive":
        k[0, 1, 60] = NAN
        out = flashtile.scaled_dot_product_attention(*_on(device, q, k, v, mask)).cpu()
        assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, 0, ~nan_rows]).all()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_nan_only_within_each_sequence(paged, num_splits, backend, device):
    """A NaN key inside sequence 0 poisons it; a NaN past sequence 1's end (stale cache,
    an unused page) or before its cache_leftpad reaches nothing."""
    b, s, hkv, d = 2, 64, 1, 16
    k_cache, v_cache = torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    seqlens = torch.tensor([40, 30], dtype=torch.int32)
    k_cache[0, 17, 0, 2] = NAN   # inside sequence 0
    k_cache[1, 45, 0, 2] = NAN   # past sequence 1's end
    kw = {}
    if paged:
        page = 16
        pool_k = torch.randn(b * s // page + 1, page, hkv, d)
        pool_v = torch.randn_like(pool_k)
        pool_k[:-1] = k_cache.reshape(-1, page, hkv, d)
        pool_v[:-1] = v_cache.reshape(-1, page, hkv, d)
        pool_k[-1] = NAN  # a page no sequence uses
        table = torch.arange(b * s // page, dtype=torch.int32).view(b, -1)
        k_cache, v_cache, kw = pool_k, pool_v, dict(block_table=table)
    else:
        v_cache[1, 2, 0, 2] = NAN  # before sequence 1's first key
        kw = dict(cache_leftpad=torch.tensor([0, 4], dtype=torch.int32))
    q = torch.randn(b, 1, 2, d)
    q, k_cache, v_cache, seqlens = _on(device, q, k_cache, v_cache, seqlens)
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits, return_lse=True,
        **{name: x.to(device) for name, x in kw.items()})
    out, lse = out.cpu(), lse.cpu()
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


def test_merge_propagates_nan(backend, device):
    """merge_attention_states: a NaN lse or a NaN partial with weight > 0 gives NaN; an
    empty side (lse -inf) is still ignored whatever its out holds."""
    out_a, out_b = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    lse_a, lse_b = torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    lse_a[0, 0, 0] = NAN
    out_b[0, 1, 0, 3] = NAN
    lse_a[0, 0, 2] = float("-inf")
    out_a[0, 2, 0] = NAN
    out, lse = flashtile.merge_attention_states(*_on(device, out_a, lse_a, out_b, lse_b))
    out, lse = out.cpu(), lse.cpu()
    assert torch.isnan(out[0, 0, 0]).all() and torch.isnan(lse[0, 0, 0])
    assert torch.isnan(out[0, 1, 0, 3]) and torch.isfinite(lse[0, 0, 1])
    assert torch.equal(out[0, 2, 0], out_b[0, 2, 0]) and lse[0, 0, 2] == lse_b[0, 0, 2]
    assert torch.isfinite(out[0, 3]).all() and torch.isfinite(out[0, :, 1]).all()
