"""The torch backend: PyTorch's fused CPU flash-attention kernel where it fits, the tiled
reference (``flashtile.reference``) everywhere else.

On CPU tensors ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (what
``F.scaled_dot_product_attention`` runs on CPU, reached directly, so no
``torch.backends`` flag or dispatch heuristic decides) returns out and the natural-log
lse, and its ``_backward`` op takes them back. It knows no softcap, ALiBi or left window,
and its causal mask is top-left. flashtile's bottom-right causal (and a right window
with an unbounded left) becomes exact calls of it without any (seqlen_q, seqlen_k)
tensor: with ``D = diag_offset + window_right`` query i sees keys j <= i + D, so

* rows i < -D see no key (out 0, lse -inf, no call);
* the other rows all see keys [0, max(D, 0)): one call without a mask;
* keys [max(D, 0), seqlen_k) form a top-left causal call over those rows;

and the two partial results merge exactly through their lse. An SDPA ``attn_mask`` (the
user's, already seqlen_q x seqlen_k) is passed through, a bool one as an additive mask
in q's dtype. Everything else runs the tiled path: softcap, ALiBi, a bounded left window,
a mask together with a causal/window bound, GQA before torch 2.9 (the CPU kernel's GQA
support), CUDA tensors with ``FLASHTILE_BACKEND=torch``, empty shapes, and the backward
when the lse is differentiated (the fused backward has no lse-gradient input).

NaN: the fused kernel propagates a NaN that reaches a row (NaN out and lse), as the
tiled path does, except in a call of fewer keys than one vector (``_SHORT_CALL``), which
therefore takes the fused path only for finite inputs. A bool mask turned additive would
let a NaN or inf score of a masked key through (-inf + NaN is NaN) where the tiled path
hides it, so a bool mask takes the fused path only when q and k are finite (one cheap
pass over them). Rows a mask empties get 0 and -inf explicitly (the kernel writes lse 0
there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from packaging import version

from flashtile import reference

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
# GQA inside the CPU flash kernel (pytorch#157893, July 2025): torch 2.9 and later.
_CPU_FLASH_GQA = version.parse(torch.__version__).release >= (2, 9)
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The CPU kernel takes a row's running max with a vector max (NaN wins) over whole vectors
# of keys and std::max (NaN loses) over the rest. A call of fewer keys than one vector (8
# fp32 lanes on AVX2, 16 on AVX-512) therefore loses a row whose scores are all NaN: it
# returns 0 with lse 0 there (torch 2.13, found by a fuzz in session 36). Such short calls
# take the fused path only when q and k (and a mask) are finite; 64 keys covers any
# vector width, and the check costs one pass over q and k where the call itself is short.
_SHORT_CALL = 64


@dataclass(frozen=True)
class _Plan:
    """How one call maps onto the fused kernel (see the module docstring).

    row0: rows [0, row0) see no key. prefix: keys [0, prefix) are seen by every row
    from row0 on. Keys [prefix, seqlen_k) are top-left causal over those rows. mask:
    the additive mask for a single unmasked-geometry call, or None."""

    row0: int
    prefix: int
    mask: Optional[torch.Tensor] = None


def _compact(mask):
    """An expanded (stride-0) mask viewed at size 1 on those dims: the kernel broadcasts
    them, and a dtype conversion must not materialize the expansion."""
    for dim in range(mask.dim()):
        if mask.stride(dim) == 0 and mask.shape[dim] > 1:
            mask = mask.narrow(dim, 0, 1)
    return mask


def _finite(*xs):
    return all(bool(torch.isfinite(x).all()) for x in xs)


def _plan(q, k, *, attn_mask, alibi_slopes, diag_offset, window_left, window_right,
          softcap) -> Optional[_Plan]:
    """The fused plan for these arguments, or None where the tiled path must run."""
    plan = _geometry(q, k, attn_mask=attn_mask, alibi_slopes=alibi_slopes,
                     diag_offset=diag_offset, window_left=window_left,
                     window_right=window_right, softcap=softcap)
    if plan is None or plan.row0 == q.shape[1]:
        return plan
    # Finite inputs only, for a bool mask and for short calls (the module docstring).
    spans = [n for n in (plan.prefix, k.shape[1] - plan.prefix) if n > 0]
    bool_mask = attn_mask is not None and attn_mask.dtype == torch.bool
    short = min(spans) < _SHORT_CALL
    if (bool_mask or short) and not _finite(q, k):
        return None
    if short and not bool_mask and plan.mask is not None and bool(plan.mask.isnan().any()):
        return None
    return plan


def _geometry(q, k, *, attn_mask, alibi_slopes, diag_offset, window_left, window_right,
              softcap) -> Optional[_Plan]:
    """The calls of the fused kernel these arguments map onto, or None."""
    sq, h, sk = q.shape[1], q.shape[2], k.shape[1]
    if (q.device.type != "cpu" or q.dtype not in _FUSED_DTYPES or softcap > 0
            or alibi_slopes is not None or window_left >= 0
            or q.numel() == 0 or sk == 0
            or (k.shape[2] != h and not _CPU_FLASH_GQA)):
        return None
    if attn_mask is not None:
        if window_right >= 0:
            return None
        mask = _compact(attn_mask)
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        return _Plan(0, sk, mask)
    if window_right < 0:
        return _Plan(0, sk)
    reach = diag_offset + window_right  # query i sees keys j <= i + reach
    row0 = min(max(-reach, 0), sq)
    # Row row0 sees keys [0, prefix]: when that is every key, so does every later row,
    # and one mask-free call covers them all.
    prefix = max(reach, 0)
    if prefix >= sk - 1:
        prefix = sk
    return _Plan(row0, prefix)


def _call(q, k, v, causal, mask, scale):
    """The fused forward on (b, s, h, d) views: out (b, s, h, d), lse (b, h, s) fp32."""
    out, lse = _FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal,
                    attn_mask=mask, scale=scale)
    return out.transpose(1, 2), lse


def _fused_fwd(plan, q, k, v, scale):
    b, sq, h, d = q.shape
    sk = k.shape[1]
    if plan.row0 == sq:
        return q.new_zeros((b, sq, h, v.shape[-1])), q.new_full(
            (b, h, sq), float("-inf"), dtype=torch.float32)
    qr = q[:, plan.row0:]
    parts = []
    if plan.prefix > 0:
        parts.append(_call(qr, k[:, :plan.prefix], v[:, :plan.prefix], False, plan.mask,
                           scale))
    if plan.prefix < sk:
        parts.append(_call(qr, k[:, plan.prefix:], v[:, plan.prefix:], True, None, scale))
    o, l = parts[0] if len(parts) == 1 else reference.merge_attention_states_ref(
        parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    if plan.mask is not None:
        # Rows the mask empties: the kernel writes lse 0 (and out 0 * v); a NaN that
        # reached such a row (NaN + -inf) keeps it NaN, as on the tiled path.
        empty = (plan.mask == float("-inf")).all(-1).expand(b, h, sq) & ~torch.isnan(l)
        l = l.masked_fill(empty, float("-inf"))
        o = o.masked_fill(empty.transpose(1, 2)[..., None], 0.0)
    if plan.row0 == 0:
        return o.contiguous(), l.contiguous()
    out = q.new_zeros((b, sq, h, v.shape[-1]))
    lse = q.new_full((b, h, sq), float("-inf"), dtype=torch.float32)
    out[:, plan.row0:] = o
    lse[:, :, plan.row0:] = l
    return out, lse


def _fused_bwd(plan, dout, q, k, v, out, lse, scale):
    """Each part's gradients from the final out and lse: P = exp(S - lse) and
    delta = rowsum(dout * out) are those of the whole row, so the parts' dK/dV are
    exact and their dQ add up."""
    sk = k.shape[1]
    r = plan.row0
    # An empty row's lse -inf becomes +inf, so its P is exp(S - inf) = 0, never NaN.
    l = lse[:, :, r:]
    l = torch.where(l == float("-inf"), float("inf"), l)
    spans = ([(0, plan.prefix, False)] if plan.prefix > 0 else []) + \
        ([(plan.prefix, sk, True)] if plan.prefix < sk else [])
    grads = [_BWD(dout[:, r:].transpose(1, 2), q[:, r:].transpose(1, 2),
                  k[:, start:stop].transpose(1, 2), v[:, start:stop].transpose(1, 2),
                  out[:, r:].transpose(1, 2), l, 0.0, causal,
                  attn_mask=None if causal else plan.mask, scale=scale)
             for start, stop, causal in spans]
    # The op's gradients are (b, h, s, d) views of (b, s, h, d) memory: transposed back
    # they are contiguous, so a single call's are returned as they are, no copy.
    if len(grads) == 1:
        dq, dk, dv = (g.transpose(1, 2) for g in grads[0])
    else:
        dq = (grads[0][0].float() + grads[1][0].float()).transpose(1, 2).to(q.dtype)
        dk, dv = (torch.cat([g[i].transpose(1, 2) for g in grads], dim=1) for i in (1, 2))
    if r:
        dq = torch.cat([q.new_zeros((q.shape[0], r, *q.shape[2:])), dq], dim=1)
    return dq, dk, dv


def attention_fwd(q, k, v, *, softmax_scale, diag_offset, window_left, window_right,
                  softcap, alibi_slopes, attn_mask, dropout=None):
    """(out, lse) as ``reference.attention_tiled_fwd``, fused where the plan allows
    (not with dropout: the CPU kernel's own dropout draws another mask)."""
    kw = dict(diag_offset=diag_offset, window_left=window_left, window_right=window_right,
              softcap=softcap, alibi_slopes=alibi_slopes, attn_mask=attn_mask)
    # PyTorch's fused CPU kernel needs one head dim for q, k and v (MLA's v is narrower).
    plan = _plan(q, k, **kw) if v.shape[-1] == q.shape[-1] and dropout is None else None
    if plan is None:
        return reference.attention_tiled_fwd(q, k, v, softmax_scale=softmax_scale,
                                             dropout=dropout, **kw)
    return _fused_fwd(plan, q, k, v, softmax_scale)


def attention_bwd(dout, q, k, v, out, lse, dlse, *, softmax_scale, diag_offset,
                  window_left, window_right, softcap, alibi_slopes, attn_mask,
                  dropout=None):
    """(dq, dk, dv) as ``reference.attention_tiled_bwd``, fused where the plan allows,
    the lse carries no gradient and there is no dropout."""
    kw = dict(diag_offset=diag_offset, window_left=window_left, window_right=window_right,
              softcap=softcap, alibi_slopes=alibi_slopes, attn_mask=attn_mask)
    # PyTorch's fused CPU kernel needs one head dim for q, k and v (MLA's v is narrower).
    plan = _plan(q, k, **kw) if v.shape[-1] == q.shape[-1] and dropout is None else None
    if plan is None or (dlse is not None and dlse.any()):
        return reference.attention_tiled_bwd(dout, q, k, v, out, lse, dlse,
                                             softmax_scale=softmax_scale, dropout=dropout,
                                             **kw)
    return _fused_bwd(plan, dout, q, k, v, out, lse, softmax_scale)
