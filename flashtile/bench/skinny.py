"""Skinny GEMMs of decode batches: engine/skinny_linear.py against the sequences it fuses.

``python -m flashtile.bench.skinny [--models ...] [--rows 1 4 16 64 128 256] [--out FILE.json]``

For each model's layer (random bf16 weights at its shapes), each of its four products
at each row count (1-64: small decode batches, one row tile; 128 and 256: the batches of
a throughput run, two and four row tiles), four providers, each timed in a CUDA graph
(the engine's setting):

- ``unfused``: what the engine runs today: its elementwise kernel (engine/layernorm.py's
  add_rms_norm, activation.py's silu_and_mul), then F.linear (cuBLAS), then an eager
  residual add where the product has one;
- ``fused``: ``skinny_linear`` with that part as its prologue or epilogue;
- ``linear`` and ``plain``: F.linear and ``skinny_linear`` alone (the GEMM without the
  fusion: whether our kernel alone is nearer its bytes than cuBLAS's).

The products and what is fused into them: ``qkv`` (the input RMSNorm with its residual
add; Qwen2's bias), ``o`` (+ residual), ``gate_up`` (the post-attention RMSNorm with its
residual add), ``down`` (SiLU-and-multiply). Each timed call is validated first against
a float64 reference (STYLE.md's rule: at most twice the unfused sequence's error plus
one bf16 unit of the largest output).

Timing: a CUDA graph of back-to-back calls, each on its own copy of the weights (at
least 20, and enough that the copies are three times the L2: in a decode step every
layer's weights come from memory, not from the L2), its median replay of 30 per call;
the providers in turn, ``--rounds`` times, the median round kept. Bandwidth counts the weight bytes (W and bias):
what a decode step must read. The per-layer table sums a layer's products as the engine
would run them: unfused (norm + qkv, o, norm + gate_up, SiLU-and-mul + down) against
fused (qkv, plain o, gate_up, down; the o row's residual add lives in the next norm).

FLASHTILE_SKINNY_LINEAR_CONFIG="BLOCK_N,BLOCK_K,split_k,num_warps,num_stages" times
every fused call at one tile instead of configs.skinny_linear_config's (an A/B run).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

OPS = ("qkv", "o", "gate_up", "down")
PROVIDERS = ("unfused", "fused", "linear", "plain")
DEFAULT_MODELS = ("qwen2.5-0.5b", "llama-3.2-1b")
MIN_CALLS = 20  # weight copies a graph calls at least
REPS = 30  # replays of a graph


def shapes(model: str) -> dict:
    """{op: (N, K, prologue, norm_residual?, bias?, residual?)} of the model's layer."""
    from flashtile.bench.throughput import PRESETS
    from flashtile.engine.config import ModelConfig

    c = ModelConfig.from_dict(PRESETS[model])
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, inter = c.hidden_size, c.intermediate_size
    return {"qkv": (q + 2 * kv, h, "rmsnorm", True, c.qkv_bias, False),
            "o": (h, q, None, False, False, True),
            "gate_up": (2 * inter, h, "rmsnorm", True, False, False),
            "down": (h, inter, "silu_mul", False, False, False)}


def make_call(op_shape, m, device, dtype=torch.bfloat16, seed=0):
    """(inputs shared by the calls, a function of one weight copy -> its kwargs)."""
    n, k, prologue, add, bias, residual = op_shape
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)
    shared = dict(x=rnd(m, 2 * k if prologue == "silu_mul" else k))
    if prologue == "rmsnorm":
        shared.update(norm_weight=rnd(k, scale=0.1) + 1, eps=1e-6)
        if add:
            shared["norm_residual"] = rnd(m, k)
    if residual:
        shared["residual"] = rnd(m, n)

    def weights():
        w = dict(weight=rnd(n, k, scale=k ** -0.5))
        if bias:
            w["bias"] = rnd(n)
        return w
    return dict(prologue=prologue, **shared), weights


def providers(kw):
    """{provider: fn(weights) -> y} for one product's shared inputs ``kw``."""
    from flashtile.engine import activation, layernorm
    from flashtile.engine.skinny_linear import skinny_linear

    prologue, x, residual = kw["prologue"], kw["x"], kw.get("residual")

    def unfused(w):
        h = x
        if prologue == "silu_mul":
            h = activation.silu_and_mul(x)
        elif prologue == "rmsnorm" and "norm_residual" in kw:
            h = layernorm.add_rms_norm(x, kw["norm_residual"], kw["norm_weight"],
                                       kw["eps"])[0]
        elif prologue == "rmsnorm":
            h = layernorm.rms_norm(x, kw["norm_weight"], kw["eps"])
        y = F.linear(h, w["weight"], w.get("bias"))
        return y if residual is None else y + residual

    def fused(w):
        out = skinny_linear(**kw, **w)
        return out[0] if isinstance(out, tuple) else out

    plain_x = plain_input(kw)
    return dict(unfused=unfused, fused=fused,
                linear=lambda w: F.linear(plain_x, w["weight"]),
                plain=lambda w: skinny_linear(plain_x, w["weight"]))


def plain_input(kw):
    """The input of the product alone (linear, plain): x, or gate's half of it."""
    x = kw["x"]
    return x[:, :x.shape[1] // 2] if kw["prologue"] == "silu_mul" else x


def check(name, fn, w, kw, unfused_out):
    """Max error of fn against float64, within 2x the unfused sequence's plus a floor
    (linear and plain: against their own float64 product)."""
    from flashtile.engine.skinny_linear import skinny_linear_reference

    out = fn(w).double()
    if name in ("linear", "plain"):
        x = plain_input(kw)
        exact = F.linear(x.double(), w["weight"].double())
        peer = F.linear(x, w["weight"]).double()
    else:
        d64 = {k: v.double() if isinstance(v, torch.Tensor) else v
               for k, v in {**kw, **w}.items()}
        exact = skinny_linear_reference(**d64)
        exact = exact[0] if isinstance(exact, tuple) else exact
        peer = unfused_out.double()
    err, err_peer = ((t - exact).abs().max().item() for t in (out, peer))
    floor = torch.finfo(torch.bfloat16).eps * exact.abs().max().item()
    if not err <= 2 * err_peer + floor:
        raise RuntimeError(f"{name}: max error {err:.3g}, PyTorch's {err_peer:.3g}")
    return err


def run_row(model, op, op_shape, m, rounds, device="cuda"):
    """One product at one row count: each provider checked, then timed in turn
    ``rounds`` times (each a CUDA graph of one call per weight copy, its median replay
    per call: step_kernels.graph_us), the median round kept."""
    from flashtile.bench.decode import median
    from flashtile.bench.step_kernels import graph_us

    n, k = op_shape[:2]
    kw, weights = make_call(op_shape, m, device)
    w_bytes = 2 * (n * k + (n if op_shape[4] else 0))
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    copies = max(MIN_CALLS, math.ceil(3 * l2 / w_bytes))
    ws = [weights() for _ in range(copies)]
    fns = providers(kw)
    row = dict(model=model, op=op, m=m, n=n, k=k, weight_mb=round(w_bytes / 1e6, 2),
               calls=copies)
    unfused_out = fns["unfused"](ws[0])
    runnable = {}
    for name, fn in fns.items():
        try:
            row[name] = dict(err=float(f"{check(name, fn, ws[0], kw, unfused_out):.3g}"))
            runnable[name] = [lambda w=w, fn=fn: fn(w) for w in ws]
        except Exception as e:  # a provider that fails a row: recorded, the run goes on
            row[name] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
    try:
        timed = {name: [] for name in runnable}
        for _ in range(rounds):  # in turn: no provider gains from its place in a round
            for name, calls in runnable.items():
                timed[name].append(graph_us(calls, REPS))
        for name, us in timed.items():
            t = median(us)
            row[name].update(us=round(t, 2), gbps=round(w_bytes / t / 1e3),
                             rounds_us=[round(u, 2) for u in us])
    except Exception as e:
        for name in runnable:
            row[name]["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    del ws, runnable
    torch.cuda.empty_cache()
    return row


def _us(row, name):
    return row.get(name, {}).get("us")


def markdown(rows, copy_gbps=None) -> str:
    """One line per product and row count; then each model's layer per row count."""
    lines = ["| model | op | M | N x K | W MB | unfused us | fused us | fused / unfused | "
             "fused GB/s | % of copy | F.linear us | plain us | plain / F.linear |",
             "|---" * 13 + "|"]
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"
    ratio = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.2f}"
    for r in rows:
        fused = r.get("fused", {})
        pct = f"{100 * fused['gbps'] / copy_gbps:.0f}%" if copy_gbps and "gbps" in fused \
            else "n/a"
        lines.append(
            f"| {r['model']} | {r['op']} | {r['m']} | {r['n']} x {r['k']} "
            f"| {r['weight_mb']} "
            f"| {fmt(_us(r, 'unfused'))} | {fmt(_us(r, 'fused'))} "
            f"| {ratio(_us(r, 'fused'), _us(r, 'unfused'))} | {fused.get('gbps', 'n/a')} "
            f"| {pct} | {fmt(_us(r, 'linear'))} | {fmt(_us(r, 'plain'))} "
            f"| {ratio(_us(r, 'plain'), _us(r, 'linear'))} |")
    layers = layer_sums(rows)
    if layers:
        lines += ["", "| model | M | layer unfused us | layer fused us | fused / unfused "
                  "| weight bytes at copy us |", "|---" * 6 + "|"]
        for (model, m), (unfused, fused, mb) in layers.items():
            at_copy = f"{mb * 1e3 / copy_gbps:.2f}" if copy_gbps else "n/a"
            lines.append(f"| {model} | {m} | {fmt(unfused)} | {fmt(fused)} | "
                         f"{ratio(fused, unfused)} | {at_copy} |")
    return "\n".join(lines)


def layer_sums(rows) -> dict:
    """{(model, M): (unfused us, fused us, weight MB)} where a layer's four rows are all
    timed: the o row counted as F.linear and as plain (its residual add is the next
    norm's, fused into gate_up's prologue)."""
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["m"]), {})[r["op"]] = r
    out = {}
    for key, ops in by.items():
        if set(ops) != set(OPS):
            continue
        pick = {op: ("linear", "plain") if op == "o" else ("unfused", "fused")
                for op in OPS}
        unfused = [_us(ops[op], pick[op][0]) for op in OPS]
        fused = [_us(ops[op], pick[op][1]) for op in OPS]
        if None in unfused or None in fused:
            continue
        out[key] = (sum(unfused), sum(fused), sum(ops[op]["weight_mb"] for op in OPS))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashtile.bench.skinny",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64, 128, 256])
    p.add_argument("--rounds", type=int, default=3,
                   help="timed rounds (all providers in turn each round); the median kept")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("flashtile.bench.skinny: needs a CUDA device", file=sys.stderr)
        return 2
    from flashtile.bench.machine import ceilings, machine_info

    copy = ceilings(torch.device("cuda"))[0]["copy_bytes_per_s"] / 1e9
    print(f"# device copy {copy:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    rows = []
    for model in args.models:
        layer = shapes(model)
        for op in args.ops:
            for m in args.rows:
                row = run_row(model, op, layer[op], m, args.rounds)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(markdown(rows, copy))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(machine=machine_info("cuda", " ".join(sys.argv)), copy_gbps=copy,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
