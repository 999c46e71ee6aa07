"""flashtile.merge_attention_states: merging two key halves gives attention over all keys.

The main check is end to end: attention over keys [0, n) and over [n, seqlen_k), each
from ``flash_attn_func(..., return_lse=True)``, merged, must equal attention over all
keys under the project's accuracy rule (float64 oracle, 2x PyTorch's own error + floor).
Both backends run: the PyTorch ops, and the Triton kernel (through the interpreter on
CPU, TRITON_INTERPRET=1). Then -inf rows, strides, autograd routing and bad input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import flashtile
from flashtile import merge as merge_module
from flashtile.reference import attention_naive, merge_attention_states_ref
from tests.conftest import triton_available_here
from tests.utils import assert_close_rule, max_err


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch, on_gpu):
    if request.param == "triton" and not triton_available_here(on_gpu):
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set by make test)")
    monkeypatch.setenv("FLASHTILE_BACKEND", request.param)
    return request.param


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]


@dataclass
class Split:
    """Attention of (batch, seqlen_q) queries over seqlen_k keys, split at key ``n``."""
    batch: int
    seqlen_q: int
    seqlen_k: int
    n: int
    nheads: int = 4
    nheads_kv: int = 2
    head_dim: int = 24
    causal: bool = False
    window: tuple = (-1, -1)

    @property
    def id(self):
        s = f"b{self.batch}-q{self.seqlen_q}-k{self.seqlen_k}-split{self.n}"
        s += f"-h{self.nheads}/{self.nheads_kv}-d{self.head_dim}"
        if self.causal:
            s += "-causal"
        if self.window != (-1, -1):
            s += f"-win{self.window[0]}_{self.window[1]}"
        return s


SPLITS = [
    Split(2, 7, 19, 9),                                  # no mask: every row sees both
    Split(1, 13, 13, 6, causal=True),                    # rows 0..5 see nothing in [6, 13)
    Split(1, 23, 11, 5, causal=True),                    # rows 0..11 see no key at all
    Split(2, 17, 17, 8, window=(12, 3)),                 # rows 0..4 see nothing in [8, 17)
    Split(1, 9, 9, 4, causal=True, window=(5, 0), head_dim=7),  # odd head_dim
    Split(1, 5, 11, 0),                                  # empty first half: lse_a = -inf
]


def _halves(q, k, v, split):
    """(out_a, lse_a) over keys [0, n) and (out_b, lse_b) over [n, seqlen_k).

    flash_attn_func aligns masks to the bottom-right corner, so the suffix [n, sk) keeps
    the full call's alignment as is. The prefix's diagonal sits ``sk - n`` keys earlier;
    widening the right bound and narrowing the left one by that shift restores it
    (the cases keep window_left >= sk - n, or unbounded).
    """
    n, sk = split.n, split.seqlen_k
    left, right = split.window
    if split.causal:
        right = 0
    shift = sk - n
    assert left == -1 or left >= shift, "test case: prefix window needs left >= sk - n"
    prefix_window = (-1 if left < 0 else left - shift, -1 if right < 0 else right + shift)
    out_a, lse_a = flashtile.flash_attn_func(q, k[:, :n], v[:, :n],
                                             window_size=prefix_window, return_lse=True)
    out_b, lse_b = flashtile.flash_attn_func(q, k[:, n:], v[:, n:], causal=split.causal,
                                             window_size=split.window, return_lse=True)
    return out_a, lse_a, out_b, lse_b


@pytest.mark.parametrize("split", SPLITS, ids=[s.id for s in SPLITS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merged_halves_equal_attention_over_all_keys(split, dtype, backend, device):
    s = split
    q = torch.randn(s.batch, s.seqlen_q, s.nheads, s.head_dim, dtype=dtype, device=device)
    k = torch.randn(s.batch, s.seqlen_k, s.nheads_kv, s.head_dim, dtype=dtype,
                    device=device)
    v = torch.randn_like(k)
    out_a, lse_a, out_b, lse_b = _halves(q, k, v, s)
    kw = dict(causal=s.causal, window_size=s.window)
    out64, lse64 = attention_naive(q.double(), k.double(), v.double(), **kw)
    out_pt, _ = attention_naive(q, k, v, upcast=False, **kw)

    for order, args in (("a,b", (out_a, lse_a, out_b, lse_b)),
                        ("b,a", (out_b, lse_b, out_a, lse_a))):
        out, lse = flashtile.merge_attention_states(*args)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert out.shape == q.shape and lse.shape == (s.batch, s.nheads, s.seqlen_q)
        assert_close_rule(f"out ({order})", out, out64, out_pt)
        finite = torch.isfinite(lse64)
        assert torch.equal(torch.isfinite(lse), finite), f"lse -inf pattern ({order})"
        assert (lse[~finite] == float("-inf")).all()
        assert (rows(out, ~finite) == 0).all(), "rows with no key must be 0"
        # lse only depends on fp32 scores of exactly representable inputs: tight at any
        # dtype (the bound test_attention uses for flash_attn_func's own lse).
        torch.testing.assert_close(lse[finite].double(), lse64[finite], rtol=1e-4,
                                   atol=1e-4)


def test_split_cases_have_empty_rows():
    """Guard on the cases above: they hold rows with no key in one half and in both."""
    q = torch.randn(1, 23, 4, 24)
    k = torch.randn(1, 11, 2, 24)
    _, lse_a, _, lse_b = _halves(q, k, k, SPLITS[2])
    assert (torch.isinf(lse_b) & torch.isfinite(lse_a)).any()
    assert (torch.isinf(lse_a) & torch.isinf(lse_b)).any()


def rows(out, mask):
    """The (rows, head_dim) of out (batch, seqlen, nheads, d) where mask (batch, nheads,
    seqlen) is True."""
    return out.transpose(1, 2)[mask]


def _random_states(b, s, h, d, dtype, device):
    out_a = torch.randn(b, s, h, d, dtype=dtype, device=device)
    out_b = torch.randn(b, s, h, d, dtype=dtype, device=device)
    lse_a = torch.randn(b, h, s, device=device) * 3
    lse_b = torch.randn(b, h, s, device=device) * 3
    return out_a, lse_a, out_b, lse_b


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_side_gives_exactly_the_other(dtype, backend, device):
    b, s, h, d = 2, 5, 3, 20
    out_a, lse_a, out_b, lse_b = _random_states(b, s, h, d, dtype, device)
    only_b = torch.zeros(b, h, s, dtype=torch.bool, device=device)
    only_a = torch.zeros_like(only_b)
    neither = torch.zeros_like(only_b)
    only_b[0, :, 1] = only_a[1, 0, :] = neither[0, 2, 3] = True
    neither[1, 1, 4] = True
    lse_a = lse_a.masked_fill(only_b | neither, float("-inf"))
    lse_b = lse_b.masked_fill(only_a | neither, float("-inf"))
    # An empty side's out is never read into the sum: NaN there must not leak.
    out_a = out_a.masked_fill((only_b | neither).transpose(1, 2)[..., None], float("nan"))
    out_b = out_b.masked_fill((only_a | neither).transpose(1, 2)[..., None], float("nan"))

    out, lse = flashtile.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(rows(out, only_a), rows(out_a, only_a))
    assert torch.equal(rows(out, only_b), rows(out_b, only_b))
    assert torch.equal(lse[only_a], lse_a[only_a])
    assert torch.equal(lse[only_b], lse_b[only_b])
    assert (rows(out, neither) == 0).all() and (lse[neither] == float("-inf")).all()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_matches_float64_reference(dtype, layout, backend, device):
    b, s, h, d = 2, 7, 3, 33
    out_a, lse_a, out_b, lse_b = _random_states(b, s, h, d, dtype, device)
    if layout == "strided":
        # out: a slice of a wider head dim and of every other head; lse stored
        # (batch, seqlen, nheads) and viewed (batch, nheads, seqlen).
        out_a = torch.randn(b, s, 2 * h, d + 5, dtype=dtype, device=device)[:, :, ::2, :d]
        lse_b = (torch.randn(b, s, h, device=device) * 3).transpose(1, 2)
        assert not out_a.is_contiguous() and not lse_b.is_contiguous()
    out, lse = flashtile.merge_attention_states(out_a, lse_a, out_b, lse_b)
    out64, lse64 = merge_attention_states_ref(out_a.double(), lse_a.double(),
                                              out_b.double(), lse_b.double())
    out_pt, _ = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    assert out.is_contiguous()
    assert_close_rule("out", out, out64, out_pt)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-6, atol=1e-6)
    only_out = flashtile.merge_attention_states(out_a, lse_a, out_b, lse_b,
                                                return_lse=False)
    assert isinstance(only_out, torch.Tensor) and torch.equal(only_out, out)


@pytest.mark.parametrize("shape", [(0, 4, 2, 8), (2, 0, 2, 8), (2, 3, 0, 8)],
                         ids=["batch0", "seqlen0", "nheads0"])
def test_empty_tensors(shape, backend, device):
    b, s, h, d = shape
    out, lse = flashtile.merge_attention_states(*_random_states(b, s, h, d, torch.float32,
                                                                device))
    assert out.shape == shape and lse.shape == (b, h, s)


def test_logaddexp_definition(backend, device):
    """lse is logaddexp(lse_a, lse_b), out the lse-weighted mean, at extreme gaps."""
    out_a, _, out_b, _ = _random_states(1, 4, 1, 8, torch.float32, device)
    lse_a = torch.tensor([[[0.0, 100.0, -100.0, 80.0]]], device=device)
    lse_b = torch.tensor([[[0.0, -100.0, 100.0, 80.0 + math.log(3.0)]]], device=device)
    out, lse = flashtile.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(lse, torch.logaddexp(lse_a, lse_b), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[0, 0], (out_a[0, 0] + out_b[0, 0]) / 2)
    torch.testing.assert_close(out[0, 1], out_a[0, 1])
    torch.testing.assert_close(out[0, 2], out_b[0, 2])
    torch.testing.assert_close(out[0, 3], 0.25 * out_a[0, 3] + 0.75 * out_b[0, 3])


# ---------------------------------------------------------------------------------------
# Autograd: the PyTorch version is differentiable; the Triton path routes to it.

def test_reference_gradients_float64():
    b, s, h, d = 1, 4, 2, 3
    out_a, lse_a, out_b, lse_b = (x.double() for x in
                                  _random_states(b, s, h, d, torch.float32, "cpu"))
    lse_a[0, 0, 1] = float("-inf")                         # one side empty
    inputs = [x.requires_grad_() for x in (out_a, lse_a, out_b, lse_b)]
    assert torch.autograd.gradcheck(merge_attention_states_ref, inputs)


def test_gradients_have_no_nan_on_empty_rows(backend, device):
    out_a, lse_a, out_b, lse_b = _random_states(1, 3, 2, 4, torch.float32, device)
    lse_a[0, 0, 0] = lse_b[0, 0, 0] = float("-inf")       # neither side sees a key
    lse_a[0, 1, 2] = float("-inf")
    leaves = [x.requires_grad_() for x in (out_a, lse_a, out_b, lse_b)]
    out, lse = flashtile.merge_attention_states(*leaves)
    loss = out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()
    for g in torch.autograd.grad(loss, leaves):
        assert not torch.isnan(g).any()


def test_triton_path_routes_grad_inputs_to_pytorch(backend, device, monkeypatch):
    """Grad mode + an input that requires grad: the exact PyTorch version runs (the
    kernel is forward-only); without grad the backend's own path runs."""
    calls = []

    def spy(*args):
        calls.append(args)
        return merge_attention_states_ref(*args)

    monkeypatch.setattr(merge_module, "merge_attention_states_ref", spy)
    out_a, lse_a, out_b, lse_b = _random_states(1, 3, 2, 4, torch.float32, device)
    out_a.requires_grad_()
    out, _ = flashtile.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert len(calls) == 1 and out.requires_grad
    with torch.no_grad():
        flashtile.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert len(calls) == (1 if backend == "triton" else 2)


# ---------------------------------------------------------------------------------------
# Bad input: the error names the argument, the expected and the given value.

B, S, H, D = 2, 5, 3, 8


def _meta(x):
    return x.to("meta")


ERROR_CASES = [
    pytest.param(dict(out_a=[1.0]), TypeError, "out_a: expected a torch.Tensor, got list",
                 id="out_a-not-tensor"),
    pytest.param(dict(out_a=torch.zeros(B, S, H, D, dtype=torch.int32)), TypeError,
                 "out_a: expected dtype float16, bfloat16 or float32, got torch.int32",
                 id="out_a-int"),
    pytest.param(dict(out_b=torch.zeros(B, S, H, D, dtype=torch.float16)), TypeError,
                 "out_b.dtype: expected out_a's dtype torch.float32, got torch.float16",
                 id="out_b-dtype"),
    pytest.param(dict(out_a=torch.zeros(S, H, D)), ValueError,
                 f"out_a: expected a 4-d tensor, got shape {(S, H, D)}", id="out_a-rank3"),
    pytest.param(dict(out_b=torch.zeros(B, S + 1, H, D)), ValueError,
                 f"out_b.shape: expected out_a's shape {(B, S, H, D)}, got "
                 f"{(B, S + 1, H, D)}", id="out_b-shape"),
    pytest.param(dict(out_b=torch.zeros(B, S, H, 2 * D)[..., ::2]), ValueError,
                 "out_b.stride(-1): expected 1 (the head dim contiguous), got 2",
                 id="out_b-last-dim-strided"),
    pytest.param(dict(lse_a=torch.zeros(B, H, S, dtype=torch.float16)), TypeError,
                 "lse_a.dtype: expected torch.float32, got torch.float16. "
                 "Pass lse_a.float()",
                 id="lse_a-fp16"),
    pytest.param(dict(lse_b=torch.zeros(B, S, H)), ValueError,
                 f"lse_b.shape: expected (batch, nheads, seqlen) = {(B, H, S)}",
                 id="lse_b-seq-major"),
    pytest.param(dict(lse_a=None), TypeError,
                 "lse_a: expected a torch.Tensor, got NoneType", id="lse_a-none"),
    pytest.param(dict(out_b=_meta(torch.zeros(B, S, H, D))), ValueError,
                 "out_b.device: expected out_a's device cpu, got meta", id="out_b-device"),
    pytest.param(dict(lse_b=_meta(torch.zeros(B, H, S))), ValueError,
                 "lse_b.device: expected out_a's device cpu, got meta", id="lse_b-device"),
    pytest.param(dict(out_a=torch.zeros(B, S, H, 0), out_b=torch.zeros(B, S, H, 0)),
                 ValueError, "out_a.shape[-1] (head_dim): expected at least 1, got 0",
                 id="head_dim-0"),
    pytest.param(dict(return_lse=1), TypeError, "return_lse: expected a bool, got int",
                 id="return_lse-int"),
]


@pytest.mark.parametrize("change, kind, message", ERROR_CASES)
def test_bad_input_raises_named_error(change, kind, message, backend):
    args = dict(out_a=torch.zeros(B, S, H, D), lse_a=torch.zeros(B, H, S),
                out_b=torch.zeros(B, S, H, D), lse_b=torch.zeros(B, H, S))
    args.update(change)
    with pytest.raises(kind) as err:
        flashtile.merge_attention_states(**args)
    assert message in str(err.value)


# ---------------------------------------------------------------------------------------
# GPU: bf16 (the interpreter gets bf16 wrong) and larger shapes.

GPU_SPLITS = [
    Split(4, 1, 4099, 2048, nheads=32, nheads_kv=8, head_dim=128),       # decode-like
    Split(2, 513, 1031, 400, nheads=8, nheads_kv=8, head_dim=64, causal=True),
    Split(1, 777, 777, 300, nheads=4, nheads_kv=2, head_dim=96, window=(600, 0)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("split", GPU_SPLITS, ids=[s.id for s in GPU_SPLITS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_merged_halves(split, dtype, device, monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    test_merged_halves_equal_attention_over_all_keys(split, dtype, "triton", device)


@pytest.mark.gpu
def test_gpu_bf16_kernel_matches_reference(device, monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    out_a, lse_a, out_b, lse_b = _random_states(8, 257, 32, 128, torch.bfloat16, device)
    lse_a[:, :, :7] = float("-inf")
    out, lse = flashtile.merge_attention_states(out_a, lse_a, out_b, lse_b)
    out_ref, lse_ref = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    # Same fp32 formula, one bf16 rounding at the end: at most 1 bf16 ulp apart.
    assert max_err(out, out_ref) <= 2 ** -7 * out_ref.abs().max().item()
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[:, :7], out_b[:, :7])
