"""Offline throughput of flashtile.engine against Hugging Face transformers (``flashtile bench
throughput``).

The workload is nano-vllm's: ``--num-requests`` requests (256) whose prompt and output lengths are
drawn uniformly from ``--min-len``..``--max-len`` (100..1024), prompt token ids uniform over the
vocabulary, ``ignore_eos`` so every request produces exactly its output length. Models are real
shapes with random weights (``load_format="dummy"``), so nothing is downloaded.

Each provider runs in a fresh subprocess (the engine sizes its KV pool from the device's free
memory, and CUDA graphs keep their memory pool): the parent writes the model's config.json, starts
``python -m flashtile.bench.throughput --one PROVIDER ...`` (throughput_runs.py) and reads one
JSON line back.

Providers:
    engine-flashtile-graphs   the engine, flashtile attention, decode in CUDA graphs
    engine-flashtile-eager    the same with enforce_eager=True
    engine-flashtile-fp8kv    engine-flashtile-graphs over an FP8 KV pool (kv_cache_dtype="fp8";
                              its roofline counts the KV cache in FP8 bytes)
    engine-sdpa, engine-naive the same engine (CUDA graphs) with torch SDPA / plain softmax
                              attention over each sequence's max_model_len keys, masked
    hf-generate               transformers ``generate`` in static batches (sdpa, left padding)
    hf-generate-batch         transformers continuous batching (``generate_batch``)

The roofline is the time the workload's decode steps would take if each step read the weights
once and every live sequence's KV cache once at the device's copy bandwidth, plus the prompt
FLOPs (2 * parameters per token) at the matrix rate: ``roofline_seconds`` below.

``--tensor-parallel-size N`` splits the engine's model over N GPUs (``LLM``'s
tensor_parallel_size; the transformers providers run on one and are refused with it). The
roofline then counts N devices' bandwidth and matrix rate, and no time for the all-reduces.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

from flashtile.bench import step_kernels

PRESETS = {
    # Real shapes of public checkpoints (their config.json values), random weights.
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
        hidden_act="silu", torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        hidden_act="silu", torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001),
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        hidden_act="silu", torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001),
}
PROVIDERS = ("hf-generate", "hf-generate-batch", "engine-naive", "engine-sdpa",
             "engine-flashtile-eager", "engine-flashtile-graphs", "engine-flashtile-fp8kv")


def workload(num_requests, min_len, max_len, vocab_size, seed=0):
    """[(prompt_token_ids, output_len)] with both lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n_in, n_out = rng.randint(min_len, max_len), rng.randint(min_len, max_len)
        out.append(([rng.randrange(vocab_size) for _ in range(n_in)], n_out))
    return out


def param_count(cfg) -> int:
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    embed = cfg["vocab_size"] * h * (1 if cfg["tie_word_embeddings"] else 2)
    return layers * per_layer + embed + h


def kv_bytes_per_token(cfg, dtype_bytes=2) -> int:
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * dtype_bytes


def roofline_seconds(cfg, requests, copy_gbs, matmul_tflops, max_num_seqs, dtype_bytes=2,
                     kv_dtype_bytes=None):
    """A floor for the workload on one device: decode steps that read the weights once per
    step and each live sequence's KV once, at the copy bandwidth; prompts at the matrix rate.
    kv_dtype_bytes: the KV cache's element size, if not the weights' (1: an FP8 pool).

    Requests run max_num_seqs at a time, each slot taking the next request when one finishes
    (the order they were given), as a continuous-batching engine would at best.
    """
    weight_bytes = param_count(cfg) * dtype_bytes
    per_token = kv_bytes_per_token(cfg, kv_dtype_bytes or dtype_bytes)
    prompt_flops = 2 * param_count(cfg) * sum(len(p) for p, _ in requests)
    pending = list(requests)
    live = []  # [prompt_len, tokens generated, output_len]
    seconds = prompt_flops / (matmul_tflops * 1e12)
    while pending or live:
        while pending and len(live) < max_num_seqs:
            p, n = pending.pop(0)
            live.append([len(p), 0, n])
        kv = sum((p + g) * per_token for p, g, _ in live)
        seconds += (weight_bytes + kv) / (copy_gbs * 1e9)
        for seq in live:
            seq[1] += 1
        live = [s for s in live if s[1] < s[2]]
    return seconds


def _row(model, provider, res, roofline, tp=1):
    tps = res["output_tokens"] / res["wall_s"]
    total = (res["output_tokens"] + res["input_tokens"]) / res["wall_s"]
    return dict(model=model, provider=provider + (f" (tp {tp})" if tp > 1 else ""),
                tensor_parallel_size=tp, requests=res["requests"],
                output_tok_s=tps, total_tok_s=total, wall_s=res["wall_s"],
                peak_gib=res["peak_gib"], kv_pool_tokens=res.get("kv_pool_tokens"),
                preemptions=res.get("preemptions"),
                vs_hf=None,  # set once the model's generate_batch row is known
                roofline_frac=roofline / res["wall_s"] if res["requests"] else None)


def markdown(rows) -> str:
    lines = ["| model | provider | requests | output tok/s | total tok/s | wall s | peak GiB "
             "| KV pool tokens | x transformers batch | of roofline |", "|" + " --- |" * 10]
    for r in rows:
        ratio = f"{r['vs_hf']:.1f}x" if r["vs_hf"] else "-"
        roof = f"{100 * r['roofline_frac']:.0f}%" if r["roofline_frac"] else "-"
        pool = f"{r['kv_pool_tokens']:,}" if r.get("kv_pool_tokens") else "-"
        lines.append(f"| {r['model']} | {r['provider']} | {r['requests']} "
                     f"| {r['output_tok_s']:.0f} | {r['total_tok_s']:.0f} | {r['wall_s']:.1f} "
                     f"| {r['peak_gib']:.1f} | {pool} | {ratio} | {roof} |")
    return "\n".join(lines)


def _child(args, argv, provider, model_dir):
    """Run one provider in a fresh process; its RESULT json, or None (reason printed)."""
    cmd = [sys.executable, "-m", "flashtile.bench.throughput", "--one", provider,
           "--model-dir", model_dir] + list(argv if argv is not None else sys.argv[1:])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        # Where it was: the child marks its phases on stderr ("PHASE ...").
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        phases = [ln[6:] for ln in (err or "").splitlines() if ln.startswith("PHASE ")]
        print(f"  {provider}: timed out after {args.timeout} s; phases reached: "
              f"{'; '.join(phases) or 'none (still loading)'}", flush=True)
        return None
    timed_log = proc.stderr.partition("TIMED RUN STARTS")[2]
    for line in timed_log.splitlines():
        if "compiling" in line:
            print(f"  {provider}: compiled inside the timed run: {line}", flush=True)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not found:
        print(f"  {provider}: failed\n{proc.stderr[-2000:]}", flush=True)
        return None
    result = json.loads(found[-1][7:])
    for kind, k in sorted(((result.get("trace") if isinstance(result, dict) else None)
                           or {}).items()):
        print(f"  {provider}: {kind}: {k['steps']} steps, GPU {k['gpu_ms']:.0f} ms "
              f"({k['gpu_ms'] / k['steps']:.2f}/step), GPU idle before them "
              f"{k['idle_ms']:.0f} ms, host launch {k['launch_ms']:.0f} ms", flush=True)
    return result


def decode_step_markdown(results, top=0) -> str:
    """The decode-step table, then, for rows profiled with --kernels, each one's kernels
    (the ``top`` of each section: step_kernels.markdown)."""
    lines = ["| model | batch | context | weights GB | KV GB | floor ms | step ms | forward ms "
             "| step of floor | forward of floor |", "|" + " --- |" * 10]
    for r in results:
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['weight_gb']:.2f} "
                     f"| {r['kv_gb']:.2f} | {r['floor_ms']:.3f} | {r['step_ms']:.3f} "
                     f"| {r['forward_ms']:.3f} | {100 * r['step_frac']:.0f}% "
                     f"| {100 * r['forward_frac']:.0f}% |")
    floors = {r["model"]: r["graph_kernel_us"] for r in results if "graph_kernel_us" in r}
    for model, us in floors.items():
        lines.append(f"\n{model}'s process: a CUDA graph of {step_kernels.FLOOR_KERNELS} "
                     f"one-element kernels replays at {us:.2f} us a kernel (the launch "
                     f"floor of each of a graphed step's kernels)")
    for r in results:
        if r.get("kernels"):
            title = (f"{r['model']}, a prompt step of {r['seqs']} x {r['context']} tokens"
                     if r.get("prefill") else
                     f"{r['model']}, batch {r['batch']}, {r['context']} keys")
            lines += ["", step_kernels.markdown(title, r["kernels"], top, r["step_ms"],
                                                r["forward_ms"], r.get("kernels_eager"))]
    return "\n".join(lines)


def _decode_step_table(args, argv):
    results = []
    for name in args.models:
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(PRESETS[name], f)
            rows = _child(args, argv, "decode-step", d) or []
        for r in rows:
            r["model"] = name
            results.append(r)
    print(decode_step_markdown(results, args.kernels))
    with open(args.out, "w") as f:
        json.dump(dict(argv=argv or sys.argv[1:], decode_steps=results), f, indent=1)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="flashtile bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["llama-3.2-1b"], choices=sorted(PRESETS))
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="GPUs the engine's model is split over (its providers only)")
    p.add_argument("--hf-requests", type=int, default=64,
                   help="transformers runs this many of the requests (it is slow)")
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--hf-attn", default="sdpa")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--copy-gbs", type=float, default=4239.0,
                   help="device copy bandwidth for the roofline (H200 measured: 4239)")
    p.add_argument("--matmul-tflops", type=float, default=786.0)
    p.add_argument("--timeout", type=int, default=900, help="seconds per provider")
    p.add_argument("--decode-step", action="store_true",
                   help="time single decode steps (--decode-batches x --context keys) "
                        "against the weights+KV read floor instead of the workload")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-reps", type=int, default=30)
    p.add_argument("--prefill-seqs", type=int, default=0, metavar="P",
                   help="with --decode-step: also time a prompt step of P prompts of "
                        "--context tokens (8 x 1024: the engine's default step budget)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="with --decode-step: then profile each batch size's step "
                        "(torch.profiler) and print its N most expensive kernels of the "
                        "forward and of the rest of the step, and where the step's time "
                        "goes on the host and the device (flashtile/bench/step_kernels.py)")
    p.add_argument("--out", default="throughput.json")
    p.add_argument("--profile", metavar="PREFIX",
                   help="cProfile each engine run into PREFIX-PROVIDER.txt; with "
                        "--decode-step, each row's eager forward into PREFIX-BATCH.txt")
    p.add_argument("--trace", action="store_true",
                   help="CUDA events around each engine step: GPU time, GPU idle time and "
                        "host launch time by step kind (decode by batch size, prompt)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tp = args.tensor_parallel_size
    if tp < 1:
        p.error(f"--tensor-parallel-size: expected an integer >= 1, got {tp}")
    if tp > 1 and (args.decode_step or any(x.startswith("hf-") for x in args.providers)):
        p.error(f"--tensor-parallel-size {tp}: the engine's providers only (transformers "
                "runs on one GPU, and --decode-step times one process's step); got "
                f"--providers {' '.join(args.providers)}"
                + (" --decode-step" if args.decode_step else ""))
    if args.one:
        from flashtile.bench.throughput_runs import run_one
        return run_one(args)
    if args.decode_step:
        return _decode_step_table(args, argv)
    rows = []
    for name in args.models:
        cfg = PRESETS[name]
        requests = workload(args.num_requests, args.min_len, args.max_len, cfg["vocab_size"],
                            args.seed)
        roof = roofline_seconds(cfg, requests, tp * args.copy_gbs, tp * args.matmul_tflops,
                                args.max_num_seqs)
        print(f"{name}: {param_count(cfg) / 1e9:.2f} B parameters, roofline "
              f"{roof:.1f} s for {len(requests)} requests"
              + (f" on {tp} GPUs" if tp > 1 else ""), flush=True)
        hf_tps = None
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
            for prov in args.providers:
                res = _child(args, argv, prov, d)
                if res is None:
                    continue
                # The roofline fraction is for the full workload only; an FP8 pool's
                # counts its KV cache in FP8 bytes.
                full = roof if prov != "engine-flashtile-fp8kv" else roofline_seconds(
                    cfg, requests, tp * args.copy_gbs, tp * args.matmul_tflops,
                    args.max_num_seqs, kv_dtype_bytes=1)
                part_roof = full if res["requests"] == len(requests) else 0
                if prov == "hf-generate-batch":
                    hf_tps = res["output_tokens"] / res["wall_s"]
                row = _row(name, prov, res, part_roof, tp)
                rows.append(row)
                note = " (under cProfile)" if res.get("profiled") else ""
                print(f"  {prov}: {row['output_tok_s']:.0f} output tok/s, "
                      f"{row['wall_s']:.1f} s{note}", flush=True)
        for r in rows:
            if r["model"] == name and hf_tps:
                r["vs_hf"] = r["output_tok_s"] / hf_tps
    print(markdown(rows))
    with open(args.out, "w") as f:
        json.dump(dict(argv=argv or sys.argv[1:], rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
