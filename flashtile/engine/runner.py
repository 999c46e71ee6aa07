"""ModelRunner: the model, the KV pool, each step's inputs, CUDA graphs, sampling.

Per step the scheduler hands over (sequence, number of new tokens) pairs. ``prepare``
builds the packed inputs and the AttentionMetadata once, on the host (pinned memory on
CUDA, copied without blocking), ``launch`` runs the forward, computes logits only for
the sequences that reach their last token this step, samples them with the Sampler and
queues the copy of the sampled ids to the host; ``wait`` reads them, the step's one host
read. Input tokens still in flight (placeholders, see sequence.py) are gathered on the
device from the last launched step's sampled ids, so a step can be launched before the
previous one's tokens reach the host (asynchronous scheduling, llm.py).

Pool size: on CUDA, one warm-up forward at max_num_batched_tokens measures the peak
activation memory, and the pool gets gpu_memory_utilization of the device minus what is
in use and that peak; on CPU (or when given), kv_cache_memory bytes. Then ``warm_up``
runs every kind of step once (fresh prefill, paged prefill beside decodes, decode), so
that no kernel compiles while serving.

CUDA graphs (every backend unless enforce_eager; a captured sdpa or naive decode attends
over the block table's whole max_model_len width, masked, as a static cache does, where an
eager one stops at the step's longest sequence): pure decode steps
(one new token per sequence) replay a graph captured for the next batch size up in 1, 2,
4, 8, ... max_num_seqs, largest first, all in one memory pool. Each graph reads two
static buffers (int64 and int32) that a decode step's inputs are built into on the host,
padded to the graph's batch size, and copied in two copies. Padding rows write into the
pool's scratch block (slot -1) and read one key of it. The block tables are captured at
max_model_len's width; flashtile's decode picks its splits from that width on the host at
capture.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from dataclasses import dataclass
from typing import Optional

import torch

from flashtile._validate import _fail
from flashtile.engine.attention import AttentionMetadata
from flashtile.engine.config import EngineConfig
from flashtile.engine.loader import build_model
from flashtile.engine.sampler import Sampler, SamplingTensors
from flashtile.engine.sequence import Sequence

log = logging.getLogger("flashtile.engine")
GiB = 2**30
# CPU pool when kv_cache_memory is not given: vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE).
CPU_DEFAULT_KV_BYTES = 4 * GiB


@dataclass
class StepInputs:
    input_ids: torch.Tensor      # (T,) int64
    positions: torch.Tensor      # (T,) int64
    meta: AttentionMetadata
    logits_indices: Optional[torch.Tensor]  # (S,) rows of the hidden states to sample
    #                                         from; None: every row, in order
    sample_rows: list            # indices into the step's sequences that sample
    graph_bs: Optional[int] = None  # a decode step replayed in this batch size's graph


@dataclass
class LaunchedStep:
    seqs: list                       # the sequences that sample, in row order
    tokens: Optional[torch.Tensor]   # (S,) int64 sampled ids; on CUDA pinned host memory,
    logprobs: Optional[torch.Tensor]  # (S,) float32   valid once ``done`` has fired
    done: Optional[torch.cuda.Event]
    # Some row has a repetition penalty: the next step's sampling reads every token of
    # its sequence on the host, so this step must be waited for before it is prepared.
    host_needs_tokens: bool


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
                 self.kv_heads, mc.head_dim)
        # Zeroed: graph padding rows read the scratch block, and sdpa/naive decode multiply
        # the values of masked pool rows by 0 (garbage NaN would survive that).
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.scratch_block = self.num_blocks
        self.graphs, self.static, self._graph_list = {}, {}, []
        self._last_tokens = None
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        if self.device.type == "cuda":
            self.warm_up(decode=not use_graphs)
        if use_graphs:
            self._capture_graphs()

    # ---- pool -------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """KV heads of this process (all of them, or its slice under tensor parallelism)."""
        return self.config.model_config.num_key_value_heads // self.model.tp.size

    def block_bytes(self) -> int:
        mc = self.config.model_config
        return (2 * mc.num_hidden_layers * self.page_size * self.kv_heads
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
            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=_round_up(seqlen, 16),
            max_seqlen_k=seqlen,
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

    @torch.inference_mode()
    def warm_up(self, decode: bool = True):
        """Run every kind of step once on dummy sequences, so that each Triton kernel
        variant and torch.compile graph the engine meets compiles now, not while serving
        (a compile takes ~0.4 s): fresh prefills, prefill chunks over the pool beside
        decodes (paged varlen), and, when not captured in CUDA graphs, decodes. Tuned
        tiles (`flashtile tune`) depend on the sequence length class (<=2k, <=8k, more),
        so each class the limits allow is run. Everything reads and writes the scratch
        block only."""
        cfg, ps = self.config, self.page_size

        def seq(keys, new):
            s = Sequence([0] * keys)
            s.num_computed_tokens = keys - new
            s.block_table = [self.scratch_block] * -(-keys // ps)
            return s, new

        def lengths(limit):
            return sorted({min(c, limit) for c in (2048, 8192, limit)})

        for total in lengths(cfg.max_num_batched_tokens):
            lens = [cfg.max_model_len] * (total // cfg.max_model_len)
            lens += [total % cfg.max_model_len] if total % cfg.max_model_len else []
            self.forward(self.prepare([seq(n, n) for n in lens]))
        for keys in lengths(cfg.max_model_len):
            if keys >= 3:  # a chunk of two tokens after one cached token, and a decode
                self.forward(self.prepare([seq(keys, 2), seq(2, 1)]))
        if decode:
            for bs in sorted({1, cfg.max_num_seqs}):
                self.forward(self.prepare([seq(cfg.max_model_len, 1)] * bs))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- step inputs ------------------------------------------------------------------
    @torch.inference_mode()  # decode steps write into the graphs' static (inference) inputs
    def prepare(self, scheduled) -> StepInputs:
        """Inputs of one step; scheduled: [(sequence, new tokens)] in batch order.

        Host cost matters here (a decode step of a 1B model is ~4 ms of GPU time at batch
        256): everything is built as flat Python lists of ints, packed into one int64 and
        one int32 buffer, and moved in one copy each.
        """
        bs = len(scheduled)
        if all(n == 1 for _, n in scheduled):
            return self._prepare_decode(scheduled)
        ps = self.page_size
        # Widths and max_seqlen_q rounded up to 16: Triton specialises int arguments on
        # divisibility by 16, so this keeps one compiled variant of the varlen kernel.
        width = _round_up(max(len(seq.block_table) for seq, _ in scheduled), 16)
        pad = [self.scratch_block] * width
        ids, pos, slots, tables, qlens, klens = [], [], [], [], [], []
        sample_rows, logits_indices, dst, src = [], [], [], []
        for b, (seq, n) in enumerate(scheduled):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
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
        longs, o64 = _packed((ids, pos, slots, logits_indices, key_slots, dst, src), "q")
        ints, o32 = _packed((itertools.accumulate(qlens, initial=0),
                             itertools.accumulate(klens, initial=0), klens, tables), "i")
        dev64, dev32 = self._to_device(longs, torch.int64), self._to_device(ints, torch.int32)
        ids, pos, slots, logits_indices, key_slots, dst, src = (
            dev64[o:o + n] for o, n in o64)
        cu_q, cu_k, seqlens, tables = (dev32[o:o + n] for o, n in o32)
        meta = AttentionMetadata(
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=_round_up(max(qlens), 16),
            max_seqlen_k=max(klens), slot_mapping=slots, cache_seqlens=seqlens,
            block_tables=tables.view(bs, width), is_decode=False, has_context=has_context,
            query_lens=qlens, key_lens=klens, key_slots=key_slots if len(key_slots) else None)
        self._gather_ids(ids, dst, src)
        return StepInputs(input_ids=ids, positions=pos, meta=meta,
                          logits_indices=logits_indices, sample_rows=sample_rows)

    def _prepare_decode(self, scheduled) -> StepInputs:
        """prepare() for a step of one new token per sequence (the common case). Laid out
        as the CUDA graphs' static inputs, padded to the graph's batch size, so that a
        replay takes them in two copies."""
        bs, ps = len(scheduled), self.page_size
        graph_bs = next((g for g in self._graph_list if g >= bs), None)
        if graph_bs is None:
            rows, width = bs, _round_up(max(len(seq.block_table) for seq, _ in scheduled),
                                        16)
        else:
            rows, width = graph_bs, self.config.blocks_per_seq
        pad = [self.scratch_block] * width
        ids, pos, slots, seqlens, tables, sample_rows = [], [], [], [], [], []
        dst, src = [], []
        for b, (seq, _) in enumerate(scheduled):
            p = seq.num_computed_tokens
            table = seq.block_table
            token = seq.token_ids[p]
            if token < 0:  # in flight: read it on the device
                dst.append(b)
                src.append(-1 - token)
                token = 0
            ids.append(token)
            pos.append(p)
            slots.append(table[p // ps] * ps + p % ps)
            seqlens.append(p + 1)
            tables += table
            tables += pad[len(table):]
            if p + 1 == len(seq.token_ids):
                sample_rows.append(b)
        extra = rows - bs  # padding rows: write nothing (slot -1), read one scratch key
        longs = array("q", ids + [0] * extra)
        longs += array("q", pos + [0] * extra)
        longs += array("q", slots + [-1] * extra)
        all_sample = len(sample_rows) == bs
        if not all_sample:
            longs += array("q", sample_rows)
        longs += array("q", dst)
        longs += array("q", src)
        ints = array("i", seqlens + [1] * extra)
        ints += array("i", tables + pad * extra)
        ints += array("i", range(bs + 1))
        ints += array("i", itertools.accumulate(seqlens, initial=0))
        if graph_bs is not None:
            dev64, dev32 = self._to_graph_inputs(longs, ints, graph_bs)
        else:
            dev64 = self._to_device(longs, torch.int64)
            dev32 = self._to_device(ints, torch.int32)
        tail = rows * (1 + width)
        s = 0 if all_sample else len(sample_rows)
        start, n = 3 * rows + s, len(dst)
        self._gather_ids(dev64[:bs], dev64[start:start + n], dev64[start + n:start + 2 * n])
        meta = AttentionMetadata(
            cu_seqlens_q=dev32[tail:tail + bs + 1],
            cu_seqlens_k=dev32[tail + bs + 1:tail + 2 * bs + 2], max_seqlen_q=1,
            max_seqlen_k=max(seqlens), slot_mapping=dev64[2 * rows:2 * rows + bs],
            cache_seqlens=dev32[:bs], block_tables=dev32[rows:tail].view(rows, width)[:bs],
            is_decode=True, has_context=max(seqlens) > 1, query_lens=[1] * bs,
            key_lens=seqlens)
        return StepInputs(input_ids=dev64[:bs], positions=dev64[rows:rows + bs], meta=meta,
                          logits_indices=None if all_sample else dev64[3 * rows:3 * rows + s],
                          sample_rows=sample_rows, graph_bs=graph_bs)

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

    # ---- forward and sampling ---------------------------------------------------------
    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of the step's rows that sample, (S, hidden_size)."""
        if inputs.graph_bs is not None:
            hidden = self._replay(inputs.graph_bs)[:len(inputs.meta.query_lens)]
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return hidden if inputs.logits_indices is None else hidden[inputs.logits_indices]

    @torch.inference_mode()
    def launch(self, scheduled) -> LaunchedStep:
        """Queue one step: inputs, forward, sampling, and on CUDA the copy of the sampled
        tokens to pinned host memory, without waiting for any of it (``wait`` does)."""
        inputs = self.prepare(scheduled)
        seqs = [scheduled[b][0] for b in inputs.sample_rows]
        if not seqs:
            self.forward(inputs)
            self._last_tokens = None
            return LaunchedStep(seqs, None, None, None, False)
        tensors = SamplingTensors.from_seqs(seqs, self.device,
                                            self.config.model_config.vocab_size)
        logits = self.model.compute_logits(self.forward(inputs)).float()
        tokens, logprobs = self.sampler(logits, tensors)
        self._last_tokens = tokens  # the next step's in-flight input ids come from here
        done = None
        if self.device.type == "cuda":
            tokens = torch.empty_like(tokens, device="cpu", pin_memory=True).copy_(
                tokens, non_blocking=True)
            logprobs = torch.empty_like(logprobs, device="cpu", pin_memory=True).copy_(
                logprobs, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return LaunchedStep(seqs, tokens, logprobs, done, tensors.token_ids is not None)

    def execute(self, scheduled) -> tuple[list, list[int], list[float]]:
        """Run one step synchronously. Returns (sequences that sampled, their token ids,
        logprobs); changes no sequence (the scheduler records steps)."""
        step = self.launch(scheduled)
        return (step.seqs, *self.wait(step))

    @staticmethod
    def wait(step: LaunchedStep) -> tuple[list[int], list[float]]:
        """A launched step's sampled token ids and logprobs on the host, once done."""
        if not step.seqs:
            return [], []
        if step.done is not None:
            step.done.synchronize()
        return step.tokens.tolist(), step.logprobs.tolist()

    # ---- CUDA graphs ------------------------------------------------------------------
    def _graph_sizes(self) -> list[int]:
        sizes, bs = [], 1
        while bs < self.config.max_num_seqs:
            sizes.append(bs)
            bs *= 2
        return sizes + [self.config.max_num_seqs]

    def _static_inputs(self, bs: int):
        """The static inputs of batch size bs's graph, laid out as _prepare_decode builds
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
        cu = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1,
            max_seqlen_k=self.config.max_model_len, slot_mapping=longs[2 * bs:3 * bs],
            cache_seqlens=ints[:bs], block_tables=ints[bs:bs * (1 + width)].view(bs, width),
            is_decode=True, has_context=True, query_lens=[1] * bs, key_lens=[1] * bs)
        return longs[:bs], longs[bs:2 * bs], meta

    @torch.inference_mode()
    def _capture_graphs(self):
        self.static_hidden = torch.zeros(self.config.max_num_seqs,
                                         self.config.model_config.hidden_size,
                                         dtype=self.dtype, device=self.device)
        pool = None
        for bs in reversed(self._graph_sizes()):
            args, out = self._static_inputs(bs), self.static_hidden[:bs]
            out.copy_(self.model(*args))  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out.copy_(self.model(*args))
            pool = graph.pool()
            self.graphs[bs] = graph
        self._graph_list = sorted(self.graphs)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self._graph_list)

    def _to_graph_inputs(self, longs: array, ints: array, graph_bs: int):
        """Copy a decode step's host buffers into the static inputs of its graph."""
        s64, s32 = self.static[graph_bs]
        for static, values, dtype in ((s64, longs, torch.int64), (s32, ints, torch.int32)):
            host = torch.frombuffer(values, dtype=dtype)
            if static.is_cuda:
                host = host.pin_memory()
            static[:len(values)].copy_(host, non_blocking=True)
        return s64, s32

    def _replay(self, graph_bs: int) -> torch.Tensor:
        self.graphs[graph_bs].replay()
        return self.static_hidden[:graph_bs]
