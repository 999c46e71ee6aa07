"""The CPU harness of the eager host path (flashtile.bench.host_cpu, issue 15): the real
launchers run with only the compiled kernels' launchers stubbed, and what each call
costs in launches, allocations and Python calls is counted."""

import os

import torch

from flashtile.bench import host_cpu
from flashtile.ops import _launch, decode, fwd


def test_rows_use_plans_and_count_the_gpu_work():
    rows = {r["call"]: r for r in host_cpu.run(number=2, repeat=1)}
    assert rows.keys() == host_cpu.cases().keys()
    # What each call enqueues on the GPU: decode splits over the H200's SMs and
    # combines; the backward is three launches; an append is one more. Allocations:
    # a forward (dense or varlen) whose lse is not returned keeps it in out's; a split
    # decode allocates out and its scratch (lse and the partials) as one; an eager
    # backward allocates dq, dk, dv and delta as one (after the forward's out and lse).
    assert [(rows[c]["launches"], rows[c]["allocations"]) for c in rows] == [
        (1, 1), (4, 3), (1, 1), (2, 1), (2, 1), (3, 1)]
    # Every launch of a warm call goes through a plan, the backward's three included.
    assert [rows[c]["unplanned"] for c in rows] == [0] * len(rows)


def test_stand_ins_are_restored():
    kernel, ready, interpret = fwd._attn_fwd_kernel, _launch.ready, \
        os.environ.get("TRITON_INTERPRET")
    with host_cpu.stubbed_launches():
        assert _launch.ready(torch.empty(1)) and fwd._attn_fwd_kernel is not kernel
        assert decode.num_splits_heuristic(1, 8192, 64, 1) > 1
    assert fwd._attn_fwd_kernel is kernel and _launch.ready is ready
    assert os.environ.get("TRITON_INTERPRET") == interpret
    assert not _launch._plans


def test_gpu_pieces_run_and_the_stubbed_launcher_launches_nothing():
    """The "piece" rows of flashtile bench host, here on CPU tensors with the stand-ins:
    the launcher rows launch, their stubbed twins never (and restore the plans)."""
    from flashtile.bench import host

    half = dict(dtype=torch.float16)
    q, k, v, do = (torch.randn(1, 128, 8, host.HEAD_DIM, **half) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    pool = torch.randn(64, 64, 2, host.HEAD_DIM, **half)
    paged = (torch.randn(1, 1, 8, host.HEAD_DIM, **half), pool, pool,
             torch.tensor([4000], dtype=torch.int32),
             torch.arange(64, dtype=torch.int32)[None])
    with host_cpu.stubbed_launches():
        pieces = {name: row["piece"] for name, row in
                  host._pieces(q, k, v, qg, kg, vg, do, paged).items()}
        launches = []
        for name, fn in pieces.items():
            fn()  # makes the plan
            host_cpu._Counter.launches = 0
            fn()
            launches.append(host_cpu._Counter.launches)
        # The decode splits (decode + combine); the backward launcher's three (the
        # preprocess, dK/dV and dQ), on the main thread and inside autograd's backward;
        # the 1k-query forward launchers, portable and Gluon (the device counts as sm_90).
        assert launches == [0, 1, 0, 2, 0, 0, 0, 3, 3, 1, 1]
        # Every plan calls the no-op itself: the Gluon one under Triton's wrapper.
        assert all(p.launch is host_cpu._no_launch for plans in _launch._plans.values()
                   for p in (plans if isinstance(plans, tuple) else (plans,))
                   if isinstance(p, _launch.Plan))
    assert qg.grad is not None


def test_forward_plans_follow_layouts_and_options():
    """Regression for the dense forward's plan key, which holds the id check_qkv's memo
    gives the layouts of q, k and v: another layout or another option after the first
    call makes a plan of its own, and the same call again finds its plan."""
    import flashtile

    q, k, v = (torch.randn(1, 128, 8, 64, dtype=torch.float16) for _ in range(3))
    q_heads_major = torch.randn(1, 8, 128, 64, dtype=torch.float16).transpose(1, 2)
    calls = [lambda: flashtile.flash_attn_func(q, k, v, causal=True),
             lambda: flashtile.flash_attn_func(q_heads_major, k, v, causal=True),
             lambda: flashtile.flash_attn_func(q, k, v),
             lambda: flashtile.flash_attn_func(q, k, v, window_size=(16, 0)),
             lambda: flashtile.flash_attn_func(q, k[:, :100], v[:, :100], causal=True)]
    with host_cpu.stubbed_launches():
        for n, call in enumerate(calls, 1):
            call()
            call()
            assert len(_launch._plans) == n


def test_varlen_forward_does_the_host_work_of_the_dense_one():
    """Regression (issue 15): the packed varlen forward, called once per layer of every
    prefill step by flashtile.engine, ran 42 of flashtile's own function calls and 2
    other torch operators per call against the dense forward's 27 and 1 (its checks
    on every call, a select of out, the generic address path). Now no more than the
    dense forward's."""
    rows = {r["call"]: r for r in host_cpu.run(["forward"], number=2, repeat=1)}
    dense, varlen = rows["forward"], rows["varlen forward"]
    assert varlen["flashtile_calls"] <= dense["flashtile_calls"]
    assert [varlen[c] for c in ("launches", "allocations", "other_ops")] == \
        [dense[c] for c in ("launches", "allocations", "other_ops")]


def test_varlen_plans_follow_layouts_not_token_counts():
    """The varlen forward's plan key holds the part of q, k and v's layouts that the id
    of their checked layouts names, without the token counts: packed batches of other
    sizes share one plan (an engine's every prefill step), another layout or option
    makes its own, and the same call again finds its plan."""
    import flashtile

    q, k, v = (torch.randn(128, 8, 64, dtype=torch.float16) for _ in range(3))
    q_heads_major = torch.randn(8, 128, 64, dtype=torch.float16).transpose(0, 1)

    def cu(n):
        return torch.tensor([0, n // 3, n], dtype=torch.int32)

    def call(q, n, **kw):
        return lambda: flashtile.flash_attn_varlen_func(q[:n], k[:n], v[:n], cu(n), cu(n),
                                                        n, n, **{"causal": True, **kw})

    calls = [(call(q, 128), 1), (call(q, 100), 1), (call(q, 37), 1),
             (call(q_heads_major, 128), 2), (call(q, 128, causal=False), 3),
             (call(q, 128, window_size=(16, 0)), 4), (call(q, 64), 4)]
    with host_cpu.stubbed_launches():
        for fn, plans in calls:
            fn()
            fn()
            assert len(_launch._plans) == plans
