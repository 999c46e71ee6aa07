"""Every public function under torch.compile with dynamic shapes and under torch.export.

Serving code compiles with ``dynamic=True`` or marks the sequence dim dynamic; the
argument checks must trace (regression: ``math.isfinite`` on a float argument broke
``fullgraph=True, dynamic=True``). Each case is compiled once, run at two sequence
lengths with no recompile, and compared with eager. The ``aot_eager`` backend runs
Dynamo, AOTAutograd and the fake implementations with symbolic sizes without
Inductor's C++ build (minutes on a 2-core CPU); one case runs Inductor end to end.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flashtile


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch, on_gpu):
    if not on_gpu:
        monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    torch._dynamo.reset()


H, HKV, D = 4, 2, 16


def _randn(*shape, device):
    return torch.randn(*shape, device=device)


def _cu(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32,
                        device=device)


# Each case: name -> (make(s, device) -> args, fn(*args), {arg index: {dim: length}}).
# The dims listed are the sequence dims that mark_dynamic and torch.export make dynamic;
# dims that share a length name (q's "sq", k's "sk") share one torch.export.Dim.

def _dense(s, device):
    return (_randn(2, s, H, D, device=device), _randn(2, s + 3, HKV, D, device=device),
            _randn(2, s + 3, HKV, D, device=device))


def _sdpa(s, device):
    q, k, v = _dense(s, device)
    return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            torch.rand(s, s + 3, device=device) > 0.3)


def _varlen(s, device):
    # Three sequences; the packed length grows with s, the lengths are data.
    lens_q, lens_k = [2, s - 3, 1], [s - 1, 4, 3]
    return (_randn(sum(lens_q), H, D, device=device), _randn(sum(lens_k), HKV, D, device=device),
            _randn(sum(lens_k), HKV, D, device=device), _cu(lens_q, device),
            _cu(lens_k, device))


def _kvcache(s, device):
    # s new tokens appended after 3 and 9 cached ones, rotary, causal.
    return (_randn(2, s, H, D, device=device), _randn(2, s, HKV, D, device=device),
            _randn(2, s, HKV, D, device=device), _randn(2, 48, HKV, D, device=device),
            _randn(2, 48, HKV, D, device=device),
            torch.tensor([3, 9], dtype=torch.int32, device=device),
            _randn(64, 4, device=device).cos(), _randn(64, 4, device=device).sin())


def _merge(s, device):
    return (_randn(2, s, H, D, device=device), _randn(2, H, s, device=device),
            _randn(2, s, H, D, device=device), _randn(2, H, s, device=device))


ALIBI = torch.rand(H)
DENSE = {0: {1: "sq"}, 1: {1: "sk"}, 2: {1: "sk"}}
CASES = {
    "flash_attn_func": (
        _dense, lambda q, k, v: flashtile.flash_attn_func(
            q, k, v, softmax_scale=0.3, causal=True, window_size=(5, 0), softcap=4.0,
            alibi_slopes=ALIBI.to(q.device), return_lse=True),
        DENSE),
    "flash_attn_func_probs": (
        _dense, lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True,
                                                          return_attn_probs=True),
        DENSE),
    "qkvpacked": (
        lambda s, device: (_randn(2, s, 3, H, D, device=device),),
        lambda qkv: flashtile.flash_attn_qkvpacked_func(qkv, causal=True), {0: {1: "sq"}}),
    "kvpacked": (
        lambda s, device: (_randn(2, s, H, D, device=device),
                           _randn(2, s + 3, 2, HKV, D, device=device)),
        lambda q, kv: flashtile.flash_attn_kvpacked_func(q, kv, window_size=(3, 3)),
        {0: {1: "sq"}, 1: {1: "sk"}}),
    "varlen": (
        _varlen, lambda q, k, v, cu_q, cu_k: flashtile.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 16, 16, causal=True, return_attn_probs=True),
        {0: {0: "sq"}, 1: {0: "sk"}, 2: {0: "sk"}}),
    "varlen_qkvpacked": (
        lambda s, device: (_randn(s + 4, 3, H, D, device=device), _cu([4, s], device)),
        lambda qkv, cu: flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, 16,
                                                                   causal=True),
        {0: {0: "sq"}}),
    "varlen_kvpacked": (
        lambda s, device: (_randn(s + 4, H, D, device=device),
                           _randn(s + 6, 2, HKV, D, device=device), _cu([4, s], device),
                           _cu([5, s + 1], device)),
        lambda q, kv, cu_q, cu_k: flashtile.flash_attn_varlen_kvpacked_func(
            q, kv, cu_q, cu_k, 16, 16, return_lse=True),
        {0: {0: "sq"}, 1: {0: "sk"}}),
    "sdpa": (
        _sdpa, lambda q, k, v, mask: flashtile.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True),
        {0: {2: "sq"}, 1: {2: "sk"}, 2: {2: "sk"}, 3: {0: "sq", 1: "sk"}}),
    "sdpa_causal": (
        lambda s, device: _sdpa(s, device)[:3],
        lambda q, k, v: flashtile.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=0.2, enable_gqa=True),
        {0: {2: "sq"}, 1: {2: "sk"}, 2: {2: "sk"}}),
    "flash_attn_with_kvcache": (
        _kvcache, lambda q, k, v, k_cache, v_cache, seqlens, cos, sin:
            flashtile.flash_attn_with_kvcache(
                q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                cache_seqlens=seqlens, causal=True, return_softmax_lse=True),
        {0: {1: "sq"}, 1: {1: "sq"}, 2: {1: "sq"}}),
    "merge_attention_states": (
        _merge, flashtile.merge_attention_states,
        {0: {1: "sq"}, 1: {2: "sq"}, 2: {1: "sq"}, 3: {2: "sq"}}),
}
LENGTHS = (7, 11)  # the traced length, then another one the same graph must serve


def _clone(args):
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in args)


def _assert_same(got, want):
    # The in-place cache append is part of the result: compare the arguments too.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["dynamic", "mark_dynamic"])
@pytest.mark.parametrize("case", list(CASES))
def test_compile_dynamic_fullgraph(case, mode, device):
    make, fn, seq_dims = CASES[case]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True,
                             dynamic=True if mode == "dynamic" else None)
    frames = []
    for s in LENGTHS:
        args = make(s, device)
        eager_args, compiled_args = _clone(args), _clone(args)
        if mode == "mark_dynamic":
            for i, dims in seq_dims.items():
                for dim in dims:
                    torch._dynamo.mark_dynamic(compiled_args[i], dim)
        want = fn(*eager_args)
        got = compiled(*compiled_args)
        _assert_same((got, compiled_args), (want, eager_args))
        frames.append(counter.frame_count)
    # The first call may compile twice: Dynamo restarts once to specialize a float it
    # cannot keep symbolic (a default softmax_scale computed from head_dim).
    assert frames[0] == frames[1], f"{case}: recompiled for a new sequence length"


def test_compile_dynamic_inductor_with_grads(device):
    """The issue's command, through Inductor, with gradients: one graph for both lengths."""
    def step(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for s in LENGTHS:
        q, k, v = (x.requires_grad_() for x in _dense(s, device))
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        want = step(q, k, v)
        want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
        _assert_same((out, grads), (want, want_grads))


def test_compile_dynamic_varlen_grads(device):
    """The varlen backward op's fake implementation under symbolic packed lengths."""
    def step(q, k, v, cu_q, cu_k):
        return flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 16, 16, causal=True)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for s in LENGTHS:
        args = _varlen(s, device)
        q, k, v = (x.requires_grad_() for x in args[:3])
        grads = torch.autograd.grad(compiled(q, k, v, *args[3:]).sum(), (q, k, v))
        want = torch.autograd.grad(step(q, k, v, *args[3:]).sum(), (q, k, v))
        _assert_same(grads, want)
        frames.append(counter.frame_count)
    assert frames[0] == frames[1]


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@pytest.mark.parametrize("case", list(CASES))
def test_export(case, device):
    """torch.export with the sequence dims dynamic: the exported program, run at another
    length, equals eager (including the KV cache it appends to). The Dim is bounded:
    flashtile's 32-bit offset checks bound sequence lengths, which export turns into
    range constraints (Dim.AUTO infers them)."""
    make, fn, seq_dims = CASES[case]
    lengths = {name: torch.export.Dim(name, min=4, max=4096) for name in ("sq", "sk")}
    args = make(LENGTHS[0], device)
    shapes = [None] * len(args)
    for i, dims in seq_dims.items():
        shapes[i] = {dim: lengths[name] for dim, name in dims.items()}
    exported = torch.export.export(_Call(fn), args, dynamic_shapes=(tuple(shapes),))
    args = make(LENGTHS[1], device)
    eager_args, exported_args = _clone(args), _clone(args)
    _assert_same((exported.module()(*exported_args), exported_args),
                 (fn(*eager_args), eager_args))


def test_fake_impls_give_symbolic_shapes(device):
    """Under dynamic=True each op's fake implementation returns the caller's symbolic
    shapes: out like q, lse (batch, nheads, seqlen_q), varlen lse (nheads, total_q)."""
    shapes = {}

    def recording_backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("flashtile."):
                shapes[str(node.target)] = [tuple(x.shape) for x in node.meta["example_value"]]
        return gm

    def fn(q, k, v, qp, cu, kc):
        flashtile.flash_attn_func(q, k, v)
        flashtile.flash_attn_varlen_func(qp, qp, qp, cu, cu, 9, 9)
        flashtile.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=3)

    q, k, v = _dense(7, device)
    qp = _randn(9, H, D, device=device)
    torch.compile(fn, backend=recording_backend, fullgraph=True, dynamic=True)(
        q, k, v, qp, _cu([4, 5], device), _randn(2, 16, HKV, D, device=device))
    b, sq, h, d = shapes["flashtile.attn_fwd.default"][0]
    assert not isinstance(sq, int), "seqlen_q was specialized"
    assert shapes["flashtile.attn_fwd.default"] == [(b, sq, h, d), (b, h, sq)]
    (tq, hv, dv), lse_v = shapes["flashtile.varlen_attn_fwd.default"]
    assert not isinstance(tq, int) and lse_v == (hv, tq)
    assert shapes["flashtile.kvcache_attn.default"] == [(b, sq, h, d), (b, h, sq)]


# Checks keep working under compile: a bad float or a bad shape still names the argument.
# Without fullgraph the failing frame falls back to eager, which raises the ValueError
# itself; with fullgraph Dynamo raises its own error carrying the message (with symbolic
# sizes, e.g. "got (s0, s1, 2, 16)").

def _raises(fullgraph, message):
    if fullgraph:
        # Dynamo quotes the message inside its own: torch 2.13 renders the f-string
        # ("v.shape: expected ..."), torch 2.11 lists its pieces ("str: 'v.shape'"), so
        # only the argument's name is matched there.
        name = message.split(":")[0]
        return pytest.raises(torch._dynamo.exc.Unsupported, match=re.escape(name))
    return pytest.raises(ValueError, match=re.escape(message))


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_break", "fullgraph"])
def test_bad_float_still_raises_under_compile(fullgraph, device):
    def step(q, k, v, scale):
        return flashtile.flash_attn_func(q, k, v, softmax_scale=scale)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=fullgraph, dynamic=True)
    q, k, v = _dense(7, device)
    _assert_same(compiled(q, k, v, 0.5), step(q, k, v, 0.5))
    with _raises(fullgraph, "softmax_scale: expected a finite float, got nan"):
        compiled(q, k, v, math.nan)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_break", "fullgraph"])
def test_bad_shape_still_raises_under_compile(fullgraph, device):
    compiled = torch.compile(lambda q, k, v: flashtile.flash_attn_func(q, k, v),
                             backend="aot_eager", fullgraph=fullgraph, dynamic=True)
    q, k, v = _dense(7, device)
    compiled(q, k, v)
    with _raises(fullgraph, "v.shape[:-1]: expected k's (2, 10, 2), got (2, 9, 2)"):
        compiled(q, k, v[:, 1:])
    # The SDPA mask's broadcast check (expand's own error cannot be caught while tracing).
    sdpa = torch.compile(lambda q, k, v, mask: flashtile.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True), backend="aot_eager",
        fullgraph=fullgraph, dynamic=True)
    q, k, v, mask = _sdpa(7, device)
    sdpa(q, k, v, mask)
    with _raises(fullgraph, "attn_mask.shape: expected" if fullgraph else
                 "attn_mask.shape: expected broadcastable to (2, 4, 7, 10), got (7, 9)"):
        sdpa(q, k, v, mask[:, 1:])


def test_tensor_window_is_refused_under_compile(device):
    """A tensor window's values could change between calls of one compiled graph."""
    q, k, v = _dense(7, device)
    window = torch.tensor([3, 0])
    compiled = torch.compile(lambda q, k, v: flashtile.flash_attn_func(
        q, k, v, window_size=window), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="window_size: expected a pair of ints"):
        compiled(q, k, v)


def test_merge_compiles_on_each_backend(backend, device):
    """On the Triton path the kernel launch is the flashtile::merge_attn_states op: Dynamo
    cannot trace the launcher (its first-launch log line breaks a fullgraph compile)."""
    make, fn, _ = CASES["merge_attention_states"]
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for s in LENGTHS:
        args = make(s, device)
        _assert_same(compiled(*args), fn(*args))
    if backend == "triton":
        from flashtile.merge import merge_attn_states
        torch.library.opcheck(merge_attn_states, make(LENGTHS[0], device))
