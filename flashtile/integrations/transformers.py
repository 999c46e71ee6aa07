"""Hugging Face transformers: ``attn_implementation="flashtile"``.

    import flashtile.integrations.transformers   # registers "flashtile" (idempotent)

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flashtile")
    model.set_attn_implementation("flashtile")   # or switch a loaded model

Importing this module calls ``register()``, which registers under the name "flashtile":

- in ``AttentionInterface`` (transformers >= 4.51), ``attention_forward``: every attention
  layer calls it with query (b, h, sq, d), key/value (b, hkv, sk, d), the layer's mask
  and options (scaling, sliding_window, softcap, dropout, is_causal); it returns
  (b, sq, h, d) from flashtile's kernels, with GQA read in place (no repeated K/V).
- in ``AttentionMaskInterface`` (transformers >= 4.53), ``build_mask``: transformers'
  masking_utils calls it once per forward and layer type, and it returns the mask in the
  form ``attention_forward`` reads, never a (b, sq, sk) tensor for the usual patterns:
    * None: no padding, the keys are the tokens so far (dense kernels; causal aligned
      at the bottom-right corner, so a decode step over a cache needs no mask);
    * 2-D bool (b, n), True = a real token: padding, in flash-attn's convention in
      transformers (column n - 1 is the last query's position; a static cache's slots
      past column n are not filled yet). Prefill and training unpad it to
      ``flash_attn_varlen_func``; a decode step reads it as a (b, 1, 1, n) mask in the
      kernel, which costs less than gathering the whole cache every step, and so does
      any step under torch.compile (unpadding has data-dependent sizes);
    * 1-D int32 (count + 1,): ``cu_seqlens`` of sequences packed along the flattened
      batch (position_ids that restart), served by ``flash_attn_varlen_func``;
    * 4-D: a pattern flashtile cannot describe (a model's own overlay such as image-token
      blocks, chunked attention), materialised by transformers' ``sdpa_mask`` and read
      tile by tile (logged once). transformers 4.51-4.52 have no mask interface: their
      models build 4-D masks for any implementation but their own, and those are read
      the same way.
- for transformers >= 5, which counts every name containing "flash" as a flash-attn
  build (``is_flash_attention_requested``) and so looks "flashtile" up as a Hub kernel
  when a model is loaded: the answer to that lookup is the flashtile package itself,
  which has flash-attn's ``flash_attn_func``, ``flash_attn_varlen_func`` and
  ``flash_attn_with_kvcache`` as a Hub kernel module does (``_serve_flash_lookup``).

Supported: training (gradients) and inference; ``generate`` with the dynamic and the
static cache (transformers >= 5 keeps the 2-D mask with a static cache for "flash"
names, so the unfilled slots are never read), under torch.compile too; GQA/MQA;
causal and bidirectional layers (``module.is_causal``, or the ``is_causal`` a model
passes); sliding windows (``sliding_window``: window_size (w - 1, 0) when causal,
(w - 1, w - 1) when not, flash-attn's convention in transformers); Gemma 2's softcap;
the module's ``scaling``; a value head_dim smaller than the query's (MLA: zero-padded,
as transformers' flash-attn path does); ``generate_batch`` (continuous batching, 5.x):
its packed batches, through ``flash_attn_varlen_func`` (its paged decode fast path is
not open to this name: see ``paged_attention_forward``). Not supported, with an error
naming the argument: attention dropout (flashtile has none), attention sinks
(``s_aux``), T5-style ``position_bias``, ``head_mask``.

No import-free route exists: transformers 4.51-5.x looks attention implementations up
in its registries only (no entry points), and a Hub-kernel name ("namespace/name")
needs the ``kernels`` package and a published kernel repository. Importing this module
(or calling ``register()``) once per process is the way.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from packaging import version

import flashtile
from flashtile import _validate as V
from flashtile.interface import _attention

NAME = "flashtile"
MIN_VERSION = "4.51"  # the first release with transformers.AttentionInterface

logger = logging.getLogger("flashtile")


def _import_transformers():
    try:
        import transformers
    except ModuleNotFoundError as e:
        if e.name != "transformers":
            raise  # transformers is there but one of its own imports failed
        raise ImportError("flashtile.integrations.transformers needs Hugging Face "
                          "transformers: pip install 'flashtile[hf]'") from e
    if version.parse(transformers.__version__) < version.parse(MIN_VERSION):
        raise ImportError(
            f"flashtile.integrations.transformers: expected transformers >= {MIN_VERSION} "
            f"(the first release with AttentionInterface), got {transformers.__version__}."
            " Upgrade it: pip install -U transformers")
    return transformers


def register() -> str:
    """Register ``attn_implementation="flashtile"`` with transformers (idempotent) and
    return the name. Raises ImportError for a transformers older than 4.51."""
    transformers = _import_transformers()
    transformers.AttentionInterface.register(NAME, attention_forward)
    if "paged|flash_attention_2" in transformers.AttentionInterface._global_mapping:
        # 5.0-5.2x: generate_batch switches a model to "paged|<its implementation>".
        transformers.AttentionInterface.register(f"paged|{NAME}", paged_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        pass  # 4.51-4.52: the models build 4-D masks, which attention_forward reads
    else:
        AttentionMaskInterface.register(NAME, build_mask)
    _serve_flash_lookup()
    return NAME


def _serve_flash_lookup():
    """transformers >= 5 takes "flashtile" for a flash-attn build (the name contains
    "flash"): loading a model then calls ``lazy_import_flash_attention("flashtile")``,
    which asks ``hub_kernels.load_and_register_attn_kernel`` for a kernel module by that
    name and raises when it gets none. Answer with the flashtile package, whose three
    functions have flash-attn's signatures; every other name goes to transformers."""
    try:
        from transformers.integrations import hub_kernels
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:
        return  # transformers 4.x: only "flash_attention_*" names are flash-attn builds
    if not is_flash_attention_requested(requested_attention_implementation=NAME):
        return
    original = hub_kernels.load_and_register_attn_kernel
    if getattr(original, "_serves_flashtile", False):
        return

    @functools.wraps(original)
    def load_and_register_attn_kernel(attn_implementation, *args, **kwargs):
        if attn_implementation.removeprefix("paged|") == NAME:
            return flashtile
        return original(attn_implementation, *args, **kwargs)

    load_and_register_attn_kernel._serves_flashtile = True
    hub_kernels.load_and_register_attn_kernel = load_and_register_attn_kernel


@functools.lru_cache(maxsize=None)
def _note_once(message: str):
    logger.warning("flashtile (transformers): %s", message)


def _note(message: str):
    if not torch.compiler.is_compiling():  # a logging call would break the graph
        _note_once(message)


# ---- The mask interface ----

# transformers' mask functions (masking_utils) by __qualname__: the patterns flashtile
# serves without a mask tensor. Windows need no reading here: each layer passes its
# sliding_window to the attention function as well. Anything else is materialised.
_BASES = {"causal_mask_function", "bidirectional_mask_function"}
_WINDOWS = {"sliding_window_overlay.<locals>.inner_mask",
            "sliding_window_bidirectional_overlay.<locals>.inner_mask"}
_PACKED = "packed_sequence_mask_function.<locals>.inner_mask"


def _nonlocal(fn, name):
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    return cells[name].cell_contents if name in cells else None


def _parts(fn):
    """The leaf mask functions of and_masks / packed-position remaps, or None for a
    composition this reading does not know (an or_masks, a model's own function)."""
    name = getattr(fn, "__qualname__", "")
    if name.startswith("and_masks."):
        inner = _nonlocal(fn, "mask_functions")
        found = [_parts(f) for f in inner] if inner is not None else [None]
        return None if None in found else [p for part in found for p in part]
    if name.startswith("remap_positions_for_packed_sequence."):
        inner = _nonlocal(fn, "mask_function")
        return _parts(inner) if inner is not None else None
    return [name]


def _pattern(mask_function):
    """"plain" (causal or bidirectional, with or without a window), "packed" (the same
    over sequences packed along each row) or None (something else)."""
    parts = _parts(mask_function)
    if parts is None or sum(p in _BASES for p in parts) != 1:
        return None
    if any(p not in _BASES and p not in _WINDOWS and p != _PACKED for p in parts):
        return None
    return "packed" if _PACKED in parts else "plain"


def _traced_pattern(mask_function, attention_mask, cache_less, kwargs):
    """_pattern inside a compiled graph, where closures cannot be read (Dynamo traces
    no __closure__ or __qualname__ of the functions masking_utils builds there), only
    compared. "plain" for the causal and bidirectional functions themselves, and for an
    and_masks that transformers built for a sliding-window layer: local_size given,
    use_vmap False (no user overlay), no chunked attention in the config, and no
    packed-sequence part possible (while tracing, transformers adds one whenever
    position_ids come without a mask or cache). Anything else is materialised (None),
    as SDPA's mask is there."""
    from transformers import masking_utils as mu
    if mask_function is mu.causal_mask_function or (
            mask_function is getattr(mu, "bidirectional_mask_function", None)):
        return "plain"
    and_code = mu.and_masks(mu.causal_mask_function).__code__
    if (mask_function.__code__ is and_code and kwargs.get("local_size") is not None
            and kwargs.get("use_vmap") is False
            and getattr(kwargs.get("config"), "attention_chunk_size", None) is None
            and not (attention_mask is None and cache_less)):
        return "plain"
    return None


def _packed_cu_seqlens(mask_function, batch_size, length, device):
    """cu_seqlens (int32) of the sequences packed along each row of a (batch_size,
    length) batch, from the mask function itself: token i starts a sequence when it
    cannot see token i - 1 (one host read, for the count). None when every row holds
    one sequence (transformers 4.53-4.57 add the packed part whenever position_ids
    come without a mask or cache)."""
    rows = torch.arange(batch_size, device=device)[:, None]
    cols = torch.arange(1, length, device=device)[None, :]
    sees_previous = mask_function(rows, torch.zeros((), dtype=torch.long, device=device),
                                  cols, cols - 1)
    starts = torch.ones(batch_size, length, dtype=torch.bool, device=device)
    starts[:, 1:] = ~sees_previous.expand(batch_size, length - 1)
    first = starts.flatten().nonzero().flatten().to(torch.int32)
    if first.numel() == batch_size:
        return None
    return torch.cat([first, first.new_full((1,), batch_size * length)])


def build_mask(*, batch_size, kv_length, mask_function, attention_mask=None, kv_offset=0,
               q_length=None, q_offset=0, cache_position=None, **kwargs):
    """transformers' mask interface for "flashtile" (see the module docstring for the
    four forms it returns). Takes transformers' keyword arguments: q_length/q_offset
    (>= 5.x) or cache_position (4.53-5.0), kv_length, kv_offset, the mask_function
    describing the pattern, and the user's 2-D attention_mask (bool, True = token)."""
    if cache_position is not None:  # transformers < 5.x names the query positions
        q_length, q_offset = cache_position.shape[0], cache_position[0]
    device = kwargs.get("device", getattr(q_offset, "device", "cpu"))
    if torch.compiler.is_compiling():
        cache_less = kv_offset == 0 and kv_length == q_length
        pattern = _traced_pattern(mask_function, attention_mask, cache_less, kwargs)
    else:
        pattern = _pattern(mask_function)
    if pattern == "packed" and attention_mask is None:
        return _packed_cu_seqlens(mask_function, batch_size, q_length, device)
    if pattern != "plain":
        from transformers.masking_utils import sdpa_mask
        if pattern is None:
            _note(f"a mask pattern flashtile cannot describe ({mask_function.__qualname__}"
                  "); it is materialised (batch, 1, q_len, kv_len) and read tile by tile")
        positions = ({"cache_position": cache_position} if cache_position is not None
                     else {"q_length": q_length, "q_offset": q_offset})
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return sdpa_mask(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset,
                         mask_function=mask_function, attention_mask=attention_mask,
                         **positions, **kwargs)
    if attention_mask is not None:
        # The user's mask covers positions 0 .. (last query); a sliding layer's keys are
        # the last kv_length of them.
        attention_mask = attention_mask[:, -kv_length:]
        if (attention_mask.shape[1] == kv_length and not torch.compiler.is_compiling()
                and bool(attention_mask.all())):
            return None
        return attention_mask
    # No user mask. A static cache's keys are its whole buffer, of which only the first
    # `filled` slots hold tokens so far; any other cache holds exactly the tokens so far.
    if cache_position is not None:  # 4.53-5.0: a tensor of query positions
        if kv_offset == 0 and kv_length == q_length:
            return None  # no cache, or a first chunk that fills the buffer
        filled = None if torch.compiler.is_compiling() else int(cache_position[-1]) + 1
    else:
        filled = q_offset + q_length  # an int, or a tensor for a static cache
        if isinstance(filled, torch.Tensor):
            filled = None if torch.compiler.is_compiling() else int(filled)
    if filled is None:
        V._fail(ValueError, "attention_mask", "the 2-D padding mask when a cache is used "
                "under torch.compile (generate passes it)", None, "Without it flashtile "
                "would read the number of filled cache slots on the host, which a "
                "compiled graph cannot do")
    if filled - kv_offset == kv_length:
        return None
    return torch.ones(batch_size, filled - kv_offset, dtype=torch.bool, device=device)


# ---- The attention function ----

def _needs_grad(*xs):
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def _window(sliding_window, causal, key_length):
    """flash-attn's window_size for transformers' sliding_window (w keys including the
    query's own: w - 1 to the left). Left out when every key fits, as transformers'
    flash-attn path does (the unbounded kernels are the faster ones)."""
    if sliding_window is None or key_length <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _masked(q, k, v, mask, causal, window, softmax_scale, softcap):
    """Dense attention with a bool or additive mask broadcastable to (b, h, sq, sk),
    read tile by tile, on top of causal (bottom-right) and window."""
    b, sq, sk, h, _, _ = V.check_qkv(q, k, v)
    left, right = V.check_flash_options(0.0, softmax_scale, softcap, window, causal)
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)  # an additive mask built in another float dtype
    mask = V.check_attn_mask(mask, b, h, sq, sk, q.device, q.dtype)
    out, _ = _attention(q, k, v, attn_mask=mask, alibi_slopes=None,
                        softmax_scale=softmax_scale, diag_offset=sk - sq,
                        window_left=left, window_right=right, softcap=softcap)
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
    mask = mask.to(torch.bool)
    window = _window(sliding_window, causal, n)
    if (sq == 1 and not _needs_grad(q, k, v)) or torch.compiler.is_compiling():
        # A decode step: every row sees the keys its mask allows, in one kernel (cheaper
        # than gathering the whole cache each step). Under torch.compile too: unpadding
        # has data-dependent sizes, which would break the graph.
        return _masked(q, k, v, mask[:, None, None, :], causal, window, **opts)
    rows, cols = mask.nonzero(as_tuple=True)  # one host read: the token count
    cu_k = F.pad(mask.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    if not causal:
        # Bidirectional: every query (padding too, as SDPA does) sees the real keys.
        out = flashtile.flash_attn_varlen_func(
            q.reshape(b * sq, h, d), k[rows, cols], v[rows, cols],
            torch.arange(0, b * sq + 1, sq, dtype=torch.int32, device=q.device), cu_k,
            sq, n, causal=False, window_size=window, **opts)
        return out.view(b, sq, h, d)
    # Causal: the real queries are the real tokens among the last sq positions, and a
    # sequence's last real query is its last real key (varlen's bottom-right alignment).
    q_mask = mask[:, n - sq:]
    q_rows, q_cols = (rows, cols) if sq == n else q_mask.nonzero(as_tuple=True)
    cu_q = F.pad(q_mask.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    out = flashtile.flash_attn_varlen_func(q[q_rows, q_cols], k[rows, cols], v[rows, cols],
                                           cu_q, cu_k, sq, n, causal=True,
                                           window_size=window, **opts)
    return out.new_zeros(b, sq, h, d).index_put((q_rows, q_cols), out)


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
    if sq == 1 and not _needs_grad(q, k, v):
        # A decode step over a cache without padding: the split-KV decode kernel.
        return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=sk, causal=causal,
                                                 window_size=window, **opts)
    return flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, **opts)


def _refuse(dropout, kwargs):
    if dropout:
        raise NotImplementedError(
            f"attention dropout: flashtile has none, and this model asks for dropout="
            f"{dropout} (its attention dropout config in training mode). Load it with "
            "that dropout at 0.0 (e.g. from_pretrained(..., attention_dropout=0.0); BERT: "
            "attention_probs_dropout_prob=0.0), or train with attn_implementation='sdpa'")
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
        docstring). A decode step (sq = 1, no gradient) without padding runs
        ``flash_attn_with_kvcache`` (the split-KV decode kernel).
    The mask's causality is the module's ``is_causal`` unless the model passes
    ``is_causal``; ``scaling`` defaults to head_dim ** -0.5; ``softcap`` None means none.
    """
    _refuse(dropout, kwargs)
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
    opts = dict(softmax_scale=scaling, softcap=0.0 if softcap is None else float(softcap))
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
    place; the -1 that pads unused block-table entries would be clamped to 0 first,
    since flashtile checks every entry). Every step therefore runs the varlen path over
    the gathered keys."""
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


register()
