"""The engine's elementwise kernels against float64 and their PyTorch references:
RMSNorm with and without the fused residual add (engine/layernorm.py), SiLU-and-multiply
(engine/activation.py), the rotary embedding with the KV-cache write
(engine/rope_store.py).

Accuracy follows the house rule (error against float64 at most twice PyTorch's own at
the same dtype, plus a floor). At 16 bits the kernels must also round as the references
do: cast before the weight multiply, silu rounded before the product. Computing those
in fp32 without the intermediate roundings agrees with the references on ~74% of fp16
outputs (measured); the kernels agree on more than 99.9%, so the test asks for 99.5%.
On CPU the kernels run under TRITON_INTERPRET=1 (fp32 and fp16: the interpreter is
wrong for bf16), with the interpreter's small tiles, so short rows still span several
column, row and head blocks (ops/configs.py).
"""

from __future__ import annotations

import pytest
import torch

from flashtile.engine.activation import silu_and_mul, silu_and_mul_reference
from flashtile.engine.layernorm import add_rms_norm, add_rms_norm_reference, rms_norm, \
    rms_norm_reference
from flashtile.engine.rope_store import rope_and_store, rotate_halves
from tests.conftest import triton_available_here
from tests.fp8_utils import fp8_interpreter
from tests.utils import assert_close_rule

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bf16")]
EPS = 1e-6
# Outputs equal to the PyTorch reference's at 16 bits (the module docstring).
SAME_ROUNDING = 0.995
__all__ = ["fp8_interpreter"]  # the fixture, imported to be used here


@pytest.fixture(autouse=True)
def _triton_here(on_gpu):
    if not triton_available_here(on_gpu):
        pytest.skip("Triton kernels: the GPU, or the interpreter (TRITON_INTERPRET=1)")


def _check(name, ours, ref64, same_dtype):
    assert ours.shape == same_dtype.shape and ours.dtype == same_dtype.dtype, name
    assert_close_rule(name, ours, ref64, same_dtype)
    if ours.dtype != torch.float32:
        agree = (ours == same_dtype).float().mean().item()
        assert agree >= SAME_ROUNDING, f"{name}: {agree:.4f} of outputs round as PyTorch's"


def _rms64(x, weight):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def _weight(n, dtype, device):
    return (1 + 0.5 * torch.randn(n, device=device)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rows,n", [(1, 896), (3, 896), (1000, 72), (3, 1), (5, 4096)])
def test_rms_norm_equals_reference(rows, n, residual, dtype, device):
    x = 2 * torch.randn(rows, n, dtype=dtype, device=device)
    w = _weight(n, dtype, device)
    if not residual:
        _check("rms_norm", rms_norm(x, w, EPS), _rms64(x, w), rms_norm_reference(x, w, EPS))
        return
    r = torch.randn(rows, n, dtype=dtype, device=device)
    normed, summed = add_rms_norm(x, r, w, EPS)
    want_normed, want_summed = add_rms_norm_reference(x, r, w, EPS)
    # The sum is rounded to the stream's dtype once, as the eager add: equal bits.
    assert torch.equal(summed, want_summed)
    _check("add_rms_norm", normed, _rms64(want_summed, w), want_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 64, 24])
def test_rms_norm_per_head_of_the_fused_projection(head_dim, dtype, device):
    """Qwen3's q/k norm: rows of head_dim in the strided (T, heads, d) views that the
    fused qkv projection's split gives, q's 32 heads and k's 8."""
    t, h, hkv = 7, 32, 8
    qkv = torch.randn(t, (h + 2 * hkv) * head_dim, dtype=dtype, device=device)
    q, k, _ = (x.view(t, -1, head_dim) for x in qkv.split(
        [h * head_dim, hkv * head_dim, hkv * head_dim], dim=-1))
    w = _weight(head_dim, dtype, device)
    for name, x in (("q", q), ("k", k)):
        out = rms_norm(x, w, EPS)
        assert out.is_contiguous()
        _check(f"rms_norm of {name}", out, _rms64(x, w), rms_norm_reference(x, w, EPS))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_of_strided_rows_and_mixed_dtypes(residual, device):
    """Rows further apart than their length (a column slice), and an fp32 weight over
    fp16 rows: the output in the promoted dtype, as PyTorch's product gives it."""
    wide = torch.randn(9, 300, dtype=torch.float16, device=device)
    x = wide[:, 7:7 + 200]
    w = _weight(200, torch.float32, device)
    if residual:
        r = torch.randn(9, 260, dtype=torch.float16, device=device)[:, 30:230]
        normed, summed = add_rms_norm(x, r, w, EPS)
        want_normed, want_summed = add_rms_norm_reference(x, r, w, EPS)
        assert torch.equal(summed, want_summed)
        _check("add_rms_norm", normed, _rms64(want_summed, w), want_normed)
    else:
        _check("rms_norm", rms_norm(x, w, EPS), _rms64(x, w), rms_norm_reference(x, w, EPS))


def _silu_mul64(x):
    gate, up = x.double().chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 4864), (3, 4864), (1000, 40), (3, 1)])
def test_silu_and_mul_equals_reference(rows, n, dtype, device):
    x = 3 * torch.randn(rows, 2 * n, dtype=dtype, device=device)
    out = silu_and_mul(x)
    assert out.is_contiguous()
    _check("silu_and_mul", out, _silu_mul64(x), silu_and_mul_reference(x))


def test_silu_and_mul_of_strided_rows(device):
    x = 3 * torch.randn(5, 2 * 100 + 24, dtype=torch.float16, device=device)[:, 8:8 + 200]
    _check("silu_and_mul", silu_and_mul(x), _silu_mul64(x), silu_and_mul_reference(x))


def _rotate64(x, cos, sin):
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no_pool"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (14, 2, 64), (5, 3, 32),
                                                     (3, 1, 24)])
def test_rope_and_store_equals_reference(heads, kv_heads, head_dim, dtype, pool, device):
    """GQA and many heads, head blocks with masked heads (5 and 3 heads in blocks of 4
    under the interpreter), views of one fused projection, slot -1 rows (CUDA-graph
    padding) that write nothing, and the pool-free rotation (the runner's sizing
    forward). The pool rows written hold the returned k and the given v bit for bit;
    every other row is untouched."""
    t, ps, blocks = 7, 4, 5
    d = head_dim
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, dtype=dtype, device=device)
    q, k, v = (x.view(t, -1, d) for x in qkv.split(
        [heads * d, kv_heads * d, kv_heads * d], dim=-1))
    angles = torch.rand(t, d // 2, device=device) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 0, -1, 17, 9, -1, 12], device=device)
    caches = [torch.randn(blocks, ps, kv_heads, d, dtype=dtype, device=device)
              for _ in range(2)] if pool else [None, None]
    before = [c.clone() for c in caches] if pool else None
    q_out, k_out = rope_and_store(q, k, v, cos, sin, slots, *caches)
    _check("rotated q", q_out, _rotate64(q, cos, sin), rotate_halves(q, cos, sin))
    _check("rotated k", k_out, _rotate64(k, cos, sin), rotate_halves(k, cos, sin))
    if not pool:
        return
    keep = slots >= 0
    for name, cache, old, new in (("k", caches[0], before[0], k_out),
                                  ("v", caches[1], before[1], v)):
        flat, old_flat = cache.view(-1, kv_heads, d), old.view(-1, kv_heads, d)
        assert torch.equal(flat[slots[keep]], new[keep]), name
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
        untouched[slots[keep]] = False
        assert torch.equal(flat[untouched], old_flat[untouched]), name


@pytest.mark.parametrize("scales", [None, (0.37, 2.5)], ids=["scale1", "scaled"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_rope_and_store_into_an_fp8_pool(cache_dtype, scales, device, on_gpu, request):
    """kv_cache_dtype="fp8": the kernel writes the rotated k and the v as the engine's
    PyTorch path does (attention.to_pool: divided by the pool's scale, 1.0 by default,
    nearest even, saturated; values past e4m3's 448 included), byte for byte; slot -1
    rows write nothing."""
    if not on_gpu:
        request.getfixturevalue("fp8_interpreter")
    from flashtile.engine.attention import to_pool
    from flashtile.engine.rope_store import rope_and_store_reference

    dtype = torch.bfloat16 if on_gpu else torch.float16
    t, heads, kv_heads, d, ps, blocks = 6, 4, 2, 32, 4, 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device=device) * 4
    qkv[:, -3:] = torch.tensor([500.0, -1000.0, 3e4])  # past 448 (e4m3), within e5m2
    qkv = qkv.to(dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split(
        [heads * d, kv_heads * d, kv_heads * d], dim=-1))
    angles = torch.rand(t, d // 2, device=device) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, -1, 17, 0, 9, 12], device=device)
    caches = [torch.zeros(blocks, ps, kv_heads, d, device=device).to(cache_dtype)
              for _ in range(4)]
    k_scale, v_scale = (None, None) if scales is None else (
        torch.tensor(x, device=device) for x in scales)
    q_out, k_out = rope_and_store(q, k, v, cos, sin, slots, *caches[:2], k_scale, v_scale)
    rope_and_store_reference(q, k, v, cos, sin, slots, *caches[2:], k_scale, v_scale)
    keep = slots >= 0
    for name, ours, ref, new, scale in (("k", caches[0], caches[2], k_out, k_scale),
                                        ("v", caches[1], caches[3], v, v_scale)):
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)), name
        written = ours.view(-1, kv_heads, d)[slots[keep]]
        assert torch.equal(written.view(torch.uint8),
                           to_pool(new[keep], cache_dtype, scale).view(torch.uint8)), name
    if scales is not None:
        with pytest.raises(ValueError, match="k_scale: expected a 0-d float32"):
            rope_and_store(q, k, v, cos, sin, slots, *caches[:2], k_scale.double(), v_scale)
    assert torch.isfinite(caches[1].float()).all()  # saturated, never NaN


def test_kernels_refuse_bad_layouts_naming_the_argument(device):
    x = torch.randn(4, 2, 3, 8, device=device)
    with pytest.raises(ValueError, match="x: expected .* got shape"):
        rms_norm(x, torch.ones(8, device=device), EPS)
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\)"):
        rms_norm(x[0, 0], torch.ones(9, device=device), EPS)
    with pytest.raises(ValueError, match="residual: expected x's shape"):
        add_rms_norm(x[0, 0], x[0, 1, :2], torch.ones(8, device=device), EPS)
    with pytest.raises(ValueError, match="x: expected .*gate | up"):
        silu_and_mul(torch.randn(3, 7, device=device))
    q = torch.randn(2, 2, 8, device=device)
    pool = torch.randn(2, 4, 8, 2, device=device).transpose(2, 3)
    with pytest.raises(ValueError, match="k_cache/v_cache: expected contiguous pools"):
        rope_and_store(q, q, q, torch.ones(2, 4, device=device),
                       torch.zeros(2, 4, device=device),
                       torch.zeros(2, dtype=torch.long, device=device), pool, pool)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_inputs_propagate(dtype, device):
    """A NaN or Inf in the input never becomes a plausible number: RMSNorm's row with a
    NaN is NaN throughout (so is the mean of its squares; with the residual add, the sum
    keeps the NaN at its place), a row with an Inf is PyTorch's (x / Inf: zeros, and
    NaN at the Inf), and the other rows equal the clean result;
    SiLU-and-multiply's NaN stays at its element; rotary's NaN reaches the rotated pair
    (x1, x2) it is part of and the cache row it is stored into, nothing else."""
    rows, n = 4, 96
    weight = _weight(n, dtype, device)
    x = torch.randn(rows, n, dtype=dtype, device=device)
    clean = rms_norm(x, weight, EPS)
    keep = torch.tensor([0, 2, 3], device=device)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 5] = bad
        out = rms_norm(y, weight, EPS)
        if bad != bad:
            assert out[1].isnan().all()
        else:
            assert out[1, 5].isnan() and out[1].isnan().sum() == 1
            assert (out[1].nan_to_num() == 0).all()
        assert torch.equal(out[keep], clean[keep]), bad
    y = x.clone()
    y[2, 7] = float("nan")
    residual = torch.randn_like(x)
    out, summed = add_rms_norm(y, residual, weight, EPS)
    assert summed[2, 7].isnan() and summed.isnan().sum() == 1
    assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()

    gate_up = torch.randn(3, 2 * n, dtype=dtype, device=device)
    gate_up[0, 4] = float("nan")       # gate of output (0, 4)
    gate_up[2, n + 9] = float("nan")   # up of output (2, 9)
    out = silu_and_mul(gate_up)
    nan = out.isnan()
    assert nan[0, 4] and nan[2, 9] and nan.sum() == 2

    t, heads, kv_heads, d = 3, 4, 2, 32
    q = torch.randn(t, heads, d, dtype=dtype, device=device)
    k = torch.randn(t, kv_heads, d, dtype=dtype, device=device)
    v = torch.randn(t, kv_heads, d, dtype=dtype, device=device)
    q[1, 2, 3] = float("nan")  # the pair (3, 3 + d/2) of token 1, head 2
    v[2, 1, 0] = float("nan")
    angles = torch.rand(t, d // 2, device=device)
    caches = [torch.zeros(2, 4, kv_heads, d, dtype=dtype, device=device) for _ in range(2)]
    slots = torch.tensor([0, 1, 5], device=device)
    q_out, k_out = rope_and_store(q, k, v, angles.cos(), angles.sin(), slots, *caches)
    nan = q_out.isnan()
    assert nan[1, 2, 3] and nan[1, 2, 3 + d // 2] and nan.sum() == 2
    assert not k_out.isnan().any()
    v_rows = caches[1].view(-1, kv_heads, d)
    assert v_rows[5, 1, 0].isnan() and v_rows.isnan().sum() == 1
