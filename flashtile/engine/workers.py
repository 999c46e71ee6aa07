"""Tensor parallelism over processes (vLLM's "mp" executor, without Ray): rank 0 is the
user's process, ranks 1..N-1 are worker processes it starts.

Rank 0 (``start_runner``, called by LLM) runs the scheduler, the block manager, the
tokenizer and the sampler. It opens a TCPStore on a free localhost port, spawns the
workers (torch.multiprocessing, spawn) and joins them in one process group: NCCL on CUDA,
rank r on cuda:r, gloo on CPU. Every rank then builds its ModelRunner: its slice of the
weights, its KV pool (each rank measures what it can hold and all take the smallest, so
that a block id names the same pages everywhere), warm-up and CUDA graphs, the ranks
running the same forwards in lockstep.

Per step, rank 0 sends the step's HostStep (the packed index buffers and their metadata,
step_inputs.py) through the Channel (channel.py); each worker uploads the same buffers and
runs ModelRunner.follow: the same forward, the LM head's all_gather, and the sampled ids
that rank 0 broadcasts when asynchronous scheduling reads them on the device.

Failures: a worker that raises reports its traceback and exits at once, so its peers'
collectives fail (gloo: immediately), and rank 0 raises a WorkerError (a RuntimeError)
carrying the worker's traceback. On NCCL a dead peer does not fail a collective, so a
thread of rank 0 watching the workers aborts the process group when one exits. After a
failure rank 0 stops the workers; the engine can only be shut down. ``shutdown``
(LLM.shutdown; also when the runner is garbage collected or the interpreter exits) tells
the workers to stop, joins them (killing what does not exit), destroys the process group
and frees the shared memory.

Scripts that build LLM(tensor_parallel_size > 1) need the ``if __name__ == "__main__":``
guard: spawn imports the main module again in each worker.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import signal
import sys
import threading
import traceback
import weakref
from multiprocessing import connection
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtile.engine.channel import Channel, WorkerEnd, WorkerError
from flashtile.engine.config import EngineConfig
from flashtile.engine.runner import LaunchedStep, ModelRunner

log = logging.getLogger("flashtile.engine")
# Longest wait for one answer of a worker (start-up, an acknowledgement) and the process
# group's collective timeout: NCCL's default. Loading, warm-up and graph capture run on
# every rank at once, so a healthy worker is never that far behind rank 0.
TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0  # for a worker to exit once told to
# After a collective of rank 0 fails: how long a worker whose death caused it may take to
# be seen dead (its report is written before it exits).
FAILURE_GRACE_S = 1.0


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of one rank: on CUDA, its device cuda:rank."""
    if config.torch_device.type != "cuda":
        return config
    config = copy.copy(config)
    config.device = f"cuda:{rank}"
    return config


def _backend(config: EngineConfig) -> str:
    return "nccl" if config.torch_device.type == "cuda" else "gloo"


def start_runner(config: EngineConfig) -> ModelRunner:
    """The engine's ModelRunner; under tensor parallelism rank 0's, its workers started
    and ready."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config)
    workers = Workers(config)
    with workers.failures():
        runner = DriverRunner(config, workers)
        workers.channel.expect("ready", TIMEOUT_S)
    return runner


class DriverRunner(ModelRunner):
    """Rank 0's ModelRunner: each launched step goes to the workers first; a failure on
    any rank stops the workers and raises (a WorkerError when a worker caused it)."""

    def __init__(self, config: EngineConfig, workers: Workers):
        super().__init__(rank_config(config, 0))
        self.workers = workers
        weakref.finalize(self, workers.shutdown)

    def launch(self, scheduled) -> LaunchedStep:
        with self.workers.failures():
            inputs = self.prepare(scheduled)
            self.workers.call("follow", inputs.host)
            return self.run(inputs, scheduled)

    def wait(self, step: LaunchedStep) -> tuple[list[int], list[float]]:
        with self.workers.failures():
            return super().wait(step)

    def shutdown(self):
        self.workers.shutdown()


class Workers:
    """Ranks 1..N-1 of config.tensor_parallel_size, as processes; this process is rank 0
    and joins them in the default torch.distributed process group."""

    def __init__(self, config: EngineConfig):
        if dist.is_initialized():
            raise RuntimeError("LLM(tensor_parallel_size > 1) starts its own process group, "
                               "but torch.distributed is already initialised in this process")
        size, self.backend = config.tensor_parallel_size, _backend(config)
        # failed: a step failed and stopped the workers (set before the stop, so the
        # message of a later call does not depend on whether the watcher thread saw a
        # killed worker exit first).
        self.processes, self.closed, self.dead, self.failed = [], False, None, False
        self._group, self._monitor = False, None
        ctx = mp.get_context("spawn")
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                              timeout=timeout)
        self.channel = Channel(ctx, size - 1)
        self._wake, self._wake_writer = ctx.Pipe(duplex=False)
        try:
            self.processes = [ctx.Process(
                target=worker_main, name=f"flashtile-tp{rank}", daemon=True,
                args=(rank, config, store.port, self.channel.ends[rank - 1],
                      torch.get_num_threads())) for rank in range(1, size)]
            for p in self.processes:
                p.start()
            self.channel.watch(self.processes)
            self.channel.expect("started", TIMEOUT_S)
            dist.init_process_group(self.backend, store=store, rank=0, world_size=size,
                                    timeout=timeout)
            self._group = True
        except BaseException:
            self.shutdown(kill=True)
            raise
        self._monitor = threading.Thread(target=self._watch, name="flashtile-tp-monitor",
                                         daemon=True)
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def call(self, method: str, *args):
        """Have every worker run ModelRunner.<method>(*args) (returns once they have the
        message, not when they are done)."""
        self.channel.send((method, args), TIMEOUT_S)

    @contextlib.contextmanager
    def failures(self):
        """Run a part of rank 0's work that the workers take part in. If it raises, or a
        worker died meanwhile, the workers are stopped, and a worker's failure is raised
        as a WorkerError (rank 0's own error is raised as it is)."""
        if self.closed:
            raise WorkerError("the tensor-parallel workers are stopped (" + (
                "a rank failed" if self.failed or self.dead is not None
                or self.channel.errors else "shutdown() was called") + ")")
        try:
            yield
        except BaseException as err:
            message = None
            # Rank 0 raises a bad input's error itself (every rank does).
            if not isinstance(err, (ValueError, TypeError, WorkerError)):
                message = self._failure()
            self.failed = True
            self.shutdown(kill=True)
            if message is None:
                raise
            raise WorkerError(message) from err
        if self.dead is not None:  # NCCL: the watcher aborted the group under this step
            message = self.channel.failure(self.dead)
            self.failed = True
            self.shutdown(kill=True)
            raise WorkerError(message)

    def _failure(self) -> Optional[str]:
        """What a worker's failure says, if one failed (and so failed rank 0's work)."""
        sentinels = [p.sentinel for p in self.processes]
        if not self.channel.collect_errors():
            connection.wait(sentinels, FAILURE_GRACE_S)
            self.channel.collect_errors()
        # A sentinel is ready once the process is exiting, a moment before is_alive()
        # turns False (its connections to rank 0 close on the way).
        exiting = connection.wait(sentinels, 0)
        for i, p in enumerate(self.processes):
            if i + 1 in self.channel.errors or p.sentinel in exiting:
                return self.channel.failure(i)
        return None

    def _watch(self):
        """A worker that exits while the engine runs: mark it, and on NCCL abort the
        group, whose collectives would otherwise wait for the dead rank forever."""
        sentinels = {p.sentinel: i for i, p in enumerate(self.processes)}
        ready = connection.wait([self._wake, *sentinels])
        if self.closed or self._wake in ready:
            return
        self.dead = sentinels[ready[0]]
        log.error("tensor-parallel worker rank %d exited", self.dead + 1)
        if self.backend == "nccl":
            self._abort()

    def _abort(self):
        abort = getattr(dist.group.WORLD, "abort", None)
        if abort is None:
            return
        try:
            abort()
        except Exception:  # the group may be gone or broken already
            log.exception("aborting the tensor-parallel process group failed")

    def shutdown(self, kill: bool = False):
        """Stop the workers (told to, then joined; kill: at once), destroy the process
        group and free the shared memory. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._wake_writer.close()  # the watcher returns
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(STOP_TIMEOUT_S)
        kill = kill or self.dead is not None or bool(self.channel.errors)
        if not kill and self.processes:
            try:
                self.channel.send(None, STOP_TIMEOUT_S)
            except WorkerError:
                kill = True
        for p in self.processes:
            p.join(0 if kill else STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
        if self._group:
            if kill and self.backend == "nccl":
                self._abort()
            try:
                dist.destroy_process_group()
            except Exception:
                log.exception("destroying the tensor-parallel process group failed")
        self.channel.close()
        self._wake.close()


def worker_main(rank: int, config: EngineConfig, port: int, end: WorkerEnd, threads: int):
    """A worker process: join the group, build this rank's ModelRunner, then follow the
    steps rank 0 sends until it sends None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's: it stops workers
    try:
        torch.set_num_threads(threads)  # rank 0's, so that the ranks share the CPU alike
        end.open()
        size = config.tensor_parallel_size
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
        config = rank_config(config, rank)
        if config.torch_device.type == "cuda":
            torch.cuda.set_device(config.torch_device)
        # Just before joining: rank 0's own join waits for this rank without watching it.
        end.report("started")
        dist.init_process_group(_backend(config), store=store, rank=rank, world_size=size,
                                timeout=timeout)
        runner = ModelRunner(config)
        end.report("ready")
        while (message := end.recv()) is not None:
            method, args = message
            getattr(runner, method)(*args)
        dist.destroy_process_group()
        end.close()
    except BaseException:
        report = traceback.format_exc()
        try:
            end.report("error", report)
        except OSError:  # rank 0 is gone
            sys.stderr.write(report)
        # At once, without cleanup that could wait on the group: the closed connections
        # fail the peers' collectives.
        os._exit(1)
