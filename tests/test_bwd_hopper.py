"""The Gluon Hopper backward (flashtile/ops/bwd_hopper.py) against the float64 oracle.

GPU (``--gpu`` on an sm_90 device): dq, dk, dv against autograd through
``attention_naive`` in float64 with the rule every backward test uses (tests/utils.py),
over head dims 64, 128 and 256 (bwd_hopper256's kernel, launched by bwd_hopper.backward),
full and causal (bottom-right and top-left), GQA/MQA, lengths off the tile sizes,
seqlen_q != seqlen_k, batch > 1, a gradient of lse (dlse); rows that see no key get zero
gradients; a NaN reaches the gradients it touches; the FLASHTILE_HOPPER_BWD switch through
flash_attn_func (deterministic=True keeps the portable backward). CPU: which calls the
kernel declines, and the switch's dispatch with the kernel replaced by a fake. Test names
with "hopper_bwd" are the memcheck slice (Makefile MEMCHECK_K).
"""

import pytest
import torch

import flashtile
from flashtile import custom_ops
from flashtile.ops import configs
from flashtile.reference import allowed_keys
from tests.utils import assert_close_rule, reference_pair

bwd_hopper = pytest.importorskip("flashtile.ops.bwd_hopper")  # Gluon: triton >= 3.6
# The forward's GPU marker (sm_90, a 60 s limit against a deadlock) and arguments.
from tests.test_fwd_hopper import MASKS, SHAPES, _kw, on_hopper  # noqa: E402
from tests.test_fwd_hopper import _inputs as _qkv  # noqa: E402


def _inputs(b, sq, sk, h, hkv, d, dtype, device="cuda"):
    """q, k, v as the forward's tests draw them, and dout."""
    return (*_qkv(b, sq, sk, h, hkv, d, dtype, device),
            torch.randn(b, sq, h, d, dtype=dtype, device=device))


def _backward(q, k, v, dout, causal, diag_offset, scale, dlse=None):
    """The portable forward's out and lse, then the Gluon backward."""
    from flashtile.ops import fwd

    out, lse = fwd.attn_fwd(q, k, v, **_kw(causal, diag_offset, scale))
    assert bwd_hopper.unsupported(q, k, v, out, dout, softmax_scale=scale) is None
    return bwd_hopper.backward(dout, q, k, v, out, lse, dlse, scale, diag_offset, causal)


# bwd_hopper's head dims (96 in 128's tile), and bwd_hopper256's.
HEAD_DIMS = [64, 96, 128, 256]


def _check(grads, q, k, v, dout, causal, diag_offset, scale, dlse=None):
    (_, _, g64), (_, _, g_pt) = reference_pair(q, k, v, dout, dlse, softmax_scale=scale,
                                               causal=causal, diag_offset=diag_offset)
    for name, g, x, r, p in zip(("dq", "dk", "dv"), grads, (q, k, v), g64, g_pt):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_close_rule(name, g, r, p)


# The forward tests' shapes (lengths off the 64-row and 128-key tiles, one query row,
# seqlen_q > seqlen_k, GQA and MQA, a walk that turns the Q/dO ring over many times) and
# masks (full, causal bottom-right and top-left).
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}".format(*s))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@on_hopper
def test_matches_float64_reference(dtype, head_dim, shape, mask):
    b, sq, sk, h, hkv = shape
    causal, align = MASKS[mask]
    diag_offset = sk - sq if align == "bottom_right" else 0
    q, k, v, dout = _inputs(b, sq, sk, h, hkv, head_dim, dtype)
    scale = head_dim ** -0.5
    grads = _backward(q, k, v, dout, causal, diag_offset, scale)
    _check(grads, q, k, v, dout, causal, diag_offset, scale)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@on_hopper
def test_hopper_bwd_wider_tile_reads_and_writes_only_head_dim(causal):
    """d96 in d128's tile: q, k, v and dout as the first 96 columns of 128-wide tensors
    whose other 32 hold NaN (inside the boxes, outside the tensor maps: read as zeros),
    GQA, ragged lengths; dk and dv stored in their own 96 columns (memcheck), twice (the
    second call through the launch plans)."""
    for _ in range(2):
        wide = torch.randn(4, 2, 300, 4, 128, dtype=torch.bfloat16, device="cuda")
        wide[..., 96:] = float("nan")
        q, dout = wide[0, ..., :96], wide[1, ..., :96]
        k, v = wide[2, :, :200, :2, :96], wide[3, :, :200, :2, :96]
        grads = _backward(q, k, v, dout, causal, -100, 0.3)
        _check(grads, q, k, v, dout, causal, -100, 0.3)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@on_hopper
def test_hopper_bwd_small(head_dim):
    """The memcheck slice: GQA, causal with seqlen_q > seqlen_k (empty rows), ragged
    lengths, a dlse (the gradient of the lse output), a scale != 1/sqrt(d)."""
    q, k, v, dout = _inputs(2, 77, 45, 4, 2, head_dim, torch.bfloat16)
    dlse = torch.randn(2, 4, 77, device="cuda")
    grads = _backward(q, k, v, dout, True, 45 - 77, 0.3, dlse)
    _check(grads, q, k, v, dout, True, 45 - 77, 0.3, dlse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [128, 256])
@on_hopper
def test_launch_plan_equals_tritons_path(head_dim, causal):
    """After a layout's first call, launch plans run the three kernels over fresh tensors
    (new addresses in the six tensor maps) with another softmax_scale and a dlse: dk and
    dv are the bits of Triton's own path (no atomics there), dq meets the rule (its
    atomics add in another order each run), and the plans keep no call's tensor alive."""
    from flashtile.ops import _launch
    from tests.test_launch_plans import keeps_no_tensor

    def call(seed, scale):
        torch.manual_seed(seed)
        q, k, v, dout = _inputs(2, 300, 333, 4, 2, head_dim, torch.bfloat16)
        dlse = torch.randn(2, 4, 300, device="cuda")
        return _backward(q, k, v, dout, causal, 33, scale, dlse), (q, k, v, dout, dlse)

    _launch.clear()
    call(0, 0.1)  # Triton's path, then the plans are stored
    grads, (q, k, v, dout, dlse) = call(1, 0.2)  # the plans
    stored = [p for p in _launch._plans.values() if isinstance(p, tuple) and len(p) == 6]
    assert len(stored) == 1  # (pre, main, convert, dq_tma, lse_smem, pad)
    assert all(map(keeps_no_tensor, stored[0][:3]))
    _check(grads, q, k, v, dout, causal, 33, 0.2, dlse)
    _launch.clear()
    again, _ = call(1, 0.2)
    assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2])


@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("split", [1, 2, 4])
@on_hopper
def test_gqa_head_split_matches_float64_reference(split, head_dim, mask, monkeypatch):
    """A GQA group of 4 query heads walked by 1, 2 or 4 programs per (key block, KV
    head), their dK and dV shares summed: the float64 reference's gradients."""
    from flashtile.ops import _launch

    monkeypatch.setattr(bwd_hopper, "head_split", lambda group, programs, sms: split)
    _launch.clear()  # a plan of another split
    try:
        q, k, v, dout = _inputs(2, 700, 900, 8, 2, head_dim, torch.bfloat16)
        causal = mask == "causal"
        grads = _backward(q, k, v, dout, causal, 200, 0.1)
        _check(grads, q, k, v, dout, causal, 200, 0.1)
    finally:
        _launch.clear()


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
@on_hopper
def test_hopper_bwd_lse_smem_edges(head_dim, split, monkeypatch):
    """lse_smem (lse and delta from (batch * nheads, seqlen_q) tensor maps, rows past
    seqlen_q, zeros from the map, masked in the consumers): empty rows (bottom-right
    causal, seqlen_q > seqlen_k) get zero dq, never NaN; the GQA head split; an lse
    handed over at an address that is not 16-byte aligned (copied for the tensor map)
    gives the same bits as an aligned one, through Triton's path and the launch plan."""
    from flashtile.ops import _launch, fwd

    monkeypatch.setenv("FLASHTILE_HOPPER_BWD_OPTS", "lse_smem,dq_tma")
    monkeypatch.setattr(bwd_hopper, "head_split", lambda group, programs, sms: split)
    _launch.clear()
    try:
        q, k, v, dout = _inputs(2, 300, 100, 4, 2, head_dim, torch.bfloat16)
        scale = head_dim ** -0.5
        out, lse = fwd.attn_fwd(q, k, v, **_kw(True, 100 - 300, scale))
        grads = bwd_hopper.backward(dout, q, k, v, out, lse, None, scale, 100 - 300, True)
        assert (grads[0][:, :200] == 0).all()
        _check(grads, q, k, v, dout, True, 100 - 300, scale)
        shifted = torch.empty(lse.numel() + 1, device="cuda")[1:].view(lse.shape)
        shifted.copy_(lse)
        assert shifted.data_ptr() % 16 != 0
        for _ in range(2):  # Triton's path (a new layout key), then its plan
            again = bwd_hopper.backward(dout, q, k, v, out, shifted, None, scale, 100 - 300,
                                        True)
            assert torch.equal(again[1], grads[1]) and torch.equal(again[2], grads[2])
            _check(again, q, k, v, dout, True, 100 - 300, scale)
    finally:
        _launch.clear()


@pytest.mark.parametrize("head_dim", [128, 256])
@on_hopper
def test_empty_rows_get_zero_gradients(head_dim):
    """Bottom-right causal with seqlen_q > seqlen_k: the first 200 rows see no key (lse
    -inf); their dq is exactly 0, never NaN, and they add nothing to dk and dv."""
    q, k, v, dout = _inputs(1, 300, 100, 2, 2, head_dim, torch.bfloat16)
    dq, dk, dv = _backward(q, k, v, dout, True, 100 - 300, head_dim ** -0.5)
    assert (dq[:, :200] == 0).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    _check((dq, dk, dv), q, k, v, dout, True, 100 - 300, head_dim ** -0.5)


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("head_dim", [64, 256])
@on_hopper
def test_nan_reaches_its_gradients(head_dim, where):
    """As tests/test_nan.py asks of every backward: the gradients a NaN reaches are NaN,
    those of the other head stay finite; dv does not depend on v."""
    sq, sk, key = 200, 300, 290
    q, k, v, dout = _inputs(1, sq, sk, 2, 2, head_dim, torch.bfloat16)
    ok = allowed_keys(sq, sk, sk - sq, -1, 0, q.device)
    seen_key = ok[:, key]
    row = int(seen_key.nonzero()[0])
    {"q": q, "k": k, "v": v}[where][0, row if where == "q" else key, 0, 3] = float("nan")
    dq, dk, dv = _backward(q, k, v, dout, True, sk - sq, head_dim ** -0.5)
    for g in (dq, dk, dv):
        assert torch.isfinite(g[0, :, 1]).all()
    rows = torch.arange(sq, device=q.device)
    nan_rows = seen_key.clone() if where != "q" else rows == row
    assert torch.isnan(dq[0, nan_rows, 0]).all() and torch.isnan(dk[0, key, 0]).all()
    if where == "v":
        assert torch.isfinite(dv).all()
    else:
        assert torch.isnan(dv[0, ok[nan_rows].any(0), 0]).all()


@on_hopper
def test_switch_dispatches_through_flash_attn_func(monkeypatch):
    """FLASHTILE_HOPPER_BWD=1: flash_attn_func's backward runs the Gluon kernel where it
    supports the call (head_dim 128) and meets the gradient rule; deterministic=True and
    head_dim 80 keep the portable backward."""
    calls = []
    real = bwd_hopper.backward
    monkeypatch.setattr(bwd_hopper, "backward",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("FLASHTILE_HOPPER_BWD", "1")
    q, k, v, dout = _inputs(2, 333, 555, 4, 2, 128, torch.bfloat16)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = flashtile.flash_attn_func(qg, kg, vg, causal=True)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    assert calls == [1]
    (_, _, g64), (_, _, g_pt) = reference_pair(q, k, v, dout, causal=True)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close_rule(name, g, r, p)
    out = flashtile.flash_attn_func(qg, kg, vg, causal=True, deterministic=True)
    torch.autograd.grad(out, (qg, kg, vg), dout)
    q80 = torch.randn(1, 64, 2, 80, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    torch.autograd.grad(flashtile.flash_attn_func(q80, q80, q80).sum(), q80)
    assert calls == [1]


@on_hopper
def test_switch_sends_head_dim_256_under_1_and_auto(monkeypatch):
    """Head dim 256 through flash_attn_func: FLASHTILE_HOPPER_BWD=1 and auto (at 1.1k
    tokens) run bwd_hopper256's kernel and meet the gradient rule (GQA, causal)."""
    calls = []
    real = bwd_hopper.backward
    monkeypatch.setattr(bwd_hopper, "backward",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, dout = _inputs(1, 1100, 1030, 4, 2, 256, torch.bfloat16)
    (_, _, g64), (_, _, g_pt) = reference_pair(q, k, v, dout, causal=True)
    for mode, sent in (("1", [1]), ("auto", [1, 1])):  # the calls so far
        monkeypatch.setenv("FLASHTILE_HOPPER_BWD", mode)
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = flashtile.flash_attn_func(qg, kg, vg, causal=True)
        grads = torch.autograd.grad(out, (qg, kg, vg), dout)
        assert calls == sent, mode
        for name, g, r, p in zip(("dq", "dk", "dv"), grads, g64, g_pt):
            assert_close_rule(name, g, r, p)


# The schedule options (FLASHTILE_HOPPER_BWD_OPTS, bwd_hopper's docstring) the GPU A/B
# times, alone and as timed together; tests/test_gluon_compile.py checks their SASS.
OPTS = ["none", "lse_ahead", "lse_ahead,dq_tma", "lse_smem,dq_tma", "lse_smem",
        "lse_smem,dq_tma,ds_ring", "lse_ahead,ds_ring", "lse_smem,dq_tma,ds_ring,lpt",
        "lse_smem,dq_tma,ds_ring,skip_masked", "lse_ahead,skip_masked",
        "lse_smem,dq_tma,ds_ring,lse_pre", "lse_smem,dq_tma,ds_ring,skip_masked,lse_pre"]
# 128 query rows a block at head_dim 64 (FLASHTILE_HOPPER_BWD_CONFIG; session 14's
# tile A/B): the block's whole (128, 64) dQ tiles through the reduce-adds.
BLOCK_M_128_CASES = [(64, "lse_ahead,dq_tma", "128,128,4,2")]
def _split_env(opts, config):
    env = {"FLASHTILE_HOPPER_BWD_OPTS": opts}
    if config is not None:
        env["FLASHTILE_HOPPER_BWD_CONFIG"] = config
    return env


def _backward_twice(env, head_dim, causal, diag_offset, monkeypatch,
                    shape=(2, 333, 300, 4, 2)):
    """Under the environment ``env``: Triton's path, then the launch plan on fresh inputs with a dlse and a scale != 1/sqrt(d);
    both meet the rule. Plans made under ``env`` are dropped afterwards."""
    from flashtile.ops import _launch

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _launch.clear()
    try:
        for seed in (0, 1):
            torch.manual_seed(seed)
            q, k, v, dout = _inputs(*shape, head_dim, torch.bfloat16)
            dlse = torch.randn(shape[0], shape[3], shape[1], device="cuda")
            grads = _backward(q, k, v, dout, causal, diag_offset, 0.3, dlse)
            _check(grads, q, k, v, dout, causal, diag_offset, 0.3, dlse)
    finally:
        _launch.clear()


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("opts", OPTS)
@on_hopper
def test_options_match_float64_reference(opts, head_dim, mask, monkeypatch):
    """GQA, seqlen_q (333; 332 under lse_smem without lse_pre: a multiple of 4) off the
    64-row blocks: the atomics and reduce-adds of the rows past it are dropped;
    seqlen_q > seqlen_k, so bottom-right causal has rows that see no key; many query
    blocks, so the dQ hand-off (dS^T's buffer) turns over many times between the two
    consumers."""
    causal, align = MASKS[mask]
    sq = 332 if "lse_smem" in opts and "lse_pre" not in opts else 333
    diag_offset = 300 - sq if align == "bottom_right" else 0
    _backward_twice({"FLASHTILE_HOPPER_BWD_OPTS": opts}, head_dim, causal, diag_offset,
                    monkeypatch, shape=(2, sq, 300, 4, 2))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("opts", OPTS)
@on_hopper
def test_hopper_bwd_options_small(opts, head_dim, monkeypatch):
    """The memcheck slice of the options: test_hopper_bwd_small's call (76 query rows
    under lse_smem without lse_pre, which needs a multiple of 4; 77 runs it as
    lse_ahead, or as lse_smem with lse_pre)."""
    sq = 76 if "lse_smem" in opts and "lse_pre" not in opts else 77
    _backward_twice({"FLASHTILE_HOPPER_BWD_OPTS": opts}, head_dim, True, 45 - sq,
                    monkeypatch, shape=(2, sq, 45, 4, 2))


# bwd_hopper256's dQ paths (its docstring): TMA reduce-adds through tiles in the block's
# Q and dO buffers (dq_tma, in the default) and relaxed atomics (options without it; the
# others do not apply at head_dim 256).
D256_OPTS = ["lse_ahead,dq_tma", "lse_ahead", "dq_tma,lpt"]


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("opts", D256_OPTS)
@on_hopper
def test_d256_dq_paths_match_float64_reference(opts, mask, monkeypatch):
    """test_options_match_float64_reference's calls at head_dim 256: GQA with the heads
    split (two programs a KV head: each writes dQ of its own query heads), the rows past
    seqlen_q dropped, many query blocks, so each stage of the Q/dO ring holds dQ tiles
    and is reloaded many times over (dq_tma)."""
    causal, align = MASKS[mask]
    diag_offset = 300 - 333 if align == "bottom_right" else 0
    _backward_twice({"FLASHTILE_HOPPER_BWD_OPTS": opts}, 256, causal, diag_offset,
                    monkeypatch)


@pytest.mark.parametrize("opts", D256_OPTS)
@on_hopper
def test_hopper_bwd_d256_dq_paths_small(opts, monkeypatch):
    """The memcheck slice of bwd_hopper256's dQ paths: test_hopper_bwd_small's call."""
    _backward_twice({"FLASHTILE_HOPPER_BWD_OPTS": opts}, 256, True, 45 - 77, monkeypatch,
                    shape=(2, 77, 45, 4, 2))


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim,opts,config", BLOCK_M_128_CASES, ids=lambda x: str(x))
@on_hopper
def test_block_m_128_matches_float64_reference(head_dim, opts, config, mask, monkeypatch):
    """128 query rows a block: test_options_match_float64_reference's calls."""
    causal, align = MASKS[mask]
    diag_offset = 300 - 333 if align == "bottom_right" else 0
    _backward_twice(_split_env(opts, config), head_dim, causal, diag_offset, monkeypatch)


@pytest.mark.parametrize("head_dim,opts,config", BLOCK_M_128_CASES, ids=lambda x: str(x))
@on_hopper
def test_hopper_bwd_block_m_128_small(head_dim, opts, config, monkeypatch):
    """The memcheck slice of 128 rows a block: test_hopper_bwd_small's call."""
    _backward_twice(_split_env(opts, config), head_dim, True, 45 - 77, monkeypatch,
                    shape=(2, 77, 45, 4, 2))


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@on_hopper
def test_stages_match_float64_reference(stages, head_dim, monkeypatch):
    """The STAGES sweep of the A/B (FLASHTILE_HOPPER_BWD_CONFIG): a deeper Q/dO ring,
    with the default's options where they fit shared memory, else (head_dim 128, whose
    three stages beside dq_tma's tiles do not) with the atomics' lse_ahead, after the
    default refused with check_fits' error instead of a compile error."""
    env = {"FLASHTILE_HOPPER_BWD_CONFIG": f"64,128,4,{stages}"}
    flags = bwd_hopper.kernel_flags(head_dim, True, configs.HOPPER_BWD_DEFAULT_OPTS, 64)
    if bwd_hopper.smem_bytes(head_dim, 64, stages, flags) > configs.SM90_SMEM_BYTES:
        with pytest.raises(ValueError, match=r"needs \d+ bytes of shared memory"):
            _backward_twice(env, head_dim, True, 0, monkeypatch)
        env["FLASHTILE_HOPPER_BWD_OPTS"] = "lse_ahead"
    _backward_twice(env, head_dim, True, 0, monkeypatch)


def test_oversized_configs_are_refused():
    """check_fits: a STAGES / options pair past a Hopper program's shared memory is a
    ValueError naming both knobs and the bytes (no GPU needed); the table's tiles fit
    with the default options, and the deeper rings the A/B sweeps fit without dq_tma."""
    default = configs.HOPPER_BWD_DEFAULT_OPTS
    for head_dim, cfg in configs.HOPPER_BWD_16BIT.items():
        bwd_hopper.check_fits(head_dim, cfg, bwd_hopper.kernel_flags(head_dim, True,
                                                                     default, cfg.block_m))
    three = configs.TileConfig(64, 128, 4, 3)
    for head_dim in (64, 128):
        bwd_hopper.check_fits(head_dim, three, bwd_hopper.kernel_flags(
            head_dim, True, frozenset({"lse_ahead"}), 64))
    with pytest.raises(ValueError, match=r"FLASHTILE_HOPPER_BWD_CONFIG=64,128,4,3 with "
                       r"FLASHTILE_HOPPER_BWD_OPTS=dq_tma,ds_ring,lse_smem at head_dim 128 "
                       r"needs 263680 bytes of shared memory, more than the 232448"):
        bwd_hopper.check_fits(128, three, bwd_hopper.kernel_flags(128, False, default, 64))


def test_options_knob(monkeypatch):
    """FLASHTILE_HOPPER_BWD_OPTS: a comma-separated subset of the options (spaces and
    empty items ignored; "none": none; unset: the default, lse_smem, dq_tma, ds_ring and
    lse_pre), each one constexpr of the kernel; anything else is a ValueError naming the
    variable, the choices and the unknown items."""
    monkeypatch.delenv("FLASHTILE_HOPPER_BWD_OPTS", raising=False)
    assert configs.hopper_bwd_opts() == {"lse_smem", "dq_tma", "ds_ring", "lse_pre"} \
        == configs.HOPPER_BWD_DEFAULT_OPTS == configs.hopper_bwd_opts(64) \
        == configs.hopper_bwd_opts(256)
    # head_dim 128's tile (and 96's, which runs in it) adds skip_masked (session 33).
    assert configs.hopper_bwd_opts(128) == {"lse_smem", "dq_tma", "ds_ring", "lse_pre",
                                            "skip_masked"}
    # head_dim 256: dq_tma by default too (bwd_hopper256 takes it alone).
    assert bwd_hopper.kernel_flags(256, True, configs.hopper_bwd_opts(), 64) \
        == dict(IS_CAUSAL=True, DQ_TMA=True, LPT=False)
    flags = bwd_hopper.kernel_flags(128, True, configs.hopper_bwd_opts(), 64)
    assert flags == dict(IS_CAUSAL=True, LSE_AHEAD=False, DQ_TMA=True, LSE_SMEM=2,
                         DS_RING=True, LPT=False, SKIP_MASKED=False)
    # lse_pre's rows padded to whole blocks suit every seqlen_q (301: not a multiple of 4).
    flags = bwd_hopper.kernel_flags(128, True, configs.hopper_bwd_opts(), 64, 301)
    assert flags == dict(IS_CAUSAL=True, LSE_AHEAD=False, DQ_TMA=True, LSE_SMEM=2,
                         DS_RING=True, LPT=False, SKIP_MASKED=False)
    # Without it, lse_ahead where lse_smem cannot run.
    flags = bwd_hopper.kernel_flags(128, True, frozenset({"lse_smem", "dq_tma", "ds_ring"}),
                                    64, 301)
    assert flags == dict(IS_CAUSAL=True, LSE_AHEAD=True, DQ_TMA=True, LSE_SMEM=False,
                         DS_RING=True, LPT=False, SKIP_MASKED=False)
    for none in ("none", " none ,", ""):
        monkeypatch.setenv("FLASHTILE_HOPPER_BWD_OPTS", none)
        assert configs.hopper_bwd_opts() == frozenset()
    flags = bwd_hopper.kernel_flags(128, True, frozenset(), 64)
    assert not any(v for k, v in flags.items() if k != "IS_CAUSAL")
    monkeypatch.setenv("FLASHTILE_HOPPER_BWD_OPTS", " ds_ring, dq_tma ,")
    assert configs.hopper_bwd_opts() == {"ds_ring", "dq_tma"}
    flags = bwd_hopper.kernel_flags(64, False, configs.hopper_bwd_opts(), 64)
    assert flags == dict(IS_CAUSAL=False, LSE_AHEAD=False, DQ_TMA=True, LSE_SMEM=False,
                         DS_RING=True, LPT=False, SKIP_MASKED=False)
    # lse_smem brings lse and delta with Q and dO: lse_ahead has nothing left to do.
    flags = bwd_hopper.kernel_flags(64, False, frozenset({"lse_ahead", "lse_smem"}), 64)
    assert flags["LSE_SMEM"] and not flags["LSE_AHEAD"]
    # ... where seqlen_q is a multiple of 4: a TMA load's innermost coordinate must fall
    # on 16 bytes. Other lengths run lse_ahead.
    for sq, smem in ((300, True), (301, False), (302, False), (64, True), (60, False)):
        flags = bwd_hopper.kernel_flags(64, False, frozenset({"lse_smem", "dq_tma"}), 64, sq)
        assert (flags["LSE_SMEM"], flags["LSE_AHEAD"], flags["DQ_TMA"]) == (smem, not smem,
                                                                           True)
    monkeypatch.setenv("FLASHTILE_HOPPER_BWD_OPTS", "lse_ahead,dq_tma")
    flags = bwd_hopper.kernel_flags(128, True, configs.hopper_bwd_opts(), 64)
    assert flags["DQ_TMA"] and flags["LSE_AHEAD"] and not flags["LSE_SMEM"]
    # dq_split (session 28), pipe (session 29) and sdp (session 31) were removed, their
    # A/Bs lost: now unknown options.
    for gone in ("dq_split", "pipe", "sdp"):
        monkeypatch.setenv("FLASHTILE_HOPPER_BWD_OPTS", f"lse_ahead,{gone}")
        with pytest.raises(ValueError, match=rf"\(unknown: \['{gone}'\]\)"):
            configs.hopper_bwd_opts()
    # bwd_hopper256 takes dq_tma alone (the default's lse_ahead is passed over there).
    assert bwd_hopper.kernel_flags(256, True, configs.HOPPER_BWD_DEFAULT_OPTS, 64) \
        == dict(IS_CAUSAL=True, DQ_TMA=True, LPT=False)
    assert bwd_hopper.kernel_flags(256, False, frozenset({"lse_ahead", "ds_ring"}), 64) \
        == dict(IS_CAUSAL=False, DQ_TMA=False, LPT=False)
    monkeypatch.setenv("FLASHTILE_HOPPER_BWD_OPTS", "lse_ahead")
    assert bwd_hopper.kernel_flags(256, False, configs.hopper_bwd_opts(), 64) \
        == dict(IS_CAUSAL=False, DQ_TMA=False, LPT=False)
    monkeypatch.setenv("FLASHTILE_HOPPER_BWD_OPTS", "ds_ring,pingpong")
    with pytest.raises(ValueError, match=r"FLASHTILE_HOPPER_BWD_OPTS must be 'none' or a "
                       r"comma-separated subset of .*'lse_pre'\), got "
                       r"'ds_ring,pingpong' "
                       r"\(unknown: \['pingpong'\]\)"):
        configs.hopper_bwd_opts()


@pytest.mark.parametrize("seqlen_q", [1, 37, 64, 130])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", [64, 128])
@on_hopper
def test_lse_pre_at_any_seqlen_q(seqlen_q, mask, head_dim, monkeypatch):
    """lse_pre runs lse_smem's row maps at lengths lse_smem alone gives way at (under a
    block, not a multiple of 4): one query row, a ragged block, whole ones; the float64
    rule, Triton's path and the plan's."""
    causal, align = MASKS[mask]
    diag_offset = 45 - seqlen_q if align == "bottom_right" else 0
    _backward_twice({"FLASHTILE_HOPPER_BWD_OPTS": "lse_smem,dq_tma,ds_ring,lse_pre"},
                    head_dim, causal, diag_offset, monkeypatch,
                    shape=(2, seqlen_q, 45, 4, 2))


def test_lse_pre_flag(monkeypatch):
    """lse_pre: LSE_SMEM 2 with lse_smem (not alone; not at head_dim 256), at every
    seqlen_q: its padded rows suit the row maps where lse_smem alone gives way to
    lse_ahead (seqlen_q not a multiple of 4, or under a block)."""
    opts = frozenset({"lse_smem", "dq_tma", "ds_ring", "lse_pre"})
    assert bwd_hopper.kernel_flags(64, True, opts, 64)["LSE_SMEM"] == 2
    for seqlen_q in (332, 333, 60, 1):
        assert bwd_hopper.kernel_flags(128, False, opts, 64, seqlen_q)["LSE_SMEM"] == 2
        without = bwd_hopper.kernel_flags(128, False, opts - {"lse_pre"}, 64, seqlen_q)
        assert without["LSE_SMEM"] is (seqlen_q == 332)
        assert without["LSE_AHEAD"] is (seqlen_q != 332)
    assert bwd_hopper.kernel_flags(64, True, opts - {"lse_smem"}, 64)["LSE_SMEM"] is False
    assert bwd_hopper.kernel_flags(64, True, opts - {"lse_pre"}, 64)["LSE_SMEM"] is True
    assert "LSE_SMEM" not in bwd_hopper.kernel_flags(256, True, opts, 64)
    monkeypatch.setenv("FLASHTILE_HOPPER_BWD_OPTS", "lse_smem,lse_pre")
    assert configs.hopper_bwd_opts() == {"lse_smem", "lse_pre"}


@pytest.mark.parametrize("seqlen_q,rows_pad", [(1, 64), (76, 128), (128, 128), (333, 384)])
@pytest.mark.parametrize("dlse", [False, True])
def test_preprocess_writes_lse_pre_rows(seqlen_q, rows_pad, dlse):
    """The portable preprocess with LSE2 (lse_pre; CPU, in the interpreter where CI runs
    it): delta = rowsum(dO * O) - dlse and lse * log2(e) (+inf where lse is -inf) in
    (batch, nheads, rows_pad) rows, the padding delta 0 and lse2 +inf; dQ's accumulator
    zeroed."""
    from flashtile.ops import bwd

    b, h, d = 2, 3, 64
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out, dout = (torch.randn(b, seqlen_q, h, d, device=dev) for _ in "od")
    lse = torch.randn(b, h, seqlen_q, device=dev) * 4
    lse[0, 1, 0] = float("-inf")  # a row that saw no key
    dl = torch.randn(b, h, seqlen_q, device=dev) if dlse else lse
    both = torch.full((2, b, h, rows_pad), float("nan"), device=dev)
    delta, lse2 = both[0], both[1]
    acc = torch.full((b, h, seqlen_q, d), float("nan"), device=dev)
    pre_m = configs.PREPROCESS_BLOCK_M
    grid = (configs.cdiv(rows_pad, pre_m), b * h)
    bwd._bwd_preprocess_kernel[grid](
        out, dout, dl, delta, acc, lse, lse2, *configs.strides(False, out, dout),
        *acc.stride()[:2], h, seqlen_q, d, rows_pad, BLOCK_M=pre_m, BLOCK_D=d,
        BLOCK_DV=d, HAS_DLSE=dlse, ZERO_DQ=True, LSE2=True)
    want = (out.double() * dout.double()).sum(-1).transpose(1, 2)
    if dlse:
        want = want - dl.double()
    torch.testing.assert_close(delta[..., :seqlen_q].double(), want, rtol=1e-5, atol=1e-5)
    want2 = torch.where(lse == float("-inf"), float("inf"), lse.double() * 1.4426950408889634)
    torch.testing.assert_close(lse2[..., :seqlen_q].double(), want2, rtol=1e-6, atol=1e-6)
    assert (delta[..., seqlen_q:] == 0).all()
    assert (lse2[..., seqlen_q:] == float("inf")).all()
    assert (acc == 0).all()


def test_skip_masked_is_causal_only(monkeypatch):
    """skip_masked: a causal walk's first query block, which no row of sees the second
    consumer's keys, skipped there (and a consumer's keys all past seqlen_k); full
    attention's kernels are left alone, as is bwd_hopper256's."""
    monkeypatch.delenv("FLASHTILE_HOPPER_BWD_OPTS", raising=False)
    opts = frozenset({"lse_smem", "dq_tma", "ds_ring", "skip_masked"})
    assert bwd_hopper.kernel_flags(64, True, opts, 64)["SKIP_MASKED"]
    assert bwd_hopper.kernel_flags(128, True, opts, 64)["SKIP_MASKED"]
    assert not bwd_hopper.kernel_flags(64, False, opts, 64)["SKIP_MASKED"]
    assert "SKIP_MASKED" not in bwd_hopper.kernel_flags(256, True, opts, 64)
    assert not bwd_hopper.kernel_flags(64, True, configs.hopper_bwd_opts(64),
                                       64)["SKIP_MASKED"]
    # The default at head_dim 128 alone (session 33: +2-4% there, -3% at 64's 1k).
    assert bwd_hopper.kernel_flags(128, True, configs.hopper_bwd_opts(128), 64)["SKIP_MASKED"]
    assert not bwd_hopper.kernel_flags(128, False, configs.hopper_bwd_opts(128),
                                       64)["SKIP_MASKED"]


def test_lpt_option_and_its_l2_rule():
    """lpt: the grid (heads, key blocks) for causal attention only (a full walk is as long
    at every key block), both kernels; backward takes it where every head's Q and dO fit
    LPT_QDO_BYTES (transformers' Llama-3.2-1B step, 32 heads x 4k, d64, bf16, does; 16k
    tokens of the same heads do not) and the key blocks fit the grid's y."""
    opts = frozenset({"lse_smem", "dq_tma", "ds_ring", "lpt"})
    assert bwd_hopper.kernel_flags(64, True, opts, 64)["LPT"]
    assert not bwd_hopper.kernel_flags(64, False, opts, 64)["LPT"]
    assert bwd_hopper.kernel_flags(256, True, opts, 64) == dict(IS_CAUSAL=True,
                                                                DQ_TMA=True, LPT=True)
    assert bwd_hopper.lpt_fits(1, 32, 4096, 4096, 64, 2, 128)
    assert not bwd_hopper.lpt_fits(1, 32, 16384, 16384, 64, 2, 128)
    assert not bwd_hopper.lpt_fits(16, 16, 1024, 1024, 128, 2, 128)
    # The key blocks go to the grid's y: at most 65535 of them (9M keys would not).
    assert bwd_hopper.lpt_fits(1, 8, 4096, 65535 * 128, 64, 2, 128)
    assert not bwd_hopper.lpt_fits(1, 8, 4096, 65535 * 128 + 1, 64, 2, 128)
    assert not bwd_hopper.lpt_fits(1, 8, 4096, 9_000_000, 64, 2, 128)


def test_dq_tma_tile_and_descriptor():
    """dq_tma's tensor map: (1, 1, rows, 64) fp32 boxes over the accumulator, rows the
    block's; 128-byte swizzled. At head_dim 256 over the accumulator's (1, batch *
    nheads, seqlen_q, 256) view."""
    dq_accum = torch.empty(2, 4, 333, 128, dtype=torch.float32)
    for rows in (64, 128):
        desc = bwd_hopper._dq_descriptor(dq_accum, rows)
        assert list(desc.block_shape) == [1, 1, rows, 64]
        assert list(desc.shape) == [2, 4, 333, 128]
        assert desc.layout.swizzle_byte_width == 128 and desc.layout.element_bitwidth == 32
    # bwd_hopper256's: (batch, query head) pairs as one dimension, 64 x 64 boxes.
    desc = bwd_hopper._dq_descriptor(torch.empty(2, 4, 333, 256), 64)
    assert list(desc.shape) == [1, 8, 333, 256] and list(desc.block_shape) == [1, 1, 64, 64]
    assert list(desc.strides) == [8 * 333 * 256, 333 * 256, 256, 1]


def test_declines_what_it_does_not_support(monkeypatch):
    """The reasons it gives for the calls the portable backward keeps (checked on CPU
    with the device check bypassed)."""
    from flashtile.ops import fwd_hopper

    q, k, v, dout = _inputs(1, 40, 40, 2, 2, 64, torch.bfloat16, "cpu")
    out = torch.randn_like(q)
    assert "sm_90" in bwd_hopper.unsupported(q, k, v, out, dout)
    monkeypatch.setattr(fwd_hopper, "_on_hopper", lambda device: True)
    assert bwd_hopper.unsupported(q, k, v, out, dout) is None
    assert bwd_hopper.unsupported(q, k, v, out, dout, window_right=0) is None  # causal
    assert "dtype" in bwd_hopper.unsupported(*(x.float() for x in (q, k, v, out, dout)))
    for d in (80, 512):
        assert f"head_dim {d}: one of [64, 96, 128, 256]" in bwd_hopper.unsupported(
            *_inputs(1, 40, 40, 2, 2, d, torch.bfloat16, "cpu"), out)
    x96 = _inputs(1, 40, 40, 2, 2, 96, torch.bfloat16, "cpu")  # in d128's tile
    assert bwd_hopper.unsupported(*x96, x96[0]) is None and bwd_hopper.tile_dim(96) == 128
    x256 = _inputs(1, 40, 40, 2, 2, 256, torch.bfloat16, "cpu")  # bwd_hopper256
    assert bwd_hopper.unsupported(*x256, x256[0]) is None
    for extra in (dict(attn_mask=q), dict(alibi_slopes=q), dict(softcap=5.0),
                  dict(window_left=8), dict(window_right=3)):
        assert "causal or full" in bwd_hopper.unsupported(q, k, v, out, dout, **extra)
    assert "dropout" in bwd_hopper.unsupported(q, k, v, out, dout, dropout_p=0.1)
    assert "empty" in bwd_hopper.unsupported(q, k[:, :0], v[:, :0], out, dout)
    odd = torch.randn(1, 40, 2, 68, dtype=torch.bfloat16)[..., :64]  # stride 68: not 8k
    assert "TMA" in bwd_hopper.unsupported(odd, k, v, out, dout)
    assert "dout" in bwd_hopper.unsupported(q, k, v, out, odd)


@pytest.mark.parametrize("switch,deterministic,head_dim,seqlen_q,used", [
    ("1", False, 64, 30, "hopper"), ("1", False, 128, 30, "hopper"),
    ("0", False, 128, 1024, "portable"), ("", False, 128, 1024, "hopper"),
    ("auto", False, 64, 1024, "hopper"), ("auto", False, 128, 511, "hopper"),
    ("auto", False, 64, 256, "hopper"), ("auto", False, 64, 255, "portable"),
    ("auto", False, 128, 256, "hopper"), ("auto", False, 128, 200, "portable"),
    ("", False, 128, 30, "portable"), ("1", True, 128, 30, "portable"),
    ("auto", True, 128, 1024, "portable"), ("1", False, 80, 30, "portable"),
    ("1", False, 96, 30, "hopper"), ("auto", False, 96, 1024, "hopper"),
    ("auto", False, 96, 255, "portable"),
    ("1", False, 256, 30, "hopper"), ("1", False, 256, 1024, "hopper"),
    ("auto", False, 256, 1024, "hopper"), ("", False, 256, 1024, "hopper"),
    ("auto", False, 256, 128, "hopper"), ("auto", False, 256, 127, "portable"),
    ("1", True, 256, 30, "portable")])
def test_switch_dispatch_on_cpu(switch, deterministic, head_dim, seqlen_q, used,
                                monkeypatch):
    """With the kernels replaced by fakes: FLASHTILE_HOPPER_BWD=1 sends a supported dense
    backward to bwd_hopper.backward with the portable launcher's arguments (bottom-right
    causal as diag_offset, the scale, dlse); "auto" (also the unset default) does so
    where both lengths (seqlen_k is seqlen_q + 20 here) reach
    configs.HOPPER_BWD_AUTO_MIN_SEQLEN (256 at head dims 64 and 128, 128 at 256) and
    keeps shorter calls on the portable backward; "0" never sends it, and neither do
    deterministic calls or calls it declines (head_dim 80: the real unsupported() runs
    there, with only its device check bypassed); head_dim 96 runs in 128's tile, from
    256 under auto."""
    from flashtile.ops import fwd_hopper

    seen = {}

    def portable(dout, q, k, v, out, lse, dlse, **kw):
        seen["portable"] = dict(kw, dlse=dlse)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def hopper(dout, q, k, v, out, lse, dlse, softmax_scale, diag_offset, causal):
        seen["hopper"] = dict(softmax_scale=softmax_scale, diag_offset=diag_offset,
                              window_right=0 if causal else -1, dlse=dlse)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(custom_ops, "select_backend", lambda *a, **kw: "torch")
    q, k, v, dout = _inputs(1, seqlen_q, seqlen_q + 20, 2, 1, head_dim, torch.bfloat16,
                            "cpu")
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = flashtile.flash_attn_func(qg, kg, vg, causal=True, softmax_scale=0.25,
                                    deterministic=deterministic)  # the torch forward
    monkeypatch.setattr(custom_ops, "select_backend", lambda *a, **kw: "triton")
    monkeypatch.setattr(fwd_hopper, "_on_hopper", lambda device: True)
    monkeypatch.setattr(bwd_hopper, "backward", hopper)
    monkeypatch.setattr(custom_ops, "triton_bwd", portable)
    monkeypatch.setenv("FLASHTILE_HOPPER_BWD", switch)
    torch.autograd.grad(out, (qg, kg, vg), dout)
    assert list(seen) == [used]
    kw = seen[used]
    assert kw["diag_offset"] == 20 and kw["window_right"] == 0
    assert kw["softmax_scale"] == 0.25


def test_switch_rejects_other_values(monkeypatch):
    from flashtile._backend import hopper_bwd_mode

    monkeypatch.setenv("FLASHTILE_HOPPER_BWD", "yes")
    with pytest.raises(ValueError, match="FLASHTILE_HOPPER_BWD must be 'auto', '0' or "
                       "'1', got 'yes'"):
        hopper_bwd_mode()


def test_head_split_fills_the_grid():
    """The smallest divisor of the group giving HEAD_SPLIT_WAVES waves, else the whole
    group; MHA never splits."""
    waves = bwd_hopper.HEAD_SPLIT_WAVES
    assert bwd_hopper.head_split(1, 4, 132) == 1
    # transformers' Llama-3.2-1B step: 32 key blocks x 8 KV heads = 256 programs.
    assert bwd_hopper.head_split(4, 256, 132) == (4 if waves * 132 > 512 else 2)
    assert bwd_hopper.head_split(4, waves * 132, 132) == 1
    assert bwd_hopper.head_split(4, waves * 66, 132) == 2
    assert bwd_hopper.head_split(7, waves * 66, 132) == 7  # 7 is prime: one a head
    assert bwd_hopper.head_split(6, waves * 50, 132) == 3
    assert bwd_hopper.head_split(8, 1, 132) == 8


def test_head_split_knob(monkeypatch):
    """FLASHTILE_HOPPER_BWD_HEAD_SPLIT: unset or "auto" leaves the rule (None); a divisor
    of the group is taken, a larger number clamped to the group; anything else, or a
    number that does not divide the group, is a ValueError naming the variable."""
    monkeypatch.delenv("FLASHTILE_HOPPER_BWD_HEAD_SPLIT", raising=False)
    assert configs.hopper_bwd_head_split(4) is None
    for raw, group, split in (("auto", 4, None), (" 2 ", 4, 2), ("1", 4, 1), ("8", 4, 4),
                              ("3", 6, 3)):
        monkeypatch.setenv("FLASHTILE_HOPPER_BWD_HEAD_SPLIT", raw)
        assert configs.hopper_bwd_head_split(group) == split
    for raw, message in (("0", "'auto' or a positive integer, got '0'"),
                         ("two", "'auto' or a positive integer, got 'two'"),
                         ("3", "=3 does not divide the GQA group of 4")):
        monkeypatch.setenv("FLASHTILE_HOPPER_BWD_HEAD_SPLIT", raw)
        with pytest.raises(ValueError, match=f"FLASHTILE_HOPPER_BWD_HEAD_SPLIT.*{message}"):
            configs.hopper_bwd_head_split(4)


@pytest.mark.parametrize("split", [1, 2, 4])
@on_hopper
def test_head_split_knob_reaches_the_kernel(split, monkeypatch):
    """The knob's split runs (its own launch plans) and meets the gradient rule: the
    GQA group of 4 at 1 (one program walks all four heads), 2 and 4."""
    from flashtile.ops import _launch, bwd

    monkeypatch.setenv("FLASHTILE_HOPPER_BWD_HEAD_SPLIT", str(split))
    seen = []
    real = _launch.first_launch

    def spy(kernel, grid, args, kwargs, slots=None):
        if kernel is bwd._bwd_dq_convert_kernel:  # its launch sums the shares
            seen.append(kwargs["SHARES"])
        return real(kernel, grid, args, kwargs, slots)

    monkeypatch.setattr(_launch, "first_launch", spy)
    _launch.clear()
    q, k, v, dout = _inputs(1, 300, 300, 8, 2, 64, torch.bfloat16)
    _check(_backward(q, k, v, dout, True, 0, 0.125), q, k, v, dout, True, 0, 0.125)
    assert seen == [split]
    _launch.clear()
