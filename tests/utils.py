"""Accuracy rule and reference helpers shared by the tests."""

import torch

from flashtile.reference import attention_naive

# Absolute slack added to 2x PyTorch's own error, per dtype: covers the cases where
# PyTorch's same-dtype path happens to be nearly exact (tiny errors on both sides).
FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def assert_close_rule(name, ours, ref64, torch_same_dtype):
    """err(ours) <= 2 * err(torch at our dtype) + floor, both against float64 (flash-attn)."""
    assert not torch.isnan(ours).any(), f"{name}: NaN in output"
    e_ours = max_err(ours, ref64)
    e_torch = max_err(torch_same_dtype, ref64)
    bound = 2 * e_torch + FLOOR[ours.dtype]
    assert e_ours <= bound, f"{name}: max error {e_ours:.3g} > bound {bound:.3g} " \
                            f"(torch's own error {e_torch:.3g})"


def reference_pair(q, k, v, dout, dlse=None, **kw):
    """Float64 oracle and PyTorch-at-our-dtype results: ((out, lse, grads) x 2)."""
    results = []
    for upcast in (True, False):
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
        if upcast:
            qs, ks, vs = (x.detach().double().requires_grad_() for x in (q, k, v))
        out, lse = attention_naive(qs, ks, vs, upcast=upcast, **kw)
        loss = (out * dout.to(out.dtype)).sum()
        if dlse is not None:
            fin = torch.isfinite(lse)
            loss = loss + (torch.where(fin, lse, 0) * dlse.to(lse.dtype)).sum()
        grads = torch.autograd.grad(loss, (qs, ks, vs))
        results.append((out.detach(), lse.detach(), grads))
    return results
