"""FP8 attention for inference: flash-attn 3's ``q_descale``, ``k_descale``, ``v_descale``.

q, k, v in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (one format for all three)
stand for the real values ``descale * x``: ``q_descale``, ``k_descale`` and ``v_descale``
are fp32 tensors of shape (batch, nheads_kv), query head h using its KV head's factor
``q_descale[b, h // (nheads // nheads_kv)]`` (flash-attn 3's layout). A factor left None
is 1.0, as in flash-attn 3. A per-tensor scale is passed as a 0-d or (1,) tensor, or any
shape that broadcasts to (batch, nheads_kv) ((nheads_kv,): per head, (batch, 1): per
sequence); it is expanded without a copy. The output is bfloat16 unless ``out_dtype``
names float16 or float32 (flash-attn 3 returns bfloat16). Forward only.

A paged KV pool may be float8 under float16 or bfloat16 q, as flash_attn_with_kvcache's
FP8 cache (vLLM's ``kv_cache_dtype="fp8"``): ``flash_attn_varlen_func`` with a
``block_table`` then takes ``k_descale`` and ``v_descale`` for the pool (no
``q_descale``), widens the pool's tiles to q's dtype (exactly) for 16-bit products, and
returns q's dtype: prefill chunks and prefix-cache hits over the same cache the decode
steps read.

``quantize`` and ``dequantize`` are the definitions the kernels are tested against: the
KV-cache append of 16-bit keys into an FP8 cache is ``quantize(k, k_descale)``.

This module validates the FP8 arguments of the public functions and holds the
``flashtile::fp8_attn_fwd`` custom op (dense, packed varlen and paged varlen). Its
PyTorch path (CPU tensors) dequantises to fp32 and runs the tiled reference, the same
semantics as the Triton kernels with exact P (see docs/fp8.md for the
kernels' FP8 tricks and their error).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from flashtile import _validate as V
from flashtile._backend import hopper_fwd_mode, select_backend
from flashtile.ops._fp8 import FP8_DTYPES, FP8_MAX

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def is_fp8(dtype) -> bool:
    return dtype in FP8_DTYPES


def check_descale(x, name, batch, nheads_kv, device):
    """None, or x expanded (no copy) to (batch, nheads_kv): a float32 tensor on
    ``device`` whose shape broadcasts to that (0-d or (1,): one scale for all)."""
    if x is None:
        return None
    if not isinstance(x, Tensor):
        V._fail(TypeError, name, "a float32 torch.Tensor of shape (batch, nheads_kv) or None",
                type(x).__name__)
    if x.dtype != torch.float32:
        V._fail(TypeError, f"{name}.dtype", "torch.float32 (flash-attn 3's descale)",
                x.dtype, f"Pass {name}.float()")
    if x.device != device:
        V._fail(ValueError, f"{name}.device", f"q's device {device}", x.device)
    target = (batch, nheads_kv)
    shape = tuple(x.shape)
    if not V.broadcastable(shape, target):
        V._fail(ValueError, f"{name}.shape", f"{target} (batch, nheads_kv), or a shape that "
                "broadcasts to it such as () for one scale", shape)
    return x.expand(target)


def check_out_dtype(out_dtype, fp8_q, q_dtype):
    """The output dtype: out_dtype, bfloat16 by default for FP8 q (flash-attn 3); for
    other q only None or q's dtype."""
    if not fp8_q:
        if out_dtype is not None and out_dtype != q_dtype:
            V._fail(ValueError, "out_dtype", f"None or q's dtype {q_dtype} (out_dtype "
                    "chooses the output of float8 q)", out_dtype)
        return q_dtype
    if out_dtype is None:
        return torch.bfloat16
    if out_dtype not in OUT_DTYPES:
        V._fail(TypeError, "out_dtype", "torch.bfloat16, torch.float16 or torch.float32",
                out_dtype)
    return out_dtype


def refuse_grad(tensors, names, what):
    """FP8 attention has no backward: a tensor that asks for a gradient is an error that
    names it and its dtype."""
    if not torch.is_grad_enabled():
        return
    for x, name in zip(tensors, names):
        if x is not None and x.requires_grad:
            raise NotImplementedError(
                f"{name} requires grad, but {what} is forward only (inference, like "
                f"flash-attn 3's FP8 path; {name}.dtype is {x.dtype}). Call it under "
                "torch.no_grad(), or pass tensors that do not require grad")


MAX_FP8_HEAD_DIM = 256


def check_fp8_args(q, k, v, batch, nheads_kv, descales, out_dtype):
    """flash_attn_func / flash_attn_varlen_func: (descales expanded to (batch,
    nheads_kv) or None, output dtype), or None when the call is not FP8 (then no
    descale may be given, and out_dtype only as q's dtype). q, k and v already share
    one dtype (check_qkv names k or v if not), but for 16-bit q over a float8 pool
    (paged varlen), where k_descale and v_descale scale the pool and the output is q's
    dtype."""
    if out_dtype is None and descales[0] is None and descales[1] is None \
            and descales[2] is None and q.dtype not in FP8_DTYPES \
            and k.dtype not in FP8_DTYPES:
        return None  # nothing FP8 asked for: what the checks below return for it
    fp8 = is_fp8(q.dtype)
    fp8_pool = not fp8 and is_fp8(k.dtype)
    out_dtype = check_out_dtype(out_dtype, fp8, q.dtype)
    if not fp8:
        for x, name in zip(descales, DESCALE_NAMES):
            if x is not None and not (fp8_pool and name != "q_descale"):
                what = "q" if fp8_pool else "q, k, v"
                V._fail(ValueError, name, f"None with {q.dtype} {what} (descales scale "
                        "float8 inputs)", "a tensor")
        if not fp8_pool:
            return None
    if q.shape[-1] > MAX_FP8_HEAD_DIM:
        V._fail(ValueError, "q.shape[-1] (head_dim)", f"1 to {MAX_FP8_HEAD_DIM} for float8 "
                "inputs (the FP8 tiles stop there; 16-bit inputs go to 512)", q.shape[-1])
    descales = [check_descale(x, name, batch, nheads_kv, q.device)
                for x, name in zip(descales, DESCALE_NAMES)]
    refuse_grad((q, k, v, *descales), ("q", "k", "v", *DESCALE_NAMES), "FP8 attention")
    return descales, out_dtype


def quantize(x: Tensor, descale: Optional[Tensor] = None,
             dtype: torch.dtype = torch.float8_e4m3fn,
             nheads_kv: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(x_fp8, descale): x (batch, seqlen, nheads, head_dim) in ``dtype`` such that
    ``dequantize(x_fp8, descale)`` approximates x; descale fp32 (batch, nheads_kv).

    nheads_kv: the number of scales per sequence (default nheads): head h takes
    descale[:, h // (nheads // nheads_kv)], as q does with GQA. descale None: the
    largest |x| over each scale's heads, sequence and head dim, divided by dtype's
    largest finite value (448 for e4m3, 57344 for e5m2); 1.0 where x is all zero. Else
    any fp32 tensor that broadcasts to (batch, nheads_kv). Each element is x / descale
    (IEEE division in fp32) rounded to the nearest FP8 value, ties to even, saturated at
    the largest finite value; NaN stays NaN (as sm_90's cvt.rn.satfinite).
    """
    if dtype not in FP8_DTYPES:
        V._fail(TypeError, "dtype", "torch.float8_e4m3fn or torch.float8_e5m2", dtype)
    V.check_tensor(x, "x", 4)
    batch, _, nheads, _ = x.shape
    nheads_kv = nheads if nheads_kv is None else nheads_kv
    if not isinstance(nheads_kv, int) or nheads_kv < 1 or nheads % nheads_kv:
        V._fail(ValueError, "nheads_kv", f"a divisor of x's nheads {nheads}", nheads_kv)
    bound = FP8_MAX[dtype]
    if descale is None:
        amax = x.detach().abs().float().unflatten(2, (nheads_kv, -1)).amax(dim=(1, 3, 4)) \
            if x.numel() else x.new_zeros((batch, nheads_kv), dtype=torch.float32)
        descale = torch.where(amax > 0, amax / bound, 1.0)
    descale = check_descale(descale, "descale", batch, nheads_kv, x.device)
    scale = descale.repeat_interleave(nheads // nheads_kv, dim=1)[:, None, :, None]
    return (x.float() / scale).clamp(-bound, bound).to(dtype), descale.contiguous()


def dequantize(x: Tensor, descale: Optional[Tensor]) -> Tensor:
    """float32 descale[b, h // group] * x for x (batch, seqlen, nheads, head_dim) and
    descale (batch, nheads_kv) or None (1.0), group = nheads // nheads_kv."""
    x = x.float()
    if descale is None:
        return x
    group = x.shape[2] // descale.shape[1]
    return x * descale.repeat_interleave(group, dim=1)[:, None, :, None]


# ---- flashtile::fp8_attn_fwd: dense (cu_seqlens_q None), packed varlen, paged ----

def _unpage(pool, block_table, lengths):
    """The keys of a paged FP8 pool, each sequence's lengths[b] keys back to back:
    (total_k, nheads_kv, head_dim), the PyTorch path's packed form. Gathered as bytes:
    indexing has no FP8 kernel in every torch build."""
    from flashtile.reference import gather_pages

    raw = pool.view(torch.uint8)
    parts = [gather_pages(raw, block_table[b], 0, n) for b, n in enumerate(lengths)]
    packed = torch.cat(parts) if parts else raw.new_empty((0, *pool.shape[2:]))
    return packed.view(pool.dtype)


def dequantize_packed(x, descale, cu_seqlens):
    """dequantize for packed rows: row r of sequence b takes descale[b]."""
    x = x.float()
    if descale is None:
        return x
    seq = torch.repeat_interleave(torch.arange(descale.shape[0], device=x.device),
                                  (cu_seqlens[1:] - cu_seqlens[:-1]).long(),
                                  output_size=x.shape[0])
    group = x.shape[1] // descale.shape[1]
    return x * descale[seq].repeat_interleave(group, dim=1)[:, :, None]


def _torch_fp8_fwd(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, block_table, seqused_k, kw):
    """The PyTorch path: dequantise to fp32, then the non-FP8 implementations."""
    from flashtile import custom_ops

    if cu_seqlens_q is None:
        q, k, v = (dequantize(x, d) for x, d in ((q, q_descale), (k, k_descale),
                                                 (v, v_descale)))
        return custom_ops._attn_fwd_impl(q, k, v, None, **kw, allow_tf32=False)
    if block_table is not None:
        lengths = (seqused_k if seqused_k is not None
                   else cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        k, v = (_unpage(x, block_table, lengths) for x in (k, v))
        cu_seqlens_k = torch.tensor([0, *lengths], device=q.device).cumsum(0).int()
        max_seqlen_k = max(lengths, default=0)
    q = dequantize_packed(q, q_descale, cu_seqlens_q)
    k = dequantize_packed(k, k_descale, cu_seqlens_k)
    v = dequantize_packed(v, v_descale, cu_seqlens_k)
    kw = dict(kw)
    kw.pop("diag_offset")
    return custom_ops._varlen_attn_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k, allow_tf32=False,
                                            **kw)


def _fp8_attn_fwd_impl(q: Tensor, k: Tensor, v: Tensor, q_descale: Optional[Tensor],
                       k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                       cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                       max_seqlen_q: int, max_seqlen_k: int, block_table: Optional[Tensor],
                       seqused_k: Optional[Tensor], alibi_slopes: Optional[Tensor],
                       softmax_scale: float, diag_offset: int, window_left: int,
                       window_right: int, softcap: float,
                       out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(out in out_dtype, lse fp32) of FP8 q, k, v, or of 16-bit q over a float8 pool
    (block_table); dense when cu_seqlens_q is None."""
    backend = select_backend(q.device, q.dtype)
    if backend == "triton" and not is_fp8(q.dtype):  # the pool's format, refused where
        select_backend(q.device, k.dtype, "k")       # the interpreter rounds it wrongly
    if cu_seqlens_q is not None and (backend == "torch" or V.index_checks_enabled()) \
            and V.can_read_indices(q):
        # As custom_ops' varlen op: here, at run time, so compiled graphs check too.
        if block_table is not None:
            V.check_paged_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        block_table, seqused_k)
        else:
            V.check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k)
    kw = dict(alibi_slopes=alibi_slopes, softmax_scale=softmax_scale,
              diag_offset=diag_offset, window_left=window_left, window_right=window_right,
              softcap=softcap)
    if backend == "torch":
        out, lse = _torch_fp8_fwd(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q,
                                  cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                  seqused_k, kw)
        return out.to(out_dtype), lse
    if cu_seqlens_q is None:
        fwd_hopper = _hopper_fwd(q, k, v, kw, out_dtype)
        if fwd_hopper is not None:
            return fwd_hopper.forward(q, k, v, softmax_scale, diag_offset,
                                      causal=window_right == 0, q_descale=q_descale,
                                      k_descale=k_descale, v_descale=v_descale,
                                      out_dtype=out_dtype)
    from flashtile.ops.fwd import attn_fwd

    varlen = {}
    if cu_seqlens_q is not None:
        varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                      block_table=block_table, seqused_k=seqused_k)
        kw["diag_offset"] = 0
    return attn_fwd(q, k, v, attn_mask=None, allow_tf32=False, q_descale=q_descale,
                    k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
                    **kw, **varlen)


def _hopper_fwd(q, k, v, kw, out_dtype):
    """flashtile.ops.fwd_hopper where FLASHTILE_HOPPER_FWD sends this dense FP8 call to
    the Gluon kernel and the kernel supports it, else None (the portable kernel runs it;
    varlen and paged calls always do)."""
    from flashtile import custom_ops

    mode = hopper_fwd_mode()
    if mode != "1" and not (mode == "auto" and custom_ops._hopper_fwd_wins(q)):
        return None
    fwd_hopper = custom_ops._gluon_fwd(required=mode == "1")
    if fwd_hopper is None or fwd_hopper.unsupported(q, k, v, out_dtype=out_dtype,
                                                    **kw) is not None:
        return None
    return fwd_hopper


fp8_attn_fwd = torch.library.custom_op("flashtile::fp8_attn_fwd",
                                       mutates_args=())(_fp8_attn_fwd_impl)


@fp8_attn_fwd.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, block_table, seqused_k, alibi_slopes, softmax_scale, diag_offset,
      window_left, window_right, softcap, out_dtype):
    if cu_seqlens_q is None:
        b, sq, h, _ = q.shape
        lse_shape = (b, h, sq)
    else:
        lse_shape = (q.shape[1], q.shape[0])
    return (q.new_empty(q.shape, dtype=out_dtype),
            q.new_empty(lse_shape, dtype=torch.float32))


def fp8_attention(q, k, v, descales, *, alibi_slopes, softmax_scale, diag_offset,
                  window_left, window_right, softcap, out_dtype, cu_seqlens_q=None,
                  cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, block_table=None,
                  seqused_k=None):
    """(out, lse) through ``flashtile::fp8_attn_fwd`` (the op under torch.compile,
    tracing and fake tensors; its implementation in plain eager mode)."""
    from flashtile.custom_ops import _plain_eager

    op = _fp8_attn_fwd_impl if _plain_eager((q, k, v)) else fp8_attn_fwd
    return op(q, k, v, *descales, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              block_table, seqused_k, alibi_slopes, softmax_scale, diag_offset,
              window_left, window_right, softcap, out_dtype)
