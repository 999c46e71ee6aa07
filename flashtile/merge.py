"""Merge two partial attentions over disjoint key sets into the attention over their union.

If ``out_a, lse_a`` is attention of some queries over keys A and ``out_b, lse_b`` over
keys B (A and B disjoint), the attention over A u B is, per query row and head::

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

This is the combine step of split-KV decoding and of cascade / shared-prefix attention
(FlashInfer's ``merge_state``, vLLM's ``merge_attn_states``). The module reads top to
bottom: the Triton kernel, its launcher, the ``flashtile::merge_attn_states`` custom op
(torch.compile's view of the launcher), then the public function (validation, backend
choice). The PyTorch version with the same arguments is
``flashtile.reference.merge_attention_states_ref``.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashtile import _validate as V
from flashtile._backend import select_backend
from flashtile.custom_ops import _plain_eager
from flashtile.ops import configs
from flashtile.reference import merge_attention_states_ref

logger = logging.getLogger("flashtile")


@triton.jit
def _merge_attention_states_kernel(
    OutA, LseA, OutB, LseB, Out, Lse,
    stride_oa_b, stride_oa_s, stride_oa_h,
    stride_ob_b, stride_ob_s, stride_ob_h,
    stride_o_b, stride_o_s, stride_o_h,
    stride_la_b, stride_la_h, stride_la_s,
    stride_lb_b, stride_lb_h, stride_lb_s,
    stride_l_b, stride_l_h, stride_l_s,
    seqlen, head_dim,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """One program per (batch * seqlen, head) row: two scalar lse loads, two head_dim
    vectors in, one out. Memory-bound, so one row per program as in vLLM's Triton
    merge_attn_states; the max is subtracted before exp so nothing overflows."""
    # int64 offsets: batch * seqlen * nheads * head_dim can pass 2**31 elements.
    off_bs = tl.program_id(0).to(tl.int64)
    off_h = tl.program_id(1).to(tl.int64)
    off_b = off_bs // seqlen
    off_s = off_bs % seqlen

    b_lse_a = tl.load(LseA + off_b * stride_la_b + off_h * stride_la_h
                      + off_s * stride_la_s)
    b_lse_b = tl.load(LseB + off_b * stride_lb_b + off_h * stride_lb_h
                      + off_s * stride_lb_s)
    # Both sides empty (-inf): use 0 as the shift so no -inf - -inf NaN appears.
    b_max = tl.maximum(b_lse_a, b_lse_b)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w_a = tl.exp(b_lse_a - b_max)  # in [0, 1]; exactly 1 for the larger side
    b_w_b = tl.exp(b_lse_b - b_max)
    b_sum = b_w_a + b_w_b            # in [1, 2], or 0 when both sides are empty
    # Tests are == 0, never > 0: a NaN lse must fail "empty" and come out NaN.
    b_empty = b_sum == 0.0
    b_sum_safe = tl.where(b_empty, 1.0, b_sum)
    b_scale_a = b_w_a / b_sum_safe
    b_scale_b = b_w_b / b_sum_safe

    o_d = tl.arange(0, BLOCK_D)
    p_oa = OutA + off_b * stride_oa_b + off_s * stride_oa_s + off_h * stride_oa_h + o_d
    p_ob = OutB + off_b * stride_ob_b + off_s * stride_ob_s + off_h * stride_ob_h + o_d
    p_o = Out + off_b * stride_o_b + off_s * stride_o_s + off_h * stride_o_h + o_d
    if EVEN_D:
        b_oa = tl.load(p_oa).to(tl.float32)                                # (BLOCK_D,)
        b_ob = tl.load(p_ob).to(tl.float32)                                # (BLOCK_D,)
    else:
        m_d = o_d < head_dim
        b_oa = tl.load(p_oa, mask=m_d, other=0.0).to(tl.float32)          # (BLOCK_D,)
        b_ob = tl.load(p_ob, mask=m_d, other=0.0).to(tl.float32)          # (BLOCK_D,)
    # A side with weight 0 contributes nothing, whatever its out holds (an empty
    # partial may hold anything, even NaN, in other libraries).
    b_o = tl.where(b_scale_a == 0.0, 0.0, b_oa * b_scale_a) \
        + tl.where(b_scale_b == 0.0, 0.0, b_ob * b_scale_b)               # (BLOCK_D,)
    if EVEN_D:
        tl.store(p_o, b_o.to(Out.dtype.element_ty))
    else:
        tl.store(p_o, b_o.to(Out.dtype.element_ty), mask=m_d)
    if STORE_LSE:
        b_lse = tl.where(b_empty, float("-inf"), b_max + tl.log(b_sum_safe))
        tl.store(Lse + off_b * stride_l_b + off_h * stride_l_h + off_s * stride_l_s, b_lse)


_seen_variants: set = set()


def _log_first_launch(device, dtype, block_d):
    key = (device.type, dtype, block_d)
    if key not in _seen_variants:
        _seen_variants.add(key)
        logger.info("flashtile: compiling merge kernel (dtype=%s, head_dim<=%d)",
                    str(dtype).replace("torch.", ""), block_d)


def _check_merge_inputs(out_a, lse_a, out_b, lse_b, return_lse):
    """Shapes, dtypes and devices of the four tensors; returns (b, s, h, d)."""
    # The merge kernel addresses rows with 64-bit offsets: no 2**31 limit here.
    V.check_tensor(out_a, "out_a", 4, offsets32=False)
    V.check_tensor(out_b, "out_b", 4, offsets32=False)
    if out_b.dtype != out_a.dtype:
        V._fail(TypeError, "out_b.dtype", f"out_a's dtype {out_a.dtype}", out_b.dtype,
                "Both partial outputs must share one dtype")
    if out_b.device != out_a.device:
        V._fail(ValueError, "out_b.device", f"out_a's device {out_a.device}", out_b.device)
    if out_b.shape != out_a.shape:
        V._fail(ValueError, "out_b.shape", f"out_a's shape {tuple(out_a.shape)}",
                tuple(out_b.shape))
    b, s, h, d = out_a.shape
    if d < 1:
        V._fail(ValueError, "out_a.shape[-1] (head_dim)", "at least 1", d)
    for lse, name in ((lse_a, "lse_a"), (lse_b, "lse_b")):
        if not isinstance(lse, torch.Tensor):
            V._fail(TypeError, name, "a torch.Tensor", type(lse).__name__)
        if lse.dtype != torch.float32:
            V._fail(TypeError, f"{name}.dtype", "torch.float32", lse.dtype,
                    f"Pass {name}.float() (flashtile returns lse in float32)")
        if lse.device != out_a.device:
            V._fail(ValueError, f"{name}.device", f"out_a's device {out_a.device}",
                    lse.device)
        if tuple(lse.shape) != (b, h, s):
            V._fail(ValueError, f"{name}.shape", f"(batch, nheads, seqlen) = {(b, h, s)} "
                    "from out_a's (batch, seqlen, nheads, head_dim)", tuple(lse.shape),
                    "lse is laid out (batch, nheads, seqlen), as flash_attn_func "
                    "returns it")
    if not isinstance(return_lse, bool):
        V._fail(TypeError, "return_lse", "a bool", type(return_lse).__name__)
    return b, s, h, d


def _merge_launch(out_a, lse_a, out_b, lse_b, return_lse):
    """Launch the merge kernel on validated inputs: out, and lse if return_lse."""
    b, s, h, d = out_a.shape
    out = torch.empty((b, s, h, d), dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=out_a.device) \
        if return_lse else None
    # Without return_lse the kernel stores no lse: out stands in as a never-written
    # pointer with zero strides.
    p_lse, lse_strides = (lse, lse.stride()) if return_lse else (out, (0, 0, 0))
    if out.numel():
        block_d = configs.next_power_of_2(d)
        _log_first_launch(out.device, out.dtype, block_d)
        _merge_attention_states_kernel[(b * s, h)](
            OutA=out_a, LseA=lse_a, OutB=out_b, LseB=lse_b, Out=out, Lse=p_lse,
            stride_oa_b=out_a.stride(0), stride_oa_s=out_a.stride(1),
            stride_oa_h=out_a.stride(2),
            stride_ob_b=out_b.stride(0), stride_ob_s=out_b.stride(1),
            stride_ob_h=out_b.stride(2),
            stride_o_b=out.stride(0), stride_o_s=out.stride(1), stride_o_h=out.stride(2),
            stride_la_b=lse_a.stride(0), stride_la_h=lse_a.stride(1),
            stride_la_s=lse_a.stride(2),
            stride_lb_b=lse_b.stride(0), stride_lb_h=lse_b.stride(1),
            stride_lb_s=lse_b.stride(2),
            stride_l_b=lse_strides[0], stride_l_h=lse_strides[1],
            stride_l_s=lse_strides[2],
            seqlen=s, head_dim=d,
            BLOCK_D=block_d, EVEN_D=block_d == d, STORE_LSE=return_lse,
        )
    return (out, lse) if return_lse else out


def _merge_op_impl(out_a: Tensor, lse_a: Tensor, out_b: Tensor,
                   lse_b: Tensor) -> tuple[Tensor, Tensor]:
    return _merge_launch(out_a, lse_a, out_b, lse_b, return_lse=True)


# One opaque node under torch.compile, torch.export and fake tensors: Dynamo cannot
# trace the launcher (its first-launch log line is a graph break under fullgraph).
# Plain eager calls skip it and launch directly, storing lse only when asked.
merge_attn_states = torch.library.custom_op("flashtile::merge_attn_states",
                                            mutates_args=())(_merge_op_impl)


@merge_attn_states.register_fake
def _(out_a, lse_a, out_b, lse_b):
    b, s, h, d = out_a.shape
    return out_a.new_empty((b, s, h, d)), out_a.new_empty((b, h, s), dtype=torch.float32)


def merge_attention_states(out_a, lse_a, out_b, lse_b, return_lse=True):
    """Attention over keys A u B from the attentions over disjoint key sets A and B.

    Arguments:
        out_a, out_b: (batch, seqlen, nheads, head_dim), float16, bfloat16 or float32,
            same dtype, shape and device; the outputs of attention of the same queries
            over key set A and key set B. Any strides with the last dim contiguous.
        lse_a, lse_b: (batch, nheads, seqlen) float32, the natural-log log-sum-exp of
            each row's scores over its key set (what ``flash_attn_func(...,
            return_lse=True)`` returns); -inf for a row that saw no key of that set.
            Any strides.
        return_lse: also return the merged lse (default True).

    Returns:
        out: (batch, seqlen, nheads, head_dim) contiguous, out_a's dtype:
            ``out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``, computed in fp32.
        lse (if return_lse): (batch, nheads, seqlen) float32, ``logaddexp(lse_a, lse_b)``.

    A side whose lse is -inf contributes nothing (its out is not read into the sum), so
    the result is then exactly the other side; where both are -inf, out is 0 and lse is
    -inf, never NaN.

    Backends: the Triton kernel on CUDA tensors (and on CPU tensors under
    TRITON_INTERPRET=1), PyTorch ops on CPU tensors, as chosen by
    ``flashtile._backend.select_backend`` (``FLASHTILE_BACKEND`` overrides). The Triton
    kernel is forward-only: when grad mode is on and an input requires grad, the call
    runs the PyTorch version instead (same result up to fp32 rounding, differentiable
    by autograd, but several elementwise passes over out instead of the kernel's one).
    """
    _check_merge_inputs(out_a, lse_a, out_b, lse_b, return_lse)
    needs_grad = torch.is_grad_enabled() and any(
        x.requires_grad for x in (out_a, lse_a, out_b, lse_b))
    if needs_grad or select_backend(out_a.device, out_a.dtype, "out_a") == "torch":
        return merge_attention_states_ref(out_a, lse_a, out_b, lse_b, return_lse)
    if _plain_eager((out_a, lse_a, out_b)):
        return _merge_launch(out_a, lse_a, out_b, lse_b, return_lse)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    return (out, lse) if return_lse else out
