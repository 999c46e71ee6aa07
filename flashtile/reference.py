"""Plain PyTorch attention: the naive oracle and the tiled online-softmax backend.

Both take the flash-attn layout, q (batch, seqlen_q, nheads, head_dim) and k, v
(batch, seqlen_k, nheads_kv, head_dim), and the same mask description as the Triton
kernels (``diag_offset``, ``window_left``, ``window_right``, see ``allowed_keys``), so
the kernels, this backend and the oracle are checked against one definition.

``attention_naive`` materializes the (seqlen_q, seqlen_k) score matrix and works in any
dtype (float64 for the test oracle). ``attention_tiled_fwd``/``attention_tiled_bwd`` walk
K/V block by block with a running max ``m``, running sum ``l`` and an fp32 accumulator,
exactly the FlashAttention recurrence; they are the CPU backend.

``lse`` is the natural-log log-sum-exp of each row's (scaled, capped, biased, masked)
scores; a row that sees no key has ``lse = -inf`` and output 0. A NaN that reaches a
row (through q, a visible key, an ALiBi slope or an additive mask entry) makes its
output and lse NaN, as in torch's SDPA; the empty test is ``l == 0``, which NaN fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG2E = math.log2(math.e)


# ---- Dropout: the kernels' Philox mask in PyTorch (flashtile/ops/_common.py) ----
_M32 = 0xFFFFFFFF
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)


def _mul32(a: int, x):
    """(high, low) 32-bit words of a * x, a < 2**32 and x int64 in [0, 2**32): by 16-bit
    halves of x, so that no int64 product overflows."""
    x_hi, x_lo = x >> 16, x & 0xFFFF
    p_hi, p_lo = a * x_hi, a * x_lo  # < 2**48
    high = (p_hi + (p_lo >> 16)) >> 16
    low = (p_lo + ((p_hi & 0xFFFF) << 16)) & _M32
    return high, low


def philox_words(philox, c0, c1):
    """The four 32-bit words of Philox-4x32-10 (Random123's; Triton's ``tl.philox``, as
    in triton/language/random.py) keyed by philox[0] at counter (c0, c1, philox[1] low,
    philox[1] high), int64 tensors in [0, 2**32). c0, c1: int64 tensors in [0, 2**32)
    broadcast together, on philox's device."""
    seed, offset = philox[0], philox[1]
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0, c1 = torch.broadcast_tensors(c0, c1)
    c2, c3 = (offset & _M32).expand(c0.shape), ((offset >> 32) & _M32).expand(c0.shape)
    for _ in range(10):
        hi_b, lo_b = _mul32(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mul32(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _M32, (k1 + _PHILOX_KEY[1]) & _M32
    return c0, c1, c2, c3


def dropout_threshold(p: float) -> int:
    """The kernels' keep threshold: a 32-bit word r is kept where r >= ceil(p * 2**32),
    p rounded to fp32 as the kernels get it (``_common._dropout_keep``); 2**32 - 1 where
    that rounding reaches 1.0 (a float-to-integer conversion saturates on the GPU)."""
    p32 = float(torch.tensor(p, dtype=torch.float32))
    return min(math.ceil(p32 * 2**32), _M32)


@dataclass(frozen=True)
class Dropout:
    """A call's dropout mask (flash-attn 2's semantics: P dropped after the softmax,
    the kept entries scaled by 1 / (1 - p)), as the kernels draw it
    (``_common._dropout_setup``, ``_dropout_keep``): query i and key j of batch entry b,
    head h take word 2 * (bit 3 of i) + (bit 3 of j) of the Philox call at counter
    (j & ~8, row0[b, h] + (i & ~8)), kept where it is >= ``dropout_threshold(p)``.

    philox: int64 (2,) [seed, offset]; p: the dropout probability; row0: int64 (b, h,
    1, 1), the row counter of each (sequence, head)'s query 0."""

    philox: torch.Tensor
    p: float
    row0: torch.Tensor

    @classmethod
    def dense(cls, philox, p, batch, nheads, seqlen_q):
        bh = torch.arange(batch * nheads, device=philox.device).view(batch, nheads, 1, 1)
        return cls(philox, p, bh * seqlen_q)

    @classmethod
    def varlen(cls, philox, p, nheads, total_q, q_start):
        """Packed sequences whose rows start at q_start in q (an int, or a (batch, 1, 1,
        1) tensor for several sequences at once); keys count from their sequence's
        start."""
        h = torch.arange(nheads, device=philox.device).view(1, nheads, 1, 1)
        return cls(philox, p, h * total_q + q_start)

    def words(self, rows, cols):
        """Int64 (b, h, len(rows), len(cols)) in [0, 2**32): the Philox word of P[i, j]."""
        i = rows.to(self.philox.device)[:, None]
        j = cols.to(self.philox.device)
        w0, w1, w2, w3 = philox_words(self.philox, j & ~8, self.row0 + (i & ~8))
        q_hi, k_hi = (i & 8) != 0, (j & 8) != 0
        return torch.where(q_hi, torch.where(k_hi, w3, w2), torch.where(k_hi, w1, w0))

    def keep(self, rows, cols):
        """Bool (b, h, len(rows), len(cols)): True where P[i, j] is kept."""
        return self.words(rows, cols) >= dropout_threshold(self.p)


def allowed_keys(seqlen_q, seqlen_k, diag_offset, window_left, window_right, device,
                 rows=None, cols=None):
    """Boolean (rows, cols) mask of the keys each query may see.

    Query i sits on the diagonal at key ``i + diag_offset``; it sees keys j with
    ``i + diag_offset - window_left <= j <= i + diag_offset + window_right``,
    where a negative window bound means unbounded. Causal is ``window_right = 0``;
    flash-attn aligns it bottom-right (``diag_offset = seqlen_k - seqlen_q``), torch's
    SDPA top-left (``diag_offset = 0``).
    """
    if rows is None:
        rows = torch.arange(seqlen_q, device=device)
    if cols is None:
        cols = torch.arange(seqlen_k, device=device)
    rel = cols[None, :] - rows[:, None] - diag_offset  # (rows, cols): j - (i + offset)
    ok = cols[None, :] < seqlen_k
    ok = ok & (rows[:, None] < seqlen_q)
    if window_right >= 0:
        ok = ok & (rel <= window_right)
    if window_left >= 0:
        ok = ok & (rel >= -window_left)
    return ok


def _expand_kv(x, nheads):
    """(b, s, hkv, d) -> (b, s, h, d) by repeating each KV head over its query group."""
    group = nheads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def alibi_of_sequence(alibi_slopes, b):
    """The slopes that apply to batch entry b: (nheads,) slopes are shared, (batch,
    nheads) ones are per sequence. Used where sequences are attended one at a time."""
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[b]


def gather_pages(cache, block_row, start, stop):
    """Keys [start, stop) of one sequence of a paged pool, contiguous (stop - start,
    nheads_kv, head_dim). cache: (num_blocks, page_size, nheads_kv, head_dim); key j
    lives in block ``block_row[j // page_size]`` at row ``j % page_size``."""
    pos = torch.arange(start, stop, device=cache.device)
    page_size = cache.shape[1]
    return cache[block_row.long()[pos // page_size], pos % page_size]


def _alibi_bias(alibi_slopes, batch, nheads, rows, cols, diag_offset, dtype):
    """-slope * |i + diag_offset - j|, shape (batch, nheads, rows, cols)."""
    slopes = alibi_slopes.to(dtype)
    if slopes.dim() == 1:
        slopes = slopes[None].expand(batch, nheads)
    dist = (rows[:, None] + diag_offset - cols[None, :]).abs().to(dtype)
    return -slopes[:, :, None, None] * dist


def _scores(q, k, rows, cols, *, softmax_scale, softcap, alibi_slopes, attn_mask,
            diag_offset, window_left, window_right, seqlen_q, seqlen_k, dtype):
    """Scaled, capped, biased and masked scores (b, h, rows, cols) in ``dtype``."""
    s = torch.einsum("bihd,bjhd->bhij", q.to(dtype), k.to(dtype)) * softmax_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + _alibi_bias(alibi_slopes, q.shape[0], q.shape[2], rows, cols,
                            diag_offset, dtype)
    ok = allowed_keys(seqlen_q, seqlen_k, diag_offset, window_left, window_right,
                      q.device, rows, cols)
    if attn_mask is not None:
        m = attn_mask[..., rows[:, None], cols[None, :]]
        if m.dtype == torch.bool:
            ok = ok & m
        else:
            s = s + m.to(dtype)
    return s.masked_fill(~ok, float("-inf"))


def attention_naive(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, attn_mask=None, diag_offset=None,
                    upcast=True, dropout_p=0.0, dropout_mask=None):
    """Three-pass attention with the score matrix in memory: the test oracle.

    Returns ``(out, lse)``; ``out`` in q's dtype (or float64 when ``upcast``),
    ``lse`` (batch, nheads, seqlen_q). ``diag_offset`` defaults to flash-attn's
    bottom-right alignment, ``seqlen_k - seqlen_q``. Differentiable by autograd.
    dropout_mask: bool, broadcastable to (batch, nheads, seqlen_q, seqlen_k), True
    where P is kept; kept entries are scaled by 1 / (1 - dropout_p); lse is undropped.
    """
    b, sq, h, d = q.shape
    sk = k.shape[1]
    dtype = torch.float64 if upcast else q.dtype
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if diag_offset is None:
        diag_offset = sk - sq
    left, right = window_size
    if causal:
        right = 0
    if attn_mask is not None:
        attn_mask = attn_mask.expand(b, h, sq, sk)
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    rows = torch.arange(sq, device=q.device)
    cols = torch.arange(sk, device=q.device)
    s = _scores(q, k, rows, cols, softmax_scale=softmax_scale, softcap=softcap,
                alibi_slopes=alibi_slopes, attn_mask=attn_mask, diag_offset=diag_offset,
                window_left=left, window_right=right, seqlen_q=sq, seqlen_k=sk,
                dtype=dtype)
    if sk == 0:  # no key at all: every row is empty
        m = s.new_full((*s.shape[:-1], 1), float("-inf"))
    else:
        m = s.amax(dim=-1, keepdim=True)                   # pass 1: row max
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows that see nothing
    p = torch.exp(s - m)                                   # pass 2: exp
    l = p.sum(dim=-1, keepdim=True)                        # pass 3: sum
    # Empty rows (l == 0) are 0 and -inf; a NaN that reached a row keeps it NaN.
    empty = l == 0
    p = p / torch.where(empty, 1.0, l)
    if dropout_mask is not None:
        p = torch.where(dropout_mask, p / (1.0 - dropout_p), 0.0)
    out = p @ v.to(dtype).transpose(1, 2)
    out = torch.where(empty, 0.0, out).transpose(1, 2)
    lse = (torch.log(l) + m).squeeze(-1)
    return (out if upcast else out.to(q.dtype)), lse.float() if not upcast else lse


def sdpa_math_bshd(causal):
    """PyTorch's SDPA forced to its math backend, on (batch, seqlen, heads, dim) inputs:
    torch's own error at a dtype, the yardstick of the accuracy rule below. (Its causal
    mask is top-left aligned: the callers use seqlen_q == seqlen_k, where that is
    flash-attn's bottom-right.)"""
    from torch.nn.attention import SDPBackend

    return sdpa_bshd(causal, SDPBackend.MATH)


def sdpa_bshd(causal, backend):
    """PyTorch's SDPA forced to ``backend`` (an SDPBackend), on (batch, seqlen, heads,
    dim) inputs; the causal mask as in ``sdpa_math_bshd``."""
    from torch.nn.attention import sdpa_kernel

    def attn(q, k, v):
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
        return out.transpose(1, 2)
    return attn


# The accuracy rule (the demo's and the tile study's): flashtile's error against float64
# may be at most 2x torch's own error at the same dtype plus a floor, scaled by
# max(1, |reference|): about 1000 fp32 ulps, a few bf16/fp16 rounding steps of a value
# near 1 after a long sum.
ERROR_FLOOR = {torch.float32: 1e-4, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def max_abs_error(x, ref) -> float:
    return (x.double() - ref.double()).abs().max().item()


def error_bound(torch_err: float, ref, dtype) -> float:
    return 2 * torch_err + ERROR_FLOOR[dtype] * max(1.0, ref.abs().max().item())


def _finish(acc, m, l):
    """out = acc / l and lse = m + log(l), with (0, -inf) for a row that saw no key.

    Empty means l == 0 exactly, so a NaN that reached the row (l is then NaN) stays NaN
    in out and lse instead of passing for an empty row; an empty row is 0 even where its
    key block held a NaN value (0 * NaN in acc)."""
    empty = l == 0
    l_safe = torch.where(empty, 1.0, l)
    out = torch.where(empty[..., None], 0.0, acc / l_safe[..., None])
    return out, torch.where(empty, float("-inf"), m + torch.log(l_safe))


def _kv_block(x, start, stop, nheads):
    return _expand_kv(x[:, start:stop], nheads)


def attention_tiled_fwd(q, k, v, *, softmax_scale, diag_offset, window_left, window_right,
                        softcap, alibi_slopes, attn_mask, dropout=None, block_n=128):
    """FlashAttention forward in PyTorch: K/V in column blocks, online softmax.

    Vectorized over batch, heads and query rows; fp32 (or float64) accumulation.
    Returns ``out`` (q's dtype, shape of q) and ``lse`` (batch, nheads, seqlen_q) fp32.
    dropout: a ``Dropout`` or None, applied as in the Triton kernel.
    """
    b, sq, h, d = q.shape
    sk = k.shape[1]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = torch.arange(sq, device=q.device)
    m_i = torch.full((b, h, sq), float("-inf"), dtype=acc_dtype, device=q.device)
    l_i = torch.zeros((b, h, sq), dtype=acc_dtype, device=q.device)
    acc = torch.zeros((b, h, sq, v.shape[-1]), dtype=acc_dtype, device=q.device)
    for start in range(0, sk, block_n):
        stop = min(start + block_n, sk)
        cols = torch.arange(start, stop, device=q.device)
        s = _scores(q, _kv_block(k, start, stop, h), rows, cols,
                    softmax_scale=softmax_scale, softcap=softcap,
                    alibi_slopes=alibi_slopes, attn_mask=attn_mask,
                    diag_offset=diag_offset, window_left=window_left,
                    window_right=window_right, seqlen_q=sq, seqlen_k=sk, dtype=acc_dtype)
        m_new = torch.maximum(m_i, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m_i - m_safe)
        l_i = l_i * alpha + p.sum(dim=-1)
        if dropout is not None:  # after l: the lse is undropped
            p = torch.where(dropout.keep(rows, cols), p, 0.0)
        vb = _kv_block(v, start, stop, h).to(acc_dtype).transpose(1, 2)  # (b, h, n, d)
        acc = acc * alpha[..., None] + p.to(q.dtype).to(acc_dtype) @ vb
        m_i = m_new
    out, lse = _finish(acc, m_i, l_i)
    if dropout is not None:
        out = out * (1.0 / (1.0 - dropout.p))
    return out.transpose(1, 2).to(q.dtype), lse.float()


def attention_tiled_bwd(dout, q, k, v, out, lse, dlse, *, softmax_scale, diag_offset,
                        window_left, window_right, softcap, alibi_slopes, attn_mask,
                        dropout=None, block_n=128):
    """FlashAttention backward in PyTorch: recompute P block by block from ``lse``.

    ``delta = rowsum(dout * out) - dlse`` turns the gradient of the output (and of the
    lse, when it was used) into dS = P * (dP - delta). dK/dV are summed over each KV
    head's query group. Returns (dq, dk, dv) in the input dtypes. With ``dropout``
    (O = (P * Z) V, Z the kept entries times 1 / (1 - p)): dV = (P * Z)^T dO and dP is
    (dO V^T) * Z; delta is unchanged, rowsum(P * dP) being rowsum(dO * O).
    """
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = torch.arange(sq, device=q.device)
    do = dout.to(acc_dtype).transpose(1, 2)  # (b, h, sq, d)
    delta = (do * out.to(acc_dtype).transpose(1, 2)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(acc_dtype)
    lse_safe = torch.where(torch.isinf(lse), float("inf"), lse).to(acc_dtype)
    qf = q.to(acc_dtype).transpose(1, 2)
    dq = torch.zeros_like(qf)
    dk = torch.zeros((b, sk, hkv, d), dtype=acc_dtype, device=q.device)
    dv = torch.zeros((b, sk, hkv, v.shape[-1]), dtype=acc_dtype, device=q.device)
    for start in range(0, sk, block_n):
        stop = min(start + block_n, sk)
        cols = torch.arange(start, stop, device=q.device)
        kb = _kv_block(k, start, stop, h)
        s_raw = torch.einsum("bihd,bjhd->bhij", q.to(acc_dtype), kb.to(acc_dtype))
        s = _scores(q, kb, rows, cols, softmax_scale=softmax_scale, softcap=softcap,
                    alibi_slopes=alibi_slopes, attn_mask=attn_mask,
                    diag_offset=diag_offset, window_left=window_left,
                    window_right=window_right, seqlen_q=sq, seqlen_k=sk, dtype=acc_dtype)
        p = torch.exp(s - lse_safe[..., None])
        vb = _kv_block(v, start, stop, h).to(acc_dtype).transpose(1, 2)
        dp = do @ vb.transpose(-1, -2)
        if dropout is not None:
            z = torch.where(dropout.keep(rows, cols), 1.0 / (1.0 - dropout.p), 0.0)
            dv_h = (p * z).transpose(-1, -2) @ do
            dp = dp * z
        else:
            dv_h = p.transpose(-1, -2) @ do                    # (b, h, n, d)
        ds = p * (dp - delta[..., None])
        if softcap > 0:
            t = torch.tanh(s_raw * softmax_scale / softcap)
            ds = ds * (1 - t * t)
        ds = ds * softmax_scale
        dq += ds @ kb.to(acc_dtype).transpose(1, 2)
        dk_h = ds.transpose(-1, -2) @ qf
        group = h // hkv
        dk[:, start:stop] += dk_h.reshape(b, hkv, group, stop - start, d).sum(2).transpose(1, 2)
        dv[:, start:stop] += dv_h.reshape(b, hkv, group, stop - start,
                                          dv.shape[-1]).sum(2).transpose(1, 2)
    return dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge_attention_states_ref(out_a, lse_a, out_b, lse_b, return_lse=True):
    """PyTorch ``flashtile.merge_attention_states``: same arguments, no validation.

    out_a, out_b (batch, seqlen, nheads, head_dim); lse_a, lse_b (batch, nheads, seqlen)
    natural-log. Computes in fp32 (float64 if out_a is float64, for the test oracle);
    returns out, contiguous in out_a's dtype, and lse (batch, nheads, seqlen) float32
    (float64 for the oracle). A side with lse -inf contributes nothing; both -inf give
    out 0 and lse -inf; a NaN lse, or a NaN in a side that has weight, gives NaN (the
    tests are ``== 0``, which NaN fails, never ``> 0``, which it would pass as empty).
    Differentiable by autograd: the shift ``m`` is detached because
    the result does not depend on it, which also keeps NaN out of the gradient of empty
    rows.
    """
    acc_dtype = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    lse_a, lse_b = lse_a.to(acc_dtype), lse_b.to(acc_dtype)
    m = torch.maximum(lse_a, lse_b).detach()
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    empty = total == 0
    total_safe = torch.where(empty, torch.ones_like(total), total)
    scale_a = (w_a / total_safe).transpose(1, 2)[..., None]  # (batch, seqlen, nheads, 1)
    scale_b = (w_b / total_safe).transpose(1, 2)[..., None]
    zero = torch.zeros((), dtype=acc_dtype, device=out_a.device)
    out = (torch.where(scale_a == 0, zero, out_a.to(acc_dtype) * scale_a)
           + torch.where(scale_b == 0, zero, out_b.to(acc_dtype) * scale_b))
    out = out.to(out_a.dtype).contiguous()
    if not return_lse:
        return out
    lse = torch.where(empty, float("-inf"), m + torch.log(total_safe))
    return out, lse.contiguous()
