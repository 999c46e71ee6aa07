"""The flashtile:: custom ops: opcheck, and torch.compile(fullgraph=True) with no break."""

import pytest
import torch

import flashtile
from flashtile import custom_ops


@pytest.fixture
def torch_backend(monkeypatch, on_gpu):
    if not on_gpu:
        monkeypatch.setenv("FLASHTILE_BACKEND", "torch")


def test_opcheck(torch_backend, device):
    q = torch.randn(2, 19, 4, 16, device=device, requires_grad=True)
    k = torch.randn(2, 23, 2, 16, device=device, requires_grad=True)
    v = torch.randn(2, 23, 2, 16, device=device, requires_grad=True)
    args = (q, k, v, None, None, 0.25, 4, -1, 0, 0.0, False)
    torch.library.opcheck(custom_ops.attn_fwd, args)
    torch.library.opcheck(custom_ops.attn_fwd, args + (True,))  # deterministic
    philox = torch.tensor([12345, 678], device=device)  # dropout's [seed, offset]
    torch.library.opcheck(custom_ops.attn_fwd, args + (False, 0.3, philox))


class TinyBlock(torch.nn.Module):
    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x, use_sdpa=False):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        if use_sdpa:
            o = flashtile.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True).transpose(1, 2)
        else:
            o = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(8, 0))
        return self.o(o.reshape(b, s, -1))


@pytest.mark.parametrize("use_sdpa", [False, True], ids=["flash_attn_func", "sdpa"])
def test_compile_fullgraph(use_sdpa, torch_backend, device):
    torch._dynamo.reset()
    model = TinyBlock().to(device)
    x = torch.randn(2, 33, 64, device=device)
    eager = model(x, use_sdpa)
    eager_grads = torch.autograd.grad(eager.sum(), list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x, use_sdpa)
    grads = torch.autograd.grad(out.sum(), list(model.parameters()))
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compile_fullgraph_with_dropout(torch_backend, device):
    """A dropout call traces into one graph (the seed drawn by torch.randint in it); with
    a fixed seed tensor the compiled op equals the eager one, gradients included."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 21, 2, 16, device=device, requires_grad=True)
               for _ in range(3))
    philox = torch.tensor([12345, 678], device=device)

    def fixed(q, k, v):
        return custom_ops.attention(q, k, v, None, None, 0.25, 0, -1, 0, 0.0, False,
                                    False, 0.3, philox)[0]

    compiled = torch.compile(fixed, fullgraph=True)(q, k, v)
    eager = fixed(q, k, v)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(torch.autograd.grad(compiled.sum(), (q, k, v)),
                    torch.autograd.grad(eager.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)
    out = torch.compile(lambda q, k, v: flashtile.flash_attn_func(q, k, v, 0.3),
                        fullgraph=True)(q, k, v)
    assert torch.isfinite(out).all() and out.shape == q.shape


def test_opcheck_varlen(torch_backend, device):
    q = torch.randn(12, 4, 16, device=device, requires_grad=True)
    k = torch.randn(15, 2, 16, device=device, requires_grad=True)
    v = torch.randn(15, 2, 16, device=device, requires_grad=True)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 15], dtype=torch.int32, device=device)
    args = (q, k, v, cu_q, cu_k, 7, 9, None, 0.25, -1, 0, 0.0, False)
    torch.library.opcheck(custom_ops.varlen_attn_fwd, args)
    torch.library.opcheck(custom_ops.varlen_attn_fwd, args + (None, None, True))
    philox = torch.tensor([12345, 678], device=device)
    torch.library.opcheck(custom_ops.varlen_attn_fwd,
                          args + (None, None, False, 0.3, philox))


def _grads_of(fn, inputs, seed=0):
    out, lse = fn()
    gen = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=gen).to(out.device)
    w_lse = torch.randn(lse.shape, generator=gen).to(lse.device)
    loss = (out * w_out).sum() + (lse * w_lse).sum()  # lse's gradient too
    return (out, lse, *torch.autograd.grad(loss, inputs))


def test_eager_path_equals_the_custom_op(torch_backend, device):
    """Eager calls skip the dispatcher (an autograd.Function over the op's own functions):
    same outputs and gradients as the op with its registered autograd, bit for bit."""
    q = torch.randn(2, 19, 4, 16, device=device, requires_grad=True)
    k = torch.randn(2, 23, 2, 16, device=device, requires_grad=True)
    v = torch.randn(2, 23, 2, 16, device=device, requires_grad=True)
    scalars = (0.25, 4, -1, 0, 0.0, False)
    eager = _grads_of(lambda: custom_ops.attention(q, k, v, None, None, *scalars), (q, k, v))
    op = _grads_of(lambda: custom_ops.attn_fwd(q, k, v, None, None, *scalars), (q, k, v))
    for a, b in zip(eager, op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    qp, kp, vp = (x.detach()[0].clone().requires_grad_() for x in (q, k, v))
    cu_q = torch.tensor([0, 5, 19], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 23], dtype=torch.int32, device=device)
    args = (qp, kp, vp, cu_q, cu_k, 14, 14, None, 0.25, -1, 0, 0.0, False)
    eager = _grads_of(lambda: custom_ops.varlen_attention(*args), (qp, kp, vp))
    op = _grads_of(lambda: custom_ops.varlen_attn_fwd(*args), (qp, kp, vp))
    for a, b in zip(eager, op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiled_graph_holds_the_custom_op(torch_backend, device):
    """Under torch.compile the call is the opaque flashtile:: op, not a trace of its
    implementation (which the eager path runs)."""
    seen = []

    def recording_backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    q = torch.randn(1, 9, 2, 16, device=device)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    torch.compile(lambda q: flashtile.flash_attn_func(q, q, q, causal=True),
                  backend=recording_backend, fullgraph=True)(q)
    torch.compile(lambda q: flashtile.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 5, 5),
                  backend=recording_backend, fullgraph=True)(q)
    assert "flashtile.attn_fwd.default" in seen, seen
    assert "flashtile.varlen_attn_fwd.default" in seen, seen


def test_transforms_tracing_and_meta_go_through_the_op(backend, device):
    """What the eager autograd.Function cannot serve goes to the op: vmap (equal to a
    loop), meta tensors and FakeTensorMode (the op's fake implementation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn(3, 1, 9, 2, 16, device=device)
    attn = lambda x: flashtile.flash_attn_func(x, x, x, causal=True)  # noqa: E731
    torch.testing.assert_close(torch.vmap(attn)(q), torch.stack([attn(x) for x in q]))
    meta = torch.empty(1, 9, 2, 16, device="meta")
    assert attn(meta).shape == (1, 9, 2, 16) and attn(meta).device.type == "meta"
    with FakeTensorMode():
        fake = torch.empty(1, 9, 2, 16)
        assert attn(fake).shape == (1, 9, 2, 16)


def test_double_backward_fails_loudly(backend, device):
    """The kernels' gradients carry no graph: a second-order gradient must raise, not
    silently drop the attention's term."""
    q = torch.randn(1, 9, 2, 16, device=device, requires_grad=True)
    out = flashtile.flash_attn_func(q, q, q)
    (g,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(g.sum(), q)


def test_opcheck_kvcache(backend, device, on_gpu):
    from flashtile import inference
    q = torch.randn(2, 3, 4, 16, device=device)
    k_cache, v_cache = (torch.randn(2, 40, 2, 16, device=device) for _ in "kv")
    seqlens = torch.tensor([5, 37], dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, seqlens, 3, None, None, None, None, 0.25, -1, 0, 0.0, 0,
            True)
    torch.library.opcheck(inference.kvcache_attn, args)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_compile_fullgraph_kvcache_step(paged, backend, device, on_gpu):
    """A decode step (rotary, append in place, attention over the cache) compiles with
    no graph break, holds the flashtile::kvcache_attn op, and equals the eager step:
    outputs and both caches (the appended slots included)."""
    seen = []

    def recording_inductor(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    b, s, h, hkv, d, page = 2, 64, 4, 2, 16, 16
    q = torch.randn(b, 1, h, d, generator=gen).to(device)
    k_new, v_new = (torch.randn(b, 1, hkv, d, generator=gen).to(device) for _ in "kv")
    cos, sin = (torch.randn(s, 4, generator=gen).to(device) for _ in "cs")
    seqlens = torch.tensor([9, 50], dtype=torch.int32, device=device)
    if paged:
        k_cache, v_cache = (torch.randn(b * s // page + 1, page, hkv, d, generator=gen)
                            .to(device) for _ in "kv")
        perm = torch.randperm(b * s // page + 1, generator=gen)[: b * s // page]
        block_table = perm.view(b, -1).to(torch.int32).to(device)
    else:
        k_cache, v_cache = (torch.randn(b, s, hkv, d, generator=gen).to(device)
                            for _ in "kv")
        block_table = None

    def step(q, k_cache, v_cache, k_new, v_new, seqlens):
        return flashtile.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=seqlens, block_table=block_table, causal=True, return_lse=True)

    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    out, lse = step(q, k_eager, v_eager, k_new, v_new, seqlens)
    compiled = torch.compile(step, backend=recording_inductor, fullgraph=True)
    out_c, lse_c = compiled(q, k_cache, v_cache, k_new, v_new, seqlens)
    assert "flashtile.kvcache_attn.default" in seen, seen
    # The compiled rotary may round differently (fused multiply-adds: 1 ulp on the H200).
    torch.testing.assert_close(k_cache, k_eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_cache, v_eager, rtol=0, atol=0)
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_c, lse, rtol=1e-5, atol=1e-5)


def test_compiled_kvcache_checks_indices_at_run_time(backend, device, on_gpu,
                                                    index_checks):
    """Compiled code cannot read the indices while tracing: with index checks on, the op
    checks them when it runs, so a cache_seqlens past the cache is still a ValueError
    naming it."""
    torch._dynamo.reset()
    q = torch.randn(1, 1, 2, 16, device=device)
    k_cache, v_cache = (torch.randn(1, 32, 2, 16, device=device) for _ in "kv")
    step = torch.compile(
        lambda q, s: flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=s),
        fullgraph=True)
    step(q, torch.tensor([32], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="cache_seqlens"):
        step(q, torch.tensor([33], dtype=torch.int32, device=device))


def _paged_varlen_inputs(device, gen):
    """Two sequences (3 new queries over 37 keys, 9 over 9) in a shuffled pool of 16-key
    pages."""
    q = torch.randn(12, 4, 16, generator=gen).to(device)
    k_pool, v_pool = (torch.randn(7, 16, 2, 16, generator=gen).to(device) for _ in "kv")
    block_table = torch.randperm(7, generator=gen)[:6].view(2, 3).to(torch.int32).to(device)
    cu_q = torch.tensor([0, 3, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 37, 46], dtype=torch.int32, device=device)
    return q, k_pool, v_pool, cu_q, cu_k, block_table


@pytest.mark.parametrize("lengths", ["cu_seqlens_k", "seqused_k"])
def test_opcheck_varlen_paged(lengths, torch_backend, device):
    q, k_pool, v_pool, cu_q, cu_k, block_table = _paged_varlen_inputs(
        device, torch.Generator().manual_seed(5))
    seqused = torch.tensor([37, 9], dtype=torch.int32, device=device)
    if lengths == "seqused_k":
        cu_k, seqused_k = None, seqused
    else:
        seqused_k = None
    torch.library.opcheck(custom_ops.varlen_attn_fwd,
                          (q, k_pool, v_pool, cu_q, cu_k, 9, 37, None, 0.25, -1, 0, 0.0,
                           False, block_table, seqused_k))


def test_compile_fullgraph_paged_varlen(backend, device, index_checks):
    """A mixed prefill step over the paged pool compiles with no graph break, holds the
    flashtile::varlen_attn_fwd op, equals eager; with index checks on, the block table's
    values are checked when the compiled op runs (a block past the pool is a ValueError
    naming it)."""
    seen = []

    def recording_inductor(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    q, k_pool, v_pool, cu_q, cu_k, block_table = _paged_varlen_inputs(
        device, torch.Generator().manual_seed(6))

    def step(q, k_pool, v_pool, block_table):
        return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 9, 37,
                                                causal=True, block_table=block_table,
                                                return_lse=True)

    out, lse = step(q, k_pool, v_pool, block_table)
    compiled = torch.compile(step, backend=recording_inductor, fullgraph=True)
    out_c, lse_c = compiled(q, k_pool, v_pool, block_table)
    assert "flashtile.varlen_attn_fwd.default" in seen, seen
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_c, lse, rtol=1e-5, atol=1e-5)
    bad = block_table.clone()
    bad[1, 0] = 7  # the pool has blocks 0..6
    with pytest.raises(ValueError, match="block_table"):
        compiled(q, k_pool, v_pool, bad)
