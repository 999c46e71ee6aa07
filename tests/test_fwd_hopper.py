"""The Gluon Hopper forward (flashtile/ops/fwd_hopper.py) against the float64 oracle.

GPU (``--gpu`` on an sm_90 device): out and lse against ``attention_naive`` in float64
with the rule every forward test uses (tests/utils.py), over head dims, full and causal
(bottom-right and top-left), GQA/MQA, lengths that are not tile multiples, batch > 1;
NaN and empty rows as tests/test_nan.py requires them; the FLASHTILE_HOPPER_FWD switch
through flash_attn_func, backward included. CPU: which calls the kernel declines, and
the switch's dispatch with the kernel replaced by a fake.
"""

import re

import pytest
import torch

import flashtile
from flashtile import custom_ops
from flashtile.reference import allowed_keys, attention_naive
from tests.utils import assert_close_rule, reference_pair

fwd_hopper = pytest.importorskip("flashtile.ops.fwd_hopper")  # Gluon: triton >= 3.6

_on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the Gluon forward runs on sm_90 only")


def on_hopper(test):
    """A --gpu test on an sm_90 device. A kernel that deadlocks (mbarrier phases out of
    step) fails it after 60 s, killing the process, instead of hanging the run."""
    for mark in (pytest.mark.gpu, _on_hopper, pytest.mark.timeout(60, method="thread")):
        test = mark(test)
    return test


@pytest.fixture
def fresh_plans():
    """Launch plans and persistent schedules dropped before and after the test: it
    changes what they are keyed without (the tile config, the program count)."""
    from flashtile.ops import _launch

    _launch.clear()
    fwd_hopper._SCHEDULES.clear()
    yield
    _launch.clear()
    fwd_hopper._SCHEDULES.clear()


@pytest.fixture(params=["tiles", "persistent"])
def schedule(request, monkeypatch):
    """Both grids (configs.hopper_fwd_persistent), each its own plan key."""
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_SCHEDULE", request.param)
    return request.param


def _kw(causal, diag_offset, softmax_scale):
    return dict(attn_mask=None, alibi_slopes=None, softmax_scale=softmax_scale,
                diag_offset=diag_offset, window_left=-1, window_right=0 if causal else -1,
                softcap=0.0, allow_tf32=False)


def _inputs(b, sq, sk, h, hkv, d, dtype, device="cuda"):
    return (torch.randn(b, sq, h, d, dtype=dtype, device=device),
            torch.randn(b, sk, hkv, d, dtype=dtype, device=device),
            torch.randn(b, sk, hkv, d, dtype=dtype, device=device))


def _check(out, lse, q, k, v, causal, diag_offset, scale):
    ref = dict(softmax_scale=scale, causal=causal, diag_offset=diag_offset)
    o64, l64 = attention_naive(q, k, v, **ref)
    o_pt, _ = attention_naive(q, k, v, upcast=False, **ref)
    assert_close_rule("out", out, o64, o_pt)
    finite = torch.isfinite(lse)
    assert torch.equal(finite, torch.isfinite(l64)), "lse -inf pattern differs"
    assert (lse[~finite] == float("-inf")).all()
    torch.testing.assert_close(lse[finite].double(), l64[finite], rtol=1e-4, atol=1e-4)


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv): lengths off the 128-row and 64/128-key
# tiles, one query row, seqlen_q > seqlen_k (causal: the first rows see no key), a long
# walk that turns the K/V ring over many times.
SHAPES = [(2, 1000, 1000, 4, 4), (1, 257, 513, 8, 2), (2, 513, 257, 4, 1),
          (1, 1, 777, 4, 4), (3, 128, 128, 2, 2), (1, 4099, 4099, 2, 1)]
MASKS = {"full": (False, None), "causal": (True, "bottom_right"),
         "causal_top_left": (True, "top_left")}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}".format(*s))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@on_hopper
def test_matches_float64_reference(dtype, head_dim, shape, mask, schedule):
    b, sq, sk, h, hkv = shape
    causal, align = MASKS[mask]
    diag_offset = sk - sq if align == "bottom_right" else 0
    q, k, v = _inputs(b, sq, sk, h, hkv, head_dim, dtype)
    scale = head_dim ** -0.5
    out, lse = fwd_hopper.attn_fwd(q, k, v, **_kw(causal, diag_offset, scale))
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    _check(out, lse, q, k, v, causal, diag_offset, scale)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}".format(*s))
@pytest.mark.parametrize("head_dim,block_n,stages", [(64, 128, 3), (128, 64, 4)],
                         ids=["d64", "d128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@on_hopper
def test_three_consumers_match_float64_reference(dtype, head_dim, block_n, stages, shape,
                                                 mask, schedule, monkeypatch, fresh_plans):
    """BLOCK_M 192 (FLASHTILE_HOPPER_FWD_CONFIG=192,BLOCK_N,4,STAGES, the sm_90 compile
    test's tiles; the other ring depths the bench times are validated there): three
    consumer warpgroups taking turns in a cycle, query tiles of 192 rows (lengths off
    them: 1000, 257, 513, 1, 128, 4099), on both grids: test_matches_float64_reference's
    rule."""
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", f"192,{block_n},4,{stages}")
    test_matches_float64_reference(dtype, head_dim, shape, mask, schedule)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}".format(*s))
@pytest.mark.parametrize("head_dim,config,tree", [
    (64, None, "1"), (96, None, "1"), (128, None, "1"), (256, None, "1"),
    (64, "192,128,4,3", "0")], ids=["d64-tree", "d96-tree", "d128-tree", "d256-tree",
                                    "d64-m192-flat-max"])
@on_hopper
def test_tree_max_off_its_default_matches_float64_reference(tree, head_dim, config, shape,
                                                            mask, schedule, monkeypatch,
                                                            fresh_plans):
    """FLASHTILE_HOPPER_FWD_TREE_MAX against its default (auto: the row max pairwise
    with three consumers only): "1" with two consumers, "0" with three, on every shape
    and head dim: test_matches_float64_reference's rule on both grids (the defaults
    run there and in test_three_consumers_match_float64_reference)."""
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_TREE_MAX", tree)
    if config is not None:
        monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", config)
    test_matches_float64_reference(torch.bfloat16, head_dim, shape, mask, schedule)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}".format(*s))
@pytest.mark.parametrize("head_dim,config,dtype", [
    (64, None, torch.bfloat16), (96, None, torch.float16), (128, None, torch.bfloat16),
    (128, None, torch.float16), (256, None, torch.bfloat16),
    (64, "192,128,4,3", torch.float16)],
    ids=["d64-bf16", "d96-fp16", "d128-bf16", "d128-fp16", "d256-bf16", "d64-m192-fp16"])
@on_hopper
def test_packed_p_matches_float64_reference(head_dim, config, dtype, shape, mask, schedule,
                                            monkeypatch, fresh_plans):
    """FLASHTILE_HOPPER_FWD_P_PACKED=0 (P V's operand carried as 16-bit values) against
    the default (P carried between blocks in packed registers, three consumers on the
    persistent grid too): test_matches_float64_reference's rule for both, and bit for
    bit the same out and lse (the same casts and products)."""
    if config is not None:
        monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", config)
    b, sq, sk, h, hkv = shape
    causal, align = MASKS[mask]
    diag_offset = sk - sq if align == "bottom_right" else 0
    q, k, v = _inputs(b, sq, sk, h, hkv, head_dim, dtype)
    kw = _kw(causal, diag_offset, head_dim ** -0.5)
    monkeypatch.delenv("FLASHTILE_HOPPER_FWD_P_PACKED", raising=False)
    packed_out, packed_lse = fwd_hopper.attn_fwd(q, k, v, **kw)
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_P_PACKED", "0")
    out, lse = fwd_hopper.attn_fwd(q, k, v, **kw)
    _check(packed_out, packed_lse, q, k, v, causal, diag_offset, head_dim ** -0.5)
    assert torch.equal(packed_out, out) and torch.equal(packed_lse.isnan(), lse.isnan())
    assert torch.equal(packed_lse.nan_to_num(), lse.nan_to_num())


@pytest.mark.parametrize("mask", ["causal", "causal_top_left"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}".format(*s))
@pytest.mark.parametrize("head_dim,config", [(64, "192,128,4,3"), (128, "192,64,4,4"),
                                             (64, None), (128, None), (256, None)],
                         ids=["d64-m192", "d128-m192", "d64", "d128", "d256"])
@on_hopper
def test_causal_consumers_walk_their_own_blocks(head_dim, config, shape, mask, schedule,
                                                monkeypatch, fresh_plans):
    """Causal: each consumer walks its own rows' key blocks and keeps the protocol for
    the tile's others (three consumers and d256 end early; the first rows of
    seqlen_q > seqlen_k see no key at all): test_matches_float64_reference's rule on
    both grids, three consumers forced at every shape. d128-m192 at q 1, top-left: the
    third consumer's rows all lie past seqlen_q, where its first row alone counted two
    full 64-key blocks against one block to walk, and it walked one the producer never
    loads (session 32, before n_full was clamped to n_blocks)."""
    if config is not None:
        monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", config)
    test_matches_float64_reference(torch.bfloat16, head_dim, shape, mask, schedule)


@pytest.mark.parametrize("mask,seqlen", [("full", 1100), ("full", 8200), ("causal", 2100),
                                         ("causal", 4100), ("full", 1024), ("full", 4096),
                                         ("causal", 4096)])
@on_hopper
def test_long_d64_takes_three_consumers(mask, seqlen, schedule):
    """Unset FLASHTILE_HOPPER_FWD_CONFIG, 16-bit d64 from 2k queries and keys (causal)
    or 1k (full) runs three consumers (configs.HOPPER_FWD_D64_THREE): lengths off the
    192-row tiles against the float64 reference, on both grids. At 1,024 and 4,096 the
    last tile's second and third warpgroups lie wholly past seqlen_q (block 0 only, then
    the protocol: _mma_tile's OWN_BLOCKS)."""
    from flashtile.ops import configs

    causal = MASKS[mask][0]
    assert configs.hopper_fwd_config(64, False, seqlen, seqlen, causal).block_m == 192
    test_matches_float64_reference(torch.bfloat16, 64, (1, seqlen, seqlen, 2, 1), mask,
                                   schedule)


@on_hopper
def test_strided_inputs():
    """q, k and v as views of packed qkv (head stride 3 x head_dim), a scale != 1/sqrt(d)."""
    qkv = torch.randn(2, 300, 3, 4, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(2)
    assert fwd_hopper.unsupported(q, k, v) is None
    out, lse = fwd_hopper.attn_fwd(q, k, v, **_kw(True, 0, 0.3))
    _check(out, lse, q, k, v, True, 0, 0.3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@on_hopper
def test_wider_tile_reads_and_writes_only_head_dim(causal, schedule):
    """d96 in d128's tile (configs.HOPPER_WIDER): q, k and v as the first 96
    columns of 128-wide tensors whose other 32 hold NaN, which the boxes' extra columns
    cover but the tensor maps exclude (zero-filled); out lands in its own 96 columns
    (memcheck: nothing past them), by the launch plan on the second call too."""
    from flashtile.ops import configs

    assert configs.hopper_fwd_tile_dim(96) == 128
    for _ in range(2):
        wide = torch.randn(3, 2, 300, 4, 128, dtype=torch.bfloat16, device="cuda")
        wide[..., 96:] = float("nan")
        q, k, v = wide[..., :96].unbind(0)
        assert fwd_hopper.unsupported(q, k, v) is None
        out, lse = fwd_hopper.attn_fwd(q, k, v, **_kw(causal, 0, 0.3))
        assert out.shape == q.shape and out.is_contiguous()
        _check(out, lse, q, k, v, causal, 0, 0.3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@on_hopper
def test_launch_plan_equals_tritons_path(causal, schedule):
    """After a layout's first call, a launch plan launches the kernel over fresh tensors
    (new addresses in the four tensor maps) and another softmax_scale: the same bits as
    Triton's own path, and the plan keeps no call's tensor alive."""
    from flashtile.ops import _launch
    from tests.test_launch_plans import keeps_no_tensor

    def call(seed, scale):
        torch.manual_seed(seed)
        q, k, v = _inputs(2, 300, 333, 4, 2, 128, torch.bfloat16)
        return fwd_hopper.attn_fwd(q, k, v, **_kw(causal, 33, scale)), (q, k, v)

    _launch.clear()
    call(0, 0.1)  # Triton's path, then the plan is stored
    (out, lse), (q, k, v) = call(1, 0.2)  # the plan
    plans = [p for p in _launch._plans.values() if isinstance(p, tuple) and len(p) == 2]
    assert len(plans) == 1 and keeps_no_tensor(plans[0][0])  # (plan, schedule or False)
    _check(out, lse, q, k, v, causal, 33, 0.2)
    _launch.clear()
    (out2, lse2), _ = call(1, 0.2)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


# (seqlen_q, seqlen_k, causal, the poisoned key), as in tests/test_nan.py but over
# several tiles of this kernel.
GEOMETRIES = {"full": (200, 300, False, 250), "causal_q<k": (200, 300, True, 290),
              "causal_q>k": (300, 200, True, 20)}


@pytest.fixture(params=["128", "192"], ids=["m128", "m192"])
def d64_block_m(request, monkeypatch, fresh_plans):
    """The d64 tile's BLOCK_M: the table's two consumers, or three (192)."""
    if request.param == "192":
        monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", "192,128,4,3")
    return int(request.param)


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@on_hopper
def test_nan_and_empty_rows(geometry, where, schedule, d64_block_m):
    """A NaN key makes exactly the rows that see it NaN (out and lse); a NaN value
    reaches at least its column in those rows; rows that see no key are 0 with lse -inf
    whatever the keys hold; the other head is untouched."""
    sq, sk, causal, key = GEOMETRIES[geometry]
    q, k, v = _inputs(1, sq, sk, 2, 2, 64, torch.bfloat16)
    ok = allowed_keys(sq, sk, sk - sq, -1, 0 if causal else -1, q.device)
    seen, empty = ok[:, key], ~ok.any(1)
    {"k": k, "v": v}[where][0, key, 0, 3] = float("nan")
    out, lse = fwd_hopper.attn_fwd(q, k, v, **_kw(causal, sk - sq, 64 ** -0.5))
    o0, l0 = out[0, :, 0], lse[0, 0]
    assert (o0[empty] == 0).all() and (l0[empty] == float("-inf")).all()
    if where == "k":
        assert torch.isnan(o0[seen]).all() and torch.isnan(l0[seen]).all()
        ref, ref_lse = attention_naive(q, k, v, causal=causal)
        same, _ = attention_naive(q, k, v, causal=causal, upcast=False)
        rest = ~seen & ~empty
        assert_close_rule("out", o0[rest], ref[0, :, 0][rest], same[0, :, 0][rest])
        torch.testing.assert_close(l0[rest].double(), ref_lse[0, 0][rest], rtol=1e-4,
                                   atol=1e-4)
    else:
        assert torch.isnan(o0[seen, 3]).all() and torch.isfinite(l0[~empty]).all()
    assert torch.isfinite(out[0, :, 1]).all() and torch.isfinite(lse[0, 1][~empty]).all()


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal alignment): causal tiles with
# no key at all (seqlen_q > seqlen_k, bottom-right), ragged query and key tails, GQA.
PERSISTENT_SHAPES = [(2, 513, 257, 4, 1, "bottom_right"), (1, 257, 777, 3, 1, "top_left"),
                     (2, 1000, 1000, 4, 2, "bottom_right"), (1, 300, 1100, 5, 5, None)]


@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("shape", PERSISTENT_SHAPES,
                         ids=lambda s: "b{}-q{}-k{}-h{}/{}-{}".format(*s))
@pytest.mark.parametrize("head_dim,dtype,p", [
    (64, torch.bfloat16, None), (128, torch.bfloat16, None), (256, torch.float16, None),
    (128, torch.float8_e4m3fn, "regs"), (128, torch.float8_e4m3fn, "smem"),
    (64, torch.float16, "m192"), (64, torch.bfloat16, "oneq"), (128, torch.float16, "twoq"),
    (64, torch.bfloat16, "m192-oneq"), (128, torch.bfloat16, "twoq-tree"),
    (64, torch.float16, "m192-flat"), (128, torch.float8_e4m3fn, "regs-tree"),
    (256, torch.float8_e4m3fn, "smem"), (128, torch.float8_e4m3fn, "swap"),
    (256, torch.float8_e4m3fn, "swap")],
    ids=["d64-bf16", "d128-bf16", "d256-fp16", "d128-fp8-p-regs", "d128-fp8-p-smem",
         "d64-fp16-m192", "d64-bf16-oneq", "d128-fp16-twoq", "d64-bf16-m192-oneq",
         "d128-bf16-twoq-tree", "d64-fp16-m192-flat-max", "d128-fp8-p-regs-tree",
         "d256-fp8-p-smem", "d128-fp8-p-swap", "d256-fp8-p-swap"])
@on_hopper
def test_persistent_many_tiles_per_program(head_dim, dtype, p, shape, programs,
                                           monkeypatch, fresh_plans):
    """The persistent grid with a few programs, each looping over many tiles of
    different lengths (the K/V ring, the turns and Q's buffer carried from tile to tile,
    tiles that see no key, O's store overlapping the next tile, d256 storing O through
    Q's buffer; Q in two sets, tile i's in set i % 2, at d64 and twoq, in one at oneq;
    tree: TREE_MAX's row max where its default leaves gl.max's, flat: gl.max's where
    three consumers take the tree): the float64 reference's numbers, as with one tile a
    program."""
    b, sq, sk, h, hkv, align = shape
    causal = align is not None
    diag_offset = sk - sq if align == "bottom_right" else 0
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_SCHEDULE", "persistent")
    monkeypatch.setattr(fwd_hopper, "_num_sms", lambda device: programs)
    if p and p.startswith("m192"):  # three consumer warpgroups (BLOCK_M 192), 16-bit
        monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", "192,128,4,3")
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_Q_BUFFERS",
                       "2" if p and "twoq" in p else "1" if p and "oneq" in p else "auto")
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_TREE_MAX",
                       "1" if p and "tree" in p else "0" if p and "flat" in p else "auto")
    if dtype.itemsize == 2:
        q, k, v = _inputs(b, sq, sk, h, hkv, head_dim, dtype)
        out, lse = fwd_hopper.attn_fwd(q, k, v, **_kw(causal, diag_offset, 0.1))
        _check(out, lse, q, k, v, causal, diag_offset, 0.1)
    else:
        monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_P", p.split("-")[0])
        (q, k, v), scales = _fp8_inputs(b, sq, sk, h, hkv, head_dim)
        if causal and diag_offset != sk - sq:
            pytest.skip("the FP8 bound assumes the bottom-right alignment")
        out, lse = fwd_hopper.attn_fwd(q, k, v, **_fp8_kw(causal, q, k),
                                       q_descale=scales[0], k_descale=scales[1],
                                       v_descale=scales[2])
        _fp8_check(out, lse, q, k, v, scales, causal)


@pytest.mark.parametrize("seqlen,batch", [(1024, 16), (4096, 4), (8192, 2), (16384, 1),
                                          (1000, 3), (65536, 1)])
@pytest.mark.parametrize("mask", ["full", "causal", "causal_q>k"])
@pytest.mark.parametrize("block_m", [128, 192])
def test_persistent_schedule_covers_every_tile_once_and_balances(seqlen, batch, mask,
                                                                 block_m):
    """The persistent grid's tile lists (CPU): every (query tile, batch-head) exactly
    once, and the greedy list schedule's bound: no program has more work than the mean
    plus the longest tile (its cost model: key blocks + TILE_OVERHEAD_BLOCKS); query
    tiles of two consumers' rows or three's."""
    n_bh, sk = batch * 16, seqlen
    sq = seqlen + 300 if mask == "causal_q>k" else seqlen
    diag_offset = None if mask == "full" else sk - sq
    rows = fwd_hopper.schedule_rows(sq, sk, 128, 2, n_bh, 2, diag_offset, block_m, 128, 132)
    n_tiles_m = -(-sq // block_m)
    assert sorted(t for r in rows for t in r) == list(range(n_tiles_m * n_bh))

    def cost(t):
        m = t % n_tiles_m
        keys = sk if diag_offset is None else \
            min(sk, max(min(m * block_m + block_m, sq) + diag_offset, 0))
        return -(-keys // 128) + fwd_hopper.TILE_OVERHEAD_BLOCKS

    work = [sum(map(cost, r)) for r in rows]
    longest = max(cost(t) for r in rows for t in r)
    assert len(rows) == min(132, n_tiles_m * n_bh)
    assert max(work) <= sum(work) / len(work) + longest


def test_persistent_causal_order_is_longest_first_within_l2_groups():
    """Causal, 4k keys at head_dim 128 in bfloat16 (2 MiB of K and V a head): groups of
    16 heads (32 MiB), each program's tiles of one group from the most keys to the
    fewest; full attention walks heads one by one, query tiles in order."""
    rows = fwd_hopper.schedule_rows(4096, 4096, 128, 2, 64, 1, 0, 128, 128, 132)
    for r in rows:
        groups = [t // 32 // 16 for t in r]
        assert groups == sorted(groups)
        for g in set(groups):
            tiles = [t % 32 for t, x in zip(r, groups) if x == g]
            assert tiles == sorted(tiles, reverse=True)
    first = [r[0] for r in rows]  # the first wave: the 16 heads' longest tiles
    assert sorted({t // 32 for t in first}) == list(range(16))
    full = fwd_hopper.schedule_rows(4096, 4096, 128, 2, 64, 1, None, 128, 128, 132)
    assert [r[0] for r in full] == list(range(132))


@on_hopper
def test_switch_dispatches_and_backward_follows(monkeypatch):
    """FLASHTILE_HOPPER_FWD=1: flash_attn_func's forward runs the Gluon kernel where it
    supports the call (head_dim 128) and the portable one elsewhere (head_dim 80); the
    backward takes the Gluon forward's out and lse and meets the gradient rule."""
    calls = []
    real = fwd_hopper.forward
    monkeypatch.setattr(fwd_hopper, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD", "1")
    q, k, v = _inputs(2, 333, 555, 4, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = flashtile.flash_attn_func(qg, kg, vg, causal=True)
    assert calls == [1]
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    (o64, _, g64), (o_pt, _, g_pt) = reference_pair(q, k, v, dout, causal=True)
    assert_close_rule("out", out.detach(), o64, o_pt)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close_rule(name, g, r, p)
    flashtile.flash_attn_func(*_inputs(1, 64, 64, 2, 2, 80, torch.bfloat16))
    assert calls == [1]


def test_declines_what_it_does_not_support(monkeypatch):
    """The reasons it gives for the calls the portable kernel keeps (checked on CPU with
    the device check bypassed)."""
    q, k, v = _inputs(1, 40, 40, 2, 2, 64, torch.bfloat16, "cpu")
    assert "sm_90" in fwd_hopper.unsupported(q, k, v)
    monkeypatch.setattr(fwd_hopper, "_on_hopper", lambda device: True)
    assert fwd_hopper.unsupported(q, k, v) is None
    assert fwd_hopper.unsupported(q, k, v, window_right=0) is None  # causal
    assert "dtype" in fwd_hopper.unsupported(*(x.float() for x in (q, k, v)))
    assert "head_dim 80: one of [64, 96, 128, 256]" in fwd_hopper.unsupported(
        *_inputs(1, 40, 40, 2, 2, 80, torch.bfloat16, "cpu"))
    # d96 runs in d128's tile (16-bit only: test_fp8_declines_what_it_does_not_support).
    assert fwd_hopper.unsupported(*_inputs(1, 40, 40, 2, 2, 96, torch.bfloat16, "cpu")) \
        is None
    assert "softmax_scale" in fwd_hopper.unsupported(q, k, v, softmax_scale=-0.1)
    for extra in (dict(attn_mask=q), dict(alibi_slopes=q), dict(softcap=5.0),
                  dict(window_left=8), dict(window_right=3)):
        assert "causal or full" in fwd_hopper.unsupported(q, k, v, **extra)
    assert "empty" in fwd_hopper.unsupported(q[:, :0], k, v)
    odd = torch.randn(1, 40, 2, 68, dtype=torch.bfloat16)[..., :64]  # stride 68: not 8k
    assert "TMA" in fwd_hopper.unsupported(odd, k, v)
    assert "TMA" in fwd_hopper.unsupported(q, k.expand(1, 40, 2, 64).as_strided(
        k.shape, (0, 128, 64, 1)), v)
    with pytest.raises(ValueError, match="fwd_hopper cannot run this call: head_dim 80"):
        fwd_hopper.attn_fwd(*_inputs(1, 40, 40, 2, 2, 80, torch.bfloat16, "cpu"),
                            **_kw(False, 0, 0.1))


@pytest.mark.parametrize("switch,head_dim,seqlen_q,used", [
    ("1", 64, 30, "hopper"), ("0", 128, 1024, "portable"),
    ("auto", 128, 1024, "hopper"), ("auto", 256, 2000, "hopper"), ("", 128, 1024, "hopper"),
    ("auto", 64, 4096, "hopper"), ("auto", 64, 128, "hopper"), ("auto", 256, 300, "hopper"),
    ("auto", 64, 127, "portable"), ("auto", 128, 100, "portable"),
    ("1", 96, 1024, "hopper"), ("auto", 96, 1024, "hopper"), ("auto", 96, 127, "portable")])
def test_switch_dispatch_on_cpu(switch, head_dim, seqlen_q, used, monkeypatch):
    """With the kernels replaced by fakes: FLASHTILE_HOPPER_FWD=1 sends a supported dense
    forward to fwd_hopper.forward with the portable launcher's arguments (bottom-right
    causal as diag_offset, window_right 0), "0" keeps it on the portable kernel, and
    "auto" (also the unset default) takes the Gluon kernel at head dims 64, 128 and 256
    from 128 queries, the cells where it was timed faster, and d96 (in d128's tile)
    likewise."""
    seen = {}

    def fake(name):
        def attn_fwd(q, k, v, **kw):
            seen[name] = kw
            b, sq, h, d = q.shape
            return q.new_zeros(q.shape), q.new_zeros((b, h, sq), dtype=torch.float32)
        return attn_fwd

    monkeypatch.setattr(custom_ops, "select_backend", lambda *a, **kw: "triton")
    # What the dispatch consults: the whole check, or its per-layout part (remembered
    # per layout id) and the addresses.
    monkeypatch.setattr(fwd_hopper, "unsupported", lambda *a, **kw: None)
    monkeypatch.setattr(fwd_hopper, "layout_unsupported", lambda *a: None)
    monkeypatch.setattr(custom_ops, "_GLUON_LAYOUTS", {})
    hopper = fake("hopper")
    monkeypatch.setattr(fwd_hopper, "forward", lambda q, k, v, softmax_scale, diag_offset,
                        causal, return_lse=True: hopper(q, k, v, diag_offset=diag_offset,
                                                        window_right=0 if causal else -1))
    monkeypatch.setattr(custom_ops, "triton_fwd", fake("portable"))
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD", switch)
    flashtile.flash_attn_func(*_inputs(1, seqlen_q, seqlen_q + 20, 2, 1, head_dim,
                                       torch.bfloat16, "cpu"), causal=True)
    assert list(seen) == [used]
    assert seen[used]["diag_offset"] == 20 and seen[used]["window_right"] == 0


def test_gluon_route_remembers_layouts_not_addresses(monkeypatch):
    """An eager forward's route to the Gluon kernel checks each layout once (the answer
    kept per layout id) and every call's addresses: a q of a known layout 4 bytes off
    16 goes to the portable kernel, an aligned one back to the Gluon kernel, and a
    refused layout (head_dim 80) is refused again without a new check."""
    seen, checked = [], []

    def fake(name):
        def attn_fwd(q, k, v, **kw):
            seen.append(name)
            b, sq, h, d = q.shape
            return q.new_zeros(q.shape), q.new_zeros((b, h, sq), dtype=torch.float32)
        return attn_fwd

    real = fwd_hopper.layout_unsupported
    monkeypatch.setattr(custom_ops, "select_backend", lambda *a, **kw: "triton")
    monkeypatch.setattr(fwd_hopper, "_on_hopper", lambda device: True)
    monkeypatch.setattr(fwd_hopper, "layout_unsupported",
                        lambda *a: checked.append(1) or real(*a))
    monkeypatch.setattr(custom_ops, "_GLUON_LAYOUTS", {})
    hopper = fake("hopper")
    monkeypatch.setattr(fwd_hopper, "forward", lambda q, k, v, *a, **kw: hopper(q, k, v))
    monkeypatch.setattr(custom_ops, "triton_fwd", fake("portable"))
    q, k, v = _inputs(1, 200, 200, 2, 2, 128, torch.bfloat16, "cpu")
    buf = torch.empty(q.numel() + 2, dtype=q.dtype)
    off = buf[2:].view(q.shape).copy_(q)  # the same layout, 4 bytes past 16
    assert off.data_ptr() % 16 == 4 and off.stride() == q.stride()
    for x in (q, off, q):
        flashtile.flash_attn_func(x, k, v, causal=True)
    q80, k80, v80 = _inputs(1, 200, 200, 2, 2, 80, torch.bfloat16, "cpu")
    for _ in range(2):
        flashtile.flash_attn_func(q80, k80, v80)
    assert seen == ["hopper", "portable", "hopper", "portable", "portable"]
    assert len(checked) == 2


def test_switch_rejects_other_values(monkeypatch):
    from flashtile._backend import hopper_fwd_mode

    monkeypatch.setenv("FLASHTILE_HOPPER_FWD", "yes")
    with pytest.raises(ValueError, match="FLASHTILE_HOPPER_FWD must be 'auto', '0' or '1', "
                       "got 'yes'"):
        hopper_fwd_mode()


# ---- FP8 (float8 q, k, v with flash-attn 3's descales) ----
#
# Checked as tests/test_fp8.py checks the portable FP8 kernel: against float64 attention
# of the dequantised inputs, within the bound tests/fp8_utils.py derives from P's
# rounding to FP8 and the FP8 wgmma's narrower accumulator.

E4M3 = torch.float8_e4m3fn


def _fp8_inputs(b, sq, sk, h, hkv, d, dtype=E4M3, descales=True):
    """FP8 q, k, v quantised with a descale per (batch, kv head) (tests/test_fp8.py's
    inputs), or normal values cast as they are with descales None."""
    from tests.test_fp8 import _dense_inputs

    if descales:
        return _dense_inputs(b, sq, sk, h, hkv, d, dtype, "cuda")
    return tuple(x.float().to(dtype) for x in _inputs(b, sq, sk, h, hkv, d, torch.float32)), \
        (None, None, None)


def _fp8_kw(causal, q, k):
    # The bottom-right causal alignment tests/fp8_utils.error_bound assumes.
    return _kw(causal, k.shape[1] - q.shape[1], q.shape[-1] ** -0.5)


def _fp8_check(out, lse, q, k, v, scales, causal):
    from tests.test_fp8 import _check as check_fp8

    check_fp8(out, lse, q, k, v, scales, "triton", dict(causal=causal), torch.bfloat16)


FP8_SHAPES = [(2, 1000, 1000, 4, 4), (1, 257, 513, 8, 2), (2, 513, 257, 4, 1),
              (1, 1, 777, 4, 4), (1, 4099, 4099, 2, 1)]


@pytest.fixture(params=["regs", "smem", "swap"], ids=["p-regs", "p-smem", "p-swap"])
def p_mode(request, monkeypatch):
    """The ways P reaches P V (configs.hopper_fwd_fp8_p_smem), each its own plan key."""
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_P", request.param)
    return request.param


# This grid and test_float8_agrees_with_the_portable_kernel are named float8, not fp8:
# the memcheck slice (Makefile MEMCHECK_K: "fp8") takes the smaller FP8 tests only;
# these two would outlast its time limit.
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}".format(*s))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@on_hopper
def test_float8_matches_float64_reference(head_dim, shape, causal, p_mode, schedule):
    b, sq, sk, h, hkv = shape
    (q, k, v), scales = _fp8_inputs(b, sq, sk, h, hkv, head_dim)
    out, lse = fwd_hopper.attn_fwd(q, k, v, **_fp8_kw(causal, q, k), q_descale=scales[0],
                                   k_descale=scales[1], v_descale=scales[2])
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    _fp8_check(out, lse, q, k, v, scales, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}".format(*s))
@pytest.mark.parametrize("p", ["smem", "swap"])
@on_hopper
def test_float8_block_n_256_pv_in_wgmma(shape, causal, p, schedule, monkeypatch,
                                        fresh_plans):
    """FP8 at head_dim 128 with 256 keys a block, P through shared memory (in the keys'
    order or swapped), P V summed in the wgmma and O staged in P's buffers
    (FLASHTILE_HOPPER_FWD_FP8_PV=wgmma, the config 128,256,4,2): the float64
    reference's bound, on both grids."""
    _fp8_pv_in_wgmma("128,256,4,2", shape, causal, monkeypatch, p)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}".format(*s))
@on_hopper
def test_float8_three_consumers(shape, causal, stages, schedule, monkeypatch, fresh_plans):
    """FP8 at head_dim 128 with three consumer warpgroups (192,128,4,STAGES), P through
    shared memory and P V summed in the wgmma: the float64 reference's FP8 bound, on
    both grids."""
    _fp8_pv_in_wgmma(f"192,128,4,{stages}", shape, causal, monkeypatch)


def _fp8_pv_in_wgmma(config, shape, causal, monkeypatch, p="smem"):
    """An FP8 d128 call with P in shared memory (FLASHTILE_HOPPER_FWD_FP8_P=p), P V
    summed in the wgmma and the tile ``config`` (FLASHTILE_HOPPER_FWD_CONFIG) against the
    FP8 bound (the caller takes fresh_plans: plans and schedules are keyed without the
    tile config)."""
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_P", p)
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_PV", "wgmma")
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", config)
    b, sq, sk, h, hkv = shape
    (q, k, v), scales = _fp8_inputs(b, sq, sk, h, hkv, 128)
    out, lse = fwd_hopper.attn_fwd(q, k, v, **_fp8_kw(causal, q, k), q_descale=scales[0],
                                   k_descale=scales[1], v_descale=scales[2])
    _fp8_check(out, lse, q, k, v, scales, causal)


@pytest.mark.parametrize("dtype,out_dtype,descales", [
    (E4M3, torch.float16, True), (torch.float8_e5m2, torch.bfloat16, True),
    (E4M3, torch.bfloat16, False)], ids=["e4m3-fp16-out", "e5m2", "no-descale"])
@on_hopper
def test_fp8_formats_and_outputs(dtype, out_dtype, descales, p_mode):
    """e5m2 inputs (P then in e5m2, as the portable kernel rounds it), a float16 out, and
    descales None (1.0: HAS_*_DESCALE off)."""
    from tests.test_fp8 import _check as check_fp8

    (q, k, v), scales = _fp8_inputs(2, 300, 333, 4, 2, 128, dtype, descales=descales)
    out, lse = fwd_hopper.attn_fwd(q, k, v, **_fp8_kw(True, q, k), q_descale=scales[0],
                                   k_descale=scales[1], v_descale=scales[2],
                                   out_dtype=out_dtype)
    check_fp8(out, lse, q, k, v, scales, "triton", dict(causal=True), out_dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@on_hopper
def test_float8_agrees_with_the_portable_kernel(head_dim, causal, p_mode):
    """The portable FP8 kernel on the same inputs and expanded (stride 0) descales: both
    within the bound of the float64 reference (so within twice it of each other; not
    bitwise: the two round exp2's argument differently, one FFMA against two ops)."""
    from flashtile.ops import fwd

    (q, k, v), scales = _fp8_inputs(2, 1000, 1100, 8, 2, head_dim)
    scales = (scales[0], scales[1][:1].expand(2, 2), scales[2])  # one k factor for all
    kw = dict(_fp8_kw(causal, q, k), q_descale=scales[0], k_descale=scales[1],
              v_descale=scales[2], out_dtype=torch.bfloat16)
    out, lse = fwd_hopper.attn_fwd(q, k, v, **kw)
    ref_out, ref_lse = fwd.attn_fwd(q, k, v, **kw)
    _fp8_check(out, lse, q, k, v, scales, causal)
    _fp8_check(ref_out, ref_lse, q, k, v, scales, causal)


@pytest.mark.parametrize("where", ["k", "v"])
@on_hopper
def test_fp8_nan_propagates(where, p_mode):
    """An e4m3 NaN key makes exactly the rows that see it NaN (out and lse); a NaN value
    reaches its column in those rows; rows that see no key are 0 with lse -inf."""
    sq, sk, key = 300, 200, 20  # causal, seqlen_q > seqlen_k: the first rows see nothing
    (q, k, v), scales = _fp8_inputs(1, sq, sk, 2, 2, 128)
    ok = allowed_keys(sq, sk, sk - sq, -1, 0, q.device)
    seen, empty = ok[:, key], ~ok.any(1)
    {"k": k, "v": v}[where].view(torch.uint8)[0, key, 0, 3] = 0x7F  # e4m3fn's NaN
    out, lse = fwd_hopper.attn_fwd(q, k, v, **_fp8_kw(True, q, k), q_descale=scales[0],
                                   k_descale=scales[1], v_descale=scales[2])
    o0, l0 = out[0, :, 0].float(), lse[0, 0]
    assert (o0[empty] == 0).all() and (l0[empty] == float("-inf")).all()
    if where == "k":
        assert torch.isnan(o0[seen]).all() and torch.isnan(l0[seen]).all()
        assert torch.isfinite(o0[~seen]).all()
    else:
        assert torch.isnan(o0[seen, 3]).all() and torch.isfinite(l0[~empty]).all()
    assert torch.isfinite(out[0, :, 1].float()).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@on_hopper
def test_fp8_launch_plan_equals_tritons_path(causal, p_mode, schedule):
    """A second FP8 call goes through the launch plan with new q, k, v (a new V^T copy)
    and new descales in the slots: the same bits as Triton's own path."""
    from flashtile.ops import _launch

    def call(seed, factor):
        torch.manual_seed(seed)
        (q, k, v), scales = _fp8_inputs(2, 300, 333, 4, 2, 128)
        scales = tuple(x * factor for x in scales)
        return fwd_hopper.attn_fwd(q, k, v, **_fp8_kw(causal, q, k), q_descale=scales[0],
                                   k_descale=scales[1], v_descale=scales[2])

    _launch.clear()
    call(0, 1.0)
    out, lse = call(1, 2.0)  # the plan
    _launch.clear()
    previous = _launch.set_enabled(False)
    try:
        out2, lse2 = call(1, 2.0)
    finally:
        _launch.set_enabled(previous)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@on_hopper
def test_fp8_switch_dispatches(monkeypatch):
    """FLASHTILE_HOPPER_FWD=1: flash_attn_func's dense FP8 forward runs the Gluon kernel
    and meets the FP8 bound; float32 out and varlen stay on the portable kernel."""
    calls = []
    real = fwd_hopper.forward
    monkeypatch.setattr(fwd_hopper, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD", "1")
    (q, k, v), scales = _fp8_inputs(2, 333, 555, 4, 2, 128)
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True,
                                         q_descale=scales[0], k_descale=scales[1],
                                         v_descale=scales[2])
    assert calls == [1]
    _fp8_check(out, lse, q, k, v, scales, True)
    flashtile.flash_attn_func(q, k, v, out_dtype=torch.float32)
    cu = torch.tensor([0, 333, 666], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 555, 1110], dtype=torch.int32, device="cuda")
    flashtile.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu,
                                     cu_k, 333, 555, causal=True)
    assert calls == [1]


def _fp8_cpu(d=128, sq=40, dtype=E4M3):
    return tuple(x.to(dtype) for x in _inputs(1, sq, sq, 2, 2, d, torch.float32, "cpu"))


def test_fp8_pv_switch(monkeypatch):
    """FLASHTILE_HOPPER_FWD_FP8_PV: P V per tile up to head_dim 128 unless "wgmma"."""
    from flashtile.ops import configs

    assert configs.hopper_fwd_fp8_pv_per_tile(128)
    assert not configs.hopper_fwd_fp8_pv_per_tile(256)
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_PV", "wgmma")
    assert not configs.hopper_fwd_fp8_pv_per_tile(64)
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_PV", "fp32")
    with pytest.raises(ValueError, match=re.escape(
            "FLASHTILE_HOPPER_FWD_FP8_PV must be one of ('tile', 'wgmma'), got 'fp32'")):
        configs.hopper_fwd_fp8_pv_per_tile(128)


def test_fp8_declines_what_it_does_not_support(monkeypatch):
    monkeypatch.setattr(fwd_hopper, "_on_hopper", lambda device: True)
    q, k, v = _fp8_cpu()
    assert fwd_hopper.unsupported(q, k, v) is None
    assert fwd_hopper.unsupported(*_fp8_cpu(dtype=torch.float8_e5m2)) is None
    assert fwd_hopper.unsupported(q, k, v, out_dtype=torch.float16) is None
    assert "out_dtype" in fwd_hopper.unsupported(q, k, v, out_dtype=torch.float32)
    for d in (32, 96):
        assert "head_dim" in fwd_hopper.unsupported(*_fp8_cpu(d))
    # TMA strides are counted in bytes: 72 one-byte elements are not 16-byte multiples
    # (72 bf16 elements are); v is copied keys-contiguous, so its strides are free.
    odd = torch.zeros(1, 40, 2, 72, dtype=torch.uint8).view(E4M3)[..., :64]
    q64, k64, v64 = _fp8_cpu(64)
    assert "TMA" in fwd_hopper.unsupported(odd, k64, v64)
    assert "TMA" in fwd_hopper.unsupported(q64, odd, v64)
    assert fwd_hopper.unsupported(q64, k64, odd) is None
    odd16 = torch.zeros(1, 40, 2, 72, dtype=torch.bfloat16)[..., :64]
    assert fwd_hopper.unsupported(odd16, odd16, odd16) is None
    with pytest.raises(ValueError, match="cannot run this call: out_dtype"):
        fwd_hopper.attn_fwd(q, k, v, **_kw(False, 0, 0.1), out_dtype=torch.float32)


def test_fp8_auto_cells():
    """FLASHTILE_HOPPER_FWD=auto's FP8 cells (custom_ops._hopper_fwd_wins): head dims 64,
    128 and 256 from 1k queries (session 39: 1.10-1.62x the portable kernel there), not
    96 (the Gluon FP8 kernel has no d96 tile) nor shorter calls (untimed)."""
    from flashtile import custom_ops

    def wins(seqlen_q, head_dim):
        return custom_ops._hopper_fwd_wins(torch.empty(1, seqlen_q, 2, head_dim, dtype=E4M3))

    assert all(wins(1024, d) and wins(16384, d) for d in (64, 128, 256))
    assert not any(wins(1023, d) for d in (64, 128, 256))
    assert not wins(4096, 96)


@pytest.mark.parametrize("switch,seqlen_q,varlen,used", [
    ("1", 40, False, "hopper"), ("auto", 1024, False, "hopper"),
    ("", 1024, False, "hopper"),
    ("auto", 1023, False, "portable"), ("0", 4096, False, "portable"),
    ("1", 40, True, "portable"), ("auto", 4096, True, "portable")])
def test_fp8_switch_dispatch_on_cpu(switch, seqlen_q, varlen, used, monkeypatch):
    """With the kernels replaced by fakes: FLASHTILE_HOPPER_FWD=1 sends a dense FP8
    forward to fwd_hopper.forward with its descales (expanded to (batch, nheads_kv)),
    out_dtype and bottom-right causal alignment; "auto" (also the unset default) does so
    from 1k queries, where it was timed faster, and keeps shorter calls on the portable
    kernel; varlen FP8 always stays there."""
    from flashtile import fp8 as F8
    from flashtile.ops import fwd

    seen = {}

    def fake(name):
        def attn_fwd(q, k, v, **kw):
            seen[name] = kw
            lse_shape = (q.shape[1], q.shape[0]) if q.dim() == 3 else \
                (q.shape[0], q.shape[2], q.shape[1])
            return (torch.zeros(q.shape, dtype=kw["out_dtype"]),
                    torch.zeros(lse_shape, dtype=torch.float32))
        return attn_fwd

    monkeypatch.setattr(F8, "select_backend", lambda *a, **kw: "triton")
    monkeypatch.setattr(fwd_hopper, "unsupported", lambda *a, **kw: None)
    hopper = fake("hopper")
    monkeypatch.setattr(fwd_hopper, "forward", lambda q, k, v, softmax_scale, diag_offset,
                        causal, **kw: hopper(q, k, v, diag_offset=diag_offset,
                                             causal=causal, **kw))
    monkeypatch.setattr(fwd, "attn_fwd", fake("portable"))
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD", switch)
    q, k, v = (x.to(E4M3) for x in _inputs(1, seqlen_q, seqlen_q + 20, 4, 2, 128,
                                           torch.float32, "cpu"))
    scale = torch.tensor(0.5)
    if varlen:
        cu_q = torch.tensor([0, seqlen_q], dtype=torch.int32)
        cu_k = torch.tensor([0, seqlen_q + 20], dtype=torch.int32)
        flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, seqlen_q,
                                         seqlen_q + 20, causal=True, k_descale=scale)
    else:
        flashtile.flash_attn_func(q, k, v, causal=True, k_descale=scale)
    assert list(seen) == [used]
    kw = seen[used]
    assert kw["k_descale"].shape == (1, 2) and kw["q_descale"] is None
    assert kw["out_dtype"] == torch.bfloat16
    if used == "hopper":
        assert kw["diag_offset"] == 20 and kw["causal"]


def test_schedule_switch_rejects_other_values(monkeypatch):
    """FLASHTILE_HOPPER_FWD_SCHEDULE: "auto" when unset or empty (persistent for 16-bit
    d64 and d128 only), "tiles" or "persistent" when named, a ValueError naming the
    choices otherwise."""
    from flashtile.ops import configs

    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_SCHEDULE", "lpt")
    with pytest.raises(ValueError, match=re.escape(
            "FLASHTILE_HOPPER_FWD_SCHEDULE must be one of ('auto', 'tiles', "
            "'persistent'), got 'lpt'")):
        configs.hopper_fwd_persistent(128, False)
    for value in ("", "auto", None):
        if value is None:
            monkeypatch.delenv("FLASHTILE_HOPPER_FWD_SCHEDULE")
        else:
            monkeypatch.setenv("FLASHTILE_HOPPER_FWD_SCHEDULE", value)
        assert configs.hopper_fwd_persistent(128, False)
        assert not configs.hopper_fwd_persistent(128, True)
        assert configs.hopper_fwd_persistent(64, False)
        # d256: persistent up to 4k queries (it lost 7% causal at 16k).
        assert configs.hopper_fwd_persistent(256, False, 4096)
        assert not configs.hopper_fwd_persistent(256, False, 4097)
        assert not configs.hopper_fwd_persistent(256, True, 1024)
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_SCHEDULE", "persistent")
    assert configs.hopper_fwd_persistent(64, False) and configs.hopper_fwd_persistent(128, True)
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_SCHEDULE", "tiles")
    assert not configs.hopper_fwd_persistent(128, False)


@on_hopper
def test_graph_capture_of_a_new_geometry(monkeypatch):
    """The default schedule (persistent at bf16 d128) captured in a CUDA graph for a
    geometry no eager call of it made (the tiles grid, no copy inside the capture), then
    after an eager call made its table (the persistent grid): each replay gives the
    float64 reference's numbers for the inputs copied in."""
    from flashtile.ops import _launch

    monkeypatch.setattr(fwd_hopper, "_SCHEDULES", {})
    _launch.clear()
    try:
        for warm_up in ("tiles", "auto"):
            q, k, v = _inputs(2, 333, 517, 4, 2, 128, torch.bfloat16)
            # The eager warm-up compiles the kernel (outside the capture, as graph users
            # do); "tiles" leaves the persistent table unmade.
            monkeypatch.setenv("FLASHTILE_HOPPER_FWD_SCHEDULE", warm_up)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fwd_hopper.attn_fwd(q, k, v, **_kw(True, 184, 0.1))
            torch.cuda.current_stream().wait_stream(stream)
            monkeypatch.delenv("FLASHTILE_HOPPER_FWD_SCHEDULE")
            made = len(fwd_hopper._SCHEDULES)
            assert made == (warm_up == "auto")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, lse = fwd_hopper.attn_fwd(q, k, v, **_kw(True, 184, 0.1))
            assert len(fwd_hopper._SCHEDULES) == made
            for x in (q, k, v):
                x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            _check(out, lse, q, k, v, True, 184, 0.1)
    finally:
        _launch.clear()


def test_persistent_schedule_is_not_made_inside_a_graph_capture(monkeypatch):
    """A geometry's first persistent call inside a CUDA-graph capture gets no table (its
    copy to the device would break the capture: the caller takes the tiles grid); a
    table made before the capture is handed out inside it."""
    q, k = torch.empty(2, 300, 4, 128), torch.empty(2, 500, 2, 128)
    made = []
    monkeypatch.setattr(fwd_hopper, "_schedule_table",
                        lambda *key: made.append(key) or torch.zeros(3, 2))
    monkeypatch.setattr(fwd_hopper, "_SCHEDULES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fwd_hopper._persistent_schedule(q, k, True, 200) is None and made == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    table = fwd_hopper._persistent_schedule(q, k, True, 200)
    assert len(made) == 1 and made[0][1:] == (300, 500, 128, 4, 8, 2, 200, 128, 128)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fwd_hopper._persistent_schedule(q, k, True, 200) is table and len(made) == 1
    # Full attention (diag_offset not part of the geometry) is another table.
    assert fwd_hopper._persistent_schedule(q, k, False, 200) is None


def test_packed_p_switch(monkeypatch):
    """FLASHTILE_HOPPER_FWD_P_PACKED: "1" (the default), which packs 16-bit P in
    registers on every grid, or "0"; anything else is a ValueError naming the variable."""
    from flashtile.ops import configs

    monkeypatch.delenv("FLASHTILE_HOPPER_FWD_P_PACKED", raising=False)
    assert configs.hopper_fwd_p_packed_choice() == "1"
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_P_PACKED", "all")
    with pytest.raises(ValueError, match="FLASHTILE_HOPPER_FWD_P_PACKED must be one of "
                       "\\('1', '0'\\), got 'all'"):
        configs.hopper_fwd_p_packed_choice()
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_P_PACKED", "0")
    assert configs.hopper_fwd_p_packed_choice() == "0"
    assert not configs.hopper_fwd_p_packed("0", False)
    assert configs.hopper_fwd_p_packed("1", False)
    assert not configs.hopper_fwd_p_packed("1", True)  # FP8: P's own modes


def test_fp8_p_switch_rejects_other_values(monkeypatch):
    from flashtile.ops import configs

    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_P", "shared")
    with pytest.raises(ValueError, match="FLASHTILE_HOPPER_FWD_FP8_P must be one of "
                       "\\('regs', 'smem', 'swap'\\), got 'shared'"):
        configs.hopper_fwd_fp8_p_smem()
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_P", "regs")
    assert configs.hopper_fwd_fp8_p_smem() == 0
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_P", "smem")
    assert configs.hopper_fwd_fp8_p_smem() == 1
    monkeypatch.delenv("FLASHTILE_HOPPER_FWD_FP8_P")
    assert configs.hopper_fwd_fp8_p_smem() == 2  # the default, timed faster than smem


@pytest.mark.parametrize("form", ["kernel", "torch"])
@pytest.mark.parametrize("seqlen_k,head_dim", [(1, 16), (31, 16), (32, 16), (33, 16),
                                               (100, 16), (128, 16), (129, 48), (300, 16)])
def test_fp8_v_copy_in_swap_order(seqlen_k, head_dim, form, monkeypatch):
    """fwd.keys_contiguous's swap32 (CPU; kernel: fwd._keys_contiguous_kernel, in the
    interpreter; torch: its PyTorch form): within each 32 keys, key 8j + 2q + r sits at
    8q + 2j + r, the copy reaches the next multiple of 32 with zeros in the places of
    keys a partial last 32 lacks and in the padding; P with its columns in the kernel's
    order (fwd_hopper._p_stored's reshape and permute, here in torch) times that copy is
    P V. v is a strided view (every stride but the head dim's off its shape)."""
    from flashtile.ops import fwd
    from flashtile.ops.fwd import FP8_V_PAD, keys_contiguous

    if form == "torch":
        monkeypatch.setattr(fwd, "interpreting", lambda: False)
    elif not fwd.interpreting():
        pytest.skip("the kernel runs on CPU tensors in the interpreter only")
    whole = (torch.randn(2, seqlen_k, 5, 2 * head_dim) * 4).to(torch.float8_e4m3fn)
    v = whole[:, :, 1:4, :head_dim]
    swapped = keys_contiguous(v, FP8_V_PAD, swap32=True)
    n32 = -(-seqlen_k // 32) * 32
    assert swapped.shape == (2, n32, 3, head_dim) and swapped.stride(1) == 1
    expected = torch.zeros(2, n32, 3, head_dim, dtype=torch.uint8)
    for key in range(seqlen_k):
        c = key % 32
        expected[:, key - c + 8 * (c // 2 % 4) + 2 * (c // 8) + c % 2] = \
            v.view(torch.uint8)[:, key]
    assert torch.equal(swapped.view(torch.uint8), expected)
    padded = swapped.permute(0, 2, 3, 1).view(torch.uint8)  # the storage's full rows
    rows = torch.as_strided(padded, (2, 3, head_dim, -(-seqlen_k // FP8_V_PAD) * FP8_V_PAD),
                            padded.stride())
    assert not rows[..., n32:].any()
    p = torch.rand(5, n32, dtype=torch.float64)
    p[:, seqlen_k:] = 0  # masked scores
    p_stored = p.reshape(5, n32 // 32, 4, 4, 2).permute(0, 1, 3, 2, 4).reshape(5, n32)
    v64 = torch.nn.functional.pad(v.double(), (0, 0, 0, 0, 0, n32 - seqlen_k))
    torch.testing.assert_close(torch.einsum("mn,bnhd->bmhd", p_stored, swapped.double()),
                               torch.einsum("mn,bnhd->bmhd", p, v64), rtol=1e-12, atol=1e-12)
    in_order = keys_contiguous(v, FP8_V_PAD)  # the other ways P goes: v's own order
    assert in_order.shape == v.shape and in_order.stride(1) == 1
    assert torch.equal(in_order.view(torch.uint8), v.view(torch.uint8))
    padded = in_order.permute(0, 2, 3, 1).view(torch.uint8)
    rows = torch.as_strided(padded, rows.shape, padded.stride())
    assert torch.equal(rows[..., :seqlen_k], v.view(torch.uint8).permute(0, 2, 3, 1))
    assert not rows[..., seqlen_k:].any()
