"""Combining a split decode's partials (Dao et al., Flash-Decoding, 2023).

A split decode (``flashtile.ops.decode``) cuts the cache length into splits, and each
split writes its normalized partial output out_s and its lse_s (fp32). They merge
exactly through the lse: with m the largest lse_s of a row and w_s = exp(lse_s - m),

    out = sum_s w_s out_s / sum_s w_s,    lse = m + log(sum_s w_s).

Two ways to run the merge (FLASHTILE_DECODE_COMBINE, ``combine_mode``):
- "kernel" (the default): ``_combine_kernel``, a second launch, one program per (batch,
  query token, query head) row; on Hopper a programmatic dependent launch
  (``combine_pdl``) whose programs are scheduled while the decode programs finish;
- "fused": the decode kernel merges its own splits, one launch. Every split program of
  a (batch entry, KV head, row block) stores its partials and counts itself on that
  block's counter (one atomic); the program that counts last reads every split's
  partials back and merges them (``_merge_rows``), then resets the counter to 0. The
  counters are a persistent int32 workspace per (device, stream), and one per device
  for CUDA graphs (``split_counters``).
Both merge with the same weights and the same empty-row and NaN rules (``_split_weights``,
``_merged_lse``) and differ in rounding only: the order of the fp32 sums, and past a
group of splits the fused merge's rescaling of its sums to the next group's largest lse.
"""

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from flashtile.ops import _launch, configs


@triton.jit
def _split_weights(lse_s, m):
    """w_s = exp(lse_s - m), the weight of a split's partial output, for m the largest
    partial lse of its row. A row whose every split is empty (m = -inf) weighs them all 0
    (it is (0, -inf): _merged_lse); a NaN partial lse gives a NaN weight."""
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return tl.exp(lse_s - m_safe)


@triton.jit
def _merged_lse(total, m):
    """(divisor, lse) of a row whose split weights sum to total (m as _split_weights'):
    out = sum_s w_s out_s / divisor. An empty row (total 0) is (0, -inf)."""
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    # == 0, not > 0: a NaN partial lse makes total NaN and must come out NaN.
    empty = total == 0.0
    divisor = tl.where(empty, 1.0, total)
    return divisor, tl.where(empty, float("-inf"), m_safe + tl.log(divisor))


@triton.jit
def _merge_rows(Lse, Out, o_lse, o_out, m_row, m_out, stride_ls, stride_os, splits,
                MERGE_S: tl.constexpr):
    """(out, lse) of the rows whose split s has its partial lse at Lse + s * stride_ls +
    o_lse (M,) and its partial output at Out + s * stride_os + o_out (M, DV), merged over
    the splits s < splits in groups of MERGE_S in split order: the result does not
    depend on which program merges. Each group is one load of its outputs (issued
    first) and one of its lse, from the L2 (``.cg``: other programs of the grid wrote
    them, and the L1 is not coherent): a round trip a group, not a split. Up to MERGE_S
    splits this is _combine_kernel's merge (the weights against the rows' largest
    lse); past them the sums so far are rescaled to each group's new largest lse, as
    the decode kernel's online softmax does."""
    offs_s = tl.arange(0, MERGE_S)
    m = tl.full(o_lse[:, None].shape, float("-inf"), dtype=tl.float32)          # (M, 1)
    total = tl.zeros_like(m)
    acc = tl.zeros(o_out.shape, dtype=tl.float32)                               # (M, DV)
    for s0 in range(0, splits, MERGE_S):
        m_s = ((s0 + offs_s) < splits)[None, :, None]                           # (1, S, 1)
        b_o = tl.load(Out + (s0 + offs_s)[None, :, None] * stride_os + o_out[:, None, :],
                      mask=m_s & m_out[:, None, :], other=0.0,
                      cache_modifier=".cg")                                     # (M, S, DV)
        b_lse = tl.load(Lse + (s0 + offs_s)[None, :, None] * stride_ls
                        + o_lse[:, None, None], mask=m_s & m_row[:, None, None],
                        other=float("-inf"), cache_modifier=".cg")              # (M, S, 1)
        m_new = tl.maximum(m, tl.max(b_lse, 1))
        # 0 while nothing was summed (m = -inf): exp(-inf - x) is 0 for any safe x.
        alpha = tl.exp(m - tl.where(m_new == float("-inf"), 0.0, m_new))
        w = _split_weights(b_lse, m_new[:, None, :])                             # (M, S, 1)
        total = total * alpha + tl.sum(w, 1)
        acc = acc * alpha + tl.sum(b_o * w, 1)
        m = m_new
    divisor, lse = _merged_lse(total, m)
    return acc / divisor, tl.reshape(lse, o_lse.shape)
    divisor, lse = _merged_lse(total, m)
    return acc / divisor[:, None], lse


# The split count and the partial lse's split stride (splits x batch x heads) follow the
# batch and the cache length: unspecialised, one variant per BLOCK_S (as _decode_kernel).
# A split count known to be a multiple of 16 would save a few predicates of the split
# mask (sm_90 PTX), not a load.
@triton.jit(do_not_specialize=["stride_lps", "num_splits"])
def _combine_kernel(OutPartial, LsePartial, Out, Lse,
                    stride_ps, stride_pb, stride_pm, stride_ph,
                    stride_lps, stride_lpb, stride_lph,
                    stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
                    num_splits, nheads, seqlen_q, head_dim,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """out = sum_s out_s * exp(lse_s - lse), lse = logsumexp_s lse_s, one row per program."""
    if USE_PDL:
        # Launched before the decode grid finished: wait until its partials are visible.
        gdc_wait()
    row = tl.program_id(0)
    off_h = row % nheads
    off_t = (row // nheads) % seqlen_q
    off_b = row // (nheads * seqlen_q)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    m_s = offs_s < num_splits
    lse_s = tl.load(LsePartial + offs_s * stride_lps + off_b * stride_lpb + off_h * stride_lph
                    + off_t, mask=m_s, other=float("-inf"))                # (S,)
    m = tl.max(lse_s, 0)
    w = _split_weights(lse_s, m)                                            # (S,)
    divisor, lse = _merged_lse(tl.sum(w, 0), m)
    b_o = tl.load(OutPartial + offs_s[:, None] * stride_ps + off_b * stride_pb
                  + off_t * stride_pm + off_h * stride_ph + offs_d[None, :],
                  mask=m_s[:, None] & (offs_d[None, :] < head_dim), other=0.0)  # (S, D)
    out = tl.sum(b_o * w[:, None], 0) / divisor
    tl.store(Out + off_b * stride_ob + off_t * stride_om + off_h * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=offs_d < head_dim)
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + off_t, lse)


def _combine_warps(elements: int) -> int:
    """Warps of the combine for a (splits, head_dim) tile: one up to 32 x 128 (the
    common decode; PDL's early launch wants it small), then enough that each thread
    holds at most 128 of its fp32 partials (sm_90 AOT: one warp at 32 x 512 spills)."""
    return 1 if elements <= 32 * 128 else min(16, max(4, elements // (128 * 32)))


def combine_pdl(q) -> tuple[bool, bool]:
    """(combine is a programmatic dependent launch, decode signals it early): Hopper and
    later. FLASHTILE_DECODE_PDL=0 turns it off, =late keeps the dependent launch but
    signals only when the decode grid ends (A/B timing). Read when a plan is made."""
    mode = os.environ.get("FLASHTILE_DECODE_PDL", "1").strip().lower()
    if mode not in ("0", "1", "late"):
        raise ValueError(f"FLASHTILE_DECODE_PDL must be '0', '1' or 'late', got {mode!r}")
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9) or mode == "0":
        return False, False
    return True, mode == "1"


_COMBINE_SLOTS = ("OutPartial", "LsePartial", "Out", "Lse")


def launch_combine(q, dv, num_splits, dst, dst_lse, out, lse_t, pdl, planned):
    """Merge a split decode's partials (dst (splits, b, sq, h, dv) fp32 and dst_lse
    (splits, b, h, sq)) into out and lse_t with _combine_kernel, a programmatic
    dependent launch when pdl (combine_pdl); returns its plan when planned."""
    b, sq, h = q.shape[:3]
    block_s = configs.next_power_of_2(num_splits)
    block_dv = configs.padded_head_dim(dv)
    return _launch.first_launch(
        _combine_kernel, (b * sq * h,),
        (dst, dst_lse, out, lse_t, *dst.stride()[:4], *dst_lse.stride()[:3],
         out.stride(0), out.stride(1), out.stride(2), lse_t.stride(0), lse_t.stride(1),
         num_splits, h, sq, dv),
        # One warp while its tile fits in 128 registers a thread: no cross-warp
        # reductions. H200, 32 splits x d128 alone: 1.66 us, 4 warps 2.69 (NOTES 9).
        dict(BLOCK_S=block_s, BLOCK_D=block_dv, USE_PDL=pdl, launch_pdl=pdl,
             num_warps=_combine_warps(block_s * block_dv)),
        _COMBINE_SLOTS if planned else None)


DECODE_COMBINE = ("kernel", "fused")


def combine_mode() -> str:
    """FLASHTILE_DECODE_COMBINE: how a split decode merges its splits (module
    docstring). "kernel" (the default): ``_combine_kernel``, a second launch; "fused":
    the decode kernel's last program of each row block, one launch (the portable decode
    kernel with V's columns in one program; the others keep the kernel). Read on every
    decode call: part of its plan key."""
    return configs._env_choice("FLASHTILE_DECODE_COMBINE", DECODE_COMBINE)


# The fused combine's counters, int32 buffers that are zero between calls: one per
# (device, stream) for eager calls, and one per (device, None) that CUDA graphs capture.
_counters: dict = {}
# Buffers a larger call outgrew: kept, never freed, since a captured CUDA graph holds
# their address (its replays leave them zero as they found them).
_outgrown: list = []
# A buffer's first size: 16 KiB, 4096 row blocks (256 sequences x 16 KV heads), so
# that an engine's batches rarely grow it.
MIN_COUNTERS = 4096


def split_counters(q, n: int):
    """The fused combine's counters for a decode of q: an int32 buffer of at least n,
    all zero (each call's last programs reset theirs).

    An eager call counts on a buffer of its device's current stream, so concurrent
    decodes on two streams never share counters; it is created zeroed on first use and
    grown (a new buffer, the old one kept alive) when a call needs more. A CUDA graph
    captures the device's graph buffer instead, made and grown with the eager ones (to
    the most counters an eager call on the device has needed; a capture may not make
    one: its zeroing would be captured, not run), since a graph is warmed up on one
    stream and captured on another (torch.cuda.graph's own, in triton's
    do_bench_cudagraph and PyTorch's recipe). So graphs holding fused decodes share it:
    replay them one at a time (as an engine's decode steps are), never two at once on
    two streams. None during a capture that needs more counters than that buffer holds
    (no eager call has needed as many): the caller merges with ``_combine_kernel``."""
    device = q.device.index if q.is_cuda else q.device.type
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        counters = _counters.get((device, None))
        return counters if counters is not None and counters.numel() >= n else None
    stream = _launch._stream(device) if q.is_cuda else 0
    counters = _counters.get((device, stream))
    if counters is not None and counters.numel() >= n:
        return counters
    for key in ((device, None), (device, stream)):
        held = _counters.get(key)
        if held is None or held.numel() < n:
            size = max(n, MIN_COUNTERS)
            if held is not None:
                _outgrown.append(held)
                size = max(size, 2 * held.numel())
            _counters[key] = torch.zeros(size, dtype=torch.int32, device=q.device)
    return _counters[(device, stream)]
