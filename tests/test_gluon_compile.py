"""Compile the Gluon Hopper kernels (flashtile/ops/fwd_hopper.py, bwd_hopper.py) for sm_90
on the CPU.

Gluon kernels do not run in the Triton interpreter, so this is what CI can check of
them: every table entry compiles, fits in shared memory, does not spill, and keeps the
FA3 schedule's pieces (TMA loads, wgmma with P from registers, register reallocation
between the producer and the consumers). tests/test_fwd_hopper.py and
tests/test_bwd_hopper.py check the numbers on a GPU. About 2 s per variant on one core.
"""

import os
import subprocess

import pytest
import torch

from flashtile.ops import configs
from tests.aot import compile_kernel, resources

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs real Triton compilation (no interpreter)")


def _compile(head_dim, causal, dtype=torch.bfloat16):
    from triton.runtime.jit import mangle_type

    from flashtile.ops import fwd_hopper

    cfg = configs.HOPPER_FWD_16BIT[head_dim]
    x = torch.empty(2, 300, 4, head_dim, dtype=dtype)  # the launcher's descriptors, on CPU
    q_type = mangle_type(fwd_hopper._descriptor(x, fwd_hopper.BLOCK_M_WG.value))
    kv_type = mangle_type(fwd_hopper._descriptor(x, cfg.block_n))
    types = dict(q_desc=q_type, k_desc=kv_type, v_desc=kv_type, o_desc=q_type,
                 softmax_scale="fp32")
    return compile_kernel(fwd_hopper._attn_fwd_hopper_kernel,
                          dict(IS_CAUSAL=causal, STAGES=cfg.num_stages),
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


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", sorted(configs.HOPPER_FWD_16BIT))
def test_hopper_forward_compiles_for_sm90(head_dim, causal):
    ck = _compile(head_dim, causal)
    res = resources(ck)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
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


def test_hopper_forward_compiles_for_fp16():
    ck = _compile(128, True, torch.float16)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in ck.asm["ptx"]
    assert resources(ck)["stack_bytes"] == 0


def _compile_bwd(head_dim, causal, dtype=torch.bfloat16):
    from triton.runtime.jit import mangle_type

    from flashtile.ops import bwd_hopper

    cfg = configs.HOPPER_BWD_16BIT[head_dim]
    x = torch.empty(2, 300, 4, head_dim, dtype=dtype)  # the launcher's descriptors, on CPU
    q_type = mangle_type(bwd_hopper._descriptor(x, cfg.block_m))
    kv_type = mangle_type(bwd_hopper._descriptor(x, bwd_hopper.BLOCK_N_WG.value))
    types = dict(q_desc=q_type, do_desc=q_type, k_desc=kv_type, v_desc=kv_type,
                 dk_desc=kv_type, dv_desc=kv_type, softmax_scale="fp32")
    return compile_kernel(bwd_hopper._attn_bwd_hopper_kernel,
                          dict(IS_CAUSAL=causal, STAGES=cfg.num_stages),
                          num_warps=cfg.num_warps, types=types)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", sorted(configs.HOPPER_BWD_16BIT))
def test_hopper_backward_compiles_for_sm90(head_dim, causal):
    ck = _compile_bwd(head_dim, causal)
    res = resources(ck)
    assert res["shared_bytes"] <= configs.SM90_SMEM_BYTES, res
    sass = _sass(ck)
    # No tile spills under the 240-register cap. At head_dim 128 ptxas keeps a dozen
    # 4-byte scalars (addresses, tile coordinates) in local memory, 48 bytes, a few of
    # them reloaded per query block; the smallest tile, a 16-bit 64 x 64 operand, is 64
    # bytes a thread, and spilling one would show as a larger stack.
    assert res["stack_bytes"] <= (0 if head_dim == 64 else 48), res
    assert "HGMMA" in sass
    ptx = ck.asm["ptx"]
    assert ck.metadata.num_warps == 12  # two consumer warpgroups + the producer's
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx and ".maxnreg" in ptx
    assert "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier" in ptx  # TMA loads
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx  # TMA stores of dK, dV
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    # dV += P^T dO and dK += dS^T Q take their A operand from registers (a register
    # list, not a 64-bit descriptor); S^T, dP^T and dQ read both from shared memory.
    from_registers = [line for line in mma if line.count("{") == 2]
    assert mma and from_registers and len(from_registers) < len(mma)
    # dQ's partial sums: relaxed fp32 atomics, two values per instruction.
    assert "atom.global.gpu.relaxed.add.v2.f32" in ptx


def test_hopper_backward_compiles_for_fp16():
    ck = _compile_bwd(128, True, torch.float16)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in ck.asm["ptx"]
    assert resources(ck)["stack_bytes"] <= 48
