"""Forward and backward of every feature against a float64 oracle.

On CPU (CI) both backends run: the tiled PyTorch path, and the Triton kernels through
the interpreter (TRITON_INTERPRET=1), in fp32 and fp16. With --gpu the Triton kernels
run on CUDA in fp16, bf16 and fp32 on larger shapes. The backward tests run the Triton
kernels twice: "triton", the split backward, and "triton-fused", the fused one
(FLASHTILE_BWD=fused with deterministic=False, flashtile/ops/bwd.py).
"""

import math
import os
from dataclasses import dataclass, field

import pytest
import torch

import flashtile
from flashtile.ops import configs
from flashtile.reference import attention_naive, attention_tiled_fwd
from tests.utils import assert_close_rule, max_err, reference_pair


@dataclass
class Case:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: str = ""  # "", "h" (nheads,), "bh" (batch, nheads)
    kw: dict = field(default_factory=dict)

    @property
    def id(self):
        s = f"b{self.batch}-q{self.seqlen_q}-k{self.seqlen_k}-h{self.nheads}/{self.nheads_kv}-d{self.head_dim}"
        if self.causal:
            s += "-causal"
        if self.window != (-1, -1):
            s += f"-win{self.window[0]}_{self.window[1]}"
        if self.softcap:
            s += f"-cap{self.softcap:g}"
        if self.alibi:
            s += f"-alibi_{self.alibi}"
        return s


CPU_CASES = [
    Case(1, 1, 1, 2, 2, 16),
    Case(2, 1, 37, 4, 2, 32, causal=True),            # decode-like, bottom-right
    Case(1, 37, 1, 2, 1, 24, causal=True),            # rows that see no key
    Case(1, 17, 17, 2, 2, 8),
    Case(2, 31, 53, 4, 1, 40),                        # MQA, odd head dim
    Case(1, 53, 31, 2, 2, 64, causal=True),
    Case(1, 64, 64, 2, 2, 64, causal=True),
    Case(1, 97, 113, 4, 2, 80, causal=True),          # GQA, non-power-of-two head dim
    Case(1, 61, 67, 2, 2, 96, window=(8, 0)),
    Case(1, 67, 61, 2, 1, 32, window=(3, 5)),
    Case(1, 45, 70, 2, 2, 16, window=(-1, 4)),
    Case(1, 70, 45, 2, 2, 16, window=(10, -1)),
    Case(1, 50, 50, 2, 2, 32, causal=True, window=(0, 0)),  # each row sees one key
    Case(2, 43, 59, 4, 2, 48, softcap=2.5),
    Case(2, 43, 59, 4, 2, 48, alibi="h"),
    Case(2, 59, 43, 2, 2, 32, causal=True, alibi="bh", softcap=5.0),
    Case(1, 33, 47, 2, 1, 160, causal=True),
    Case(1, 29, 23, 2, 2, 256),
]

GPU_CASES = CPU_CASES + [
    Case(2, 1024, 1024, 8, 8, 64),
    Case(2, 1024, 1024, 8, 8, 128, causal=True),
    Case(1, 2048, 2048, 4, 4, 256, causal=True),
    Case(1, 1000, 3000, 8, 2, 128, causal=True),
    Case(1, 3000, 1000, 8, 2, 112, causal=True),
    Case(2, 777, 1531, 6, 3, 192, window=(256, 0)),
    Case(1, 4096, 4096, 4, 1, 128, window=(512, 64), softcap=30.0),
    Case(1, 8192, 8192, 2, 2, 64, causal=True),
    Case(1, 8192, 8192, 2, 1, 128),
    Case(1, 1023, 1023, 4, 4, 96, alibi="bh", causal=True),
]


def _dtypes(on_gpu):
    if on_gpu:
        return [torch.float16, torch.bfloat16, torch.float32]
    return [torch.float32, torch.float16]  # the interpreter is wrong for bf16


# Tests whose backward also runs the fused Triton path ("triton-fused").
BACKWARD_TESTS = ("test_fwd_bwd", "test_grad_through_one_output")


def pytest_generate_tests(metafunc):
    on_gpu = metafunc.config.getoption("--gpu")
    if "case" in metafunc.fixturenames:
        cases = GPU_CASES if on_gpu else CPU_CASES
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])
    if "dtype" in metafunc.fixturenames:
        dts = _dtypes(on_gpu)
        metafunc.parametrize("dtype", dts, ids=[str(d).split(".")[-1] for d in dts])
    if "backend" in metafunc.fixturenames:
        bes = ["triton"] if on_gpu else ["torch", "triton"]
        if metafunc.function.__name__ in BACKWARD_TESTS:
            bes.append("triton-fused")
        metafunc.parametrize("backend", bes)


@pytest.fixture
def use_backend(backend, monkeypatch, on_gpu):
    if backend != "torch" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (set by make test)")
    monkeypatch.setenv("FLASHTILE_BACKEND", backend.split("-")[0])
    monkeypatch.setenv("FLASHTILE_BWD", "fused" if backend == "triton-fused" else "split")
    return backend


def _inputs(case, dtype, device):
    b, sq, sk, h, hkv, d = (case.batch, case.seqlen_q, case.seqlen_k, case.nheads,
                            case.nheads_kv, case.head_dim)
    q = torch.randn(b, sq, h, d, device=device, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device=device, dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device=device, dtype=dtype)
    alibi = None
    if case.alibi == "h":
        alibi = torch.rand(h, device=device) * 0.3
    elif case.alibi == "bh":
        alibi = torch.rand(b, h, device=device) * 0.3
    return q, k, v, alibi


def _poison(monkeypatch):
    """Fill every output flashtile allocates with NaN, so an unwritten element fails."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def test_fwd_bwd(case, dtype, use_backend, device, monkeypatch):
    if dtype == torch.float32 and device.type == "cuda" and case.seqlen_k > 2048:
        pytest.skip("fp32 on long sequences is covered by the shorter cases")
    q, k, v, alibi = _inputs(case, dtype, device)
    kw = dict(causal=case.causal, window_size=case.window, softcap=case.softcap,
              alibi_slopes=alibi)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    _poison(monkeypatch)
    out, lse = flashtile.flash_attn_func(qg, kg, vg, return_lse=True, **kw)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    finite = torch.isfinite(lse)
    loss = (out * dout).sum() + (torch.where(finite, lse, 0) * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (qg, kg, vg))
    monkeypatch.undo()

    (o64, l64, g64), (o_pt, l_pt, g_pt) = reference_pair(q, k, v, dout, dlse, **kw)
    assert_close_rule("out", out, o64, o_pt)
    assert torch.equal(finite, torch.isfinite(l64)), "lse -inf pattern differs"
    assert (lse[~finite] == float("-inf")).all()
    # lse only depends on fp32 scores of exactly-representable inputs: tight at any dtype.
    torch.testing.assert_close(lse[finite].double(), l64[finite], rtol=1e-4, atol=1e-4)
    for name, ours, r64, rpt in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, g_pt):
        assert_close_rule(name, ours, r64, rpt)


@pytest.mark.parametrize("through", ["out", "lse"])
def test_grad_through_one_output(through, use_backend, device):
    """Only out or only lse reaches the loss: the other output's gradient arrives as
    None (not materialized as zeros) and the backward must treat it as zero."""
    case = Case(2, 37, 53, 4, 2, 32, causal=True, window=(17, 0))
    q, k, v, _ = _inputs(case, torch.float16, device)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = flashtile.flash_attn_func(qg, kg, vg, return_lse=True, causal=True,
                                         window_size=(17, 0))
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    if through == "out":
        loss, dlse = (out * dout).sum(), None
    else:
        loss, dout = (lse * dlse).sum(), torch.zeros_like(out)
    grads = torch.autograd.grad(loss, (qg, kg, vg))
    (_, _, g64), (_, _, g_pt) = reference_pair(q, k, v, dout, dlse, causal=True,
                                               window_size=(17, 0))
    for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close_rule(name, ours, r64, rpt)


def test_deterministic_backward(use_backend, device, monkeypatch):
    """deterministic=True is bitwise reproducible even where FLASHTILE_BWD asks for the
    fused backward (whose dq sums by atomics): the flag takes the split one."""
    monkeypatch.setenv("FLASHTILE_BWD", "fused")
    case = Case(2, 67, 89, 4, 2, 32, causal=True) if device.type == "cpu" else \
        Case(2, 2048, 2048, 16, 4, 128, causal=True)
    dtype = torch.float16
    q, k, v, _ = _inputs(case, dtype, device)
    dout = torch.randn_like(q)
    grads = []
    for _ in range(2):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = flashtile.flash_attn_func(qg, kg, vg, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, (qg, kg, vg), dout))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_strided_layouts(use_backend, device):
    """BSHD, BHSD views and slices of packed QKV give the same result, no copies."""
    dtype = torch.float32
    b, s, h, d = 2, 45, 4, 32
    qkv = torch.randn(b, s, 3, h, d, device=device, dtype=dtype)
    out_packed = flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (qkv[:, :, i].contiguous() for i in range(3))
    out_contig = flashtile.flash_attn_func(q, k, v, causal=True)
    bhsd = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    out_bhsd = flashtile.flash_attn_func(*bhsd, causal=True)
    kv = torch.stack([k, v], dim=2)
    out_kv = flashtile.flash_attn_kvpacked_func(q, kv, causal=True)
    torch.testing.assert_close(out_packed, out_contig, rtol=0, atol=0)
    torch.testing.assert_close(out_bhsd, out_contig, rtol=0, atol=0)
    torch.testing.assert_close(out_kv, out_contig, rtol=0, atol=0)


def test_no_overflow_large_scores(use_backend, device):
    """Scores of magnitude ~1e4 in fp16 inputs: fp32 scores and the running max keep it exact."""
    q = torch.randn(1, 40, 2, 32, device=device).mul(18).half()
    k = torch.randn(1, 40, 2, 32, device=device).mul(18).half()
    v = torch.randn(1, 40, 2, 32, device=device).half()
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / math.sqrt(32)
    assert scores.abs().max() > 1e3
    out = flashtile.flash_attn_func(q, k, v)
    ref, _ = attention_naive(q, k, v)
    assert torch.isfinite(out).all()
    assert max_err(out, ref) < 5e-3


@pytest.mark.parametrize("bwd", ["split", "fused"])
@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (16, 64), (64, 32)],
                         ids=lambda t: f"m{t[0]}n{t[1]}")
def test_tilings(tiles, bwd, device, monkeypatch):
    """The mask-range split must be right for any BLOCK_M/BLOCK_N, not just the default."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    monkeypatch.setenv("FLASHTILE_BWD", bwd)
    bm, bn = tiles
    kinds = (("fwd", (bm, bn)), ("bwd_dq", (bm, bn)), ("bwd_dkdv", (bn, bm)),
             ("bwd_fused", (bn, bm)))
    for kind, cfg in kinds:
        configs.set_override(kind, configs.TileConfig(*cfg))
    try:
        for case in (Case(1, 71, 83, 2, 1, 16, causal=True, window=(9, 0)),
                     Case(1, 83, 71, 2, 2, 16, window=(20, 7)),
                     Case(1, 50, 50, 2, 2, 16, causal=True)):
            q, k, v, _ = _inputs(case, torch.float32, device)
            kw = dict(causal=case.causal, window_size=case.window)
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            out = flashtile.flash_attn_func(qg, kg, vg, **kw)
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (qg, kg, vg), dout)
            (o64, _, g64), (o_pt, _, g_pt) = reference_pair(q, k, v, dout, **kw)
            assert_close_rule(f"{case.id} out", out, o64, o_pt)
            for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
                assert_close_rule(f"{case.id} {name}", ours, r64, rpt)
    finally:
        for kind, _ in kinds:
            configs.set_override(kind, None)


def test_tiled_reference_equals_naive(device):
    """The CPU backend's online softmax equals the three-pass oracle in float64."""
    q = torch.randn(2, 70, 4, 24, dtype=torch.float64, device=device)
    k = torch.randn(2, 90, 2, 24, dtype=torch.float64, device=device)
    v = torch.randn(2, 90, 2, 24, dtype=torch.float64, device=device)
    alibi = torch.rand(4, dtype=torch.float64, device=device)
    for window, causal in (((-1, -1), False), ((5, 7), False), ((-1, -1), True)):
        ref, ref_lse = attention_naive(q, k, v, causal=causal, window_size=window,
                                       softcap=4.0, alibi_slopes=alibi)
        out, lse = attention_tiled_fwd(q, k, v, softmax_scale=24 ** -0.5,
                                       diag_offset=20, window_left=window[0],
                                       window_right=0 if causal else window[1],
                                       softcap=4.0, alibi_slopes=alibi, attn_mask=None,
                                       block_n=16)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
