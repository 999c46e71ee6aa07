"""A step's inputs: the packed index buffers and the AttentionMetadata every layer reads.

Per step the scheduler hands over (sequence, number of new tokens) pairs. ``prepare``
builds the step once, on the host, as one int64 and one int32 buffer (a HostStep: a
prefill's from flat lists of ints, a decode step's with numpy over a few values read per
sequence and the block manager's table rows), and ``upload`` copies them to the device
(pinned memory on CUDA, without blocking) and makes the AttentionMetadata. Input tokens
still in flight (placeholders, see sequence.py) are gathered on the device from the last
launched step's sampled ids, so a step can be launched before the previous one's tokens
reach the host (asynchronous scheduling, llm.py).

A pure decode step (one new token per sequence) is laid out as the CUDA graphs' static
inputs (cuda_graphs.py), padded to the graph's batch size, so that a replay takes them
in two copies.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from array import array
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from flashtile.engine.attention import AttentionMetadata


@dataclass
class HostStep:
    """One step's inputs on the host: each index tensor a run of one int64 or one int32
    buffer, and the host values of its metadata. ``upload`` makes the device inputs from
    it; under tensor parallelism rank 0 sends it to the other ranks, which upload the
    same (engine/workers.py)."""

    longs: array         # int64 runs: input_ids, positions, slot_mapping, logits_indices,
    #                      key_slots, and the in-flight tokens' dst/src gather indices
    #                      (an array.array, or a numpy array for a decode step)
    ints: array          # int32 runs: cu_seqlens_q/k, cache_seqlens, block_tables
    o64: dict            # run name -> (offset, length) in longs; logits_indices and
    #                      key_slots absent when None
    o32: dict            # run name -> (offset, length) in ints
    batch: int           # sequences in the step
    width: int           # block table columns
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool
    has_context: bool
    query_lens: list
    key_lens: list
    sample_rows: list    # indices into the step's sequences that sample
    graph_bs: Optional[int] = None  # a decode step replayed in this batch size's graph
    # SamplingParams.prompt_logprobs: (sequence index, first position, count) per
    # sequence whose prompt positions first..first+count-1 predict prompt tokens this
    # step (rows prompt_rows, targets prompt_targets in longs), and the most
    # alternatives one asks for.
    prompt_spans: list = dataclasses.field(default_factory=list)
    prompt_top: int = 0


@dataclass
class StepInputs:
    input_ids: torch.Tensor      # (T,) int64
    positions: torch.Tensor      # (T,) int64
    meta: AttentionMetadata
    logits_indices: Optional[torch.Tensor]  # (S,) rows of the hidden states to sample
    #                                         from; None: every row, in order
    sample_rows: list            # indices into the step's sequences that sample
    host: HostStep               # what these were made from
    graph_bs: Optional[int] = None  # a decode step replayed in this batch size's graph
    prompt_rows: Optional[torch.Tensor] = None     # (R,) hidden rows that predict prompt
    prompt_targets: Optional[torch.Tensor] = None  # (R,) tokens (HostStep.prompt_spans)


def _packed(segments, typecode: str):
    """Runs of ints back to back in one array, each starting at a multiple of 16 bytes:
    (array, [(offset, length)]). Triton specialises a pointer argument on 16-byte
    alignment, so a kernel reading a view at an unaligned offset (cu_seqlens_k after
    batch + 1 int32s) compiled another variant; run E5 paid four such compiles inside its
    timed run."""
    out, places = array(typecode), []
    step = 16 // out.itemsize
    for seg in segments:
        out.extend(array(typecode, [0]) * (-len(out) % step))
        start = len(out)
        out.extend(array(typecode, seg))
        places.append((start, len(out) - start))
    return out, places


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _extend_slots(out: list, table: list, start: int, end: int, page_size: int):
    """Append the pool slots of positions start..end-1 of a sequence with this block
    table: one range per page instead of a division per token."""
    while start < end:
        page, offset = divmod(start, page_size)
        n = min(end - start, page_size - offset)
        base = table[page] * page_size + offset
        out += range(base, base + n)
        start += n


class StepInputsMixin:
    """ModelRunner's step-input building. Reads the runner's config, device, page_size,
    scratch_block, block_manager, _graph_list and _last_tokens, and writes decode steps
    into the graphs' static inputs (CudaGraphsMixin._to_graph_inputs)."""

    def prepare(self, scheduled) -> StepInputs:
        """Inputs of one step; scheduled: [(sequence, new tokens)] in batch order.

        Host cost matters here (a decode step of a 1B model is ~4 ms of GPU time at batch
        256): everything is packed into one int64 and one int32 buffer, moved in one copy
        each.
        """
        if {n for _, n in scheduled} == {1}:
            host = self._host_decode(scheduled)
            if host is not None:
                return self.upload(host)
        return self.upload(self._host_prefill(scheduled))

    @torch.inference_mode()  # decode steps write into the graphs' static (inference) inputs
    def upload(self, host: HostStep) -> StepInputs:
        """A step's device inputs from its host buffers: one copy each (into the static
        inputs of its CUDA graph for a replayed decode step), views of them, and the
        tokens still in flight gathered on the device."""
        if host.graph_bs is not None:
            dev64, dev32 = self._to_graph_inputs(host.longs, host.ints, host.graph_bs)
            # Views of a graph's static inputs stay valid: the last step's serve the next
            # one of the same layout (most decode steps) without a dozen slicings.
            layout = (host.width, host.batch, *host.o64.items(), *host.o32.items())
            buffers, last, t = self._graph_views
            if buffers is not dev64 or last != layout:
                t = self._views(dev64, dev32, host)
                self._graph_views = dev64, layout, t
        else:
            t = self._views(self._to_device(host.longs, torch.int64),
                            self._to_device(host.ints, torch.int32), host)
        self._gather_ids(t["input_ids"], t["dst"], t["src"])
        meta = AttentionMetadata(
            cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"],
            max_seqlen_q=host.max_seqlen_q, max_seqlen_k=host.max_seqlen_k,
            slot_mapping=t["slot_mapping"], cache_seqlens=t["cache_seqlens"],
            block_tables=t["block_tables"],
            is_decode=host.is_decode, has_context=host.has_context,
            query_lens=host.query_lens, key_lens=host.key_lens, key_slots=t.get("key_slots"))
        return StepInputs(input_ids=t["input_ids"], positions=t["positions"], meta=meta,
                          logits_indices=t.get("logits_indices"),
                          sample_rows=host.sample_rows, host=host, graph_bs=host.graph_bs,
                          prompt_rows=t.get("prompt_rows"),
                          prompt_targets=t.get("prompt_targets"))

    @staticmethod
    def _views(dev64, dev32, host: HostStep) -> dict:
        """The step's index tensors: views of its device buffers (block_tables 2-D)."""
        t = {name: dev64[o:o + n] for name, (o, n) in host.o64.items()}
        t.update((name, dev32[o:o + n]) for name, (o, n) in host.o32.items())
        t["block_tables"] = t["block_tables"].view(-1, host.width)[:host.batch]
        return t

    def _host_prefill(self, scheduled) -> HostStep:
        """A step with some sequence computing more than one token: every run packed at a
        16-byte offset (see _packed)."""
        bs, ps = len(scheduled), self.page_size
        # Widths and max_seqlen_q rounded up to 16: Triton specialises int arguments on
        # divisibility by 16, so this keeps one compiled variant of the varlen kernel.
        width = _round_up(max(len(seq.block_table) for seq, _ in scheduled), 16)
        pad = [self.scratch_block] * width
        ids, pos, slots, tables, qlens, klens = [], [], [], [], [], []
        sample_rows, logits_indices, dst, src = [], [], [], []
        prompt_rows, prompt_targets, prompt_spans = [], [], []
        for b, (seq, n) in enumerate(scheduled):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if seq.prompt_logprobs is not None:  # positions that predict prompt tokens
                last = min(end, seq.num_prompt_tokens - 1)
                if start < last:
                    prompt_rows += range(len(ids), len(ids) + last - start)
                    prompt_targets += seq.token_ids[start + 1:last + 1]
                    prompt_spans.append((b, start, last - start))
            ids += seq.token_ids[start:end]
            if ids[-1] < 0:  # the last token is in flight: read it on the device
                dst.append(len(ids) - 1)
                src.append(-1 - ids[-1])
                ids[-1] = 0
            pos += range(start, end)
            _extend_slots(slots, table, start, end, ps)
            tables += table
            tables += pad[len(table):]
            qlens.append(n)
            klens.append(end)
            if end == len(seq.token_ids):
                sample_rows.append(b)
                logits_indices.append(len(ids) - 1)
        has_context = any(k != q for q, k in zip(qlens, klens))
        key_slots = []
        if has_context and self.config.attention_backend != "flashtile":
            for seq, n in scheduled:
                _extend_slots(key_slots, seq.block_table, 0,
                              seq.num_computed_tokens + n, ps)
        longs, o64 = _packed((ids, pos, slots, logits_indices, key_slots, dst, src,
                              prompt_rows, prompt_targets), "q")
        ints, o32 = _packed((itertools.accumulate(qlens, initial=0),
                             itertools.accumulate(klens, initial=0), klens, tables), "i")
        o64 = dict(zip(("input_ids", "positions", "slot_mapping", "logits_indices",
                        "key_slots", "dst", "src", "prompt_rows", "prompt_targets"), o64))
        if not key_slots:
            del o64["key_slots"]
        if not prompt_rows:
            del o64["prompt_rows"], o64["prompt_targets"]
        o32 = dict(zip(("cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "block_tables"),
                       o32))
        return HostStep(longs, ints, o64, o32, batch=bs, width=width,
                        max_seqlen_q=_round_up(max(qlens), 16), max_seqlen_k=max(klens),
                        is_decode=False,
                        has_context=has_context, query_lens=qlens, key_lens=klens,
                        sample_rows=sample_rows, prompt_spans=prompt_spans,
                        prompt_top=max((scheduled[b][0].sampling_params.prompt_logprobs
                                        for b, _, _ in prompt_spans), default=0))

    def _host_decode(self, scheduled) -> Optional[HostStep]:
        """A step of one new token per sequence (the common case), laid out as the CUDA
        graphs' static inputs, padded to the graph's batch size, so that a replay takes
        them in two copies. Three reads per sequence, then numpy: at batch 256 a loop
        over the sequences building every row cost ~0.8 ms per step on the H200's host
        (session 15's profile). None where a prompt chunk's token has prompt logprobs to
        compute (``_host_prefill`` lays those out)."""
        bs, ps = len(scheduled), self.page_size
        seqs = [seq for seq, _ in scheduled]
        i = bisect.bisect_left(self._graph_list, bs)
        graph_bs = self._graph_list[i] if i < len(self._graph_list) else None
        if graph_bs is None:
            rows, width = bs, _round_up(max(len(seq.block_table) for seq in seqs), 16)
        else:
            rows, width = graph_bs, self.config.blocks_per_seq
        pos, ids, ends = np.array([[seq.num_computed_tokens for seq in seqs],
                                   [seq.token_ids[seq.num_computed_tokens] for seq in seqs],
                                   [len(seq.token_ids) for seq in seqs]], dtype=np.int64)
        sample_rows = (pos + 1 == ends).nonzero()[0]
        all_sample = len(sample_rows) == bs
        if not all_sample and any(seqs[i].prompt_logprobs is not None
                                  for i in (pos + 1 != ends).nonzero()[0]):
            return None  # a prompt position's logprobs: the prefill layout has them
        s = 0 if all_sample else len(sample_rows)
        dst = (ids < 0).nonzero()[0]  # in flight: read on the device
        n = len(dst)
        # int64: input_ids | positions | slot_mapping (rows each) | logits_indices
        # | dst | src
        longs = np.zeros(3 * rows + s + 2 * n, dtype=np.int64)
        longs[:bs] = ids
        longs[dst] = 0
        longs[rows:rows + bs] = pos
        longs[3 * rows:3 * rows + s] = sample_rows[:s]
        longs[3 * rows + s:3 * rows + s + n] = dst
        np.subtract(-1, ids[dst], out=longs[3 * rows + s + n:])
        # int32: cache_seqlens (rows) | block_tables (rows x width) | cu_seqlens_q | _k
        tail = rows * (1 + width)
        ints = np.empty(tail + 2 * (bs + 1), dtype=np.int32)
        ints[:bs] = pos + 1
        ints[bs:rows] = 1  # padding rows: write nothing (slot -1), read one scratch key
        tables = ints[rows:tail].reshape(rows, width)
        self._block_table_rows(seqs, tables)
        slots = longs[2 * rows:3 * rows]
        slots[:bs] = tables[np.arange(bs), pos // ps] * ps + pos % ps
        slots[bs:] = -1
        ints[tail:tail + bs + 1] = np.arange(bs + 1)
        ints[tail + bs + 1] = 0
        np.add.accumulate(ints[:bs], out=ints[tail + bs + 2:])
        o64 = dict(input_ids=(0, bs), positions=(rows, bs), slot_mapping=(2 * rows, bs),
                   dst=(3 * rows + s, n), src=(3 * rows + s + n, n))
        if not all_sample:
            o64["logits_indices"] = (3 * rows, s)
        o32 = dict(cache_seqlens=(0, bs), block_tables=(rows, rows * width),
                   cu_seqlens_q=(tail, bs + 1), cu_seqlens_k=(tail + bs + 1, bs + 1))
        max_seqlen_k = int(np.maximum.reduce(pos)) + 1
        return HostStep(longs, ints, o64, o32, batch=bs, width=width, max_seqlen_q=1,
                        max_seqlen_k=max_seqlen_k, is_decode=True,
                        has_context=max_seqlen_k > 1, query_lens=[1] * bs,
                        key_lens=ints[:bs].tolist(), sample_rows=sample_rows.tolist(),
                        graph_bs=graph_bs)

    def _block_table_rows(self, seqs, out: np.ndarray):
        """Write the sequences' block tables into the first rows of out (rows x width),
        the scratch block everywhere else: gathered from the block manager's rows
        (block_manager.py) when it holds every sequence, else from the lists (warm-up's
        sequences, tests' own block managers)."""
        bm, bs, width = self.block_manager, len(seqs), out.shape[1]
        held = [seq.table_row for seq in seqs]
        if bm is not None and None not in held:
            w = min(width, bm.tables.shape[1])
            out[:bs, :w] = bm.tables.take(held, axis=0)[:, :w]
            out[:bs, w:] = self.scratch_block
        else:
            lens = np.array([len(seq.block_table) for seq in seqs])
            out[:bs] = self.scratch_block
            out[:bs][np.arange(width) < lens[:, None]] = list(
                itertools.chain.from_iterable(seq.block_table for seq in seqs))
        out[bs:] = self.scratch_block

    def _gather_ids(self, input_ids, dst, src):
        """input_ids[dst] = the last launched step's sampled tokens[src]: the tokens still
        in flight, read on the device so that the host never waits for them before
        launching the next step."""
        if len(dst):
            input_ids.index_copy_(0, dst, self._last_tokens.index_select(0, src))

    def _to_device(self, values: array, dtype: torch.dtype) -> torch.Tensor:
        """A host array as a device tensor: on CUDA through pinned memory, copied without
        blocking (the caching host allocator keeps the buffer until the copy is done)."""
        host = torch.frombuffer(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
