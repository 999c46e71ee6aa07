"""Ring (context-parallel) attention over torch.distributed: exact attention on a
sequence split across ranks.

Algorithm (Liu et al., "Ring Attention with Blockwise Transformers for Near-Infinite
Context", 2023). Each of the W ranks of ``group`` holds a slice of the sequence: its
queries and the matching keys/values. Attention of the local queries over the whole
sequence is computed in W steps. At step s rank r holds the K/V slice of rank
(r - s) mod W, runs the flashtile kernel on (its q, that K/V) and merges the partial
result into an fp32 accumulator through the log-sum-exps::

    lse = logaddexp(lse_acc, lse_s)
    out = out_acc * exp(lse_acc - lse) + out_s * exp(lse_s - lse)

which is exact: the softmax over the union of key sets. A row that saw no key yet has
lse = -inf and contributes nothing (never NaN).

Communication: one ``dist.batch_isend_irecv`` per step with an isend of the K/V in hand
(k and v stacked in one buffer) to rank r + 1 and an irecv from rank r - 1. The hop for
step s + 1 is posted *before* step s's kernels and waited on after them, so the transfer
hides behind the compute when a step's attention takes longer than moving one K/V slice
(bytes ~ 2 * L * nheads_kv * head_dim, flops ~ 4 * L^2 * nheads * head_dim per step).
W - 1 hops in the forward.

Backward: the ring turns again. For each step the block pair's (dq, dk, dv) come from
``attn_bwd`` fed with the *global* out and lse (the FlashAttention backward identity:
P = exp(s - lse), dS = P * (dP - delta), delta = rowsum(dout * out) - dlse), so block
gradients add up exactly. dq accumulates at home in fp32. The fp32 dK/dV accumulator of a
K/V slice travels one hop behind it: after computing step s a rank adds its share to
the accumulator that arrived (overlapped with step s's compute) and sends it on; after W
hops it is back on the rank that owns the slice. W - 1 K/V hops and W dK/dV hops.

Causal load balance (``layout="zigzag"``). With a contiguous split, causal rank r has
r + 1 useful steps of W, so the last rank works W times longer than the first. The
zig-zag split cuts the sequence into 2W chunks and gives rank r chunks r and 2W-1-r
(concatenated), so every rank does the same work: the diagonal step is one causal call,
every other step one unmasked call on half the rows (kv from a later rank) or on half the
keys (kv from an earlier rank). Use ``split(..., layout="zigzag")`` to lay the inputs
out and ``gather(..., layout="zigzag")`` to reassemble the output.

Masks: query at global position i sees the key at global j iff
i - window_left <= j <= i + window_right (-1 = unbounded; causal sets window_right = 0);
q and k cover the same global positions. Each kernel call gets a ``diag_offset`` equal to
(global start of its q rows) - (global start of its k rows), so the kernel's local mask is
the global one; fully masked block pairs are skipped (``flashtile._ring.plan``).

Transport: only torch.distributed, so NCCL on GPUs and gloo on CPUs both work. With NCCL,
call ``torch.cuda.set_device(local_rank)`` before the first call. The ring is not traced
by torch.compile (the p2p calls break the graph).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from flashtile import _validate as V
from flashtile._ring import LAYOUTS, LocalRing, Ready, RingAttention, RingConfig

__all__ = ["ring_flash_attn_func", "ring_attention_simulated", "split", "gather",
           "zigzag_split", "zigzag_gather"]


class _Pending:
    def __init__(self, works, buffers):
        self.works, self.buffers = works, buffers

    def wait(self):
        for w in self.works:
            w.wait()
        return self.buffers


class P2PRing:
    """This process's place in the ring of ``group``: isend to rank+1, irecv from rank-1."""

    def __init__(self, group):
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        self.ranks = (rank,)
        self.next = dist.get_global_rank(self.group, (rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (rank - 1) % self.world)

    def shift(self, buffers, tag):
        if self.world == 1:
            return Ready(buffers)
        (buf,) = buffers
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return _Pending(dist.batch_isend_irecv(ops), [recv])


def _require_process_group():
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "flashtile.distributed needs a torch.distributed process group: call "
            "torch.distributed.init_process_group(backend='nccl' or 'gloo', ...) first "
            "(torchrun sets the environment it needs)")


def _check_layout(layout):
    if layout not in LAYOUTS:
        V._fail(ValueError, "layout", f"one of {LAYOUTS}", repr(layout))


def _chunk_count(world_size, layout):
    return world_size * (2 if layout == "zigzag" else 1)


def _check_divisible(seqlen, world_size, layout, name):
    n = _chunk_count(world_size, layout)
    if seqlen % n:
        V._fail(ValueError, name, f"a multiple of {n} ({layout} split over "
                f"{world_size} ranks)", seqlen,
                "Pad the sequence (and mask the padding out of the loss)")


def _check_ranks_agree(ring, signature, device):
    """All-gather the call's signature on every call; raise on mismatch.

    Mismatched shapes would otherwise hang or read garbage in the p2p hops. The check is
    one small collective per call: caching agreement per rank would let a rank that saw
    a signature before skip the collective while another rank waits in it.
    """
    if ring.world == 1:
        return
    mine = torch.tensor(signature, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(ring.world)]
    dist.all_gather(everyone, mine, group=ring.group)
    rows = [tuple(t.tolist()) for t in everyone]
    if any(r != rows[0] for r in rows):
        names = "(batch, seqlen_local, nheads, nheads_kv, head_dim, dtype, " \
                "softmax_scale, window_left, window_right, softcap, layout)"
        table = "; ".join(f"rank {i}: {r}" for i, r in enumerate(rows))
        raise ValueError(f"ring_flash_attn_func: ranks disagree on {names}: {table}. "
                         "Every rank must pass the same shapes and arguments")


def _config(q, k, v, causal, softmax_scale, window_size, softcap, layout, world_size):
    """Validate one rank's inputs; returns its RingConfig."""
    b, sq, sk, h, hkv, d = V.check_qkv(q, k, v)
    if v.shape[-1] != d:  # check_qkv takes it (MLA); the ring's buffers do not yet
        V._fail(ValueError, "v.shape[-1] (head_dim)", f"q's head_dim {d}", v.shape[-1],
                "ring attention needs one head_dim for q, k and v")
    if sk != sq:
        V._fail(ValueError, "k.shape[1] (local seqlen)", f"q's local seqlen {sq}", sk,
                "Each rank holds the same positions of q, k and v")
    _check_layout(layout)
    if layout == "zigzag" and sq % 2:
        V._fail(ValueError, "q.shape[1] (local seqlen)", "an even number: zigzag holds "
                "two equal chunks, so the global seqlen must be a multiple of "
                f"2 * world_size = {2 * world_size}", sq)
    left, right = V.check_flash_options(0.0, softmax_scale, softcap, window_size, causal)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    # fp32 uses TF32 products only when the user allowed them, as flash_attn_func does.
    allow_tf32 = (q.dtype == torch.float32
                  and torch.get_float32_matmul_precision() != "highest")
    return RingConfig(layout, sq, float(softmax_scale), left, right, float(softcap),
                      allow_tf32)


def ring_flash_attn_func(q, k, v, group=None, causal=False, softmax_scale=None,
                         window_size=(-1, -1), return_lse=False, layout="contiguous",
                         softcap=0.0):
    """Exact attention over a sequence split across the ranks of ``group``.

    Call it on every rank of ``group`` with that rank's slice; all ranks must pass the
    same shapes and arguments (checked by one small all-gather per call).

    Arguments:
        q: (batch, seqlen_local, nheads, head_dim), float16, bfloat16 or float32: this
            rank's queries, seqlen_local = seqlen / world_size.
        k, v: (batch, seqlen_local, nheads_kv, head_dim), same dtype and device; the
            same positions as q. nheads must be a multiple of nheads_kv (GQA/MQA).
        group: the torch.distributed process group forming the ring (default: world).
        causal: query at global position i sees keys j <= i (q and k cover the same
            positions, so top-left and bottom-right alignment agree).
        softmax_scale: scale of q k^T; default 1 / sqrt(head_dim).
        window_size: (left, right) in global positions: i sees j in
            [i - left, i + right]; -1 = unbounded. causal=True sets right to 0.
        return_lse: also return lse.
        layout: how the sequence is split over ranks, see ``split``.
            "contiguous": rank r holds tokens [r*L, (r+1)*L), L = seqlen_local.
            "zigzag": the sequence is cut into 2*world_size chunks; rank r holds chunks
            r and 2*world_size-1-r, concatenated. Balances the causal work across ranks;
            seqlen_local must be even. Use it for causal attention.
        softcap: if > 0, scores become softcap * tanh(scores / softcap).

    Returns:
        out: (batch, seqlen_local, nheads, head_dim), q's dtype: this rank's rows.
        lse (if return_lse): (batch, nheads, seqlen_local) float32, natural-log
            log-sum-exp of each row's scores over the whole sequence; differentiable.

    Gradients reach q, k and v of this rank's slice (dk/dv gathered over the ring).
    Raises RuntimeError when no process group is initialized.
    """
    _require_process_group()
    ring = P2PRing(group)
    cfg = _config(q, k, v, causal, softmax_scale, window_size, softcap, layout,
                  ring.world)
    signature = (*q.shape, k.shape[2], V.SUPPORTED_DTYPES.index(q.dtype),
                 cfg.softmax_scale, cfg.window_left, cfg.window_right, cfg.softcap,
                 LAYOUTS.index(layout))
    _check_ranks_agree(ring, signature, q.device)
    out, lse = RingAttention.apply(ring, cfg, q, k, v)
    return (out, lse) if return_lse else out


def ring_attention_simulated(q_slices, k_slices, v_slices, causal=False,
                             softmax_scale=None, window_size=(-1, -1), return_lse=False,
                             layout="contiguous", softcap=0.0):
    """The ring in one process: slice r plays rank r; no torch.distributed.

    Runs the same plan, kernel calls, merge and dK/dV travel as ``ring_flash_attn_func``
    (a hop is a rotation of the list), so it tests the algorithm on one device.
    ``*_slices`` are lists of world_size tensors shaped as in ``ring_flash_attn_func``,
    e.g. ``[split(q, W, r, layout) for r in range(W)]``. Differentiable. Returns the
    list of outs (and the list of lses if return_lse).
    """
    world = len(q_slices)
    if world == 0 or len(k_slices) != world or len(v_slices) != world:
        V._fail(ValueError, "q_slices, k_slices, v_slices", "three non-empty lists of "
                "equal length", (len(q_slices), len(k_slices), len(v_slices)))
    cfgs = {_config(q, k, v, causal, softmax_scale, window_size, softcap, layout, world)
            for q, k, v in zip(q_slices, k_slices, v_slices)}
    shapes = {(tuple(q.shape), tuple(k.shape)) for q, k in zip(q_slices, k_slices)}
    if len(cfgs) != 1 or len(shapes) != 1:
        V._fail(ValueError, "slice shapes", "the same shapes on every slice", shapes)
    results = RingAttention.apply(LocalRing(world), cfgs.pop(), *q_slices, *k_slices,
                                  *v_slices)
    outs, lses = list(results[:world]), list(results[world:])
    return (outs, lses) if return_lse else outs


def _chunk_order(world_size, layout):
    """Global chunk index of each (rank, local chunk), flattened in rank order."""
    if layout == "contiguous":
        return list(range(world_size))
    return [c for r in range(world_size) for c in (r, 2 * world_size - 1 - r)]


def split(x, world_size, rank, layout="contiguous", dim=1):
    """This rank's slice of a full-sequence tensor, for ``ring_flash_attn_func``.

    contiguous: chunk ``rank`` of world_size equal chunks along ``dim``. zigzag: chunks
    rank and 2*world_size-1-rank of 2*world_size, concatenated. The length along ``dim``
    must divide evenly (ValueError otherwise). Returns a copy for zigzag, a view else.
    """
    _check_layout(layout)
    if not 0 <= rank < world_size:
        V._fail(ValueError, "rank", f"0 <= rank < world_size={world_size}", rank)
    _check_divisible(x.shape[dim], world_size, layout, f"x.shape[{dim}] (seqlen)")
    chunks = x.chunk(_chunk_count(world_size, layout), dim=dim)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat((chunks[rank], chunks[2 * world_size - 1 - rank]), dim=dim)


def gather(local, group=None, layout="contiguous", dim=1):
    """The full sequence from every rank's slice (all_gather, then reorder).

    Inverse of ``split``; every rank gets the whole tensor. Not differentiable (use
    torch.distributed.nn.functional.all_gather for that).
    """
    _require_process_group()
    _check_layout(layout)
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    pieces = [c for p in parts for c in p.chunk(_chunk_count(world, layout) // world,
                                                 dim=dim)]
    ordered = [None] * len(pieces)
    for piece, index in zip(pieces, _chunk_order(world, layout)):
        ordered[index] = piece
    return torch.cat(ordered, dim=dim)


def zigzag_split(x, world_size, rank, dim=1):
    """``split(x, world_size, rank, layout="zigzag", dim=dim)``."""
    return split(x, world_size, rank, layout="zigzag", dim=dim)


def zigzag_gather(local, group=None, dim=1):
    """``gather(local, group, layout="zigzag", dim=dim)``."""
    return gather(local, group, layout="zigzag", dim=dim)
