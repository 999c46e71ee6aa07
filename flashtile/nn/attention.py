"""flashtile.nn.Attention: the attention block of a transformer, for model builders.

Parameters only (Liger's thin-layer rule): the fused QKV projection ``qkv_proj`` (rows:
the query heads, then the key heads, then the value heads), ``o_proj``, and with
``qk_norm`` the per-head RMSNorms ``q_norm``/``k_norm`` (Qwen3's and Gemma 3's). The
attention itself is ``flash_attn_func``, ``flash_attn_varlen_func`` (packed sequences)
or ``flash_attn_with_kvcache`` (decoding).
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from flashtile import _validate as V
from flashtile.inference import flash_attn_with_kvcache, rotate
from flashtile.interface import flash_attn_func, flash_attn_varlen_func


def _positive_int(x, name):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        V._fail(ValueError, name, "an int >= 1", x)
    return int(x)


class Attention(nn.Module):
    """Multi-head attention with GQA, rotary embedding, optional q/k RMSNorm, sliding
    window and softcap, computed by flashtile.

    Arguments:
        embed_dim: model width E (input and output features).
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA/MQA), a divisor of num_heads; default
            num_heads.
        head_dim: default embed_dim // num_heads (which must then divide exactly);
            1 to 256.
        bias: bias in the QKV projection (Qwen2). out_bias: bias in o_proj.
        causal: bool, flash-attn's bottom-right alignment: with a KV cache, query i of
            n new tokens sees the cached keys and new keys up to itself.
        window_size: (left, right), flash-attn's sliding window; -1 = unbounded.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) (Gemma 2).
        softmax_scale: default 1 / sqrt(head_dim).
        rotary_dim: None for no rotary embedding, else an even number <= head_dim: the
            first rotary_dim dims of each q/k head are rotated by its position.
        rope_theta: the rotary base. rotary_interleaved: False rotates the two halves
            (GPT-NeoX, Llama), True the pairs (0, 1), (2, 3), ... (GPT-J).
        qk_norm: RMSNorm (eps norm_eps, weight over head_dim) of each q and k head
            before the rotary embedding.
        dropout: attention dropout probability in [0, 1), applied in training mode only
            (as torch.nn.MultiheadAttention's): flash_attn_func's dropout_p, whose
            Philox mask is seeded from PyTorch's generator (torch.manual_seed makes it
            reproducible). Decoding with kv_cache has no dropout: it needs eval mode
            or dropout=0.0.
        device, dtype: of the parameters.

    forward(x, *, cu_seqlens=None, max_seqlen=None, kv_cache=None, cache_seqlens=None,
    block_table=None) -> out:
        x: (batch, seqlen, embed_dim); out has x's shape.
        Packed sequences: x (total, embed_dim) with cu_seqlens (batch + 1,) int32 and
            max_seqlen (int); positions restart at 0 in each sequence.
        Decoding: kv_cache = (k_cache, v_cache), this layer's cache tensors
            (batch_cache, max_cache_len, num_kv_heads, head_dim), e.g. ``cache.k_cache[i],
            cache.v_cache[i]`` of a ``flashtile.kv_cache.KVCache``, or a paged pool
            (num_blocks, page_size, num_kv_heads, head_dim) with block_table;
            cache_seqlens: int or int32 (batch,), the tokens already cached per sequence.
            The new tokens sit at positions cache_seqlens[b] + i: their rotated keys and
            their values are written there (in place) and attended to with the cache.
            The caller advances cache_seqlens by seqlen after all layers ran. Inference
            only: call it under torch.no_grad() or torch.inference_mode().
    """

    def __init__(self, embed_dim, num_heads, num_kv_heads=None, head_dim=None, *,
                 bias=False, out_bias=False, causal=False, window_size=(-1, -1),
                 softcap=0.0, softmax_scale=None, rotary_dim=None, rope_theta=10000.0,
                 rotary_interleaved=False, qk_norm=False, norm_eps=1e-6, dropout=0.0,
                 device=None, dtype=None):
        super().__init__()
        embed_dim = _positive_int(embed_dim, "embed_dim")
        num_heads = _positive_int(num_heads, "num_heads")
        num_kv_heads = num_heads if num_kv_heads is None else _positive_int(
            num_kv_heads, "num_kv_heads")
        if num_heads % num_kv_heads:
            V._fail(ValueError, "num_kv_heads", f"a divisor of num_heads={num_heads}",
                    num_kv_heads)
        if head_dim is None:
            if embed_dim % num_heads:
                V._fail(ValueError, "embed_dim", f"a multiple of num_heads={num_heads} "
                        "when head_dim is not given", embed_dim)
            head_dim = embed_dim // num_heads
        head_dim = _positive_int(head_dim, "head_dim")
        if head_dim > V.MAX_HEAD_DIM:
            V._fail(ValueError, "head_dim", f"at most {V.MAX_HEAD_DIM}", head_dim)
        if rotary_dim is not None and (isinstance(rotary_dim, bool) or not isinstance(
                rotary_dim, numbers.Integral) or rotary_dim < 2 or rotary_dim % 2
                or rotary_dim > head_dim):
            V._fail(ValueError, "rotary_dim", f"None or an even int from 2 to head_dim="
                    f"{head_dim}", rotary_dim)
        V.check_bools(bias=bias, out_bias=out_bias, causal=causal,
                      rotary_interleaved=rotary_interleaved, qk_norm=qk_norm)
        self.window_size = V.check_window(window_size)
        V.check_float(softcap, "softcap", minimum=0.0)
        V.check_softmax_scale(softmax_scale)
        V.check_float(rope_theta, "rope_theta", minimum=1.0)
        V.check_dropout(dropout, "dropout")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim, self.causal, self.softcap = head_dim, causal, float(softcap)
        self.softmax_scale = softmax_scale
        self.rotary_dim, self.rope_theta = rotary_dim, float(rope_theta)
        self.rotary_interleaved = rotary_interleaved
        self.dropout = float(dropout)
        kw = {"device": device, "dtype": dtype}
        self.qkv_proj = nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * head_dim,
                                  bias=bias, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=out_bias, **kw)
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps, **kw) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps, **kw) if qk_norm else None
        if rotary_dim is not None:
            # Non-persistent: derived from rope_theta, never in a state dict.
            self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)

    def _inv_freq(self, device):
        d = self.rotary_dim
        return 1.0 / self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                      device=device) / d)

    def reset_parameters(self):
        """Re-initialise the weights (and the rotary frequencies, e.g. after building
        on the meta device and ``to_empty``)."""
        for m in (self.qkv_proj, self.o_proj, self.q_norm, self.k_norm):
            if m is not None:
                m.reset_parameters()
        if self.rotary_dim is not None:
            self.inv_freq.copy_(self._inv_freq(self.inv_freq.device))

    def _qkv(self, x, positions):
        """q (.., num_heads, head_dim), k and v (.., num_kv_heads, head_dim) of x
        (.., embed_dim), normed and rotated at positions (x's leading shape)."""
        h, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).unflatten(-1, (h + 2 * hkv, self.head_dim))
        q, k, v = qkv.split([h, hkv, hkv], dim=-2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim is not None:
            angles = positions[..., None].float() * self.inv_freq      # (.., rotary_dim/2)
            cos, sin = angles.cos(), angles.sin()
            if x.dim() == 2:  # packed: rotate takes (batch, seqlen, heads, dim)
                q, k, cos, sin = q[None], k[None], cos[None], sin[None]
            q, k = (rotate(t, cos, sin, self.rotary_interleaved) for t in (q, k))
            if x.dim() == 2:
                q, k = q[0], k[0]
        return q, k, v

    def _options(self):
        return dict(softmax_scale=self.softmax_scale, causal=self.causal,
                    window_size=self.window_size, softcap=self.softcap)

    def _dropout_p(self):
        return self.dropout if self.training else 0.0

    def forward(self, x, *, cu_seqlens=None, max_seqlen=None, kv_cache=None,
                cache_seqlens=None, block_table=None):
        rank = 2 if cu_seqlens is not None else 3
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            expected = "(total, embed_dim) with cu_seqlens" if rank == 2 else \
                "(batch, seqlen, embed_dim)"
            V._fail(ValueError, "x", expected, getattr(x, "shape", type(x).__name__))
        if x.shape[-1] != self.embed_dim:
            V._fail(ValueError, "x.shape[-1]", f"embed_dim={self.embed_dim}", x.shape[-1])
        if kv_cache is not None:
            return self._decode(x, cu_seqlens, kv_cache, cache_seqlens, block_table)
        for value, name in ((cache_seqlens, "cache_seqlens"), (block_table, "block_table")):
            if value is not None:
                V._fail(ValueError, name, "None without kv_cache", "a value")
        if cu_seqlens is not None:
            if max_seqlen is None:
                V._fail(ValueError, "max_seqlen", "an int with cu_seqlens", None)
            if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
                    or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
                V._fail(ValueError, "cu_seqlens", "an int32 tensor (batch + 1,)",
                        getattr(cu_seqlens, "shape", type(cu_seqlens).__name__))
            tokens = torch.arange(x.shape[0], device=x.device, dtype=cu_seqlens.dtype)
            # Sequence of each token; a zero-length sequence owns none (right=True).
            seq = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
            starts = cu_seqlens[seq.clamp(max=cu_seqlens.numel() - 2)]
            q, k, v = self._qkv(x, tokens - starts)
            out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen,
                                         max_seqlen, dropout_p=self._dropout_p(),
                                         **self._options())
        else:
            if max_seqlen is not None:
                V._fail(ValueError, "max_seqlen", "None without cu_seqlens", max_seqlen)
            positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[:2])
            q, k, v = self._qkv(x, positions)
            out = flash_attn_func(q, k, v, dropout_p=self._dropout_p(), **self._options())
        return self.o_proj(out.flatten(-2))

    def _decode(self, x, cu_seqlens, kv_cache, cache_seqlens, block_table):
        if cu_seqlens is not None:
            V._fail(ValueError, "cu_seqlens", "None with kv_cache (the cache path takes "
                    "(batch, seqlen, embed_dim) inputs)", "a tensor")
        if torch.is_grad_enabled() and (x.requires_grad or any(
                p.requires_grad for p in self.parameters())):
            raise NotImplementedError(
                "Attention with kv_cache is inference only (flash_attn_with_kvcache has "
                "no backward): call it under torch.no_grad() or torch.inference_mode()")
        if self._dropout_p() > 0.0:
            V._fail(ValueError, "dropout", "0.0 with kv_cache in training mode (decoding "
                    "has no dropout)", self.dropout, "Call .eval() before decoding")
        if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
            V._fail(TypeError, "kv_cache", "a pair (k_cache, v_cache) of tensors",
                    type(kv_cache).__name__)
        if cache_seqlens is None:
            V._fail(ValueError, "cache_seqlens", "an int or an int32 tensor (batch,) with "
                    "kv_cache", None)
        batch, seqlen = x.shape[:2]
        if isinstance(cache_seqlens, numbers.Integral) and \
                not isinstance(cache_seqlens, bool):
            cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32,
                                       device=x.device)
        if not isinstance(cache_seqlens, torch.Tensor):
            V._fail(TypeError, "cache_seqlens", "an int or an int32 tensor (batch,)",
                    type(cache_seqlens).__name__)
        positions = cache_seqlens.long()[:, None] + torch.arange(seqlen, device=x.device)
        q, k, v = self._qkv(x, positions)
        out = flash_attn_with_kvcache(q, kv_cache[0], kv_cache[1], k, v,
                                      cache_seqlens=cache_seqlens, block_table=block_table,
                                      **self._options())
        return self.o_proj(out.flatten(-2))

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads="
                f"{self.num_kv_heads}, head_dim={self.head_dim}, causal={self.causal}, "
                f"window_size={self.window_size}, softcap={self.softcap}, rotary_dim="
                f"{self.rotary_dim}, dropout={self.dropout}")
