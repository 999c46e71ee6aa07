"""Online serving benchmark against an OpenAI-compatible server (``flashtile bench serve``).

    flashtile serve MODEL_DIR --port 8000 &
    flashtile bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --request-rate 8 --random-input-len 512 --random-output-len 128
    flashtile bench serve ... --sweep-rates 1 2 4 8 inf

Definitions are vLLM's ``bench serve``, so the numbers compare with vLLM's:

- Workload: random prompts of token ids drawn uniformly from the vocabulary, input and
  output lengths uniform in ``[len * (1 - range_ratio), len * (1 + range_ratio)]``, sent to
  ``/v1/completions`` as token id lists with ``stream=true``, ``ignore_eos`` (so each
  request generates exactly its output length) and ``stream_options.include_usage``.
- Arrivals: gaps drawn from Gamma(shape=burstiness, scale=1 / (rate * burstiness))
  (burstiness 1: a Poisson process), their running sum rescaled so that the last request
  is sent at ``num_prompts / rate`` (vLLM does this to steady the throughput across
  seeds); rate ``inf`` sends everything at once. Seeded.
- Per request, on the client's clock: TTFT = first streamed chunk - send; ITL = the gaps
  between chunks; E2E = last chunk - send; TPOT = (E2E - TTFT) / (output tokens - 1),
  for requests of more than one token.
- Reported: mean, median, p90 and p99 (linear interpolation, numpy's default) of TTFT,
  TPOT and E2E over requests and of ITL pooled over all requests; request, output-token
  and total-token throughput over the wall time; peak concurrent requests (a sweep over
  each request's [send, last chunk) interval); goodput = requests per second meeting
  every SLO (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms).

The client is plain aiohttp: nothing of the engine is imported, so it runs anywhere.
``--fake-server STEP_MS`` starts its own server instead, ``flashtile serve`` over an
engine without a model (bench/fake_server.py), and adds the server's CPU per token to
the report: the host cost of serving, measurable on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field

LATENCIES = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds (``time.perf_counter``)."""

    prompt_len: int
    output_len: int = 0  # tokens generated: usage.completion_tokens, else the chunks
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    itl: list = field(default_factory=list)
    latency: float = 0.0  # E2E


# ---- workload -------------------------------------------------------------------------
def random_requests(num, input_len, output_len, range_ratio, vocab_size, seed):
    """[(prompt token ids, output length)] with vLLM's random-dataset lengths."""
    rng = random.Random(seed)

    def length(n):
        return rng.randint(max(1, int(n * (1 - range_ratio))), int(n * (1 + range_ratio)))

    out = []
    for _ in range(num):
        n_in, n_out = length(input_len), length(output_len)
        out.append(([rng.randrange(vocab_size) for _ in range(n_in)], n_out))
    return out


def arrival_times(num, rate, burstiness, seed) -> list[float]:
    """Send time of each request, in seconds from the start (see the module docstring)."""
    if math.isinf(rate):
        return [0.0] * num
    if math.isinf(burstiness):  # the Gamma's limit: evenly spaced (vLLM)
        return [(i + 1) / rate for i in range(num)]
    rng = random.Random(seed)
    # gammavariate(alpha, beta) has mean alpha * beta: numpy's (shape, scale).
    times = list(_running_sum(rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
                              for _ in range(num)))
    return [t * (num / rate) / times[-1] for t in times]


def _running_sum(xs):
    total = 0.0
    for x in xs:
        total += x
        yield total


# ---- metrics --------------------------------------------------------------------------
def percentile(xs, p) -> float:
    """numpy.percentile(xs, p) (linear interpolation); 0 for no data (vLLM's `or 0`)."""
    xs = sorted(xs)
    if not xs:
        return 0.0
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def peak_concurrency(results) -> int:
    """Most requests in flight at once, over half-open [send, last chunk) intervals."""
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.latency, -1)
                                                        for r in results])
    peak = now = 0
    for _, delta in events:  # at equal times -1 sorts first: an end frees its slot
        now += delta
        peak = max(peak, now)
    return peak


def tpot(r: RequestResult):
    """Time per output token after the first; None for a one-token request."""
    return (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else None


def compute_metrics(results, duration, slo_ttft_ms=None, slo_tpot_ms=None) -> dict:
    """vLLM's serving metrics of a run (``duration``: wall seconds of the whole run)."""
    ok = [r for r in results if r.success]
    tpots = [tpot(r) for r in ok]
    values = {"ttft": [r.ttft for r in ok], "e2el": [r.latency for r in ok],
              "itl": [x for r in ok for x in r.itl],
              "tpot": [t for t in tpots if t is not None]}
    good = 0
    for r, t in zip(ok, tpots):  # vLLM: a one-token request's TPOT counts as 0
        if (slo_ttft_ms is None or r.ttft * 1e3 <= slo_ttft_ms) and \
                (slo_tpot_ms is None or (t or 0.0) * 1e3 <= slo_tpot_ms):
            good += 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    m = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
         "total_token_throughput": (total_in + total_out) / duration,
         "request_goodput": good / duration, "max_concurrent_requests":
         peak_concurrency(ok), "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms}
    for name in LATENCIES:
        xs = values[name]
        m[f"mean_{name}_ms"] = 1e3 * sum(xs) / len(xs) if xs else 0.0
        m[f"median_{name}_ms"] = 1e3 * percentile(xs, 50)
        for p in PERCENTILES:
            m[f"p{p}_{name}_ms"] = 1e3 * percentile(xs, p)
    return m


# ---- client ---------------------------------------------------------------------------
async def send_request(session, url, model, prompt, max_tokens) -> RequestResult:
    """One streamed completion; never raises (a failure is recorded in the result)."""
    result = RequestResult(prompt_len=len(prompt))
    # vLLM's payload: the server's default sampling (no temperature sent).
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks, buffer = 0, b""
    result.start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for data in resp.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    event = event.strip()
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[6:])
                    if "error" in chunk:
                        result.error = chunk["error"].get("message", str(chunk["error"]))
                        return result
                    if chunk.get("choices"):
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft = now - result.start
                        else:
                            result.itl.append(now - last)
                        last, chunks = now, chunks + 1
                    elif chunk.get("usage"):
                        result.output_len = chunk["usage"]["completion_tokens"]
    except Exception as err:  # the connection, the server: recorded, the run goes on
        result.error = f"{type(err).__name__}: {err}"
        return result
    if chunks == 0:
        result.error = "no streamed chunk"
        return result
    result.output_len = result.output_len or chunks
    result.success, result.latency = True, last - result.start
    return result


async def server_model(session, base_url) -> dict:
    """The first entry of the server's /v1/models."""
    async with session.get(f"{base_url}/v1/models") as resp:
        body = await resp.text()
    try:
        return json.loads(body)["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"--base-url: expected an OpenAI-compatible server with a "
                           f"model at {base_url}/v1/models, got HTTP {resp.status}: "
                           f"{body[:200]}") from None


async def run_rate(session, url, model, requests, rate, burstiness, seed,
                   max_concurrency=None, progress=True):
    """Send the requests at the rate; (results in request order, wall seconds)."""
    times = arrival_times(len(requests), rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = _progress(len(requests), f"rate {rate:g}") if progress else None

    async def one(prompt, max_tokens):
        if limit is None:
            result = await send_request(session, url, model, prompt, max_tokens)
        else:
            async with limit:
                result = await send_request(session, url, model, prompt, max_tokens)
        if bar is not None:
            bar.update(1)
        return result

    start, tasks = time.perf_counter(), []
    for (prompt, max_tokens), at in zip(requests, times):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(prompt, max_tokens)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration


def _progress(total, desc):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)


async def benchmark(args, fake=None) -> dict:
    """The whole command: look up the model, check one request, run each rate. fake: a
    FakeServer (fake_server.py), whose host cost each run then reports too."""
    import aiohttp

    base = args.base_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=6 * 3600)  # vLLM's: a run may take hours
    connector = aiohttp.TCPConnector(limit=0)  # no pool cap: the rate decides
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        card = await server_model(session, base)
        model = args.model or card["id"]
        vocab = args.vocab_size or card.get("vocab_size")
        if not vocab:
            raise ValueError("--vocab-size: expected the model's vocabulary size, got none "
                             "(the server's /v1/models does not say it)")
        longest = int(args.random_input_len * (1 + args.random_range_ratio)) + \
            int(args.random_output_len * (1 + args.random_range_ratio))
        if card.get("max_model_len") and longest > card["max_model_len"]:
            raise ValueError(f"--random-input-len/--random-output-len: expected at most "
                             f"max_model_len={card['max_model_len']} tokens per request, "
                             f"got up to {longest}")
        requests = random_requests(args.num_prompts, args.random_input_len,
                                   args.random_output_len, args.random_range_ratio, vocab,
                                   args.seed)
        url = base + "/v1/completions"
        check = await send_request(session, url, model, *requests[0])
        if not check.success:
            raise RuntimeError(f"the first request failed: {check.error}")
        runs = []
        for rate in args.sweep_rates or [args.request_rate]:
            before = fake.mark() if fake else None
            results, duration = await run_rate(
                session, url, model, requests, rate, args.burstiness, args.seed,
                args.max_concurrency, progress=not args.no_progress)
            metrics = compute_metrics(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
            if fake:
                from flashtile.bench.fake_server import host_metrics
                metrics["server"] = host_metrics(before, fake.mark(), args.fake_server)
            runs.append({"request_rate": rate, "metrics": metrics,
                         "errors": sorted({r.error for r in results if not r.success})[:10],
                         "requests": [_request_row(r) for r in results]})
            server = (f", server CPU {metrics['server']['cpu_us_per_token']:.1f} us/token"
                      if fake else "")
            print(f"rate {rate:g}: {metrics['completed']} ok, {metrics['failed']} failed, "
                  f"{metrics['output_throughput']:.1f} output tok/s{server}", file=sys.stderr)
    return {"model": model, "base_url": base, "runs": runs}


def _request_row(r: RequestResult) -> dict:
    t = tpot(r)
    return {"prompt_len": r.prompt_len, "output_len": r.output_len, "success": r.success,
            "ttft_ms": 1e3 * r.ttft, "tpot_ms": None if t is None else 1e3 * t,
            "e2el_ms": 1e3 * r.latency, "error": r.error or None}


# ---- reports --------------------------------------------------------------------------
def _ms(x):
    return f"{x:.1f}" if x < 1e4 else f"{x:.0f}"


def markdown(run: dict) -> str:
    """One run: throughputs, then the latency table."""
    m = run["metrics"]
    rate = run["request_rate"]
    slo = f"TTFT <= {m['slo_ttft_ms']:g} ms, TPOT <= {m['slo_tpot_ms']:g} ms"
    lines = ["| metric | value |", "| --- | ---: |",
             f"| requests ok / failed | {m['completed']} / {m['failed']} |",
             f"| request rate (configured) | {rate:g} req/s |",
             f"| duration | {m['duration_s']:.2f} s |",
             f"| input / output tokens | {m['total_input_tokens']} / "
             f"{m['total_output_tokens']} |",
             f"| request throughput | {m['request_throughput']:.2f} req/s |",
             f"| output token throughput | {m['output_throughput']:.1f} tok/s |",
             f"| total token throughput | {m['total_token_throughput']:.1f} tok/s |",
             f"| peak concurrent requests | {m['max_concurrent_requests']} |",
             f"| goodput ({slo}) | {m['request_goodput']:.2f} req/s |", *_host_rows(m), "",
             "| latency (ms) | mean | median | p90 | p99 |", "| --- | ---: | ---: | ---: | ---: |"]
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E"}
    for key, label in names.items():
        cells = [m[f"{s}_{key}_ms"] for s in ("mean", "median", "p90", "p99")]
        lines.append(f"| {label} | " + " | ".join(map(_ms, cells)) + " |")
    return "\n".join(lines)


def _host_rows(m) -> list[str]:
    if "server" not in m:  # not a --fake-server run
        return []
    from flashtile.bench.fake_server import markdown_rows
    return markdown_rows(m["server"])


def sweep_markdown(runs) -> str:
    """One line per rate: throughput, latency mean / p50 / p99, concurrency, goodput."""
    lines = ["| rate req/s | done req/s | output tok/s | TTFT ms mean/p50/p99 "
             "| TPOT ms mean/p50/p99 | ITL ms mean/p50/p99 | E2E ms mean/p50/p99 "
             "| peak concurrency | goodput req/s | failed |", "|" + " ---: |" * 10]
    for run in runs:
        m = run["metrics"]
        lat = [" / ".join(_ms(m[f"{s}_{k}_ms"]) for s in ("mean", "median", "p99"))
               for k in ("ttft", "tpot", "itl", "e2el")]
        lines.append(f"| {run['request_rate']:g} | {m['request_throughput']:.2f} "
                     f"| {m['output_throughput']:.1f} | " + " | ".join(lat)
                     + f" | {m['max_concurrent_requests']} | {m['request_goodput']:.2f} "
                     f"| {m['failed']} |")
    return "\n".join(lines)


def plot_sweep(runs, path) -> None:
    """Throughput and p99 latencies against the configured rate (a sweep), as a PNG."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    labels = [f"{r['request_rate']:g}" for r in runs]
    ms = [r["metrics"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"wspace": 0.4})
    left.plot(labels, [m["output_throughput"] for m in ms], marker="o", label="output tok/s")
    left.set_ylabel("output tokens/s")
    twin = left.twinx()
    twin.plot(labels, [m["request_throughput"] for m in ms], marker="s", color="tab:green",
              label="requests/s done")
    twin.plot(labels, [m["request_goodput"] for m in ms], marker="^", color="tab:red",
              label="goodput req/s")
    twin.set_ylabel("requests/s")
    left.legend(loc="upper left")
    twin.legend(loc="lower right")
    for key, color in (("ttft", "tab:blue"), ("tpot", "tab:orange"), ("itl", "tab:gray")):
        right.plot(labels, [m[f"p99_{key}_ms"] for m in ms], marker="o", color=color,
                   label=f"p99 {key.upper()}")
    for key, color in (("slo_ttft_ms", "tab:blue"), ("slo_tpot_ms", "tab:orange")):
        right.axhline(ms[0][key], color=color, linestyle="--", linewidth=1)
    right.set_yscale("log")
    right.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    right.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    right.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.set_ylabel("ms (dashed: SLO)")
    right.legend()
    for ax in (left, right):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _strict(x):
    """Infinite rates as "inf": json.dump would write Infinity, which is not JSON."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_strict(v) for v in x]
    return x


# ---- command line ---------------------------------------------------------------------
def _rate(text: str) -> float:  # named for argparse's "invalid _rate value"
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="flashtile bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="the served model name (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second; inf (default) sends all at once")
    p.add_argument("--sweep-rates", type=_rate, nargs="+",
                   help="run each rate in turn (e.g. 1 2 4 8 inf) and print one table")
    p.add_argument("--burstiness", type=_rate, default=1.0,
                   help="Gamma shape of the arrival gaps; 1 is Poisson, < 1 burstier")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in len * [1 - ratio, 1 + ratio]")
    p.add_argument("--vocab-size", type=int,
                   help="token ids are drawn below this (default: the server's)")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--fake-server", type=float, metavar="STEP_MS",
                   help="benchmark flashtile serve over an engine without a model whose "
                   "steps take STEP_MS (started here; --base-url is ignored) and report "
                   "the server's CPU per token (bench/fake_server.py)")
    p.add_argument("--fake-server-stream-interval", type=int, default=1, metavar="N",
                   help="with --fake-server: its --stream-interval (flashtile serve's)")
    p.add_argument("--fake-server-profile", metavar="DIR",
                   help="with --fake-server: cProfile its loop and engine threads into DIR")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="serve.json",
                   help="JSON results; the markdown (and a sweep's plot) beside it")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        p.error("--num-prompts, --random-input-len and --random-output-len: expected >= 1")
    if not 0 <= args.random_range_ratio < 1:
        p.error(f"--random-range-ratio: expected a number in [0, 1), got "
                f"{args.random_range_ratio}")
    fake = None
    try:
        if args.fake_server is not None:
            from flashtile.bench.fake_server import FakeServer
            longest = 2 * (args.random_input_len + args.random_output_len)
            fake = FakeServer(args.fake_server, longest, args.fake_server_stream_interval,
                              args.fake_server_profile)
            args.base_url = fake.url
        report = asyncio.run(benchmark(args, fake))
    except (ValueError, RuntimeError, OSError) as err:  # OSError: no server there
        print(f"flashtile bench serve: {err}", file=sys.stderr)
        return 1
    finally:
        if fake is not None:
            fake.close()
    runs = report["runs"]
    table = sweep_markdown(runs) if args.sweep_rates else markdown(runs[0])
    print(table)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "no_progress")}
    command = shlex.join(["flashtile", "bench", "serve",
                          *(sys.argv[1:] if argv is None else argv)])
    stem = os.path.splitext(args.out)[0]
    with open(args.out, "w") as f:
        json.dump(_strict({"command": command, "settings": settings, **report}), f,
                  indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"Command: `{command}`; model {report['model']}\n\n{table}\n")
    written = [args.out, stem + ".md"]
    if args.sweep_rates:
        try:
            plot_sweep(runs, stem + ".png")
            written.append(stem + ".png")
        except ImportError:  # the bench extra is not installed: tables only
            print("no plot: matplotlib is not installed", file=sys.stderr)
    print(f"wrote {', '.join(written)}")
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
