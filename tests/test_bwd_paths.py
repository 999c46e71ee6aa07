"""Which Triton backward runs, and what each promises (flashtile/ops/bwd.py).

deterministic (flash-attn's flag), FLASHTILE_BWD and torch.use_deterministic_algorithms
pick the split backward (bitwise reproducible) or the fused one (dq summed by atomics:
reproducible to rounding). The accuracy of both is tested against float64 by the
backward tests of test_attention.py, test_varlen.py, test_nan.py and
test_index_safety.py ("triton" and "triton-fused"); here: the choice, that the flag
reaches the backward through every entry point, and run-to-run behaviour.
"""

import pytest
import torch

import flashtile
from flashtile import custom_ops
from tests.utils import assert_close_rule, max_err, reference_pair


@pytest.mark.parametrize("env,deterministic,fused", [
    (None, False, False), (None, True, False), ("split", False, False),
    ("fused", False, True), ("fused", True, False), (" Fused ", False, True),
], ids=["default", "default-deterministic", "split", "fused", "fused-deterministic",
        "fused-spaced"])
def test_path_choice(env, deterministic, fused, monkeypatch):
    """deterministic=True always takes the split path; False takes FLASHTILE_BWD's
    (unset: custom_ops.DEFAULT_BWD, split until the fused one is timed on the GPU)."""
    if env is None:
        monkeypatch.delenv("FLASHTILE_BWD", raising=False)
    else:
        monkeypatch.setenv("FLASHTILE_BWD", env)
    assert custom_ops.DEFAULT_BWD == "split"
    assert custom_ops.fused_backward(deterministic) is fused


def test_torch_deterministic_algorithms_take_the_split_path(monkeypatch):
    monkeypatch.setenv("FLASHTILE_BWD", "fused")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert custom_ops.fused_backward(False) is False
    finally:
        torch.use_deterministic_algorithms(before)


def test_bad_path_name_raises(monkeypatch):
    monkeypatch.setenv("FLASHTILE_BWD", "atomic")
    with pytest.raises(ValueError, match=r"FLASHTILE_BWD must be one of \('split', "
                                         r"'fused'\).*'atomic'"):
        custom_ops.fused_backward(False)


# The Triton kernels (conftest.backend), on the GPU or through the interpreter.
TRITON = pytest.mark.parametrize("backend", ["triton"], indirect=True)


@pytest.fixture
def fused_calls(monkeypatch):
    """The ``fused`` argument of every Triton backward launch, in order."""
    calls, real = [], custom_ops.triton_bwd

    def spy(*args, **kwargs):
        calls.append(kwargs["fused"])
        return real(*args, **kwargs)

    monkeypatch.setattr(custom_ops, "triton_bwd", spy)
    return calls


def _dense_and_varlen(deterministic, device, wrap):
    """Gradients of a dense and a varlen call, each through ``wrap`` (eager or compiled)."""
    q, k, v = (torch.randn(1, 21, 2, 16, device=device, requires_grad=True)
               for _ in range(3))
    dense = wrap(lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True,
                                                           deterministic=deterministic))
    torch.autograd.grad(dense(q, k, v).sum(), (q, k, v))
    cu = torch.tensor([0, 8, 21], dtype=torch.int32, device=device)
    varlen = wrap(lambda q, k, v: flashtile.flash_attn_varlen_func(
        q, k, v, cu, cu, 13, 13, causal=True, deterministic=deterministic))
    qp, kp, vp = (x.detach()[0].requires_grad_() for x in (q, k, v))
    torch.autograd.grad(varlen(qp, kp, vp).sum(), (qp, kp, vp))


@TRITON
@pytest.mark.parametrize("entry", ["eager", "compiled"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_flag_reaches_the_backward(entry, deterministic, backend, fused_calls, device,
                                   monkeypatch):
    """Through the eager autograd.Function and through the custom ops' own autograd
    (torch.compile), dense and varlen: with FLASHTILE_BWD=fused, deterministic=False
    runs the fused backward and True the split one."""
    monkeypatch.setenv("FLASHTILE_BWD", "fused")
    if entry == "compiled":
        torch._dynamo.reset()
        wrap = lambda fn: torch.compile(fn, fullgraph=True)  # noqa: E731
    else:
        wrap = lambda fn: fn  # noqa: E731
    _dense_and_varlen(deterministic, device, wrap)
    assert fused_calls == [not deterministic] * 2


def _grads(q, k, v, dout, deterministic, **kw):
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = flashtile.flash_attn_func(qg, kg, vg, deterministic=deterministic, **kw)
    return torch.autograd.grad(out, (qg, kg, vg), dout)


@TRITON
def test_fp32_over_head_dim_128_takes_the_split_kernels(backend, device, monkeypatch):
    """The fused kernel has no fp32 tile beyond head_dim 128 (every one compiled there
    spilled, configs.py): such calls run the split kernels, within the accuracy rule."""
    from flashtile.ops import configs

    def no_fused_tile(*args, **kwargs):
        raise AssertionError("the fused backward was launched")

    monkeypatch.setattr(configs, "bwd_fused_config", no_fused_tile)
    monkeypatch.setenv("FLASHTILE_BWD", "fused")
    q = torch.randn(1, 23, 2, 136, device=device)
    k, v = (torch.randn(1, 29, 1, 136, device=device) for _ in range(2))
    dout = torch.randn_like(q)
    grads = _grads(q, k, v, dout, False, causal=True)
    (_, _, g64), (_, _, g_pt) = reference_pair(q, k, v, dout, causal=True)
    for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close_rule(name, ours, r64, rpt)
    assert configs.fused_bwd_has_tiles(2, 512) and configs.fused_bwd_has_tiles(4, 128)
    assert not configs.fused_bwd_has_tiles(4, 136)


@TRITON
def test_fused_run_to_run(backend, fused_calls, device, on_gpu, monkeypatch):
    """Two fused backwards on the same inputs: dk and dv bitwise equal (each has one
    owner program, as in the split path), dq within one rounding step of its dtype
    (only the order of the fp32 atomic adds differs), both within the accuracy rule."""
    monkeypatch.setenv("FLASHTILE_BWD", "fused")
    # 2k tokens on sm_90 would go to the Gluon backward (FLASHTILE_HOPPER_BWD=auto).
    monkeypatch.setenv("FLASHTILE_HOPPER_BWD", "0")
    shape, dtype = ((2, 2048, 16, 4, 128), torch.bfloat16) if on_gpu else \
        ((2, 67, 4, 2, 32), torch.float16)
    b, s, h, hkv, d = shape
    q = torch.randn(b, s, h, d, device=device, dtype=dtype)
    k, v = (torch.randn(b, s, hkv, d, device=device, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    first, second = (_grads(q, k, v, dout, False, causal=True) for _ in range(2))
    assert fused_calls == [True, True]
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    eps = torch.finfo(dtype).eps
    assert max_err(first[0], second[0]) <= eps * first[0].abs().max().item()
    (_, _, g64), (_, _, g_pt) = reference_pair(q, k, v, dout, causal=True)
    for grads in (first, second):
        for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
            assert_close_rule(name, ours, r64, rpt)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fused_bf16_on_gpu(head_dim, causal, monkeypatch):
    """bf16 on the H200 at the table's tiles (GQA, a length that is no tile multiple):
    the fused backward within the accuracy rule, and equal to the split one within
    the same rule (the interpreter cannot run bf16)."""
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    monkeypatch.setenv("FLASHTILE_BWD", "fused")
    q = torch.randn(2, 1061, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1061, 2, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn_like(q)
    fused = _grads(q, k, v, dout, False, causal=causal)
    split = _grads(q, k, v, dout, True, causal=causal)
    (_, _, g64), (_, _, g_pt) = reference_pair(q, k, v, dout, causal=causal)
    for grads in (fused, split):
        for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
            assert_close_rule(f"d{head_dim} {name}", ours, r64, rpt)


@pytest.mark.gpu
def test_fused_varlen_plan_reuse_on_gpu(monkeypatch):
    """The second varlen call (same batch and seqlen class, another max_seqlen and
    other lengths) replays the cached launch plans with its own grid: each call's
    gradients match its sequences computed alone in float64 (accuracy rule)."""
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    monkeypatch.setenv("FLASHTILE_BWD", "fused")
    dtype, h, hkv, d = torch.float16, 4, 2, 64
    for lens in ([300, 0, 701], [500, 480, 21]):
        total = sum(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                          device="cuda")
        q = torch.randn(total, h, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(total, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
        dout = torch.randn_like(q)
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = flashtile.flash_attn_varlen_func(qg, kg, vg, cu, cu, max(lens), max(lens),
                                               causal=True)
        grads = torch.autograd.grad(out, (qg, kg, vg), dout)
        for start, n in zip(cu[:-1].tolist(), lens):
            if not n:
                continue
            rows = slice(start, start + n)
            (_, _, g64), (_, _, g_pt) = reference_pair(
                *(x[None, rows] for x in (q, k, v, dout)), causal=True)
            for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
                assert_close_rule(f"{lens} {name}", ours[None, rows], r64, rpt)


@pytest.mark.parametrize("backend", ["triton", "triton-fused"], indirect=True)
def test_eager_gradients_share_one_allocation_and_the_ops_do_not(backend, device):
    """The eager backward allocates dq, dk, dv and its fp32 scratch (delta, the fused dQ
    accumulator) as one (an allocation is ~7-11 us of host time on the H200); the
    custom op's gradients, which torch.library forbids to alias each other, have one
    each (the scratch in dq's). Both within the accuracy rule; a second backward adds
    into the first's gradients, now the leaves' .grad and views of one storage, without
    touching their neighbours."""
    q = torch.randn(2, 37, 4, 40, device=device)
    k, v = (torch.randn(2, 29, 2, 40, device=device) for _ in range(2))
    dout = torch.randn_like(q)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = flashtile.flash_attn_func(qg, kg, vg, causal=True, return_lse=True)
    out.backward(dout, retain_graph=True)
    eager = (qg.grad, kg.grad, vg.grad)
    assert len({g.untyped_storage().data_ptr() for g in eager}) == 1
    assert all(g.is_contiguous() for g in eager)
    first = [g.clone() for g in eager]
    out.backward(dout)
    for name, total, once in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), first):
        assert torch.equal(total, 2 * once), name
    inner = [x * 1 for x in (qg, kg, vg)]  # none a leaf: the gradients flow on
    grads = torch.autograd.grad(flashtile.flash_attn_func(*inner, causal=True), inner, dout)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1
    op = custom_ops.attn_bwd(dout, q, k, v, out.detach(), lse.detach(), None, None, None,
                             40 ** -0.5, 29 - 37, -1, 0, 0.0, False)
    assert len({g.untyped_storage().data_ptr() for g in op}) == 3
    (_, _, g64), (_, _, g_pt) = reference_pair(q, k, v, dout, causal=True)
    for grads in (first, op):
        for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
            assert_close_rule(name, ours, r64, rpt)


@TRITON
@pytest.mark.parametrize("case", ["only_q", "q_leaf_kv_computed"])
def test_eager_gradients_apart_where_one_would_keep_the_others(case, backend, device):
    """Where one gradient may outlive the others, each has its own allocation: k and v
    need none (autograd drops dk and dv at once), or q is a leaf and k, v are not (its
    .grad is kept, theirs flow on). Shared, q.grad would keep dk and dv's memory."""
    q = torch.randn(1, 21, 2, 16, device=device, requires_grad=True)
    if case == "only_q":
        k, v = (torch.randn(1, 21, 2, 16, device=device) for _ in range(2))
    else:
        kv = torch.randn(1, 21, 2, 16, device=device, requires_grad=True)
        k, v = kv * 1, kv * 2
    flashtile.flash_attn_func(q, k, v, causal=True).sum().backward()
    dq_bytes = q.numel() * q.element_size()
    # dq's allocation also holds delta's words (2 x 21 fp32), nothing of dk or dv.
    assert q.grad.untyped_storage().nbytes() == dq_bytes + 2 * 21 * 4


@TRITON
@pytest.mark.parametrize("shares", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_dq_convert_sums_head_split_shares(shares, head_dim, backend, device, on_gpu):
    """bwd_hopper's GQA head split leaves dK and dV in shares (batch, seqlen_k, nheads_kv
    x shares, head_dim); the dQ conversion's launch sums them (fp32, one rounding) in the
    grid rows past its dq programs, and still converts every row of dq. Odd sizes: rows
    off the 32-row block, a head_dim narrower than its tile (40 in 64)."""
    from flashtile.ops import bwd, configs

    dtype = torch.bfloat16 if on_gpu else torch.float16
    b, sq, h, hkv, sk = 2, 45, 6, 3, 37
    tile = configs.next_power_of_2(head_dim)
    dq_accum = torch.randn(b, h, sq, tile, device=device)
    dq = torch.full((b, sq, h, head_dim), float("nan"), dtype=dtype, device=device)
    dk_shares, dv_shares = (torch.randn(b, sk, hkv * shares, head_dim, dtype=dtype,
                                        device=device) for _ in range(2))
    dk, dv = (torch.full((b, sk, hkv, head_dim), float("nan"), dtype=dtype, device=device)
              for _ in range(2))
    kv_rows = b * sk * hkv if shares > 1 else 0
    bwd._bwd_dq_convert_kernel[bwd.convert_grid(b, h, sq, kv_rows)](
        dq_accum, dq, dk_shares, dv_shares, dk, dv, *dq_accum.stride()[:2],
        *configs.strides(False, dq), b, h, sq, head_dim, kv_rows, 0.3,
        BLOCK_M=configs.PREPROCESS_BLOCK_M, BLOCK_D=tile, SHARES=shares)
    want_dq = (dq_accum[..., :head_dim] * 0.3).transpose(1, 2).to(dtype)
    assert torch.equal(dq, want_dq)
    if shares == 1:  # nothing to sum: dk and dv untouched
        assert dk.isnan().all() and dv.isnan().all()
        return
    for name, got, x in (("dk", dk, dk_shares), ("dv", dv, dv_shares)):
        want = x.double().view(b, sk, hkv, shares, head_dim).sum(3)
        # fp32 sums of `shares` 16-bit values, rounded once: within half an ulp of the
        # float64 sum's rounding, so at most one ulp from it.
        torch.testing.assert_close(got.double(), want.to(dtype).double(),
                                   rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10,
                                   atol=1e-6, msg=name)
