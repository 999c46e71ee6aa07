"""The torch backend's fused path: PyTorch's CPU flash kernel under flashtile's meaning.

Which calls take it (and with what: never a seqlen_q x seqlen_k tensor unless the user
gave a mask), and that what it returns meets the accuracy rule against the float64
oracle, forward and backward, on shapes that cross the kernel's own tiles (query blocks
of 32/64/256 rows, key blocks of 512).
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile import _torch_backend
from tests.utils import assert_close_rule, reference_pair

pytestmark = pytest.mark.usefixtures("torch_backend")


@pytest.fixture
def torch_backend(monkeypatch, on_gpu):
    if on_gpu:
        pytest.skip("the fused path runs on CPU tensors")
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")


@pytest.fixture
def fused_calls(monkeypatch):
    """Every fused forward/backward call: (op, key length, causal, attn_mask)."""
    calls = []

    def spy(op, name):
        # fwd(q, k, v, dropout_p, causal), bwd(dout, q, k, v, out, lse, dropout_p, causal)
        def call(*args, **kwargs):
            k, causal = (args[1], args[4]) if name == "fwd" else (args[2], args[7])
            calls.append((name, k.shape[2], causal, kwargs.get("attn_mask")))
            return op(*args, **kwargs)
        return call

    monkeypatch.setattr(_torch_backend, "_FWD", spy(_torch_backend._FWD, "fwd"))
    monkeypatch.setattr(_torch_backend, "_BWD", spy(_torch_backend._BWD, "bwd"))
    return calls


# (seqlen_q, seqlen_k, causal, window) -> the fused calls expected: the key length and
# causal flag of each. Bottom-right causal with seqlen_q < seqlen_k is a mask-free call
# over the keys every row sees plus a top-left causal call over the rest.
GEOMETRY = {
    "full": ((300, 700, False, (-1, -1)), [(700, False)]),
    "causal_square": ((600, 600, True, (-1, -1)), [(600, True)]),
    "causal_q<k": ((300, 1100, True, (-1, -1)), [(800, False), (300, True)]),
    "causal_q>k": ((1100, 300, True, (-1, -1)), [(300, True)]),
    "decode": ((1, 1100, True, (-1, -1)), [(1100, False)]),
    "right_window": ((300, 700, False, (-1, 40)), [(440, False), (260, True)]),
}


@pytest.mark.parametrize("geometry", list(GEOMETRY))
def test_calls_and_no_quadratic_tensor(geometry, fused_calls):
    (sq, sk, causal, window), expected = GEOMETRY[geometry]
    q, k, v = torch.randn(1, sq, 2, 16), torch.randn(1, sk, 2, 16), torch.randn(1, sk, 2, 16)
    flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window)
    assert [(n, c) for _, n, c, _ in fused_calls] == expected
    assert all(mask is None for *_, mask in fused_calls)


@pytest.mark.parametrize("kwargs", [dict(softcap=5.0), dict(window_size=(16, 0)),
                                    dict(alibi_slopes=torch.tensor([0.1, 0.2]))],
                         ids=["softcap", "left_window", "alibi"])
def test_features_the_kernel_lacks_run_tiled(kwargs, fused_calls):
    q, k, v = (torch.randn(1, 40, 2, 16) for _ in range(3))
    flashtile.flash_attn_func(q, k, v, causal=True, **kwargs)
    assert fused_calls == []


def test_sdpa_mask_passes_once_at_its_broadcast_size(fused_calls):
    """A (1, 1, sq, sk) bool mask broadcast over batch and heads is converted at that
    size, never at (batch, heads, sq, sk)."""
    q, k, v = (torch.randn(4, 8, 50, 16) for _ in range(3))
    mask = torch.rand(1, 1, 50, 50) > 0.5
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    (_, _, _, passed), = fused_calls
    assert passed.shape == (1, 1, 50, 50) and passed.dtype == q.dtype
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref)


CASES = {
    # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal, window)
    "full_gqa": (2, 97, 600, 4, 2, 40, False, (-1, -1)),
    "causal_q<k": (1, 300, 1100, 2, 1, 64, True, (-1, -1)),
    "causal_q>k_gqa": (1, 800, 257, 4, 2, 32, True, (-1, -1)),
    "causal_square_odd_d": (2, 257, 257, 2, 2, 24, True, (-1, -1)),
    "right_window": (1, 200, 333, 2, 2, 16, False, (-1, 7)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_meets_the_accuracy_rule(case, dtype, fused_calls):
    b, sq, sk, h, hkv, d, causal, window = CASES[case]
    q = torch.randn(b, sq, h, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, requires_grad=True)
    out, lse = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                         return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert {name for name, *_ in fused_calls} == {"fwd", "bwd"}
    (ref_out, ref_lse, ref_grads), (pt_out, pt_lse, pt_grads) = reference_pair(
        q, k, v, dout, causal=causal, window_size=window)
    assert_close_rule("out", out, ref_out, pt_out)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert_close_rule("lse", lse[fin], ref_lse[fin], pt_lse[fin].float())
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        assert_close_rule(name, g, r, p)


def test_lse_gradient_falls_back_to_the_tiled_backward(fused_calls):
    """The fused backward has no lse-gradient input: a loss on the lse runs the tiled
    backward (exact), while the forward stays fused."""
    q, k, v = (torch.randn(1, 70, 2, 16, requires_grad=True) for _ in range(3))
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert [name for name, *_ in fused_calls] == ["fwd"]
    (_, _, ref_grads), (_, _, pt_grads) = reference_pair(q, k, v, dout, dlse, causal=True)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        assert_close_rule(name, g, r, p)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_mask_with_empty_rows_forward_and_backward(kind):
    """Rows the mask empties: out 0 and zero gradients, the rest as the float64 oracle."""
    b, h, sq, sk, d = 2, 2, 90, 130, 16
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for s in (sq, sk, sk))
    allowed = torch.rand(b, 1, sq, sk) > 0.4
    allowed[:, :, 7] = False
    mask = allowed if kind == "bool" else \
        torch.zeros(b, 1, sq, sk).masked_fill(~allowed, float("-inf"))
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert (out[:, :, 7] == 0).all() and (dq[:, :, 7] == 0).all()
    t = [x.detach().transpose(1, 2) for x in (q, k, v)]
    (ref_out, _, ref_grads), (pt_out, _, pt_grads) = reference_pair(
        *t, dout.transpose(1, 2), attn_mask=mask, diag_offset=0)
    assert_close_rule("out", out.transpose(1, 2), ref_out, pt_out)
    for name, g, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, pt_grads):
        assert_close_rule(name, g.transpose(1, 2), r, p)
