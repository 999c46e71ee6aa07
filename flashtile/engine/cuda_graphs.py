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
"""

from __future__ import annotations

import logging

import torch

from flashtile.engine.attention import AttentionMetadata

log = logging.getLogger("flashtile.engine")


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

    def _decode_body(self, bs: int):
        """The work batch size bs's graph captures, as a function: the model over the
        graph's static inputs into static_hidden[:bs]."""
        args, out = self._static_inputs(bs), self.static_hidden[:bs]
        return lambda: out.copy_(self.model(*args))

    @torch.inference_mode()
    def _capture_graphs(self):
        self.static_hidden = torch.zeros(self.config.max_num_seqs,
                                         self.config.model_config.hidden_size,
                                         dtype=self.dtype, device=self.device)
        pool = None
        for bs in reversed(self._graph_sizes()):
            body = self._decode_body(bs)
            body()  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                body()
            pool = graph.pool()
            self.graphs[bs] = graph
        self._graph_list = sorted(self.graphs)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self._graph_list)

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
