"""Host time of one engine step at a large decode batch, with the model's forward stubbed.

A decode step of Qwen2.5-0.5B at batch 256 takes the H200 ~2.3 ms; everything else a step
does (schedule, input preparation, sampling tensors, bookkeeping, detokenisation) is host
work (runner.launch alone took 1.45 ms a step in session 15's trace). This measures that
work alone on any machine: a dummy checkpoint, BATCH requests decoding with PROMPT-token
prompts, the time of ``LLM._step()`` (what ``generate`` runs; ``--server``:
``LLM.step()``, which also builds a RequestOutput per request) over the decode steps,
split into its parts, and a cProfile of them (--profile). What a CPU run leaves out: the
CUDA calls (pinned copies, kernel launches, the graph replay), which only the GPU's trace
and profile show.

As on the GPU by default: asynchronous scheduling, and decode steps laid out for the CUDA
graphs of batch sizes 1, 2, 4, ... max_num_seqs (static inputs on the CPU, a replay that
does nothing); ``--eager`` times the CPU engine's own path instead (synchronous, no graphs,
the stub forward). The LM head returns a (rows, 8) zero tensor, so the sampler's argmax
costs next to nothing and the forward's arithmetic is left out everywhere.

    PYTHONPATH=. python scripts/engine_host.py [--batch 256] [--prompt 600] [--steps 200]
        [--server] [--eager] [--profile] [--engine-kw '{"page_size": 16}']
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile
import time
from collections import defaultdict

import torch

from flashtile.engine import LLM, SamplingParams

HIDDEN, VOCAB = 64, 1000


class _NoGraph:
    def replay(self):
        pass


def _emulate_graphs(runner):
    """Give a CPU runner the decode graphs' static inputs and replays that do nothing, so
    that decode steps take the GPU's host path (_host_decode at graph sizes, the copies
    into static inputs)."""
    sizes = runner._graph_sizes()
    for bs in sizes:
        runner._static_inputs(bs)
    runner.static_hidden = torch.zeros(runner.config.max_num_seqs, HIDDEN)
    runner.graphs = {bs: _NoGraph() for bs in sizes}
    runner._graph_list = sorted(sizes)


def _timed(times, name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name].append(time.perf_counter() - start)
    return wrapper


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--max-model-len", type=int, default=2064,
                    help="default: the throughput bench's (2 x 1024 + 16)")
    ap.add_argument("--server", action="store_true")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--engine-kw", default="{}", help="JSON of extra EngineConfig kwargs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kw = dict(async_scheduling=not args.eager, page_size=64)
    kw.update(json.loads(args.engine_kw))
    with tempfile.TemporaryDirectory() as path:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dict(architectures=["LlamaForCausalLM"], hidden_size=HIDDEN,
                           intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB,
                           max_position_embeddings=args.max_model_len), f)
        ps = kw["page_size"]
        need = -(-(args.prompt + args.steps + 8) // ps) * args.batch
        block_bytes = 2 * 1 * ps * 2 * 16 * 4  # 1 layer, 2 kv heads x 16, float32
        llm = LLM(path, load_format="dummy", dtype="float32", device="cpu",
                  max_model_len=args.max_model_len, max_num_seqs=args.batch,
                  max_num_batched_tokens=args.batch * args.prompt,
                  kv_cache_memory=(need + 64) * block_bytes, **kw)
        runner = llm.runner
        # The forward's cost is the GPU's: stub it so that the host's work is what is timed.
        runner.model.forward = lambda ids, pos, meta: torch.zeros(ids.shape[0], HIDDEN)
        logits = torch.zeros(args.batch, 8)
        runner.model.compute_logits = lambda hidden: logits[:hidden.shape[0]]
        if not args.eager:
            _emulate_graphs(runner)
        params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        for _ in range(args.batch):
            llm.add_request(torch.randint(3, VOCAB, (args.prompt,), generator=g).tolist(),
                            params)
        for _ in range(4):  # the prefill, and the first decode steps
            llm.step()
        parts = defaultdict(list)
        sched = llm.scheduler
        sched.schedule = _timed(parts, "schedule", sched.schedule)
        runner._host_decode = _timed(parts, "prepare: host arrays", runner._host_decode)
        runner.upload = _timed(parts, "prepare: upload", runner.upload)
        runner.launch = _timed(parts, "launch (prepare, forward, sampling)", runner.launch)
        sched.launched = _timed(parts, "scheduler.launched", sched.launched)
        llm._complete = _timed(parts, "_complete (scheduler.completed, text)",
                               llm._complete)
        prof = cProfile.Profile() if args.profile else None
        if prof:
            prof.enable()
        step, times = llm.step if args.server else llm._step, []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        if prof:
            prof.disable()

        def us(values):
            """The median and the 10th percentile: other processes only add time, so on
            a shared machine the low percentile is the steadier figure."""
            values = sorted(values)
            return f"median {values[len(values) // 2] * 1e6:.0f} us, " \
                f"p10 {values[len(values) // 10] * 1e6:.0f} us"

        print(f"batch {args.batch}: host time per decode step: {us(times)}")
        for name, values in parts.items():
            print(f"  {name}: {us(values)}")
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
