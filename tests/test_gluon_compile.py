"""Compile the Gluon Hopper kernels (flashtile/ops/fwd_hopper.py, bwd_hopper.py) for sm_90
on the CPU.

Gluon kernels do not run in the Triton interpreter, so this is what CI can check of
them: every table entry compiles, fits in shared memory, does not spill, and keeps the
FA3 schedule's pieces (TMA loads, wgmma with P from registers, register reallocation
between the producer and the consumers). tests/test_fwd_hopper.py and
tests/test_bwd_hopper.py check the numbers on a GPU. About 2 s per variant on one core.
"""

import os
import re
import subprocess

import pytest
import torch

from flashtile.ops import configs
from tests.aot import compile_kernel, resources

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs real Triton compilation (no interpreter)")


def _compile(head_dim, causal, dtype=torch.bfloat16, descales=True, p_smem=False,
             persistent=False, q_bufs=None, tree_max="auto", packed="1"):
    """The kernel a launch of ``fwd_hopper.forward`` compiles for these inputs (FP8: out
    in bfloat16, descales given or not, V through its keys-contiguous copy; q_bufs: the
    Q sets asked for, None for the launcher's default; tree_max and packed:
    FLASHTILE_HOPPER_FWD_TREE_MAX's and FLASHTILE_HOPPER_FWD_P_PACKED's values)."""
    from triton.runtime.jit import mangle_type

    from flashtile.ops import fwd_hopper

    fp8 = dtype.itemsize == 1
    cfg = configs.hopper_fwd_config(head_dim, fp8=fp8)
    rows = fwd_hopper.BLOCK_M_WG.value
    x = torch.empty(2, 300, 4, head_dim, dtype=dtype)  # the launcher's descriptors, on CPU
    out = torch.empty(x.shape, dtype=torch.bfloat16 if fp8 else dtype)
    types = dict(q_desc=mangle_type(fwd_hopper._descriptor(x, (1, rows, 1, head_dim))),
                 k_desc=mangle_type(fwd_hopper._descriptor(x, (1, cfg.block_n, 1, head_dim))),
                 v_desc=mangle_type(fwd_hopper._v_descriptor(x, cfg.block_n, head_dim)),
                 o_desc=mangle_type(fwd_hopper._descriptor(out, (1, rows, 1, head_dim))),
                 softmax_scale="fp32", Schedule="*i32")
    has = fp8 and descales
    if q_bufs is None:  # as the launcher asks: two sets at d64's persistent grid
        q_bufs = configs.hopper_fwd_q_buffers(head_dim) if persistent and not fp8 else 1
    flags = dict(IS_CAUSAL=causal, STAGES=cfg.num_stages, HAS_Q_DESCALE=has,
                 HAS_K_DESCALE=has, HAS_V_DESCALE=has,
                 PV_PER_TILE=fp8 and configs.hopper_fwd_fp8_pv_per_tile(head_dim),
                 P_SMEM=p_smem, PERSISTENT=persistent, NUM_WG=cfg.block_m // rows,
                 Q_BUFS=fwd_hopper._q_buffers(q_bufs, head_dim, cfg),
                 TREE_MAX=configs.hopper_fwd_tree_max(tree_max, cfg.block_m // rows, fp8),
                 P_PACKED=configs.hopper_fwd_p_packed(packed, fp8))
    return compile_kernel(fwd_hopper._attn_fwd_hopper_kernel, flags,
                          num_warps=cfg.num_warps, types=types)


def _sass(compiled) -> str:
    import tempfile

    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


SCHEDULES = [False, True]
SCHEDULE_IDS = ["tiles", "persistent"]


@pytest.mark.parametrize("persistent", SCHEDULES, ids=SCHEDULE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", sorted(configs.HOPPER_FWD_16BIT))
def test_hopper_forward_compiles_for_sm90(head_dim, causal, persistent):
    """Both schedules (configs.hopper_fwd_persistent). Persistent: O gets a buffer of
    its own where it fits (d64, d128: Q's buffer then goes back to the producer after
    the last S), d256 keeps storing O through Q's; d64 keeps two Q sets."""
    ck = _compile(head_dim, causal, persistent=persistent)
    res = resources(ck)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    cfg = configs.HOPPER_FWD_16BIT[head_dim]
    tile = 64 * head_dim * 2  # one warpgroup's 16-bit Q (or O) tile, bytes
    q_sets = 2 if persistent and head_dim == 64 else 1
    ring = q_sets * 2 * tile + cfg.num_stages * 2 * cfg.block_n * head_dim * 2
    own_o = persistent and head_dim <= 128
    assert ring + own_o * 2 * tile <= res["shared_bytes"] < ring + (own_o + 1) * 2 * tile
    assert res["stack_bytes"] == 0, res  # no spills under the 240-register cap
    ptx = ck.asm["ptx"]
    # 12 warps: the default partition's consumer warpgroup, the second consumer, and the
    # producer warp padded to a warpgroup.
    assert ck.metadata.num_warps == 12
    # Register reallocation happened: the producer drops to 24, the consumers rise to
    # 240 (ptxas ignores setmaxnreg without a register cap at entry: .maxnreg is set).
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx and ".maxnreg" in ptx
    assert "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier" in ptx  # TMA loads
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx  # TMA store of O
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    # Q K^T reads both operands from shared memory (descriptors); P V takes P from
    # registers: its A operand is a register list, not a 64-bit descriptor.
    from_registers = [line for line in mma if line.count("{") == 2]
    assert mma and from_registers and len(from_registers) < len(mma)
    # P reaches the second product without a round trip through shared memory: the only
    # shared stores are O's (stmatrix) and a few scalars.
    assert "st.shared.v4" not in ptx and "ld.shared.v4" not in ptx
    sass = _sass(ck)
    assert "HGMMA" in sass and "LDL" not in sass and "STL" not in sass


def _computing_walks(sass: str) -> list[list[str]]:
    """``_walks`` less the loops that hold a tile's end (O's stmatrix stores)."""
    return [body for body in _walks(sass) if not any("STSM" in op for op in body)]


def _assert_walk_local_memory(walks, three_persistent):
    """No local memory in the walks, but for three consumers on the persistent grid with
    P packed (the default, 160 registers): at most 2 stores a walk block and their
    loads (NOTES.md section 45)."""
    stores = [sum(op.startswith("STL") for op in body) for body in walks]
    if three_persistent:
        assert max(stores) <= 2, stores
    else:
        assert not any(op.startswith(("STL", "LDL")) for body in walks for op in body)


@pytest.mark.parametrize("persistent", SCHEDULES, ids=SCHEDULE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,config", [(64, None), (128, None), (256, None),
                                             (64, "192,128,4,3")],
                         ids=["d64", "d128", "d256", "d64-three"])
def test_packed_p_leaves_no_prmt_in_the_walks(head_dim, config, causal, persistent,
                                              monkeypatch):
    """FLASHTILE_HOPPER_FWD_P_PACKED=1 (the default): P crosses the walk's loop edge in
    packed 32-bit registers, so the walks re-pack nothing (no PRMT; the operand's form,
    "0", has 32 a block at d64, 16 at d256) and still take P V's A operand from
    registers, without spills, but for three consumers on the persistent grid (160
    registers): there 24 bytes of stack and at most 2 local stores in a walk block,
    which still ran 2-5% faster than the operand's PRMT (NOTES.md section 45)."""
    if config:
        monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", config)
    ck = _compile(head_dim, causal, persistent=persistent)
    spills = bool(config and persistent)
    assert resources(ck)["stack_bytes"] <= (24 if spills else 0)
    mma = [line for line in ck.asm["ptx"].splitlines() if "wgmma.mma_async" in line]
    assert any(line.count("{") == 2 for line in mma)  # P V's A from registers
    walks = _computing_walks(_sass(ck))
    assert walks and not any(op.startswith("PRMT") for body in walks for op in body)
    _assert_walk_local_memory(walks, spills)
    if head_dim == 64 and not config and not (causal or persistent):  # the operand's form
        unpacked = _computing_walks(_sass(_compile(64, False, packed="0")))
        assert min(sum(op.startswith("PRMT") for op in body) for body in unpacked) == 32
        assert all(len(a) >= len(b) + 20 for a, b in zip(unpacked, walks))


@pytest.mark.parametrize("config", [None, "192,128,4,3"], ids=["two", "three"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_forward_two_q_sets_compile_for_sm90(head_dim, causal, config, monkeypatch):
    """Q_BUFS 2 (FLASHTILE_HOPPER_FWD_Q_BUFFERS, the persistent grid): one more Q set
    beside the ring and O's own buffer (d128's two consumers at 229,376 bytes of
    232,448), the launcher's fit rule says so, twice the Q barriers; the same local
    memory as one set (the tile loop's scalar with three consumers; in the walks only
    packed P's few words with three consumers)."""
    from flashtile.ops import fwd_hopper

    if config is not None:
        if head_dim != 64:
            pytest.skip("three consumers take 128 keys at d64 only")
        monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", config)
    cfg = configs.hopper_fwd_config(head_dim)
    assert fwd_hopper._q_buffers(2, head_dim, cfg) == 2
    one = resources(_compile(head_dim, causal, persistent=True, q_bufs=1))
    ck = _compile(head_dim, causal, persistent=True, q_bufs=2)
    res = resources(ck)
    q_set = cfg.block_m * head_dim * 2
    barriers = 2 * (cfg.block_m // 64) * 8
    # (the barriers' bytes up to alignment)
    assert 0 <= res["shared_bytes"] - one["shared_bytes"] - q_set <= barriers, (res, one)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    assert res["stack_bytes"] <= one["stack_bytes"], (res, one)
    walks = _walks(_sass(ck))
    assert len(walks) >= 2
    _assert_walk_local_memory(walks, config is not None)


def test_two_q_sets_only_where_they_fit(monkeypatch):
    """FLASHTILE_HOPPER_FWD_Q_BUFFERS: "auto" (unset: two sets at head_dim 64, one
    elsewhere), "1" or "2", else a ValueError naming it; two sets only where they fit
    beside the ring and O (not d256's 128 x 64 tiles)."""
    from flashtile.ops import fwd_hopper

    name = "FLASHTILE_HOPPER_FWD_Q_BUFFERS"
    monkeypatch.delenv(name, raising=False)
    assert [configs.hopper_fwd_q_buffers(d) for d in (64, 128, 256)] == [2, 1, 1]
    monkeypatch.setenv(name, "2")
    assert configs.hopper_fwd_q_buffers(128) == 2
    monkeypatch.setenv(name, "1")
    assert configs.hopper_fwd_q_buffers(64) == 1
    monkeypatch.setenv(name, "3")
    with pytest.raises(ValueError, match=name + r" must be one of \('auto', '1', '2'\), "
                       r"got '3'"):
        configs.hopper_fwd_q_buffers(64)
    assert fwd_hopper._q_buffers(2, 256, configs.HOPPER_FWD_16BIT[256]) == 1
    assert fwd_hopper._q_buffers(1, 64, configs.HOPPER_FWD_16BIT[64]) == 1
    assert fwd_hopper._q_buffers(2, 64, configs.HOPPER_FWD_16BIT[64]) == 2


def _exp2_under_each_pv(sass: str) -> list[int]:
    """The exp2 (MUFU.EX2) between each wait for S_j (WARPGROUP.DEPBAR.LE gsb0, 0x1:
    P_{j-1} V_{j-1} may still run) and the next wait for every product (0x0): the
    softmax a consumer computes under its own previous P V."""
    counts, n = [], None
    for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in op:
            n = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in op:
            if n is not None:
                counts.append(n)
            n = None
        elif n is not None and op.startswith("MUFU.EX2"):
            n += 1
    return counts


def _max_chain_depths(sass: str) -> list[int]:
    """For each block of each walk: the longest chain of dependent FMNMX and SHFL.BFLY
    (each reading the one before) between the wait for S_j and the block's first exp2:
    the row max's latency before any exp2 can start."""
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)
    depths, i = [], 0
    while i < len(ins):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in ins[i]:
            depth, best = {}, 0
            i += 1
            while i < len(ins) and not ins[i].startswith("MUFU.EX2"):
                m = re.match(r"(?:FMNMX|SHFL\.BFLY)\S*\s+(?:PT, )?(R\d+), (R\d+), "
                             r"(R\d+|0x[0-9a-f]+)", ins[i])
                if m:
                    d, a, b = m.groups()
                    depth[d] = 1 + max(depth.get(a, 0), depth.get(b, 0))
                    best = max(best, depth[d])
                i += 1
            depths.append(best)
        i += 1
    return depths


@pytest.mark.parametrize("config", [None, "192,128,4,3"], ids=["two", "three"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", sorted(configs.HOPPER_FWD_16BIT))
def test_tree_max_in_the_sass(head_dim, causal, config, monkeypatch):
    """TREE_MAX (FLASHTILE_HOPPER_FWD_TREE_MAX=1; auto takes it with three consumers),
    the persistent grid, unmasked and masked walks: the dependent FMNMX/shuffle chain
    before a block's first exp2 is at most 14 deep (9-14 on sm_90 in session 30; gl.max's
    one chain a row: over 30), with no local memory in the walks (three consumers:
    packed P's few words)."""
    if config is not None:
        if head_dim != 64:
            pytest.skip("three consumers take 128 keys at d64 only")
        monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", config)
    sass = _sass(_compile(head_dim, causal, persistent=True, tree_max="1"))
    depths = _max_chain_depths(sass)
    assert len(depths) >= 4 and max(depths) <= 14, depths
    _assert_walk_local_memory(_walks(sass), config is not None)
    if config is None and head_dim == 64 and not causal:  # the default's chain, beside it
        flat = _max_chain_depths(_sass(_compile(64, False, persistent=True)))
        assert min(flat) > 30, flat


@pytest.mark.parametrize("persistent", SCHEDULES, ids=SCHEDULE_IDS)
@pytest.mark.parametrize("head_dim,config", [(64, "192,128,4,3"), (256, None)],
                         ids=["d64-three", "d256"])
def test_causal_walks_end_per_consumer(head_dim, config, persistent, monkeypatch):
    """Causal consumers walk their own rows' key blocks and only keep the protocol for
    the tile's others (three consumers; d256's 64-key blocks): the causal kernel's walks
    issue the products and exp2 of full attention's (that loop of barrier waits holds
    none), with no local memory in them."""
    if config is not None:
        monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", config)

    def counts(sass):
        return [(sum("GMMA" in op for op in body), sum(op.startswith("MUFU.EX2")
                                                       for op in body))
                for body in _walks(sass)]

    causal = _sass(_compile(head_dim, True, persistent=persistent))
    assert counts(causal) == counts(_sass(_compile(head_dim, False, persistent=persistent)))
    assert len(counts(causal)) >= 4
    assert not any(op.startswith(("STL", "LDL")) for body in _walks(causal) for op in body)


def test_tree_max_knob(monkeypatch):
    """FLASHTILE_HOPPER_FWD_TREE_MAX: "auto" (unset), "0" or "1", else a ValueError
    naming the variable; auto is the tree for three 16-bit consumers only."""
    name = "FLASHTILE_HOPPER_FWD_TREE_MAX"
    monkeypatch.delenv(name, raising=False)
    choice = configs.hopper_fwd_tree_max_choice()
    assert choice == "auto"
    assert [configs.hopper_fwd_tree_max(choice, n, fp8) for n, fp8 in
            [(2, False), (3, False), (2, True), (3, True)]] == [False, True, False, False]
    for value, taken in (("0", False), ("1", True)):
        monkeypatch.setenv(name, value)
        choice = configs.hopper_fwd_tree_max_choice()
        assert all(configs.hopper_fwd_tree_max(choice, n, fp8) is taken
                   for n in (2, 3) for fp8 in (False, True))
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=name + r" must be one of \('auto', '0', '1'\), "
                                              r"got 'yes'"):
        configs.hopper_fwd_tree_max_choice()


# Three consumers' tiles (BLOCK_M 192): head_dim 64 with 128 keys a block (FA3's tile),
# head_dim 128 with 64 (128 keys spill 240-320 bytes under 160 registers).
THREE_CONSUMERS = {64: 128, 128: 64}


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("persistent", SCHEDULES, ids=SCHEDULE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", sorted(THREE_CONSUMERS))
def test_hopper_forward_three_consumers_compile_for_sm90(head_dim, causal, persistent,
                                                        stages, monkeypatch):
    """BLOCK_M 192 (FLASHTILE_HOPPER_FWD_CONFIG=192,BLOCK_N,4,STAGES): three consumer
    warpgroups of 64 rows taking turns in a cycle. 16 warps (the producer warp padded to
    a warpgroup); register reallocation 24 / 160 (three consumers' 160 and the
    producer's 24 a thread fit 64K registers), with no spills under that cap (but packed
    P's few words on d64's persistent grid): S, O and P a thread (d64: 64 + 32 + 32;
    d128 at 64 keys: 32 + 64 + 16). Shared memory: Q 3 x d x 128 bytes (twice on d64's
    persistent grid: two Q sets), the K/V ring, and (persistent) O's 3 x d x 128
    bytes."""
    block_n = THREE_CONSUMERS[head_dim]
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", f"192,{block_n},4,{stages}")
    ck = _compile(head_dim, causal, persistent=persistent)
    res = resources(ck)
    tile = 64 * head_dim * 2
    q_sets = 2 if persistent and head_dim == 64 else 1
    ring = q_sets * 3 * tile + stages * 2 * block_n * head_dim * 2
    assert ring + persistent * 3 * tile <= res["shared_bytes"] \
        < ring + (persistent + 1) * 3 * tile, res
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    # Persistent: ptxas keeps one 4-byte scalar of the tile loop in local memory, stored
    # and reloaded once a tile, and at d64 (P packed, the default) a few words in the
    # walks (a spilled S, O or P tile would be 128 bytes or more and stored every block).
    assert res["stack_bytes"] <= (0 if not persistent else 24 if head_dim == 64 else 8), res
    assert ck.metadata.num_warps == 16
    ptx = ck.asm["ptx"]
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t160;" in ptx and ".maxnreg" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" not in ptx
    # Each consumer's products: Q K^T from shared memory, P V with P from registers.
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    from_registers = [line for line in mma if line.count("{") == 2]
    assert mma and from_registers and len(from_registers) < len(mma)
    sass = _sass(ck)
    assert "HGMMA" in sass
    walks = _walks(sass)
    assert len(walks) >= 3
    _assert_walk_local_memory(walks, persistent and head_dim == 64)
    if not persistent:
        assert "LDL" not in sass and "STL" not in sass


@pytest.mark.parametrize("causal,persistent", [(False, False), (True, False), (False, True)],
                         ids=["full-tiles", "causal-tiles", "full-persistent"])
def test_hopper_fp8_forward_three_consumers_compile_for_sm90(causal, persistent,
                                                            monkeypatch):
    """FP8 at head_dim 128 with three consumers (192,128,4,3) and P V summed in the
    wgmma (FLASHTILE_HOPPER_FWD_FP8_PV=wgmma; per tile, the second O spills 270-300
    bytes under 160 registers): P through six shared buffers, the whole softmax under
    the previous P V, no spills (persistent: the tile loop's 4-byte scalar, outside the
    walks), within shared memory with O in a buffer of its own. Causal on the persistent
    grid spills inside the walks (72 bytes: the tile loop's state on top), as BLOCK_N
    256's does, so that pair is left out (FP8 takes the tiles grid by default)."""
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_PV", "wgmma")
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", "192,128,4,3")
    ck = _compile(128, causal, torch.float8_e4m3fn, p_smem=True, persistent=persistent)
    res = resources(ck)
    ring = 3 * 64 * 128 + 3 * 2 * 128 * 128  # Q, then K and V^T: FP8, 1 byte each
    p_buffers, o_tiles = 6 * 64 * 128, 3 * 64 * 128 * 2
    assert ring + p_buffers + o_tiles <= res["shared_bytes"] <= configs.SM90_SMEM_BYTES
    assert res["stack_bytes"] <= (8 if persistent else 0), res
    assert ck.metadata.num_warps == 16
    assert "setmaxnreg.inc.sync.aligned.u32 \t160;" in ck.asm["ptx"]
    sass = _sass(ck)
    assert "QGMMA" in sass
    walks = _walks(sass)
    assert len(walks) >= 3 and not any(op.startswith(("STL", "LDL")) for body in walks
                                       for op in body), walks
    assert _exp2_under_pv(sass) >= 64  # a consumer's whole softmax under its P V


def test_wider_head_dims_launch_the_wider_kernel():
    """configs.HOPPER_WIDER: the tensor maps over d96 tensors in d128 boxes have the
    kernel-argument types of d128's, so a d96 launch compiles (and the tests above
    check) exactly the d128 kernels, forward and backward; only the maps' shapes,
    runtime values, differ."""
    from triton.runtime.jit import mangle_type

    from flashtile.ops import bwd_hopper, fwd_hopper

    for d, tile in configs.HOPPER_WIDER.items():
        assert configs.hopper_fwd_tile_dim(d) == tile and bwd_hopper.tile_dim(d) == tile
        narrow, wide = (torch.empty(2, 300, 4, x, dtype=torch.bfloat16) for x in (d, tile))
        for box in ((1, 64, 1, tile), (1, 128, 1, tile)):
            assert mangle_type(fwd_hopper._descriptor(narrow, box)) == \
                mangle_type(fwd_hopper._descriptor(wide, box))
        assert mangle_type(fwd_hopper._v_descriptor(narrow, 128, tile)) == \
            mangle_type(fwd_hopper._v_descriptor(wide, 128, tile))
        assert mangle_type(bwd_hopper._descriptor(narrow, 64, tile)) == \
            mangle_type(bwd_hopper._descriptor(wide, 64, tile))


def test_hopper_forward_config_knob(monkeypatch):
    """FLASHTILE_HOPPER_FWD_CONFIG: BLOCK_M 128, or 192 for 16-bit inputs at head_dim 64
    only; anything else names the variable, the rule, the value and the head dim.
    Unset: the table, and 192 at 16-bit d64 from 2k queries and keys (causal) or 1k
    (full attention)."""
    # Unset: three consumers at 16-bit d64 where both lengths reach 2k (causal) or 1k
    # (full), else the table.
    monkeypatch.delenv("FLASHTILE_HOPPER_FWD_CONFIG", raising=False)
    three, two = configs.TileConfig(192, 128, 4, 3), configs.HOPPER_FWD_16BIT[64]
    assert configs.hopper_fwd_config(64, False, 2048, 2048) == three
    assert configs.hopper_fwd_config(64, False, 2048, 2047) == two
    assert configs.hopper_fwd_config(64, False, 1024, 16384) == two
    assert configs.hopper_fwd_config(64, False, 8192, 8192, causal=False) == three
    assert configs.hopper_fwd_config(64, False, 1024, 1024, causal=False) == three
    assert configs.hopper_fwd_config(64, False, 1024, 1023, causal=False) == two
    assert configs.hopper_fwd_config(64, False, 512, 16384, causal=False) == two
    assert configs.hopper_fwd_config(64, False, 1024, 1024, causal=True) == two
    assert configs.hopper_fwd_config(64) == two
    assert configs.hopper_fwd_config(64, True, 16384, 16384) == configs.HOPPER_FWD_FP8[64]
    assert configs.hopper_fwd_config(128, False, 16384, 16384) == configs.HOPPER_FWD_16BIT[128]
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", "192,128,4,3")
    assert configs.hopper_fwd_config(64) == configs.TileConfig(192, 128, 4, 3)
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", "128,128,4,3")  # the knob wins
    assert configs.hopper_fwd_config(64, False, 16384, 16384) == two
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", "192,128,4,3")
    for head_dim, fp8 in ((128, False), (256, False), (64, True)):
        with pytest.raises(ValueError, match=r"FLASHTILE_HOPPER_FWD_CONFIG must be "
                           r"'BLOCK_M,BLOCK_N,4,STAGES' with BLOCK_M 128 \(or 192 for "
                           r"16-bit inputs at head_dim 64, or 128 with BLOCK_N <= 64; FP8 "
                           rf"at head_dim 128 .*for head_dim {head_dim}"):
            configs.hopper_fwd_config(head_dim, fp8=fp8)
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", "192,64,4,4")
    assert configs.hopper_fwd_config(128) == configs.TileConfig(192, 64, 4, 4)
    # FP8: three consumers only with P V in the wgmma (no second O in registers).
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", "192,128,4,3")
    with pytest.raises(ValueError, match="FLASHTILE_HOPPER_FWD_FP8_PV=wgmma"):
        configs.hopper_fwd_config(128, fp8=True)
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_PV", "wgmma")
    assert configs.hopper_fwd_config(128, fp8=True) == configs.TileConfig(192, 128, 4, 3)
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", "64,128,4,3")
    with pytest.raises(ValueError, match="BLOCK_M 128"):
        configs.hopper_fwd_config(64)


def test_hopper_forward_compiles_for_fp16():
    ck = _compile(128, True, torch.float16)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in ck.asm["ptx"]
    assert resources(ck)["stack_bytes"] == 0


def _exp2_under_pv(sass: str) -> int:
    """The most exp2 (MUFU.EX2) the SASS runs between a block's wait for S_j alone
    (``DEPBAR.LE gsb0, 0x1``: P_{j-1} V_{j-1} may still run) and its wait for P V
    (``0x0``): the softmax work that overlaps the warpgroup's own P V."""
    return max(_exp2_under_each_pv(sass), default=0)


@pytest.mark.parametrize("persistent", SCHEDULES, ids=SCHEDULE_IDS)
@pytest.mark.parametrize("p_smem", [0, 1, 2], ids=["p-regs", "p-smem", "p-swap"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", sorted(configs.HOPPER_FWD_FP8))
def test_hopper_fp8_forward_compiles_for_sm90(head_dim, causal, p_smem, persistent):
    """The FP8 variants: both products on 8-bit wgmma (QGMMA in SASS), V^T and Q by TMA,
    O stored by TMA from its own bfloat16 buffer, P cast to e4m3 saturating; they fit
    shared memory without spilling, with P V summed per tile in fp32 (two fp32 O tiles)
    up to head_dim 128. P in registers is permuted there (no shared-memory round trip);
    P in shared memory keeps the whole softmax (BLOCK_N / 2 exp2 a thread) between the
    wait for S_j and the wait for P_{j-1} V_{j-1}, FA3's in-warpgroup overlap. P's
    stores a walk block: 2 bytes each in the keys' order (BLOCK_N / 4 of them a
    thread), 8 bytes each in the "swap" order (BLOCK_N / 16, fwd_hopper._p_stored)."""
    ck = _compile(head_dim, causal, torch.float8_e4m3fn, p_smem=p_smem,
                  persistent=persistent)
    res = resources(ck)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    assert res["stack_bytes"] == 0, res
    assert ck.metadata.num_warps == 12
    ptx = ck.asm["ptx"]
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx
    assert "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier" in ptx
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert mma and all(".f32.e4m3.e4m3" in line and "k32" in line for line in mma)
    from_registers = [line for line in mma if line.count("{") == 2]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # P to e4m3, saturating
    sass = _sass(ck)
    assert "QGMMA" in sass and "HGMMA" not in sass
    assert "LDL" not in sass and "STL" not in sass
    if p_smem:
        assert not from_registers
        block_n = configs.HOPPER_FWD_FP8[head_dim].block_n
        assert _exp2_under_pv(sass) >= block_n // 2
        stores = [[op.split()[0] for op in body if op.startswith("STS")]
                  for body in _computing_walks(sass)]
        width, count = ("STS.U16", block_n // 4) if p_smem == 1 else ("STS.64", block_n // 16)
        assert stores and all(ops == [width] * count for ops in stores), stores
    else:
        assert from_registers and len(from_registers) < len(mma)
        assert "st.shared.v4" not in ptx and "ld.shared.v4" not in ptx


@pytest.mark.parametrize("causal,persistent", [(False, False), (True, False), (False, True)],
                         ids=["full-tiles", "causal-tiles", "full-persistent"])
def test_hopper_fp8_forward_block_n_256_compiles_for_sm90(causal, persistent, monkeypatch):
    """FP8 at head_dim 128 with 256 keys a block (half the per-block barriers, turns,
    row reductions and O rescales of 128): only with P in shared memory and P V summed
    in the wgmma (FLASHTILE_HOPPER_FWD_FP8_PV=wgmma); with P V per tile the second O
    tile spills (336 bytes with P in registers, 616 in shared memory). O (2 x 16 KiB)
    does not fit beside the ring and P's 64 KiB: it is staged in each warpgroup's first
    P buffer (the same 16 KiB) after the last P V. Causal on the persistent grid spills
    (144 bytes: the tile loop's state on top), so that pair is left out."""
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_FP8_PV", "wgmma")
    monkeypatch.setenv("FLASHTILE_HOPPER_FWD_CONFIG", "128,256,4,2")
    ck = _compile(128, causal, torch.float8_e4m3fn, p_smem=True, persistent=persistent)
    res = resources(ck)
    ring = 2 * 64 * 128 + 2 * 2 * 256 * 128  # Q, then K and V^T: FP8, 1 byte each
    p_buffers = 4 * 64 * 256
    assert ring + p_buffers <= res["shared_bytes"] < ring + p_buffers + 2 * 64 * 128 * 2
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    assert res["stack_bytes"] == 0, res
    sass = _sass(ck)
    assert "LDL" not in sass and "STL" not in sass and "QGMMA" in sass
    assert "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3" in ck.asm["ptx"]
    assert _exp2_under_pv(sass) >= 128  # the whole softmax under P_{j-1} V_{j-1}


def test_hopper_fp8_forward_compiles_for_e5m2_without_descales():
    ck = _compile(128, False, torch.float8_e5m2, descales=False)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e5m2" in ck.asm["ptx"]
    assert resources(ck)["stack_bytes"] == 0


def _compile_mla(stages, causal, paged, dtype=torch.bfloat16):
    """The kernel a launch of ``decode_mla_hopper.attn_decode`` compiles: q (b, 1, 128,
    576), a pool of 64-key pages (or contiguous caches) of 576 columns, V its first 512;
    the tile of configs.hopper_mla_decode_config with ``stages`` ring stages."""
    from triton.runtime.jit import mangle_type

    from flashtile.ops import decode_mla_hopper as mla

    q = torch.empty(2, 1, 128, 576, dtype=dtype)  # the launcher's descriptors, on CPU
    cache = torch.empty(64, 64, 1, 576, dtype=dtype)
    descs = mla.descriptors(q, cache, configs.hopper_mla_decode_config().block_n)
    names = ("q_lat_desc", "q_rope_desc", "k_lat_desc", "k_rope_desc")
    types = dict(zip(names, map(mangle_type, descs)), softmax_scale="fp32",
                 Out="*bf16" if dtype == torch.bfloat16 else "*fp16")
    return compile_kernel(mla._mla_decode_hopper_kernel,
                          dict(STAGES=stages, IS_CAUSAL=causal, PAGED=paged,
                               PAGE_SIZE=64 if paged else 1), num_warps=4, types=types)


def _longest_s_chain(sass: str) -> int:
    """The most m64n32k16 wgmma (S = Q K^T) the SASS issues between two waits."""
    best = run = 0
    for line in sass.splitlines():
        if "HGMMA.64x32x16" in line:
            run += 1
            best = max(best, run)
        elif "WARPGROUP.DEPBAR" in line:
            run = 0
    return best


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("stages", sorted({3, configs.HOPPER_MLA_DECODE.num_stages}))
def test_hopper_mla_decode_compiles_for_sm90(stages, causal, paged):
    """The Gluon absorbed-MLA decode (ops/decode_mla_hopper.py) at the ring depths the
    mla stage times: within shared memory (Q 72 KiB, 36 KiB a stage, P 8 KiB), no
    spills under the 240-register cap (Q's descriptors are not loop invariants there:
    as such they took 72 registers and spilled), both products on wgmma from shared
    memory, S = Q K^T one chain of 36 m64n32k16 (ptxas serialized every wgmma when a
    product was in flight across the loop's back edge, C7514), and the softmax of S_t
    under the other warpgroup's P_{t-1} V_{t-1} (at least BLOCK_N / 2 exp2 a thread
    between the wait for S_t alone and the wait for that P V)."""
    ck = _compile_mla(stages, causal, paged)
    res = resources(ck)
    used = 64 * 576 * 2 + stages * 32 * 576 * 2 + 2 * 64 * 32 * 2
    assert used <= res["shared_bytes"] <= min(used + 2048, configs.SM90_SMEM_BYTES), res
    assert res["stack_bytes"] == 0, res
    assert ck.metadata.num_warps == 12
    ptx = ck.asm["ptx"]
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx and ".maxnreg" in ptx
    assert "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier" in ptx  # Q
    assert "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier" in ptx  # K tiles
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert any("m64n32k16.f32.bf16.bf16" in line for line in mma)
    assert any("m64n256k16.f32.bf16.bf16" in line for line in mma)
    assert all(line.count("{") == 1 for line in mma)  # A from shared memory: P too
    sass = _sass(ck)
    assert "HGMMA" in sass and "LDL" not in sass and "STL" not in sass
    assert _longest_s_chain(sass) == 576 // 16
    assert _exp2_under_pv(sass) >= configs.HOPPER_MLA_DECODE.block_n // 2


def test_hopper_mla_decode_compiles_for_fp16():
    ck = _compile_mla(configs.HOPPER_MLA_DECODE.num_stages, False, True, torch.float16)
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in ck.asm["ptx"]
    assert resources(ck)["stack_bytes"] == 0


def _compile_bwd(head_dim, causal, dtype=torch.bfloat16, opts=None, stages=None,
                 block_m=None):
    """The kernel a launch of ``bwd_hopper.backward`` compiles for these inputs, with the
    FLASHTILE_HOPPER_BWD_OPTS options ``opts`` (None: the default's, () for none) and
    the table's STAGES and BLOCK_M unless given (head dim 256: bwd_hopper256's kernel,
    which takes dq_tma alone)."""
    from triton.runtime.jit import mangle_type

    from flashtile.ops import bwd_hopper, bwd_hopper256

    if head_dim == 256:
        cfg, kernel = configs.HOPPER_BWD_D256, bwd_hopper256._attn_bwd_hopper256_kernel
    else:
        cfg, kernel = configs.HOPPER_BWD_16BIT[head_dim], bwd_hopper._attn_bwd_hopper_kernel
    block_m = block_m or cfg.block_m
    x = torch.empty(2, 300, 4, head_dim, dtype=dtype)  # the launcher's descriptors, on CPU
    q_type = mangle_type(bwd_hopper._descriptor(x, block_m, head_dim))
    kv_type = mangle_type(bwd_hopper._descriptor(x, bwd_hopper.BLOCK_N_WG.value, head_dim))
    types = dict(q_desc=q_type, do_desc=q_type, k_desc=kv_type, v_desc=kv_type,
                 dk_desc=kv_type, dv_desc=kv_type, softmax_scale="fp32")
    opts = configs.HOPPER_BWD_DEFAULT_BY_DIM.get(head_dim, configs.HOPPER_BWD_DEFAULT_OPTS) \
        if opts is None else frozenset(opts)
    flags = dict(bwd_hopper.kernel_flags(head_dim, causal, opts, block_m),
                 STAGES=stages or cfg.num_stages)
    if flags.get("DQ_TMA"):  # the accumulator's tensor map, not its address
        dq_accum = torch.empty(2, 4, 300, head_dim, dtype=torch.float32)
        types["DQAccum"] = mangle_type(bwd_hopper._dq_descriptor(
            dq_accum, block_m))
    if flags.get("LSE_SMEM"):  # lse and delta: (batch * nheads, seqlen_q) tensor maps
        rows = mangle_type(bwd_hopper._rows_descriptor(
            torch.empty(2, 4, 300, dtype=torch.float32), block_m))
        types.update(Lse=rows, Delta=rows)
    return compile_kernel(kernel, flags, num_warps=cfg.num_warps, types=types)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", sorted(configs.HOPPER_BWD_16BIT))
def test_hopper_backward_compiles_for_sm90(head_dim, causal):
    """The atomics' schedule (lse_ahead alone, the default until dq_tma joined it in
    session 17; test_hopper_backward_dq_tma_compiles_for_sm90 compiles the default)."""
    ck = _compile_bwd(head_dim, causal, opts=("lse_ahead",))
    res = resources(ck)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    _assert_smem_model(res, head_dim, causal, ("lse_ahead",))
    sass = _sass(ck)
    # No tile spills under the 240-register cap. At head_dim 128 ptxas keeps a dozen
    # 4-byte scalars (addresses, tile coordinates) in local memory, 56 bytes with
    # lse_ahead (48 without), a few of them reloaded per query block; the
    # smallest tile, a 16-bit 64 x 64 operand, is 64 bytes a thread, and spilling one
    # would show as a larger stack. Nothing is stored inside the walks.
    assert res["stack_bytes"] <= (0 if head_dim == 64 else 56), res
    assert not any(_walk_local_stores(sass))
    assert "HGMMA" in sass
    ptx = ck.asm["ptx"]
    _assert_backward_partitions(ck)
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    # dV += P^T dO and dK += dS^T Q take their A operand from registers (a register
    # list, not a 64-bit descriptor); S^T, dP^T and dQ read both from shared memory.
    from_registers = [line for line in mma if line.count("{") == 2]
    assert mma and from_registers and len(from_registers) < len(mma)
    # dQ's partial sums: relaxed fp32 atomics, two values per instruction.
    assert "atom.global.gpu.relaxed.add.v2.f32" in ptx


def _assert_smem_model(res, head_dim, causal, opts, block_m=64, stages=None):
    """bwd_hopper.smem_bytes (what check_fits refuses by) is the compiled kernel's
    shared memory less at most 2 KiB of barriers and layout-conversion scratch (656
    bytes at BLOCK_M 64, 1,120 at 128)."""
    from flashtile.ops import bwd_hopper

    flags = bwd_hopper.kernel_flags(head_dim, causal, frozenset(opts), block_m)
    stages = stages or configs.HOPPER_BWD_16BIT[head_dim].num_stages
    model = bwd_hopper.smem_bytes(head_dim, block_m, stages, flags)
    assert model <= res["shared_bytes"] <= model + 2048, (model, res)


def _assert_backward_partitions(ck):
    """The backward's warp specialisation: two consumer warpgroups beside the producer's
    (12 warps), register reallocation (ptxas ignores setmaxnreg without a register cap
    at entry: .maxnreg is set), TMA loads of Q, K, V, dO and TMA stores of dK, dV."""
    ptx = ck.asm["ptx"]
    assert ck.metadata.num_warps == 12
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx and ".maxnreg" in ptx
    assert "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier" in ptx
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx


def test_hopper_backward_compiles_for_fp16():
    ck = _compile_bwd(128, True, torch.float16)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in ck.asm["ptx"]
    # the default's options (lse_smem, dq_tma)
    assert resources(ck)["stack_bytes"] <= _BWD_LSE_SMEM_STACK[(128, True)]


def _walks(sass: str) -> list[list[str]]:
    """The instructions of each innermost loop of the SASS that holds wgmma: the
    consumers' walks over the query blocks (and the mbarrier retry paths that jump back
    into them)."""
    line = r"/\*([0-9a-f]{4,})\*/\s+([^;]*);"  # /*address*/ instruction ;
    ins = [(int(a, 16), op) for a, op in re.findall(line, sass)]
    loops = []
    for addr, op in ins:
        m = re.search(r"\bBRA 0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            body = [o for a, o in ins if int(m.group(1), 16) <= a <= addr]
            if any("HGMMA" in o or "QGMMA" in o for o in body):  # 16-bit or FP8
                loops.append((int(m.group(1), 16), addr, body))
    return [body for lo, hi, body in loops
            if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b, _ in loops)]


def _walk_local_stores(sass: str) -> list[int]:
    """STL (stores to local memory) inside each walk (``_walks``). A tile that did not
    fit the registers is stored there every query block; the scalars ptxas keeps in
    local memory are stored before the walk and only reloaded in it."""
    return [sum(o.startswith("STL") for o in body) for body in _walks(sass)]


# Where the walks store a few words to local memory since session 28 branched over the
# softmax's mask in blocks that need none (bwd_hopper._p_t): (options, head dim, BLOCK_M,
# causal) -> the most stores in one walk. The default's d128 causal walks are among them
# and still ran forward + backward 4-6% faster (NOTES.md section 38).
_WALK_STORES = {
    (("lse_smem", "dq_tma", "ds_ring"), 128, 64, True): 6,
}


def _walk_stores_allowed(opts, head_dim, block_m, causal) -> int:
    return _WALK_STORES.get((tuple(opts), head_dim, block_m, causal), 0)


def _early_release(sass: str) -> bool:
    """Whether an mbarrier arrive precedes dQ atomics with no wgmma between: dS^T's
    buffer released before the atomics of the last dQ piece, which the schedule does
    after them."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)
    arrived = False
    for op in ops:
        if "SYNCS.ARRIVE" in op:
            arrived = True
        elif "HGMMA" in op:
            arrived = False
        elif "REDG" in op and arrived:
            return True
    return False


def _dq_behind_dkv(sass: str) -> bool:
    """Whether a product with its A operand in shared memory (S^T, dP^T, dQ) is issued
    after dV or dK (A from registers) with no wgmma wait between: the dQ product queued
    behind them (FA3's order). Here dV and dK are waited for first."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)
    in_flight = False
    for op in ops:
        if re.match(r"HGMMA\.\S+ R\d+, R\d+,", op):
            in_flight = True
        elif "WARPGROUP.DEPBAR" in op:
            in_flight = False
        elif re.match(r"HGMMA\.\S+ R\d+, gdesc", op) and in_flight:
            return True
    return False


@pytest.mark.parametrize("opts", [("lse_ahead",), ()], ids=["lse_ahead", "none"])
def test_hopper_backward_atomics_schedules(opts):
    """The atomics' kernels (lse_ahead, the default before dq_tma, and no option): dQ atomics masked (a
    branch around each) and after the product's last read of dS^T, S^T waited alone, no
    local stores in the walks, dV and dK waited for before the dQ product; lse's load
    waited for before S^T's issue only without lse_ahead."""
    sass = _sass(_compile_bwd(128, True, opts=opts))
    assert "BSSY" in sass and not _early_release(sass)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in sass
    assert "REDG.E.ADD.F32x2" in sass and not any(_walk_local_stores(sass))
    assert bool(_loads_waited_before_mma(sass)) == (opts == ())
    assert not _dq_behind_dkv(sass)


def _loads_waited_before_mma(sass: str) -> int:
    """Global loads (LDG) inside the walks (``_walks``) whose value an instruction reads
    before the next wgmma issue: a load on the walk's path (lse, converted through
    shared memory before S^T)."""
    return sum(_waited_loads(body) for body in _walks(sass))


def _waited_loads(ops: list[str]) -> int:
    waited = 0
    for i, op in enumerate(ops):
        m = re.match(r"(?:@!?U?P\w+\s+)?LDG\S*\s+(R\d+),", op)
        if not m:
            continue
        reg = re.compile(rf"\b{m.group(1)}\b")
        for later in ops[i + 1:]:
            if "HGMMA" in later:
                break
            # Read: named past the first operand, or anywhere in a store.
            body = later.split(None, 1)[-1]
            sources = body if later.lstrip("@!P0123456789 ").startswith("ST") \
                else body.split(",", 1)[-1]
            if "," in body and reg.search(sources):
                waited += 1
                break
    return waited


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_backward_skip_masked_compiles_for_sm90(head_dim):
    """skip_masked (causal; session 32; head_dim 128's default since session 33) beside
    the options it joins: the same shared memory, no more local memory and no more
    stores in the walks (the skip arm, a zero dS^T stored and the protocol, sits in the
    walk loop beside the block's products)."""
    base_opts = tuple(sorted(configs.HOPPER_BWD_DEFAULT_OPTS))
    ck = _compile_bwd(head_dim, True, opts=base_opts + ("skip_masked",))
    base = _compile_bwd(head_dim, True, opts=base_opts)
    res, ref = resources(ck), resources(base)
    assert res["shared_bytes"] == ref["shared_bytes"], (res, ref)
    assert res["stack_bytes"] <= ref["stack_bytes"], (res, ref)
    skip_stores = _walk_local_stores(_sass(ck))
    assert len(skip_stores) >= 2
    assert max(skip_stores) <= max(_walk_local_stores(_sass(base))), skip_stores


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_backward_lse_pre_compiles_for_sm90(head_dim, causal):
    """lse_pre (session 34; the default since session 38) against each head dim's
    default options without it: the walks read lse (in base 2) and delta as the
    preprocess wrote them, with no conversion or mask (no FSETP: the 16 a block without
    it are lse's -inf tests), each consumer's walk at least 12% shorter (sm_90: d64 530
    -> 433, d128 causal 850 -> 723 instructions), the same shared memory, and local
    memory as without it (d64 none; d128's stores before its walks, a word or two in
    them)."""
    default = configs.hopper_bwd_opts(head_dim)
    assert "lse_pre" in default
    ck = _compile_bwd(head_dim, causal, opts=tuple(sorted(default)))
    base = _compile_bwd(head_dim, causal, opts=tuple(sorted(default - {"lse_pre"})))
    res, ref = resources(ck), resources(base)
    assert res["shared_bytes"] == ref["shared_bytes"], (res, ref)
    sass, base_sass = _sass(ck), _sass(base)
    walks, base_walks = _walks(sass), _walks(base_sass)
    assert not any("FSETP" in op for body in walks for op in body)
    assert any("FSETP" in op for body in base_walks for op in body)
    for default_walk in [len(w) for w in base_walks][:2]:  # one a consumer
        assert any(n <= default_walk * 0.88 for n in map(len, walks)), \
            (default_walk, [len(w) for w in walks])
    if head_dim == 64:
        assert res["stack_bytes"] == 0 and not any(_walk_local_stores(sass)), res
    else:
        assert res["stack_bytes"] <= ref["stack_bytes"] + 40, (res, ref)
        assert max(_walk_local_stores(sass)) <= 2


# The options of session 14 (bwd_hopper's docstring), each with the BLOCK_M it is timed
# at and the local memory ptxas keeps (bytes, the worst of full and causal; scalars
# stored before the walk, checked by _walk_local_stores and _WALK_STORES).
_BWD_NEW_OPTS = {
    (("lse_ahead",), 64, 64): 0,
    (("lse_ahead",), 128, 64): 56,
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("opts,head_dim,block_m", list(_BWD_NEW_OPTS),
                         ids=lambda x: ",".join(x) if isinstance(x, tuple) else str(x))
def test_hopper_backward_new_options_compile_for_sm90(opts, head_dim, block_m, causal):
    """lse_ahead: no global load waited for inside a block before the next wgmma issue
    (the schedule without it waits for lse's before S^T), and the same shared memory."""
    ck = _compile_bwd(head_dim, causal, opts=opts, block_m=block_m)
    res = resources(ck)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    assert res["stack_bytes"] <= _BWD_NEW_OPTS[(opts, head_dim, block_m)], res
    sass = _sass(ck)
    walks = _walk_local_stores(sass)
    assert len(walks) >= 2, walks
    assert max(walks) <= _walk_stores_allowed(opts, head_dim, block_m, causal), walks
    assert (_loads_waited_before_mma(sass) == 0) == ("lse_ahead" in opts)
    base = _compile_bwd(head_dim, causal, opts=(), block_m=block_m)
    assert res["shared_bytes"] == resources(base)["shared_bytes"]


# dq_tma (session 15) with lse_ahead, at the BLOCK_M each is timed or tested at, and the
# local memory ptxas keeps (bytes, the worst of full and causal; scalars stored before
# the walks, reloaded in them). At head_dim 128 the walk's TMA coordinates take 24-64
# bytes more than the atomics' (56).
_BWD_TMA_OPTS = {
    (("lse_ahead", "dq_tma"), 64, 64): 0,
    (("lse_ahead", "dq_tma"), 128, 64): 120,
    (("lse_ahead", "dq_tma"), 64, 128): 128,
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("opts,head_dim,block_m", list(_BWD_TMA_OPTS),
                         ids=lambda x: ",".join(x) if isinstance(x, tuple) else str(x))
def test_hopper_backward_dq_tma_compiles_for_sm90(opts, head_dim, block_m, causal):
    """dq_tma: dQ_partial leaves through shared memory and TMA reduce-adds
    (cp.reduce.async.bulk.tensor .add, UTMAREDG in SASS), not atomics: no REDG or
    atom.global is left, each consumer has its own fp32 tiles (a 64-dim piece each)
    beside the atomics' shared memory, and nothing is stored to local memory inside the
    walks."""
    ck = _compile_bwd(head_dim, causal, opts=opts, block_m=block_m)
    res = resources(ck)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    assert res["stack_bytes"] <= _BWD_TMA_OPTS[(opts, head_dim, block_m)], res
    atomics = [o for o in opts if o != "dq_tma"]
    base = resources(_compile_bwd(head_dim, causal, opts=atomics, block_m=block_m))
    tiles = 2 * head_dim // 64
    assert res["shared_bytes"] == base["shared_bytes"] + tiles * block_m * 64 * 4
    _assert_smem_model(res, head_dim, causal, opts, block_m)
    sass = _sass(ck)
    walks = _walk_local_stores(sass)
    assert len(walks) >= 2, walks
    assert max(walks) <= _walk_stores_allowed(opts, head_dim, block_m, causal), walks
    assert "UTMAREDG.4D.ADD" in sass and not re.search(r"\bREDG\.", sass)
    ptx = ck.asm["ptx"]
    assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in ptx
    assert "atom.global" not in ptx and "red.global" not in ptx


# lse_smem (session 19) with dq_tma: the local memory ptxas keeps (bytes, scalars stored
# before the walks), by head dim and causal; lse_ahead + dq_tma keeps 0 / 64-80.
_BWD_LSE_SMEM_STACK = {(64, False): 0, (64, True): 0, (128, False): 120, (128, True): 152}


@pytest.mark.parametrize("head_dim,causal", list(_BWD_LSE_SMEM_STACK),
                         ids=lambda x: str(x) if isinstance(x, int) else
                         ("causal" if x else "full"))
def test_hopper_backward_lse_smem_compiles_for_sm90(head_dim, causal):
    """lse_smem: lse and delta come with Q and dO (TMA loads of a row of BLOCK_M fp32
    values on the same mbarriers, 2 x STAGES x 256 bytes more shared memory) and each consumer
    reads its columns from shared memory: no global load and no layout conversion in
    the walks, so three fewer warpgroup barriers (BAR.SYNC) a block than lse_ahead's
    walk; no local stores inside the walks."""
    opts = ("lse_smem", "dq_tma")
    ck = _compile_bwd(head_dim, causal, opts=opts)
    res = resources(ck)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    assert res["stack_bytes"] <= _BWD_LSE_SMEM_STACK[(head_dim, causal)], res
    _assert_smem_model(res, head_dim, causal, opts)  # smem_bytes counts the lse rings
    ptx = ck.asm["ptx"]
    # Rank-2 maps of one row: rank-1 loads stopped the GPU with an illegal instruction.
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier") == 2
    assert "cp.async.bulk.tensor.1d" not in ptx
    sass = _sass(ck)
    walks = _walks(sass)
    assert len(walks) >= 2 and not any(_walk_local_stores(sass)), walks
    assert not any("LDG" in op for op in walks[0]) and any("LDS" in op for op in walks[0])

    def barriers(body):
        return sum(op.startswith("BAR.SYNC") for op in body)

    lse_ahead = _walks(_sass(_compile_bwd(head_dim, causal, opts=("lse_ahead", "dq_tma"))))
    assert barriers(walks[0]) <= barriers(lse_ahead[0]) - 3, (walks[0], lse_ahead[0])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", sorted(configs.HOPPER_BWD_16BIT))
def test_hopper_backward_ds_ring_compiles_for_sm90(head_dim, causal):
    """ds_ring (the default's, with lse_smem and dq_tma): a second dS^T buffer (16 KiB:
    d128 still fits, 230,912 bytes of 232,448) and a full and an empty mbarrier for each
    (four where one buffer has two), the local memory of lse_smem's walks or less, no
    stores in the walks but those of _WALK_STORES."""
    opts = ("lse_smem", "dq_tma", "ds_ring")
    ck = _compile_bwd(head_dim, causal, opts=opts)
    res = resources(ck)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    assert res["stack_bytes"] <= _BWD_LSE_SMEM_STACK[(head_dim, causal)], res
    _assert_smem_model(res, head_dim, causal, opts)
    base = resources(_compile_bwd(head_dim, causal, opts=opts[:2]))
    assert res["shared_bytes"] - base["shared_bytes"] == 2 * 64 * 64 * 2 + 16  # + 2 barriers
    assert max(_walk_local_stores(_sass(ck))) <= _walk_stores_allowed(opts, head_dim, 64,
                                                                      causal)


# FLASHTILE_HOPPER_BWD_CONFIG="64,128,4,STAGES" values that compile without local stores
# in the walks (BLOCK_M 128 stores 64-472 bytes a thread inside them at head_dim 64,
# STAGES 1 stores 8 at 128; both never timed): the STAGES sweep of the GPU A/B, with the
# default's options at head_dim 64 and lse_ahead alone at 128 (dq_tma's tiles leave no
# room for a third stage there: check_fits refuses it). With lse_ahead, 3 stages at 128
# keep 64 bytes of scalars, stored before the walks.
@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("head_dim", sorted(configs.HOPPER_BWD_16BIT))
def test_hopper_backward_stages_compile_for_sm90(head_dim, stages):
    opts = configs.HOPPER_BWD_DEFAULT_OPTS if head_dim == 64 else ("lse_ahead",)
    ck = _compile_bwd(head_dim, True, opts=opts, stages=stages)
    res = resources(ck)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    _assert_smem_model(res, head_dim, True, opts, stages=stages)
    assert res["stack_bytes"] <= (0 if head_dim == 64 else 64), res
    assert not any(_walk_local_stores(_sass(ck)))


# bwd_hopper256's shared memory: K, V, two stages of Q and dO, P^T and dS^T (208 KiB),
# plus barriers and layout-conversion scratch; dq_tma's tiles live in the Q/dO ring.
_D256_TILES = 2 * 64 * 256 * 2 + 2 * 2 * 64 * 256 * 2 + 2 * 64 * 64 * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_backward_d256_compiles_for_sm90(causal, dtype):
    """bwd_hopper256 (head_dim 256, the consumers splitting the head dim) with dQ by
    atomics (FLASHTILE_HOPPER_BWD_OPTS without dq_tma): shared memory is K, V, two
    stages of Q and dO, P^T and dS^T (208 KiB) plus barriers; nothing is stored to local
    memory inside the walks (causal: ptxas keeps the shared-memory base, 4 bytes, stored
    before the walk, reloaded in it); setmaxnreg 24/240; the products of
    ``_assert_d256_products``."""
    ck = _compile_bwd(256, causal, dtype, opts=())
    res = resources(ck)
    assert _D256_TILES <= res["shared_bytes"] \
        <= min(_D256_TILES + 1024, configs.SM90_SMEM_BYTES), res
    assert res["stack_bytes"] <= (8 if causal else 0), res
    sass = _sass(ck)
    walks = _walk_local_stores(sass)
    assert len(walks) >= 2 and not any(walks), walks  # one walk per consumer at least
    _assert_backward_partitions(ck)
    _assert_d256_products(ck, dtype)
    # dQ's partial sums: relaxed fp32 atomics, two values per instruction, 32 values of
    # each 64 x 64 piece a thread.
    assert ck.asm["ptx"].count("atom.global.gpu.relaxed.add.v2.f32") == 4 * 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_backward_d256_dq_tma_compiles_for_sm90(causal, dtype):
    """bwd_hopper256 with dq_tma (the default's): each 64 x 64 dQ piece leaves by a TMA
    reduce-add (cp.reduce.async.bulk.tensor .add, UTMAREDG in SASS; 4 a block, 2 a
    consumer) from a tile in the block's Q or dO buffer, so the shared memory is the
    atomics' (208 KiB and barriers) and within the limit; no REDG or atom.global is
    left; nothing is stored to local memory inside the walks, and ptxas keeps no local
    memory at all on this machine (8 bytes allowed: the GPU image's ptxas kept 8 more
    than this one's for a d64 option in session 18's check; a spilled tile would be 64
    or more); the products are the atomics' kernel's."""
    ck = _compile_bwd(256, causal, dtype, opts=("dq_tma",))
    res = resources(ck)
    assert _D256_TILES <= res["shared_bytes"] \
        <= min(_D256_TILES + 1024, configs.SM90_SMEM_BYTES), res
    assert res["stack_bytes"] <= 8, res
    sass = _sass(ck)
    walks = _walk_local_stores(sass)
    assert len(walks) >= 2 and not any(walks), walks
    assert sass.count("UTMAREDG.4D.ADD") == 4 and not re.search(r"\bREDG\.", sass)
    ptx = ck.asm["ptx"]
    assert ptx.count("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add") == 4
    assert "atom.global" not in ptx and "red.global" not in ptx
    # The stage goes back to the producer only after the reduce-adds have read it: one
    # bulk wait (cp.async.bulk.wait_group.read) a consumer inside its walk, one after it,
    # and warpgroup 0's for its dK and dV stores.
    assert ptx.count("cp.async.bulk.wait_group.read") == 5
    _assert_backward_partitions(ck)
    _assert_d256_products(ck, dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_backward_lpt_compiles_for_sm90(head_dim):
    """lpt (causal): only the program ids swap roles (key block from the grid's y, the
    head from x), so the kernel keeps the default's shared memory, local memory and
    walks' stores."""
    default = None if head_dim == 256 else tuple(sorted(configs.HOPPER_BWD_DEFAULT_OPTS))
    opts = ("dq_tma", "lpt") if head_dim == 256 else (*default, "lpt")
    ck = _compile_bwd(head_dim, True, opts=opts)
    base = _compile_bwd(head_dim, True, opts=default)
    res, was = resources(ck), resources(base)
    assert res["shared_bytes"] == was["shared_bytes"], (res, was)
    assert res["stack_bytes"] <= was["stack_bytes"], (res, was)
    assert max(_walk_local_stores(_sass(ck))) <= max(_walk_local_stores(_sass(base)))
    ptx = ck.asm["ptx"]
    assert "%ctaid.x" in ptx and "%ctaid.y" in ptx


def _assert_d256_products(ck, dtype):
    """bwd_hopper256's products: dV += P^T dO and dK += dS^T Q on 128-wide halves of the
    head dim, with the A operand from registers but for warpgroup 0's dK (dS^T from
    shared memory, where warpgroup 1 stored it); S^T, dP^T (the whole 256 contraction)
    and the four dQ pieces on 64-wide products."""
    assert "HGMMA" in _sass(ck)
    ab = "bf16.bf16" if dtype == torch.bfloat16 else "f16.f16"
    mma = [line for line in ck.asm["ptx"].splitlines() if "wgmma.mma_async" in line]
    wide = [line for line in mma if f"m64n128k16.f32.{ab}" in line]
    narrow = [line for line in mma if f"m64n64k16.f32.{ab}" in line]
    # K 16 a step: dV, dK over 64 queries, 4 steps each, in both warpgroups; S^T, dP^T
    # over 256 head dims, 16 steps each; 4 dQ pieces over 64 keys, 4 steps each.
    assert len(wide) == 2 * 2 * 4 and len(narrow) == 2 * 16 + 4 * 4 == len(mma) - 16
    from_registers = [line for line in wide if line.count("{") == 2]
    assert len(from_registers) == 3 * 4 and not any(line.count("{") == 2 for line in narrow)
