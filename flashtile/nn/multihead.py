"""flashtile.nn.MultiheadAttention: torch.nn.MultiheadAttention with flashtile inside.

A subclass of torch's module, so the constructor, the parameters (``in_proj_weight``,
``in_proj_bias``, ``out_proj``, ``bias_k``/``bias_v``, ``q/k/v_proj_weight`` when kdim or
vdim differ), their initialisation and the state dict are torch's own; only ``forward``
changes. It follows ``torch.nn.functional.multi_head_attention_forward`` step for step,
except that the projections are viewed straight into flashtile's (batch, seq, heads,
head_dim) layout and the attention is ``flashtile.scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtile import _validate as V
from flashtile.interface import scaled_dot_product_attention


def _project(query, key, value, m, shared):
    """q (.., E), k (.., E), v (.., E) in the inputs' own (seq, batch) or (batch, seq)
    order: one matrix product for self-attention (shared == "qkv": query is key is
    value), two when key is value ("kv"), three otherwise; torch's _in_projection_packed
    and _in_projection split the weights the same way."""
    e = m.embed_dim
    if not m._qkv_same_embed_dim:
        b = (None,) * 3 if m.in_proj_bias is None else m.in_proj_bias.chunk(3)
        ws = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
        return tuple(F.linear(x, wi, bi) for x, wi, bi in zip((query, key, value), ws, b))
    w, b = m.in_proj_weight, m.in_proj_bias
    if shared == "qkv":
        return F.linear(query, w, b).unflatten(-1, (3, e)).unbind(-2)
    if shared == "kv":
        w_q, w_kv = w.split([e, 2 * e])
        b_q, b_kv = (None, None) if b is None else b.split([e, 2 * e])
        return (F.linear(query, w_q, b_q),
                *F.linear(key, w_kv, b_kv).unflatten(-1, (2, e)).unbind(-2))
    ws, bs = w.chunk(3), (None,) * 3 if b is None else b.chunk(3)
    return tuple(F.linear(x, wi, bi) for x, wi, bi in zip((query, key, value), ws, bs))


def _flashtile_mask(mask, name, shape, dtype):
    """A torch MHA mask (bool True = masked out, or additive) viewed as ``shape``, in
    flashtile's meaning (bool True = attend, or additive in the query's dtype)."""
    if not isinstance(mask, torch.Tensor):
        V._fail(TypeError, name, "a torch.Tensor or None", type(mask).__name__)
    if mask.dtype == torch.bool:
        return ~mask.view(shape)
    if not mask.is_floating_point():
        V._fail(TypeError, f"{name}.dtype", "torch.bool or a floating dtype", mask.dtype)
    return mask.view(shape).to(dtype)


def _additive(mask, dtype):
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


def _merge_masks(attn_mask, key_padding_mask, bsz, heads, tgt_len, src_len, dtype):
    """attn_mask (L, S) or (N * heads, L, S) and key_padding_mask (N, S), combined as
    torch does (both masks out a key; additive ones add) into one mask broadcastable to
    (N, heads, L, S). A key padding mask alone stays a (N, 1, 1, S) view: the kernel
    reads it through stride-0 dims, nothing (L, S)-sized is made."""
    masks = []
    if attn_mask is not None:
        if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (tgt_len, src_len):
            shape = (1, 1, tgt_len, src_len)
        elif attn_mask.dim() == 3 and tuple(attn_mask.shape) in (
                (bsz * heads, tgt_len, src_len), (1, tgt_len, src_len)):
            shape = (attn_mask.shape[0] // heads or 1, -1, tgt_len, src_len)
        else:
            V._fail(ValueError, "attn_mask.shape", f"({tgt_len}, {src_len}) or (batch * "
                    f"num_heads, L, S) = ({bsz * heads}, {tgt_len}, {src_len})",
                    tuple(attn_mask.shape))
        masks.append(_flashtile_mask(attn_mask, "attn_mask", shape, dtype))
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (bsz, src_len):
            V._fail(ValueError, "key_padding_mask.shape", f"(batch, S) = ({bsz}, "
                    f"{src_len}), or (S,) for an unbatched query",
                    tuple(key_padding_mask.shape))
        masks.append(_flashtile_mask(key_padding_mask, "key_padding_mask",
                                     (bsz, 1, 1, src_len), dtype))
    if len(masks) < 2:
        return masks[0] if masks else None
    a, b = masks
    if a.dtype == b.dtype == torch.bool:
        return a & b
    return _additive(a, dtype) + _additive(b, dtype)


def _append_key(k, v, mask, k_row, v_row):
    """One more key per sequence (bias_k/bias_v or add_zero_attn's zeros), seen by every
    query: k/v (N, S, H, D) grow to S + 1 and the mask gets an attending column."""
    n = k.shape[0]
    k = torch.cat([k, k_row.expand(n, 1, *k.shape[2:])], dim=1)
    v = torch.cat([v, v_row.expand(n, 1, *v.shape[2:])], dim=1)
    if mask is not None:
        mask = F.pad(mask, (0, 1), value=True if mask.dtype == torch.bool else 0.0)
    return k, v, mask


class MultiheadAttention(torch.nn.MultiheadAttention):
    """Drop-in for ``torch.nn.MultiheadAttention`` computed by flashtile.

    Same constructor (embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn,
    kdim, vdim, batch_first, device, dtype), parameters and state dict: a torch
    module's ``state_dict()`` loads unchanged, and ``isinstance(m,
    torch.nn.MultiheadAttention)`` holds. head_dim = embed_dim / num_heads is at most 256.

    ``forward(query, key, value, key_padding_mask=None, need_weights=False,
    attn_mask=None, average_attn_weights=True, is_causal=False)`` has torch's arguments
    and shapes ((L, N, E), or (N, L, E) with batch_first, or unbatched (L, E)) and
    returns ``(attn_output, None)``. Differences, all deliberate:

    - need_weights defaults to False and True raises NotImplementedError: flashtile
      never forms the (L, S) attention weights. torch's default is True, but code that
      unpacks ``out, _ = mha(q, k, v)`` and ignores the weights runs unchanged.
    - dropout drops attention weights in training mode only, with p = dropout and the
      kept ones scaled by 1 / (1 - p), as torch does, through flashtile's dropout_p.
      The mask is flashtile's Philox mask, seeded from PyTorch's generator (so
      torch.manual_seed makes it reproducible): the same distribution as torch's, not
      the same draw, so outputs match torch's only in eval mode or with dropout=0.0.
    - is_causal is torch's hint that attn_mask is causal (attn_mask is required with it,
      as in torch): without a key_padding_mask the mask is not read and the top-left
      causal mask is computed in the kernel, as torch's SDPA path does.
    - A key_padding_mask alone is passed as a (N, 1, 1, S) view, not an (N, L, S) mask;
      rows that see no key give 0 (torch's training path gives 0 too, its fast inference
      path NaN).
    - Inputs must be float16, bfloat16 or float32 (flashtile's dtypes).
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None):
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn,
                         kdim, vdim, batch_first, device, dtype)
        # torch takes any float (and p = 1 zeroes the weights); flashtile's dropout_p is
        # in [0, 1): refuse a bad value here rather than at the first training forward.
        V.check_dropout(dropout, "dropout")
        if self.head_dim > V.MAX_HEAD_DIM:
            V._fail(ValueError, "embed_dim / num_heads (head_dim)",
                    f"at most {V.MAX_HEAD_DIM}", f"{embed_dim} / {num_heads}",
                    "Use more heads")

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        V.check_bools(need_weights=need_weights, average_attn_weights=average_attn_weights,
                      is_causal=is_causal)
        if need_weights:
            raise NotImplementedError(
                "need_weights=True: flashtile never forms the attention weights. Pass "
                "need_weights=False (the second return value is then None), or use "
                "torch.nn.MultiheadAttention where the weights are needed")
        if is_causal and attn_mask is None:
            raise ValueError("is_causal=True needs attn_mask (the causal mask itself), as "
                             "torch.nn.MultiheadAttention requires: is_causal is a hint "
                             "about attn_mask. Pass nn.Transformer."
                             "generate_square_subsequent_mask(L) as attn_mask")
        for x, name in ((query, "query"), (key, "key"), (value, "value")):
            if not isinstance(x, torch.Tensor):
                V._fail(TypeError, name, "a torch.Tensor", type(x).__name__)
        batched = query.dim() == 3
        if query.dim() not in (2, 3) or not query.dim() == key.dim() == value.dim():
            V._fail(ValueError, "query/key/value rank", "3 (batched) or 2 (unbatched) for "
                    "all three", (query.dim(), key.dim(), value.dim()))
        for x, name, dim in ((query, "query", "embed_dim"), (key, "key", "kdim"),
                             (value, "value", "vdim")):
            if x.shape[-1] != getattr(self, dim):
                V._fail(ValueError, f"{name}.shape[-1]", f"{dim}={getattr(self, dim)}",
                        x.shape[-1])
        # Read before unsqueeze makes new tensor objects.
        shared = "qkv" if query is key and key is value else "kv" if key is value else ""
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        # The projections run in the inputs' own order; the (seq, batch) transposes of
        # their outputs are free views that keep the head dim contiguous for the kernel.
        seq_first = not (self.batch_first and batched)
        q, k, v = _project(query, key, value, self, shared)
        q, k, v = (x.transpose(0, 1) if seq_first else x for x in (q, k, v))
        bsz, tgt_len, src_len = q.shape[0], q.shape[1], k.shape[1]
        q, k, v = (x.unflatten(-1, (self.num_heads, self.head_dim)) for x in (q, k, v))

        # torch's rule: the hint holds when no key padding mask is mixed in.
        causal = is_causal and key_padding_mask is None
        mask = None if causal else _merge_masks(attn_mask, key_padding_mask, bsz,
                                                self.num_heads, tgt_len, src_len, q.dtype)
        if self.bias_k is not None and self.bias_v is not None:
            k, v, mask = _append_key(k, v, mask, self.bias_k.view(1, 1, *k.shape[2:]),
                                     self.bias_v.view(1, 1, *v.shape[2:]))
        if self.add_zero_attn:
            zeros = k.new_zeros(1, 1, *k.shape[2:])
            k, v, mask = _append_key(k, v, mask, zeros, zeros)
        out = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=mask,
                                           dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=causal)       # (N, H, L, D)
        order = (2, 0, 1, 3) if seq_first else (0, 2, 1, 3)
        out = out.permute(order).flatten(-2)                       # (L, N, E) or (N, L, E)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        return (out if batched else out.squeeze(1)), None
