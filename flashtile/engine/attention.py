"""The step's attention metadata and the Attention layer over the paged KV pool.

The runner builds one AttentionMetadata per step; every layer reads it. Each layer first
writes its new keys and values into the pool with one vectorised store (``slot_mapping``,
pool slot = block id * page_size + offset), then attends:

- ``flashtile``: a pure decode step (one query per sequence) is one paged
  ``flash_attn_with_kvcache`` call; a prefill step whose sequences have no earlier keys
  is ``flash_attn_varlen_func`` over the step's own packed k/v; a step with earlier keys
  (prefill chunks, prefix-cache hits, mixed prefill + decode) is ``flash_attn_varlen_func``
  reading the pool through ``block_table``.
- ``sdpa``: torch.nn.functional.scaled_dot_product_attention, sequence by sequence, on keys
  gathered from the pool (``key_slots``).
- ``naive``: softmax(q k^T) v in plain PyTorch over each sequence's contiguous
  max_model_len slab (the pool with one page of max_model_len per sequence).

The pool of each layer is (num_blocks + 1, page_size, nheads_kv, head_dim): the extra last
block is scratch. Padding rows (slot -1) write into it, since a negative index counts from
the end, and CUDA-graph padding rows read it, so neither touches a sequence's pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import flashtile
from flashtile import fp8


@dataclass
class AttentionMetadata:
    """One step's batch of B sequences and T = num_tokens new tokens, packed.

    cu_seqlens_q: (B + 1,) int32 prefix sums of the new tokens of each sequence.
    cu_seqlens_k: (B + 1,) int32 prefix sums of each sequence's keys, this step's included.
    max_seqlen_q, max_seqlen_k: the longest of each (host ints).
    slot_mapping: (T,) int64 pool slot of each new token's k/v; -1 writes nothing.
    cache_seqlens: (B,) int32 keys of each sequence after this step's writes.
    block_tables: (B, max_blocks) int32 pool block of each page of each sequence.
    is_decode: every sequence has exactly one new token (the CUDA-graph case).
    has_context: some sequence attends to keys written by an earlier step.
    query_lens, key_lens: host copies of the lengths, for the per-sequence loops.
    key_slots: (cu_seqlens_k[-1],) int64 pool slots of every key, sequence by sequence,
        when has_context and not is_decode, for the sdpa and naive backends (flashtile
        reads the pool through block_tables).
    """

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: Tensor
    cache_seqlens: Tensor
    block_tables: Tensor
    is_decode: bool
    has_context: bool
    query_lens: list
    key_lens: list
    key_slots: Optional[Tensor] = None


# calculate_kv_scales (vLLM's): a layer's scale maps the largest |k| (|v|) of the first
# step that writes the pool to these values, below e4m3's 448 so that later tokens have
# room (vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT).
K_RANGE, V_RANGE = 200.0, 100.0


def to_pool(x: Tensor, dtype: torch.dtype, scale: Optional[Tensor] = None) -> Tensor:
    """Keys or values (T, Hkv, d) as an FP8 pool holds them: flashtile.fp8.quantize with
    the pool's scale (a 0-d fp32 tensor; None: 1.0, vLLM's default), x / scale rounded to
    nearest even and saturated at the format's largest value (a plain cast would make
    NaN of what lies past it); x itself for a 16-bit pool."""
    if dtype.itemsize != 1:
        return x
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=x.device)
    return fp8.quantize(x[None], scale, dtype)[0][0]


def store_kv(k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, k: Tensor,
             v: Tensor, k_scale: Optional[Tensor] = None,
             v_scale: Optional[Tensor] = None) -> None:
    """k/v (T, Hkv, d) into the pool at slot_mapping, one vectorised write each (slot -1:
    the scratch block, the pool's last). An FP8 pool's as bytes (``to_pool``, with its
    scales): index_put has no FP8 kernel in every torch build."""
    for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        x = to_pool(x, cache.dtype, scale)
        if cache.dtype.itemsize == 1:
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_put_((slot_mapping,), x)


def _allowed(q_pos: Tensor, num_keys: int, window_left: int) -> Tensor:
    """Bool (..., Lq, Lk): key j is visible from query position i (causal, windowed)."""
    k_pos = torch.arange(num_keys, device=q_pos.device)
    mask = k_pos <= q_pos[..., None]
    if window_left >= 0:
        mask &= k_pos > q_pos[..., None] - window_left - 1
    return mask


def _masked_attention(q, k, v, mask, scale, use_sdpa):
    """q (B, H, Lq, d), k/v (B, Hkv, Lk, d), mask bool (B, 1, Lq, Lk) or broadcastable.

    GQA without copying keys: the H / Hkv query heads that share a kv head become rows of
    one (B, Hkv, G * Lq, d) query, so each key is read once per kv head. (SDPA's
    ``enable_gqa`` falls back to its math backend with a mask, which repeats k and v and
    computes in fp32: a baseline ~20x slower than it needs to be on the H200.)"""
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    q = q.reshape(b, hkv, g * lq, d)  # head kv * g + j, row i -> row j * lq + i
    if g > 1:
        mask = mask.expand(b, 1, lq, mask.shape[-1])
        mask = mask[:, :, None].expand(b, 1, g, lq, mask.shape[-1]).reshape(b, 1, g * lq, -1)
    if use_sdpa:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = (q @ k.transpose(-1, -2)).float() * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        out = probs.to(v.dtype) @ v
    return out.reshape(b, h, lq, d)


class Attention(nn.Module):
    """Causal GQA attention of packed q (T, H, d) over the pool; k_cache/v_cache are set by
    the runner once the pool exists (None: a cache-free forward, prefill only)."""

    def __init__(self, num_heads, num_kv_heads, head_dim, window_left=-1,
                 backend="flashtile"):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.window_left = window_left
        self.backend = backend
        self.k_cache: Optional[Tensor] = None
        self.v_cache: Optional[Tensor] = None
        # The pool rounds what it stores (FP8, set by the runner): every prefill then
        # attends over the pool, as later steps do. Its scales (0-d fp32, the real value
        # of a pool entry is scale * entry) and whether the next step that writes the
        # pool sets them first (calculate_kv_scales).
        self.quantized = False
        self.k_scale: Optional[Tensor] = None
        self.v_scale: Optional[Tensor] = None
        self.calibrate = False

    def forward(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata,
                stored: bool = False) -> Tensor:
        """stored: k and v are in the pool already (rope_store.rope_and_store wrote them
        with the rotary embedding)."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        if self.k_cache is None and (meta.is_decode or meta.has_context):
            raise RuntimeError("attention over earlier keys needs the KV pool: set "
                               "k_cache/v_cache first (ModelRunner does)")
        if self.k_cache is not None and not stored:
            if self.calibrate:
                self.set_scales(k, v)
            store_kv(self.k_cache, self.v_cache, meta.slot_mapping, k, v, self.k_scale,
                     self.v_scale)
        if meta.is_decode:
            return self._decode(q, meta)
        if self.backend == "flashtile":
            # Keys written by earlier steps are read from the pool through the block table;
            # a fresh prefill attends to its own packed k/v (no page lookups), but over an
            # FP8 pool, whose rounded keys every later step sees: so that a prompt's logits
            # do not depend on how it was split into steps.
            paged = meta.has_context or (self.quantized and self.k_cache is not None)
            return flashtile.flash_attn_varlen_func(
                q, self.k_cache if paged else k, self.v_cache if paged else v,
                meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
                softmax_scale=self.scale, causal=True, window_size=(self.window_left, -1),
                block_table=meta.block_tables if paged else None,
                **self._descales(paged))
        if meta.has_context:
            k = self.k_cache.view(flat)[meta.key_slots]
            v = self.v_cache.view(flat)[meta.key_slots]
        return self._prefill_loop(q, k, v, meta)

    def set_scales(self, k: Tensor, v: Tensor) -> None:
        """calculate_kv_scales: this layer's FP8 scales from the keys and values about to
        be stored (on the device, no host read), once."""
        for scale, x, limit in ((self.k_scale, k, K_RANGE), (self.v_scale, v, V_RANGE)):
            amax = x.detach().abs().amax().float() if x.numel() else scale.new_zeros(())
            # An all-zero first step keeps 1.0 (a zero scale would divide by zero).
            scale.copy_(torch.where(amax > 0, amax / limit, 1.0))
        self.calibrate = False

    def _descales(self, paged: bool) -> dict:
        """An FP8 pool's scales as flashtile's descales (where the pool is read)."""
        if not (paged and self.k_cache.dtype.itemsize == 1):
            return {}
        return dict(k_descale=self.k_scale, v_descale=self.v_scale)

    def _decode(self, q, meta):
        if self.backend == "flashtile":
            out = flashtile.flash_attn_with_kvcache(
                q[:, None], self.k_cache, self.v_cache, cache_seqlens=meta.cache_seqlens,
                block_table=meta.block_tables, softmax_scale=self.scale, causal=True,
                window_size=(self.window_left, -1), **self._descales(True))
            return out[:, 0]
        # Every sequence's keys gathered into one (B, Lk, Hkv, d) tensor padded to the
        # longest sequence of the step (a host int: these backends run eagerly); keys past
        # a sequence's length are masked. The naive slab is one page: slice it first so
        # that only Lk keys are copied.
        lk = meta.max_seqlen_k
        pages = -(-lk // self.k_cache.shape[1])
        k, v = ((cache[:, :lk][meta.block_tables[:, 0]] if pages == 1 else
                 cache[meta.block_tables[:, :pages]].flatten(1, 2)[:, :lk])
                for cache in (self.k_cache, self.v_cache))
        q_pos = (meta.cache_seqlens.long() - 1)[:, None, None]              # (B, 1, 1)
        mask = _allowed(q_pos, lk, self.window_left)                        # (B, 1, 1, Lk)
        out = _masked_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), mask,
                                self.scale, self.backend == "sdpa")
        return out[:, :, 0]

    def _prefill_loop(self, q, k, v, meta):
        """sdpa/naive over packed sequences, one at a time (host lengths, no sync)."""
        out = torch.empty_like(q)
        q_start = k_start = 0
        for lq, lk in zip(meta.query_lens, meta.key_lens):
            qs = q[q_start:q_start + lq].transpose(0, 1)[None]          # (1, H, Lq, d)
            ks = k[k_start:k_start + lk].transpose(0, 1)[None]          # (1, Hkv, Lk, d)
            vs = v[k_start:k_start + lk].transpose(0, 1)[None]
            q_pos = torch.arange(lk - lq, lk, device=q.device)
            mask = _allowed(q_pos, lk, self.window_left)
            o = _masked_attention(qs, ks, vs, mask, self.scale, self.backend == "sdpa")
            out[q_start:q_start + lq] = o[0].transpose(0, 1)
            q_start, k_start = q_start + lq, k_start + lk
        return out
