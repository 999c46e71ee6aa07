"""Launch plans (flashtile.ops._launch): after a kernel variant's first launch, later calls
with the same key go straight to the compiled kernel's launcher (issue 15).

On CPU every kernel is replaced by a recorder that stands for Triton: a launch through
``kernel[grid](...)`` records the arguments Triton would bind; a plan's launch records
what reaches the compiled launcher. A plan must pass exactly what Triton would have been
given for the same tensors (their addresses instead of the tensors), and a change of
anything Triton specialises on (strides, 16-byte alignment, options) must make a new
launch through Triton. On the GPU the same calls are checked against Triton's own path
numerically.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import triton

import flashtile
from flashtile.engine import activation, layernorm, rope_store
from flashtile.ops import _launch, bwd, combine, configs, decode, fwd

KERNELS = {
    (fwd, "_attn_fwd_kernel"), (bwd, "_bwd_preprocess_kernel"), (bwd, "_bwd_dkdv_kernel"),
    (bwd, "_bwd_dq_kernel"), (bwd, "_bwd_dq_convert_kernel"), (decode, "_decode_kernel"), (combine, "_combine_kernel"),
    (decode, "_append_kernel"), (layernorm, "_rms_norm_kernel"),
    (activation, "_silu_and_mul_kernel"), (rope_store, "_rope_store_kernel"),
}


class _Launcher:
    """What a CompiledKernel's ``run`` is: the launcher a plan calls."""
    launch_cooperative_grid = launch_pdl = False
    global_scratch_size = profile_scratch_size = 0

    def __init__(self, kernel):
        self.kernel = kernel

    def launch(self, gx, gy, gz, stream, function, *rest):
        head = 8  # coop, pdl, 2 scratch, metadata, launch metadata, 2 hooks
        self.kernel.log.append(("plan", self.kernel.name, (gx, gy, gz), list(rest[head:])))


class _Compiled:
    packed_metadata = function = None

    def __init__(self, kernel):
        self.run = _Launcher(kernel)


class _Kernel:
    """Stands for a JITFunction: records the bound arguments of kernel[grid](...)."""

    def __init__(self, real, name, log):
        self.arg_names = list(inspect.signature(real.fn).parameters)
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            bound = [*args, *(kwargs[n] for n in self.arg_names[len(args):])]
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            self.log.append(("triton", self.name, grid3, bound))
            return _Compiled(self)
        return run


@pytest.fixture
def recorder(monkeypatch):
    """Plans on CPU tensors, every launch recorded; the list of (path, kernel, grid,
    arguments) entries."""
    log = []
    for module, name in KERNELS:
        monkeypatch.setattr(module, name, _Kernel(getattr(module, name), name, log))
    monkeypatch.setattr(_launch, "ready", lambda x: True)
    monkeypatch.setattr(_launch, "_device", lambda: 0)
    monkeypatch.setattr(_launch, "_stream", lambda device: 0)
    _launch.clear()
    yield log
    _launch.clear()


def _canon(entry, roles, pointer_positions):
    """An entry's arguments with every address replaced by the role of its tensor."""
    path, name, grid, args = entry
    out = []
    for i, x in enumerate(args):
        if i in pointer_positions:
            x = roles.get(x.data_ptr() if isinstance(x, torch.Tensor) else x, "internal")
        out.append(x)
    return name, grid, out


def _roles(named):
    return {x.data_ptr(): name for name, x in named.items() if isinstance(x, torch.Tensor)}


def _check_plan_matches_triton(recorder, call, make_inputs, first=True):
    """call(inputs) -> outputs (dict). First call: through Triton, plan made (first=False:
    any path); second call with new tensors: through the plan; third, plans cleared,
    the same tensors through Triton: the plan's arguments must be Triton's, role for
    role."""
    call(make_inputs())
    assert recorder and (not first or all(e[0] == "triton" for e in recorder))
    recorder.clear()
    inputs = make_inputs()
    planned = call(inputs)
    assert recorder and all(e[0] == "plan" for e in recorder), recorder
    plan_log = list(recorder)
    recorder.clear()
    _launch.clear()
    through_triton = call(inputs)
    triton_log = list(recorder)
    assert [e[1] for e in plan_log] == [e[1] for e in triton_log]
    for p, t in zip(plan_log, triton_log):
        pointers = {i for i, x in enumerate(t[3]) if isinstance(x, torch.Tensor)}
        assert _canon(p, _roles({**inputs, **planned}), pointers) == \
            _canon(t, _roles({**inputs, **through_triton}), pointers), p[1]


def _fwd_kw(**kw):
    base = dict(attn_mask=None, alibi_slopes=None, softmax_scale=0.3, diag_offset=0,
                window_left=-1, window_right=0, softcap=0.0, allow_tf32=False)
    return {**base, **kw}


@pytest.mark.parametrize("features", ["plain", "alibi", "mask_dlse_dropout"])
@pytest.mark.parametrize("one_allocation", [False, True], ids=["op", "eager"])
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_plan_forward_and_backward_match_triton(fused, one_allocation, features,
                                                recorder):
    """Both of the backward's allocations (the op's dq with the scratch in its tail, the
    eager path's one for all) give the plan, which is given addresses, what Triton's
    path is given, in every slot (the optional tensors' and their placeholders')."""
    def make_inputs():
        q, k, v = (torch.randn(2, 37, 4, 24) for _ in range(3))
        k, v = k[:, :, :2], v[:, :, :2]  # GQA, strided views
        return dict(q=q, k=k, v=v, dout=torch.randn(2, 37, 4, 24), alibi=torch.rand(4),
                    mask=torch.randn(2, 4, 37, 37), dlse=torch.randn(2, 4, 37),
                    philox=torch.tensor([7, 0]))

    def call(t):
        opts = {"plain": {}, "alibi": dict(alibi_slopes=t["alibi"]),
                "mask_dlse_dropout": dict(attn_mask=t["mask"], dropout_p=0.25,
                                          philox=t["philox"])}[features]
        out, lse = fwd.attn_fwd(t["q"], t["k"], t["v"], **_fwd_kw(**opts))
        dlse = t["dlse"] if features == "mask_dlse_dropout" else None
        dq, dk, dv = bwd.attn_bwd(t["dout"], t["q"], t["k"], t["v"], out, lse, dlse,
                                  fused=fused, one_allocation=one_allocation,
                                  **_fwd_kw(**opts))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    _check_plan_matches_triton(recorder, call, make_inputs)


def test_plan_varlen_takes_each_calls_max_seqlen(recorder):
    """max_seqlen_q/k change from call to call (not specialised): one plan, and each
    call's grid covers its own longest sequence."""
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)

    def make_inputs():
        return dict(q=torch.randn(12, 2, 16), k=torch.randn(12, 2, 16),
                    v=torch.randn(12, 2, 16), cu=cu.clone(), dout=torch.randn(12, 2, 16))

    def call(t, max_q=7, max_k=7):
        kw = _fwd_kw(cu_seqlens_q=t["cu"], cu_seqlens_k=t["cu"], max_seqlen_q=max_q,
                     max_seqlen_k=max_k)
        out, lse = fwd.attn_fwd(t["q"], t["k"], t["v"], **kw)
        dq, dk, dv = bwd.attn_bwd(t["dout"], t["q"], t["k"], t["v"], out, lse, None, **kw)
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    _check_plan_matches_triton(recorder, call, make_inputs)
    recorder.clear()
    call(make_inputs(), max_q=100, max_k=60)
    assert [e[0] for e in recorder] == ["plan"] * 4
    grids = {e[1]: e[2] for e in recorder}
    assert grids["_attn_fwd_kernel"][0] == configs.cdiv(100, configs.fwd_config(
        torch.empty(0), 16).block_m)
    assert recorder[0][3][fwd._attn_fwd_kernel.arg_names.index("max_seqlen_q")] == 100


@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "no_lse"])
@pytest.mark.parametrize("keys", ["packed", "paged", "paged_seqused_k"])
def test_plan_varlen_forward_serves_every_token_count(keys, return_lse, recorder):
    """An engine's steps pack a different number of tokens each time: the forward's plan
    is keyed without the counts and passes each call's own (total_q, total_k and the lse
    strides they make) exactly as Triton would; without lse, its words after out's in
    out's allocation. Paged: the block table, and seqused_k where it replaces
    cu_seqlens_k, in their slots (the plan's short address path names them itself)."""
    sizes = iter([(5, 7), (9, 2, 6), (9, 2, 6)])  # Triton, plan, Triton again
    paged = keys != "packed"

    def make_inputs():
        lens = next(sizes)
        cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        n = int(cu[-1])
        t = dict(q=torch.randn(n, 4, 16), cu=cu)
        if paged:
            t.update(k=torch.randn(6, 8, 2, 16), v=torch.randn(6, 8, 2, 16),
                     table=torch.randperm(6)[:2 * len(lens)].view(len(lens), 2).int())
        else:
            t.update(k=torch.randn(n, 2, 16), v=torch.randn(n, 2, 16))
        if keys == "paged_seqused_k":
            t.update(seqused_k=torch.tensor(lens, dtype=torch.int32))
        return t

    def call(t):
        seqused_k = t.get("seqused_k")
        out, lse = fwd.attn_fwd(t["q"], t["k"], t["v"], **_fwd_kw(
            cu_seqlens_q=t["cu"], cu_seqlens_k=t["cu"] if seqused_k is None else None,
            max_seqlen_q=9, max_seqlen_k=9, block_table=t.get("table"),
            seqused_k=seqused_k), return_lse=return_lse)
        if return_lse:
            return dict(out=out, lse=lse)
        assert lse is None and out.is_contiguous() and out.shape == (*t["q"].shape[:2], 16)
        lse_at = -(-out.numel() * out.element_size() // 16) * 16
        total_q, h = out.shape[:2]
        lse_words = torch.empty(0).set_(out.untyped_storage(), lse_at // 4, (h, total_q))
        return dict(out=out, lse=lse_words)

    _check_plan_matches_triton(recorder, call, make_inputs)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_plan_varlen_backward_serves_every_batch_and_token_count(fused, recorder):
    """Packed training batches differ in sequence count and tokens from step to step: the
    backward's plans are keyed without them and pass each call's own rows, lse and dQ
    accumulator strides and token counts exactly as Triton would (the first call's would
    address the wrong rows)."""
    sizes = iter([(5, 7), (9, 2, 6, 1), (9, 2, 6, 1)])  # Triton, plan, Triton again

    def make_inputs():
        lens = next(sizes)
        cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        n = int(cu[-1])
        return dict(q=torch.randn(n, 4, 16), k=torch.randn(n, 2, 16),
                    v=torch.randn(n, 2, 16), dout=torch.randn(n, 4, 16), cu=cu)

    def call(t):
        kw = _fwd_kw(cu_seqlens_q=t["cu"], cu_seqlens_k=t["cu"], max_seqlen_q=9,
                     max_seqlen_k=9)
        out, lse = fwd.attn_fwd(t["q"], t["k"], t["v"], **kw)
        dq, dk, dv = bwd.attn_bwd(t["dout"], t["q"], t["k"], t["v"], out, lse, None,
                                  fused=fused, **kw)
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    _check_plan_matches_triton(recorder, call, make_inputs)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_plan_decode_and_append_match_triton(paged, num_splits, recorder):
    def make_inputs():
        if paged:
            cache = dict(k_cache=torch.randn(9, 16, 2, 16), v_cache=torch.randn(9, 16, 2, 16),
                         block_table=torch.randperm(9)[:8].view(2, 4).to(torch.int32))
        else:
            cache = dict(k_cache=torch.randn(2, 64, 2, 16), v_cache=torch.randn(2, 64, 2, 16),
                         block_table=None)
        return dict(q=torch.randn(2, 1, 4, 16), k=torch.randn(2, 1, 2, 16),
                    v=torch.randn(2, 1, 2, 16),
                    seqlens=torch.tensor([5, 40], dtype=torch.int32), **cache)

    def call(t):
        decode.append_kv(t["k"], t["v"], t["k_cache"], t["v_cache"],
                         cache_seqlens=t["seqlens"], block_table=t["block_table"],
                         cache_batch_idx=None)
        out, lse = decode.attn_decode(
            t["q"], t["k_cache"], t["v_cache"], cache_seqlens=t["seqlens"],
            block_table=t["block_table"], cache_batch_idx=None, cache_leftpad=None,
            alibi_slopes=None, softmax_scale=0.25, window_left=-1, window_right=0,
            softcap=0.0, num_splits=num_splits, allow_tf32=False, new_tokens=1)
        return dict(out=out, lse=lse)

    _check_plan_matches_triton(recorder, call, make_inputs)
    assert [e[1] for e in recorder] == ["_append_kernel", "_decode_kernel"] + (
        ["_combine_kernel"] if num_splits > 1 else [])


@pytest.mark.parametrize("launcher", ["fwd", "fwd_dropout", "decode", "decode_split"])
def test_plan_without_lse_matches_triton_and_writes_lse_after_out(launcher, recorder):
    """return_lse=False: lse's words after out's in one allocation. The plan passes the
    kernels what Triton's path does, lse at out's address plus out's bytes rounded up
    to 16 (inside out's allocation) for the unsplit launches."""
    def make_inputs():
        return dict(q=torch.randn(2, 5, 4, 24), k=torch.randn(2, 64, 2, 24),
                    v=torch.randn(2, 64, 2, 24),
                    seqlens=torch.tensor([5, 40], dtype=torch.int32),
                    philox=torch.tensor([7, 0]))

    def call(t):
        if launcher.startswith("fwd"):
            dropout = dict(dropout_p=0.3, philox=t["philox"]) if "dropout" in launcher \
                else {}
            out, lse = fwd.attn_fwd(t["q"], t["k"], t["v"], **_fwd_kw(), **dropout,
                                    return_lse=False)
        else:
            out, lse = decode.attn_decode(
                t["q"], t["k"], t["v"], cache_seqlens=t["seqlens"], block_table=None,
                cache_batch_idx=None, cache_leftpad=None, alibi_slopes=None,
                softmax_scale=0.25, window_left=-1, window_right=0, softcap=0.0,
                num_splits=3 if launcher == "decode_split" else 1, allow_tf32=False,
                return_lse=False)
        assert lse is None and out.is_contiguous() and out.shape == (2, 5, 4, 24)
        if launcher == "decode_split":  # lse in the scratch of the partials
            return dict(out=out)
        lse_at = -(-out.numel() * out.element_size() // 16) * 16
        assert out.untyped_storage().nbytes() >= lse_at + 4 * 2 * 4 * 5
        lse_words = torch.empty(0).set_(out.untyped_storage(), lse_at // 4, (2, 4, 5))
        return dict(out=out, lse=lse_words)

    _check_plan_matches_triton(recorder, call, make_inputs)


def test_plans_of_flash_attn_with_kvcache_follow_each_layout(recorder, monkeypatch):
    """flash_attn_with_kvcache keys its decode and append plans by the id of its
    arguments' checked layouts: a call whose layouts differ from every earlier one (here
    in strides only, shapes equal) goes through Triton, never through another layout's
    plan; a later call of the same layouts passes its plan what Triton's path does."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path
    monkeypatch.delenv("FLASHTILE_BACKEND", raising=False)

    def contiguous(wide=False, q_t=False, append=False):
        def make():
            kv = torch.randn(2, 64, 2, 48) if wide else None
            q = torch.randn(2, 1, 4, 16)
            if q_t:
                q = q.transpose(1, 2).contiguous().transpose(1, 2)
            return dict(q=q, k_cache=kv[..., :16] if wide else torch.randn(2, 64, 2, 16),
                        v_cache=kv[..., -16:] if wide else torch.randn(2, 64, 2, 16),
                        seqlens=torch.tensor([5, 40], dtype=torch.int32),
                        k=torch.randn(2, 1, 2, 16) if append else None,
                        v=torch.randn(2, 1, 2, 16) if append else None, table=None)
        return make

    def paged(table_t=False, append=False):
        def make():
            table = torch.randperm(9)[:8].view(2, 4).to(torch.int32)
            if table_t:
                table = table.t().contiguous().t()
            return dict(q=torch.randn(2, 1, 4, 16), k_cache=torch.randn(9, 16, 2, 16),
                        v_cache=torch.randn(9, 16, 2, 16), table=table,
                        seqlens=torch.tensor([5, 40], dtype=torch.int32),
                        k=torch.randn(2, 1, 2, 16) if append else None,
                        v=torch.randn(2, 1, 2, 16) if append else None)
        return make

    def call(t):
        out, lse = flashtile.flash_attn_with_kvcache(
            t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], cache_seqlens=t["seqlens"],
            block_table=t["table"], causal=True, num_splits=3, return_lse=True)
        return dict(out=out, lse=lse)

    # (make_inputs, whether its first call goes through Triton). A wide cache's strides
    # differ from the plain one's within what Triton compiles on: its decode takes the
    # plain layout's plans, relocated (test_plan_follows_a_growing_contiguous_cache),
    # with Triton's arguments all the same (checked on its second call). So does q_t's,
    # whose q keeps the plain strides (contiguous() leaves a transposed size-1 dim be)
    # but whose plans the wide call's clear() removed.
    for make, first in ((contiguous(), True), (contiguous(wide=True), False),
                        (contiguous(q_t=True), False), (contiguous(append=True), True),
                        (contiguous(wide=True, append=True), False), (paged(), True),
                        (paged(table_t=True), True), (paged(append=True), True),
                        (paged(table_t=True, append=True), True)):
        recorder.clear()
        _check_plan_matches_triton(recorder, call, make, first=first)


def _growing(splits=1, leftpad=False):
    """make_inputs of decodes over a contiguous cache one key longer each call, in
    transformers' layout: (b, hkv, capacity, d) concatenated, read as (b, capacity, hkv,
    d), so that the capacity and the batch and head strides change every call."""
    capacity = iter(range(40, 400))

    def make():
        n = next(capacity)
        k, v = (torch.randn(2, 2, n, 16).transpose(1, 2) for _ in "kv")
        return dict(q=torch.randn(2, 1, 4, 16), k_cache=k, v_cache=v,
                    seqlens=torch.tensor([n - 3, n], dtype=torch.int32),
                    leftpad=torch.tensor([2, 0], dtype=torch.int32) if leftpad else None)
    return make


def _decode_call(num_splits=1, return_lse=True):
    def call(t):
        out, lse = decode.attn_decode(
            t["q"], t["k_cache"], t["v_cache"], cache_seqlens=t["seqlens"],
            block_table=None, cache_batch_idx=None, cache_leftpad=t["leftpad"],
            alibi_slopes=None, softmax_scale=0.25, window_left=-1, window_right=0,
            softcap=0.0, num_splits=num_splits, allow_tf32=False, return_lse=return_lse)
        return dict(out=out) if lse is None else dict(out=out, lse=lse)
    return call


@pytest.mark.parametrize("leftpad", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_plan_follows_a_growing_contiguous_cache(num_splits, leftpad, recorder):
    """A cache one key longer than the last call's (transformers' DynamicCache) takes
    the last plans of its layout with the new capacity, strides and keys per split in
    place of the recorded ones: no launch through Triton, Triton's arguments all the
    same, split or not."""
    _check_plan_matches_triton(recorder, _decode_call(num_splits), _growing(leftpad=leftpad))
    assert [e[1] for e in recorder] == ["_decode_kernel"] + (
        ["_combine_kernel"] if num_splits > 1 else [])


def test_plan_of_a_growing_cache_is_remade_when_the_split_count_changes(recorder,
                                                                        monkeypatch):
    """The relocated plans launch the split count they were made with: a capacity for
    which the heuristic picks another count goes through Triton (new plans, which the
    next longer cache then takes)."""
    monkeypatch.setattr(decode, "num_splits_heuristic",
                        lambda work, capacity, *args: 2 if capacity < 43 else 3)
    make, call = _growing(), _decode_call(num_splits=0)
    paths = []
    for _ in range(5):  # capacities 40-44: 2, 2, 2, 3, 3 splits
        recorder.clear()
        call(make())
        paths.append({e[0] for e in recorder})
    assert paths == [{"triton"}, {"plan"}, {"plan"}, {"triton"}, {"plan"}]
    assert recorder[0][2][0] == 3  # the decode's grid: 3 splits


@pytest.mark.parametrize("splits", [1, 3])
def test_bound_decode_passes_what_attn_decode_plans_pass(splits, recorder, monkeypatch):
    """decode.bind after a call: its launches take a later call's tensors of the same
    layout (a longer cache too, through the relocated plans) and pass what
    attn_decode's plans pass, split or not; an address aligned otherwise is left to
    attn_decode (None)."""
    monkeypatch.setattr(decode, "num_splits_heuristic", lambda *args: splits)
    make, call = _growing(), _decode_call(num_splits=0, return_lse=False)
    first = make()
    call(first)
    bound = decode.bind(first["q"], first["k_cache"], first["v_cache"],
                        cache_seqlens=first["seqlens"], cache_leftpad=None,
                        softmax_scale=0.25, window_left=-1, window_right=0, softcap=0.0)
    assert bound is not None
    same = dict(first, q=first["q"].clone(), k_cache=first["k_cache"] * 1,
                v_cache=first["v_cache"] * 1)
    for t in (first, same):
        recorder.clear()
        out = bound(t["q"], t["k_cache"], t["v_cache"], t["seqlens"], None)
        bound_log = list(recorder)
        recorder.clear()
        planned = call(t)
        assert [e[1] for e in bound_log] == ["_decode_kernel"] + (
            ["_combine_kernel"] if splits > 1 else [])
        assert {e[0] for e in bound_log} == {"plan"}
        assert [e[:3] for e in bound_log] == [e[:3] for e in recorder]
        for b, p in zip(bound_log, recorder):
            # The decode kernel's 13 tensors, the combine's 4.
            pointers = set(range(13 if b[1] == "_decode_kernel" else 4))
            assert _canon(b, _roles({**t, "out": out}), pointers) == \
                _canon(p, _roles({**t, **planned}), pointers)
    longer = make()
    later = decode.bind(longer["q"], longer["k_cache"], longer["v_cache"],
                        cache_seqlens=longer["seqlens"], cache_leftpad=None,
                        softmax_scale=0.25, window_left=-1, window_right=0, softcap=0.0)
    recorder.clear()
    assert later is not None and later(longer["q"], longer["k_cache"], longer["v_cache"],
                                       longer["seqlens"], None) is not None
    assert {e[0] for e in recorder} == {"plan"}
    buf = torch.randn(first["q"].numel() + 1)
    unaligned = buf[1:].view(first["q"].shape)
    assert bound(unaligned, first["k_cache"], first["v_cache"], first["seqlens"],
                 None) is None


def _engine_inputs(t, device="cpu", dtype=torch.float32):
    """A layer's tensors for the engine's elementwise launchers at t tokens: q/k/v views
    of one fused projection (4 q and 2 kv heads of 16), hidden size 24, MLP width 40."""
    f = dict(device=device, dtype=dtype)
    q, k, v = (x.view(t, -1, 16) for x in torch.randn(t, 128, **f).split([64, 32, 32], -1))
    angles = torch.rand(t, 8, device=device)
    return dict(x=torch.randn(t, 24, **f), res=torch.randn(t, 24, **f),
                w=torch.randn(24, **f), wh=torch.randn(16, **f),
                gate_up=torch.randn(t, 80, **f), q=q, k=k, v=v, cos=angles.cos(),
                sin=angles.sin(), slots=torch.arange(t, device=device) * 3 - 1,
                k_cache=torch.randn(t + 1, 4, 2, 16, **f),  # slots up to 3 t - 1
                v_cache=torch.randn(t + 1, 4, 2, 16, **f))


def _engine_layer(t):
    """Every engine launcher once, each output by name."""
    normed, summed = layernorm.add_rms_norm(t["x"], t["res"], t["w"], 1e-6)
    q_rot, k_rot = rope_store.rope_and_store(t["q"], t["k"], t["v"], t["cos"], t["sin"],
                                             t["slots"], t["k_cache"], t["v_cache"])
    q_free, k_free = rope_store.rope_and_store(t["q"], t["k"], t["v"], t["cos"], t["sin"],
                                               None, None, None)
    return dict(normed=normed, summed=summed, plain=layernorm.rms_norm(t["x"], t["w"], 1e-6),
                q_normed=layernorm.rms_norm(t["q"], t["wh"], 1e-5),
                act=activation.silu_and_mul(t["gate_up"]), q_rot=q_rot, k_rot=k_rot,
                q_free=q_free, k_free=k_free)


def test_plan_engine_elementwise_serves_every_token_count(recorder):
    """The engine's RMSNorm (plain, with the residual, per head over a strided view),
    SiLU-and-multiply and rotary + cache-write launchers (with the pool and without):
    a plan made at one token count serves another, passing each call's row count and
    grid and, for the tensors, exactly what Triton's path is given."""
    sizes = iter([5, 9, 9])  # Triton, plan, Triton again
    _check_plan_matches_triton(recorder, _engine_layer, lambda: _engine_inputs(next(sizes)))


def test_plan_engine_elementwise_is_remade_for_new_layouts(recorder):
    """Triton compiles an unaligned pointer and other strides into other kernels: a
    new launch through Triton each."""
    gate_up = torch.randn(4, 80)
    activation.silu_and_mul(gate_up)
    activation.silu_and_mul(torch.randn(6, 80))
    assert _count(recorder, "triton") == 1 and _count(recorder, "plan") == 1
    activation.silu_and_mul(torch.randn(4 * 80 + 1)[1:].view(4, 80))  # 4 bytes past
    activation.silu_and_mul(torch.randn(4, 96)[:, :80])
    assert _count(recorder, "triton") == 3
    x, w = torch.randn(4, 24), torch.randn(24)
    layernorm.rms_norm(x, w, 1e-6)
    layernorm.rms_norm(torch.randn(4, 32)[:, :24], w, 1e-6)
    layernorm.rms_norm(x, w, 1e-5)  # eps is held in the plan
    assert _count(recorder, "triton") == 6


def _count(recorder, path):
    return sum(e[0] == path for e in recorder)


def test_plan_is_remade_when_alignment_strides_or_options_change(recorder):
    """Triton compiles a 16-byte aligned pointer into another kernel than an unaligned
    one, and bakes strides and flags in: each change is a new launch through Triton."""
    q = torch.randn(1, 20, 2, 16)
    fwd.attn_fwd(q, q, q, **_fwd_kw())
    fwd.attn_fwd(q.clone(), q.clone(), q.clone(), **_fwd_kw())
    assert _count(recorder, "triton") == 1 and _count(recorder, "plan") == 1
    buf = torch.randn(q.numel() + 1)
    unaligned = buf[1:].view(q.shape)  # 4 bytes past an aligned address
    assert unaligned.data_ptr() % 16
    fwd.attn_fwd(unaligned, q, q, **_fwd_kw())
    assert _count(recorder, "triton") == 2
    fwd.attn_fwd(q.transpose(1, 2).contiguous().transpose(1, 2), q, q, **_fwd_kw())
    assert _count(recorder, "triton") == 3
    fwd.attn_fwd(q, q, q, **_fwd_kw(softcap=2.0))
    fwd.attn_fwd(q, q, q, **_fwd_kw(window_left=3))
    assert _count(recorder, "triton") == 5
    fwd.attn_fwd(q, q, q, **_fwd_kw(softcap=5.0, softmax_scale=0.1))  # floats: per call
    assert _count(recorder, "triton") == 5


def test_plans_forget_tiles_when_the_override_changes(recorder):
    q = torch.randn(1, 20, 2, 16)
    fwd.attn_fwd(q, q, q, **_fwd_kw())
    configs.set_override("fwd", configs.TileConfig(16, 16))
    try:
        fwd.attn_fwd(q, q, q, **_fwd_kw())
    finally:
        configs.set_override("fwd", None)
    assert _count(recorder, "triton") == 2
    assert recorder[1][3][fwd._attn_fwd_kernel.arg_names.index("BLOCK_N")] == 16


def keeps_no_tensor(plan) -> bool:
    """A plan holds no call's tensor, nor a descriptor over one (a leak, and memory a
    CUDA graph thinks free)."""
    held = [*plan.template, *(a for _, f in plan.maps for a in getattr(f, "args", ()))]
    return not any(isinstance(x, torch.Tensor) or getattr(x, "base", None) is not None
                   for x in held)


class _FakeUtils:
    """The driver's ``fill_tma_descriptor``: a tuple of its arguments stands for the
    tensor map it encodes."""

    @staticmethod
    def fill_tma_descriptor(ptr, swizzle, elem_size, elem_type, block, shape, strides,
                            padding):
        return ("map", ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape),
                tuple(strides), padding)


class _FakeDriver:
    utils = _FakeUtils()


def _descriptor_kernel(monkeypatch, wrapped):
    """A compiled kernel of five parameters and a constexpr, two of them host tensor
    descriptors, behind Triton's own descriptor wrapper (``wrapped``) or a plain
    launcher; the raw launches land in the returned list."""
    from triton.backends.nvidia import driver as nvidia

    monkeypatch.setattr(triton.runtime.driver, "_active", _FakeDriver())
    received = []

    def raw(*args):
        received.append(args)

    names = ["a_desc", "X", "n", "b_desc", "scale", "FLAG"]
    signature = dict(zip(names, ["tensordesc<bf16[1,64,1,64]>", "*fp32", "i32",
                                 "tensordesc<fp32[64,16]>", "fp32", "constexpr"]))
    metas = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[1, 64, 1, 64],
                  fp4_padded=False),
             dict(swizzle=2, elem_size=4, elem_type=7, block_size=[64, 16],
                  fp4_padded=False)]
    launch = nvidia.wrap_handle_tensordesc(raw, signature, metas) if wrapped else raw

    class Run:
        launch_cooperative_grid = launch_pdl = False
        global_scratch_size = profile_scratch_size = 0

    Run.launch = staticmethod(launch)

    class Compiled:
        packed_metadata = function = None
        run = Run()

    class Kernel:
        arg_names = names

    return Compiled(), Kernel(), launch, received


def _descriptors(a, b):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon import language as gl

    def desc(x, box, dtype):
        return TensorDescriptor(x, list(x.shape), list(x.stride()), box,
                                gl.NVMMASharedLayout.get_default_for(box, dtype))

    return desc(a, [1, 64, 1, 64], gl.bfloat16), desc(b, [64, 16], gl.float32)


@pytest.mark.parametrize("wrapped", [True, False], ids=["tritons-wrapper", "plain"])
def test_plan_encodes_tensor_maps_as_tritons_wrapper(wrapped, monkeypatch):
    """A plan of a kernel that takes host tensor descriptors (the Gluon kernels) takes
    each descriptor slot's tensor and must hand the compiled launcher exactly what
    Triton's wrapper would for descriptors over those tensors: the map encoded from the
    new address, the shape and strides, every other argument in place. Behind Triton
    3.6's wrapper the plan calls the launcher under it; behind anything else it keeps
    the launcher and re-bases the descriptors. Either way it keeps no call's tensor."""
    monkeypatch.setattr(_launch, "_device", lambda: 0)
    monkeypatch.setattr(_launch, "_stream", lambda device: 5)
    compiled, kernel, launch, received = _descriptor_kernel(monkeypatch, wrapped)
    a, b, x = torch.empty(2, 100, 3, 64), torch.empty(64, 48), torch.empty(4)
    first = _descriptors(a, b)
    plan = _launch.make(compiled, kernel, (first[0], x, 7, first[1], 0.5),
                        dict(FLAG=True), (3, 2), ("a_desc", "X", "b_desc", "scale"))
    assert (plan.launch is not launch) == wrapped
    assert keeps_no_tensor(plan)
    a2, b2, x2 = torch.empty_like(a), torch.empty_like(b), torch.empty_like(x)
    plan((a2, x2.data_ptr(), b2, 0.25))
    planned = received.pop()
    head = (None, False, False, None, None, None, None, None, None)
    launch(3, 2, 1, 5, *head, *_descriptors(a2, b2)[:1], x2.data_ptr(), 7,
           _descriptors(a2, b2)[1], 0.25, True)
    through_triton = received.pop()
    assert planned == through_triton
    if wrapped:  # the maps encoded from the new addresses, the shapes and strides after
        assert planned[13][:2] == ("map", a2.data_ptr())
        assert planned[14:22] == (2, 100, 3, 64, 19200, 192, 64, 1)


def test_no_plans_without_cuda():
    """CPU tensors (the interpreter, the torch path) never make or use a plan."""
    assert not _launch.ready(torch.empty(1))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "strided", "unaligned"])
def test_plan_path_equals_triton_path_on_gpu(layout, device):
    """Numbers through a plan equal those through Triton's own path, bit for bit, for
    fresh tensors of each layout, forward and backward."""

    def inputs(seed):
        torch.manual_seed(seed)
        if layout == "unaligned":  # 2 bytes past an aligned address
            buf = torch.randn(3 * 2 * 64 * 4 * 32 + 1, device=device, dtype=torch.float16)
            q, k, v = buf[1:].view(3, 2, 64, 4, 32).unbind(0)
        else:
            q, k, v = (torch.randn(2, 64, 4, 32, device=device, dtype=torch.float16)
                       for _ in range(3))
            if layout == "strided":
                q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        return [x.detach().requires_grad_() for x in (q, k, v)]

    def step(q, k, v):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        out.float().square().sum().backward()
        return out, q.grad, k.grad, v.grad

    _launch.clear()
    step(*inputs(0))  # through Triton: plans made
    planned = step(*inputs(1))
    _launch.clear()
    for a, b in zip(planned, step(*inputs(1))):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_plan_decode_and_varlen_equal_triton_path_on_gpu(paged, device):
    """flash_attn_with_kvcache (append, split decode and combine) and
    flash_attn_varlen_func give the same bits through plans as through Triton's path,
    on fresh tensors and with a max_seqlen the plan was not made with."""
    def run(seed, max_seqlen):
        gen = torch.Generator(device=device).manual_seed(seed)
        f16 = dict(device=device, dtype=torch.float16, generator=gen)
        q = torch.randn(2, 1, 8, 64, **f16)
        k_new, v_new = (torch.randn(2, 1, 2, 64, **f16) for _ in "kv")
        seqlens = torch.tensor([700, 1500], dtype=torch.int32, device=device)
        if paged:
            # 24 pages of 64 per sequence: room for 1501 keys.
            k_cache, v_cache = (torch.randn(50, 64, 2, 64, **f16) for _ in "kv")
            extra = dict(block_table=torch.randperm(50, device=device, generator=gen)[:48]
                         .view(2, 24).to(torch.int32))
        else:
            k_cache, v_cache = (torch.randn(2, 2048, 2, 64, **f16) for _ in "kv")
            extra = {}
        out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                cache_seqlens=seqlens, causal=True,
                                                return_lse=True, **extra)
        qv, kv, vv = (torch.randn(90, 8 if i == 0 else 2, 64, **f16) for i in range(3))
        cu = torch.tensor([0, 30, 90], dtype=torch.int32, device=device)
        varlen = flashtile.flash_attn_varlen_func(qv, kv, vv, cu, cu, max_seqlen,
                                                  max_seqlen, causal=True, return_lse=True)
        return (*out, k_cache, v_cache, *varlen)

    _assert_plans_equal_triton_path(run, (0, 60), (1, 64))


@pytest.mark.parametrize("head_dim", [16, 24])
def test_transformers_decode_steps_follow_a_growing_cache(head_dim, recorder, monkeypatch):
    """transformers' decode memo (integrations.transformers.attention._decode) over a
    DynamicCache: a step's first layer goes through flash_attn_with_kvcache, its later
    layers through the bound plans. At head_dim 16 the cache's strides (S * 16) stay
    multiples of 16: the next steps' first layers, one key longer, skip the validation
    and launch relocated plans. At head_dim 24 they are multiples of 16 at even lengths
    only: each step's first layer is validated again, and after the two first steps
    (one of each parity) its decode finds relocated plans, not Triton's path. Either
    way the plans pass Triton's arguments."""
    hf_attention = pytest.importorskip("flashtile.integrations.transformers.attention")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path
    monkeypatch.delenv("FLASHTILE_BACKEND", raising=False)
    validated = []
    original = flashtile.flash_attn_with_kvcache
    monkeypatch.setattr(flashtile, "flash_attn_with_kvcache",
                        lambda *a, **k: validated.append(a[1].shape[1]) or original(*a, **k))
    monkeypatch.setattr(hf_attention, "_last_decode", [None])
    module = type("Attn", (torch.nn.Module,), {"is_causal": True})()
    q = torch.randn(2, 4, 1, head_dim)

    def layer(keys, seed):
        g = torch.Generator().manual_seed(seed)
        k, v = (torch.randn(2, 2, keys, head_dim, generator=g) for _ in "kv")
        with torch.no_grad():
            hf_attention.attention_forward(module, q, k, v, None, scaling=0.2)
        return k, v

    through_triton = []
    for keys in range(40, 46):
        recorder.clear()
        for seed in range(3):  # three layers a step
            layer(keys, seed)
        assert {e[0] for e in recorder[2:]} == {"plan"}  # the later layers: bound plans
        through_triton.append(_count(recorder, "triton") > 0)
    assert validated == ([40] if head_dim == 16 else list(range(40, 46)))
    assert through_triton == [True] + [head_dim == 24] + [False] * 4
    # The last step's first layer, again: its plans' arguments are Triton's.
    recorder.clear()
    k, v = layer(45, 7)
    plan_log = list(recorder)
    recorder.clear()
    _launch.clear()
    seqlens = torch.full((2,), 45, dtype=torch.int32)
    decode.attn_decode(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       cache_seqlens=seqlens, block_table=None, cache_batch_idx=None,
                       cache_leftpad=None, alibi_slopes=None, softmax_scale=0.2,
                       window_left=-1, window_right=0, softcap=0.0, num_splits=0,
                       allow_tf32=False, return_lse=False)
    assert {e[0] for e in plan_log} == {"plan"} and {e[0] for e in recorder} == {"triton"}
    assert [e[1] for e in plan_log] == [e[1] for e in recorder]
    for p, t in zip(plan_log, recorder):  # past the tensors (addresses: per call)
        assert p[3][13:] == t[3][13:], p[1]


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_plan_of_a_growing_cache_equals_triton_path_on_gpu(num_splits, device):
    """A decode over a cache one key longer than the last (transformers' layout, read
    transposed) through the relocated plans, and through decode.bind's launch, gives
    Triton's bits; fresh tensors each call."""
    def run(seed, keys):
        gen = torch.Generator(device=device).manual_seed(seed)
        f16 = dict(device=device, dtype=torch.float16, generator=gen)
        q = torch.randn(3, 1, 8, 64, **f16)
        k, v = (torch.randn(3, 2, keys, 64, **f16).transpose(1, 2) for _ in "kv")
        seqlens = torch.tensor([keys, keys - 5, 1], dtype=torch.int32, device=device)
        kw = dict(cache_seqlens=seqlens, block_table=None, cache_batch_idx=None,
                  cache_leftpad=None, alibi_slopes=None, softmax_scale=0.125,
                  window_left=-1, window_right=0, softcap=0.0)
        out = decode.attn_decode(q, k, v, **kw, num_splits=num_splits, allow_tf32=False,
                                 return_lse=False)[0]
        if num_splits:
            return (out,)
        bound = decode.bind(q, k, v, cache_seqlens=seqlens, cache_leftpad=None,
                            softmax_scale=0.125, window_left=-1, window_right=0,
                            softcap=0.0)
        again = out if bound is None else bound(q, k, v, seqlens, None)
        assert again is not None and (bound is not None) == _launch._enabled["on"]
        return out, again

    _assert_plans_equal_triton_path(run, (0, 1000), (1, 1001))


def _assert_plans_equal_triton_path(run, first, again):
    """run(*first) through Triton makes the plans; run(*again) through them gives the
    bits Triton's path gives for the same arguments."""
    _launch.clear()
    run(*first)
    planned = run(*again)
    previous = _launch.set_enabled(False)
    try:
        for a, b in zip(planned, run(*again)):
            assert torch.equal(a, b)
    finally:
        _launch.set_enabled(previous)


@pytest.mark.gpu
def test_plan_engine_elementwise_equals_triton_path_on_gpu(device):
    """The engine's elementwise launchers give the same bits through plans as through
    Triton's path, on fresh tensors of another token count than the plans were made
    with (the pool writes included)."""
    def run(seed, t):
        torch.manual_seed(seed)
        inputs = _engine_inputs(t, device, torch.bfloat16)
        out = _engine_layer(inputs)
        return (*out.values(), inputs["k_cache"], inputs["v_cache"])

    _assert_plans_equal_triton_path(run, (0, 5), (1, 300))


def test_fp32_precision_switch(monkeypatch):
    """FLASHTILE_FP32_PRECISION picks the fp32 products when TF32 is off ("tf32x3" by
    default, "ieee" on request; anything else is refused), and the tile table: IEEE
    products take the spill-free IEEE tables, tf32x3 its own forward table and the fp32
    backward tables, TF32 the fp32 ones."""
    import torch

    from flashtile.ops import configs
    q = torch.empty(1, 8, 2, 128, dtype=torch.float32, device="meta")
    flags = lambda tf32: configs.feature_args(None, None, q, window_left=-1, window_right=-1,
                                              softcap=0.0, allow_tf32=tf32,
                                              head_dim=128)[4]["INPUT_PRECISION"]
    monkeypatch.delenv("FLASHTILE_FP32_PRECISION", raising=False)
    assert flags(False) == "tf32x3" and flags(True) == "tf32"
    monkeypatch.setenv("FLASHTILE_FP32_PRECISION", "ieee")
    assert flags(False) == "ieee" and flags(True) == "tf32"
    monkeypatch.setenv("FLASHTILE_FP32_PRECISION", "fast")
    with pytest.raises(ValueError, match="FLASHTILE_FP32_PRECISION"):
        flags(False)
    assert configs.fwd_config(q, 128, products="ieee") == configs._FWD_IEEE[128]
    assert configs.fwd_config(q, 128, products="tf32") == configs._FWD_32BIT[128]
    assert configs.fwd_config(q, 64, products="tf32x3") == configs._FWD_TF32X3[64]
    assert configs._FWD_TF32X3[64] != configs._FWD_32BIT[64]
    assert configs.bwd_dq_config(q, 128, products="tf32x3") == configs._BWD_32BIT[128]
    assert configs.bwd_dq_config(q, 128, products="ieee") == configs._BWD_DQ_IEEE[128]
    assert (configs.bwd_dq_config(q.half(), 128, products="ieee")
            == configs._BWD_DQ_16BIT[128])
