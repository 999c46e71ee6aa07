"""``flashtile serve`` over an engine without a model: the server's host cost alone.

``flashtile bench serve --fake-server STEP_MS`` starts this module in a child process and
runs its client against it. The engine is a real LLM (scheduler, block manager, outputs)
whose ModelRunner is replaced by ``InstantRunner``: each step's tokens are made up at
once and the device time of a step is emulated by a sleep of STEP_MS that holds no GIL,
as a GPU step does. So the whole process's CPU time is the server's host work (the HTTP
loop and the engine thread), and with STEP_MS near a real decode step (~5 ms for a 1B
model at batch 256 on the H200) the run shows whether the host keeps up with the device.

The child prints ``{"port": P}`` once serving; each line ``mark`` on its stdin is
answered by a JSON line of counters (CPU seconds of the process, of the event loop's
thread and of the engine's thread, steps, tokens, and ``idle_s``: the time the emulated
device had no step to run, which is host-bound when every request is in, as with
``--request-rate inf``: a busy event loop holding the GIL delays the engine thread); the
client reports the differences. End of stdin stops it. With ``--profile DIR``, the loop
and engine threads run under cProfile from the first mark on and write DIR/loop.prof
and DIR/engine.prof at the end (Python >= 3.12: one profile of both, DIR/server.prof).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

# A one-layer Llama: the model is never run, only its config matters (vocabulary size,
# KV bytes per token for the pool's size).
TINY_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32,
                   intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, vocab_size=32000, max_position_embeddings=8192,
                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, torch_dtype="float16")


@dataclass
class InstantStep:
    """LaunchedStep's fields that LLM reads, plus the step's made-up tokens."""

    seqs: list
    tokens: list
    done_at: float  # time.perf_counter() when the emulated device step ends
    host_needs_tokens: bool = False


class InstantRunner:
    """ModelRunner's interface (launch, wait, num_blocks, shutdown) without a model. The
    device is emulated as a queue: a step ends step_s after the previous one ended or
    after its launch, whichever is later; the time in between is idle."""

    def __init__(self, num_blocks: int, vocab_size: int, step_s: float):
        self.num_blocks, self.vocab_size, self.step_s = num_blocks, vocab_size, step_s
        self.busy_until = None  # None: the idle time until the next launch is not counted
        self.steps = self.tokens = 0
        self.idle_s = 0.0

    def launch(self, scheduled) -> InstantStep:
        # The rows that sample: sequences whose step reaches their last token (a prompt's
        # last chunk, or a decode).
        seqs = [seq for seq, n in scheduled if seq.num_computed_tokens + n == len(seq)]
        # Any ids but 0-2 (the config's special tokens), varied across sequences.
        tokens = [3 + (seq.seq_id * 7919 + len(seq)) % (self.vocab_size - 3) for seq in seqs]
        now = time.perf_counter()
        if self.busy_until is not None:
            self.idle_s += max(0.0, now - self.busy_until)
        self.busy_until = max(now, self.busy_until or now) + self.step_s
        return InstantStep(seqs, tokens, self.busy_until)

    def wait(self, step: InstantStep) -> tuple[list, list]:
        wait = step.done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        self.steps += 1
        self.tokens += len(step.seqs)
        return step.tokens, [0.0] * len(step.tokens)

    def shutdown(self):
        pass


def instant_llm(step_ms: float, max_model_len: int, max_num_seqs: int):
    """An LLM over a tiny dummy checkpoint whose runner is an InstantRunner; its pool
    holds max_num_seqs sequences of max_model_len tokens."""
    from flashtile.engine.llm import LLM

    path = tempfile.mkdtemp(prefix="flashtile-fake-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f)
    c = TINY_CONFIG
    token_bytes = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * 2 * (
        c["hidden_size"] // c["num_attention_heads"])
    llm = LLM(path, device="cpu", dtype="float16", load_format="dummy", page_size=64,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              kv_cache_memory=token_bytes * max_model_len * max_num_seqs,
              async_scheduling=True)  # as on CUDA: the host works while a step runs
    llm.runner = InstantRunner(llm.runner.num_blocks, c["vocab_size"], step_ms / 1e3)
    return llm


class FakeServer:
    """This module's server in a child process (the client's side): ``url``, ``mark()``
    (the counters now), ``close()``."""

    def __init__(self, step_ms: float, max_model_len: int, stream_interval: int = 1,
                 profile=None):
        cmd = [sys.executable, "-m", "flashtile.bench.fake_server", "--step-ms",
               str(step_ms), "--max-model-len", str(max_model_len), "--stream-interval",
               str(stream_interval)]
        if profile:
            cmd += ["--profile", profile]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.url = f"http://127.0.0.1:{self._read()['port']}"

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"--fake-server: the server process ended (exit status "
                               f"{self.proc.returncode}); its error is above")
        return json.loads(line)

    def mark(self) -> dict:
        self.proc.stdin.write("mark\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def host_metrics(before: dict, after: dict, step_ms: float) -> dict:
    """The server's host cost between two marks, per output token and per step."""
    d = {k: after[k] - before[k] for k in before}
    tokens, steps = max(d["tokens"], 1), max(d["steps"], 1)
    return {"step_ms": step_ms, "tokens": d["tokens"], "steps": d["steps"],
            "cpu_us_per_token": 1e6 * d["cpu_s"] / tokens,
            "loop_cpu_us_per_token": 1e6 * d["loop_cpu_s"] / tokens,
            "engine_cpu_us_per_token": 1e6 * d["engine_cpu_s"] / tokens,
            "engine_cpu_us_per_step": 1e6 * d["engine_cpu_s"] / steps,
            "device_idle_ms_per_step": 1e3 * d["idle_s"] / steps}


def markdown_rows(h: dict) -> list[str]:
    """host_metrics as rows of bench serve's markdown table."""
    return [f"| server CPU per output token (loop + engine thread) | "
            f"{h['cpu_us_per_token']:.1f} us ({h['loop_cpu_us_per_token']:.1f} + "
            f"{h['engine_cpu_us_per_token']:.1f}) |",
            f"| engine steps / engine thread CPU per step | {h['steps']} / "
            f"{h['engine_cpu_us_per_step']:.0f} us |",
            f"| emulated device ({h['step_ms']:g} ms a step) idle per step | "
            f"{h['device_idle_ms_per_step']:.2f} ms |"]


def _thread_cpu(thread_id: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread_id))


def main(argv=None) -> int:
    from aiohttp import web

    from flashtile.engine.server import AsyncEngine, build_app, freeze_gc_heap

    p = argparse.ArgumentParser(prog="python -m flashtile.bench.fake_server")
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--stream-interval", type=int, default=1, help="as flashtile serve's")
    p.add_argument("--profile", help="directory for loop.prof and engine.prof")
    args = p.parse_args(argv)
    llm = instant_llm(args.step_ms, args.max_model_len, args.max_num_seqs)
    engine = AsyncEngine(lambda: llm, args.stream_interval)
    engine_thread = engine._executor.submit(threading.get_ident).result()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(engine, "fake"), handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    freeze_gc_heap()  # as flashtile serve does
    profiles = []

    def profile_threads():
        # (file name, profiler, how to run a call on its thread) for each profiler.
        import cProfile
        here = lambda f: f()  # noqa: E731
        if sys.version_info >= (3, 12):
            # cProfile sits on sys.monitoring from 3.12: one profiler per process, and
            # it sees every thread (a second one raises "Another profiling tool").
            profiles.append(("server", cProfile.Profile(), here))
        else:  # one per thread, each enabled on its own thread
            profiles.extend([("loop", cProfile.Profile(), loop.call_soon_threadsafe),
                             ("engine", cProfile.Profile(),
                              lambda f: engine._executor.submit(f).result())])
        for _, prof, on_thread in profiles:
            on_thread(prof.enable)

    def counters():
        if args.profile and not profiles:
            profile_threads()
        r = llm.runner
        r.busy_until = None  # the wait for the next run's requests is not the host's
        return {"cpu_s": time.process_time(), "loop_cpu_s": _thread_cpu(main_thread),
                "engine_cpu_s": _thread_cpu(engine_thread), "steps": r.steps,
                "tokens": r.tokens, "idle_s": r.idle_s}

    def commands():  # stdin: "mark" lines, then EOF
        for line in sys.stdin:
            if line.strip() == "mark":
                print(json.dumps(counters()), flush=True)
        loop.call_soon_threadsafe(loop.stop)

    main_thread = threading.get_ident()
    threading.Thread(target=commands, daemon=True).start()
    print(json.dumps({"port": runner.addresses[0][1]}), flush=True)
    loop.run_forever()
    if profiles:
        loop.run_until_complete(asyncio.sleep(0))
        os.makedirs(args.profile, exist_ok=True)
        for name, prof, on_thread in profiles:
            # The loop's thread is this one, and the loop has stopped: disable it here.
            (prof.disable() if on_thread is loop.call_soon_threadsafe
             else on_thread(prof.disable))
            prof.dump_stats(os.path.join(args.profile, f"{name}.prof"))
    loop.run_until_complete(runner.cleanup())
    return 0


if __name__ == "__main__":
    sys.exit(main())
