"""Ring attention (flashtile.distributed): exact against one process on the full sequence.

- The plan: for every layout, world size and mask, the kernel calls of each (q rank,
  kv rank) pair cover exactly the global mask, without overlap or wasted calls.
- The simulated ring (all ranks in one process, same step/merge/backward code): fp32 on
  CPU (both backends), bf16 on GPU under the accuracy rule.
- The real ring: 2 and 4 gloo processes on CPU, each comparing its slice's out, lse and
  gradients with flash_attn_func on the full sequence; world size 1 in this process.
- Bad input.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import flashtile
from flashtile import distributed as fd
from flashtile._ring import layout_chunks, plan
from flashtile.reference import allowed_keys
from tests.utils import FLOOR, assert_close_rule, max_err, reference_pair, run_gloo

SPAWN_TIMEOUT_S = 150  # a hung child fails the test then; gloo gives up at 60 s itself


# ---------------------------------------------------------------- the plan, exhaustively

def _global_positions(layout, world, rank, seqlen_local):
    return torch.cat([torch.arange(c.start, c.start + c.length)
                      for c in layout_chunks(layout, world, rank, seqlen_local)])


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 0), (0, 0), (5, 2), (-1, 4),
                                    (9, -1), (40, 0)], ids=lambda w: f"win{w[0]}_{w[1]}")
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_plan_covers_the_global_mask_exactly(layout, window):
    for world in range(1, 6):
        for seqlen_local in (2, 6, 8):
            for r in range(world):
                rows = _global_positions(layout, world, r, seqlen_local)
                for src in range(world):
                    cols = _global_positions(layout, world, src, seqlen_local)
                    want = allowed_keys(10 ** 6, 10 ** 6, 0, *window, "cpu", rows, cols)
                    calls = torch.zeros(want.shape, dtype=torch.int)  # per (q, k) cell
                    seen = torch.zeros(want.shape, dtype=torch.int)
                    for t in plan(layout, world, r, src, seqlen_local, *window):
                        ok = allowed_keys(t.q_hi - t.q_lo, t.k_hi - t.k_lo, t.diag_offset,
                                          t.window_left, t.window_right, "cpu")
                        assert ok.any(), f"{t}: a call with nothing to compute"
                        calls[t.q_lo:t.q_hi, t.k_lo:t.k_hi] += 1
                        seen[t.q_lo:t.q_hi, t.k_lo:t.k_hi] += ok.int()
                    where = f"W={world} r={r} src={src} L={seqlen_local}"
                    assert (calls <= 1).all(), f"overlapping calls {where}"
                    assert torch.equal(seen.bool(), want), f"mask differs {where}"


def test_zigzag_causal_is_one_call_per_step():
    for world in (2, 3, 4, 8):
        for r in range(world):
            calls = [plan("zigzag", world, r, src, 16, -1, 0) for src in range(world)]
            assert [len(c) for c in calls] == [1] * world
            areas = [(t.q_hi - t.q_lo) * (t.k_hi - t.k_lo) for (t,) in calls]
            assert sorted(areas) == [128] * (world - 1) + [256]  # balanced across ranks


# ------------------------------------------------------------------ the simulated ring

def _full_inputs(b, s, h, hkv, d, dtype, device):
    return (torch.randn(b, s, h, d, device=device, dtype=dtype),
            torch.randn(b, s, hkv, d, device=device, dtype=dtype),
            torch.randn(b, s, hkv, d, device=device, dtype=dtype))


def _slices(x, world, layout, dim=1):
    return [fd.split(x, world, r, layout, dim) for r in range(world)]


def _simulated(q, k, v, dout, dlse, world, layout, **kw):
    """Ring out, lse and (dq, dk, dv) reassembled into full-sequence order."""
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    outs, lses = fd.ring_attention_simulated(
        _slices(qg, world, layout), _slices(kg, world, layout), _slices(vg, world, layout),
        return_lse=True, layout=layout, **kw)
    loss = sum((o * do).sum() + (lse * dl).sum() for o, lse, do, dl in zip(
        outs, lses, _slices(dout, world, layout), _slices(dlse, world, layout, dim=2)))
    grads = torch.autograd.grad(loss, (qg, kg, vg))  # through split: full order
    return _unsplit(outs, layout), _unsplit(lses, layout, dim=2), grads


def _unsplit(parts, layout, dim=1):
    world = len(parts)
    pieces = [c for p in parts for c in p.chunk(2 if layout == "zigzag" else 1, dim=dim)]
    order = fd._chunk_order(world, layout)
    return torch.cat([pieces[order.index(i)] for i in range(len(pieces))], dim=dim)


# (world, layout, causal, window, softcap)
SIM_CASES = [
    (1, "contiguous", True, (-1, -1), 0.0),
    (2, "zigzag", True, (-1, -1), 0.0),
    (3, "zigzag", True, (-1, -1), 0.0),
    (4, "zigzag", True, (7, 0), 0.0),
    (4, "contiguous", False, (-1, -1), 0.0),
    (3, "contiguous", True, (5, 0), 0.0),
    (2, "contiguous", False, (4, 3), 2.0),
    (3, "zigzag", False, (-1, 6), 0.0),
]
# The interpreter takes seconds per kernel call: a few cases cover the kernels' offsets.
INTERPRETER_CASES = [SIM_CASES[2], SIM_CASES[3], SIM_CASES[5], SIM_CASES[6]]


def _sim_id(c):
    world, layout, causal, window, softcap = c
    s = f"W{world}-{layout}" + ("-causal" if causal else "")
    s += f"-win{window[0]}_{window[1]}" if window != (-1, -1) else ""
    return s + (f"-cap{softcap:g}" if softcap else "")


def _sim_params():
    params = [pytest.param(c, torch.float32, "torch", id=_sim_id(c) + "-fp32-torch")
              for c in SIM_CASES]
    params += [pytest.param(c, torch.float32, "triton", id=_sim_id(c) + "-fp32-triton")
               for c in INTERPRETER_CASES]
    params += [pytest.param(c, torch.bfloat16, "triton", id=_sim_id(c) + "-bf16-gpu",
                            marks=pytest.mark.gpu) for c in SIM_CASES]
    return params


@pytest.mark.parametrize("case, dtype, backend", _sim_params())
def test_simulated_ring_matches_full_attention(case, dtype, backend, device, on_gpu,
                                               monkeypatch):
    if backend == "torch" and on_gpu:
        pytest.skip("the GPU run checks the Triton kernels (bf16 cases)")
    if backend == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (set by make test)")
    monkeypatch.setenv("FLASHTILE_BACKEND", backend)
    world, layout, causal, window, softcap = case
    # GPU: 2048 tokens (1536 for world 3: divisible by 2*world), GQA 8/2, head_dim 128.
    b, s, h, hkv, d = (2, 2048 if world != 3 else 1536, 8, 2, 128) if on_gpu \
        else (1, 8 * world, 4, 2, 16)
    q, k, v = _full_inputs(b, s, h, hkv, d, dtype, device)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    dout = torch.randn_like(q)
    dlse = torch.randn(b, h, s, device=device)
    out, lse, grads = _simulated(q, k, v, dout, dlse, world, layout, **kw)

    (o64, l64, g64), (o_pt, _, g_pt) = reference_pair(q, k, v, dout, dlse, **kw)
    assert_close_rule("out", out, o64, o_pt)
    torch.testing.assert_close(lse.double(), l64, rtol=1e-4, atol=1e-4)
    for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close_rule(name, ours, r64, rpt)

    # And against flashtile's own kernel on the whole sequence, under the same bound.
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    full_out, full_lse = flashtile.flash_attn_func(qf, kf, vf, return_lse=True, **kw)
    full_grads = torch.autograd.grad((full_out * dout).sum() + (full_lse * dlse).sum(),
                                     (qf, kf, vf))
    for name, ours, full, r64, rpt in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                          (full_out, *full_grads), (o64, *g64),
                                          (o_pt, *g_pt)):
        bound = 2 * max_err(rpt, r64) + FLOOR[dtype]
        assert max_err(ours, full) <= bound, f"{name}: ring vs full kernel"


def test_simulated_ring_merges_rows_that_see_nothing_yet():
    """Window (0, 0): at most steps a row sees no key (lse -inf partials): no NaN."""
    q, k, v = _full_inputs(1, 24, 2, 2, 8, torch.float32, "cpu")
    ref = flashtile.flash_attn_func(q, k, v, window_size=(0, 0))
    outs = fd.ring_attention_simulated(*(_slices(x, 3, "zigzag") for x in (q, k, v)),
                                       window_size=(0, 0), layout="zigzag")
    torch.testing.assert_close(_unsplit(outs, "zigzag"), ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the real ring (gloo)

# (layout, causal, window, nheads_kv)
DIST_CASES = [
    ("zigzag", True, (-1, -1), 2),
    ("contiguous", False, (-1, -1), 4),
    ("contiguous", True, (6, 0), 2),
    ("zigzag", False, (3, 5), 1),
]


def _rank_results(rank, world, seqlen):
    """Every DIST_CASE on this rank: {name: (ours, flashtile on the full sequence)}."""
    results = {}
    b, h, d = 2, 4, 16
    for layout, causal, window, hkv in DIST_CASES:
        cid = f"{layout}-causal{causal}-win{window}-hkv{hkv}"
        gen = torch.Generator().manual_seed(1234)  # the same full tensors on every rank
        q, k, v = (torch.randn(b, seqlen, n, d, generator=gen) for n in (h, hkv, hkv))
        dout = torch.randn(b, seqlen, h, d, generator=gen)
        dlse = torch.randn(b, h, seqlen, generator=gen)
        kw = dict(causal=causal, window_size=window)

        qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
        out_f, lse_f = flashtile.flash_attn_func(qf, kf, vf, return_lse=True, **kw)
        grads_f = torch.autograd.grad((out_f * dout).sum() + (lse_f * dlse).sum(),
                                      (qf, kf, vf))

        mine = [fd.split(x, world, rank, layout).clone().requires_grad_()
                for x in (q, k, v)]
        out, lse = fd.ring_flash_attn_func(*mine, return_lse=True, layout=layout, **kw)
        grads = torch.autograd.grad(
            (out * fd.split(dout, world, rank, layout)).sum()
            + (lse * fd.split(dlse, world, rank, layout, dim=2)).sum(), mine)
        expected = [fd.split(x, world, rank, layout) for x in (out_f, *grads_f)]
        for name, ours, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), expected):
            results[f"{cid}/{name}"] = (ours.detach(), ref.detach())
        results[f"{cid}/lse"] = (lse.detach(), fd.split(lse_f, world, rank, layout, 2))
        results[f"{cid}/gather"] = (fd.gather(out.detach(), layout=layout),
                                    out_f.detach())
    return results


def _disagreeing_shapes_error(rank):
    """Rank 0 passes batch 2, the others batch 1: every rank must raise, nobody hang."""
    b = 2 if rank == 0 else 1
    q = torch.randn(b, 8, 2, 16)
    try:
        fd.ring_flash_attn_func(q, q, q)
    except ValueError as e:
        return str(e)
    return "no error"


def _ring_rank(rank, world, seqlen):
    results = _rank_results(rank, world, seqlen)
    if world > 1:
        results["disagree"] = _disagreeing_shapes_error(rank)
    return results


@pytest.mark.parametrize("world, seqlen", [(2, 32), (4, 64)], ids=["gloo2", "gloo4"])
def test_ring_processes_match_full_attention(world, seqlen, tmp_path):
    ranks = run_gloo(_ring_rank, world, tmp_path, seqlen, timeout_s=SPAWN_TIMEOUT_S)
    for rank, results in enumerate(ranks):
        assert "disagree on" in results.pop("disagree"), f"rank {rank}"
        for name, (ours, ref) in results.items():
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.fixture
def world_of_one(monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ring_world_size_one(world_of_one):
    q, k, v = _full_inputs(2, 20, 4, 2, 16, torch.float32, "cpu")
    for layout in ("contiguous", "zigzag"):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out, lse = fd.ring_flash_attn_func(qg, kg, vg, causal=True, return_lse=True,
                                           layout=layout)
        ref, ref_lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
        assert torch.equal(fd.gather(out, layout=layout), out)
        out.sum().backward()
        assert all(torch.isfinite(x.grad).all() for x in (qg, kg, vg))


def test_ring_rejects_odd_local_length_for_zigzag(world_of_one):
    q = torch.randn(1, 7, 2, 16)
    with pytest.raises(ValueError, match=r"q.shape\[1\] \(local seqlen\).*got 7"):
        fd.ring_flash_attn_func(q, q, q, causal=True, layout="zigzag")


# ---------------------------------------------------------------------------- bad input

def test_ring_without_process_group_raises():
    assert not dist.is_initialized()
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.ring_flash_attn_func(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.gather(q)


@pytest.mark.parametrize("layout, seqlen, world, fragment", [
    ("contiguous", 10, 4, "a multiple of 4"),
    ("zigzag", 12, 4, "a multiple of 8"),
    ("zigzag", 9, 1, "a multiple of 2"),
])
def test_split_rejects_indivisible_lengths(layout, seqlen, world, fragment):
    with pytest.raises(ValueError, match=f"x.shape\\[1\\] \\(seqlen\\): expected {fragment}"
                                         f".*got {seqlen}"):
        fd.split(torch.randn(1, seqlen, 2, 4), world, 0, layout)


@pytest.mark.parametrize("change, fragment", [
    (dict(layout="zig"), "layout: expected one of ('contiguous', 'zigzag'), got 'zig'"),
    (dict(window_size=(-2, 0)), "window_size: expected each bound >= 0"),
    (dict(k_len=6), "k.shape[1] (local seqlen): expected q's local seqlen 8, got 6"),
    (dict(layout="zigzag", q_len=5, k_len=5),
     "q.shape[1] (local seqlen): expected an even"),
    (dict(k_slices=2), "three non-empty lists of equal length, got (3, 2, 2)"),
], ids=["layout", "window", "k_len", "zigzag_odd", "slice_count"])
def test_simulated_rejects_bad_input(change, fragment):
    q_len, k_len = change.pop("q_len", 8), change.pop("k_len", 8)
    n_k = change.pop("k_slices", 3)
    qs = [torch.randn(1, q_len, 2, 16) for _ in range(3)]
    ks = [torch.randn(1, k_len, 2, 16) for _ in range(n_k)]
    with pytest.raises(ValueError, match=re.escape(fragment)):
        fd.ring_attention_simulated(qs, ks, ks, **change)


def test_split_gather_rank_bounds():
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world_size=2, got 2"):
        fd.split(torch.randn(1, 8, 1, 1), 2, 2)


def test_scaling_benchmark_dry_run():
    """benchmarks/ring_scaling.py --dry-run: its check and table on 2 gloo CPU processes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.join(root, "benchmarks", "ring_scaling.py")
    run = subprocess.run([sys.executable, script, "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=SPAWN_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "# check world=2: ok" in run.stdout
    assert "| 64 | True | 2 |" in run.stdout
