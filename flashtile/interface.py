"""Public attention functions: flash-attn's names and arguments, and an SDPA drop-in.

Every function validates its input (``flashtile._validate``), turns causal/window/layout
into one mask description (``diag_offset``, ``window_left``, ``window_right``) and calls
``custom_ops.attention``: the ``flashtile::attn_fwd`` custom op under torch.compile (no
graph break), the same implementation as an autograd.Function in eager mode.
"""

from __future__ import annotations

import functools
import math

import torch

from flashtile import _validate as V
from flashtile import custom_ops, reference
from flashtile import fp8 as F8


@torch.compiler.assume_constant_result
def _tf32_allowed() -> bool:
    # Read once per compiled graph (a recompile follows a change), like torch's own flags.
    return torch.get_float32_matmul_precision() != "highest"


def _allow_tf32(dtype) -> bool:
    # fp32 keeps fp32's accuracy (tf32x3 products, or IEEE ones: configs.fp32_products)
    # unless the user allowed TF32 the PyTorch way: set_float32_matmul_precision("high")
    # or ("medium").
    return dtype == torch.float32 and _tf32_allowed()


# flash_attn_func's check of q, k and v reads their layouts only: once per combination.
_check_qkv = V.once_per_layout(functools.partial(V.check_qkv, dtypes=V.WITH_FP8))
# flash_attn_varlen_func's checks read the layouts of q, k, v and the index tensors, and
# the values of max_seqlen_q/k (their range; paged, max_seqlen_k against the block
# table's reach) and nothing else: the layouts once per combination, with max_seqlen 0,
# which passes every check of a value, each value checked per call (_check_varlen).
_check_varlen_layouts = V.once_per_layout(
    lambda q, k, v, cu_seqlens_q, cu_seqlens_k: V.check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, 0, 0, dtypes=V.WITH_FP8))
_check_paged_varlen_layouts = V.once_per_layout(
    lambda q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k:
    V.check_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, 0, 0, block_table,
                         seqused_k, dtypes=V.WITH_FP8))


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  block_table, seqused_k):
    """V.check_varlen, or V.check_paged_varlen with a block_table: ((batch, h, hkv, d),
    the id of the checked layouts or None), the id as once_per_layout's with_id gives
    it. An engine calls it in every layer of a prefill step with the layouts of the
    layer before (issue 15), so when the values pass (both max_seqlen ints in range,
    paged max_seqlen_k within the block table's reach) the layouts' part comes from the
    memo; any other value (out of range, not an int, an int-like such as a SymInt)
    takes the whole check, which raises what it raised before, in its order."""
    in_range = (type(max_seqlen_q) is int and type(max_seqlen_k) is int
                and 0 <= max_seqlen_q <= V.MAX_OFFSET and 0 <= max_seqlen_k <= V.MAX_OFFSET)
    if block_table is None:
        if in_range:
            return _check_varlen_layouts.with_id(q, k, v, cu_seqlens_q, cu_seqlens_k)
        return V.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, dtypes=V.WITH_FP8), None
    if in_range:
        checked = _check_paged_varlen_layouts.with_id(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                      block_table, seqused_k)
        # The keys a block table row can name (what check_paged_varlen compares).
        if max_seqlen_k <= block_table.shape[1] * k.shape[1]:
            return checked
    return V.check_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, block_table, seqused_k,
                                dtypes=V.WITH_FP8), None


def _philox(q, dropout_p):
    """The dropout mask's Philox key, int64 [seed, offset] on q's device, drawn from
    PyTorch's default generator of that device (None without dropout).

    A device tensor the kernels load, not Python ints: torch.manual_seed makes runs
    reproducible, nothing is read on the host (no sync), and under CUDA-graph capture
    the draw is recorded like any PyTorch RNG op, whose generator advances its Philox
    offset at every replay, so each replay gets a fresh mask (a seed read on the host
    would be frozen into the graph). The autograd context saves it for the backward,
    which regenerates the same mask from it (``flashtile.ops._common._dropout_setup``)."""
    if dropout_p == 0.0:
        return None
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device=q.device)


def _attention(q, k, v, *, attn_mask, alibi_slopes, softmax_scale, diag_offset,
               window_left, window_right, softcap, deterministic=False, dropout_p=0.0,
               philox=None, return_lse=True, layout=None):
    """(out, lse); with return_lse=False lse may be None (custom_ops.attention, as is
    layout)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    # torch.sym_int, not int(): under torch.export int() of a symbolic size specializes
    # it (seqlen_k - seqlen_q would be frozen to the example's difference).
    if type(diag_offset) is not int:
        diag_offset = torch.sym_int(diag_offset)
    return custom_ops.attention(q, k, v, attn_mask, alibi_slopes, float(softmax_scale),
                               diag_offset, window_left, window_right,
                               float(softcap), _allow_tf32(q.dtype), deterministic,
                               float(dropout_p), philox, return_lse, layout)


# return_attn_probs (flash-attn's name): flash-attn then returns (out, softmax_lse,
# S_dmask), where S_dmask holds probabilities only when dropout is on, for its own tests,
# and encodes the dropout pattern in its sign. flashtile returns the exact probabilities
# (undropped, unscaled) as a test aid, with the same sign code when dropout_p > 0:
# dropped entries negated, so ``~torch.signbit(probs)`` is the mask the kernels applied
# (a dropped 0 is -0.0). Dense, so only for small problems.
ATTN_PROBS_MAX_ELEMENTS = 2**24  # 64 MiB of float32 probabilities


def _check_probs_size(batch, nheads, seqlen_q, seqlen_k):
    n = batch * nheads * seqlen_q * seqlen_k
    if n > ATTN_PROBS_MAX_ELEMENTS:
        V._fail(ValueError, "return_attn_probs", "batch * nheads * seqlen_q * seqlen_k <= "
                f"ATTN_PROBS_MAX_ELEMENTS = {ATTN_PROBS_MAX_ELEMENTS} (the probabilities "
                "are a dense test aid)",
                f"{batch} * {nheads} * {seqlen_q} * {seqlen_k} = {n}",
                "Use return_lse=True for the log-sum-exp alone")


@torch.no_grad()
def _attn_probs(q, k, rows, cols, seqlen_q, seqlen_k, *, softmax_scale, softcap,
                alibi_slopes, window_left, window_right):
    """softmax(scores) as float32 (batch, nheads, len(rows), len(cols)), from the
    reference's scores (the one definition of scale, softcap, ALiBi and masks) in float64.
    seqlen_q/seqlen_k are ints or (batch, 1, 1, 1) tensors (varlen); a row that sees no
    key is 0, as its output is."""
    if cols.numel() == 0:
        return q.new_zeros((q.shape[0], q.shape[2], rows.numel(), 0), dtype=torch.float32)
    s = reference._scores(q, reference._expand_kv(k, q.shape[2]), rows, cols,
                          softmax_scale=softmax_scale, softcap=softcap,
                          alibi_slopes=alibi_slopes, attn_mask=None,
                          diag_offset=seqlen_k - seqlen_q, window_left=window_left,
                          window_right=window_right, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                          dtype=torch.float64)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
    l = p.sum(dim=-1, keepdim=True)
    return (p / torch.where(l == 0, 1.0, l)).float()


def _sign_dropped(probs, dropout, rows, cols):
    """probs with the entries that ``dropout`` (a reference.Dropout) drops negated."""
    return torch.where(dropout.keep(rows, cols).to(probs.device), probs, -probs)


def _varlen_attn_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    """(batch, nheads, max_seqlen_q, max_seqlen_k): sequence b's probabilities in the top
    left corner of [b], zeros around them. Pads by gathering (no host read, so it also
    traces under torch.compile)."""
    batch = cu_seqlens_q.numel() - 1
    rows = torch.arange(max_seqlen_q, device=q.device)
    cols = torch.arange(max_seqlen_k, device=q.device)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return q.new_zeros((batch, q.shape[1], max_seqlen_q, max_seqlen_k),
                           dtype=torch.float32)
    starts_q, starts_k = cu_seqlens_q[:-1].long(), cu_seqlens_k[:-1].long()
    # Rows past a sequence's end read a neighbour's (clamped) rows; the masks drop them.
    # Clamped at 0 too: prefix sums are not read on the host, a bad one must not index.
    q_pad = q[(starts_q[:, None] + rows).clamp(0, q.shape[0] - 1)]  # (b, max_q, h, d)
    k_pad = k[(starts_k[:, None] + cols).clamp(0, k.shape[0] - 1)]  # (b, max_k, hkv, d)
    lengths = [(cu[1:] - cu[:-1]).long().view(batch, 1, 1, 1)
               for cu in (cu_seqlens_q, cu_seqlens_k)]
    return _attn_probs(q_pad, k_pad, rows, cols, *lengths, **kw)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False, *, return_lse=False,
                    q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """Exact attention, softmax(q k^T * softmax_scale) v, in flash-attn's layout.

    Arguments:
        q: (batch, seqlen_q, nheads, head_dim), float16, bfloat16 or float32, or FP8
            (float8_e4m3fn, float8_e5m2; forward only, see q_descale).
        k, v: (batch, seqlen_k, nheads_kv, head_dim), same dtype and device as q.
            nheads must be a multiple of nheads_kv (GQA/MQA); K/V are never copied.
            head_dim is any value from 1 to 512 (FP8: 256; padded inside the
            kernel); v's may differ from q's and k's (MLA, e.g. 192/128), and out
            then takes v's.
            Any strides work as long as the last dim is contiguous.
        dropout_p: float in [0, 1): attention dropout, as flash-attn 2 (training): the
            probabilities P are dropped after the softmax with probability dropout_p,
            the kept ones scaled by 1 / (1 - dropout_p); lse stays undropped. The mask
            comes from Philox in the kernel, keyed by a draw from PyTorch's generator
            of q's device (torch.manual_seed reproduces it; CUDA-graph safe), and the
            backward regenerates it. Applied whenever > 0 (pass 0.0 for evaluation).
            Not with FP8 inputs. return_attn_probs shows the mask (below).
        softmax_scale: scale of q k^T; default 1 / sqrt(head_dim).
        causal: bool. Query i sees key j only if j <= i + seqlen_k - seqlen_q, i.e. the
            mask is aligned to the bottom-right corner (flash-attn >= 2.1). With
            seqlen_q=2, seqlen_k=5 (1 = kept)::

                1 1 1 1 0
                1 1 1 1 1

            and with seqlen_q=5, seqlen_k=2 the first three rows see no key at all:
            their output is 0 and their lse is -inf.
        window_size: (left, right) ints, or a 2-element integer CPU tensor as flash-attn
            accepts (read on the host; not under torch.compile); query i sees keys in
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right].
            -1 means unbounded on that side. causal=True sets right to 0.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) (before ALiBi).
        alibi_slopes: (nheads,) or (batch, nheads) float; adds
            -slope * |i + seqlen_k - seqlen_q - j| to the score of (i, j).
        deterministic: bool (flash-attn's flag). True: the backward is bitwise
            reproducible (no atomics: each program owns the gradient rows it writes).
            False: the backward may instead take the fused path, whose dq is summed
            by atomic adds in an order that varies (equal to rounding, not bitwise),
            when FLASHTILE_BWD=fused; today's default, FLASHTILE_BWD=split, is the
            reproducible path for both values. torch.use_deterministic_algorithms(True)
            counts as True.
        return_attn_probs: bool (flash-attn's name, for testing): also return lse and
            the attention probabilities, see below. At most ATTN_PROBS_MAX_ELEMENTS
            (2**24) probabilities, batch * nheads * seqlen_q * seqlen_k; more raises.
        return_lse: bool, keyword only (flashtile's name): also return lse.
        q_descale, k_descale, v_descale: keyword only, FP8 q, k, v only (flash-attn 3's
            names): fp32 (batch, nheads_kv), the real q[b, :, h] being
            q_descale[b, h // (nheads // nheads_kv)] * q[b, :, h] (likewise k and v);
            None is 1.0. A per-tensor scale: a 0-d or (1,) tensor (any shape that
            broadcasts to (batch, nheads_kv)). See flashtile.fp8.
        out_dtype: keyword only: the output dtype of FP8 inputs, torch.bfloat16 (the
            default, as flash-attn 3), torch.float16 or torch.float32.

    Returns:
        out: (batch, seqlen_q, nheads, head_dim), q's dtype (FP8: out_dtype).
        lse (if return_lse or return_attn_probs): (batch, nheads, seqlen_q) float32, the
            natural-log log-sum-exp of each row's final scores (scaled, capped, biased,
            masked); -inf for a row that sees no key. It is differentiable.
        probs (if return_attn_probs): (batch, nheads, seqlen_q, seqlen_k) float32,
            softmax of the final scores computed exactly (float64, rounded once) from
            the reference, 0 where masked and in rows that see no key; no gradient.
            With dropout_p > 0 the entries the dropout removed are negated (flash-attn's
            sign code): ``~torch.signbit(probs)`` is the keep mask of this call.
            flash-attn's S_dmask is instead padded to multiples of 128, in q's dtype,
            and empty of meaning without dropout (docs/flash-attn-compat.md).
    """
    (b, sq, sk, h, hkv, d), layout = _check_qkv.with_id(q, k, v)
    left, right = V.check_flash_options(dropout_p, softmax_scale, softcap, window_size,
                                        causal)
    V.check_bools(deterministic=deterministic, return_attn_probs=return_attn_probs,
                  return_lse=return_lse)
    fp8 = F8.check_fp8_args(q, k, v, b, hkv, (q_descale, k_descale, v_descale), out_dtype)
    alibi_slopes = V.check_alibi(alibi_slopes, b, h, q.device)
    if return_attn_probs:
        _check_probs_size(b, h, sq, sk)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if fp8 is not None:
        V.check_no_dropout(dropout_p, "with FP8 inputs (a forward for inference)")
        out, lse = F8.fp8_attention(
            q, k, v, fp8[0], alibi_slopes=alibi_slopes, softmax_scale=float(softmax_scale),
            diag_offset=torch.sym_int(sk - sq), window_left=left, window_right=right,
            softcap=float(softcap), out_dtype=fp8[1])
    else:
        philox = _philox(q, dropout_p)
        out, lse = _attention(q, k, v, attn_mask=None, alibi_slopes=alibi_slopes,
                              softmax_scale=softmax_scale, diag_offset=sk - sq,
                              window_left=left, window_right=right, softcap=softcap,
                              deterministic=deterministic, dropout_p=dropout_p,
                              philox=philox, return_lse=return_lse or return_attn_probs,
                              layout=layout)
    if return_attn_probs:
        if fp8 is not None:  # the probabilities of the real (dequantised) q and k
            q, k = F8.dequantize(q, fp8[0][0]), F8.dequantize(k, fp8[0][1])
        rows, cols = torch.arange(sq, device=q.device), torch.arange(sk, device=q.device)
        probs = _attn_probs(q, k, rows, cols, sq, sk, softmax_scale=softmax_scale,
                            softcap=softcap, alibi_slopes=alibi_slopes, window_left=left,
                            window_right=right)
        if dropout_p > 0:
            probs = _sign_dropped(probs, reference.Dropout.dense(philox, dropout_p, b, h,
                                                                 sq), rows, cols)
        return out, lse, probs
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None,
                           *, return_lse=False, seqused_k=None, q_descale=None,
                           k_descale=None, v_descale=None, out_dtype=None):
    """flash_attn_func over packed sequences of different lengths, with no padding.

    Arguments:
        q: (total_q, nheads, head_dim); k, v: (total_k, nheads_kv, head_dim): the
            sequences of the batch back to back.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 prefix sums of the lengths
            (sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]); lengths may be 0.
        max_seqlen_q, max_seqlen_k: ints from 0 to 2**31 - 1, at least the longest
            sequence (they size the grid; given by the caller so that nothing is read
            from the device).
        The rest as in flash_attn_func; causal and windows are aligned per sequence at
        its own bottom-right corner, alibi_slopes (batch, nheads) is per sequence.
        block_table: optional int32 (batch, max_num_blocks_per_seq). Then k and v are a
            paged KV pool (num_blocks, page_size, nheads_kv, head_dim; v's own head_dim
            as in flash_attn_func), page_size a
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
        q_descale, k_descale, v_descale, out_dtype: FP8 q, k, v (packed, or an FP8 pool
            with block_table), as in flash_attn_func; batch is the number of sequences,
            so sequence b's rows (and keys, wherever its pages lie) take descale[b].
            With block_table the pool may also be FP8 under float16 or bfloat16 q (an
            FP8 KV cache, as in flash_attn_with_kvcache): k_descale and v_descale scale
            it, q_descale stays None, and out is in q's dtype.
        dropout_p: as in flash_attn_func (not with block_table or FP8). The mask entry
            of query i and key j of a sequence whose queries start at packed row
            q_start, head h, is word 2 * (bit 3 of i) + (bit 3 of j) of the Philox call
            at counter (j & ~8, h * total_q + q_start + (i & ~8)), so it does not
            depend on the tiles (docs/flash-attn-compat.md).

    Returns out (total_q, nheads, head_dim); with return_lse or return_attn_probs, lse
    (nheads, total_q) float32 (flash-attn's varlen layout), natural log, -inf for rows
    that see no key; with return_attn_probs, probs (batch, nheads, max_seqlen_q,
    max_seqlen_k) float32: sequence b's probabilities in the top-left corner of probs[b],
    zeros elsewhere (at most ATTN_PROBS_MAX_ELEMENTS elements); with dropout_p > 0 the
    dropped entries of each corner are negated, as in flash_attn_func.

    Index values are not read on the host (no device sync): the kernels check what they
    read, never leave a tensor, and show a bad index as NaN. If cu_seqlens_q or (without
    block_table) cu_seqlens_k are not prefix sums from 0 to the packed length whose
    steps are at most max_seqlen_q / max_seqlen_k, every row of out and lse is NaN (and
    so are dq, dk, dv in the backward); with a block_table, a sequence whose key count
    (seqused_k[b], or cu_seqlens_k[b + 1] - cu_seqlens_k[b]) is outside [0,
    max_num_blocks_per_seq * page_size] has NaN rows, and every row that would see a key
    behind a block-table entry outside [0, num_blocks) is NaN (other rows of its block
    of queries may be NaN too). With
    ``flashtile.set_index_checks(True)`` (or FLASHTILE_CHECK_INDICES=1) the values are
    read first (one host sync) and a bad one raises ValueError; the PyTorch path (CPU
    tensors without TRITON_INTERPRET) always checks. The check runs when the op runs, so
    also inside a torch.compile graph; while a CUDA graph is captured it is skipped.
    return_attn_probs is not available with a block_table.
    """
    if block_table is None and seqused_k is not None:
        V._fail(ValueError, "seqused_k", "None without block_table (packed k/v have their "
                "lengths in cu_seqlens_k)", "a tensor")
    (batch, h, hkv, d), layout = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                               max_seqlen_q, max_seqlen_k, block_table,
                                               seqused_k)
    fp8 = F8.check_fp8_args(q, k, v, batch, hkv, (q_descale, k_descale, v_descale),
                            out_dtype)
    if block_table is not None:
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            raise NotImplementedError(
                "flash_attn_varlen_func with block_table is forward only (as in "
                "flash-attn): q, k and v require no grad. Call it under torch.no_grad() "
                "or pass detached tensors")
        block_table = block_table.contiguous()  # the kernel reads rows with unit stride
    left, right = V.check_flash_options(dropout_p, softmax_scale, softcap, window_size,
                                        causal)
    if block_table is not None:
        V.check_no_dropout(dropout_p, "with block_table (a paged KV pool, forward only)")
    if fp8 is not None:
        V.check_no_dropout(dropout_p, "with FP8 inputs (a forward for inference)")
    V.check_bools(deterministic=deterministic, return_attn_probs=return_attn_probs,
                  return_lse=return_lse)
    alibi_slopes = V.check_alibi(alibi_slopes, batch, h, q.device)
    if return_attn_probs:
        if block_table is not None:
            V._fail(ValueError, "return_attn_probs", "False with block_table (the "
                    "probabilities are computed from packed k)", "True")
        _check_probs_size(batch, h, max_seqlen_q, max_seqlen_k)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if cu_seqlens_k is not None:
        cu_seqlens_k = cu_seqlens_k.contiguous()
    if seqused_k is not None:
        seqused_k = seqused_k.contiguous()
    # torch.sym_int keeps a symbolic size symbolic under torch.export; an int is itself.
    if type(max_seqlen_q) is not int or type(max_seqlen_k) is not int:
        max_seqlen_q, max_seqlen_k = torch.sym_int(max_seqlen_q), torch.sym_int(max_seqlen_k)
    if fp8 is not None:
        out, lse = F8.fp8_attention(
            q, k, v, fp8[0], alibi_slopes=alibi_slopes, softmax_scale=float(softmax_scale),
            diag_offset=0, window_left=left, window_right=right, softcap=float(softcap),
            out_dtype=fp8[1], cu_seqlens_q=cu_seqlens_q.contiguous(),
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, block_table=block_table,
            seqused_k=seqused_k)
    else:
        philox = _philox(q, dropout_p)
        out, lse = custom_ops.varlen_attention(
            q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            alibi_slopes, float(softmax_scale), left, right,
            float(softcap), _allow_tf32(q.dtype), block_table, seqused_k, deterministic,
            float(dropout_p), philox, return_lse=return_lse or return_attn_probs,
            layout=layout)
    if return_attn_probs:
        if fp8 is not None:  # the probabilities of the real (dequantised) q and k
            q = F8.dequantize_packed(q, fp8[0][0], cu_seqlens_q)
            k = F8.dequantize_packed(k, fp8[0][1], cu_seqlens_k)
        probs = _varlen_attn_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, softmax_scale=softmax_scale,
                                   softcap=softcap, alibi_slopes=alibi_slopes,
                                   window_left=left, window_right=right)
        if dropout_p > 0:  # each sequence's counters start at its packed rows
            starts_q = cu_seqlens_q[:-1].long().view(batch, 1, 1, 1)
            dropout = reference.Dropout.varlen(philox, dropout_p, h, q.shape[0], starts_q)
            probs = _sign_dropped(probs, dropout, torch.arange(max_seqlen_q),
                                  torch.arange(max_seqlen_k))
        return out, lse, probs
    return (out, lse) if return_lse else out


def _unpack(x, name, index_dim, count):
    """Views of a packed qkv / kv tensor: ``count`` tensors along ``index_dim``."""
    rank = index_dim + 3
    V.check_tensor(x, name, rank)  # so a wrong dtype is reported as "qkv", not "q"
    if x.shape[index_dim] != count:
        V._fail(ValueError, f"{name}.shape", f"a {rank}-d tensor with size {count} at dim "
                f"{index_dim}", tuple(x.shape))
    return x.unbind(index_dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              return_lse=False):
    """flash_attn_func with qkv (batch, seqlen, 3, nheads, head_dim); views, no copies."""
    q, k, v = _unpack(qkv, "qkv", 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs,
                           return_lse=return_lse)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *,
                             return_lse=False):
    """flash_attn_func with kv (batch, seqlen_k, 2, nheads_kv, head_dim)."""
    k, v = _unpack(kv, "kv", 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs,
                           return_lse=return_lse)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, return_lse=False):
    """flash_attn_varlen_func with qkv (total, 3, nheads, head_dim): q, k and v share
    cu_seqlens and max_seqlen."""
    q, k, v = _unpack(qkv, "qkv", 1, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs,
                                  return_lse=return_lse)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, return_lse=False):
    """flash_attn_varlen_func with kv (total_k, 2, nheads_kv, head_dim)."""
    k, v = _unpack(kv, "kv", 1, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, return_lse=return_lse)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    query (batch, nheads, seqlen_q, head_dim) and key/value (batch, nheads_kv, seqlen_k,
    head_dim), or 3-d (batch, seq, head_dim), or with more batch dims in front (batch,
    ..., nheads, seq, head_dim), the same for query, key and value. ``attn_mask`` is
    bool (True = attend) or additive in the query's dtype, broadcastable to (batch,
    nheads, seqlen_q, seqlen_k), and is read tile by tile in the kernel. ``is_causal``
    is aligned top-left, as in PyTorch (query i sees keys j <= i). A row whose mask
    excludes every key returns 0. ``dropout_p`` in [0, 1) drops attention probabilities
    as PyTorch's does (whenever it is > 0, training or not: nn modules pass 0.0 in eval
    mode), with flashtile's own Philox mask (flash_attn_func's dropout_p; a different
    draw than PyTorch's kernels).
    """
    V.check_bools(is_causal=is_causal, enable_gqa=enable_gqa)
    for x, name in ((query, "query"), (key, "key"), (value, "value")):
        if not isinstance(x, torch.Tensor):
            V._fail(TypeError, name, "a torch.Tensor", type(x).__name__)
        if x.dim() < 3:
            V._fail(ValueError, name, "a 4-d (batch, heads, seq, dim) or 3-d tensor "
                    "(or more batch dims in front)", f"shape {tuple(x.shape)}")
    if not query.dim() == key.dim() == value.dim():
        V._fail(ValueError, "key/value rank", f"query's rank {query.dim()}",
                (key.dim(), value.dim()))
    # Shape checks in the caller's (batch, heads, seq, dim) layout, so the messages name
    # the dims the caller sees; check_qkv below sees the transposed views. value's head
    # dim may differ from the query's (MLA), the output taking it, as in PyTorch's.
    if key.shape[-1] != query.shape[-1]:
        V._fail(ValueError, "key.shape[-1] (head_dim)",
                f"query's head_dim {query.shape[-1]}", key.shape[-1])
    if value.shape[:-1] != key.shape[:-1]:
        V._fail(ValueError, "value.shape[:-1]", f"key's {tuple(key.shape[:-1])}",
                tuple(value.shape[:-1]))
    if key.shape[0] != query.shape[0]:
        V._fail(ValueError, "key.shape[0] (batch)", f"query's batch {query.shape[0]}",
                key.shape[0])
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask and is_causal=True were both given: pass one, as "
                         "torch.nn.functional.scaled_dot_product_attention requires")
    lead = None
    if query.dim() > 4:
        # (batch, ..., heads, seq, dim): the batch dims merge into one (a view where the
        # strides allow) and come back on the output.
        lead = tuple(query.shape[:-3])
        if tuple(key.shape[:-3]) != lead:
            V._fail(ValueError, "key.shape[:-3] (batch dims)", f"query's {lead}",
                    tuple(key.shape[:-3]))
        attn_mask = _merge_mask_batch_dims(attn_mask, query, key, lead)
        query, key, value = (x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
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
                        window_right=0 if is_causal else -1, softcap=0.0,
                        dropout_p=dropout_p, philox=_philox(q, dropout_p),
                        return_lse=False)
    out = out.transpose(1, 2)
    if lead is not None:
        return out.reshape(*lead, *out.shape[1:])
    return out.squeeze(1) if squeeze else out


def _merge_mask_batch_dims(attn_mask, query, key, lead):
    """An SDPA mask for (batch, ..., heads, seq, dim) inputs, its batch dims merged as
    the inputs' are: one of 3 dims or fewer broadcasts over them as it is; a longer one
    is expanded over them first (a copy only where its strides cannot merge)."""
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dim() <= 3:
        return attn_mask
    target = (*lead, query.shape[-3], query.shape[-2], key.shape[-2])
    shape = tuple(attn_mask.shape)
    if not V.broadcastable(shape, target):
        V._fail(ValueError, "attn_mask.shape", f"broadcastable to {target}", shape)
    return attn_mask.expand(*lead, *shape[-3:]).reshape(-1, *shape[-3:])
