"""CUDA graphs of pure decode steps, for every attention backend unless enforce_eager (a
captured sdpa or naive decode attends over the block table's whole max_model_len width,
masked, as a static cache does; an eager one stops at the step's longest sequence).

A decode step (one new token per sequence) replays a graph captured for the next batch
size up in 1, 2, 4, 8, ... max_num_seqs, largest first, all in one memory pool. Each graph
reads two static buffers (int64 and int32) that a decode step's inputs are built into on
the host (step_inputs.py), padded to the graph's batch size, and copied in two copies.
Padding rows write into the pool's scratch block (slot -1) and read one key of it. The
block tables are captured at max_model_len's width; flashtile's decode picks its splits
from that width on the host at capture.

FLASHTILE_ENGINE_DECODE_OVERLAP (opt-in, read at capture): "N" splits the batch of every
graph of N or more sequences in two halves whose forwards run on two streams, a branch
each in the graph; "N,offset" starts the second half once the first has finished its
first layer's attention. Why: at a small model's decode shapes the matrix products are
latency-bound on a few SMs while attention is bandwidth-bound on all of them (the 0.5B
shape at batch 256: 833 us of products, 943 us of attention, NOTES.md section 26), so
one half's products can run beside the other half's attention. Off under tensor
parallelism (each half's collectives would interleave across ranks).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from flashtile._backend import getenv
from flashtile._validate import _fail
from flashtile.engine.attention import AttentionMetadata

log = logging.getLogger("flashtile.engine")
OVERLAP_ENV = "FLASHTILE_ENGINE_DECODE_OVERLAP"


def decode_overlap() -> Optional[tuple[int, bool]]:
    """(smallest split batch, offset) from FLASHTILE_ENGINE_DECODE_OVERLAP; None when
    unset, empty or "0". Anything else is a ValueError naming the variable."""
    raw = getenv(OVERLAP_ENV, "").strip()
    if raw in ("", "0"):
        return None
    size, _, mode = raw.partition(",")
    if not size.strip().isdigit() or int(size) < 2 or mode.strip() not in ("", "offset"):
        _fail(ValueError, OVERLAP_ENV, "'0', 'N' or 'N,offset' with N >= 2 (the smallest "
              "decode batch split in two halves on two streams)", repr(raw))
    return int(size), mode.strip() == "offset"


def split_decode_args(args, rows: int):
    """A decode step's model arguments (input ids, positions, AttentionMetadata) over its
    first ``rows`` sequences and over the rest: views of the same buffers, so a graph
    captured over them reads each replay's inputs."""
    ids, positions, meta = args

    def part(lo, hi):
        n = hi - lo
        cu = torch.arange(n + 1, dtype=torch.int32, device=ids.device)
        return ids[lo:hi], positions[lo:hi], dataclasses.replace(
            meta, cu_seqlens_q=cu, cu_seqlens_k=cu, slot_mapping=meta.slot_mapping[lo:hi],
            cache_seqlens=meta.cache_seqlens[lo:hi], block_tables=meta.block_tables[lo:hi],
            query_lens=[1] * n, key_lens=[1] * n)
    return part(0, rows), part(rows, len(ids))


class CudaGraphsMixin:
    """ModelRunner's decode graphs: capture, static inputs, replay. Reads the runner's
    config, device, dtype, model and scratch_block; fills graphs, static, _staging,
    _graph_list and static_hidden."""

    def _graph_sizes(self) -> list[int]:
        sizes, bs = [], 1
        while bs < self.config.max_num_seqs:
            sizes.append(bs)
            bs *= 2
        return sizes + [self.config.max_num_seqs]

    def _static_inputs(self, bs: int):
        """The static inputs of batch size bs's graph, laid out as _host_decode builds
        a step's: int64 (input ids | positions | slots | room for the sampled rows and
        the in-flight tokens' gather indices) and
        int32 (cache_seqlens | block tables | room for cu_seqlens), kept in self.static.
        Returns the model's arguments over them."""
        width, dev = self.config.blocks_per_seq, self.device
        longs = torch.zeros(6 * bs, dtype=torch.int64, device=dev)
        longs[2 * bs:3 * bs] = -1
        ints = torch.full((bs * (1 + width) + 2 * bs + 2,), self.scratch_block,
                          dtype=torch.int32, device=dev)
        ints[:bs] = 1
        self.static[bs] = (longs, ints)
        pinned = dev.type == "cuda"
        self._staging[bs] = (torch.empty_like(longs, device="cpu", pin_memory=pinned),
                             torch.empty_like(ints, device="cpu", pin_memory=pinned),
                             torch.cuda.Event() if pinned else None)
        cu = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1,
            max_seqlen_k=self.config.max_model_len, slot_mapping=longs[2 * bs:3 * bs],
            cache_seqlens=ints[:bs], block_tables=ints[bs:bs * (1 + width)].view(bs, width),
            is_decode=True, has_context=True, query_lens=[1] * bs, key_lens=[1] * bs)
        return longs[:bs], longs[bs:2 * bs], meta

    def _decode_body(self, bs: int, overlap: Optional[tuple[int, bool]]):
        """The work batch size bs's graph captures, as a function: the model over the
        graph's static inputs into static_hidden[:bs]; with ``overlap``
        (``decode_overlap()``) at this size, over the two halves of the batch, the second
        on a side stream (in order, off CUDA)."""
        args, out = self._static_inputs(bs), self.static_hidden[:bs]
        if overlap is None or bs < overlap[0]:
            return lambda: out.copy_(self.model(*args))
        if self.model.tp.size > 1:
            _fail(ValueError, OVERLAP_ENV, "unset with tensor_parallel_size > 1 (each "
                  "half's collectives would interleave across ranks)",
                  repr(getenv(OVERLAP_ENV, "")))
        half = bs // 2
        first, second = split_decode_args(args, half)
        cuda = out.is_cuda
        if cuda and self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        started = torch.cuda.Event() if cuda and overlap[1] else None

        def body():
            if not cuda:
                out[:half].copy_(self.model(*first))
                out[half:].copy_(self.model(*second))
                return
            main, side = torch.cuda.current_stream(self.device), self._side_stream
            side.wait_stream(main)
            hook = None
            if started is not None:  # recorded once the first half's layer 0 attended
                hook = self.model.attention_layers()[0].register_forward_hook(
                    lambda *_: started.record())
            try:
                out[:half].copy_(self.model(*first))
            finally:
                if hook is not None:
                    hook.remove()
            with torch.cuda.stream(side):
                if started is not None:
                    side.wait_event(started)
                out[half:].copy_(self.model(*second))
            main.wait_stream(side)
        return body

    @torch.inference_mode()
    def _capture_graphs(self):
        self.static_hidden = torch.zeros(self.config.max_num_seqs,
                                         self.config.model_config.hidden_size,
                                         dtype=self.dtype, device=self.device)
        pool, overlap = None, decode_overlap()
        for bs in reversed(self._graph_sizes()):
            body = self._decode_body(bs, overlap)
            body()  # warm-up (the side stream's cuBLAS handle too)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                body()
            pool = graph.pool()
            self.graphs[bs] = graph
        self._graph_list = sorted(self.graphs)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s%s", self._graph_list,
                 f" ({OVERLAP_ENV}={getenv(OVERLAP_ENV, '')})" if overlap else "")

    def _to_graph_inputs(self, longs, ints, graph_bs: int):
        """Copy a decode step's host buffers into the static inputs of its graph, through
        the graph's pinned staging buffers (pinning a new buffer per copy cost ~38 us of
        host time each on the H200, session 15's profile). The staging buffers are
        rewritten once the last copy out of them is done: at once, in practice, since
        the host has waited for an earlier step's tokens."""
        s64, s32 = self.static[graph_bs]
        staged64, staged32, copied = self._staging[graph_bs]
        if copied is not None:
            copied.synchronize()
        for static, staged, values, dtype in ((s64, staged64, longs, torch.int64),
                                              (s32, staged32, ints, torch.int32)):
            n = len(values)
            staged[:n].copy_(torch.frombuffer(values, dtype=dtype))
            static[:n].copy_(staged[:n], non_blocking=True)
        if copied is not None:
            copied.record()
        return s64, s32

    def _replay(self, graph_bs: int) -> torch.Tensor:
        self.graphs[graph_bs].replay()
        return self.static_hidden[:graph_bs]
