"""Public attention functions: flash-attn's names and arguments, and an SDPA drop-in.

Every function validates its input (``flashtile._validate``), turns causal/window/layout
into one mask description (``diag_offset``, ``window_left``, ``window_right``) and calls
``custom_ops.attention``: the ``flashtile::attn_fwd`` custom op under torch.compile (no
graph break), the same implementation as an autograd.Function in eager mode.
"""

from __future__ import annotations

import math

import torch

from flashtile import _validate as V
from flashtile import custom_ops


@torch.compiler.assume_constant_result
def _tf32_allowed() -> bool:
    # Read once per compiled graph (a recompile follows a change), like torch's own flags.
    return torch.get_float32_matmul_precision() != "highest"


def _allow_tf32(dtype) -> bool:
    # fp32 is exact (IEEE products) unless the user allowed TF32 the PyTorch way:
    # torch.set_float32_matmul_precision("high") or ("medium").
    return dtype == torch.float32 and _tf32_allowed()


def _attention(q, k, v, *, attn_mask, alibi_slopes, softmax_scale, diag_offset,
               window_left, window_right, softcap):
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    return custom_ops.attention(q, k, v, attn_mask, alibi_slopes, float(softmax_scale),
                               int(diag_offset), window_left, window_right, float(softcap),
                               _allow_tf32(q.dtype))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_lse=False):
    """Exact attention, softmax(q k^T * softmax_scale) v, in flash-attn's layout.

    Arguments:
        q: (batch, seqlen_q, nheads, head_dim), float16, bfloat16 or float32.
        k, v: (batch, seqlen_k, nheads_kv, head_dim), same dtype and device as q.
            nheads must be a multiple of nheads_kv (GQA/MQA); K/V are never copied.
            head_dim is any value from 1 to 256 (padded inside the kernel).
            Any strides work as long as the last dim is contiguous.
        dropout_p: must be 0.0 (dropout is not implemented and raises).
        softmax_scale: scale of q k^T; default 1 / sqrt(head_dim).
        causal: query i sees key j only if j <= i + seqlen_k - seqlen_q, i.e. the mask
            is aligned to the bottom-right corner (flash-attn >= 2.1). With
            seqlen_q=2, seqlen_k=5 (1 = kept)::

                1 1 1 1 0
                1 1 1 1 1

            and with seqlen_q=5, seqlen_k=2 the first three rows see no key at all:
            their output is 0 and their lse is -inf.
        window_size: (left, right); query i sees keys in
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right].
            -1 means unbounded on that side. causal=True sets right to 0.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) (before ALiBi).
        alibi_slopes: (nheads,) or (batch, nheads) float; adds
            -slope * |i + seqlen_k - seqlen_q - j| to the score of (i, j).
        deterministic: accepted for compatibility. The backward is always
            deterministic (no atomics: each program owns the gradient rows it writes),
            so gradients are bitwise identical from run to run with either value.
        return_lse: also return lse.

    Returns:
        out: (batch, seqlen_q, nheads, head_dim), q's dtype.
        lse (if return_lse): (batch, nheads, seqlen_q) float32, the natural-log
            log-sum-exp of each row's final scores (scaled, capped, biased, masked);
            -inf for a row that sees no key. It is differentiable.
    """
    b, sq, sk, h, hkv, d = V.check_qkv(q, k, v)
    left, right = V.check_flash_options(dropout_p, softmax_scale, softcap, window_size,
                                        causal)
    alibi_slopes = V.check_alibi(alibi_slopes, b, h, q.device)
    out, lse = _attention(q, k, v, attn_mask=None, alibi_slopes=alibi_slopes,
                          softmax_scale=softmax_scale, diag_offset=sk - sq,
                          window_left=left, window_right=right, softcap=softcap)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_lse=False, block_table=None, *,
                           seqused_k=None):
    """flash_attn_func over packed sequences of different lengths, with no padding.

    Arguments:
        q: (total_q, nheads, head_dim); k, v: (total_k, nheads_kv, head_dim): the
            sequences of the batch back to back.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 prefix sums of the lengths
            (sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]); lengths may be 0.
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence (sizes the grid).
        The rest as in flash_attn_func; causal and windows are aligned per sequence at
        its own bottom-right corner, alibi_slopes (batch, nheads) is per sequence.
        block_table: optional int32 (batch, max_num_blocks_per_seq). Then k and v are a
            paged KV pool (num_blocks, page_size, nheads_kv, head_dim), page_size a
            power of two from 16 to 256, and key j of sequence b lives at
            k[block_table[b, j // page_size], j % page_size] (flash-attn's and vLLM's
            layout; rows of the table past a sequence's pages may hold anything in
            [0, num_blocks)). Sequence b has cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys;
            max_seqlen_k is at most max_num_blocks_per_seq * page_size. This is the
            prefill of an inference engine whose earlier tokens are already in the pool
            (a prefix-cache hit, a chunk of a long prompt): with n new queries over L
            keys, causal query i sees keys j <= i + L - n, e.g. n=2, L=5::

                1 1 1 1 0
                1 1 1 1 1

            Forward only: q, k and v must not require grad (use torch.no_grad()).
        seqused_k: optional int32 (batch,), with block_table only: the key count of each
            sequence, as vLLM passes it; cu_seqlens_k may then be None (if both are
            given, seqused_k counts).

    Returns out (total_q, nheads, head_dim) and, if return_lse, lse (nheads, total_q)
    float32 (flash-attn's varlen layout), natural log, -inf for rows that see no key.

    With a block_table, cu_seqlens_q, the key lengths and the block indices are read on
    the host when the op runs, also inside a torch.compile graph (as in
    flash_attn_with_kvcache): a bad value raises ValueError instead of reaching the
    kernel. While a CUDA graph is captured no read is possible: the values are then the
    caller's responsibility.
    """
    if block_table is not None:
        batch, h, hkv, d = V.check_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                max_seqlen_q, max_seqlen_k, block_table,
                                                seqused_k)
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            raise NotImplementedError(
                "flash_attn_varlen_func with block_table is forward only (as in "
                "flash-attn): q, k and v require no grad. Call it under torch.no_grad() "
                "or pass detached tensors")
        block_table = block_table.contiguous()  # the kernel reads rows with unit stride
    else:
        if seqused_k is not None:
            V._fail(ValueError, "seqused_k", "None without block_table (packed k/v have "
                    "their lengths in cu_seqlens_k)", "a tensor")
        batch, h, hkv, d = V.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k)
    left, right = V.check_flash_options(dropout_p, softmax_scale, softcap, window_size,
                                        causal)
    alibi_slopes = V.check_alibi(alibi_slopes, batch, h, q.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    cu_seqlens_k, seqused_k = (x.contiguous() if x is not None else None
                               for x in (cu_seqlens_k, seqused_k))
    out, lse = custom_ops.varlen_attention(
        q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k, int(max_seqlen_q),
        int(max_seqlen_k),
        alibi_slopes, float(softmax_scale), left, right, float(softcap),
        _allow_tf32(q.dtype), block_table, seqused_k)
    return (out, lse) if return_lse else out


def _unpack(x, name, index_dim, count):
    V.check_tensor(x, name, 5)  # so a wrong dtype is reported as "qkv", not "q"
    if x.shape[index_dim] != count:
        V._fail(ValueError, f"{name}.shape", f"a 5-d tensor with size {count} at dim "
                f"{index_dim}", tuple(x.shape))
    return x.unbind(index_dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_lse=False):
    """flash_attn_func with qkv (batch, seqlen, 3, nheads, head_dim); views, no copies."""
    q, k, v = _unpack(qkv, "qkv", 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_lse)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_lse=False):
    """flash_attn_func with kv (batch, seqlen_k, 2, nheads_kv, head_dim)."""
    k, v = _unpack(kv, "kv", 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_lse)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    query (batch, nheads, seqlen_q, head_dim) and key/value (batch, nheads_kv, seqlen_k,
    head_dim), or 3-d (batch, seq, head_dim). ``attn_mask`` is bool (True = attend) or
    additive in the query's dtype, broadcastable to (batch, nheads, seqlen_q, seqlen_k),
    and is read tile by tile in the kernel. ``is_causal`` is aligned top-left, as in
    PyTorch (query i sees keys j <= i). A row whose mask excludes every key returns 0.
    Value must share the query's head_dim; dropout_p must be 0.
    """
    for x, name in ((query, "query"), (key, "key"), (value, "value")):
        if not isinstance(x, torch.Tensor):
            V._fail(TypeError, name, "a torch.Tensor", type(x).__name__)
        if x.dim() not in (3, 4):
            V._fail(ValueError, name, "a 4-d (batch, heads, seq, dim) or 3-d tensor",
                    f"shape {tuple(x.shape)}")
    if not query.dim() == key.dim() == value.dim():
        V._fail(ValueError, "key/value rank", f"query's rank {query.dim()}",
                (key.dim(), value.dim()))
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(
            f"value head_dim {value.shape[-1]} != query head_dim {query.shape[-1]}: "
            "flashtile needs one head_dim for q, k and v")
    # Shape checks in the caller's (batch, heads, seq, dim) layout, so the messages name
    # the dims the caller sees; check_qkv below sees the transposed views.
    if value.shape != key.shape:
        V._fail(ValueError, "value.shape", f"key's shape {tuple(key.shape)}",
                tuple(value.shape))
    if key.shape[0] != query.shape[0]:
        V._fail(ValueError, "key.shape[0] (batch)", f"query's batch {query.shape[0]}",
                key.shape[0])
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask and is_causal=True were both given: pass one, as "
                         "torch.nn.functional.scaled_dot_product_attention requires")
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
    h, hkv = query.shape[1], key.shape[1]
    if hkv != h and not enable_gqa:
        V._fail(ValueError, "key.shape[1] (nheads)", f"query's nheads {h}", hkv,
                "Try setting enable_gqa=True")
    if hkv == 0 or h % hkv != 0:
        V._fail(ValueError, "key.shape[1] (nheads)", f"a divisor of query's nheads {h} "
                "(GQA/MQA)", hkv)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    b, sq, sk, h, hkv, d = V.check_qkv(q, k, v, names=("query", "key", "value"))
    V.check_dropout(dropout_p)
    V.check_softmax_scale(scale, "scale")
    attn_mask = V.check_attn_mask(attn_mask, b, h, sq, sk, q.device, q.dtype)
    out, _ = _attention(q, k, v, attn_mask=attn_mask, alibi_slopes=None,
                        softmax_scale=scale, diag_offset=0, window_left=-1,
                        window_right=0 if is_causal else -1, softcap=0.0)
    out = out.transpose(1, 2)
    return out.squeeze(1) if squeeze else out
