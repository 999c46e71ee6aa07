"""Compile a flashtile kernel for a GPU target without a GPU (Triton + its bundled ptxas).

Used by tests/test_sm90_compile.py to catch compile errors the interpreter cannot see,
and by developers to read registers, spills and shared memory of a tile config before
spending device time (from the repo root, ``from tests.aot import compile_kernel,
resources``). A developer tool: it is not part of the installed package.
"""

from __future__ import annotations

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

_FLOAT_SCALARS = {"softmax_scale", "softcap", "dropout_p"}
_FP32_POINTERS = {"Lse", "Delta", "DLse", "Alibi", "LsePartial", "OutPartial", "DQAccum",
                  "QDescale", "KDescale", "VDescale"}
_INT32_POINTERS = {"BlockTable", "CacheSeqlens", "CacheBatchIdx", "CacheLeftpad",
                   "CuSeqlensQ", "CuSeqlensK", "SequsedK"}
_INT64_POINTERS = {"Philox"}  # dropout's [seed, offset]


# Integer arguments that are multiples of 16 in the launches that matter (head_dim 64,
# 128, ...): the JIT marks them so, and without it the decode kernel's head-dim mask
# blocks vectorized loads and with them the software pipelining (NOTES.md section 8).
_DIVISIBLE_INTS = {"head_dim", "head_dim_v"}


def compile_kernel(kernel, constexprs: dict, dtype: str = "bf16", arch: int = 90,
                   num_warps: int = 4, num_stages: int = 1, types: dict | None = None):
    """Compile ``kernel`` (Triton or Gluon) with the given constexprs; tensors named in
    capitals are pointers (``dtype``, or fp32 for lse-like ones, u8 for Mask), other
    scalars i32, unless ``types`` names the argument's type (e.g. a TMA descriptor's,
    ``triton.runtime.jit.mangle_type(descriptor)``)."""
    types = types or {}
    params = inspect.signature(kernel.fn).parameters
    # V's head dim (BLOCK_DV, EVEN_DV) defaults to q's: the equal-dim kernel every
    # launch with v.shape[-1] == q.shape[-1] compiles.
    constexprs = dict(constexprs)
    for dv_name, d_name in (("BLOCK_DV", "BLOCK_D"), ("EVEN_DV", "EVEN_D")):
        if dv_name in params and dv_name not in constexprs and d_name in constexprs:
            constexprs[dv_name] = constexprs[d_name]
    # The decode kernel's key head dim in one tile (no tail), V loaded on its own (FP8
    # V as int16 column pairs where the launcher allows it, widened with sm_90's cvt).
    v_fp8 = str((types or {}).get("VCache", "")).startswith("*fp8")
    for name, default in (("BLOCK_DT", 0), ("V_IS_K", False),
                          ("V_PAIRS", v_fp8 and not constexprs.get("V_IS_K")),
                          ("PAIRS_ASM", arch >= 90), ("KEYS_M", False),
                          ("DV_PARTS", 1)):
        if name in params and name not in constexprs:
            constexprs[name] = default
    # No dropout unless asked: the kernel every call with dropout_p == 0 compiles.
    if "HAS_DROPOUT" in params:
        constexprs.setdefault("HAS_DROPOUT", False)
    sig, attrs = {}, {}
    for i, name in enumerate(params):
        # What the JIT infers at a real launch from aligned pointers and strides that
        # are multiples of 16; without it loads are scalar and the kernel is not the one
        # that runs.
        if name[0].isupper() or name.startswith("stride_") or name in _DIVISIBLE_INTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name[0].isupper():
            sig[name] = ("*fp32" if name in _FP32_POINTERS else "*i32"
                         if name in _INT32_POINTERS else "*i64"
                         if name in _INT64_POINTERS else "*u8" if name == "Mask"
                         else f"*{dtype}")
        elif name in _FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    src = source(kernel, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _cuobjdump(compiled, flag: str) -> str:
    """The bundled cuobjdump's output for the compiled kernel's cubin."""
    import os
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def resources(compiled) -> dict:
    """Registers, stack (spill) bytes and shared memory, read with the bundled cuobjdump."""
    import re

    fields = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", _cuobjdump(compiled, "-res-usage")))
    return dict(registers=int(fields.get("REG", -1)), stack_bytes=int(fields.get("STACK", -1)),
                shared_bytes=compiled.metadata.shared)


def tensor_core_ops(compiled) -> set:
    """The tensor-core instructions in the SASS: QGMMA (FP8 wgmma), HGMMA (16-bit
    wgmma), HMMA (mma.sync)."""
    import re

    return set(re.findall(r"\b(QGMMA|HGMMA|HMMA)\b", _cuobjdump(compiled, "-sass")))


# SASS opcodes by kind, for loop_instructions (the first that matches wins).
_SASS_KINDS = (
    ("fp8_widen", r"F2FP\.F16\.E(4M3|5M2)"),
    ("fp16_pack", r"F2FP\."),
    ("hmma", r"HMMA|HGMMA"),
    ("exp2", r"MUFU\.EX2"),
    ("fp32_arith", r"FMUL|FFMA|FADD"),
    ("fp32_select", r"FMNMX|FSEL|FSETP"),
    ("shuffle", r"SHFL"),
    ("prmt", r"PRMT"),
    ("shared", r"LDSM|LDS|STS|STSM"),
    ("global_load", r"LDGSTS|LDG|LDGDEPBAR|DEPBAR"),
    ("barrier", r"BAR\b|BAR\.|BSSY|BSYNC|WARPSYNC"),
    ("move", r"(IMAD\.)?MOV|CS2R"),
    ("integer", r"U?(IMAD|IADD3|LEA|SEL|ISETP|LOP3|SHF|VIADD|VIMNMX|IMNMX|PLOP3|P2R|R2P|"
                r"R2UR|S2R|S2UR|SGXT|IABS)"),
)


def loop_instructions(compiled) -> dict:
    """Instructions by kind (_SASS_KINDS, else "other") in the SASS of the kernel's
    longest loop, the instructions from the target of its longest backward branch to
    that branch: per thread per iteration of a kernel whose hot loop that is, such as
    the decode's K/V tile loop."""
    import re

    sass = _cuobjdump(compiled, "-sass")
    predicate = r"(?:@!?U?P\w+\s+)?"
    code = [(int(a, 16), op) for a, op in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+" + predicate + r"([A-Z][\w.]*)", sass)]
    loops = [(int(t, 16), int(a, 16)) for a, t in
             re.findall(r"/\*([0-9a-f]{4,})\*/\s+" + predicate + r"BRA\S*\s+0x([0-9a-f]+)",
                        sass) if int(t, 16) < int(a, 16)]
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    counts: dict = {}
    for addr, op in code:
        if lo <= addr <= hi:
            kind = next((k for k, pattern in _SASS_KINDS if re.match(pattern, op)), "other")
            counts[kind] = counts.get(kind, 0) + 1
    return counts
