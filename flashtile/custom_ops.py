"""The ``flashtile::`` custom ops: one opaque node each for torch.compile, with autograd.

``attn_fwd`` returns (out, lse); ``attn_bwd`` returns (dq, dk, dv). Both pick the backend
(Triton kernels or the tiled PyTorch path) at run time from the tensors' device. The fake
implementations only allocate, with the strides the real ones return (contiguous), so
compiled graphs see the true layout.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from flashtile import reference
from flashtile._backend import select_backend


def _mask_kwargs(attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
                 window_right, softcap):
    return dict(attn_mask=attn_mask, alibi_slopes=alibi_slopes, softmax_scale=softmax_scale,
                diag_offset=diag_offset, window_left=window_left,
                window_right=window_right, softcap=softcap)


@torch.library.custom_op("flashtile::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
             alibi_slopes: Optional[Tensor], softmax_scale: float, diag_offset: int,
             window_left: int, window_right: int, softcap: float,
             allow_tf32: bool) -> tuple[Tensor, Tensor]:
    kw = _mask_kwargs(attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
                      window_right, softcap)
    if select_backend(q.device) == "triton":
        from flashtile.ops.fwd import attn_fwd as triton_fwd
        return triton_fwd(q, k, v, allow_tf32=allow_tf32, **kw)
    out, lse = reference.attention_tiled_fwd(q, k, v, **kw)
    return out.contiguous(), lse.contiguous()


@attn_fwd.register_fake
def _(q, k, v, attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
      window_right, softcap, allow_tf32):
    b, sq, h, d = q.shape
    return q.new_empty((b, sq, h, d)), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("flashtile::attn_bwd", mutates_args=())
def attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             dlse: Optional[Tensor], attn_mask: Optional[Tensor],
             alibi_slopes: Optional[Tensor], softmax_scale: float, diag_offset: int,
             window_left: int, window_right: int, softcap: float,
             allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    kw = _mask_kwargs(attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
                      window_right, softcap)
    if select_backend(q.device) == "triton":
        from flashtile.ops.bwd import attn_bwd as triton_bwd
        return triton_bwd(dout, q, k, v, out, lse, dlse, allow_tf32=allow_tf32, **kw)
    grads = reference.attention_tiled_bwd(dout, q, k, v, out, lse, dlse, **kw)
    return tuple(g.contiguous() for g in grads)


@attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, attn_mask, alibi_slopes, softmax_scale, diag_offset,
      window_left, window_right, softcap, allow_tf32):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


_SCALARS = ("softmax_scale", "diag_offset", "window_left", "window_right", "softcap",
            "allow_tf32")


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, alibi_slopes = inputs[:5]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, alibi_slopes)
    ctx.scalars = dict(zip(_SCALARS, inputs[5:]))


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask, alibi_slopes = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, dlse, attn_mask, alibi_slopes,
                          **ctx.scalars)
    return dq, dk, dv, None, None, None, None, None, None, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)
