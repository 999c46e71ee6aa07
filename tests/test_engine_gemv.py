"""The engine's GEMV for decode steps of one or two tokens (engine/gemv.py) against
float64 and F.linear, its input checks, and its opt-in switch.

On CPU the kernel runs under TRITON_INTERPRET=1 (fp32 and fp16: the interpreter is wrong
for bf16); on the GPU (--gpu) bf16 too, at the engine's shapes.
"""

from __future__ import annotations

import pytest
import torch

from flashtile.engine import gemv as gemv_module
from flashtile.engine.gemv import gemv, gemv_reference, linear
from flashtile.ops import configs
from tests.conftest import triton_available_here
from tests.utils import assert_close_rule

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bf16")]
# (N, K): ragged feature blocks (37, 5), K below, at and past one tile (1024 / 2048) with
# a ragged last tile, and Qwen2.5-0.5B's q/k/v product.
SHAPES = [(37, 200), (5, 2100), (64, 1024), (100, 1030), (1152, 896)]


@pytest.fixture
def kernels_here(on_gpu):
    if not triton_available_here(on_gpu):
        pytest.skip("Triton kernels: the GPU, or the interpreter (TRITON_INTERPRET=1)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda x: str(x))
def test_gemv_matches_float64(n, k, m, bias, dtype, device, kernels_here):
    """x @ W^T (+ b) within twice F.linear's own error against float64 (plus the floor),
    x a row-strided view (a slice of a wider activation)."""
    torch.manual_seed(n * k + m)
    x = torch.randn(m, k + 24, dtype=dtype, device=device)[:, 8:8 + k]
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    ours = gemv(x, w, b)
    ref64 = gemv_reference(x.double(), w.double(), None if b is None else b.double())
    same = gemv_reference(x, w, b)
    assert ours.shape == (m, n) and ours.dtype == dtype and ours.is_contiguous()
    assert_close_rule("gemv", ours, ref64, same)


def test_gemv_nan_propagates(device, kernels_here):
    """A NaN in x reaches every output; one in a row of W only that feature's."""
    x = torch.randn(1, 300, device=device)
    w = torch.randn(9, 300, device=device)
    w[4, 17] = float("nan")
    out = gemv(x, w)
    assert out[0, 4].isnan() and not out[0, [0, 1, 2, 3, 5, 6, 7, 8]].isnan().any()
    x[0, 3] = float("nan")
    assert gemv(x, w).isnan().all()


def test_gemv_rejects_bad_input():
    """Shapes and layouts it does not take are ValueErrors naming the argument."""
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"x: expected \(M, K\) with 1 <= M <= 2"):
        gemv(torch.randn(3, 16), w)
    with pytest.raises(ValueError, match="x: expected"):
        gemv(torch.randn(1, 32)[:, ::2], w)
    with pytest.raises(ValueError, match=r"weight: expected a contiguous \(N, 16\)"):
        gemv(x, torch.randn(8, 15))
    with pytest.raises(ValueError, match="weight: expected"):
        gemv(x, torch.randn(16, 8).t())
    with pytest.raises(ValueError, match="weight: expected"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match=r"bias: expected a contiguous \(8,\) tensor"):
        gemv(x, w, torch.randn(9))


def test_max_tokens_switch(monkeypatch):
    """FLASHTILE_ENGINE_GEMV (configs.engine_gemv_max_tokens): 2 (unset), 0, 1 or 2 tokens
    a step; else a ValueError naming the variable and the choices."""
    monkeypatch.delenv("FLASHTILE_ENGINE_GEMV", raising=False)
    assert configs.engine_gemv_max_tokens() == 2
    for raw, want in (("1", 1), (" 2 ", 2), ("0", 0)):
        monkeypatch.setenv("FLASHTILE_ENGINE_GEMV", raw)
        assert configs.engine_gemv_max_tokens() == want
    monkeypatch.setenv("FLASHTILE_ENGINE_GEMV", "3")
    with pytest.raises(ValueError, match=r"FLASHTILE_ENGINE_GEMV must be one of "
                       r"\('2', '0', '1'\), got '3'"):
        configs.engine_gemv_max_tokens()


def test_linear_routes_small_cuda_steps(monkeypatch):
    """``linear`` (the engine's parallel linears): CPU tensors always take F.linear; on
    CUDA, steps of at most FLASHTILE_ENGINE_GEMV tokens take gemv."""
    calls = []
    monkeypatch.setattr(gemv_module, "gemv", lambda *a: calls.append(a) or "gemv")
    monkeypatch.setattr(gemv_module, "_max_tokens", 2)
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w)) and not calls

    class FakeCuda(torch.Tensor):  # is_cuda without a GPU
        is_cuda = True

    for m, routed in ((1, True), (2, True), (3, False)):
        calls.clear()
        xc = torch.randn(m, 16).as_subclass(FakeCuda)
        out = linear(xc, w)
        assert (out == "gemv") is routed and bool(calls) is routed
    monkeypatch.setattr(gemv_module, "_max_tokens", 0)
    calls.clear()
    linear(torch.randn(1, 16).as_subclass(FakeCuda), w)
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_engine_linears_with_gemv_equal_f_linear(m, monkeypatch):
    """On the GPU, bf16 at the 0.5B and 1B shapes (q/k/v with bias, o, gate_up, down, the
    LM head): gemv within F.linear's rule against float64, through a second call (the
    launch plan) too."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    torch.manual_seed(m)
    for n, k, bias in ((1152, 896, True), (896, 896, False), (9728, 896, False),
                       (896, 4864, False), (151936, 896, False), (2048, 8192, False)):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        b = torch.randn(n, dtype=torch.bfloat16, device="cuda") if bias else None
        ref64 = gemv_reference(x.double(), w.double(), None if b is None else b.double())
        same = gemv_reference(x, w, b)
        for _ in range(2):
            assert_close_rule(f"gemv {n}x{k}", gemv(x, w, b), ref64, same)
