"""The engine's GEMV for decode steps of one or two tokens (engine/gemv.py) against
float64 and F.linear, with its prologues (RMSNorm with the residual add, SiLU-and-multiply)
against the unfused kernels' references, its input checks and its switches.

On CPU the kernel runs under TRITON_INTERPRET=1 (fp32 and fp16: the interpreter is wrong
for bf16); on the GPU (--gpu) bf16 too, at the engine's shapes.
"""

from __future__ import annotations

import pytest
import torch

from flashtile.engine import gemv as gemv_module
from flashtile.engine.activation import silu_and_mul_reference
from flashtile.engine.gemv import gemv, gemv_norm, gemv_norm_reference, gemv_reference, \
    gemv_silu, gemv_silu_reference, linear
from flashtile.engine.layernorm import add_rms_norm_reference, rms_norm_reference
from flashtile.ops import configs
from tests.conftest import triton_available_here
from tests.utils import assert_close_rule

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bf16")]
# (N, K): ragged feature blocks (37, 5), K below, at and past one tile (1024 / 2048) with
# a ragged last tile, and Qwen2.5-0.5B's q/k/v product.
SHAPES = [(37, 200), (5, 2100), (64, 1024), (100, 1030), (1152, 896)]


def gemv_steps(monkeypatch, fuse: bool, on_cpu: bool = False) -> list:
    """The engine's steps of one or two tokens through the GEMV (fuse: with its
    prologues; on_cpu: CPU tensors too, under the interpreter). Returns the list that
    records each launch's PROLOGUE."""
    if on_cpu:
        monkeypatch.setattr(gemv_module, "_on_device", lambda x: True)
    monkeypatch.setattr(gemv_module, "_max_tokens", 2)
    monkeypatch.setattr(gemv_module, "_fuse", fuse)
    prologues = []
    launch = gemv_module._gemv
    monkeypatch.setattr(gemv_module, "_gemv", lambda x, w, b, prologue, *a:
                        prologues.append(prologue) or launch(x, w, b, prologue, *a))
    return prologues


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda x: str(x))
def test_gemv_norm_matches_the_unfused_pair(n, k, m, residual, dtype, device, kernels_here):
    """gemv_norm = add_rms_norm (or rms_norm) then the product: the next residual equal
    to the unfused add's bits, the product within F.linear's rule against float64 of the
    unfused norm's output (its roundings are the prologue's), K in one tile of W and in
    several (the norm's own pass over the row first). x and the residual row-strided."""
    torch.manual_seed(n * k + m + residual)
    x = torch.randn(m, k + 8, dtype=dtype, device=device)[:, 8:]
    r = torch.randn(m, k + 16, dtype=dtype, device=device)[:, :k] if residual else None
    nw = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, dtype=dtype, device=device) if m == 2 else None
    ours, stream = gemv_norm(x, r, nw, 1e-5, w, b)
    same, want_stream = gemv_norm_reference(x, r, nw, 1e-5, w, b)
    if residual:
        normed = add_rms_norm_reference(x, r, nw, 1e-5)[0]
        assert torch.equal(stream, want_stream) and stream.is_contiguous()
    else:
        normed = rms_norm_reference(x, nw, 1e-5)
        assert stream is x
    ref64 = gemv_reference(normed.double(), w.double(), None if b is None else b.double())
    assert ours.shape == (m, n) and ours.dtype == dtype
    assert_close_rule("gemv_norm", ours, ref64, same)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda x: str(x))
def test_gemv_silu_matches_the_unfused_pair(n, k, m, dtype, device, kernels_here):
    """gemv_silu = silu_and_mul then the product, x = [gate | up] (a strided slice)."""
    torch.manual_seed(n * k + m)
    x = torch.randn(m, 2 * k + 4, dtype=dtype, device=device)[:, 4:]
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, dtype=dtype, device=device) if m == 1 else None
    act = silu_and_mul_reference(x)
    ref64 = gemv_reference(act.double(), w.double(), None if b is None else b.double())
    assert_close_rule("gemv_silu", gemv_silu(x, w, b), ref64, gemv_silu_reference(x, w, b))


def test_gemv_prologues_propagate_nan(device, kernels_here):
    """A NaN in x or in the residual reaches every output of gemv_norm (the row's RMS)
    and the next residual's entry; in gate or up, gemv_silu's every output."""
    x, r, nw = torch.randn(1, 300), torch.randn(1, 300), torch.ones(300)
    w = torch.randn(9, 300)
    r[0, 5] = float("nan")
    out, stream = gemv_norm(x.to(device), r.to(device), nw.to(device), 1e-6, w.to(device))
    assert out.isnan().all() and stream[0, 5].isnan() and stream.isnan().sum() == 1
    g = torch.randn(1, 600)
    g[0, 450] = float("nan")
    assert gemv_silu(g.to(device), w.to(device)).isnan().all()


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
    meta = torch.randn(8, 16, device="meta")  # another device, no GPU needed
    with pytest.raises(ValueError, match="weight: expected a tensor on x's device cpu"):
        gemv(x, meta)
    with pytest.raises(ValueError, match="bias: expected a tensor on x's device cpu"):
        gemv(x, w, torch.randn(8, device="meta"))


def test_prologues_reject_bad_input():
    """gemv_norm's residual and norm weight, gemv_silu's x: ValueErrors naming them."""
    x, w, nw = torch.randn(1, 16), torch.randn(8, 16), torch.ones(16)
    with pytest.raises(ValueError, match=r"residual: expected x's shape \(1, 16\)"):
        gemv_norm(x, torch.randn(2, 16), nw, 1e-6, w)
    with pytest.raises(ValueError, match="residual: expected"):
        gemv_norm(x, torch.randn(1, 16).half(), nw, 1e-6, w)
    with pytest.raises(ValueError, match=r"norm_weight: expected a contiguous \(16,\)"):
        gemv_norm(x, None, torch.ones(17), 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight: expected"):
        gemv_norm(x, None, nw.double(), 1e-6, w)
    with pytest.raises(ValueError, match="residual: expected a tensor on x's device"):
        gemv_norm(x, torch.randn(1, 16, device="meta"), nw, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight: expected a tensor on x's device"):
        gemv_norm(x, None, torch.ones(16, device="meta"), 1e-6, w)
    with pytest.raises(ValueError, match=r"x: expected \(M, 2 \* K\)"):
        gemv_silu(torch.randn(1, 33), w)
    with pytest.raises(ValueError, match=r"weight: expected a contiguous \(N, 8\)"):
        gemv_silu(x, w)


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


def test_fuse_switch(monkeypatch):
    """FLASHTILE_ENGINE_GEMV_FUSE (configs.engine_gemv_fuse): off unless "1"; ``fuses``
    says no without it, or where the norm's weight is in another dtype."""
    monkeypatch.delenv("FLASHTILE_ENGINE_GEMV_FUSE", raising=False)
    assert configs.engine_gemv_fuse() is False
    monkeypatch.setenv("FLASHTILE_ENGINE_GEMV_FUSE", "1")
    assert configs.engine_gemv_fuse() is True
    monkeypatch.setenv("FLASHTILE_ENGINE_GEMV_FUSE", "yes")
    with pytest.raises(ValueError, match=r"FLASHTILE_ENGINE_GEMV_FUSE must be one of "
                       r"\('0', '1'\), got 'yes'"):
        configs.engine_gemv_fuse()
    monkeypatch.setattr(gemv_module, "_on_device", lambda x: True)
    monkeypatch.setattr(gemv_module, "_max_tokens", 2)
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    for fuse in (False, True):
        monkeypatch.setattr(gemv_module, "_fuse", fuse)
        assert gemv_module.takes(x, w)
        assert gemv_module.fuses(x, w, None, torch.ones(16)) is fuse
    assert not gemv_module.fuses(x, w, None, torch.ones(16).double())
    assert not gemv_module.fuses(torch.randn(3, 16), w)


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


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llama", "qwen2-bias"])
def test_engine_with_fused_prologues_gives_transformers_tokens(case, tmp_path, monkeypatch):
    """The engine on the GPU (CUDA graphs at batch 1 and 2, fp32) with the norms and
    SiLU-and-multiply inside the GEMV (FLASHTILE_ENGINE_GEMV_FUSE; Qwen2's q/k/v bias):
    transformers' greedy tokens, one and two sequences a step."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    from flashtile.engine import LLM, SamplingParams
    from tests.engine_utils import VOCAB, hf_greedy, make_checkpoint

    model = make_checkpoint(tmp_path, case)
    prologues = gemv_steps(monkeypatch, fuse=True)
    llm = LLM(str(tmp_path), dtype="float32", device="cuda", max_model_len=64,
              max_num_seqs=2, kv_cache_memory=2**26)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 19, 33)]
    params = SamplingParams(temperature=0, max_tokens=12)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(model, p, 12) for p in prompts]
    assert {gemv_module.ADD_NORM, gemv_module.SILU} <= set(prologues)
