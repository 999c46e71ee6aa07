"""Ring attention's algorithm, apart from any transport: plan, step, merge, autograd.

``flashtile.distributed`` documents the algorithm and runs it over torch.distributed;
this module holds the parts that do not depend on how K/V move, so that the one-process
simulation (``ring_attention_simulated``) executes exactly the code a rank executes.

The code is written for a list of *local ranks* held by one process: one rank per process
with torch.distributed (``P2PRing`` in distributed.py), every rank of the ring in one
process for the simulation (``LocalRing`` below). A ring object exposes ``world``,
``ranks`` (the rank ids held here) and ``shift(buffers, tag)``, which starts moving each
local buffer from rank r to rank r + 1 and returns a handle whose ``wait()`` gives the
buffers that arrived from rank r - 1, in the same order as ``ranks``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flashtile import custom_ops

LAYOUTS = ("contiguous", "zigzag")
KV_TAG, DKV_TAG = 0, 1  # separate p2p tags for the two streams in flight in the backward

_NONE, _FULL, _PARTIAL = 0, 1, 2  # how much of a (q chunk, k chunk) block is visible


@dataclass(frozen=True)
class RingConfig:
    """Everything about a ring call that is the same on every rank."""

    layout: str
    seqlen_local: int  # tokens each rank holds, q and k alike
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    allow_tf32: bool


@dataclass(frozen=True)
class Task:
    """One kernel call: local q rows [q_lo, q_hi) against local k rows [k_lo, k_hi)."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    diag_offset: int
    window_left: int
    window_right: int


@dataclass(frozen=True)
class _Chunk:
    start: int   # global position of the first token
    local: int   # its index in the rank's local tensor
    length: int


def layout_chunks(layout, world, rank, seqlen_local):
    """The global pieces a rank holds, in local order.

    contiguous: rank r holds tokens [r*L, (r+1)*L). zigzag: the sequence is cut into
    2*world chunks of c = L/2 tokens and rank r holds chunks r and 2*world-1-r.
    """
    if layout == "contiguous":
        return (_Chunk(rank * seqlen_local, 0, seqlen_local),)
    c = seqlen_local // 2
    return (_Chunk(rank * c, 0, c), _Chunk((2 * world - 1 - rank) * c, c, c))


def _visibility(diag_offset, n_rows, n_cols, window_left, window_right):
    """_NONE, _FULL or _PARTIAL for a block where row i sees col j iff
    -window_left <= j - i - diag_offset <= window_right (negative bound = unbounded)."""
    if n_rows == 0 or n_cols == 0:
        return _NONE
    lo, hi = -(n_rows - 1) - diag_offset, (n_cols - 1) - diag_offset  # range of j-i-diag
    if window_right >= 0 and lo > window_right or window_left >= 0 and hi < -window_left:
        return _NONE
    if (window_right < 0 or hi <= window_right) and (window_left < 0 or lo >= -window_left):
        return _FULL
    return _PARTIAL


def _one_call(q_chunks, k_chunks, window_left, window_right):
    """A Task computing q_chunks x k_chunks (runs of adjacent local chunks) in one call.

    The kernel's mask uses local indices, so one (diag_offset, window) must reproduce the
    global mask on every chunk pair: exactly (same offset) or trivially (the pair is
    fully visible, or fully masked, under both). Tried: no mask at all, then the offset
    of each pair. Returns None when no candidate fits.
    """
    q0, k0 = q_chunks[0].local, k_chunks[0].local
    pairs = [(q, k, q.start - k.start, (q.local - q0) - (k.local - k0))
             for q in q_chunks for k in k_chunks]  # (q, k, true offset, local shift)
    candidates = [(0, -1, -1)] + [(d - shift, window_left, window_right)
                                  for _, _, d, shift in pairs]
    for diag, left, right in candidates:
        for q, k, d_true, shift in pairs:
            d_call = diag + shift
            if d_call == d_true and (left, right) == (window_left, window_right):
                continue
            want = _visibility(d_true, q.length, k.length, window_left, window_right)
            if want == _PARTIAL or want != _visibility(d_call, q.length, k.length,
                                                       left, right):
                break
        else:
            return Task(q0, q_chunks[-1].local + q_chunks[-1].length,
                        k0, k_chunks[-1].local + k_chunks[-1].length, diag, left, right)
    return None


def _span(chunks, keep):
    idx = [i for i, k in enumerate(keep) if k]
    return chunks[idx[0]:idx[-1] + 1]


@functools.lru_cache(maxsize=4096)
def plan(layout, world, q_rank, kv_rank, seqlen_local, window_left, window_right):
    """Kernel calls for q_rank's queries against kv_rank's keys; () if all masked.

    The calls cover disjoint q x k rectangles and together give exactly the global mask;
    fully masked chunk pairs are never computed. Zig-zag causal needs one call per step:
    the diagonal step is one causal call, the others one unmasked call on half the rows
    or half the keys.
    """
    q_chunks = layout_chunks(layout, world, q_rank, seqlen_local)
    k_chunks = layout_chunks(layout, world, kv_rank, seqlen_local)
    seen = [[_visibility(q.start - k.start, q.length, k.length, window_left,
                         window_right) != _NONE for k in k_chunks] for q in q_chunks]
    rows = [any(r) for r in seen]
    if not any(rows):
        return ()
    cols = [any(r[j] for r in seen) for j in range(len(k_chunks))]
    task = _one_call(_span(q_chunks, rows), _span(k_chunks, cols), window_left,
                     window_right)
    if task is not None:
        return (task,)
    tasks = []
    for q, row in zip(q_chunks, seen):
        if not any(row):
            continue
        task = _one_call((q,), _span(k_chunks, row), window_left, window_right)
        if task is not None:
            tasks.append(task)
        else:  # a single pair always fits with its own offset
            tasks += [_one_call((q,), (k,), window_left, window_right)
                      for k, s in zip(k_chunks, row) if s]
    return tuple(tasks)


def merge_into(acc_out, acc_lse, out, lse):
    """acc <- exact softmax merge of acc and a partial, in place; fp32 accumulators.

    acc_out (b, s, h, d) fp32, acc_lse (b, h, s) fp32; out (b, s, h, d), lse (b, h, s).
    out = acc_out * exp(acc_lse - new) + out * exp(lse - new), new = logaddexp(...).
    A row that is -inf on both sides stays (0, -inf): the exponents use 0 for it, no NaN.
    """
    new = torch.logaddexp(acc_lse, lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    w_acc = torch.exp(acc_lse - safe).transpose(1, 2).unsqueeze(-1)  # (b, s, h, 1)
    w_new = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(w_acc).add_(out.float() * w_new)
    acc_lse.copy_(new)


def _tasks(cfg, world, rank, step):
    return plan(cfg.layout, world, rank, (rank - step) % world, cfg.seqlen_local,
                cfg.window_left, cfg.window_right)


def _mask_args(cfg, t):
    return (cfg.softmax_scale, t.diag_offset, t.window_left, t.window_right, cfg.softcap,
            cfg.allow_tf32)


def ring_forward(ring, cfg, qs, ks, vs):
    """Forward over the ring: per local rank, (out in q's dtype, lse fp32)."""
    kvs = [torch.stack((k, v)) for k, v in zip(ks, vs)]  # one buffer per hop
    acc_out = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) for q in qs]
    acc_lse = [torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"),
                          dtype=torch.float32, device=q.device) for q in qs]
    for step in range(ring.world):
        # Post the next hop first so the transfer overlaps this step's kernels.
        pending = ring.shift(kvs, KV_TAG) if step + 1 < ring.world else None
        for i, rank in enumerate(ring.ranks):
            q, kv = qs[i], kvs[i]
            for t in _tasks(cfg, ring.world, rank, step):
                out, lse = custom_ops.attn_fwd(
                    q[:, t.q_lo:t.q_hi], kv[0][:, t.k_lo:t.k_hi], kv[1][:, t.k_lo:t.k_hi],
                    None, None, *_mask_args(cfg, t))
                merge_into(acc_out[i][:, t.q_lo:t.q_hi], acc_lse[i][:, :, t.q_lo:t.q_hi],
                           out, lse)
        if pending is not None:
            kvs = pending.wait()
    return [o.to(q.dtype) for o, q in zip(acc_out, qs)], acc_lse


def ring_backward(ring, cfg, douts, dlses, qs, ks, vs, outs, lses):
    """Backward over the ring: per local rank, (dq, dk, dv) of its own slice.

    Each block pair's gradient is attn_bwd with the *global* out and lse (P of the block
    is exp(s - lse), delta = rowsum(dout * out) - dlse), so the pairs add up exactly.
    dq stays home; the fp32 dK/dV accumulator of a K/V slice travels with it and, after
    world hops, is back on the slice's owner.
    """
    kvs = [torch.stack((k, v)) for k, v in zip(ks, vs)]
    dqs = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) for q in qs]
    dkvs = [torch.zeros(kv.shape, dtype=torch.float32, device=kv.device) for kv in kvs]
    pending_dkv = None
    for step in range(ring.world):
        pending_kv = ring.shift(kvs, KV_TAG) if step + 1 < ring.world else None
        parts = []
        for i, rank in enumerate(ring.ranks):
            q, kv, dout, out, lse = qs[i], kvs[i], douts[i], outs[i], lses[i]
            dlse = dlses[i]
            for t in _tasks(cfg, ring.world, rank, step):
                rows, keys = slice(t.q_lo, t.q_hi), slice(t.k_lo, t.k_hi)
                dq, dk, dv = custom_ops.attn_bwd(
                    dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys],
                    out[:, rows], lse[:, :, rows],
                    None if dlse is None else dlse[:, :, rows], None, None,
                    *_mask_args(cfg, t))
                dqs[i][:, rows] += dq
                parts.append((i, keys, dk, dv))
        # The accumulator of the slice in hand arrives while this step computes.
        if pending_dkv is not None:
            dkvs = pending_dkv.wait()
        for i, keys, dk, dv in parts:
            dkvs[i][0][:, keys] += dk
            dkvs[i][1][:, keys] += dv
        pending_dkv = ring.shift(dkvs, DKV_TAG)  # world hops in all: the last one goes home
        if pending_kv is not None:
            kvs = pending_kv.wait()
    dkvs = pending_dkv.wait()
    return ([dq.to(q.dtype) for dq, q in zip(dqs, qs)],
            [dkv[0].to(k.dtype) for dkv, k in zip(dkvs, ks)],
            [dkv[1].to(v.dtype) for dkv, v in zip(dkvs, vs)])


class RingAttention(torch.autograd.Function):
    """(ring, cfg, *qs, *ks, *vs) -> (*outs, *lses), one of each per local rank."""

    @staticmethod
    def forward(ctx, ring, cfg, *qkv):
        n = len(ring.ranks)
        qs, ks, vs = qkv[:n], qkv[n:2 * n], qkv[2 * n:]
        outs, lses = ring_forward(ring, cfg, qs, ks, vs)
        ctx.save_for_backward(*qs, *ks, *vs, *outs, *lses)
        ctx.ring, ctx.cfg = ring, cfg
        ctx.set_materialize_grads(False)
        return (*outs, *lses)

    @staticmethod
    def backward(ctx, *grads):
        n = len(ctx.ring.ranks)
        saved = ctx.saved_tensors
        qs, ks, vs, outs, lses = (saved[i * n:(i + 1) * n] for i in range(5))
        douts = [torch.zeros_like(o) if g is None else g.contiguous()
                 for g, o in zip(grads[:n], outs)]
        dlses = list(grads[n:])
        dqs, dks, dvs = ring_backward(ctx.ring, ctx.cfg, douts, dlses, qs, ks, vs, outs,
                                      lses)
        return (None, None, *dqs, *dks, *dvs)


class Ready:
    def __init__(self, buffers):
        self.buffers = buffers

    def wait(self):
        return self.buffers


class LocalRing:
    """Every rank of the ring in this process; a hop is a rotation of the buffer list."""

    def __init__(self, world):
        self.world = world
        self.ranks = tuple(range(world))

    def shift(self, buffers, tag):
        return Ready([buffers[(r - 1) % self.world] for r in self.ranks])
