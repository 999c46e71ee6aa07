"""The attention function transformers calls for every layer, and the generate_batch
adapter (continuous batching, transformers 5.0-5.2x)."""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

import flashtile
from flashtile import _validate as V
from flashtile._backend import select_backend
from flashtile.custom_ops import _plain_eager
from flashtile.integrations.transformers._notes import _note
from flashtile.integrations.transformers.masks import marked_leftpad, tensor_version
from flashtile.interface import _attention, _philox
from flashtile.ops import _launch, decode
from flashtile.ops.decode import attn_decode


def _needs_grad(*xs):
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def _window(sliding_window, causal, key_length):
    """flash-attn's window_size for transformers' sliding_window (w keys including the
    query's own: w - 1 to the left). Left out when every key fits, as transformers'
    flash-attn path does (the unbounded kernels are the faster ones)."""
    if sliding_window is None or key_length <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _masked(q, k, v, mask, causal, window, softmax_scale, softcap, dropout_p):
    """Dense attention with a bool or additive mask broadcastable to (b, h, sq, sk),
    read tile by tile, on top of causal (bottom-right) and window."""
    b, sq, sk, h, _, _ = V.check_qkv(q, k, v)
    left, right = V.check_flash_options(dropout_p, softmax_scale, softcap, window, causal)
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)  # an additive mask built in another float dtype
    mask = V.check_attn_mask(mask, b, h, sq, sk, q.device, q.dtype)
    out, _ = _attention(q, k, v, attn_mask=mask, alibi_slopes=None,
                        softmax_scale=softmax_scale, diag_offset=sk - sq,
                        window_left=left, window_right=right, softcap=softcap,
                        dropout_p=dropout_p, philox=_philox(q, dropout_p),
                        return_lse=False)
    return out


def _padded(q, k, v, mask, causal, sliding_window, opts):
    """Attention under a 2-D padding mask (b, n), flash-attn's convention: column n - 1
    is the last query; keys past column n are unfilled static-cache slots."""
    b, sq, h, d = q.shape
    n = mask.shape[1]
    if n > k.shape[1]:
        V._fail(ValueError, "attention_mask.shape[1]", f"at most the key length {k.shape[1]}",
                n, "A 2-D mask covers the positions of the keys, up to the last query")
    k, v = k[:, :n], v[:, :n]
    attention_mask, mask = mask, mask.to(torch.bool)
    window = _window(sliding_window, causal, n)
    if torch.compiler.is_compiling():
        # Unpadding has data-dependent sizes, which would break the graph; whether the
        # padding is all at the left is a host read, which a graph cannot make.
        return _masked(q, k, v, mask[:, None, None, :], causal, window, **opts)
    if sq == 1 and not _needs_grad(q, k, v):
        # A decode step: every row sees the keys its mask allows, in one kernel (cheaper
        # than gathering the whole cache each step). When build_mask found the padding
        # all at the left (generate's batches), the keys of row b are [leftpad[b], n):
        # the split-KV decode kernel's cache_leftpad (it has no dropout).
        leftpad = marked_leftpad(attention_mask)
        if leftpad is not None and not opts["dropout_p"]:
            return _decode(q, k, v, causal, window, opts["softmax_scale"], opts["softcap"],
                           leftpad)
        return _masked(q, k, v, mask[:, None, None, :], causal, window, **opts)
    windowed = window != (-1, -1)
    unpadded, holes = _unpadding(attention_mask, mask, sq, causal, windowed)
    if windowed and holes:
        # Unpadding closes the gaps between a row's tokens, which would move keys into
        # a sliding window that sdpa's positions keep out: the masked kernel, exact.
        return _masked(q, k, v, mask[:, None, None, :], causal, window, **opts)
    (rows, cols, cu_k), (q_rows, q_cols, cu_q) = unpadded
    if not causal:
        # Bidirectional: every query (padding too, as SDPA does) sees the real keys.
        out = flashtile.flash_attn_varlen_func(
            q.reshape(b * sq, h, d), k[rows, cols], v[rows, cols], cu_q, cu_k, sq, n,
            causal=False, window_size=window, **opts)
        return out.view(b, sq, h, d)
    out = flashtile.flash_attn_varlen_func(q[q_rows, q_cols], k[rows, cols], v[rows, cols],
                                           cu_q, cu_k, sq, n, causal=True,
                                           window_size=window, **opts)
    return out.new_zeros(b, sq, h, d).index_put((q_rows, q_cols), out)


# The last _unpadding: (weak reference to the mask, its version, sq, causal), and
# [unpadding, whether rows have holes (None: not asked yet)].
_last_unpadding = [None, None]


def _unpadding(given, mask, sq, causal, windowed):
    """(unpadding, holes) of a 2-D mask. The unpadding: ((rows, cols, cu_seqlens) of the
    real keys, the same of the real queries); holes (asked by sliding-window layers,
    else None): whether any row has padding between its tokens. Both are computed once
    per forward, not per layer. transformers hands every layer the mask object
    build_mask made for that forward (a fresh view each time), so the last result is
    reused while ``given`` is that object, unmodified (``tensor_version``). Each
    computation reads the token count on the host (nonzero): a sync, which in
    every layer would stall the pipeline once a layer."""
    version = tensor_version(given)
    key, found = _last_unpadding
    if key is None or key[0]() is not given or key[1:] != (version, sq, causal):
        found = [_unpad(mask, sq, causal), None]
        _last_unpadding[:] = ((weakref.ref(given), version, sq, causal), found)
    if windowed and found[1] is None:
        n = mask.shape[1]
        cols = torch.arange(n, device=mask.device)
        first = torch.where(mask, cols, n).amin(1)
        last = torch.where(mask, cols, -1).amax(1)
        found[1] = bool((last - first + 1 > mask.sum(1)).any())  # a host read
    return found


def _unpad(mask, sq, causal):
    b, n = mask.shape
    rows, cols = mask.nonzero(as_tuple=True)  # one host read: the token count
    cu_k = F.pad(mask.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    if not causal:  # every query row is kept (padding too, as SDPA does)
        queries = (None, None, torch.arange(0, b * sq + 1, sq, dtype=torch.int32,
                                            device=mask.device))
    else:
        # Causal: the real queries are the real tokens among the last sq positions, and
        # a sequence's last real query is its last real key (varlen's bottom-right
        # alignment).
        q_mask = mask[:, n - sq:]
        q_rows, q_cols = (rows, cols) if sq == n else q_mask.nonzero(as_tuple=True)
        queries = (q_rows, q_cols, F.pad(q_mask.sum(1, dtype=torch.int32).cumsum(
            0, dtype=torch.int32), (1, 0)))
    return (rows, cols, cu_k), queries


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, sliding_window, opts):
    """Sequences packed along the flattened batch: q (b, sq, h, d) -> (b*sq, h, d)."""
    b, sq, h, d = q.shape
    out = flashtile.flash_attn_varlen_func(
        q.reshape(-1, h, d), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), causal=causal,
        window_size=_window(sliding_window, causal, int(max_k)), **opts)
    return out.view(b, sq, h, d)


def _given_varlen(q, k, v, kwargs, causal, sliding_window, opts):
    """The cu_seq_lens a caller passes: generate_batch, or DataCollatorWithFlattening
    (return_flash_attn_kwargs=True). generate_batch pads q and k for its CUDA graphs
    past the last sequence (its cu_seq_lens plateau there); those rows become one more
    sequence, so the prefix sums end at the packed lengths as flashtile requires,
    without reading them on the host (a CUDA graph capture cannot)."""
    cu_q, cu_k = (kwargs[name].to(torch.int32) for name in ("cu_seq_lens_q", "cu_seq_lens_k"))
    total_q, total_k = q.shape[0] * q.shape[1], k.shape[0] * k.shape[1]
    cu_q = torch.cat([cu_q, cu_q.new_full((1,), total_q)])
    cu_k = torch.cat([cu_k, cu_k.new_full((1,), total_k)])
    # transformers 5.24 names the lengths max_length_*, 5.0-5.2x max_seqlen_*. The
    # padding rows fit under them: max_length_q is the padded size when there are any.
    max_q = kwargs.get("max_length_q", kwargs.get("max_seqlen_q")) or total_q
    return _varlen(q, k, v, cu_q, cu_k, max_q, total_k, causal, sliding_window, opts)


def _dense(q, k, v, causal, sliding_window, opts):
    sq, sk = q.shape[1], k.shape[1]
    window = _window(sliding_window, causal, sk)
    if sq == 1 and not _needs_grad(q, k, v) and not opts["dropout_p"]:
        # A decode step over a cache without padding: the split-KV decode kernel, which
        # has no dropout (a model left in training mode under no_grad takes
        # flash_attn_func below, whose result is the same but for the dropout).
        return _decode(q, k, v, causal, window, opts["softmax_scale"], opts["softcap"])
    return flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, **opts)


# The last decode call's (signature, cache_seqlens, softmax_scale, window_left,
# window_right, decode.Bound or None).
_last_decode = [None]


def _decode(q, k, v, causal, window, softmax_scale, softcap, cache_leftpad=None):
    """flash_attn_with_kvcache(q, k, v, cache_seqlens=k.shape[1], cache_leftpad=...)
    for a decode step, at less host cost. Decode in ``generate`` is host-bound (a
    step's kernels take a few microseconds, the Python around them far more), and
    every layer of a step makes this call with the same shapes. So the first layer's
    call goes through flash_attn_with_kvcache, which validates them, and the step's
    other layers, whose signature (shapes, strides, dtypes, devices, options, whether
    a cache_leftpad comes, stream) is the same, launch the decode kernel as
    flash_attn_with_kvcache's eager Triton path does, on the first call's
    cache_seqlens tensor (the kernel only reads it) and this call's cache_leftpad
    (build_mask's, made once per forward). What can change between calls of one
    signature is still asked on every call: compile, tracing or a subclass
    (``_plain_eager``), the backend (FLASHTILE_BACKEND), the index checks; a call they
    send elsewhere, or one during CUDA-graph capture (whose tensors must not outlive
    it here), takes flash_attn_with_kvcache. So does a call torch.compile traces: the
    memo is host state of eager calls, which a graph must neither query (the stream)
    nor keep (its tensor in a global).

    The next step's first layer differs from the memo in the cache's length and
    strides alone (transformers' DynamicCache grows by concatenation): ``_grown`` checks
    what flash_attn_with_kvcache's validation could find new there (the cache's 32-bit
    reach), and the step binds the decode's plans relocated to the longer cache
    (``decode.bind``) on a fresh cache_seqlens, without that validation's host time."""
    if torch.compiler.is_compiling():
        return _kvcache(q, k, v, causal, window, softmax_scale, softcap, cache_leftpad)[0]
    cuda = q.is_cuda
    capturing = cuda and torch.cuda.is_current_stream_capturing()
    signature = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype,
                 k.device, v.shape, v.stride(), v.dtype, v.device, causal, window,
                 softmax_scale, softcap, cache_leftpad is not None,
                 torch._C._cuda_getCurrentRawStream(q.device.index) if cuda else None)
    last = _last_decode[0]
    same = last is not None and last[0] == signature
    if (not capturing and (same or _grown(last, signature, k, v))
            and not V.index_checks_enabled() and _plain_eager((q, k, v))
            and select_backend(q.device, q.dtype) == "triton"):
        _, cache_seqlens, scale, left, right, bound = last
        if not same:
            cache_seqlens = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32,
                                       device=q.device)
            bound = _remember(signature, q, k, v, cache_seqlens, cache_leftpad, scale,
                              left, right, softcap)
        if bound is not None:  # the plans, launched without a key built and looked up
            out = bound(q, k, v, cache_seqlens, cache_leftpad)
            if out is not None:
                return out
        return attn_decode(q, k, v, cache_seqlens=cache_seqlens, block_table=None,
                           cache_batch_idx=None, cache_leftpad=cache_leftpad,
                           alibi_slopes=None, softmax_scale=scale, window_left=left,
                           window_right=right, softcap=float(softcap), num_splits=0,
                           allow_tf32=False, return_lse=False)[0]
    out, cache_seqlens = _kvcache(q, k, v, causal, window, softmax_scale, softcap,
                                 cache_leftpad)
    if not capturing:
        # What flash_attn_with_kvcache derived from the options, for the fast path.
        left, right = V.check_flash_options(0.0, softmax_scale, softcap, window, causal)
        scale = float(1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None
                      else softmax_scale)
        _remember(signature, q, k, v, cache_seqlens, cache_leftpad, scale, left, right,
                  softcap)
    return out


def _remember(signature, q, k, v, cache_seqlens, cache_leftpad, scale, left, right,
              softcap):
    """The memo of ``signature``'s calls, with the decode's plans bound to it
    (``decode.bind``; None where there are none); returns the Bound."""
    bound = decode.bind(q, k, v, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                        softmax_scale=scale, window_left=left, window_right=right,
                        softcap=float(softcap))
    _last_decode[0] = (signature, cache_seqlens, scale, left, right, bound)
    return bound


# The signature's places of k's and v's shapes (each followed by its strides).
_CACHES = (4, 8)


def _grown(last, signature, k, v) -> bool:
    """Whether ``signature`` is the memo's but for a cache of another length (k and v
    alike) whose strides Triton compiles as the memo's (``_launch.spec_class``), whose
    elements 32-bit offsets reach, and whose decode found plans (the memo's Bound)."""
    if last is None or last[5] is None:
        return False
    old = last[0]
    places = {at + i for at in _CACHES for i in (0, 1)}
    if any(a != b for i, (a, b) in enumerate(zip(old, signature)) if i not in places):
        return False
    spec = _launch.spec_class
    for at in _CACHES:
        if any(a != b for i, (a, b) in enumerate(zip(old[at], signature[at])) if i != 1) \
                or any(spec(a) != spec(b) for a, b in zip(old[at + 1], signature[at + 1])):
            return False
    if k.shape[1] != v.shape[1]:
        return False
    try:
        V.check_offsets(k, "k_cache")
        V.check_offsets(v, "v_cache")
    except ValueError:  # flash_attn_with_kvcache raises it, in its own words
        return False
    return True


def _kvcache(q, k, v, causal, window, softmax_scale, softcap, cache_leftpad):
    """(flash_attn_with_kvcache over every key of k and v, the cache_seqlens made)."""
    cache_seqlens = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32,
                               device=q.device)
    out = flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens,
                                            cache_leftpad=cache_leftpad, causal=causal,
                                            window_size=window, softmax_scale=softmax_scale,
                                            softcap=softcap)
    return out, cache_seqlens


def _refuse(kwargs):
    for name, what in (("s_aux", "attention sinks"),
                       ("position_bias", "an additive position bias (T5-style)"),
                       ("head_mask", "a head mask")):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{name}: flashtile takes no {what}; use attn_implementation='sdpa' or "
                "'eager' for this model")
    if kwargs.get("output_attentions"):
        _note("output_attentions=True: flashtile never forms the attention weights; "
              "they are returned as None (use attn_implementation='eager' for them)")


def attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                      scaling=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention function for "flashtile".

    query (b, h, sq, d), key/value (b, hkv, sk, d_v) as transformers' layers pass them
    (after RoPE and the cache update); returns (out (b, sq, h, d_v), None). Path, in
    order:
      * ``cu_seq_lens_q/k`` and ``max_length_q/k`` in kwargs (``generate_batch``'s
        packed batches, ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``):
        ``flash_attn_varlen_func``;
      * then by the mask ``build_mask`` made (None, 2-D, 1-D or 4-D; see the module
        docstring). A decode step (sq = 1, no gradient) without dropout, and
        without padding or with padding only at the left (build_mask marks such a
        mask), runs ``flash_attn_with_kvcache`` (the split-KV decode kernel, the left
        padding as its ``cache_leftpad``).
    The mask's causality is the module's ``is_causal`` unless the model passes
    ``is_causal``; ``scaling`` defaults to head_dim ** -0.5; ``softcap`` None means none.
    ``dropout`` (models pass their attention dropout in training mode, 0.0 otherwise)
    is flashtile's dropout_p on every path: flashtile's Philox mask, seeded from
    PyTorch's generator, not the draw sdpa or eager would make.
    """
    V.check_dropout(dropout, "dropout")
    _refuse(kwargs)
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    causal = bool(causal)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (b, s, h, d) views
    d, d_v = q.shape[-1], v.shape[-1]
    if d_v > d:
        V._fail(ValueError, "value.shape[-1] (head_dim)", f"at most the query's {d}", d_v)
    if d_v < d:  # MLA: pad value to the query's head_dim, crop the output below
        v = F.pad(v, (0, d - d_v))
    opts = dict(softmax_scale=scaling, softcap=0.0 if softcap is None else float(softcap),
                dropout_p=float(dropout))
    if kwargs.get("block_table") is not None:
        raise NotImplementedError(_NO_BLOCK_TABLE)
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        out = _given_varlen(q, k, v, kwargs, causal, sliding_window, opts)
    elif attention_mask is None:
        out = _dense(q, k, v, causal, sliding_window, opts)
    elif attention_mask.dim() == 4:
        out = _masked(q, k, v, attention_mask[..., :k.shape[1]], False, (-1, -1), **opts)
    elif attention_mask.dim() == 2:
        out = _padded(q, k, v, attention_mask, causal, sliding_window, opts)
    elif attention_mask.dim() == 1:
        out = _varlen(q, k, v, attention_mask, attention_mask, q.shape[1], k.shape[1],
                      causal, sliding_window, opts)
    else:
        V._fail(ValueError, "attention_mask", "None, a 2-D padding mask, 1-D cu_seqlens or "
                "a 4-D mask", f"shape {tuple(attention_mask.shape)}")
    return (out[..., :d_v] if d_v < d else out), None


# ---- generate_batch (continuous batching) ----

_NO_BLOCK_TABLE = (
    "block_table: generate_batch's decode fast path (flash_attn_with_kvcache over its "
    "paged cache) is not served for attn_implementation='flashtile'. transformers enables "
    "it only for names matching flash.*2 or flash.*3 on CUDA "
    "(is_flash_attention_requested(config, version=[2, 3])), so it should never reach "
    "flashtile; turn it off with ContinuousBatchingConfig(max_blocks_per_request=0)")


def paged_attention_forward(module, query, key, value, attention_mask, cache=None,
                            cu_seq_lens_q=None, cu_seq_lens_k=None, max_seqlen_q=None,
                            **kwargs):
    """generate_batch's attention in transformers 5.0-5.2x, which switches a model to
    "paged|flashtile" for it: the layer passes its new keys and the PagedAttentionCache;
    cache.update writes them into the pages and gathers each sequence's keys
    (read_index/write_index), which ``flash_attn_varlen_func`` then attends, one
    sequence per request. cu_seq_lens_k (and max_seqlen_k, unused: the gathered keys'
    count bounds every sequence) come per layer type ("full_attention",
    "sliding_attention").

    transformers >= 5.21 drops the "paged|" step for flash-style names: its model
    layers update the cache themselves and ``attention_forward`` gets the same packed
    batch. In both, the decode fast path (flash_attn_with_kvcache with the pages' block
    table) stays off for "flashtile": transformers turns it on only for
    ``is_flash_attention_requested(config, version=[2, 3])`` (a name matching
    flash.*2 or flash.*3) on CUDA, although flashtile's flash_attn_with_kvcache has
    the arguments that path passes (block_table, cache_seqlens, the new k/v appended in
    place; the -1 that pads unused block-table entries is never read, since entries
    past a sequence's pages are not followed). Every step therefore runs the varlen path
    over the gathered keys."""
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if isinstance(cu_seq_lens_k, dict):
        layer_type = "sliding_attention" if window else "full_attention"
        cu_seq_lens_k = cu_seq_lens_k[layer_type]
    if kwargs.get("block_table") is not None:
        raise NotImplementedError(_NO_BLOCK_TABLE)
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                              read_index=kwargs["read_index"],
                              write_index=kwargs["write_index"])
    # (total_k, hkv, d) -> the (1, hkv, total_k, d) layout of a layer's keys
    key, value = (x.transpose(0, 1).unsqueeze(0) for x in (key, value))
    kwargs.update(sliding_window=window, cu_seq_lens_q=cu_seq_lens_q,
                  cu_seq_lens_k=cu_seq_lens_k, max_length_q=max_seqlen_q)
    return attention_forward(module, query, key, value, None, **kwargs)
