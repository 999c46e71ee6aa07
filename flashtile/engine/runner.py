"""ModelRunner: the model, the KV pool, each step's inputs, CUDA graphs, sampling.

Per step the scheduler hands over (sequence, number of new tokens) pairs. ``prepare``
builds the packed inputs and the AttentionMetadata once, on the host (pinned memory on
CUDA, copied without blocking), ``execute`` runs the forward, computes logits only for
the sequences that reach their last token this step, and samples them with the Sampler;
the sampled ids are the step's one host read.

Pool size: on CUDA, one warm-up forward at max_num_batched_tokens measures the peak
activation memory, and the pool gets gpu_memory_utilization of the device minus what is
in use and that peak; on CPU (or when given), kv_cache_memory bytes.

CUDA graphs (flashtile backend; sdpa and naive run eagerly, since their decode gathers
every sequence's pages padded to the captured max_model_len width): pure decode steps
(one new token per sequence) replay a graph captured for the next batch size up in 1, 2,
4, 8, ... max_num_seqs, largest first, all in one memory pool. Padding rows write into
the pool's scratch block (slot -1) and read one key of it. The block tables are captured
at max_model_len's width; flashtile's decode picks its splits from that width on the host
at capture.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from flashtile._validate import _fail
from flashtile.engine.attention import AttentionMetadata
from flashtile.engine.config import EngineConfig
from flashtile.engine.loader import build_model
from flashtile.engine.sampler import Sampler, SamplingTensors

log = logging.getLogger("flashtile.engine")
GiB = 2**30
# CPU pool when kv_cache_memory is not given: vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE).
CPU_DEFAULT_KV_BYTES = 4 * GiB


@dataclass
class StepInputs:
    input_ids: torch.Tensor      # (T,) int64
    positions: torch.Tensor      # (T,) int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) rows of the hidden states to sample from
    sample_rows: list            # indices into the step's sequences that sample


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.page_size = config.page_size
        self.model = build_model(config)
        self.sampler = Sampler(seed=config.seed)
        self.num_blocks = self._pool_blocks()
        mc = config.model_config
        shape = (2, mc.num_hidden_layers, self.num_blocks + 1, self.page_size,
                 mc.num_key_value_heads, mc.head_dim)
        # Zeroed: graph padding rows read the scratch block, and sdpa/naive decode multiply
        # the values of masked pool rows by 0 (garbage NaN would survive that).
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.scratch_block = self.num_blocks
        self.graphs = {}
        if self.device.type == "cuda" and not config.enforce_eager \
                and config.attention_backend == "flashtile":
            self._capture_graphs()

    # ---- pool -------------------------------------------------------------------------
    def block_bytes(self) -> int:
        mc = self.config.model_config
        return (2 * mc.num_hidden_layers * self.page_size * mc.num_key_value_heads
                * mc.head_dim * self.dtype.itemsize)

    def _pool_blocks(self) -> int:
        cfg = self.config
        need = cfg.blocks_per_seq
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._free_cuda_bytes()
        else:
            # More than max_num_seqs full-length sequences could use is never touched.
            budget = min(CPU_DEFAULT_KV_BYTES,
                         cfg.max_num_seqs * need * self.block_bytes())
        blocks = int(budget // self.block_bytes())
        if blocks < need:
            _fail(ValueError, "KV pool", f">= {need} pages of {self.page_size} tokens "
                  f"(one max_model_len={cfg.max_model_len} sequence, "
                  f"{need * self.block_bytes()} bytes)",
                  f"{blocks} pages ({int(budget)} bytes)",
                  "Raise kv_cache_memory / gpu_memory_utilization or lower max_model_len")
        log.info("KV pool: %d pages of %d tokens (%.2f GiB)", blocks, self.page_size,
                 blocks * self.block_bytes() / GiB)
        return blocks

    @torch.inference_mode()
    def _free_cuda_bytes(self) -> int:
        """Device bytes left for the pool after a forward at the full token budget."""
        cfg = self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = cfg.max_num_batched_tokens
        seqlen = min(tokens, cfg.max_model_len)
        lens = [seqlen] * (tokens // seqlen) + ([tokens % seqlen] if tokens % seqlen else [])
        cu = torch.tensor([0] + lens, device=self.device).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqlen, max_seqlen_k=seqlen,
            slot_mapping=torch.full((tokens,), -1, device=self.device),
            cache_seqlens=cu.diff(), block_tables=None, is_decode=False, has_context=False,
            query_lens=lens, key_lens=lens)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(torch.zeros_like(positions), positions, meta)
        rows = min(cfg.max_num_seqs, tokens)
        self.model.compute_logits(hidden[:rows]).float().softmax(-1)
        del hidden
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so that "in use" below is what stays allocated
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        activations = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        return total * cfg.gpu_memory_utilization - (total - free) - activations

    # ---- step inputs ------------------------------------------------------------------
    def _to_device(self, *parts: torch.Tensor) -> list[torch.Tensor]:
        """Host tensors of one dtype -> device views, through one pinned buffer and one
        non-blocking copy (a copy per tensor cost a few microseconds of host time each)."""
        if self.device.type != "cuda":
            return list(parts)
        flat = torch.cat([x.reshape(-1) for x in parts]).pin_memory()
        flat = flat.to(self.device, non_blocking=True)
        views, offset = [], 0
        for x in parts:
            views.append(flat[offset:offset + x.numel()].view(x.shape))
            offset += x.numel()
        return views

    def prepare(self, scheduled) -> StepInputs:
        """Inputs of one step; scheduled: [(sequence, new tokens)] in batch order."""
        ps = self.page_size
        starts = [seq.num_computed_tokens for seq, _ in scheduled]
        qlens = [n for _, n in scheduled]
        klens = [s + n for s, n in zip(starts, qlens)]
        width = max(len(seq.block_table) for seq, _ in scheduled)
        pad = [self.scratch_block] * width
        tables = torch.tensor([seq.block_table + pad[len(seq.block_table):]
                               for seq, _ in scheduled], dtype=torch.int32)
        ids, positions = [], []
        for (seq, n), start in zip(scheduled, starts):
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
        lens = torch.tensor(qlens)
        row = torch.repeat_interleave(torch.arange(len(scheduled)), lens)
        pos = torch.tensor(positions, dtype=torch.int64)
        slots = tables[row, pos // ps].long() * ps + pos % ps
        is_decode = all(n == 1 for n in qlens)
        has_context = any(s > 0 for s in starts)
        cu_q = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + klens).cumsum(0).to(torch.int32)
        sample_rows = [b for b, (seq, n) in enumerate(scheduled)
                       if starts[b] + n == seq.num_tokens]
        longs = [torch.tensor(ids, dtype=torch.int64), pos, slots,
                 cu_q[1:].long()[sample_rows] - 1]
        if has_context and not is_decode and self.config.attention_backend != "flashtile":
            krow = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(klens))
            kpos = torch.cat([torch.arange(n) for n in klens])
            longs.append(tables[krow, kpos // ps].long() * ps + kpos % ps)
        input_ids, pos, slots, logits_indices, *key_slots = self._to_device(*longs)
        cu_q, cu_k, seqlens, tables = self._to_device(
            cu_q, cu_k, torch.tensor(klens, dtype=torch.int32), tables)
        meta = AttentionMetadata(
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(qlens),
            max_seqlen_k=max(klens), slot_mapping=slots, cache_seqlens=seqlens,
            block_tables=tables, is_decode=is_decode, has_context=has_context,
            query_lens=qlens, key_lens=klens, key_slots=key_slots[0] if key_slots else None)
        return StepInputs(input_ids=input_ids, positions=pos, meta=meta,
                          logits_indices=logits_indices, sample_rows=sample_rows)

    # ---- forward and sampling ---------------------------------------------------------
    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of the step's rows that sample, (S, hidden_size)."""
        bs = len(inputs.meta.query_lens)
        graph_bs = next((g for g in sorted(self.graphs) if g >= bs), None)
        if inputs.meta.is_decode and graph_bs is not None:
            return self._replay(inputs, graph_bs)[inputs.logits_indices]
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return hidden[inputs.logits_indices]

    @torch.inference_mode()
    def execute(self, scheduled) -> tuple[list, list[int], list[float]]:
        """Run one step. Returns (sequences that sampled, their token ids, logprobs)."""
        inputs = self.prepare(scheduled)
        if not inputs.sample_rows:
            self.forward(inputs)
            return [], [], []
        seqs = [scheduled[b][0] for b in inputs.sample_rows]
        tensors = SamplingTensors.from_seqs(seqs, self.device,
                                            self.config.model_config.vocab_size)
        logits = self.model.compute_logits(self.forward(inputs)).float()
        token_ids, logprobs = self.sampler(logits, tensors)
        return seqs, token_ids.tolist(), logprobs.tolist()

    # ---- CUDA graphs ------------------------------------------------------------------
    def _graph_sizes(self) -> list[int]:
        sizes, bs = [], 1
        while bs < self.config.max_num_seqs:
            sizes.append(bs)
            bs *= 2
        return sizes + [self.config.max_num_seqs]

    @torch.inference_mode()
    def _capture_graphs(self):
        max_bs, width = self.config.max_num_seqs, self.config.blocks_per_seq
        dev = self.device
        self.static = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            cache_seqlens=torch.ones(max_bs, dtype=torch.int32, device=dev),
            block_tables=torch.full((max_bs, width), self.scratch_block, dtype=torch.int32,
                                    device=dev),
            hidden=torch.zeros(max_bs, self.config.model_config.hidden_size,
                               dtype=self.dtype, device=dev))
        pool = None
        for bs in reversed(self._graph_sizes()):
            s = {k: v[:bs] for k, v in self.static.items()}
            cu = torch.arange(bs + 1, dtype=torch.int32, device=dev)
            meta = AttentionMetadata(
                cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1,
                max_seqlen_k=self.config.max_model_len, slot_mapping=s["slot_mapping"],
                cache_seqlens=s["cache_seqlens"], block_tables=s["block_tables"],
                is_decode=True, has_context=True, query_lens=[1] * bs, key_lens=[1] * bs)
            s["hidden"].copy_(self.model(s["input_ids"], s["positions"], meta))  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                s["hidden"].copy_(self.model(s["input_ids"], s["positions"], meta))
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", sorted(self.graphs))

    def _replay(self, inputs: StepInputs, graph_bs: int) -> torch.Tensor:
        s, meta = self.static, inputs.meta
        bs, width = len(meta.query_lens), meta.block_tables.shape[1]
        s["input_ids"][:bs].copy_(inputs.input_ids)
        s["positions"][:bs].copy_(inputs.positions)
        s["slot_mapping"][:bs].copy_(meta.slot_mapping)
        s["cache_seqlens"][:bs].copy_(meta.cache_seqlens)
        s["block_tables"][:bs, :width].copy_(meta.block_tables)
        # Rows bs..graph_bs of an earlier, larger batch: make them padding again.
        s["slot_mapping"][bs:graph_bs].fill_(-1)
        s["cache_seqlens"][bs:graph_bs].fill_(1)
        s["block_tables"][bs:graph_bs].fill_(self.scratch_block)
        self.graphs[graph_bs].replay()
        return s["hidden"][:bs]
