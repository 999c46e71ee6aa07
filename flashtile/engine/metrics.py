"""The engine's serving metrics, as ``flashtile serve`` exposes them at ``/metrics`` in
Prometheus' text format, under vLLM's names (``vllm:num_requests_running``,
``vllm:time_to_first_token_seconds``, ...), so dashboards and alerts written for a vLLM
server read a flashtile one unchanged.

``EngineStats`` lives in the LLM and records each request once, when it leaves the
engine (finished or aborted); ``render`` adds what the scheduler and block manager hold
now (running and waiting requests, the KV pool's use, preemptions, prefix-cache
lookups). Histograms have vLLM's buckets.
"""

from __future__ import annotations

import bisect
import time

# vLLM's buckets (vllm/v1/metrics/loggers.py), seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def token_buckets(max_model_len: int) -> tuple:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, x: float):
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.sum += x


class EngineStats:
    """Counters and histograms over the requests that have left the engine."""

    def __init__(self, max_model_len: int):
        self.prompt_tokens = self.generation_tokens = 0
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        tokens = token_buckets(max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)  # a request's mean time per output token
        self.prompt_lengths = Histogram(tokens)
        self.generation_lengths = Histogram(tokens)

    def record(self, seq):
        """A request (its Sequence) has finished or was aborted."""
        # With asynchronous scheduling an aborted request may end on the placeholder of
        # a token that was never produced.
        generated = seq.num_completion_tokens - (seq.num_completion_tokens > 0
                                                 and seq.last_token < 0)
        self.prompt_tokens += seq.num_prompt_tokens
        self.generation_tokens += generated
        reason = seq.finish_reason if seq.finish_reason in self.finished else "abort"
        self.finished[reason] += 1
        end = seq.finish_time or time.time()
        self.e2e.observe(end - seq.arrival_time)
        if seq.first_token_time is not None:
            self.ttft.observe(seq.first_token_time - seq.arrival_time)
            if generated > 1:
                self.tpot.observe((end - seq.first_token_time) / (generated - 1))
        self.prompt_lengths.observe(seq.num_prompt_tokens)
        self.generation_lengths.observe(generated)


def _label(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(llm, model_name: str) -> str:
    """The LLM's metrics in Prometheus' text exposition format (version 0.0.4). Call it
    where the engine is stepped (its thread), so the figures are of one moment."""
    stats, sched, bm = llm.stats, llm.scheduler, llm.block_manager
    model = f'model_name="{_label(model_name)}"'
    lines = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP vllm:{name} {help_}")
        lines.append(f"# TYPE vllm:{name} {kind}")
        for suffix, labels, value in samples:
            lines.append(f"vllm:{name}{suffix}{{{labels}}} {value}")

    def histogram(name, help_, h: Histogram):
        samples, total = [], 0
        for bound, count in zip([*map(float, h.buckets), "+Inf"], h.counts):
            total += count  # a bucket counts every observation up to its bound
            samples.append(("_bucket", f'{model},le="{bound}"', total))
        samples += [("_sum", model, h.sum), ("_count", model, total)]
        metric(name, "histogram", help_, samples)

    metric("num_requests_running", "gauge", "Number of requests in model execution "
           "batches.", [("", model, len(sched.running))])
    metric("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           [("", model, len(sched.waiting))])
    metric("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           [("", model, bm.usage())])
    metric("num_preemptions", "counter", "Cumulative number of preemptions from the "
           "engine.", [("_total", model, sched.num_preemptions)])
    metric("prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of "
           "queried tokens.", [("_total", model, bm.queried_tokens)])
    metric("prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of "
           "cached tokens.", [("_total", model, bm.hit_tokens)])
    metric("prompt_tokens", "counter", "Number of prefill tokens processed.",
           [("_total", model, stats.prompt_tokens)])
    metric("generation_tokens", "counter", "Number of generation tokens processed.",
           [("_total", model, stats.generation_tokens)])
    metric("request_success", "counter", "Count of successfully processed requests.",
           [("_total", f'finished_reason="{reason}",{model}', n)
            for reason, n in stats.finished.items()])
    histogram("time_to_first_token_seconds", "Histogram of time to first token in "
              "seconds.", stats.ttft)
    histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in "
              "seconds.", stats.e2e)
    histogram("request_time_per_output_token_seconds", "Histogram of time_per_output_token"
              "_seconds per request.", stats.tpot)
    histogram("request_prompt_tokens", "Number of prefill tokens processed.",
              stats.prompt_lengths)
    histogram("request_generation_tokens", "Number of generation tokens processed.",
              stats.generation_lengths)
    return "\n".join(lines) + "\n"
