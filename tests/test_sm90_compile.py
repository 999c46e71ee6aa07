"""Compile every kernel for Hopper (sm_90) on the CPU: catches what the interpreter can't.

The interpreter runs kernels as NumPy and accepts code the real compiler rejects (a
non-constexpr global, a type mismatch between branches). This compiles with Triton's
bundled ptxas, no GPU needed, and checks that the tables' tiles fit in shared memory.
"""

import dataclasses
import os
import re

import pytest
import torch

from flashtile.ops import combine, configs, decode
from flashtile.ops.bwd import (_bwd_dkdv_kernel, _bwd_dq_convert_kernel, _bwd_dq_kernel,
                               _bwd_preprocess_kernel)
from flashtile.ops.combine import _combine_kernel
from flashtile.ops.decode import _append_kernel, _decode_kernel
from flashtile.ops.fwd import _attn_fwd_kernel
from tests.aot import compile_kernel, loop_instructions, resources, tensor_core_ops

# Under TRITON_INTERPRET=1 @triton.jit gives interpreted functions that cannot be
# compiled; `make test` runs this file in a second pytest process without it.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs real Triton compilation (no interpreter)")

PLAIN = dict(EVEN_D=True, MASK_LEFT=False, MASK_RIGHT=True, HAS_SOFTCAP=False,
             HAS_ALIBI=False, HAS_MASK=False, MASK_IS_BOOL=False, INPUT_PRECISION="tf32")
EVERYTHING = dict(EVEN_D=False, MASK_LEFT=True, MASK_RIGHT=True, HAS_SOFTCAP=True,
                  HAS_ALIBI=True, HAS_MASK=True, MASK_IS_BOOL=True, INPUT_PRECISION="ieee")

# No FP8 descales (the FP8 variants are compiled at the end of this file).
NO_DESCALE = dict(HAS_Q_DESCALE=False, HAS_K_DESCALE=False, HAS_V_DESCALE=False)
UNPAGED = dict(PAGED=False, PAGE_SIZE=1, SEQUSED_K=False, V_KEYS_CONTIGUOUS=False,
               **NO_DESCALE)
# Pages of 16 keys: one block-table entry per key row; 256: one per key tile.
PAGED16 = dict(PAGED=True, PAGE_SIZE=16, SEQUSED_K=True, V_KEYS_CONTIGUOUS=False,
               **NO_DESCALE)
PAGED256 = dict(PAGED=True, PAGE_SIZE=256, SEQUSED_K=False, V_KEYS_CONTIGUOUS=False,
                **NO_DESCALE)
PAGED64 = dict(PAGED=True, PAGE_SIZE=64, SEQUSED_K=False, V_KEYS_CONTIGUOUS=False,
               **NO_DESCALE)  # the engine's default page

KERNELS = {
    "fwd": (_attn_fwd_kernel, configs._FWD_16BIT,
            dict(REVERSE_M=True, IS_VARLEN=False, **UNPAGED)),
    "fwd_varlen": (_attn_fwd_kernel, configs._FWD_16BIT,
                   dict(REVERSE_M=True, IS_VARLEN=True, **UNPAGED)),
    "fwd_varlen_paged16": (_attn_fwd_kernel, configs._FWD_16BIT,
                           dict(REVERSE_M=True, IS_VARLEN=True, **PAGED16)),
    "fwd_varlen_paged256": (_attn_fwd_kernel, configs._FWD_16BIT,
                            dict(REVERSE_M=True, IS_VARLEN=True, **PAGED256)),
    "bwd_dkdv": (_bwd_dkdv_kernel, configs._BWD_DKDV_16BIT,
                 dict(IS_VARLEN=True, ATOMIC_DQ=False)),
    "bwd_fused": (_bwd_dkdv_kernel, configs._BWD_FUSED_16BIT,
                  dict(IS_VARLEN=True, ATOMIC_DQ=True)),
    "bwd_dq": (_bwd_dq_kernel, configs._BWD_DQ_16BIT, dict(IS_VARLEN=False)),
}


ADDITIVE_MASK = dict(PLAIN, HAS_MASK=True, MASK_IS_BOOL=False)


@pytest.mark.parametrize("flags", [PLAIN, EVERYTHING, ADDITIVE_MASK],
                         ids=["plain", "all_features", "additive_mask"])
@pytest.mark.parametrize("kind", list(KERNELS))
def test_compiles_for_sm90(kind, flags):
    """The table's d128 tile compiles; where a feature's extra buffers (a mask tile)
    overflow shared memory, the launcher's step-down (configs.smaller) reaches a tile
    that fits. The plain hot path must fit without stepping down."""
    kernel, table, extra = KERNELS[kind]
    cfg = table[128]
    while True:
        ck = compile_kernel(kernel, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                         BLOCK_D=128, **extra, **flags),
                            dtype="bf16", num_warps=cfg.num_warps,
                            num_stages=cfg.num_stages)
        res = resources(ck)
        # Register use is reported, not asserted: the measured-best dK/dV tile at d128
        # spills a little (docs/benchmarks/NOTES.md) and still wins.
        assert res["registers"] > 0, res
        if res["shared_bytes"] <= configs.SM90_SMEM_BYTES:
            break
        assert flags is not PLAIN, f"{kind} {cfg} needs {res['shared_bytes']} B"
        cfg = configs.smaller(cfg)
        assert cfg is not None, f"{kind}: no tile fits with {flags}"


@pytest.mark.parametrize("paged", [PAGED16, PAGED256], ids=["page16", "page256"])
def test_paged_forward_stays_pipelined(paged):
    """The paged forward keeps the contiguous one's K/V pipeline (async copies, shared
    memory for three stages at d128): looking a tile's page up in its own iteration
    cost one stage (the lesson of the paged decode, NOTES.md section 4)."""
    cfg = configs._FWD_16BIT_CAUSAL[128]

    def build(extra):
        return compile_kernel(_attn_fwd_kernel, dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=128, REVERSE_M=True,
            IS_VARLEN=True, **PLAIN, **extra), dtype="bf16", num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)

    plain, paged_ck = build(UNPAGED), build(paged)
    assert resources(paged_ck)["stack_bytes"] == 0
    assert paged_ck.metadata.shared == plain.metadata.shared
    copies = [ck.asm["ttgir"].count("async_copy_global_to_local") for ck in (plain, paged_ck)]
    assert copies[1] == copies[0] > 0, copies


@pytest.mark.parametrize("fp8", ["fp8e4nv", "fp8e5"])
def test_paged_forward_over_an_fp8_pool(fp8):
    """bf16 q over an FP8 pool (an engine's kv_cache_dtype="fp8" prefill): the K and V
    tiles are widened to bf16 after their loads, so the pipeline keeps its async copies
    (of half the bytes) and nothing spills; the descales are two scalars a program."""
    cfg = configs._FWD_16BIT_CAUSAL[128]
    flags = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=128, REVERSE_M=True,
                 IS_VARLEN=True, **PLAIN, **dict(PAGED64, HAS_K_DESCALE=True,
                                                 HAS_V_DESCALE=True))
    pool = compile_kernel(_attn_fwd_kernel, flags, dtype="bf16", num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages,
                          types=dict(K=f"*{fp8}", V=f"*{fp8}", KDescale="*fp32",
                                     VDescale="*fp32"))
    plain = compile_kernel(_attn_fwd_kernel, dict(flags, **PAGED64), dtype="bf16",
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert resources(pool)["stack_bytes"] == 0
    copies = [ck.asm["ttgir"].count("async_copy_global_to_local") for ck in (plain, pool)]
    assert copies[1] == copies[0] > 0, copies
    assert pool.metadata.shared < plain.metadata.shared


FUSED_TABLES = {  # name: (table, dtype, products)
    "bf16": (configs._BWD_FUSED_16BIT, "bf16", "tf32"),
    "fp32_tf32": (configs._BWD_FUSED_32BIT, "fp32", "tf32"),
    "fp32_tf32x3": (configs._BWD_FUSED_32BIT, "fp32", "tf32x3"),
    "fp32_ieee": (configs._BWD_FUSED_IEEE, "fp32", "ieee"),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("table,head_dim", [(t, d) for t, (table, _, _) in FUSED_TABLES.items()
                                            for d in sorted(table)])
def test_fused_backward_tiles_do_not_spill(table, head_dim, causal):
    """Every entry of the fused backward's tables (chosen with tests/aot.py, configs.py)
    compiles without spilling, and its dQ atomics are relaxed (acq_rel would fence each
    one), four floats each in the 16-bit table (the fp32 tiles hold fewer per thread).
    fp32 stops at head_dim 128: the split backward serves fp32 beyond it."""
    entries, dtype, products = FUSED_TABLES[table]
    assert configs.fused_bwd_has_tiles(4 if dtype == "fp32" else 2, head_dim)
    cfg = entries[head_dim]
    parts = configs.head_dim_parts(head_dim)  # 512: 2 programs of 256 columns
    part = configs.part_columns(head_dim, parts)
    ck = compile_kernel(_bwd_dkdv_kernel, dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=part, BLOCK_DV=part,
        DV_PARTS=parts, IS_VARLEN=False, ATOMIC_DQ=True,
        **dict(PLAIN, MASK_RIGHT=causal, INPUT_PRECISION=products)),
        dtype=dtype, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    res = resources(ck)
    assert res["stack_bytes"] == 0 and res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    adds = re.findall(r"(?:atom|red)\.global[.\w]*\.add[.\w]*", ck.asm["ptx"])
    assert adds and all(".relaxed." in a and a.endswith(".f32") for a in adds), adds
    if dtype == "bf16":
        assert all(a.endswith(".v4.f32") for a in adds), adds


def test_preprocess_and_dq_conversion_compile():
    """At the largest head dim; the preprocess also zeroing the fused dQ accumulator."""
    ck = compile_kernel(_bwd_preprocess_kernel,
                        dict(BLOCK_M=configs.PREPROCESS_BLOCK_M, BLOCK_D=512, HAS_DLSE=True,
                             ZERO_DQ=True),
                        dtype="fp16")
    assert resources(ck)["stack_bytes"] == 0
    ck = compile_kernel(_bwd_dq_convert_kernel,
                        dict(BLOCK_M=configs.PREPROCESS_BLOCK_M, BLOCK_D=512, SHARES=1),
                        dtype="bf16")
    assert resources(ck)["stack_bytes"] == 0
    # bwd_hopper's head split: Llama's group of 4, and MQA's wide groups at d256
    for block_d, shares in ((64, 4), (128, 32), (256, 64)):
        ck = compile_kernel(_bwd_dq_convert_kernel,
                            dict(BLOCK_M=configs.PREPROCESS_BLOCK_M, BLOCK_D=block_d,
                                 SHARES=shares), dtype="bf16")
        assert resources(ck)["stack_bytes"] == 0


@pytest.mark.parametrize("swap", [False, True], ids=["in-order", "swap"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_v_copy_compiles_vectorised(head_dim, swap):
    """fwd._keys_contiguous_kernel (FP8 V's keys-contiguous copy, in v's order or P's
    swap order) for sm_90: no spills, and 16-byte global loads and stores alone (the
    transpose and the key permutation stay in registers and shared memory)."""
    from flashtile.ops.fwd import COPY_BLOCK_K, _keys_contiguous_kernel

    ck = compile_kernel(_keys_contiguous_kernel,
                        dict(SWAP=swap, BLOCK_D=head_dim, BLOCK_K=COPY_BLOCK_K),
                        num_warps=4 if head_dim <= 128 else 8,
                        types=dict(V="*u8", VT="*u8"))
    assert resources(ck)["stack_bytes"] == 0
    accesses = set(re.findall(r"\b(?:ld|st)\.global[.\w]*", ck.asm["ptx"]))
    assert accesses == {"ld.global.v4.b32", "st.global.v4.b32"}, accesses


@pytest.mark.parametrize("paged,page_size,aligned,tile_pages,split_pages",
                         [(False, 1, False, 0, 0), (True, 16, False, 0, 0),
                          (True, 64, True, 0, 0), (True, 16, False, 4, 0),
                          (True, 16, False, 4, 16), (True, 64, True, 0, 4)],
                         ids=["contiguous", "paged_per_row", "paged_per_tile",
                              "paged_pages_per_tile", "paged_split_pages_small",
                              "paged_split_pages_large"])
def test_decode_compiles(paged, page_size, aligned, tile_pages, split_pages):
    flags = {k: v for k, v in EVERYTHING.items() if k not in ("HAS_MASK", "MASK_IS_BOOL")}
    ck = compile_kernel(_decode_kernel, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_D=128,
                                             PAGED=paged, PAGE_SIZE=page_size,
                                             PAGE_ALIGNED=aligned, TILE_PAGES=tile_pages,
                                             SPLIT_PAGES=split_pages, HAS_BATCH_IDX=not paged,
                                             HAS_LEFTPAD=not (aligned or tile_pages or split_pages),
                                             LAUNCH_DEPENDENTS=True, **NO_DESCALE,
                                             **flags),
                        dtype="bf16", num_warps=4, num_stages=3)
    assert resources(ck)["stack_bytes"] == 0
    # The K/V loads must stay software-pipelined (async copies into shared memory): a
    # change to the page lookup once silently turned that off (NOTES.md section 8).
    assert ck.asm["ttgir"].count("async_copy_global_to_local") >= 4, "decode not pipelined"
    # Split decode lets the combine (a programmatic dependent launch) be scheduled early;
    # the combine waits for the decode grid before its first global read.
    assert "griddepcontrol.launch_dependents" in ck.asm["ptx"]
    # The launcher's one-warp combine at its largest tile must not spill.
    ck = compile_kernel(_combine_kernel, dict(BLOCK_S=32, BLOCK_D=128, USE_PDL=True),
                        dtype="bf16", num_warps=1)
    assert resources(ck)["stack_bytes"] == 0
    ptx = ck.asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), "reads before the wait"


@pytest.mark.parametrize("split_pages", [2, 4, 8, 16])
@pytest.mark.parametrize("page_size", [16, 64], ids=["pages_per_tile", "page_per_tile"])
@pytest.mark.parametrize("dtype,head_dim", [("bf16", 64), ("bf16", 128), ("fp32", 128),
                                            ("fp32", 256)])
def test_split_page_lists_do_not_spill(dtype, head_dim, page_size, split_pages):
    """Every page-list length decode.split_plan picks (powers of two from 2), at the
    split tile decode_config gives 64 query rows, with every feature: no stack, K/V
    still copied asynchronously. (A list of one page spilled at fp32 d128, which is why
    there is none; pages smaller than the fp32 tiles spill whatever the list, so those
    are left out here.)"""
    q = torch.empty(1, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                    device="meta")
    cfg = configs.decode_config(q, head_dim, 64)
    aligned = page_size % cfg.block_n == 0
    tile_pages = 0 if aligned else cfg.block_n // page_size
    if dtype == "fp32" and not aligned:
        pytest.skip("fp32 tiles over pages smaller than the tile spill (not split-only)")
    if split_pages < tile_pages:
        pytest.skip("a split spans at least a tile's pages")
    flags = {k: v for k, v in EVERYTHING.items() if k not in ("HAS_MASK", "MASK_IS_BOOL")}
    ck = compile_kernel(_decode_kernel, dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_dim, BLOCK_DT=0,
        BLOCK_DV=head_dim, V_IS_K=False, PAGED=True, PAGE_SIZE=page_size,
        PAGE_ALIGNED=aligned, TILE_PAGES=tile_pages, SPLIT_PAGES=split_pages,
        HAS_BATCH_IDX=False, HAS_LEFTPAD=False, LAUNCH_DEPENDENTS=True, **NO_DESCALE,
        **dict(flags, INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32")),
        dtype=dtype, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert resources(ck)["stack_bytes"] == 0, (cfg, resources(ck))
    assert ck.asm["ttgir"].count("async_copy_global_to_local") >= 4, "decode not pipelined"


@pytest.mark.parametrize("head_dims", [(128, 128), (192, 128), (512, 512), (576, 512)],
                         ids=lambda dims: "d{}-dv{}".format(*dims))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_append_compiles(paged, head_dims):
    """The append's tiles, V's head dim its own (MLA), at the launcher's tokens per
    program: no spills."""
    block_d, block_dv = (configs.padded_head_dim(x) for x in head_dims)
    ck = compile_kernel(_append_kernel, dict(
        BLOCK_T=configs.append_block_t(max(block_d, block_dv)), BLOCK_D=block_d,
        BLOCK_DV=block_dv, PAGED=paged, PAGE_SIZE=16 if paged else 1,
        HAS_BATCH_IDX=not paged, HAS_K_DESCALE=False, HAS_V_DESCALE=False), dtype="bf16")
    assert resources(ck)["stack_bytes"] == 0


@pytest.mark.parametrize("rows", [16, 64, 128], ids=lambda r: f"{r}rows")
@pytest.mark.parametrize("split", [True, False], ids=["split", "unsplit"])
@pytest.mark.parametrize("v_is_k", [True, False], ids=["v_view_of_k", "v_own"])
@pytest.mark.parametrize("head_dims, dtype", [((576, 512), "bf16"), ((576, 512), "fp32"),
                                              ((192, 128), "bf16")],
                         ids=["d576-dv512-bf16", "d576-dv512-fp32", "d192-dv128-bf16"])
def test_mla_decode_compiles_for_sm90(head_dims, dtype, v_is_k, split, rows):
    """Decode with V's head dim its own (MLA) at the tile decode_config picks for 16, 64
    and 128 query rows (absorbed MLA's 16 and 128 heads): 576 as a 512 tile plus a 64
    tail, V read from K's tiles when it is a view of them (absorbed MLA) or loaded;
    within shared memory, no spills, K/V still copied asynchronously. 16-bit 576 past
    32 rows: wgmma (HGMMA) products, no mma.sync (_wide_key_decode_config), V's columns
    in parts where the config says. fp32 with IEEE products (the decode's, TF32 is
    never allowed there) at 576; at 192 the general fp32 decode tile
    (test_fp32_decode_tiles_do_not_spill)."""
    d, dv = head_dims
    if v_is_k and configs.padded_head_dim(dv) != configs.decode_head_dim_tiles(d)[0]:
        pytest.skip("V is read from K's tiles only when its tile is K's first")
    q = torch.empty(1, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                    device="meta")
    cfg = configs.decode_config(q, d, rows, split=split, head_dim_v=dv, v_is_k=v_is_k)
    block_d, block_dt = configs.decode_head_dim_tiles(d)
    flags = {k: v for k, v in EVERYTHING.items() if k not in ("HAS_MASK", "MASK_IS_BOOL")}
    ck = compile_kernel(_decode_kernel, dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d // cfg.dv_parts,
        BLOCK_DT=block_dt, BLOCK_DV=configs.padded_head_dim(dv) // cfg.dv_parts,
        DV_PARTS=cfg.dv_parts, V_IS_K=v_is_k, PAGED=True, PAGE_SIZE=64,
        PAGE_ALIGNED=True, TILE_PAGES=0, SPLIT_PAGES=4 if split else 0,
        HAS_BATCH_IDX=False, HAS_LEFTPAD=False, LAUNCH_DEPENDENTS=split, **NO_DESCALE,
        **dict(flags, EVEN_D=True, INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32")),
        dtype=dtype, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    res = resources(ck)
    assert res["stack_bytes"] == 0 and res["shared_bytes"] <= configs.SM90_SMEM_BYTES, \
        (cfg, res)
    assert ck.asm["ttgir"].count("async_copy_global_to_local") >= 4, "decode not pipelined"
    if d > configs.DECODE_MAX_BLOCK_D and dtype == "bf16" and rows > 32:
        assert tensor_core_ops(ck) == {"HGMMA"}, cfg
        assert cfg.dv_parts == (2 if v_is_k and rows > 64 else 1), cfg


@pytest.mark.parametrize("split", [True, False], ids=["split", "unsplit"])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_fp32_decode_tiles_do_not_spill(head_dim, split):
    """fp32 decode multiplies with FFMA (IEEE products; decode never allows TF32): the
    tile decode_config picks for 64 query rows (the most it packs) holds no stack, with
    no feature and with every one."""
    q = torch.empty(1, dtype=torch.float32, device="meta")
    cfg = configs.decode_config(q, head_dim, 64, split=split)
    for flags in (PLAIN, EVERYTHING):
        flags = {k: v for k, v in flags.items() if k not in ("HAS_MASK", "MASK_IS_BOOL")}
        ck = compile_kernel(_decode_kernel, dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_dim, BLOCK_DT=0,
            BLOCK_DV=head_dim, V_IS_K=False, PAGED=True, PAGE_SIZE=64, PAGE_ALIGNED=True,
            TILE_PAGES=0, SPLIT_PAGES=4 if split else 0, HAS_BATCH_IDX=False,
            HAS_LEFTPAD=False, LAUNCH_DEPENDENTS=split, **NO_DESCALE,
            **dict(flags, EVEN_D=True, INPUT_PRECISION="ieee")),
            dtype="fp32", num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        res = resources(ck)
        assert res["stack_bytes"] == 0 and res["shared_bytes"] <= configs.SM90_SMEM_BYTES, \
            (cfg, res)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", ["fwd", "bwd_dkdv", "bwd_dq"])
def test_ieee_fp32_tiles_do_not_spill(kind, head_dim):
    """fp32 with IEEE products multiplies with FFMA: the TF32-sized tiles spilled there
    (the d128 forward's held 8 KB of stack per thread). The IEEE tables' must not."""
    kernel, table, extra = {
        "fwd": (_attn_fwd_kernel, configs._FWD_IEEE,
                dict(REVERSE_M=False, IS_VARLEN=False, **UNPAGED)),
        "bwd_dkdv": (_bwd_dkdv_kernel, configs._BWD_DKDV_IEEE,
                     dict(IS_VARLEN=False, ATOMIC_DQ=False)),
        "bwd_dq": (_bwd_dq_kernel, configs._BWD_DQ_IEEE, dict(IS_VARLEN=False)),
    }[kind]
    cfg = table[head_dim]
    flags = dict(PLAIN, MASK_RIGHT=False, INPUT_PRECISION="ieee")
    ck = compile_kernel(kernel, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                     BLOCK_D=head_dim, **extra, **flags),
                        dtype="fp32", num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    res = resources(ck)
    assert res["stack_bytes"] == 0 and res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res


@pytest.mark.parametrize("kind", ["fwd", "bwd_dkdv", "bwd_dq", "bwd_fused"])
def test_tf32x3_compiles_to_tensor_core_products(kind):
    """tf32x3 (fp32 as three TF32 products, the default fp32 products) on its tables'
    d128 tiles (the forward's own, the backward's the fp32 ones): compiles for sm_90 within shared memory, to tensor-core products in the
    SASS (HGMMA, or HMMA where a 32-row tile is below wgmma's 64 rows per warpgroup)."""
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv
    kernel, extra = {
        "fwd": (_attn_fwd_kernel, dict(REVERSE_M=False, IS_VARLEN=False, **UNPAGED)),
        "bwd_dkdv": (_bwd_dkdv_kernel, dict(IS_VARLEN=False, ATOMIC_DQ=False)),
        "bwd_dq": (_bwd_dq_kernel, dict(IS_VARLEN=False)),
        "bwd_fused": (_bwd_dkdv_kernel, dict(IS_VARLEN=False, ATOMIC_DQ=True)),
    }[kind]
    cfg = {"fwd": configs._FWD_TF32X3, "bwd_dkdv": configs._BWD_32BIT,
           "bwd_dq": configs._BWD_32BIT, "bwd_fused": configs._BWD_FUSED_32BIT}[kind][128]
    ck = compile_kernel(kernel, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=128,
                                     **extra, **dict(PLAIN, INPUT_PRECISION="tf32x3")),
                        dtype="fp32", num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert resources(ck)["shared_bytes"] <= configs.SM90_SMEM_BYTES
    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    assert "HGMMA" in sass or "HMMA" in sass


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tf32x3_d64_forward_tile_does_not_spill(causal):
    """The tf32x3 forward's d64 tile (128 x 64, 3 stages: the fastest timed on the H200,
    NOTES.md section 34) fits the registers; its d128 tile spills a little (configs.py)."""
    cfg = configs._FWD_TF32X3[64]
    ck = compile_kernel(_attn_fwd_kernel, dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=64, REVERSE_M=causal,
        IS_VARLEN=False, **UNPAGED, **dict(PLAIN, MASK_RIGHT=causal, INPUT_PRECISION="tf32x3")),
        dtype="fp32", num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    res = resources(ck)
    assert res["stack_bytes"] == 0 and res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res


def _engine_kernel(name):
    """(kernel, constexprs, num_warps, types) of an engine elementwise kernel at a
    model's shape, with the tiles its launcher takes on the GPU. The names say the
    shape: Qwen2.5-0.5B (hidden 896, MLP 4864, 14/2 heads of 64), Llama-3-8B (4096,
    14336, 32/8 heads of 128), Qwen3's per-head norm (32 heads of 128 a token)."""
    from flashtile.engine.activation import _silu_and_mul_kernel
    from flashtile.engine.layernorm import _rms_norm_kernel
    from flashtile.engine.rope_store import _rope_store_kernel
    cuda = torch.device("cuda")
    kind, *shape = name.split("_")
    if kind in ("norm", "addnorm", "headnorm"):
        n = int(shape[0])
        block_n, rows, warps = configs.rms_norm_tile(n, cuda)
        return (_rms_norm_kernel, dict(N=n, INNER=32 if kind == "headnorm" else 1,
                                       BLOCK_N=block_n, ROWS=rows,
                                       HAS_RESIDUAL=kind == "addnorm"),
                warps, dict(eps="fp32"))
    if kind == "silu":
        n = int(shape[0])
        block_n, warps = configs.silu_and_mul_tile(n, cuda)
        return _silu_and_mul_kernel, dict(N=n, BLOCK_N=block_n), warps, {}
    h, hkv, d = map(int, shape[0].split("x"))
    block_half, heads_q, heads_kv, warps = configs.rope_store_tile(h, hkv, d // 2, cuda)
    # rope8: the pool in FP8 (kv_cache_dtype="fp8"), quantised as it is stored.
    pool = dict(KCache="*fp8e4nv", VCache="*fp8e4nv", KScale="*fp32",
                VScale="*fp32") if kind == "rope8" else {}
    return (_rope_store_kernel, dict(NUM_HEADS=h, NUM_KV_HEADS=hkv, HALF=d // 2,
                                     BLOCK_HALF=block_half, HEADS_Q=heads_q,
                                     HEADS_KV=heads_kv, STORE=True),
            warps, dict(Cos="*fp32", Sin="*fp32", Slots="*i64", **pool))


@pytest.mark.parametrize("name", ["norm_896", "addnorm_896", "addnorm_4096", "headnorm_128",
                                  "silu_4864", "silu_14336", "rope_14x2x64",
                                  "rope_32x8x128", "rope8_14x2x64", "rope8_32x8x128"])
def test_engine_elementwise_kernels_compile_vectorised(name):
    """The engine's elementwise kernels (engine/layernorm.py, activation.py,
    rope_store.py) compile for sm_90 without spills and move bf16 in 16-byte vectors:
    the reason they replaced torch.compile's kernels, whose symbolic shapes hid the
    alignment and gave scalar loads."""
    kernel, constexprs, warps, types = _engine_kernel(name)
    ck = compile_kernel(kernel, constexprs, num_warps=warps, types=types)
    assert resources(ck)["stack_bytes"] == 0
    accesses = set(re.findall(r"\b(?:ld|st)\.global[.\w]*", ck.asm["ptx"]))
    if name.startswith("silu") or name.endswith("_4096"):
        # Rows of whole 16-byte vectors per thread: nothing narrower anywhere.
        assert accesses == {"ld.global.v4.b32", "st.global.v4.b32"}, accesses
    elif name.startswith("rope8"):
        # 16-bit loads in 16-byte vectors; an FP8 pool's stores are half as wide.
        assert "ld.global.v4.b32" in accesses, accesses
    else:
        assert {"ld.global.v4.b32", "st.global.v4.b32"} <= accesses, accesses


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,precision", [("bf16", "tf32"), ("fp32", "tf32"),
                                             ("fp32", "ieee")])
@pytest.mark.parametrize("kind", ["fwd", "bwd_dkdv", "bwd_dq", "bwd_fused", "decode"])
def test_head_dim_512_tiles_do_not_spill(kind, dtype, precision, causal):
    """head_dim 512's tiles: every table entry (and the decode tile) compiles for sm_90
    within shared memory and without spills, causal or not. The forward and backward
    run in 2 parts of 256 columns (configs.head_dim_parts): the forward's BLOCK_D is
    q's whole head dim and BLOCK_DV its part of V's; the backward's are both parts.
    The 16-bit forward's 128-row tile is there for wgmma (one warpgroup per 64 rows)."""
    class Q:  # what configs reads of q: device, element size
        device = type("D", (), {"type": "cuda"})()

        @staticmethod
        def element_size():
            return 4 if dtype == "fp32" else 2
    ieee = precision == "ieee"
    if kind == "decode":
        if ieee and dtype == "fp32" or causal:
            pytest.skip("decode's tile depends on neither the products nor a mask")
        cfg = configs.decode_config(Q, 512, 4, split=True)
        consts = dict(PAGED=True, PAGE_SIZE=64, PAGE_ALIGNED=True, TILE_PAGES=0,
                      SPLIT_PAGES=4, HAS_BATCH_IDX=False, HAS_LEFTPAD=False,
                      LAUNCH_DEPENDENTS=True, BLOCK_D=512)
        kernel = _decode_kernel
        flags = {k: v for k, v in PLAIN.items() if k not in ("HAS_MASK", "MASK_IS_BOOL")}
    else:
        if kind == "bwd_fused" and dtype == "fp32":
            pytest.skip("fp32 takes the split backward past head_dim 128")
        pick = {"fwd": configs.fwd_config, "bwd_dkdv": configs.bwd_dkdv_config,
                "bwd_dq": configs.bwd_dq_config, "bwd_fused": configs.bwd_fused_config}[kind]
        cfg = pick(Q, 512, causal, products=precision)
        assert cfg.dv_parts == 2, cfg
        part = configs.part_columns(512, cfg.dv_parts)
        kernel = {"fwd": _attn_fwd_kernel, "bwd_dkdv": _bwd_dkdv_kernel,
                  "bwd_fused": _bwd_dkdv_kernel, "bwd_dq": _bwd_dq_kernel}[kind]
        consts = {"fwd": dict(REVERSE_M=causal, IS_VARLEN=False, BLOCK_D=512, **UNPAGED),
                  "bwd_dkdv": dict(IS_VARLEN=False, ATOMIC_DQ=False, BLOCK_D=part),
                  "bwd_fused": dict(IS_VARLEN=False, ATOMIC_DQ=True, BLOCK_D=part),
                  "bwd_dq": dict(IS_VARLEN=False, BLOCK_D=part)}[kind]
        consts.update(BLOCK_DV=part, DV_PARTS=cfg.dv_parts)
        flags = dict(PLAIN)
    flags = dict(flags, MASK_RIGHT=causal, INPUT_PRECISION=precision)
    ck = compile_kernel(kernel, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **consts,
                                     **flags),
                        dtype=dtype, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    res = resources(ck)
    print(kind, dtype, precision, "causal" if causal else "full", cfg, res)
    assert res["stack_bytes"] == 0 and res["shared_bytes"] <= configs.SM90_SMEM_BYTES, \
        (cfg, res)
    if kind == "fwd" and dtype == "bf16":
        assert tensor_core_ops(ck) == {"HGMMA"}
    if kind == "decode":  # and the combine of its splits, at the largest split count
        ck = compile_kernel(_combine_kernel, dict(BLOCK_S=128, BLOCK_D=512, USE_PDL=True),
                            dtype=dtype, num_warps=combine._combine_warps(128 * 512))
        assert resources(ck)["stack_bytes"] == 0


# Head dim 512's 16-bit tiles with every score feature, paged and varlen, dropout: they
# compile within shared memory (after the launcher's step-down where a mask tile adds a
# buffer) and in 2 parts. Registers and stack are printed, not asserted: a feature's
# extra tiles may spill (the plain tiles above are the ones that must not).
D512_VARIANTS = {
    "fwd_everything": (_attn_fwd_kernel, "fwd", dict(REVERSE_M=True, IS_VARLEN=True,
                                                     **UNPAGED, **EVERYTHING)),
    "fwd_paged16": (_attn_fwd_kernel, "fwd", dict(REVERSE_M=True, IS_VARLEN=True,
                                                  **PAGED16, **PLAIN)),
    "fwd_dropout": (_attn_fwd_kernel, "fwd", dict(REVERSE_M=True, IS_VARLEN=False,
                                                  HAS_DROPOUT=True, **UNPAGED, **PLAIN)),
    "bwd_dkdv_everything": (_bwd_dkdv_kernel, "bwd_dkdv", dict(IS_VARLEN=True,
                                                               ATOMIC_DQ=False,
                                                               HAS_DROPOUT=True,
                                                               **EVERYTHING)),
    "bwd_fused_everything": (_bwd_dkdv_kernel, "bwd_fused", dict(IS_VARLEN=True,
                                                                 ATOMIC_DQ=True,
                                                                 HAS_DROPOUT=True,
                                                                 **EVERYTHING)),
    "bwd_dq_everything": (_bwd_dq_kernel, "bwd_dq", dict(IS_VARLEN=True, HAS_DROPOUT=True,
                                                         **EVERYTHING)),
}


@pytest.mark.parametrize("variant", list(D512_VARIANTS))
def test_head_dim_512_feature_variants_compile(variant):
    kernel, kind, flags = D512_VARIANTS[variant]
    table = {"fwd": configs._FWD_16BIT_CAUSAL, "bwd_dkdv": configs._BWD_DKDV_16BIT,
             "bwd_fused": configs._BWD_FUSED_16BIT, "bwd_dq": configs._BWD_DQ_16BIT}[kind]
    cfg = dataclasses.replace(table[512], dv_parts=configs.head_dim_parts(512))
    part = configs.part_columns(512, cfg.dv_parts)
    dims = dict(BLOCK_D=512 if kind == "fwd" else part, BLOCK_DV=part,
                DV_PARTS=cfg.dv_parts)
    while True:
        ck = compile_kernel(kernel, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **dims,
                                         **flags),
                            dtype="bf16", num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        res = resources(ck)
        print(variant, cfg, res)
        if res["shared_bytes"] <= configs.SM90_SMEM_BYTES:
            break
        cfg = configs.smaller(cfg)
        assert cfg is not None and cfg.dv_parts == 2, f"{variant}: no tile fits"
    assert res["registers"] > 0


# ---- FP8 (tests/test_fp8.py runs them; here what only the compiler can tell) ----

FP8_FWD_LAYOUTS = {
    # V^T copy (keys contiguous), read with async copies as K is.
    "dense": dict(IS_VARLEN=False, PAGED=False, PAGE_SIZE=1, V_KEYS_CONTIGUOUS=True),
    # V as given: Triton transposes each tile through registers.
    "varlen": dict(IS_VARLEN=True, PAGED=False, PAGE_SIZE=1, V_KEYS_CONTIGUOUS=False),
    "paged16": dict(IS_VARLEN=True, PAGED=True, PAGE_SIZE=16, V_KEYS_CONTIGUOUS=False),
}


def _compile_fp8_fwd(layout, head_dim, causal, dtype="fp8e4nv"):
    cfg = configs._FWD_FP8[head_dim]
    flags = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_dim, EVEN_D=True,
                 MASK_LEFT=False, MASK_RIGHT=causal, HAS_SOFTCAP=False, HAS_ALIBI=False,
                 HAS_MASK=False, MASK_IS_BOOL=False, INPUT_PRECISION="ieee",
                 REVERSE_M=causal, SEQUSED_K=False, HAS_Q_DESCALE=True,
                 HAS_K_DESCALE=True, HAS_V_DESCALE=True, **FP8_FWD_LAYOUTS[layout])
    return compile_kernel(_attn_fwd_kernel, flags, dtype=dtype, num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages, types={"Out": "*bf16"})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout, head_dim", [("dense", 64), ("dense", 128),
                                              ("dense", 256), ("varlen", 128),
                                              ("varlen", 256), ("paged16", 128)])
def test_fp8_forward_compiles_for_sm90(layout, head_dim, causal):
    """The FP8 table's tiles: both products on the FP8 tensor cores (QGMMA in the SASS,
    no HGMMA), no spills, within shared memory; the dense path's V^T tiles are copied
    asynchronously as K's are (twice the async copies of the varlen path)."""
    compiled = _compile_fp8_fwd(layout, head_dim, causal)
    res = resources(compiled)
    assert res["stack_bytes"] == 0, res
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    assert tensor_core_ops(compiled) == {"QGMMA"}
    if layout == "dense":
        copies = [ck.asm["ttgir"].count("async_copy_global_to_local")
                  for ck in (compiled, _compile_fp8_fwd("varlen", head_dim, causal))]
        assert copies[0] == 2 * copies[1] > 0, copies


def test_fp8_e5m2_forward_compiles_for_sm90():
    compiled = _compile_fp8_fwd("dense", 128, True, dtype="fp8e5")
    assert resources(compiled)["stack_bytes"] == 0
    assert tensor_core_ops(compiled) == {"QGMMA"}


@pytest.mark.parametrize("q_dtype, cache_dtype", [("bf16", "fp8e4nv"), ("fp16", "fp8e5"),
                                                  ("fp8e4nv", "fp8e4nv")])
@pytest.mark.parametrize("split", [True, False], ids=["split", "unsplit"])
def test_fp8_decode_compiles_for_sm90(q_dtype, cache_dtype, split):
    """Decode over an FP8 cache at the tile decode_config picks: K/V still copied
    asynchronously (software-pipelined), widened in registers, no spills."""
    # A meta tensor stands for a GPU q (decode_config gives CPU tensors the
    # interpreter's tile).
    q = torch.empty(1, dtype=torch.float8_e4m3fn if q_dtype.startswith("fp8")
                    else torch.bfloat16, device="meta")
    cfg = configs.decode_config(q, 128, 4, split=split, fp8_cache=True)
    compiled = compile_kernel(_decode_kernel, dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=128, EVEN_D=True, MASK_LEFT=False,
        MASK_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=False, PAGED=True, PAGE_SIZE=64,
        PAGE_ALIGNED=True, TILE_PAGES=0, SPLIT_PAGES=0, HAS_BATCH_IDX=False,
        HAS_LEFTPAD=False, INPUT_PRECISION="ieee", LAUNCH_DEPENDENTS=split,
        HAS_Q_DESCALE=q_dtype.startswith("fp8"), HAS_K_DESCALE=True, HAS_V_DESCALE=True),
        dtype=q_dtype, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        types={"KCache": f"*{cache_dtype}", "VCache": f"*{cache_dtype}", "Out": "*bf16"})
    assert resources(compiled)["stack_bytes"] == 0
    assert compiled.asm["ttgir"].count("async_copy_global_to_local") >= 4
    # Issue 17: the FP8 decode ran no faster than the bf16 one, issue-bound. V's tile
    # (keys, the reduction, 128 bytes apart) was read from shared memory one byte at a
    # time into the P @ V operand, and each pair of values widened to bf16 in three
    # cvts. Now V is copied as int16 column pairs (ldmatrix) and every pair of FP8
    # values takes one cvt to fp16; every async copy moves 16 bytes.
    ptx = compiled.asm["ptx"]
    fmt = "e4m3x2" if cache_dtype == "fp8e4nv" else "e5m2x2"
    assert "ld.shared.b8" not in ptx and "ldmatrix" in ptx
    assert "cvt.bf16.f16" not in ptx and f"cvt.rn.f16x2.{fmt}" in ptx and "prmt.b32" in ptx
    assert re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)",
                      ptx) == ["0x10"] * ptx.count("cp.async.cg.shared.global")


# sm_90 SASS instructions a thread per 128-key tile of the FP8 decode (tests/aot.py
# loop_instructions), bf16 q, e4m3 cache, d128, 4 query rows (32 heads over 8): the
# rows-on-M layout (16 padded rows as the products' M) against KEYS_M (keys as M, 8
# rows as N; configs.decode_fp8_keys_m, the default since session 14). Measured with
# Triton 3.6.0 (session 13).
FP8_DECODE_TILE = {
    # name: (split, page size (0: contiguous), TILE_PAGES, SPLIT_PAGES), counts
    "contiguous": ((True, 0, 0, 0), (
        dict(fp8_widen=128, fp16_pack=8, hmma=64, exp2=18, fp32_arith=72, fp32_select=42,
             shuffle=12, prmt=32, shared=57, global_load=19, barrier=12, move=67, integer=185,
             other=6),  # 722
        dict(fp8_widen=128, fp16_pack=4, hmma=32, exp2=10, fp32_arith=34, fp32_select=28,
             shuffle=8, prmt=32, shared=38, global_load=19, barrier=7, move=20, integer=79,
             other=2),  # 441
    )),
    # Pages of 64 keys, two a tile, a split's 4 pages loaded before the loop.
    "paged64": ((True, 64, 2, 4), (
        dict(fp8_widen=128, fp16_pack=8, hmma=64, exp2=18, fp32_arith=72, fp32_select=42,
             shuffle=12, prmt=32, shared=57, global_load=19, barrier=12, move=88, integer=270,
             other=7),  # 829
        dict(fp8_widen=128, fp16_pack=4, hmma=32, exp2=10, fp32_arith=34, fp32_select=28,
             shuffle=8, prmt=32, shared=38, global_load=19, barrier=7, move=26, integer=201,
             other=5),  # 572
    )),
    # The same pages unsplit: each tile's two pages looked up one tile ahead.
    "paged64_unsplit": ((False, 64, 2, 0), (
        dict(fp8_widen=128, fp16_pack=8, hmma=64, exp2=18, fp32_arith=72, fp32_select=42,
             shuffle=12, prmt=32, shared=57, global_load=21, barrier=12, move=86, integer=270,
             other=11),  # 833
        dict(fp8_widen=128, fp16_pack=4, hmma=32, exp2=10, fp32_arith=34, fp32_select=28,
             shuffle=8, prmt=32, shared=38, global_load=21, barrier=7, move=31, integer=205,
             other=8),  # 586
    )),
    # Pages of 256 keys (a tile in one page), a split's 4 pages loaded before the loop.
    "paged256": ((True, 256, 0, 4), (
        dict(fp8_widen=128, fp16_pack=8, hmma=64, exp2=18, fp32_arith=72, fp32_select=42,
             shuffle=12, prmt=32, shared=59, global_load=19, barrier=14, move=89, integer=251,
             other=6),  # 814
        dict(fp8_widen=128, fp16_pack=4, hmma=32, exp2=10, fp32_arith=34, fp32_select=28,
             shuffle=8, prmt=32, shared=40, global_load=19, barrier=9, move=22, integer=187,
             other=2),  # 555
    )),
}


@pytest.mark.parametrize("cache", list(FP8_DECODE_TILE))
def test_fp8_decode_keys_m_tile_is_shorter(cache):
    """FLASHTILE_DECODE_FP8_KEYS_M=1's kernel (S^T = K Q^T, O^T = V^T P^T over FP8 V
    column pairs) at the tile decode_config gives it: no spills, K and V still copied
    asynchronously, V widened by paired cvts, and fewer instructions per key tile than
    the rows-on-M layout's, kind by kind as measured (FP8_DECODE_TILE): half the HMMAs (8 query
    rows padded as N, not 16 as M), about half the softmax's exp2, fp32 arithmetic and
    selects, no sum of P across the warps per tile (each thread keeps its own parts),
    no signed halving of V's word addresses, and K/V copies not masked (rows past the
    split re-read its last key)."""
    (split, page_size, tile_pages, split_pages), expected = FP8_DECODE_TILE[cache]
    q = torch.empty(1, dtype=torch.bfloat16, device="meta")
    counts = []
    for keys_m in (False, True):
        cfg = configs.decode_config(q, 128, 4, split=split, fp8_cache=True, keys_m=keys_m)
        assert (cfg.block_m, cfg.block_n) == ((8 if keys_m else 16), 128)
        compiled = compile_kernel(_decode_kernel, dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=128, EVEN_D=True,
            MASK_LEFT=False, MASK_RIGHT=False, HAS_SOFTCAP=False, HAS_ALIBI=False,
            PAGED=page_size > 0, PAGE_SIZE=page_size or 1, PAGE_ALIGNED=False,
            TILE_PAGES=tile_pages, SPLIT_PAGES=split_pages, HAS_BATCH_IDX=False,
            HAS_LEFTPAD=False, INPUT_PRECISION="ieee", LAUNCH_DEPENDENTS=split,
            HAS_Q_DESCALE=False, HAS_K_DESCALE=True, HAS_V_DESCALE=True, KEYS_M=keys_m),
            dtype="bf16", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            types={"KCache": "*fp8e4nv", "VCache": "*fp8e4nv", "Out": "*bf16"})
        assert resources(compiled)["stack_bytes"] == 0
        assert compiled.asm["ttgir"].count("async_copy_global_to_local") >= 4
        ptx = compiled.asm["ptx"]
        assert "ld.shared.b8" not in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
        counts.append(loop_instructions(compiled))
    assert tuple(counts) == expected
    assert sum(counts[1].values()) < sum(counts[0].values())


@pytest.mark.parametrize("cache_dtype, cvt", [("fp8e4nv", "e4m3x2"), ("fp8e5", "e5m2x2")])
def test_fp8_append_quantizes_with_satfinite(cache_dtype, cvt):
    """16-bit keys into an FP8 cache: IEEE division, then sm_90's saturating round to
    nearest even (cvt.rn.satfinite), which flashtile.fp8.quantize reproduces."""
    compiled = compile_kernel(_append_kernel, dict(
        BLOCK_T=16, BLOCK_D=128, PAGED=True, PAGE_SIZE=16, HAS_BATCH_IDX=False,
        HAS_K_DESCALE=True, HAS_V_DESCALE=True), dtype="bf16",
        types={"KCache": f"*{cache_dtype}", "VCache": f"*{cache_dtype}"})
    ptx = compiled.asm["ptx"]
    assert f"cvt.rn.satfinite.{cvt}.f32" in ptx
    assert "div.rn.f32" in ptx
    assert resources(compiled)["stack_bytes"] == 0


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", list(KERNELS)[:2] + ["bwd_dkdv", "bwd_fused", "bwd_dq"])
def test_dropout_compiles_for_sm90(kind, head_dim):
    """The dropout variants (HAS_DROPOUT: the Philox mask drawn per score tile) compile
    at the tables' tiles with the shared memory of the plain kernel: the four words of
    a Philox call land in one thread's registers (_common._dropout_keep), nothing is
    exchanged through shared memory (four neighbouring keys per call had needed 16 KB
    more at d128, over the limit). One call per four scores: at most 20 mul.hi.u32 (10
    rounds of 2) per call a thread makes in a tile, in each of the three unrolled
    spans; a call per score (the first version: 1,859 in the d128 forward) is 4x over.
    Registers and spills are printed, not asserted, until the GPU has timed them."""
    kernel, table, extra = KERNELS[kind]
    cfg = table[head_dim]
    compiled = {drop: compile_kernel(kernel, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                                  BLOCK_D=head_dim, HAS_DROPOUT=drop,
                                                  **extra, **PLAIN),
                                     dtype="bf16", num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages)
                for drop in (True, False)}
    ck = compiled[True]
    res = resources(ck)
    print(kind, cfg, res)
    assert res["shared_bytes"] == compiled[False].metadata.shared, res
    assert res["registers"] > 0 and res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    calls = cfg.block_m * cfg.block_n // (4 * 32 * cfg.num_warps)
    mul_hi = ck.asm["ptx"].count("mul.hi.u32")
    assert 0 < mul_hi <= 3 * 20 * calls, (mul_hi, calls)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k,bias,prologue", [
    (1152, 896, True, "NONE"), (9728, 896, False, "NONE"), (896, 4864, False, "NONE"),
    (28672, 4096, False, "NONE"), (1152, 896, True, "ADD_NORM"), (9728, 896, False, "NORM"),
    (28672, 4096, False, "ADD_NORM"), (896, 4864, False, "SILU"),
    (4096, 14336, False, "SILU")])
def test_engine_gemv_compiles_vectorised(n, k, bias, prologue, m):
    """engine/gemv.py at the 0.5B and 8B products, with its prologues (RMSNorm with the
    residual add, over one tile of K and over several; SiLU-and-multiply): no spills, W
    read in 16-byte vectors (the kernel is a stream of W's bytes), with the tiles its
    launcher takes."""
    from flashtile.engine import gemv
    block_n, block_k, warps = configs.gemv_tile(k)
    ck = compile_kernel(gemv._gemv_kernel, dict(N=n, K=k, BLOCK_M=m, BLOCK_N=block_n,
                                                BLOCK_K=block_k, HAS_BIAS=bias,
                                                PROLOGUE=getattr(gemv, prologue)),
                        num_warps=warps, types=dict(M="i32", eps="fp32"))
    assert resources(ck)["stack_bytes"] == 0
    assert "ld.global.v4.b32" in set(re.findall(r"\bld\.global[.\w]*", ck.asm["ptx"]))
