"""What runs inside one provider's process of ``flashtile bench throughput``: the engine
(offline generate, optionally traced step by step), transformers' generate and
generate_batch, and the decode step against its read floor. The parent
(throughput.py) starts ``python -m flashtile.bench.throughput --one PROVIDER`` and reads
the one ``RESULT`` JSON line that ``run_one`` prints."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager

from flashtile.bench.throughput import kv_bytes_per_token, param_count, workload


def _print_compile(repr, compile, **_):
    """Triton's post-compile hook: the kernel and its specialisation, one line (Triton
    3.6's own ``repr`` lists the first argument only): each argument with what Triton
    specialised it on, D for 16-byte divisible, =value for a constant (an int equal to 1
    becomes one), which is what a warm-up must reproduce."""
    signature, configs, constants = (compile[k] for k in ("signature", "configs",
                                                          "constants"))
    spec = []
    for i, (name, ty) in enumerate(signature.items()):
        if ty == "constexpr":
            spec.append(f"{name}={constants.get((i,))}")
        else:
            divisible = any(a[0] == "tt.divisibility" for a in configs[0].get((i,), ()))
            spec.append(f"{name}:{ty}{':D' if divisible else ''}")
    print(f"compiling (Triton) {repr.split('(')[0]}({', '.join(spec)})", file=sys.stderr,
          flush=True)


class _StepTrace:
    """Where a run's time goes, without slowing it: CUDA events before and after each
    launched step (no host wait), read once the run is over. A step's GPU span runs from
    its first event to its last; the gap before it is time the GPU waited for the host.
    Steps are grouped by kind: pure decode of B sequences (by B's power of two) or a step
    with prompt tokens."""

    def __init__(self, runner):
        import torch
        self.steps, self._launch = [], runner.launch

        def launch(scheduled):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            step = self._launch(scheduled)
            end.record()
            tokens = sum(n for _, n in scheduled)
            self.steps.append((len(scheduled), tokens, start, end,
                               time.perf_counter() - t0))
            return step
        runner.launch = launch

    def summary(self) -> dict:
        kinds = {}
        prev_end = None
        for bs, tokens, start, end, host in self.steps:
            kind = (f"decode<={1 << (bs - 1).bit_length()}" if tokens == bs
                    else "with prompt tokens")
            k = kinds.setdefault(kind, dict(steps=0, gpu_ms=0.0, idle_ms=0.0, launch_ms=0.0))
            k["steps"] += 1
            k["gpu_ms"] += start.elapsed_time(end)
            k["idle_ms"] += max(prev_end.elapsed_time(start), 0.0) if prev_end else 0.0
            k["launch_ms"] += 1e3 * host
            prev_end = end
        return kinds


def _phase(what):
    """A progress mark the parent reports if this run times out."""
    print(f"PHASE {what}", file=sys.stderr, flush=True)


def _engine(args, cfg, requests, backend, eager, kv_cache_dtype="auto"):
    from flashtile.engine import LLM, SamplingParams
    import torch
    began = time.perf_counter()
    llm = LLM(model=args.model_dir, dtype="bfloat16", load_format="dummy",
              attention_backend=backend, enforce_eager=eager, max_num_seqs=args.max_num_seqs,
              max_model_len=2 * args.max_len + 16, seed=0,
              tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=kv_cache_dtype)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
              for _, n in requests]
    prompts = [p for p, _ in requests]
    _phase(f"engine built (graphs captured) at {time.perf_counter() - began:.0f} s")
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (compiles, graphs)
    torch.cuda.synchronize()
    _phase(f"warm-up done at {time.perf_counter() - began:.0f} s")
    torch.cuda.reset_peak_memory_stats()
    # Any kernel compiled from here on is paid inside the timing: name it (on stderr, which
    # the parent shows), so the warm-up can be made to cover it.
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("flashtile").setLevel(logging.INFO)
    import triton
    triton.knobs.runtime.jit_post_compile_hook = _print_compile
    print("TIMED RUN STARTS", file=sys.stderr, flush=True)
    profiler = None
    if args.profile:  # the run's numbers then include cProfile's overhead: marked profiled
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    trace = _StepTrace(llm.runner) if args.trace else None
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if profiler is not None:
        import pstats
        profiler.disable()
        with open(f"{args.profile}-{args.one}.txt", "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(40)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(wall_s=wall, output_tokens=produced, profiled=bool(args.profile),
                # (rank 0's device under tensor parallelism: each rank holds 1/N)
                peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                # The tokens the KV pool holds (an FP8 pool: twice a bf16 one's) and the
                # preemptions the run needed.
                kv_pool_tokens=llm.runner.num_blocks * llm.config.page_size,
                preemptions=llm.scheduler.num_preemptions,
                trace=trace.summary() if trace else None)


@contextmanager
def _decoding(llm, cfg, bs, context, prefill=False):
    """bs sequences of ``context`` random tokens in the engine's pool, as if prefilled:
    the scheduled step [(sequence, 1)] that decodes each one's last token (a step
    changes no sequence, so it can be run again); ``prefill``: the step [(sequence,
    context)] that computes each one's whole prompt instead. Freed after."""
    import torch
    from flashtile.engine import SamplingParams
    from flashtile.engine.sequence import Sequence
    seqs = [Sequence(torch.randint(cfg["vocab_size"], (context,)).tolist(),
                     SamplingParams(temperature=0.0, max_tokens=1)) for _ in range(bs)]
    blocks = llm.block_manager
    for seq in seqs:
        if not blocks.allocate(seq):
            raise RuntimeError(f"the pool cannot hold {bs} x {context} tokens")
        if not prefill:
            seq.num_computed_tokens = context - 1  # as if prefilled: decode the last
    try:
        yield [(seq, context if prefill else 1) for seq in seqs]
    finally:
        for seq in seqs:
            blocks.free(seq)


@contextmanager
def _eager(runner):
    """The runner's decode steps eager while the context lasts: a step takes a CUDA
    graph only where the runner lists one of its size (its _graph_list)."""
    graphs, runner._graph_list = runner._graph_list, []
    try:
        yield
    finally:
        runner._graph_list = graphs


def _time_step(runner, scheduled, reps):
    """Median ms of the whole engine step and of its forward alone (CUDA events around
    the forward on CUDA, the host clock on the CPU), over reps after 5 untimed."""
    import torch
    cuda = runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step_ms, fwd_ms = [], []
    for i in range(reps + 5):
        sync()
        t0 = time.perf_counter()
        runner.execute(scheduled)  # ends by reading the sampled ids: synchronous
        step = time.perf_counter() - t0
        inputs = runner.prepare(scheduled)
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            runner.forward(inputs)
            ev[1].record()
            sync()
            fwd = ev[0].elapsed_time(ev[1])
        else:
            t1 = time.perf_counter()
            runner.forward(inputs)
            fwd = 1e3 * (time.perf_counter() - t1)
        if i >= 5:
            step_ms.append(1e3 * step)
            fwd_ms.append(fwd)
    return sorted(step_ms)[len(step_ms) // 2], sorted(fwd_ms)[len(fwd_ms) // 2]


def _profile_forward(runner, scheduled, path, reps=5):
    """--profile with --decode-step: ``reps`` eager forwards of the step under cProfile,
    its 30 functions of most own time into ``path``: where an eager step's host time
    goes (a prompt step's host was the bottleneck of the 0.5B shape, NOTES.md section
    26). The device is synchronised before and after, so only host work is counted."""
    import cProfile
    import pstats

    import torch
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    with _eager(runner):
        inputs = runner.prepare(scheduled)
        runner.forward(inputs)  # any first-call work stays out of the profile
        sync()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(reps):
            runner.forward(inputs)
        profiler.disable()
        sync()
    with open(path, "w") as f:
        f.write(f"# {reps} eager forwards of the step, cProfile, by own time\n")
        pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(30)


def _kernel_breakdowns(llm, cfg, args, rows):
    """--kernels: each batch size's decode step under torch.profiler, kernel by kernel
    (step_kernels), into its row as ``kernels``. Where the runner replays CUDA graphs,
    eager steps run beside them in the same session (``kernels_eager``, the forward's
    launch cost by comparison); if the profiler saw no kernel of the graph replay, the
    eager breakdown takes ``kernels``' place and says so."""
    from flashtile.bench import step_kernels
    runner = llm.runner
    cuda = runner.device.type == "cuda"
    graphs = bool(runner._graph_list)
    with step_kernels.session(cuda) as prof, step_kernels.annotated(runner):
        for row in rows:
            with _decoding(llm, cfg, row["seqs"], args.context,
                           row["prefill"]) as scheduled:
                step_kernels.run_steps(runner, scheduled, str(row["batch"]))
                if graphs and not row["prefill"]:  # prompts run eagerly anyway
                    with _eager(runner):
                        step_kernels.run_steps(runner, scheduled, f"{row['batch']}-eager")
    ranges, kernels = step_kernels.profile_events(prof, cuda)
    source = ("CUDA graph replay" if graphs else "eager forward") if cuda \
        else "CPU operators (self time)"
    for row in rows:
        bs = row["batch"]
        main = step_kernels.summarize(ranges, kernels, str(bs), source)
        eager = step_kernels.summarize(ranges, kernels, f"{bs}-eager", "eager forward")
        row["kernels"] = step_kernels.graph_or_eager(main, eager)
        row["kernels_eager"] = eager


def _decode_steps(args, cfg):
    """One decode step of B sequences with --context keys each, against the bytes it must
    read (every weight once, every live key and value once) at the copy bandwidth.

    Timed two ways: the whole engine step as the engine runs it (inputs, graph replay,
    logits, sampling, reading the tokens back), and the forward alone (CUDA events around
    the graph replay). The pool's keys are zeros: the timing does not depend on them.
    With --prefill-seqs P, a prompt step too: P prompts of --context tokens computed in
    one step, against the roofline's prompt rule (2 x parameters FLOPs a token at the
    matrix rate). With --kernels, each step is then profiled kernel by kernel, and on
    CUDA the launch floor of a graph's kernel is measured (step_kernels.graph_kernel_us).
    """
    from flashtile.engine import LLM
    from flashtile.engine.config import EngineConfig
    sizes = args.decode_batches
    llm = LLM(model=args.model_dir, dtype="bfloat16", load_format="dummy",
              max_num_seqs=max(sizes + [args.prefill_seqs]),
              max_num_batched_tokens=max(EngineConfig.max_num_batched_tokens,
                                         args.prefill_seqs * args.context),
              max_model_len=args.context + 16, seed=0)
    runner = llm.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in
                       {id(p): p for p in runner.model.parameters()}.values())
    rows = []
    steps = [(bs, False) for bs in sizes] + ([(args.prefill_seqs, True)]
                                             if args.prefill_seqs else [])
    for bs, prefill in steps:
        with _decoding(llm, cfg, bs, args.context, prefill) as scheduled:
            step, fwd = _time_step(runner, scheduled, args.decode_reps)
        if prefill:
            kv = 0
            flops = 2 * param_count(cfg) * bs * args.context
            floor_ms = 1e3 * flops / (args.matmul_tflops * 1e12)
        else:
            kv = bs * args.context * kv_bytes_per_token(cfg)
            floor_ms = 1e3 * (weight_bytes + kv) / (args.copy_gbs * 1e9)
        rows.append(dict(batch=f"prefill {bs}x{args.context}" if prefill else bs,
                         seqs=bs, prefill=prefill, context=args.context,
                         weight_gb=weight_bytes / 1e9, kv_gb=kv / 1e9, floor_ms=floor_ms,
                         step_ms=step, forward_ms=fwd, step_frac=floor_ms / step,
                         forward_frac=floor_ms / fwd))
    if getattr(args, "profile", None):
        for row in rows:
            with _decoding(llm, cfg, row["seqs"], args.context,
                           row["prefill"]) as scheduled:
                _profile_forward(runner, scheduled, f"{args.profile}-{row['batch']}.txt")
    if args.kernels:
        _kernel_breakdowns(llm, cfg, args, rows)
        if runner.device.type == "cuda":
            from flashtile.bench import step_kernels
            floor = step_kernels.graph_kernel_us()
            for row in rows:
                row["graph_kernel_us"] = floor
    return rows


def _hf_model(args, cfg):
    import torch
    import transformers
    config = transformers.AutoConfig.from_pretrained(args.model_dir)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation=args.hf_attn)
    return model.eval()


def _hf(args, cfg, requests, batched):
    import torch
    import transformers
    model = _hf_model(args, cfg)
    requests = requests[:args.hf_requests]  # transformers is slow: a stated subset
    torch.cuda.reset_peak_memory_stats()
    produced = 0
    start = time.perf_counter()
    if batched:
        gen = transformers.GenerationConfig(max_new_tokens=max(n for _, n in requests),
                                            do_sample=False, eos_token_id=None,
                                            pad_token_id=0)
        outs = model.generate_batch([p for p, _ in requests], generation_config=gen)
        produced = sum(len(o.generated_tokens) for o in outs.values())
    else:
        for i in range(0, len(requests), args.hf_batch):
            chunk = requests[i:i + args.hf_batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk],
                                device="cuda")
            new = max(n for _, n in chunk)  # a static batch runs to its longest request
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
            produced += sum(n for _, n in chunk)  # only the tokens each request asked for
    torch.cuda.synchronize()
    return dict(wall_s=time.perf_counter() - start, output_tokens=produced,
                requests=len(requests), peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def run_one(args):
    with open(os.path.join(args.model_dir, "config.json")) as f:
        cfg = json.load(f)
    requests = workload(args.num_requests, args.min_len, args.max_len, cfg["vocab_size"],
                        args.seed)
    p = args.one
    if p == "decode-step":
        print("RESULT " + json.dumps(_decode_steps(args, cfg)), flush=True)
        return
    if p.startswith("hf-"):
        res = _hf(args, cfg, requests, batched=p == "hf-generate-batch")
    else:
        backend = {"engine-naive": "naive", "engine-sdpa": "sdpa"}.get(p, "flashtile")
        res = _engine(args, cfg, requests, backend, eager=p == "engine-flashtile-eager",
                      kv_cache_dtype="fp8" if p == "engine-flashtile-fp8kv" else "auto")
        res["requests"] = len(requests)
    n = res["requests"]
    res["input_tokens"] = sum(len(q) for q, _ in requests[:n])
    print("RESULT " + json.dumps(res), flush=True)
