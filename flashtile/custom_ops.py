"""The ``flashtile::`` custom ops: one opaque node each for torch.compile, with autograd.

``attn_fwd`` returns (out, lse); ``attn_bwd`` returns (dq, dk, dv). Both pick the backend
(Triton kernels or the tiled PyTorch path) at run time from the tensors' device. The fake
implementations only allocate, with the strides the real ones return (contiguous), so
compiled graphs see the true layout.

The Triton backward has two paths (flashtile/ops/bwd.py): split, bitwise reproducible,
and fused, fewer matrix products with dq summed by atomics (reproducible to rounding).
``deterministic`` (flash-attn's flag) True always takes the split path; False takes
FLASHTILE_BWD's choice, read at each backward: "split" or "fused" (default DEFAULT_BWD).
torch.use_deterministic_algorithms(True) counts as deterministic=True.
FLASHTILE_HOPPER_BWD (``flashtile._backend.hopper_bwd_mode``; default "auto": from
configs.HOPPER_BWD_AUTO_MIN_SEQLEN queries and keys) sends the dense 16-bit backwards it
supports on sm_90 to the Gluon kernel (flashtile/ops/bwd_hopper.py, atomic dQ), unless
deterministic.

Dropout: ``dropout_p`` > 0 comes with ``philox``, the int64 [seed, offset] tensor the
caller drew from PyTorch's generator (``flashtile.interface._philox``); it is saved for
the backward, which regenerates the same mask from it on either backend.

Callers use ``attention`` / ``varlen_attention``: plain eager calls run the same
implementation, setup_context and backward as an autograd.Function, without the
dispatcher's round trip through the op; torch.compile, tracing, fake or meta tensors
and torch.func transforms get the op itself.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from flashtile import _torch_backend, reference
from flashtile._backend import getenv, hopper_bwd_mode, hopper_fwd_mode, select_backend
from flashtile._validate import (MAX_LAYOUTS, MAX_OFFSET, can_read_indices,
                                 check_paged_varlen_values, check_varlen_values,
                                 index_checks_enabled, offset_reach)
from flashtile.ops import configs
from flashtile.ops.bwd import attn_bwd as triton_bwd
from flashtile.ops.fwd import attn_fwd as triton_fwd


BWD_PATHS = ("split", "fused")
# The split path is the default: on the H200 the fused one ran forward+backward at
# 0.57-0.86x the split one (d64/d128, 1k-16k tokens; NOTES.md section 22).
DEFAULT_BWD = "split"


def fused_backward(deterministic: bool) -> bool:
    """Whether a Triton backward takes the fused path (module docstring)."""
    path = getenv("FLASHTILE_BWD", "").strip().lower() or DEFAULT_BWD
    if path not in BWD_PATHS:
        raise ValueError(f"FLASHTILE_BWD must be one of {BWD_PATHS} (or unset: "
                         f"{DEFAULT_BWD!r}), got {path!r}")
    return path == "fused" and not _deterministic(deterministic)


def _deterministic(deterministic: bool) -> bool:
    """The call asked for reproducible gradients, itself or through PyTorch's switch."""
    return deterministic or torch.are_deterministic_algorithms_enabled()


def _mask_kwargs(attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
                 window_right, softcap):
    return dict(attn_mask=attn_mask, alibi_slopes=alibi_slopes, softmax_scale=softmax_scale,
                diag_offset=diag_offset, window_left=window_left,
                window_right=window_right, softcap=softcap)


def _attn_fwd_impl(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
             alibi_slopes: Optional[Tensor], softmax_scale: float, diag_offset: int,
             window_left: int, window_right: int, softcap: float,
             allow_tf32: bool, deterministic: bool = False, dropout_p: float = 0.0,
             philox: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    # deterministic only matters to the backward: kept for it by _setup_context.
    return _forward(q, k, v, attn_mask, alibi_slopes, softmax_scale, diag_offset,
                    window_left, window_right, softcap, allow_tf32, dropout_p, philox)


def _forward(q, k, v, attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
             window_right, softcap, allow_tf32, dropout_p, philox, return_lse=True,
             layout=None):
    """(out, lse) of either backend; return_lse=False may return None for lse (the
    portable Triton kernel then keeps it in out's allocation: one allocation less).
    layout: as in ``attention``."""
    if select_backend(q.device, q.dtype) == "triton":
        mode = hopper_fwd_mode()
        if mode == "1" or (mode == "auto" and _hopper_fwd_wins(q)):
            fwd_hopper = _gluon_fwd(required=mode == "1")
            if fwd_hopper is not None and _gluon_serves(
                    fwd_hopper, q, k, v, layout, attn_mask, alibi_slopes, softmax_scale,
                    window_left, window_right, softcap, dropout_p):
                return fwd_hopper.forward(q, k, v, softmax_scale, diag_offset,
                                          causal=window_right == 0, return_lse=return_lse)
        # Keywords spelled out, not **_mask_kwargs: no dict built on the eager path.
        return triton_fwd(q, k, v, attn_mask=attn_mask, alibi_slopes=alibi_slopes,
                          softmax_scale=softmax_scale, diag_offset=diag_offset,
                          window_left=window_left, window_right=window_right,
                          softcap=softcap, allow_tf32=allow_tf32, dropout_p=dropout_p,
                          philox=philox, return_lse=return_lse, layout=layout)
    out, lse = _torch_backend.attention_fwd(
        q, k, v, dropout=_dense_dropout(q, dropout_p, philox), **_mask_kwargs(
            attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
            window_right, softcap))
    return out.contiguous(), lse.contiguous()


@functools.lru_cache(maxsize=None)
def _gluon_fwd(required: bool = False):
    """flashtile.ops.fwd_hopper, imported at the first call that may take it. Gluon needs
    triton >= 3.6: older ones keep the portable kernel, unless FLASHTILE_HOPPER_FWD=1
    asked for it by name (then the ImportError stands)."""
    try:
        from flashtile.ops import fwd_hopper
    except ImportError:
        if required:
            raise
        return None
    return fwd_hopper


# fwd_hopper.layout_unsupported's answer per layout id (``attention``'s layout): a call
# whose q, k and v have a layout met before checks only its options and addresses.
_GLUON_LAYOUTS: dict = {}


def _gluon_serves(fwd_hopper, q, k, v, layout, attn_mask, alibi_slopes, softmax_scale,
                  window_left, window_right, softcap, dropout_p) -> bool:
    """``fwd_hopper.unsupported(...) is None``, its layout checks remembered per layout
    id (the eager forward's host time, issue 15)."""
    # Keywords spelled out, not **_mask_kwargs: no dict built on the eager path.
    if fwd_hopper.options_unsupported(
            q, softmax_scale=softmax_scale, attn_mask=attn_mask, alibi_slopes=alibi_slopes,
            window_left=window_left, window_right=window_right, softcap=softcap,
            dropout_p=dropout_p) is not None:
        return False
    if layout is None:
        return fwd_hopper.layout_unsupported(q, k, v) is None \
            and not fwd_hopper.misaligned(q, k, v)
    serves = _GLUON_LAYOUTS.get(layout)
    if serves is None:
        if len(_GLUON_LAYOUTS) >= MAX_LAYOUTS:
            _GLUON_LAYOUTS.clear()
        serves = _GLUON_LAYOUTS[layout] = fwd_hopper.layout_unsupported(q, k, v) is None
    return serves and not fwd_hopper.misaligned(q, k, v)


def _hopper_fwd_wins(q: Tensor) -> bool:
    """FLASHTILE_HOPPER_FWD=auto's cells, where the Gluon kernel was timed faster than
    the portable one:
    - 16-bit inputs at head dims 64, 128 and 256 from configs.HOPPER_FWD_AUTO_MIN_SEQLEN
      queries: 1.26-1.75x at d128/d256 from 1k (NOTES.md section 20), d64 on the
      persistent grid 1.04-1.21x (section 23), 128-512 queries 1.1-1.7x (section 32);
      d96 in d128's tile (configs.HOPPER_WIDER) 1.17-1.57x from 1k (section 36).
    - FP8 (flashtile.fp8) at head dims 64, 128 and 256 from
      configs.HOPPER_FWD_FP8_AUTO_MIN_SEQLEN queries: 1.10-1.62x on an H100 at 1k-16k
      (NOTES.md section 49). Shorter calls untimed."""
    if q.element_size() == 1:
        return q.shape[-1] in configs.HOPPER_FWD_FP8_AUTO_D \
            and q.shape[1] >= configs.HOPPER_FWD_FP8_AUTO_MIN_SEQLEN
    return q.element_size() == 2 and q.shape[-1] >= 64 \
        and q.shape[1] >= configs.HOPPER_FWD_AUTO_MIN_SEQLEN


def _hopper_bwd_wins(q: Tensor, k: Tensor) -> bool:
    """FLASHTILE_HOPPER_BWD=auto's cells: both lengths from
    configs.HOPPER_BWD_AUTO_MIN_SEQLEN of the head dim (NOTES.md sections 22, 24, 32, 33)."""
    least = configs.HOPPER_BWD_AUTO_MIN_SEQLEN.get(q.shape[-1])
    return least is not None and min(q.shape[1], k.shape[1]) >= least


def _dense_dropout(q, dropout_p, philox):
    """The torch backend's description of the kernels' dropout mask (or None)."""
    if philox is None:
        return None
    return reference.Dropout.dense(philox, dropout_p, q.shape[0], q.shape[2], q.shape[1])


attn_fwd = torch.library.custom_op("flashtile::attn_fwd", mutates_args=())(_attn_fwd_impl)


@attn_fwd.register_fake
def _(q, k, v, attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
      window_right, softcap, allow_tf32, deterministic=False, dropout_p=0.0, philox=None):
    b, sq, h, _ = q.shape
    return (q.new_empty((b, sq, h, v.shape[-1])),
            q.new_empty((b, h, sq), dtype=torch.float32))


def _attn_bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             dlse: Optional[Tensor], attn_mask: Optional[Tensor],
             alibi_slopes: Optional[Tensor], softmax_scale: float, diag_offset: int,
             window_left: int, window_right: int, softcap: float, allow_tf32: bool,
             deterministic: bool = False, dropout_p: float = 0.0,
             philox: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _attn_backward(dout, q, k, v, out, lse, dlse, attn_mask, alibi_slopes,
                          softmax_scale, diag_offset, window_left, window_right, softcap,
                          allow_tf32, deterministic, dropout_p, philox, False)


def _attn_backward(dout, q, k, v, out, lse, dlse, attn_mask, alibi_slopes, softmax_scale,
                   diag_offset, window_left, window_right, softcap, allow_tf32,
                   deterministic, dropout_p, philox, one_allocation):
    """(dq, dk, dv) of either backend. one_allocation: the portable Triton backward's
    gradients may share one allocation (``ops.bwd.attn_bwd``), which only the eager
    autograd path allows: the op's outputs must not alias each other."""
    if select_backend(q.device, q.dtype) == "triton":
        # FLASHTILE_HOPPER_BWD (default auto: _hopper_bwd_wins): the Gluon backward
        # where it supports the call; its dQ atomics are not reproducible, so
        # deterministic calls keep the portable one.
        mode = hopper_bwd_mode()
        if (mode == "1" or mode == "auto" and _hopper_bwd_wins(q, k)) \
                and not _deterministic(deterministic):
            from flashtile.ops import bwd_hopper

            reason = bwd_hopper.unsupported(q, k, v, out, dout, dropout_p=dropout_p,
                                            **_mask_kwargs(attn_mask, alibi_slopes,
                                                           softmax_scale, diag_offset,
                                                           window_left, window_right,
                                                           softcap))
            if reason is None:
                return bwd_hopper.backward(dout, q, k, v, out, lse, dlse, softmax_scale,
                                           diag_offset, causal=window_right == 0)
        # Keywords spelled out, not **_mask_kwargs: no dict built on the eager path.
        return triton_bwd(dout, q, k, v, out, lse, dlse, attn_mask=attn_mask,
                          alibi_slopes=alibi_slopes, softmax_scale=softmax_scale,
                          diag_offset=diag_offset, window_left=window_left,
                          window_right=window_right, softcap=softcap,
                          allow_tf32=allow_tf32, fused=fused_backward(deterministic),
                          dropout_p=dropout_p, philox=philox,
                          one_allocation=one_allocation)
    grads = _torch_backend.attention_bwd(
        dout, q, k, v, out, lse, dlse, dropout=_dense_dropout(q, dropout_p, philox),
        **_mask_kwargs(attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
                       window_right, softcap))
    return tuple(g.contiguous() for g in grads)


attn_bwd = torch.library.custom_op("flashtile::attn_bwd", mutates_args=())(_attn_bwd_impl)


@attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, attn_mask, alibi_slopes, softmax_scale, diag_offset,
      window_left, window_right, softcap, allow_tf32, deterministic=False, dropout_p=0.0,
      philox=None):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


_SCALARS = ("softmax_scale", "diag_offset", "window_left", "window_right", "softcap",
            "allow_tf32", "deterministic", "dropout_p")
# None for attn_mask, alibi_slopes, each scalar and philox (a call that left the
# trailing defaults out has fewer inputs: autograd drops trailing Nones).
_NO_GRADS = (None,) * (3 + len(_SCALARS))


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, alibi_slopes = inputs[:5]
    out, lse = output
    # The last input, philox (dropout's seed tensor), if given: an eager call may leave
    # the trailing defaults out.
    philox = inputs[5 + len(_SCALARS)] if len(inputs) > 5 + len(_SCALARS) else None
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, alibi_slopes, philox)
    # _SCALARS' values in order, positional for the backward; deterministic and
    # dropout_p default to False and 0.0 where the call left them out.
    ctx.scalars = (*inputs[5:5 + len(_SCALARS)], False, 0.0)[:len(_SCALARS)]


def _kernel_ready(dout, out):
    """The incoming gradient as the kernels read it: last dim contiguous, and within
    32-bit offsets (a view into a larger gradient may reach further than ``out``)."""
    if dout is None:
        return out.new_zeros(out.shape)
    if dout.is_contiguous():  # the usual case: reach = out's element count, checked
        return dout
    if dout.stride(-1) != 1 or offset_reach(dout) > MAX_OFFSET:
        return dout.contiguous()
    return dout


def _backward(ctx, dout, dlse):
    """The op's backward: ``flashtile::attn_bwd``."""
    q, k, v, out, lse, attn_mask, alibi_slopes, philox = ctx.saved_tensors
    return attn_bwd(_kernel_ready(dout, out), q, k, v, out, lse, dlse, attn_mask,
                    alibi_slopes, *ctx.scalars, philox) + _NO_GRADS


def _eager_backward(ctx, dout, dlse):
    """The eager autograd.Function's backward: the implementation itself, its
    gradients in one allocation where ``_one_allocation`` allows."""
    q, k, v, out, lse, attn_mask, alibi_slopes, philox = ctx.saved_tensors
    return _attn_backward(_kernel_ready(dout, out), q, k, v, out, lse, dlse, attn_mask,
                          alibi_slopes, *ctx.scalars, philox,
                          _one_allocation(ctx, q, k, v)) + _NO_GRADS


def _one_allocation(ctx, q, k, v):
    """Whether an eager backward may return dq, dk and dv as views of one allocation:
    only where none would keep the others' memory alive by itself, i.e. all three are
    asked for (a gradient autograd drops is freed at once) and q, k and v are all
    leaves (whose .grad keep all three) or none is (each flows on through the graph)."""
    need = ctx.needs_input_grad
    return need[0] and need[1] and need[2] and q.is_leaf == k.is_leaf == v.is_leaf


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _eager_function(name, forward_impl, setup_context, backward):
    """An autograd.Function over the custom op's own implementation, setup_context and
    backward, for plain eager calls: it skips the dispatcher's round trip through the
    op, which cost more host time on the H200 than the kernel launches (NOTES.md
    section 7). The ctx form, because Function.apply binds a setup_context form's
    arguments through inspect.signature on every call (~40 us). Once differentiable,
    like the op: the kernels' gradients carry no graph, so a double backward must fail
    loudly rather than drop the second-order term."""
    def forward(ctx, *inputs):
        # An output the loss does not use (usually lse) gets a None gradient instead of
        # a materialized zero tensor: a fill launch less, and the kernels skip its term.
        ctx.set_materialize_grads(False)
        output = forward_impl(*inputs)
        setup_context(ctx, inputs, output)
        return output

    guarded = once_differentiable(backward)

    def backward_once(ctx, *grads):
        # A plain backward runs with grad mode off: nothing to guard, and
        # once_differentiable's no_grad block would cost ~1.5 us a call.
        if torch.is_grad_enabled():
            return guarded(ctx, *grads)
        return backward(ctx, *grads)

    function = type(name, (torch.autograd.Function,),
                    {"forward": staticmethod(forward),
                     "backward": staticmethod(backward_once)})
    # Function.apply's C part, called by _call: the Python wrapper around it (~2 us a
    # call) binds a setup_context form's defaults (this is the ctx form), checks for
    # functorch transforms (_plain_eager did) and unwraps dead functorch wrappers (as on
    # the no-grad path, which calls the implementation directly, they are not).
    function.apply_eager = super(torch.autograd.Function, function).apply
    return function


def _plain_eager(args) -> bool:
    """Plain tensors on a real device, no compile, tracing, dispatch mode or torch.func
    transform: everything else (meta and fake tensors, make_fx, vmap, subclasses) goes
    through the op, whose fake implementation and dispatcher handle it."""
    if (_is_compiling() or _functorch_active() or _dispatch_modes() > 0):
        return False
    q, k, v = args[:3]
    return (type(q) in _PLAIN and type(k) in _PLAIN and type(v) in _PLAIN
            and not q.is_meta)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack


def _call(op, function, args):
    """The op (compile, tracing, fake tensors, transforms), else the eager
    autograd.Function when a gradient may be asked for; None for a plain eager call
    that needs no gradient, which the caller runs itself: it does not pay autograd's
    bookkeeping, and may drop lse."""
    if not _plain_eager(args):
        return op(*args)
    if torch.is_grad_enabled() and (args[0].requires_grad or args[1].requires_grad
                                    or args[2].requires_grad):
        return function.apply_eager(*args)
    return None


_EAGER_ATTENTION = _eager_function("_EagerAttention", _attn_fwd_impl, _setup_context,
                                   _eager_backward)


def attention(q, k, v, attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
              window_right, softcap, allow_tf32, deterministic=False, dropout_p=0.0,
              philox=None, return_lse=True, layout=None):
    """(out, lse) with autograd: ``flashtile::attn_fwd`` (one opaque node under
    torch.compile), or in plain eager mode the same functions without the dispatcher.
    return_lse=False: the caller drops lse, which may then be None (a plain eager call
    that needs no gradient). layout: None, or the id ``_validate.once_per_layout`` gave
    the layouts of q, k and v (``ops.fwd.attn_fwd``'s), for a dense call."""
    args = (q, k, v, attn_mask, alibi_slopes, softmax_scale, diag_offset, window_left,
            window_right, softcap, allow_tf32, deterministic, dropout_p, philox)
    result = _call(attn_fwd, _EAGER_ATTENTION, args)
    if result is not None:
        return result
    if return_lse:
        return _attn_fwd_impl(*args)
    # lse dropped (then possibly None).
    return _forward(q, k, v, attn_mask, alibi_slopes, softmax_scale, diag_offset,
                    window_left, window_right, softcap, allow_tf32, dropout_p, philox,
                    return_lse=False, layout=layout)


# Varlen: packed sequences, q (total_q, h, d), k/v (total_k, hkv, d), lse (h, total_q).
# diag_offset is 0: each sequence's causal/window mask is aligned at its bottom-right.
# With a block_table, k/v are a paged pool (num_blocks, page_size, hkv, d) and the key
# lengths come from seqused_k, or else from cu_seqlens_k; forward only.

def _sequence_keys(x, b, start, stop, block_table):
    """Keys [start, stop) of sequence b as (1, stop - start, hkv, d): rows of the packed
    k/v, or positions in the sequence's pages."""
    if block_table is None:
        return x[None, start:stop]
    return reference.gather_pages(x, block_table[b], start, stop)[None]


def _varlen_attn_fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                    cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                    alibi_slopes: Optional[Tensor], softmax_scale: float, window_left: int,
                    window_right: int, softcap: float, allow_tf32: bool,
                    block_table: Optional[Tensor] = None,
                    seqused_k: Optional[Tensor] = None,
                    deterministic: bool = False, dropout_p: float = 0.0,
                    philox: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           alibi_slopes, softmax_scale, window_left, window_right, softcap,
                           allow_tf32, block_table, seqused_k, dropout_p, philox)


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    alibi_slopes, softmax_scale, window_left, window_right, softcap,
                    allow_tf32, block_table, seqused_k, dropout_p, philox, return_lse=True,
                    layout=None):
    """(out, lse) of either backend; return_lse=False may return None for lse, as
    ``_forward``. layout: as in ``varlen_attention``."""
    backend = select_backend(q.device, q.dtype)
    if (backend == "torch" or index_checks_enabled()) and can_read_indices(q):
        # Here, not in the caller: the op's own run time is the one place a compiled
        # graph can still read them (skipped while a CUDA graph is captured). Without
        # the check the kernels make bad indices NaN rows.
        if block_table is not None:
            check_paged_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      block_table, seqused_k)
        else:
            check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k)
    if backend == "triton":
        return triton_fwd(q, k, v, attn_mask=None, alibi_slopes=alibi_slopes,
                          softmax_scale=softmax_scale, diag_offset=0,
                          window_left=window_left, window_right=window_right,
                          softcap=softcap, allow_tf32=allow_tf32, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, block_table=block_table,
                          seqused_k=seqused_k, dropout_p=dropout_p, philox=philox,
                          return_lse=return_lse, layout=layout)
    kw = _mask_kwargs(None, alibi_slopes, softmax_scale, 0, window_left, window_right,
                      softcap)
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))  # contiguous, as the fake says
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    for b, (qs, qe, ks, ke) in enumerate(_bounds(cu_seqlens_q, cu_seqlens_k, block_table,
                                                 seqused_k)):
        if qe == qs:
            continue
        kw_b = dict(kw, diag_offset=(ke - ks) - (qe - qs),
                    alibi_slopes=reference.alibi_of_sequence(alibi_slopes, b),
                    dropout=_varlen_dropout(q, dropout_p, philox, qs))
        o, l = _torch_backend.attention_fwd(q[None, qs:qe],
                                            _sequence_keys(k, b, ks, ke, block_table),
                                            _sequence_keys(v, b, ks, ke, block_table),
                                            **kw_b)
        out[qs:qe], lse[:, qs:qe] = o[0], l[0]
    return out, lse


def _varlen_dropout(q, dropout_p, philox, q_start):
    """The dropout mask of the packed sequence whose queries start at row q_start (or
    None)."""
    if philox is None:
        return None
    return reference.Dropout.varlen(philox, dropout_p, q.shape[1], q.shape[0], q_start)


varlen_attn_fwd = torch.library.custom_op("flashtile::varlen_attn_fwd",
                                          mutates_args=())(_varlen_attn_fwd_impl)


@varlen_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
      softmax_scale, window_left, window_right, softcap, allow_tf32, block_table=None,
      seqused_k=None, deterministic=False, dropout_p=0.0, philox=None):
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _varlen_attn_bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                    max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor],
                    softmax_scale: float, window_left: int, window_right: int,
                    softcap: float, allow_tf32: bool,
                    deterministic: bool = False, dropout_p: float = 0.0,
                    philox: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _varlen_attn_backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, alibi_slopes, softmax_scale,
                                 window_left, window_right, softcap, allow_tf32,
                                 deterministic, dropout_p, philox, False)


def _varlen_attn_backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, alibi_slopes, softmax_scale,
                          window_left, window_right, softcap, allow_tf32, deterministic,
                          dropout_p, philox, one_allocation):
    """(dq, dk, dv) of either backend; one_allocation as in ``_attn_backward``."""
    kw = _mask_kwargs(None, alibi_slopes, softmax_scale, 0, window_left, window_right,
                      softcap)
    if select_backend(q.device, q.dtype) == "triton":
        return triton_bwd(dout, q, k, v, out, lse, dlse, allow_tf32=allow_tf32,
                          cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                          fused=fused_backward(deterministic), dropout_p=dropout_p,
                          philox=philox, one_allocation=one_allocation, **kw)
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    for b, (qs, qe, ks, ke) in enumerate(_bounds(cu_seqlens_q, cu_seqlens_k)):
        if qe == qs or ke == ks:
            continue
        kw_b = dict(kw, diag_offset=(ke - ks) - (qe - qs),
                    alibi_slopes=reference.alibi_of_sequence(alibi_slopes, b),
                    dropout=_varlen_dropout(q, dropout_p, philox, qs))
        g = _torch_backend.attention_bwd(
            dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
            out[None, qs:qe], lse[None, :, qs:qe],
            dlse[None, :, qs:qe] if dlse is not None else None, **kw_b)
        dq[qs:qe], dk[ks:ke], dv[ks:ke] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


varlen_attn_bwd = torch.library.custom_op("flashtile::varlen_attn_bwd",
                                          mutates_args=())(_varlen_attn_bwd_impl)


@varlen_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, alibi_slopes, softmax_scale, window_left, window_right, softcap,
      allow_tf32, deterministic=False, dropout_p=0.0, philox=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _bounds(cu_seqlens_q, cu_seqlens_k, block_table=None, seqused_k=None):
    """(q_start, q_end, k_start, k_end) of each sequence: rows of the packed q, and rows
    of the packed k/v or, with a block table, key positions in the sequence's pages."""
    cq = cu_seqlens_q.tolist()
    if seqused_k is not None:
        lengths = seqused_k.tolist()
    else:
        ck = cu_seqlens_k.tolist()
        if block_table is None:
            return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]
        lengths = [b - a for a, b in zip(ck, ck[1:])]
    return [(cq[i], cq[i + 1], 0, n) for i, n in enumerate(lengths)]


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes = inputs[:8]
    out, lse = output
    # Inputs past the scalars: block_table, seqused_k, deterministic, dropout_p and
    # philox (the op always has them, an eager call may leave them out).
    philox = inputs[17] if len(inputs) > 17 else None
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes, philox)
    ctx.scalars = (max_q, max_k, *inputs[8:13])
    ctx.paged = any(x is not None for x in inputs[13:15])
    ctx.deterministic = len(inputs) > 15 and bool(inputs[15])
    ctx.dropout_p = inputs[16] if len(inputs) > 16 else 0.0
    ctx.num_inputs = len(inputs)


def _varlen_backward(ctx, dout, dlse, eager=False):
    """The op's backward (``flashtile::varlen_attn_bwd``), or with eager=True the eager
    autograd.Function's (the implementation, as ``_eager_backward``)."""
    if ctx.paged:
        # flash_attn_varlen_func refuses grad with a block_table before the forward; a
        # direct call of the op reaches this instead.
        raise NotImplementedError("varlen attention over a paged KV cache (block_table) "
                                  "is forward only")
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, philox = ctx.saved_tensors
    max_q, max_k, *rest = ctx.scalars
    args = (_kernel_ready(dout, out), q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k,
            alibi_slopes, *rest, ctx.deterministic, ctx.dropout_p, philox)
    if eager:
        grads = _varlen_attn_backward(*args, _one_allocation(ctx, q, k, v))
    else:
        grads = varlen_attn_bwd(*args)
    return (*grads, *(None,) * (ctx.num_inputs - 3))


varlen_attn_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)

_EAGER_VARLEN_ATTENTION = _eager_function(
    "_EagerVarlenAttention", _varlen_attn_fwd_impl, _varlen_setup_context,
    lambda ctx, dout, dlse: _varlen_backward(ctx, dout, dlse, eager=True))


def varlen_attention(*args, return_lse=True, layout=None):
    """varlen (out, lse) with autograd; arguments as ``flashtile::varlen_attn_fwd``.
    return_lse=False: the caller drops lse, which may then be None (as ``attention``).
    layout: None, or the id ``_validate.once_per_layout`` gave the layouts of q, k, v
    and the index tensors (``ops.fwd.attn_fwd``'s)."""
    result = _call(varlen_attn_fwd, _EAGER_VARLEN_ATTENTION, args)
    if result is not None:
        return result
    if return_lse:
        return _varlen_attn_fwd_impl(*args)
    # deterministic (args[15]) only matters to a backward.
    return _varlen_forward(*args[:15], *args[16:], return_lse=False, layout=layout)
