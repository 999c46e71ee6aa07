"""KV memory waste of the engine's paged pool against contiguous max-length slabs
(``flashtile bench kv-waste``).

The engine's own Scheduler and BlockManager run a workload step by step; only the model is
replaced by a stub that returns a token per sampling row, since which pages are taken and
freed depends on lengths alone, never on the token values (``ignore_eos``). After each
step the pool is read:

- used: KV tokens the running sequences hold (their computed tokens);
- paged: pages held by sequences x page_size;
- slab: running sequences x max_model_len, what a contiguous per-sequence cache reserves.

Waste is 1 - used / allocated, summed over the steps (token-steps), so a long-lived
allocation weighs by how long it is held. A paged pool wastes at most one partly filled
page per sequence; a slab wastes everything its sequence never reaches. With
``--pool-tokens`` the pool is limited, and the largest concurrency each layout reaches
with that memory is reported too.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

from flashtile.bench.throughput import workload
from flashtile.engine.block_manager import BlockManager
from flashtile.engine.sampling_params import SamplingParams
from flashtile.engine.scheduler import Scheduler
from flashtile.engine.sequence import Sequence


def simulate(requests, page_size, max_model_len, pool_tokens, max_num_seqs=256,
             max_num_batched_tokens=8192):
    """Run [(prompt_ids, output_len)] through Scheduler + BlockManager; the waste figures
    and peak concurrency of the paged pool and of max_model_len slabs of the same memory."""
    blocks = BlockManager(pool_tokens // page_size, page_size, enable_prefix_caching=False)
    config = SimpleNamespace(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens)
    sched = Scheduler(config, blocks, eos_token_ids=())
    for prompt, n in requests:
        sched.add(Sequence(prompt, SamplingParams(temperature=0, max_tokens=n,
                                                  ignore_eos=True)))
    used = paged = slab = steps = peak_running = 0
    while sched.has_unfinished():
        scheduled = sched.schedule()
        if not scheduled:
            raise RuntimeError(f"a pool of {pool_tokens} tokens cannot hold one sequence")
        sampling = [seq for seq, n in scheduled
                    if seq.num_computed_tokens + n == seq.num_tokens]
        step = sched.launched(scheduled, sampling)
        holders = [seq for seq, _ in scheduled]
        used += sum(seq.num_computed_tokens for seq in holders)
        paged += sum(len(seq.block_table) for seq in holders) * page_size
        slab += len(holders) * max_model_len
        peak_running = max(peak_running, len(holders))
        steps += 1
        sched.completed(step, [0] * len(sampling), [0.0] * len(sampling))
    if blocks.num_free_blocks != blocks.num_blocks:
        raise RuntimeError("pages leaked")  # every sequence finished: all pages are back
    return dict(page_size=page_size, steps=steps, used_token_steps=used,
                paged_waste=1 - used / paged, slab_waste=1 - used / slab,
                peak_running=peak_running,
                slab_capacity=min(max_num_seqs, pool_tokens // max_model_len),
                preemptions=sched.num_preemptions)


def main(argv=None):
    p = argparse.ArgumentParser(prog="flashtile bench kv-waste", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="what a slab reserves per sequence (the longest prompt + output)")
    p.add_argument("--pool-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: enough for every request)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)
    requests = workload(args.num_requests, args.min_len, args.max_len, 32000, args.seed)
    pool = args.pool_tokens or args.max_num_seqs * args.max_model_len
    rows = [simulate(requests, ps, args.max_model_len, pool, args.max_num_seqs)
            for ps in args.page_sizes]
    print(f"{len(requests)} requests, prompt and output lengths uniform in "
          f"{args.min_len}..{args.max_len}; pool {pool} tokens; slabs of "
          f"{args.max_model_len}\n")
    print("| page size | steps | paged waste | slab waste | peak running (paged) "
          "| slabs that fit | preemptions |\n|" + " --- |" * 7)
    for r in rows:
        print(f"| {r['page_size']} | {r['steps']} | {100 * r['paged_waste']:.2f}% "
              f"| {100 * r['slab_waste']:.1f}% | {r['peak_running']} | {r['slab_capacity']} "
              f"| {r['preemptions']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(argv=argv if argv is not None else sys.argv[1:], rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
