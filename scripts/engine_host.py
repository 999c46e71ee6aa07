"""Host time of one engine step at a large decode batch, with the model's forward stubbed.

The GPU runs a decode step of Llama-3.2-1B at batch 256 in ~3.8 ms; everything else a step
does (schedule, input preparation, sampling tensors, bookkeeping, detokenisation) is host
work. This measures that work alone on any machine: a dummy checkpoint whose forward
returns zeros, BATCH requests decoding with PROMPT-token prompts, the mean time of
``LLM._step()`` (what ``generate`` runs; ``--server``: ``LLM.step()``, which also builds a
RequestOutput per request) over the decode steps, and a cProfile of them (--profile).

    PYTHONPATH=. python scripts/engine_host.py [--batch 256] [--prompt 512] [--steps 200]
        [--server] [--profile] [--engine-kw '{"async_scheduling": false}']
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile
import time

import torch

from flashtile.engine import LLM, SamplingParams


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--server", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--engine-kw", default="{}", help="JSON of extra EngineConfig kwargs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as path:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dict(architectures=["LlamaForCausalLM"], hidden_size=64,
                           intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1000,
                           max_position_embeddings=4096), f)
        need = -(-(args.prompt + args.steps + 8) // 64) * args.batch
        llm = LLM(path, load_format="dummy", dtype="float32", device="cpu",
                  max_model_len=4096, max_num_seqs=args.batch, page_size=64,
                  max_num_batched_tokens=args.batch * args.prompt,
                  kv_cache_memory=(need + 64) * llm_block_bytes(), **json.loads(args.engine_kw))
        # The forward's cost is the GPU's; stub it so the host's work is what is timed.
        llm.runner.model.forward = lambda ids, pos, meta: torch.zeros(ids.shape[0], 64)
        params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        for _ in range(args.batch):
            llm.add_request(torch.randint(3, 1000, (args.prompt,), generator=g).tolist(),
                            params)
        for _ in range(4):  # the prefill, and the first decode steps
            llm.step()
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
        times.sort()
        # The median and the fastest decile: the machine may be shared.
        print(f"batch {args.batch}: host time per decode step: median "
              f"{times[len(times) // 2] * 1e3:.3f} ms, p10 {times[len(times) // 10] * 1e3:.3f} ms")
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def llm_block_bytes() -> int:
    """Bytes of one 64-token page of the benchmark's model (1 layer, 2 kv heads x 16)."""
    return 2 * 1 * 64 * 2 * 16 * 4


if __name__ == "__main__":
    main()
