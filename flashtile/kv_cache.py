"""KV caches for inference: a contiguous one (gpt-fast style) and a paged one (vLLM style).

``KVCache`` holds (batch, max_seqlen, nheads_kv, head_dim) per layer and writes new
tokens with ``update(layer, input_pos, k, v)``.

``PagedKVCache`` holds a pool of fixed-size blocks per layer in flash-attn's paged layout,
``k_cache[layer]`` of shape (num_blocks, page_size, nheads_kv, head_dim), and maps each
sequence to its list of blocks. Token ``t`` of a sequence lives in block
``block_table[t // page_size]`` at offset ``t % page_size``. Blocks are reference
counted, so ``fork`` shares a prefix between sequences (beam search, parallel sampling)
and a shared, partly filled last block is copied before anyone appends into it
(copy-on-write). One decode step::

    for seq_id in seq_ids:
        cache.reserve(seq_id, 1)          # grow by one token, copy-on-write if shared
    plan = cache.plan(seq_ids)            # once per step, reused by every layer
    for layer in range(num_layers):
        for i, seq_id in enumerate(seq_ids):
            cache.write(layer, seq_id, k[i], v[i])      # k[i]: (1, nheads_kv, head_dim)
        out = flashtile.flash_attn_with_kvcache(
            q, cache.k_cache[layer], cache.v_cache[layer], causal=True,
            block_table=plan.block_table, cache_seqlens=plan.cache_seqlens)

``plan.cache_seqlens`` counts the reserved tokens. To let ``flash_attn_with_kvcache``
write the new tokens itself instead (its ``k=``, ``v=``), skip ``write`` and pass
``cache_seqlens=plan.cache_seqlens - 1`` (the length before the append, flash-attn's
meaning); ``reserve`` has already given the block table room for them.

Absorbed MLA (DeepSeek's 576/512 decode over one latent cache): ``shared_kv=True`` makes
``v_cache`` the view of ``k_cache``'s first ``head_dim_v`` columns, writes take k alone,
and ``flash_attn_with_kvcache`` reads V from K's tiles.

Everything here is plain PyTorch; the bookkeeping (free list, reference counts, block
lists) lives in Python on the host, the tensors on ``device``.
"""

from __future__ import annotations

import numbers
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from flashtile import _validate as V

MIN_PAGE_SIZE, MAX_PAGE_SIZE = 16, 256


class CacheFullError(RuntimeError):
    """The block pool has fewer free blocks than a request needs.

    Attributes: ``blocks_needed`` and ``blocks_free`` (and the message says how to fix it).
    Raised before anything changes: the cache is as it was before the call.
    """

    def __init__(self, blocks_needed: int, blocks_free: int, num_blocks: int, what: str):
        self.blocks_needed = blocks_needed
        self.blocks_free = blocks_free
        super().__init__(
            f"PagedKVCache is full: {what} needs {blocks_needed} free blocks, "
            f"{blocks_free} of {num_blocks} are free. Remove finished sequences "
            "(remove_sequence) or create the cache with a larger num_blocks")


def _check_int(x, name, minimum=None, maximum=None):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        V._fail(TypeError, name, "an int", type(x).__name__)
    if minimum is None:
        return int(x)
    if x < minimum or (maximum is not None and x > maximum):
        bound = f"an int >= {minimum}" if maximum is None else f"{minimum} to {maximum}"
        V._fail(ValueError, name, bound, x)
    return int(x)


def _check_layout(num_layers, nheads_kv, head_dim, head_dim_v, dtype, shared_kv=False):
    """Returns head_dim_v (None: head_dim)."""
    if not isinstance(shared_kv, bool):
        V._fail(TypeError, "shared_kv", "a bool", type(shared_kv).__name__)
    _check_int(num_layers, "num_layers", 1)
    _check_int(nheads_kv, "nheads_kv", 1)
    _check_int(head_dim, "head_dim")
    head_dim_v = head_dim if head_dim_v is None else _check_int(head_dim_v, "head_dim_v")
    # The head dims flash_attn_with_kvcache reads (576: absorbed MLA's keys).
    if not (1 <= head_dim <= V.MAX_HEAD_DIM or head_dim == V.MLA_HEAD_DIM):
        V._fail(ValueError, "head_dim", f"1 to {V.MAX_HEAD_DIM}, or {V.MLA_HEAD_DIM}",
                head_dim)
    if not 1 <= head_dim_v <= V.MAX_HEAD_DIM:
        V._fail(ValueError, "head_dim_v", f"1 to {V.MAX_HEAD_DIM} (None: head_dim)",
                head_dim_v)
    if dtype not in V.SUPPORTED_DTYPES:
        V._fail(TypeError, "dtype", "torch.float16, torch.bfloat16 or torch.float32", dtype)
    if shared_kv and head_dim_v >= head_dim:
        V._fail(ValueError, "head_dim_v", f"less than head_dim={head_dim} with shared_kv "
                "(v is the first head_dim_v columns of each key row)", head_dim_v)
    return int(head_dim_v)


def _allocate(cache, slots, num_layers, nheads_kv, head_dim, head_dim_v, dtype, device,
              shared_kv=False):
    """The layout fields and the zeroed k_cache (num_layers, *slots, nheads_kv,
    head_dim) and v_cache (..., head_dim_v) of a validated cache; with shared_kv,
    v_cache is the view of k_cache's first head_dim_v columns (absorbed MLA's latent
    cache: flash_attn_with_kvcache then reads V from K's tiles). Its device is the one
    the tensors landed on: "cuda" resolves to "cuda:N", and inputs are compared against
    it."""
    cache.num_layers, cache.nheads_kv, cache.head_dim = num_layers, nheads_kv, head_dim
    cache.head_dim_v, cache.dtype, cache.shared_kv = head_dim_v, dtype, shared_kv
    shape = (num_layers, *slots, nheads_kv)
    cache.k_cache = torch.zeros((*shape, head_dim), dtype=dtype, device=device)
    cache.v_cache = cache.k_cache[..., :head_dim_v] if shared_kv else \
        torch.zeros((*shape, head_dim_v), dtype=dtype, device=device)
    cache.device = cache.k_cache.device


def _check_v_given(cache, v, name):
    """A shared latent cache takes k alone (its rows hold v too); the others need v."""
    if cache.shared_kv and v is not None:
        V._fail(ValueError, name, "None for a shared_kv cache (v_cache is k_cache[..., "
                f":{cache.head_dim_v}]: write the latent rows as k)", type(v).__name__)
    if not cache.shared_kv and v is None:
        V._fail(TypeError, name, "a torch.Tensor", "None",
                "Only a shared_kv cache takes k alone")


def _check_new_kv(x, name, leading_dims, nheads_kv, head_dim, dtype, device):
    # head_dim: the cache's k head dim for k, its v head dim for v.
    """x: (*leading_dims, nheads_kv, head_dim) in the cache's dtype and device; a leading
    dim given as a str (its name) may have any size, one given as an int must match."""
    if not isinstance(x, torch.Tensor):
        V._fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    if x.dtype != dtype:
        V._fail(TypeError, f"{name}.dtype", f"the cache's dtype {dtype}", x.dtype,
                f"Pass {name}.to({dtype})")
    if x.device != device:
        V._fail(ValueError, f"{name}.device", f"the cache's device {device}", x.device)
    expected = (*leading_dims, nheads_kv, head_dim)
    if x.dim() != len(expected) or any(
            isinstance(e, int) and g != e for g, e in zip(x.shape, expected)):
        shown = ", ".join(str(e) for e in leading_dims)
        V._fail(ValueError, f"{name}.shape", f"({shown}, nheads_kv={nheads_kv}, "
                f"head_dim={head_dim})", tuple(x.shape))


def _check_layer(layer, num_layers):
    return _check_int(layer, "layer", 0, num_layers - 1)


# ---------------------------------------------------------------------------------------
# Contiguous cache

class KVCache:
    """Contiguous KV cache: per layer, k/v of shape (max_batch, max_seqlen, nheads_kv,
    head_dim), zero-initialised.

    Arguments:
        max_batch, max_seqlen: capacity in sequences and tokens per sequence.
        num_layers, nheads_kv, head_dim: the model's layout (head_dim 1 to 512, or 576).
        dtype: float16, bfloat16 or float32; device: where the tensors live.
        head_dim_v: v's head dim when it differs from k's (MLA, 1 to 512; None: head_dim).
        shared_kv: absorbed MLA's latent cache: v_cache is a view of k_cache's first
            head_dim_v columns (head_dim_v < head_dim), and writes take k alone.

    Attributes:
        k_cache, v_cache: (num_layers, max_batch, max_seqlen, nheads_kv, head_dim), v's
            last dim head_dim_v;
            ``k_cache[layer][:batch]`` is what an attention call reads, with
            ``cache_seqlens[:batch]`` telling how many tokens of each row are valid.
        cache_seqlens: (max_batch,) int32 on ``device``, the number of tokens written
            so far per row (one past the last position of the latest ``update``).
    """

    def __init__(self, max_batch, max_seqlen, num_layers, nheads_kv, head_dim,
                 dtype=torch.float16, device="cpu", head_dim_v=None, shared_kv=False):
        _check_int(max_batch, "max_batch", 1)
        _check_int(max_seqlen, "max_seqlen", 1)
        head_dim_v = _check_layout(num_layers, nheads_kv, head_dim, head_dim_v, dtype,
                                   shared_kv)
        self.max_batch, self.max_seqlen = int(max_batch), int(max_seqlen)
        _allocate(self, (max_batch, max_seqlen), num_layers, nheads_kv, head_dim,
                  head_dim_v, dtype, device, shared_kv)
        self.cache_seqlens = torch.zeros(max_batch, dtype=torch.int32, device=self.device)

    def reset(self):
        """Forget every token (the tensors keep their memory and old values)."""
        self.cache_seqlens.zero_()

    def update(self, layer, input_pos, k, v=None):
        """Write new tokens of every batch row at ``input_pos``; returns the layer's
        (k_cache, v_cache) views of shape (batch, max_seqlen, nheads_kv, head_dim), v's
        last dim head_dim_v.

        Arguments:
            layer: int in [0, num_layers).
            input_pos: an int, the position of the first new token (the tokens go to
                input_pos .. input_pos + n_new - 1), or an integer tensor (n_new,) of
                positions on the cache's device, shared by every row (gpt-fast).
            k, v: (batch, n_new, nheads_kv, head_dim) in the cache's dtype and device,
                v's last dim head_dim_v, batch <= max_batch; rows 0 .. batch-1 are
                written. A shared_kv cache takes k alone (v None).

        Positions past max_seqlen raise ValueError before anything is written. A tensor
        ``input_pos`` on the CPU is checked so; on a GPU reading it would be a sync, so it
        is checked only with ``flashtile.set_index_checks(True)`` (or
        FLASHTILE_CHECK_INDICES=1), and otherwise left to index_copy_'s own bounds check
        on the device (an error, never a write out of bounds), as under torch.compile,
        whose decode step then has no graph break.
        Sets ``cache_seqlens[:batch]`` to the last position + 1.
        """
        layer = _check_layer(layer, self.num_layers)
        _check_v_given(self, v, "v")
        if self.shared_kv:  # v's columns are k's: one write
            v = k[..., :self.head_dim_v]
        for x, name, d in ((k, "k", self.head_dim), (v, "v", self.head_dim_v)):
            _check_new_kv(x, name, ("batch", "n_new"), self.nheads_kv, d, self.dtype,
                          self.device)
        if v.shape[:-1] != k.shape[:-1]:
            V._fail(ValueError, "v.shape[:-1]", f"k's {tuple(k.shape[:-1])}",
                    tuple(v.shape[:-1]))
        batch, n_new = k.shape[:2]
        if batch > self.max_batch:
            V._fail(ValueError, "k.shape[0] (batch)", f"at most max_batch={self.max_batch}",
                    batch)
        k_layer, v_layer = self.k_cache[layer, :batch], self.v_cache[layer, :batch]
        if isinstance(input_pos, torch.Tensor):
            self._check_positions(input_pos, n_new)
            if n_new:
                k_layer.index_copy_(1, input_pos, k)
                if not self.shared_kv:
                    v_layer.index_copy_(1, input_pos, v)
                self.cache_seqlens[:batch] = input_pos.max().to(torch.int32) + 1
        else:
            start = _check_int(input_pos, "input_pos", 0)
            if start + n_new > self.max_seqlen:
                V._fail(ValueError, "input_pos + n_new", f"at most max_seqlen="
                        f"{self.max_seqlen}", f"{start} + {n_new} = {start + n_new}",
                        "Create the KVCache with a larger max_seqlen")
            k_layer[:, start:start + n_new] = k
            if not self.shared_kv:
                v_layer[:, start:start + n_new] = v
            self.cache_seqlens[:batch] = start + n_new
        return self.k_cache[layer, :batch], self.v_cache[layer, :batch]

    def _check_positions(self, input_pos, n_new):
        if input_pos.dtype not in (torch.int32, torch.int64):
            V._fail(TypeError, "input_pos.dtype", "torch.int64 or torch.int32",
                    input_pos.dtype)
        if input_pos.device != self.device:
            V._fail(ValueError, "input_pos.device", f"the cache's device {self.device}",
                    input_pos.device)
        if tuple(input_pos.shape) != (n_new,):
            V._fail(ValueError, "input_pos.shape", f"(n_new,) = ({n_new},) from k",
                    tuple(input_pos.shape))
        if n_new and (input_pos.device.type == "cpu" or V.index_checks_enabled()) \
                and V.can_read_indices(input_pos):
            lo, hi = int(input_pos.min()), int(input_pos.max())
            if lo < 0 or hi >= self.max_seqlen:
                V._fail(ValueError, "input_pos", f"positions in [0, max_seqlen="
                        f"{self.max_seqlen})", f"positions from {lo} to {hi}",
                        "Create the KVCache with a larger max_seqlen")


# ---------------------------------------------------------------------------------------
# Paged cache

@dataclass(frozen=True)
class PagedPlan:
    """Paged-attention metadata of one decode step, built once and reused by every layer.

    block_table: (batch, max_blocks_per_seq) int32 on the cache's device; row i lists the
        blocks of seq_ids[i] in token order, padded with 0 past its last block.
    cache_seqlens: (batch,) int32 on the cache's device, tokens per sequence.
    max_seqlen: int, the largest of cache_seqlens (host-side, no sync needed).
    """
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    max_seqlen: int


@dataclass
class _Sequence:
    blocks: list          # block ids, in token order
    seqlen: int = 0       # tokens, the reserved ones included
    pending: tuple = ()   # (block, offset) slots of the latest reserve(), for write()


class PagedKVCache:
    """Paged KV cache: a reference-counted pool of blocks of ``page_size`` tokens.

    Arguments:
        num_blocks: blocks in the pool (shared by every sequence and layer).
        page_size: tokens per block, a power of two from 16 to 256.
        num_layers, nheads_kv, head_dim: the model's layout (head_dim 1 to 512, or 576).
        dtype: float16, bfloat16 or float32; device: where the tensors live.
        head_dim_v: v's head dim when it differs from k's (MLA, 1 to 512; None: head_dim).
        shared_kv: absorbed MLA's latent cache: v_cache is a view of k_cache's first
            head_dim_v columns (head_dim_v < head_dim), and writes take k alone.

    Attributes:
        k_cache, v_cache: (num_layers, num_blocks, page_size, nheads_kv, head_dim), v's
            last dim head_dim_v, zero-initialised; ``k_cache[layer]`` is flash-attn's
            paged ``k_cache`` (num_blocks, page_size, nheads_kv, head_dim), to pass
            with a ``block_table`` and ``cache_seqlens`` from ``plan``.

    Blocks go out in free-list order (first freed, first reused), so a sequence's blocks
    are in general not adjacent in the pool.
    """

    def __init__(self, num_blocks, page_size, num_layers, nheads_kv, head_dim,
                 dtype=torch.float16, device="cpu", head_dim_v=None, shared_kv=False):
        _check_int(num_blocks, "num_blocks", 1)
        _check_int(page_size, "page_size")
        # Key tiles are powers of two, at least 16 (tl.dot's minimum): with a power-of-
        # two page_size a tile of up to page_size keys never straddles two blocks.
        if not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE or page_size & (page_size - 1):
            V._fail(ValueError, "page_size", f"a power of two from {MIN_PAGE_SIZE} to "
                    f"{MAX_PAGE_SIZE}", page_size)
        head_dim_v = _check_layout(num_layers, nheads_kv, head_dim, head_dim_v, dtype,
                                   shared_kv)
        self.num_blocks, self.page_size = int(num_blocks), int(page_size)
        _allocate(self, (num_blocks, page_size), num_layers, nheads_kv, head_dim,
                  head_dim_v, dtype, device, shared_kv)
        self._free = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._allocated: set = set()      # blocks held by allocate() callers, not sequences
        self._seqs: dict = {}

    # -- block allocator ----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block: int) -> int:
        """How many owners (sequences, or allocate() callers) hold ``block``."""
        return self._ref_counts[_check_int(block, "block", 0, self.num_blocks - 1)]

    def allocate(self, n: int) -> list:
        """Take ``n`` free blocks, each with reference count 1, for the caller to give
        back with ``free``. Raises CacheFullError (and takes nothing) if fewer than
        ``n`` are free."""
        n = _check_int(n, "n", 0)
        self._ensure_free(n, f"allocate({n})")
        blocks = self._take(n)
        self._allocated.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Give back blocks taken with ``allocate``; each becomes free again.

        Raises ValueError, changing nothing, if any block is out of range, listed twice,
        free already, or held by a sequence (those go back with ``remove_sequence``).
        """
        if not isinstance(blocks, Sequence):
            V._fail(TypeError, "blocks", "a sequence of block ids", type(blocks).__name__)
        ids = {}                  # an ordered set: blocks go back in the order given
        for block in blocks:      # all checked before any count changes
            self._check_allocated(block, seen=ids)
            ids[int(block)] = None
        self._allocated.difference_update(ids)
        self._release(list(ids))

    def _check_allocated(self, block, seen):
        if isinstance(block, bool) or not isinstance(block, numbers.Integral):
            V._fail(TypeError, "blocks", "int block ids", type(block).__name__)
        if not 0 <= block < self.num_blocks:
            V._fail(ValueError, "blocks", f"block ids 0 to {self.num_blocks - 1}",
                    f"block {block}")
        expected = "blocks taken with allocate(), each listed once"
        if block in seen:
            V._fail(ValueError, "blocks", expected, f"block {block} listed twice "
                    "(a double free)")
        if block in self._allocated:
            return
        if self._ref_counts[block] == 0:
            V._fail(ValueError, "blocks", expected, f"block {block}, which is free "
                    "(never allocated, or freed already)")
        owner = next(s for s, q in self._seqs.items() if block in q.blocks)
        V._fail(ValueError, "blocks", expected, f"block {block}, which belongs to "
                f"sequence {owner!r}", "A sequence's blocks go back with remove_sequence")

    def _take(self, n):
        """n blocks off the free list, each with count 1 (the caller checked they exist)."""
        blocks = [self._free.popleft() for _ in range(n)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def _release(self, blocks):
        """Drop one reference to each block; a block whose count reaches 0 is free."""
        for block in blocks:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def _ensure_free(self, needed, what):
        if needed > len(self._free):
            raise CacheFullError(needed, len(self._free), self.num_blocks, what)

    # -- sequences ----------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable) -> None:
        """Start an empty sequence (it holds no block until tokens are reserved)."""
        if seq_id in self._seqs:
            V._fail(ValueError, "seq_id", "a new sequence id", f"{seq_id!r}, already in "
                    "the cache")
        self._seqs[seq_id] = _Sequence(blocks=[])

    def remove_sequence(self, seq_id: Hashable) -> None:
        """Drop the sequence; blocks no other sequence shares go back to the pool."""
        self._release(self._seq(seq_id).blocks)
        del self._seqs[seq_id]

    def fork(self, seq_id: Hashable, new_seq_id: Hashable) -> None:
        """Start ``new_seq_id`` as a copy of ``seq_id`` that shares all its blocks.

        No data moves: each block's reference count goes up by one. The first append
        of either sequence into a shared, partly filled last block copies that block.
        Fork after the step's ``write`` calls are done: the source's pending slots are
        not carried over.
        """
        src = self._seq(seq_id)
        if new_seq_id in self._seqs:
            V._fail(ValueError, "new_seq_id", "a new sequence id", f"{new_seq_id!r}, "
                    "already in the cache")
        for block in src.blocks:
            self._ref_counts[block] += 1
        self._seqs[new_seq_id] = _Sequence(blocks=list(src.blocks), seqlen=src.seqlen)

    def seqlen(self, seq_id: Hashable) -> int:
        """Tokens in the sequence, the reserved ones included."""
        return self._seq(seq_id).seqlen

    def blocks(self, seq_id: Hashable) -> tuple:
        """The sequence's block ids in token order."""
        return tuple(self._seq(seq_id).blocks)

    def _seq(self, seq_id):
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            V._fail(ValueError, "seq_id", "a sequence of the cache (add it with "
                    "add_sequence)", repr(seq_id))

    # -- writing tokens -----------------------------------------------------------------

    def reserve(self, seq_id: Hashable, num_new_tokens: int) -> list:
        """Grow the sequence by ``num_new_tokens`` and return their (block, offset) slots.

        Allocates the blocks the new tokens need and, if the last block is shared with
        another sequence and partly filled, first copies it (every layer, k and v) to a
        block of its own (copy-on-write). Raises CacheFullError, changing nothing, if
        the pool lacks the blocks. ``write`` then fills these slots, layer by layer.
        """
        seq = self._seq(seq_id)
        n = _check_int(num_new_tokens, "num_new_tokens", 0)
        page = self.page_size
        in_last = seq.seqlen % page            # tokens already in the last block
        copy_last = in_last > 0 and n > 0 and self._ref_counts[seq.blocks[-1]] > 1
        new_blocks = -(-(seq.seqlen + n) // page) - len(seq.blocks)
        self._ensure_free(new_blocks + copy_last,
                          f"reserving {n} tokens for sequence {seq_id!r}")
        if copy_last:
            shared = seq.blocks[-1]
            (own,) = self._take(1)
            self.k_cache[:, own] = self.k_cache[:, shared]
            if not self.shared_kv:  # else copied with k
                self.v_cache[:, own] = self.v_cache[:, shared]
            self._release([shared])
            seq.blocks[-1] = own
        seq.blocks.extend(self._take(new_blocks))
        positions = range(seq.seqlen, seq.seqlen + n)
        seq.pending = tuple((seq.blocks[t // page], t % page) for t in positions)
        seq.seqlen += n
        return list(seq.pending)

    def write(self, layer: int, seq_id: Hashable, k: torch.Tensor,
              v: torch.Tensor | None = None) -> None:
        """Write the tokens of the sequence's latest ``reserve`` into one layer.

        k, v: (num_new_tokens, nheads_kv, head_dim) in the cache's dtype and device,
        v's last dim head_dim_v, num_new_tokens as reserved (a shared_kv cache takes k
        alone). Call once per layer (writing a layer again overwrites the same slots).
        """
        layer = _check_layer(layer, self.num_layers)
        seq = self._seq(seq_id)
        n = len(seq.pending)
        _check_v_given(self, v, "v")
        _check_new_kv(k, "k", (n,), self.nheads_kv, self.head_dim, self.dtype, self.device)
        if not self.shared_kv:
            _check_new_kv(v, "v", (n,), self.nheads_kv, self.head_dim_v, self.dtype,
                          self.device)
        if n == 0:
            return
        slots = torch.tensor(seq.pending, dtype=torch.int64).to(self.device)
        self.k_cache[layer][slots[:, 0], slots[:, 1]] = k
        if not self.shared_kv:  # a shared cache's v is k's first columns: written
            self.v_cache[layer][slots[:, 0], slots[:, 1]] = v

    def append(self, seq_id: Hashable, layer_k, layer_v=None) -> list:
        """``reserve`` then ``write`` in every layer; returns the slots.

        layer_k, layer_v: (num_layers, num_new_tokens, nheads_kv, head_dim) tensors, or
        sequences of num_layers (num_new_tokens, nheads_kv, head_dim) tensors (v's last
        dim head_dim_v; a shared_kv cache takes layer_k alone). All are checked before
        the sequence grows.
        """
        _check_v_given(self, layer_v, "layer_v")
        layer_k = self._stack_layers(layer_k, "layer_k", self.head_dim)
        if not self.shared_kv:
            layer_v = self._stack_layers(layer_v, "layer_v", self.head_dim_v)
            if layer_v.shape[:-1] != layer_k.shape[:-1]:
                V._fail(ValueError, "layer_v.shape[:-1]",
                        f"layer_k's {tuple(layer_k.shape[:-1])}",
                        tuple(layer_v.shape[:-1]))
        slots = self.reserve(seq_id, layer_k.shape[1])
        for layer in range(self.num_layers):
            self.write(layer, seq_id, layer_k[layer],
                       None if self.shared_kv else layer_v[layer])
        return slots

    def _stack_layers(self, x, name, head_dim):
        if isinstance(x, (list, tuple)):
            if len(x) != self.num_layers:
                V._fail(ValueError, f"len({name})", f"num_layers={self.num_layers}", len(x))
            for i, t in enumerate(x):
                _check_new_kv(t, f"{name}[{i}]", ("num_new_tokens",), self.nheads_kv,
                              head_dim, self.dtype, self.device)
            x = torch.stack(list(x))
        _check_new_kv(x, name, (self.num_layers, "num_new_tokens"), self.nheads_kv,
                      head_dim, self.dtype, self.device)
        return x

    # -- attention metadata -------------------------------------------------------------

    def block_table(self, seq_ids: Sequence[Hashable], max_blocks_per_seq=None):
        """(batch, max_blocks_per_seq) int32 on the cache's device: row i lists the blocks
        of seq_ids[i] in token order.

        Padding: entries past a sequence's last block are 0. Block 0 is an ordinary
        block that may belong to another sequence, so a kernel must read only the first
        ceil(cache_seqlens[i] / page_size) entries of row i (flash-attn's rule).
        max_blocks_per_seq: the width; default the longest row (at least 1). Pass a
        fixed width to keep shapes static (CUDA graphs); it must fit every row.
        """
        rows = [self._seq(s).blocks for s in seq_ids]
        longest = max((len(r) for r in rows), default=0)
        if max_blocks_per_seq is None:
            width = max(longest, 1)
        else:
            width = _check_int(max_blocks_per_seq, "max_blocks_per_seq", max(longest, 1))
        table = torch.zeros((len(rows), width), dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(self.device)

    def cache_seqlens(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """(batch,) int32 on the cache's device: tokens of each sequence (reserved
        included, so call it after the step's ``reserve``)."""
        lens = [self._seq(s).seqlen for s in seq_ids]
        return torch.tensor(lens, dtype=torch.int32).to(self.device)

    def plan(self, seq_ids: Sequence[Hashable], max_blocks_per_seq=None) -> PagedPlan:
        """block_table, cache_seqlens and max_seqlen of ``seq_ids``, built once per
        decode step (after ``reserve``) and passed to every layer's attention call
        (FlashInfer's plan/run split: the host-side work is not repeated per layer)."""
        seq_ids = list(seq_ids)
        lens = [self._seq(s).seqlen for s in seq_ids]
        cache_seqlens = torch.tensor(lens, dtype=torch.int32).to(self.device)
        return PagedPlan(block_table=self.block_table(seq_ids, max_blocks_per_seq),
                         cache_seqlens=cache_seqlens, max_seqlen=max(lens, default=0))
