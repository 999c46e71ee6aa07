"""bfloat16 is refused where the Triton kernels would run in the interpreter (issue 13).

The interpreter emulates bfloat16 with numpy and returns garbage (errors near 1e9, only
a numpy overflow warning), so every entry point that launches kernels raises a TypeError
naming the argument instead. The checks run before any launch, so setting
TRITON_INTERPRET=1 for the call is enough to exercise them in any CPU run.
"""

import pytest
import torch

import flashtile
from flashtile._backend import select_backend

MESSAGE = (r"q\.dtype: expected float32 or float16 while the Triton kernels run in the "
           r"Triton interpreter \(TRITON_INTERPRET=1\), got torch\.bfloat16\. "
           r".*FLASHTILE_BACKEND=torch")


@pytest.fixture
def interpreter(monkeypatch, on_gpu):
    if on_gpu:
        pytest.skip("CPU tensors only")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")


def _qkv(*shape):
    return (torch.randn(*shape, dtype=torch.bfloat16) for _ in range(3))


def test_flash_attn_func(interpreter):
    q, k, v = _qkv(1, 8, 2, 16)
    with pytest.raises(TypeError, match=MESSAGE):
        flashtile.flash_attn_func(q, k, v, causal=True)


def test_sdpa_drop_in(interpreter):
    q, k, v = _qkv(1, 2, 8, 16)
    with pytest.raises(TypeError, match=MESSAGE):
        flashtile.scaled_dot_product_attention(q, k, v)


def test_varlen(interpreter):
    q, k, v = _qkv(12, 2, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(TypeError, match=MESSAGE):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)


def test_kvcache_refused_before_the_append(interpreter):
    k_cache, v_cache = (torch.zeros(2, 32, 1, 16, dtype=torch.bfloat16) for _ in range(2))
    q, k, v = _qkv(2, 1, 1, 16)
    with pytest.raises(TypeError, match=MESSAGE):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)
    assert not k_cache.any() and not v_cache.any()


def test_merge(interpreter):
    out = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    lse = torch.randn(1, 2, 4)
    with pytest.raises(TypeError, match=MESSAGE.replace("q", "out_a", 1)):
        flashtile.merge_attention_states(out, lse, out, lse)


def test_torch_backend_still_runs_bf16(monkeypatch, on_gpu):
    if on_gpu:
        pytest.skip("CPU tensors only")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    q, k, v = _qkv(1, 8, 2, 16)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_interpreter_takes_fp32_and_fp16(dtype, interpreter):
    assert select_backend(torch.device("cpu"), dtype) == "triton"
