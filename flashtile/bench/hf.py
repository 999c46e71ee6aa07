"""transformers with attn_implementation="flashtile" beside "sdpa" and "eager"
(``flashtile bench hf``).

One process, one model with random weights (a preset of ``flashtile.bench.throughput``,
default llama-3.2-1b, bf16), switched between the attention implementations with
``set_attn_implementation``, so every row has the same weights, the same inputs and the
same process state. The implementations take turns within each repetition (see
``_timed``). Timed:

- ``generate`` at each ``--batches`` size: ``--prompt`` random prompt tokens per row (no
  padding, so transformers passes no mask; with ``--pad`` each row's prompt is
  shortened by a random 0 .. prompt/4 tokens and left-padded, as a tokenizer pads a
  batch for generate, so the padded prefill and decode paths are timed), ``--new``
  greedy new tokens
  (min_new_tokens = max_new_tokens: no early stop), transformers' default dynamic
  cache. Also timed with one new token (the prefill); decode tokens/s are the other
  new tokens over the rest of the time.
- one training step: forward and backward of a causal-LM loss over ``--train-tokens``
  tokens (batch 1), gradients freed between steps. ``--profile`` then runs one more
  step per implementation under torch.profiler and prints its ``--profile`` most
  expensive kernels (device time; CPU time on ``--device cpu``), to show where a gap
  between implementations lies, and the device time of all its kernels beside the timed
  step: the difference is time the GPU waited for the host (session 13: a backward 3.3
  ms faster left the step's time unchanged, which only such idle time explains).
  ``--profile`` does the same for one more ``generate`` per batch and implementation,
  and reports the host time a call spent inside transformers' attention function
  (counted in a separate, unprofiled call): at small batches decode is host-bound, and
  that is the part of the host time that is the implementation's own.

Each measurement is the median of ``--reps`` runs after one untimed run of the same
shapes (kernel compiles and autotuning happen there), the implementations alternating. Peak memory is
torch.cuda.max_memory_allocated over the timed runs, weights included. The table goes to
stdout; the rows, versions and device to ``--out`` as JSON.

``--device cpu`` is a smoke run with a tiny model (two layers, hidden 64) and small
sizes, for the test suite; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

IMPLS = ("flashtile", "sdpa", "eager")
MIN_TRANSFORMERS = "4.56"
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
            max_position_embeddings=512, torch_dtype="float32")


def _parser():
    from flashtile.bench.throughput import PRESETS
    p = argparse.ArgumentParser(prog="flashtile bench hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS),
                   help="model shape (random weights); default llama-3.2-1b (CUDA)")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens per row")
    p.add_argument("--new", type=int, default=256, help="new tokens per row")
    p.add_argument("--train-tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pad", action="store_true",
                   help="left-pad the generate prompts: each row a random 0..prompt/4 "
                        "tokens shorter")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timings, the N most expensive kernels of one training "
                        "step and one generate per implementation (torch.profiler), and "
                        "generate's host time inside the attention function")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a smoke run with a tiny model (numbers mean nothing)")
    p.add_argument("--out", default="bench-hf.json")
    return p


def _sync(device):
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, impls, reps, device, setup):
    """{impl: (median seconds, peak GiB)} of ``reps`` calls of ``fn()`` under each of
    ``impls`` (``setup(impl)`` before each call, untimed), after one untimed call under
    each. The implementations take turns within each rep, so
    a drift of the host or the clocks during the run lands on all of them alike (in
    session 11 the first implementation timed, alone, came out 1.7x slower at batch 1
    than the same calls later in the process)."""
    import torch
    for impl in impls:
        setup(impl)
        fn()
    times = {impl: [] for impl in impls}
    peaks = dict.fromkeys(impls, 0.0)
    for _ in range(reps):
        for impl in impls:
            setup(impl)
            _sync(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            fn()
            _sync(device)
            times[impl].append(time.perf_counter() - start)
            if device == "cuda":
                peaks[impl] = max(peaks[impl], torch.cuda.max_memory_allocated() / 2**30)
    return {impl: (sorted(t)[len(t) // 2], peaks[impl] if device == "cuda" else None)
            for impl, t in times.items()}


def _model(args, dtype):
    import torch
    import transformers
    from flashtile.bench.throughput import PRESETS
    from flashtile.integrations.transformers import register
    register()  # attn_implementation="flashtile" (importing the module already did it)
    spec = TINY if args.device == "cpu" and args.model is None else PRESETS[
        args.model or "llama-3.2-1b"]
    config = transformers.AutoConfig.for_model(**{k: v for k, v in spec.items()
                                                 if k != "architectures"})
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, config


def run(args) -> list[dict]:
    import torch
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, config = _model(args, dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []

    def timed(fn, training=False):
        def setup(impl):
            model.set_attn_implementation(impl)
            model.train(training)
        return _timed(fn, args.impls, args.reps, device, setup)

    for batch in args.batches:
        ids = torch.randint(config.vocab_size, (batch, args.prompt), generator=gen)
        mask = torch.ones_like(ids)
        if args.pad:
            _left_pad(ids, mask, args.prompt // 4, gen)
        ids, mask = ids.to(device), mask.to(device)

        def generate(new):
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0)

        prefill, total = timed(lambda: generate(1)), timed(lambda: generate(args.new))
        generated = len(rows)
        for impl in args.impls:
            (prefill_s, _), (total_s, peak) = prefill[impl], total[impl]
            decode_s = total_s - prefill_s  # noise can make it <= 0 on tiny runs
            rows.append(dict(task="generate", impl=impl, batch=batch, prompt=args.prompt,
                             padding=int((mask == 0).sum()), new=args.new,
                             ms=1e3 * total_s, prefill_ms=1e3 * prefill_s,
                             tokens_s=batch * args.new / total_s,
                             decode_tokens_s=(batch * (args.new - 1) / decode_s
                                              if decode_s > 0 and args.new > 1 else None),
                             peak_gib=peak))
            print(f"  {impl} generate batch {batch}: {rows[-1]['ms']:.0f} ms", flush=True)
        if args.profile:
            for row in rows[generated:]:
                model.set_attn_implementation(row["impl"])
                model.train(False)
                rows.append(_profiled(lambda: generate(args.new), row, device,
                                      args.profile))
    ids = torch.randint(config.vocab_size, (1, args.train_tokens), generator=gen)
    ids = ids.to(device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    for impl, (step_s, peak) in timed(step, training=True).items():
        rows.append(dict(task="train step", impl=impl, batch=1, tokens=args.train_tokens,
                         ms=1e3 * step_s, tokens_s=args.train_tokens / step_s,
                         peak_gib=peak))
        print(f"  {impl} train step: {rows[-1]['ms']:.0f} ms", flush=True)
    if args.profile:
        step_ms = {r["impl"]: r["ms"] for r in rows if r["task"] == "train step"}
        for impl in args.impls:
            model.set_attn_implementation(impl)
            model.train(True)
            top, kernel_ms = _profile(step, device, args.profile)
            rows.append(dict(task="train step profile", impl=impl, kernels=top,
                             kernel_ms=kernel_ms, step_ms=step_ms[impl]))
            print(f"  {impl} train step: kernels {kernel_ms:.1f} ms of the timed "
                  f"{step_ms[impl]:.1f} ms step (the GPU idle ~"
                  f"{step_ms[impl] - kernel_ms:.1f} ms); top kernels (ms, calls):",
                  flush=True)
            _print_top(top)
    _ratios(rows)
    return rows


def _print_top(top):
    for name, ms, calls in top:
        print(f"    {ms:9.3f} {calls:5d}  {name[:100]}", flush=True)


def _profiled(generate, row, device, top):
    """The ``generate profile`` row of a timed generate ``row``: one more call with the
    host time spent inside transformers' attention function counted (``_attention_host``),
    then one under torch.profiler for its ``top`` most expensive kernels and the device
    time of all of them. Decode in generate is host-bound at small batches: the kernels'
    total beside the timed call shows how much, and the attention function's host time
    per call is the part of the host time that is the implementation's own."""
    with _attention_host(row["impl"]) as spent:
        generate()
        _sync(device)
    kernels, kernel_ms = _profile(generate, device, top)
    calls, seconds = spent
    found = dict(task="generate profile", impl=row["impl"], batch=row["batch"],
                 kernels=kernels, kernel_ms=kernel_ms, ms=row["ms"],
                 attention_calls=calls,
                 attention_host_us=1e6 * seconds / calls if calls else None)
    host = (f"; {found['attention_host_us']:.1f} us of host time a call inside the "
            f"attention function ({calls} calls)" if calls else "")
    print(f"  {row['impl']} generate batch {row['batch']}: kernels {kernel_ms:.1f} ms of "
          f"the timed {row['ms']:.1f} ms{host}; top kernels (ms, calls):", flush=True)
    _print_top(kernels)
    return found


class _attention_host:
    """Inside the block, the registered attention function of ``impl`` (transformers'
    AttentionInterface; "eager" has none: nothing is counted) is wrapped to add its
    calls and wall time (perf_counter, no sync) to the [calls, seconds] the block gets;
    the registration is restored on exit."""

    def __init__(self, impl):
        import transformers
        # (a private table, as flashtile.integrations.transformers.register reads it;
        # without it nothing is counted)
        self.mapping = getattr(transformers.AttentionInterface, "_global_mapping", {})
        self.impl, self.spent = impl, [0, 0.0]

    def __enter__(self):
        self.saved = self.mapping.get(self.impl)
        if self.saved is not None:
            fn, spent = self.saved, self.spent

            def counted(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[0] += 1
                    spent[1] += time.perf_counter() - start
            self.mapping[self.impl] = counted
        return self.spent

    def __exit__(self, *exc):
        if self.saved is not None:
            self.mapping[self.impl] = self.saved


def _profile(fn, device, top):
    """([(kernel name, total ms, calls)] of the ``top`` most expensive kernels of one
    ``fn()`` under torch.profiler by device time (host time on the CPU), and the ms of
    all of them)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        _sync(device)

    def spent(e):  # torch >= 2.4 names device time device_*; self time: no double count
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    events = [e for e in prof.key_averages() if spent(e) > 0]
    events.sort(key=spent, reverse=True)
    return ([(e.key, spent(e) / 1e3, e.count) for e in events[:top]],
            sum(map(spent, events)) / 1e3)


def _left_pad(ids, mask, most, gen, pad_id=0):
    """Shorten each row's prompt by a random 0 .. most tokens, in place: the pad id and
    mask zeros at its left (the padding generate's tokenizers add)."""
    import torch
    short = torch.randint(most + 1, (ids.shape[0],), generator=gen)
    padding = torch.arange(ids.shape[1])[None, :] < short[:, None]
    ids.masked_fill_(padding, pad_id)
    mask.masked_fill_(padding, 0)


def _ratios(rows):
    """x sdpa: each row's tokens/s over sdpa's in the same task and batch."""
    timed = [r for r in rows if "tokens_s" in r]
    sdpa = {(r["task"], r["batch"]): r["tokens_s"] for r in timed if r["impl"] == "sdpa"}
    for r in timed:
        base = sdpa.get((r["task"], r["batch"]))
        r["vs_sdpa"] = r["tokens_s"] / base if base else None


def markdown(rows) -> str:
    lines = ["| task | impl | batch | ms | prefill ms | tokens/s | decode tokens/s "
             "| peak GiB | x sdpa |", "|" + " --- |" * 9]
    for r in rows:
        if "kernels" in r:  # --profile's rows are printed as they are made
            continue
        cells = [r["task"], r["impl"], r["batch"], f"{r['ms']:.1f}",
                 f"{r['prefill_ms']:.1f}" if "prefill_ms" in r else "-",
                 f"{r['tokens_s']:.0f}",
                 f"{r['decode_tokens_s']:.0f}" if r.get("decode_tokens_s") else "-",
                 f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-",
                 f"{r['vs_sdpa']:.2f}" if r["vs_sdpa"] else "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("flashtile bench hf: error: needs a CUDA device (torch sees none); "
              "--device cpu runs a smoke test with a tiny model", file=sys.stderr)
        return 2
    if args.profile < 0:
        print(f"flashtile bench hf: error: --profile must be >= 0, got {args.profile}",
              file=sys.stderr)
        return 2
    for name in ("batches", "prompt", "new", "train_tokens", "reps"):
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < 1:
            print(f"flashtile bench hf: error: --{name.replace('_', '-')} must be >= 1, "
                  f"got {values}", file=sys.stderr)
            return 2
    try:
        import transformers
    except ImportError:
        transformers = None
    from packaging import version
    if transformers is None or version.parse(transformers.__version__) < version.parse(
            MIN_TRANSFORMERS):
        found = transformers.__version__ if transformers else "none"
        print(f"flashtile bench hf: error: needs Hugging Face transformers >= "
              f"{MIN_TRANSFORMERS} (from_config(dtype=), set_attn_implementation), found "
              f"{found}: pip install -U 'flashtile[hf]'", file=sys.stderr)
        return 2
    from flashtile.bench import machine
    argv = list(sys.argv[1:] if argv is None else argv)
    rows = run(args)
    print(markdown(rows))
    info = machine.machine_info(args.device, "flashtile bench hf " + " ".join(argv))
    info["transformers"] = transformers.__version__
    with open(args.out, "w") as f:
        json.dump(dict(info=info, settings=vars(args), rows=rows), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
