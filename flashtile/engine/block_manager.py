"""BlockManager: which pages of the KV pool each sequence owns, and the prefix cache.

The pool holds ``num_blocks`` pages of ``page_size`` tokens. A sequence's block table
lists its pages in token order (token t lives in page ``block_table[t // page_size]`` at
offset ``t % page_size``). Pages are reference-counted so that sequences sharing a
prompt prefix share its pages.

Prefix caching (vLLM v1's scheme, nano-vllm's size): once a page is full and its KV has
been written (``commit``), it is registered under a hash chaining the previous page's
hash with the page's token ids. ``allocate`` looks a new prompt's full pages up in that
order and reuses every page that hits, so their tokens are not recomputed. A hit needs
more than an equal hash: the page's token ids must equal the prompt's, and the page
must have been registered as the child of the very page matched one position earlier
(a registration number, ``version``, identifies it). By induction the whole prefix then
matches token for token, so a hash collision can cost a cache hit but never give a
sequence another prompt's keys.

A page whose last reference goes keeps its hash and contents in the free list, which is
ordered by reuse: pages holding nothing cached first, then cached ones oldest-freed
first, so taking a page from the front evicts the least recently used cached page.

Every sequence holding pages also has a row of ``tables``, one int32 array: its block
table, then ``num_blocks`` (the runner's scratch page, one past the pool's) in the
columns past its end. Rows change only where tables do (a new sequence, a page added, a
sequence freed), so a decode step gathers its block tables from here in one numpy
operation instead of rebuilding every row from the lists (step_inputs.py).
"""

from __future__ import annotations

import array
import hashlib
import itertools
from collections import OrderedDict

import numpy as np

from flashtile._validate import _fail
from flashtile.engine.sequence import Sequence

try:
    import xxhash
except ImportError:  # optional: hashlib is slower but as good for this
    xxhash = None


def block_hash(parent_hash: int | None, token_ids) -> int:
    """64-bit hash of a full page: its parent page's hash (None for the first page)
    followed by its token ids."""
    data = array.array("q", token_ids).tobytes()
    if parent_hash is not None:
        data = parent_hash.to_bytes(8, "little") + data
    if xxhash is not None:
        return xxhash.xxh64_intdigest(data)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Block:
    """One page of the pool. hash/token_ids/version are set while it is registered in the
    prefix cache; parent_version is the version of the page before it at registration
    (0 for a sequence's first page)."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "version", "parent_version")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.forget()

    def forget(self):
        self.hash, self.token_ids, self.version, self.parent_version = None, None, 0, 0


class BlockManager:
    """Hands out pages of a pool of num_blocks pages of page_size tokens.

    The scheduler's calls, per sequence: ``allocate`` when it is admitted (False: not
    enough free pages, nothing changed), ``ensure_slots`` before each step that computes
    tokens (False: preempt someone), ``commit`` after the step wrote their KV, ``free``
    when it finishes or is preempted.
    """

    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(ValueError, name, "an int >= 1", repr(value))
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        # Prefix-cache lookups in tokens (vLLM's metrics): queried at each allocation
        # with caching on, and found cached.
        self.queried_tokens = self.hit_tokens = 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id of a registered page
        self._versions = itertools.count(1)
        self._seqs: dict[int, Sequence] = {}  # sequences holding pages, for check_invariants
        # Block table rows (see the module's doc), grown as needed; seq.table_row indexes
        # them, and a freed sequence's row goes back to _free_rows.
        self.tables = np.full((0, 0), num_blocks, dtype=np.int32)
        self._free_rows: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of the pool's pages held by sequences (cached free pages count free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the registered pages holding seq's leading full pages."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []  # prompt logprobs come from the steps that compute the prompt
        ps, hits = self.page_size, []
        parent_hash, parent_version = None, 0
        # The last token is never taken from the cache: the step that computes it produces
        # the logits of the next token.
        for i in range((seq.num_tokens - 1) // ps):
            tokens = tuple(seq.token_ids[i * ps:(i + 1) * ps])
            h = block_hash(parent_hash, tokens)
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_version != parent_version:
                break  # a hash collision: recompute rather than trust it
            hits.append(block_id)
            parent_hash, parent_version = h, block.version
        return hits

    def _pages_short(self, seq: Sequence, hits: list[int]) -> bool:
        new = seq.num_blocks(self.page_size) - len(hits)
        revived = sum(self.blocks[b].ref_count == 0 for b in hits)  # hits in the free list
        return new + revived > len(self._free)

    def can_allocate(self, seq: Sequence) -> bool:
        return not self._pages_short(seq, self._match_prefix(seq))

    def allocate(self, seq: Sequence) -> bool:
        """Give seq pages for all its tokens, reusing cached pages of its prefix.

        Sets seq.block_table, seq.num_cached_tokens and seq.num_computed_tokens (= the
        cached tokens). Returns False, changing nothing, when the pool is short.
        """
        if seq.block_table:
            _fail(ValueError, "seq.block_table", "empty (free(seq) before allocating it again)",
                  f"{len(seq.block_table)} blocks for seq {seq.seq_id}")
        hits = self._match_prefix(seq)
        if self._pages_short(seq, hits):
            return False
        if self.enable_prefix_caching:
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += len(hits) * self.page_size
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        new = seq.num_blocks(self.page_size) - len(hits)
        seq.block_table = hits + [self._take_free() for _ in range(new)]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.page_size
        if seq.prefix_hit_tokens is None:
            seq.prefix_hit_tokens = seq.num_cached_tokens
        self._seqs[seq.seq_id] = seq
        if not self._free_rows:
            held = len(self.tables)
            self._grow(rows=2 * held or 16)
            self._free_rows = list(range(len(self.tables) - 1, held - 1, -1))
        seq.table_row = self._free_rows.pop()
        self._write_row(seq, 0)
        return True

    def _grow(self, rows: int = 0, width: int = 0):
        """Make tables at least rows x width, new entries num_blocks."""
        old = self.tables
        rows, width = max(rows, old.shape[0]), max(width, old.shape[1])
        if (rows, width) != old.shape:
            self.tables = np.full((rows, width), self.num_blocks, dtype=np.int32)
            self.tables[:old.shape[0], :old.shape[1]] = old

    def _write_row(self, seq: Sequence, start: int):
        """Copy seq.block_table[start:] into its row of tables."""
        table = seq.block_table
        if len(table) > self.tables.shape[1]:
            self._grow(width=max(len(table), 2 * self.tables.shape[1]))
        self.tables[seq.table_row, start:len(table)] = table[start:]

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its contents are about to be overwritten
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
            block.forget()
        block.ref_count = 1
        return block_id

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Extend seq.block_table to hold seq.num_computed_tokens + num_new_tokens tokens.

        Returns False, changing nothing, when the pool is short.
        """
        table = seq.block_table
        total = seq.num_computed_tokens + num_new_tokens
        if table and total <= len(table) * self.page_size:
            return True  # the common decode step: the last page has room
        if seq.seq_id not in self._seqs:
            _fail(ValueError, "seq", "a sequence allocated by this BlockManager",
                  f"seq {seq.seq_id} holding no pages")
        need = -(-total // self.page_size) - len(table)
        if need > len(self._free):
            return False
        table.extend(self._take_free() for _ in range(need))
        self._write_row(seq, len(table) - need)
        return True

    def commit(self, seq: Sequence, num_tokens: int | None = None):
        """Register the pages that seq's first num_tokens tokens (default: its computed
        ones) fill, for later prompts.

        Call after the step that wrote their KV, once their token ids are known: a page
        registered earlier could be handed to another sequence before its keys exist.
        """
        if not self.enable_prefix_caching:
            return
        table, ps = seq.block_table, self.page_size
        if num_tokens is None:
            num_tokens = seq.num_computed_tokens
        full = min(num_tokens // ps, len(table))
        # Registered pages are a prefix of the table: walk back over the newly full ones.
        first = full
        while first > 0 and self.blocks[table[first - 1]].hash is None:
            first -= 1
        for i in range(first, full):
            block = self.blocks[table[i]]
            parent = self.blocks[table[i - 1]] if i else None
            block.token_ids = tuple(seq.token_ids[i * ps:(i + 1) * ps])
            block.hash = block_hash(parent.hash if parent else None, block.token_ids)
            block.version = next(self._versions)
            block.parent_version = parent.version if parent else 0
            # Two sequences that computed the same page: the first registered stays the
            # one looked up (the other still chains its own later pages by its hash).
            self._cached.setdefault(block.hash, block.block_id)

    def free(self, seq: Sequence):
        """Drop seq's pages; seq then holds none and has no computed tokens."""
        # Last page first, so that a sequence's tail is evicted before its head, which
        # other prompts are likelier to share.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(block_id, last=False)
        if self._seqs.pop(seq.seq_id, None) is not None:
            self.tables[seq.table_row, :len(seq.block_table)] = self.num_blocks
            self._free_rows.append(seq.table_row)
            seq.table_row = None
        seq.block_table = []
        seq.num_cached_tokens = seq.num_computed_tokens = 0

    def check_invariants(self):
        """Raise RuntimeError if the bookkeeping is inconsistent (for tests)."""
        def bad(what):
            raise RuntimeError(f"BlockManager invariant broken: {what}")

        refs = [0] * self.num_blocks
        rows = np.full_like(self.tables, self.num_blocks)
        for seq in self._seqs.values():
            table = seq.block_table
            rows[seq.table_row, :len(table)] = table
            if len(set(table)) != len(table):
                bad(f"seq {seq.seq_id} lists a page twice: {table}")
            if len(table) * self.page_size < seq.num_computed_tokens:
                bad(f"seq {seq.seq_id} computed tokens lie outside its {len(table)} pages")
            hashed = [self.blocks[b].hash is not None for b in table]
            if hashed != sorted(hashed, reverse=True):
                bad(f"seq {seq.seq_id}: registered pages are not a prefix of its table")
            for i, block_id in enumerate(table):
                refs[block_id] += 1
                tokens = self.blocks[block_id].token_ids
                own = tuple(seq.token_ids[i * self.page_size:(i + 1) * self.page_size])
                if tokens is not None and tokens != own:
                    bad(f"seq {seq.seq_id} page {i} holds tokens of another prefix")
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                bad(f"block {block.block_id} ref_count {block.ref_count}, "
                    f"held {refs[block.block_id]} times")
            if (block.ref_count == 0) != (block.block_id in self._free):
                bad(f"block {block.block_id} (ref {block.ref_count}) free-list membership")
        for h, block_id in self._cached.items():
            if self.blocks[block_id].hash != h:
                bad(f"cache entry {h:#x} points at block {block_id} of another hash")
        if not np.array_equal(rows, self.tables):
            bad("the rows of tables differ from the sequences' block tables")
        held = [seq.table_row for seq in self._seqs.values()]
        if sorted(held + self._free_rows) != list(range(len(self.tables))):
            bad(f"table rows held {sorted(held)}, free {sorted(self._free_rows)}")
