"""flash_attn_with_kvcache: attention of new query tokens over a KV cache.

Contiguous or paged cache, append of the new k/v in place (with rotary embedding),
split-KV for small batches, a value head dim of its own (MLA, absorbed MLA's 576/512
over shared rows). The Triton path is ``flashtile.ops.decode``; the PyTorch path
gathers each sequence's keys and runs the tiled reference (CPU backend and test oracle).
Inference only: no autograd.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from flashtile import _validate as V
from flashtile import _torch_backend, reference
from flashtile import fp8 as F8
from flashtile._backend import select_backend
from flashtile.custom_ops import _plain_eager
from flashtile.ops.decode import append_kv, attn_decode


def _check_cache(q, k_cache, v_cache, k, v, block_table, cache_seqlens, cache_batch_idx,
                 cache_leftpad):
    """Validate shapes, dtypes and devices (no device read). Returns the number of new
    tokens to append."""
    V.check_tensor(q, "q", 4, dtypes=V.WITH_FP8)
    b, sq, h, d = q.shape
    dtype, device = q.dtype, q.device
    for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        # A paged pool's rows are addressed as int64 page * stride plus a small in-page
        # offset, so the pool may pass 2**31 elements; a contiguous cache's row offset
        # (position * stride) is 32-bit, so it may not.
        V.check_tensor(x, name, 4, offsets32=block_table is None, dtypes=V.WITH_FP8)
        # An FP8 cache serves FP8 queries of its format, or 16-bit ones.
        if x.dtype != dtype and not (F8.is_fp8(k_cache.dtype) and x.dtype == k_cache.dtype
                                     and dtype in (torch.float16, torch.bfloat16)):
            V._fail(TypeError, f"{name}.dtype", f"q's dtype {dtype}, or with float16 or "
                    "bfloat16 q a float8 cache (k_cache and v_cache in one format)",
                    x.dtype)
        if x.device != device:
            V._fail(ValueError, f"{name}.device", f"q's device {device}", x.device)
    cache_shape = k_cache.shape
    # v_cache's head dim may differ from k_cache's (MLA); every other dim is shared.
    if cache_shape[:-1] != v_cache.shape[:-1]:
        V._fail(ValueError, "v_cache.shape[:-1]", f"k_cache's {tuple(cache_shape[:-1])}",
                tuple(v_cache.shape[:-1]), "k_cache and v_cache differ only in head_dim")
    hkv, dv = cache_shape[2], v_cache.shape[3]
    V.check_grid(b * hkv, device)
    if cache_shape[3] != d:
        V._fail(ValueError, "k_cache.shape[-1] (head_dim)", f"q's head_dim {d}",
              cache_shape[3])
    V.check_kvcache_head_dims(d, dv)
    if hkv == 0 or h % hkv:
        V._fail(ValueError, "k_cache.shape[2] (nheads_kv)", f"a divisor of q's nheads {h}",
              hkv)
    if (k is None) != (v is None):
        V._fail(ValueError, "k/v", "both given or both None", (k is None, v is None))
    sn = 0
    if k is not None:
        for x, name, cache in ((k, "k", k_cache), (v, "v", v_cache)):
            V.check_tensor(x, name, 4, dtypes=V.WITH_FP8)
            if x.dtype != q.dtype or x.device != q.device:
                V._fail(TypeError, f"{name}.dtype/device", f"q's {q.dtype} on {q.device}",
                      f"{x.dtype} on {x.device}")
            if x.shape[0] != b or x.shape[2:] != cache.shape[2:]:
                V._fail(ValueError, f"{name}.shape",
                        f"({b}, seqlen_new, {hkv}, {cache.shape[3]})", tuple(x.shape))
        if k.shape[:-1] != v.shape[:-1]:
            V._fail(ValueError, "v.shape[:-1]", f"k's {tuple(k.shape[:-1])}",
                    tuple(v.shape[:-1]))
        sn = k.shape[1]

    if block_table is not None:
        V.check_page_size(cache_shape[1], "k_cache.shape[1] (page_size)")
        if cache_shape[0] == 0 and b:
            # The kernels read block 0 in place of a bad block-table entry.
            V._fail(ValueError, "k_cache.shape[0] (num_blocks)", "at least 1 block", 0)
        if cache_batch_idx is not None:
            V._fail(ValueError, "cache_batch_idx", "None with a paged cache (block_table)",
                  "a tensor", "Each sequence's pages are already named by block_table")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            V._fail(ValueError, "block_table", "an int32 tensor (batch, max_blocks_per_seq)",
                  getattr(block_table, "shape", type(block_table).__name__))
        V.check_index_tensor(block_table, "block_table", (b, block_table.shape[1]),
                             device)
        cache_rows = b
    else:
        cache_rows = cache_shape[0]
    if cache_batch_idx is not None:
        V.check_index_tensor(cache_batch_idx, "cache_batch_idx", (b,), device)
    elif block_table is None and cache_rows < b:
        V._fail(ValueError, "k_cache.shape[0]", f">= q's batch {b}", cache_rows)
    if cache_leftpad is not None:
        V.check_index_tensor(cache_leftpad, "cache_leftpad", (b,), device)
    V.check_index_tensor(cache_seqlens, "cache_seqlens", (b,), device)
    return sn


def _check_append_target(k_cache, v_cache):
    """New k and v need caches that share no element: which of them would land in the
    shared columns is not defined (two writes of one address). Eager only (Dynamo
    cannot trace a storage's address); per call, as it reads addresses."""
    if not torch.compiler.is_compiling() and V.views_overlap(k_cache, v_cache):
        # MLA writes its latent rows into the cache itself.
        V._fail(ValueError, "k/v", "None when v_cache and k_cache share elements "
                "(v_cache a view of k_cache's rows, as in absorbed MLA)", "new k and v",
                "Write the new rows into the shared cache first, then call with "
                "cache_seqlens counting them")


# Its checks read the arguments' layouts only: once per combination of them.
_check_cache_once = V.once_per_layout(_check_cache)


def apply_rotary(x, cos, sin, positions, interleaved):
    """Rotate the first rotary_dim dims of x (b, s, h, d) at integer positions (b, s).

    cos/sin (seqlen_ro, rotary_dim / 2). interleaved=True rotates pairs (0, 1), (2, 3)...
    (GPT-J); False rotates the two halves (GPT-NeoX). Computed in fp32. A position
    outside the table (read on no host) rotates its token to NaN: a table too short for
    the cache is then visible, never a read past it.
    """
    inside = ((positions >= 0) & (positions < cos.shape[0]))[:, :, None]
    at = positions.clamp(0, max(cos.shape[0] - 1, 0))
    nan = torch.tensor(float("nan"), device=x.device)
    return rotate(x, torch.where(inside, cos[at].float(), nan),
                  torch.where(inside, sin[at].float(), nan), interleaved)


def rotate(x, cos, sin, interleaved):
    """apply_rotary with the angles already per token: cos/sin (b, s, rotary_dim / 2)."""
    rd = cos.shape[-1] * 2
    c = cos.float()[:, :, None, :]                                     # (b, s, 1, rd/2)
    s = sin.float()[:, :, None, :]
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _cache_positions(cache_seqlens, n):
    """Cache slots of n tokens after each sequence's current end: (b, n)."""
    return cache_seqlens.long()[:, None] + torch.arange(n, device=cache_seqlens.device)


def _append(k_cache, v_cache, k, v, pos, block_table, cache_batch_idx):
    """Write k/v (b, n, hkv, d) at cache positions pos (b, n), in place, by tensor
    indexing: the PyTorch path and torch.compile graphs (whose indexing checks its
    bounds). Eager Triton calls use ``ops.decode.append_kv`` instead. FP8 k/v (already
    in the cache's format) move as bytes: index_put has no FP8 kernel in every torch."""
    if F8.is_fp8(k_cache.dtype):
        k_cache, v_cache, k, v = (x.view(torch.uint8) for x in (k_cache, v_cache, k, v))
    if block_table is not None:
        page_size = k_cache.shape[1]
        pages = torch.gather(block_table.long(), 1, pos // page_size)
        k_cache[pages, pos % page_size] = k
        v_cache[pages, pos % page_size] = v
    else:
        rows = (cache_batch_idx.long() if cache_batch_idx is not None
                else torch.arange(k.shape[0], device=k.device))[:, None].expand_as(pos)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v


def _gather_sequence(cache, b, start, stop, block_table, cache_batch_idx):
    """Keys [start, stop) of sequence b as a contiguous (1, stop - start, hkv, d) tensor
    (an FP8 cache's gathered as bytes, as _append writes them)."""
    if F8.is_fp8(cache.dtype):
        return _gather_sequence(cache.view(torch.uint8), b, start, stop, block_table,
                                cache_batch_idx).view(cache.dtype)
    if block_table is not None:
        return reference.gather_pages(cache, block_table[b], start, stop)[None]
    row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
    return cache[row, start:stop][None]


def _backend(q, k_cache):
    """select_backend for q, and for an FP8 cache under 16-bit q too: FP8 is refused
    where the Triton interpreter rounds to it wrongly (the append would be wrong)."""
    backend = select_backend(q.device, q.dtype)
    if backend == "triton" and F8.is_fp8(k_cache.dtype) and not F8.is_fp8(q.dtype):
        select_backend(q.device, k_cache.dtype, "k_cache")
    return backend


def _attend_torch(q, k_cache, v_cache, seqlens, leftpad, block_table, cache_batch_idx,
                  descales, out_dtype, **kw):
    """The PyTorch path, a sequence at a time; FP8 tensors are dequantised to fp32 with
    the sequence's descales (q too then, to share their dtype)."""
    # Seeded with an empty batch's (out, lse): torch.cat refuses an empty list.
    outs = [q.new_empty((0, *q.shape[1:3], v_cache.shape[-1]), dtype=out_dtype)]
    lses = [q.new_empty((0, q.shape[2], q.shape[1]), dtype=torch.float32)]
    fp8 = F8.is_fp8(q.dtype) or F8.is_fp8(k_cache.dtype)
    for b in range(q.shape[0]):
        start = int(leftpad[b]) if leftpad is not None else 0
        stop = int(seqlens[b])
        qkv = [q[b:b + 1], *(_gather_sequence(x, b, start, stop, block_table,
                                              cache_batch_idx) for x in (k_cache, v_cache))]
        if fp8:
            qkv = [F8.dequantize(x, None if d is None else d[b:b + 1])
                   for x, d in zip(qkv, descales)]
        kw_b = dict(kw, diag_offset=(stop - start) - q.shape[1],
                    alibi_slopes=reference.alibi_of_sequence(kw["alibi_slopes"], b))
        o, l = _torch_backend.attention_fwd(*qkv, attn_mask=None, **kw_b)
        outs.append(o.to(out_dtype))
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _kvcache_attn_impl(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                       new_tokens: int, block_table: Optional[Tensor],
                       cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                       alibi_slopes: Optional[Tensor], softmax_scale: float,
                       window_left: int, window_right: int, softcap: float,
                       num_splits: int, check_indices: bool,
                       q_descale: Optional[Tensor] = None,
                       k_descale: Optional[Tensor] = None,
                       v_descale: Optional[Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of q over the cache's first cache_seqlens + new_tokens keys (the new
    ones already written). check_indices: False when the caller has checked the
    indices already (an eager call, before its append); else they are checked here, at
    run time, if index checks are on or on the PyTorch path, unless a CUDA graph is
    being captured. FP8: descales (b, hkv) or None, out in out_dtype (None: q's)."""
    backend = _backend(q, k_cache)
    if check_indices and (backend == "torch" or V.index_checks_enabled()) \
            and V.can_read_indices(q):
        V.check_index_values(k_cache, block_table, cache_seqlens, cache_batch_idx,
                             cache_leftpad, new_tokens)
    kw = dict(alibi_slopes=alibi_slopes, softmax_scale=softmax_scale,
              window_left=window_left, window_right=window_right, softcap=softcap)
    if backend == "triton":
        return attn_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                           new_tokens=new_tokens, block_table=block_table,
                           cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                           num_splits=num_splits, allow_tf32=False, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
                           **kw)
    seqlens = cache_seqlens + new_tokens if new_tokens else cache_seqlens
    return _attend_torch(q, k_cache, v_cache, seqlens, cache_leftpad, block_table,
                         cache_batch_idx, (q_descale, k_descale, v_descale),
                         out_dtype or q.dtype, **kw)


# One opaque node for torch.compile (a fullgraph decode step, CUDA graphs through
# mode="reduce-overhead"). It reads the caches, never writes them: the append before it
# is plain tensor indexing, which the compiler sees and keeps in place.
kvcache_attn = torch.library.custom_op("flashtile::kvcache_attn",
                                       mutates_args=())(_kvcache_attn_impl)


@kvcache_attn.register_fake
def _(q, k_cache, v_cache, cache_seqlens, new_tokens, block_table, cache_batch_idx,
      cache_leftpad, alibi_slopes, softmax_scale, window_left, window_right, softcap,
      num_splits, check_indices, q_descale=None, k_descale=None, v_descale=None,
      out_dtype=None):
    b, sq, h, _ = q.shape
    return (q.new_empty((b, sq, h, v_cache.shape[-1]), dtype=out_dtype or q.dtype),
            q.new_empty((b, h, sq), dtype=torch.float32))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, return_lse=False, q_descale=None,
                            k_descale=None, v_descale=None, out_dtype=None):
    """Attention of q over a KV cache, after appending the new k/v to it in place.

    Arguments (flash-attn's meaning):
        q: (batch, seqlen_q, nheads, head_dim); seqlen_q >= 1 (decode, speculative
            verification, chunked prefill).
        k_cache, v_cache: contiguous (batch_cache, seqlen_cache, nheads_kv, head_dim), or
            paged (num_blocks, page_size, nheads_kv, head_dim) when block_table is given;
            page_size a power of two from 16 to 256. head_dim is 1 to 512, or 576.
            v_cache's last dim, head_dim_v (1 to 512), may differ from k_cache's (MLA);
            out then takes it. Absorbed MLA decode (FlashMLA's): q and k_cache of 576 =
            512 latent + 64 rope dims over one KV head, v_cache = k_cache[..., :512], a
            view of the same rows; those rows are read once (V from K's tiles).
        k, v: optional new keys (batch, seqlen_new, nheads_kv, head_dim) and values
            (..., head_dim_v), written into the cache at positions cache_seqlens[b] ...
            (in place) before attending. Refused (ValueError) when v_cache shares
            elements with k_cache (a view of its rows: which of k and v lands in the
            shared columns would be undefined); write such rows into the cache first
            and count them in cache_seqlens. (Checked in eager calls; Dynamo cannot
            read a storage's address, so under torch.compile it is the caller's.)
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2); if given, q and the
            new k are rotated at their absolute cache positions, as flash-attn does: the
            new k at cache_seqlens[b] + i; q at those positions if causal or windowed,
            else all at cache_seqlens[b]. cache_leftpad does not shift them (the keys
            already in the cache were rotated at their cache positions too).
            rotary_interleaved (bool) selects GPT-J pairs (True) or halves (False).
        cache_seqlens: int or int32 (batch,): keys already in the cache for each
            sequence (before the append).
        cache_batch_idx: int32 (batch,): cache row of each sequence (contiguous only).
        cache_leftpad: int32 (batch,): the sequence's keys start at this cache position.
        block_table: int32 (batch, max_blocks_per_seq): pool block of each page.
        causal / window_size / softcap / alibi_slopes / softmax_scale: as flash_attn_func,
            aligned bottom-right at the sequence's last key.
        num_splits: split-KV factor; 0 picks it from the SM count, 1 disables splitting.
        return_softmax_lse: bool (flash-attn's name): also return lse (batch, nheads,
            seqlen_q) float32, natural log, -inf for a row that sees no key. out is
            (batch, seqlen_q, nheads, head_dim_v).
        return_lse: bool, keyword only: flashtile's name for return_softmax_lse.
        FP8 (keyword only, flash-attn 3's names): k_cache and v_cache may be
            float8_e4m3fn or float8_e5m2 (one format), with float16 or bfloat16 q (the
            serving case: half the cache memory and decode bytes) or q in the caches'
            format. k_descale, v_descale: fp32 (batch, nheads_kv), the real cache rows of
            sequence b being k_descale[b, h] * k_cache[..., h, :] (contiguous or paged);
            q_descale likewise for FP8 q; None is 1.0, a 0-d tensor one scale for all
            (any shape that broadcasts). The new k, v (q's dtype) are written into an
            FP8 cache quantised as flashtile.fp8.quantize(k, k_descale) does: k /
            k_descale rounded to nearest even, saturated at the format's largest value
            (448 for e4m3). out_dtype: the output of FP8 q, bfloat16 by default (else
            q's dtype). Rotary embedding takes 16-bit q (rotate before quantising).

    Index values (cache_seqlens, block_table, cache_batch_idx, cache_leftpad) are not
    read on the host (no device sync): the kernels read them, and a bad one is harmless
    and visible. A sequence whose keys after the append would not fit its cache row (or
    its block-table row), whose cache_leftpad is outside [0, its key count] or whose
    cache_batch_idx is outside the cache appends nothing and its rows of out and lse are
    NaN; a block-table entry outside the pool is never followed, and every row that
    would see a key behind it is NaN (with pages smaller than the key tile, every row
    of the sequence that reads that tile); rotary positions past the rotary table rotate
    their tokens to NaN. With ``flashtile.set_index_checks(True)`` (or
    FLASHTILE_CHECK_INDICES=1) every index, and the rotary table's length, is checked
    first with one host sync and a bad one raises ValueError before anything is written;
    the PyTorch path (CPU tensors without TRITON_INTERPRET) always checks. Under
    torch.compile the attention is one custom op (``flashtile::kvcache_attn``, no graph
    break) and the check runs inside it at run time, after the append (an append past
    the cache meets the compiled indexing's own bounds check first). While a CUDA graph
    is being captured the check is skipped (no sync is possible there).

    Not differentiable (inference only): the outputs never require grad.
    """
    if cache_seqlens is None:
        V._fail(ValueError, "cache_seqlens", "an int or an int32 tensor (batch,)", None)
    if type(cache_seqlens) is not Tensor and isinstance(cache_seqlens, numbers.Integral) \
            and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32,
                                   device=q.device)
    sn, layout = _check_cache_once.with_id(q, k_cache, v_cache, k, v, block_table,
                                           cache_seqlens, cache_batch_idx, cache_leftpad)
    if k is not None:
        _check_append_target(k_cache, v_cache)
    b, sq, h, d = q.shape
    descales, out_dtype = _check_fp8(q, k_cache, v_cache, (q_descale, k_descale, v_descale),
                                     out_dtype, rotary_cos)
    left, right = V.check_flash_options(0.0, softmax_scale, softcap, window_size, causal)
    V.check_bools(rotary_interleaved=rotary_interleaved,
                  return_softmax_lse=return_softmax_lse, return_lse=return_lse)
    want_lse = return_softmax_lse or return_lse
    if not (type(num_splits) is int and num_splits >= 0) and (
            isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
            or num_splits < 0):
        V._fail(ValueError, "num_splits", "an int >= 0 (0 = heuristic)", num_splits)
    alibi_slopes = V.check_alibi(alibi_slopes, b, h, q.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    q_moves = causal or left >= 0 or right >= 0  # rotary: q at its own positions
    if rotary_cos is not None and (
            rotary_sin is None or rotary_cos.shape != rotary_sin.shape
            or rotary_cos.dim() != 2 or rotary_cos.shape[1] * 2 > d):
        V._fail(ValueError, "rotary_cos/rotary_sin", "two (seqlen_ro, rotary_dim / 2) "
                f"tensors with rotary_dim <= {d}",
                (tuple(rotary_cos.shape), getattr(rotary_sin, "shape", None)))
    # Before the append, so a bad value raises with the cache untouched; this also
    # refuses bf16 in the interpreter.
    backend = None if torch.compiler.is_compiling() else _backend(q, k_cache)
    checked = (backend == "torch" or V.index_checks_enabled()) and V.can_read_indices(q)
    if checked:
        V.check_index_values(k_cache, block_table, cache_seqlens, cache_batch_idx,
                             cache_leftpad, sn)
        reach = max(sq if q_moves else 1, sn)  # positions used past cache_seqlens[b]
        if rotary_cos is not None and b and \
                int(cache_seqlens.max()) + reach > rotary_cos.shape[0]:
            V._fail(ValueError, "rotary_cos.shape[0]",
                    f">= {int(cache_seqlens.max()) + reach} positions (max(cache_seqlens) "
                    "plus the new tokens)", rotary_cos.shape[0])
    # The kernels read every index tensor with unit strides.
    cache_seqlens = cache_seqlens.contiguous()
    if block_table is not None:
        block_table = block_table.contiguous()
    if cache_batch_idx is not None:
        cache_batch_idx = cache_batch_idx.contiguous()
    if cache_leftpad is not None:
        cache_leftpad = cache_leftpad.contiguous()
    plain = _plain_eager((q, k_cache, v_cache))
    if plain and backend == "triton" and rotary_cos is None:
        # The eager Triton path, straight to the launchers: the append and the attention
        # are kernels that check their indices; nothing for autograd to record.
        if sn:
            append_kv(k, v, k_cache, v_cache, cache_seqlens=cache_seqlens,
                      block_table=block_table, cache_batch_idx=cache_batch_idx,
                      k_descale=descales[1], v_descale=descales[2], layout=layout)
        out, lse = attn_decode(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, new_tokens=sn,
            block_table=block_table, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes,
            softmax_scale=float(softmax_scale), window_left=left, window_right=right,
            softcap=float(softcap), num_splits=int(num_splits), allow_tf32=False,
            q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
            out_dtype=out_dtype, return_lse=want_lse, layout=layout)
    else:
        with torch.no_grad():
            q, k = _rotate(q, k, rotary_cos, rotary_sin, cache_seqlens, sq, sn, q_moves,
                           rotary_interleaved)
            args = (q, k_cache, v_cache, cache_seqlens, sn, block_table, cache_batch_idx,
                    cache_leftpad, alibi_slopes, float(softmax_scale), left, right,
                    float(softcap), int(num_splits))
            if k is not None and sn:
                if plain and backend == "triton":
                    append_kv(k, v, k_cache, v_cache, cache_seqlens=cache_seqlens,
                              block_table=block_table, cache_batch_idx=cache_batch_idx,
                              k_descale=descales[1], v_descale=descales[2])
                else:
                    if k.dtype != k_cache.dtype:  # 16-bit keys into an FP8 cache
                        k, v = (_quantize_new(x, d, k_cache.dtype)
                                for x, d in ((k, descales[1]), (v, descales[2])))
                    _append(k_cache, v_cache, k, v, _cache_positions(cache_seqlens, sn),
                            block_table, cache_batch_idx)
            if plain:
                out, lse = _kvcache_attn_impl(*args, not checked, *descales, out_dtype)
            else:
                out, lse = kvcache_attn(*args, not checked, *descales, out_dtype)
    return (out, lse) if want_lse else out


def _check_fp8(q, k_cache, v_cache, descales, out_dtype, rotary_cos):
    """The FP8 arguments of flash_attn_with_kvcache: (descales expanded to (batch,
    nheads_kv) or None, the output dtype)."""
    fp8_q, fp8_cache = F8.is_fp8(q.dtype), F8.is_fp8(k_cache.dtype)
    if not (fp8_q or fp8_cache) and out_dtype is None and descales[0] is None \
            and descales[1] is None and descales[2] is None:
        return descales, q.dtype  # nothing FP8: what the checks below return for it
    out_dtype = F8.check_out_dtype(out_dtype, fp8_q, q.dtype)
    scaled = ((fp8_q, "q", q.dtype), (fp8_cache, "k_cache", k_cache.dtype),
              (fp8_cache, "v_cache", v_cache.dtype))
    for x, name, (fp8, tensor, dtype) in zip(descales, F8.DESCALE_NAMES, scaled):
        if x is not None and not fp8:
            V._fail(ValueError, name, f"None with {tensor} in {dtype} (descales scale "
                    "float8 tensors)", "a tensor")
    if fp8_q and rotary_cos is not None:
        V._fail(ValueError, "rotary_cos", f"None with {q.dtype} q (rotary embedding takes "
                "16-bit q: rotate before quantising)", "a tensor")
    descales = [F8.check_descale(x, name, q.shape[0], k_cache.shape[2], q.device)
                for x, name in zip(descales, F8.DESCALE_NAMES)]
    if fp8_q or fp8_cache:
        F8.refuse_grad((q if fp8_q else None, k_cache, v_cache, *descales),
                       ("q", "k_cache", "v_cache", *F8.DESCALE_NAMES),
                       "flash_attn_with_kvcache")
    return descales, out_dtype


def _quantize_new(x, descale, dtype):
    """New keys or values (b, n, hkv, d) in the cache's FP8 format (descale None: 1.0)."""
    if descale is None:
        descale = x.new_ones((), dtype=torch.float32)
    return F8.quantize(x, descale, dtype)[0]


def _rotate(q, k, rotary_cos, rotary_sin, cache_seqlens, sq, sn, q_moves, interleaved):
    """q and the new k rotated at flash-attn's positions: absolute cache positions,
    leftpad or not; the new k at cache_seqlens[b] + i, q there too when it moves
    (causal or windowed), else all at cache_seqlens[b]."""
    if rotary_cos is None:
        return q, k
    base = cache_seqlens.long()[:, None]                                      # (b, 1)
    offs = torch.arange(max(sq, sn), device=q.device)[None, :]
    q_pos = base + (offs[:, :sq] if q_moves else 0 * offs[:, :sq])
    q = apply_rotary(q, rotary_cos, rotary_sin, q_pos, interleaved)
    if k is not None:
        k = apply_rotary(k, rotary_cos, rotary_sin, base + offs[:, :sn], interleaved)
    return q, k
