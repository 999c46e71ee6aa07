"""ModelRunner: the model, the KV pool, each step's forward and sampling.

``prepare`` (step_inputs.py) builds a step's packed inputs once on the host; ``launch``
runs the forward, computes logits only for the sequences that reach their last token this
step, samples them with the Sampler and queues the copy of the sampled ids to the host;
``wait`` reads them, the step's one host read. Pure decode steps replay CUDA graphs
(cuda_graphs.py). Under tensor parallelism every rank has a ModelRunner over its slice of
the model (workers.py): rank 0 launches each step and the others ``follow`` it.

Pool size: on CUDA, one warm-up forward at max_num_batched_tokens measures the peak
activation memory, and the pool gets gpu_memory_utilization of the device minus what is
in use and that peak; on CPU (or when given), kv_cache_memory bytes; under tensor
parallelism the smallest rank's figure, on every rank. Then ``warm_up`` runs every kind
of step once (fresh prefill, paged prefill beside decodes, decode), so that no kernel
compiles while serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from flashtile._backend import select_backend
from flashtile._validate import _fail
from flashtile.engine.attention import AttentionMetadata
from flashtile.engine.config import EngineConfig
from flashtile.engine.cuda_graphs import CudaGraphsMixin
from flashtile.engine.loader import build_model
from flashtile.engine.sampler import Sampler, SamplingTensors
from flashtile.engine.sequence import Sequence
from flashtile.engine.step_inputs import HostStep, StepInputs, StepInputsMixin, \
    _round_up
from flashtile.ops.decode import paged_decode_warm_shapes

log = logging.getLogger("flashtile.engine")
GiB = 2**30
# CPU pool when kv_cache_memory is not given: vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE).
CPU_DEFAULT_KV_BYTES = 4 * GiB


@dataclass
class LaunchedStep:
    seqs: list                       # the sequences that sample, in row order
    tokens: Optional[torch.Tensor]   # (S,) int64 sampled ids; on CUDA pinned host memory,
    logprobs: Optional[torch.Tensor]  # (S,) float32   valid once ``done`` has fired
    done: Optional[torch.cuda.Event]
    # Some row has a penalty that reads its tokens (repetition, frequency, presence): the
    # next step's sampling reads them on the host, so this step must be waited for
    # before it is prepared.
    host_needs_tokens: bool
    # (ids, logprobs), each (S, k): the k most likely tokens of every row, where some
    # row asked for k alternatives (SamplingParams.logprobs > 0).
    top: Optional[tuple] = None
    # SamplingParams.prompt_logprobs: ([(sequence, first position, count)], logprobs
    # (R,), then (ids, logprobs), each (R, k), or None) for the prompt positions the
    # step predicted; stored into the sequences by ``wait``.
    prompt: Optional[tuple] = None


class ModelRunner(StepInputsMixin, CudaGraphsMixin):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.cache_dtype = config.cache_dtype  # the pool's: the model's, or FP8
        self.page_size = config.page_size
        self.model = build_model(config)
        self.sampler = Sampler(seed=config.seed)
        self.num_blocks = self._pool_blocks()
        mc = config.model_config
        shape = (2, mc.num_hidden_layers, self.num_blocks + 1, self.page_size,
                 self.kv_heads, mc.head_dim)
        # Zeroed: graph padding rows read the scratch block, and sdpa/naive decode multiply
        # the values of masked pool rows by 0 (garbage NaN would survive that). Zeroed as
        # bytes: not every torch build fills FP8 tensors.
        self.kv_cache = torch.zeros(shape, dtype=torch.uint8 if self.cache_dtype.itemsize == 1
                                    else self.cache_dtype, device=self.device
                                    ).view(self.cache_dtype)
        quantized = self.cache_dtype != self.dtype
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            attn.quantized = quantized
            if quantized:  # the checkpoint's, else 1.0 (vLLM's rule); or calculated
                loaded = getattr(attn, "checkpoint_scales", {})
                attn.k_scale, attn.v_scale = (
                    torch.tensor(loaded.get(kind, 1.0), dtype=torch.float32,
                                 device=self.device) for kind in ("k", "v"))
        self.scratch_block = self.num_blocks
        # The BlockManager over this pool whose table rows decode steps gather (LLM sets
        # it; its rows end in num_blocks, the scratch block). None: from the lists.
        self.block_manager = None
        self._greedy_seqs = self._greedy_tensors = None  # see run
        self._graph_views = None, None, None  # see upload
        self.graphs, self.static, self._staging, self._graph_list = {}, {}, {}, []
        self._last_tokens = None
        # flashtile's PyTorch path (FLASHTILE_BACKEND=torch) reads each sequence's length
        # on the host, which a graph capture forbids: that path decodes eagerly.
        use_graphs = self.device.type == "cuda" and not config.enforce_eager and not (
            config.attention_backend == "flashtile" and select_backend(self.device) == "torch")
        if self.device.type == "cuda":
            self.warm_up(decode=not use_graphs)
        if use_graphs:
            self._capture_graphs()
        # After the warm-up's made-up steps: the first step that serves a request sets
        # the scales (the graphs read them where they are).
        for attn in self.model.attention_layers():
            attn.calibrate = quantized and config.calculate_kv_scales

    # ---- pool -------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """KV heads of this process (all of them, or its slice under tensor parallelism)."""
        return self.config.model_config.num_key_value_heads // self.model.tp.size

    def block_bytes(self) -> int:
        mc = self.config.model_config
        return (2 * mc.num_hidden_layers * self.page_size * self.kv_heads
                * mc.head_dim * self.cache_dtype.itemsize)

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
        # Under tensor parallelism every rank takes the smallest rank's budget, so that a
        # block id names the same pages on every rank (block_bytes is the same on all).
        budget = self.model.tp.min(int(budget), self.device)
        blocks = budget // self.block_bytes()
        if blocks < need:
            _fail(ValueError, "KV pool", f">= {need} pages of {self.page_size} tokens "
                  f"(one max_model_len={cfg.max_model_len} sequence, "
                  f"{need * self.block_bytes()} bytes)",
                  f"{blocks} pages ({budget} bytes)",
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
        decodes (paged varlen), and, when not captured in CUDA graphs, decodes (one per
        split-decode variant: paged_decode_warm_shapes). Tuned
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
            if cfg.attention_backend == "flashtile":
                # Split decode's variants follow the batch and the block table's width
                # (rounded up to 16 pages, _host_decode): one step for each.
                attn = self.model.attention_layers()[0]
                q = torch.empty(1, 1, attn.num_heads, attn.head_dim, dtype=self.dtype,
                                device=self.device)
                for bs, width in paged_decode_warm_shapes(
                        q, attn.k_cache, attn.v_cache, range(1, cfg.max_num_seqs + 1),
                        range(16, _round_up(cfg.blocks_per_seq, 16) + 1, 16)):
                    keys = min(width * ps, cfg.max_model_len)
                    self.forward(self.prepare([seq(keys, 1)] * bs))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- forward and sampling ---------------------------------------------------------
    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of every row of the step (a replayed graph's real rows);
        ``_sampled`` picks those that sample. (bench/step_kernels.py times this method
        as the step's forward.)"""
        if inputs.graph_bs is not None:
            return self._replay(inputs.graph_bs)[:len(inputs.meta.query_lens)]
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)

    @staticmethod
    def _sampled(hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        return hidden if inputs.logits_indices is None else hidden[inputs.logits_indices]

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs):
        """(logprobs (R,), top) of the prompt tokens that the step's rows prompt_rows
        predict, top (ids, logprobs) each (R, k) for the most alternatives a sequence
        asked for (None for 0); None without such rows. The LM head runs over at most
        max_num_seqs rows at a time: the activation peak that the pool was sized
        beside (``_free_cuda_bytes``). Every rank of a tensor-parallel group runs it
        (compute_logits gathers the vocabulary slices)."""
        rows, targets = inputs.prompt_rows, inputs.prompt_targets
        if rows is None:
            return None
        k, chunk = inputs.host.prompt_top, self.config.max_num_seqs
        parts = []
        for i in range(0, len(rows), chunk):
            logits = self.model.compute_logits(hidden[rows[i:i + chunk]]).float()
            log_z = logits.logsumexp(dim=-1, keepdim=True)
            lp = logits.gather(1, targets[i:i + chunk, None]) - log_z
            top = logits.topk(k) if k else None
            parts.append((lp.squeeze(1), *((top.indices, top.values - log_z) if k else ())))
        out = [torch.cat(x) for x in zip(*parts)]
        return out[0], (tuple(out[1:]) if k else None)

    def launch(self, scheduled) -> LaunchedStep:
        """Queue one step: inputs, forward, sampling, and on CUDA the copy of the sampled
        tokens to pinned host memory, without waiting for any of it (``wait`` does)."""
        return self.run(self.prepare(scheduled), scheduled)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, scheduled) -> LaunchedStep:
        """launch's work after prepare. Under tensor parallelism ``follow`` is the other
        ranks' side of it: the same collectives, in the same order."""
        seqs = [scheduled[b][0] for b in inputs.sample_rows]
        hidden = self.forward(inputs)
        prompt = self._prompt_logprobs(hidden, inputs)
        if prompt is not None:
            spans = [(scheduled[b][0], start, count)
                     for b, start, count in inputs.host.prompt_spans]
            prompt = (spans, *self._to_host(prompt[0]),
                      *(() if prompt[1] is None else self._to_host(*prompt[1])))
        hidden = self._sampled(hidden, inputs)
        if not seqs:
            self._last_tokens = None
            return LaunchedStep(seqs, None, None, self._event(), False, prompt=prompt)
        if seqs == self._greedy_seqs:  # list equality: identity, one C loop
            tensors = self._greedy_tensors
        else:
            tensors = SamplingTensors.from_seqs(seqs, self.device,
                                                self.config.model_config.vocab_size)
            # An all-greedy step's tensors depend on nothing but its sequences' parameters,
            # fixed per request: the next step of the same sequences (most decode steps)
            # reuses them without reading 2 x 256 parameter sets again.
            plain = tensors.all_greedy and not tensors.adjusts_logits
            self._greedy_seqs, self._greedy_tensors = (seqs, tensors) if plain else \
                (None, None)
        logits = self.model.compute_logits(hidden)  # the sampler upcasts
        tokens, logprobs = self.sampler(logits, tensors)  # logprobs None: none asked
        top = None
        if tensors.top_logprobs:  # the raw distribution's, as the chosen token's logprob
            # log Z = the chosen token's logit - its logprob (the sampler's): no second
            # fp32 copy and log_softmax of the (rows, vocab) logits.
            values, ids = logits.topk(tensors.top_logprobs)
            log_z = logits.gather(1, tokens[:, None]).float() - logprobs[:, None]
            top = (ids, values.float() - log_z)
        if self.model.tp.size > 1 and self.config.async_scheduling:
            self.model.tp.broadcast(tokens)  # the other ranks' next step may read them
        self._last_tokens = tokens  # the next step's in-flight input ids come from here
        (tokens,) = self._to_host(tokens)
        if logprobs is not None:
            (logprobs,) = self._to_host(logprobs)
        if top is not None:
            top = self._to_host(*top)
        return LaunchedStep(seqs, tokens, logprobs, self._event(), tensors.reads_token_ids,
                            top, prompt)

    def _to_host(self, *tensors) -> tuple:
        """On CUDA, copies into pinned host memory queued without waiting (valid once
        the step's event fires); elsewhere the tensors themselves."""
        if self.device.type != "cuda":
            return tensors
        return tuple(torch.empty_like(x, device="cpu", pin_memory=True).copy_(
            x, non_blocking=True) for x in tensors)

    def _event(self) -> Optional[torch.cuda.Event]:
        """An event after the step's queued work (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    @torch.inference_mode()
    def follow(self, host: HostStep):
        """A step that rank 0 launched, on another rank of a tensor-parallel group: the
        same forward over this rank's slice of the model, the LM head's all_gather of the
        rows that sample, and, with asynchronous scheduling, the sampled tokens
        broadcast by rank 0, which the next step's in-flight input ids are read from."""
        inputs = self.upload(host)
        hidden = self.forward(inputs)
        self._prompt_logprobs(hidden, inputs)
        hidden = self._sampled(hidden, inputs)
        self._last_tokens = None
        if inputs.sample_rows:
            self.model.compute_logits(hidden)
            if self.config.async_scheduling:
                self._last_tokens = self.model.tp.broadcast(torch.empty(
                    len(inputs.sample_rows), dtype=torch.int64, device=self.device))

    def execute(self, scheduled) -> tuple[list, list[int], list[float]]:
        """Run one step synchronously. Returns (sequences that sampled, their token ids,
        logprobs); changes no sequence (the scheduler records steps)."""
        step = self.launch(scheduled)
        return (step.seqs, *self.wait(step))

    def wait(self, step: LaunchedStep) -> tuple[list[int], list]:
        """A launched step's sampled token ids and logprobs on the host, once done;
        the prompt logprobs it computed are stored into their sequences."""
        if step.done is not None and (step.seqs or step.prompt is not None):
            step.done.synchronize()
        if step.prompt is not None:
            spans, lp, *top = step.prompt
            lp, top = lp.tolist(), [x.tolist() for x in top]
            i = 0
            for seq, start, count in spans:
                seq.keep_prompt_logprobs(start, lp[i:i + count],
                                         *(x[i:i + count] for x in top))
                i += count
        if not step.seqs:
            return [], []
        tokens = step.tokens.tolist()
        if step.logprobs is None:  # no request of the step asked for logprobs
            return tokens, [None] * len(tokens)
        if step.top is None:
            return tokens, step.logprobs.tolist()
        # (logprob, alternative ids, their logprobs) per row: Sequence.resolve keeps them.
        return tokens, list(zip(step.logprobs.tolist(), *(x.tolist() for x in step.top)))

    def shutdown(self):
        """Release what outlives this object: nothing in one process (the pool and the
        graphs go with it); the worker processes under tensor parallelism (workers.py)."""
