"""The mask interface (transformers >= 4.53): the form of each layer's mask.

transformers' masking_utils calls ``build_mask`` once per forward and layer type; it
returns what ``attention.attention_forward`` reads, never a (b, sq, sk) tensor for the
usual patterns (see the package docstring for the four forms).
"""

from __future__ import annotations

import torch

from flashtile import _validate as V
from flashtile.integrations.transformers._notes import _note

try:  # imported here: Dynamo cannot trace an import from transformers' lazy module
    from transformers import masking_utils as _mu
except ImportError:  # transformers < 4.53 (no mask interface, build_mask unused) or none
    _mu = None


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
    mu = _mu
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


def _padding_kind(mask, decoding):
    """(every token real, pure left padding: each row padding then tokens, its last
    column a token) of a 2-D bool mask, in one host read per forward. The second is
    asked in a decode step only (else False), the one step that uses it."""
    if not decoding:
        return bool(mask.all()), False
    # No token followed by padding in a row, and the query's own column a token.
    left = (mask[:, 1:] >= mask[:, :-1]).all() & mask[:, -1].all()
    return torch.stack([mask.all(), left]).tolist()


# The attribute build_mask sets on a decode step's purely left-padded 2-D mask:
# (the mask's version, cache_leftpad int32 (b,): the column of each row's first token).
_LEFTPAD = "_flashtile_cache_leftpad"


def tensor_version(t):
    """t's in-place version counter, to tell a tensor modified since; None for an
    inference tensor, which has none (then identity alone decides)."""
    return None if t.is_inference() else t._version


def _mark_left_padded(mask):
    """Tell the layers that ``mask`` (the view build_mask returns and transformers hands
    every layer unchanged) is pure left padding, with flash-attn's cache_leftpad, so a
    decode step takes the split-KV decode kernel; computed on the device, no read."""
    n = mask.shape[1]
    leftpad = n - mask.sum(1, dtype=torch.int32)
    setattr(mask, _LEFTPAD, (tensor_version(mask), leftpad))


def marked_leftpad(mask):
    """The cache_leftpad build_mask attached to ``mask``, or None: not marked (another
    2-D mask, a copy or slice of it, one built under torch.compile) or modified in
    place since."""
    version, leftpad = getattr(mask, _LEFTPAD, (None, None))
    if leftpad is None or version != tensor_version(mask):
        return None
    return leftpad


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
        if pattern is None and not torch.compiler.is_compiling():  # (no __qualname__ there)
            _note(f"a mask pattern flashtile cannot describe ({mask_function.__qualname__}"
                  "); it is materialised (batch, 1, q_len, kv_len) and read tile by tile")
        positions = ({"cache_position": cache_position} if cache_position is not None
                     else {"q_length": q_length, "q_offset": q_offset})
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return _mu.sdpa_mask(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset,
                         mask_function=mask_function, attention_mask=attention_mask,
                         **positions, **kwargs)
    if attention_mask is not None:
        # The user's mask covers positions 0 .. (last query); a sliding layer's keys are
        # the last kv_length of them.
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and not torch.compiler.is_compiling():
            all_real, left_padded = _padding_kind(attention_mask, q_length == 1)
            if all_real:
                return None
            if left_padded:
                _mark_left_padded(attention_mask)
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
