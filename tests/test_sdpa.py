"""flashtile.scaled_dot_product_attention against torch's SDPA in float64."""

import pytest
import torch
import torch.nn.functional as F

import flashtile
from tests.utils import FLOOR, max_err


MASKS = {
    "none": lambda b, h, sq, sk, dev: None,
    "bool_2d": lambda b, h, sq, sk, dev: torch.rand(sq, sk, device=dev) > 0.3,
    "bool_b11k": lambda b, h, sq, sk, dev: torch.rand(b, 1, 1, sk, device=dev) > 0.2,
    "bool_full_rows_off": lambda b, h, sq, sk, dev: torch.cat(
        [torch.zeros(b, h, 2, sk, dtype=torch.bool, device=dev),
         torch.rand(b, h, sq - 2, sk, device=dev) > 0.5], dim=2),
    "additive_bh": lambda b, h, sq, sk, dev: torch.randn(b, h, sq, sk, device=dev),
    "additive_1hq1": lambda b, h, sq, sk, dev: torch.randn(1, h, sq, 1, device=dev),
}


# "triton-fused": the attn_mask reaches the fused backward too (conftest.backend).
WITH_FUSED = pytest.mark.parametrize("backend", ["torch", "triton", "triton-fused"],
                                     indirect=True)


@WITH_FUSED
@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("shape", [(2, 4, 4, 37, 53, 32), (1, 4, 2, 61, 29, 48)],
                         ids=["mha", "gqa"])
def test_sdpa_masks(shape, mask_kind, backend, device):
    b, h, hkv, sq, sk, d = shape
    dtype = torch.float32
    q = torch.randn(b, h, sq, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, sk, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, sk, d, device=device, dtype=dtype)
    mask = MASKS[mask_kind](b, h, sq, sk, device)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = flashtile.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask,
                                                 enable_gqa=hkv != h)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)

    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=m64, enable_gqa=hkv != h)
    # torch gives NaN (older) or 0 (newer) for rows the mask empties; flashtile gives 0.
    ref = torch.nan_to_num(ref, nan=0.0)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert max_err(out, ref) < 1e-5
    for ours, r in zip(grads, ref_grads):
        assert max_err(ours, torch.nan_to_num(r, nan=0.0)) < 1e-4


@pytest.mark.parametrize("sq,sk", [(40, 40), (23, 57), (57, 23)])
def test_sdpa_causal_is_top_left(sq, sk, backend, device):
    q = torch.randn(2, 3, sq, 16, device=device)
    k = torch.randn(2, 3, sk, 16, device=device)
    v = torch.randn(2, 3, sk, 16, device=device)
    out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                         is_causal=True, scale=0.3)
    assert max_err(out, ref) < 1e-5


def test_sdpa_3d(backend, device):
    q, k, v = (torch.randn(3, 29, 16, device=device) for _ in range(3))
    mask = torch.rand(3, 29, 29, device=device) > 0.3
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert out.shape == (3, 29, 16)
    assert max_err(out, ref) < 1e-5


# Masks of (2, 3, heads, 19, 23) inputs: fewer dims than the batch dims (broadcast as
# they are), the whole shape, and batch dims of size 1 and stride 0 among them (merged).
MASKS_5D = {
    "none": lambda dev: None,
    "bool_2d": lambda dev: torch.rand(19, 23, device=dev) > 0.3,
    "additive_h11": lambda dev: torch.randn(4, 1, 1, device=dev),
    "bool_full": lambda dev: torch.rand(2, 3, 4, 19, 23, device=dev) > 0.3,
    "additive_1_3": lambda dev: torch.randn(3, 1, 19, 23, device=dev),
    "bool_expanded": lambda dev: (torch.rand(2, 1, 1, 19, 23, device=dev) > 0.3).expand(
        2, 3, 4, 19, 23),
}


@pytest.mark.parametrize("mask_kind", list(MASKS_5D))
@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
def test_sdpa_more_batch_dims(mask_kind, hkv, backend, device):
    """(batch, ..., heads, seq, dim) inputs, as torch's SDPA takes them: forward and
    backward against the float64 oracle."""
    q = torch.randn(2, 3, 4, 19, 16, device=device)
    k, v = (torch.randn(2, 3, hkv, 23, 16, device=device) for _ in range(2))
    mask = MASKS_5D[mask_kind](device)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = flashtile.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask,
                                                 enable_gqa=hkv != 4)
    assert out.shape == (2, 3, 4, 19, 16)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    ref = torch.nan_to_num(F.scaled_dot_product_attention(
        q64, k64, v64, attn_mask=m64, enable_gqa=hkv != 4), nan=0.0)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert max_err(out, ref) < 1e-5
    for ours, r in zip(grads, ref_grads):
        assert max_err(ours, torch.nan_to_num(r, nan=0.0)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sdpa_lowp_matches_torch_error(dtype, device):
    b, h, s, d = 2, 8, 1024, 128
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
    mask = torch.rand(b, 1, s, s, device=device) > 0.1
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        pt = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert max_err(out, ref) <= 2 * max_err(pt, ref) + FLOOR[dtype]


@WITH_FUSED
def test_sdpa_additive_mask_with_inf_rows(backend, device):
    """Regression: an additive mask of -inf (left padding built with masked_fill) that
    empties a row's first key block, or the whole row, gave NaN in the unmasked span."""
    b, h, sq, sk, d = 2, 2, 40, 70, 16
    q = torch.randn(b, h, sq, d, device=device)
    k = torch.randn(b, h, sk, d, device=device)
    v = torch.randn(b, h, sk, d, device=device)
    mask = torch.zeros(b, 1, sq, sk, device=device)
    mask[:, :, :, :37] = float("-inf")   # every row: the first key blocks excluded
    mask[0, :, 5] = float("-inf")        # one row: every key excluded
    qg = q.clone().requires_grad_()
    out = flashtile.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    (dq,) = torch.autograd.grad(out.sum(), qg)
    assert not torch.isnan(out).any() and not torch.isnan(dq).any()
    ref = torch.nan_to_num(F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask.double()), nan=0.0)
    assert max_err(out, ref) < 1e-5
    assert (out[0, :, 5] == 0).all()
