"""AsyncEngine: one LLM driven from an asyncio event loop, for many concurrent clients.

The engine is not thread-safe, so every engine call (add_request, step, abort_request)
runs in one worker thread, one at a time, in the order submitted. One asyncio task keeps
stepping while requests are unfinished: it submits a step, and while the step runs (a GPU
step takes milliseconds) the event loop is free to accept and parse requests and to
stream the previous step's tokens. Each caller gets a ``RequestStream`` of its requests'
outputs; closing it aborts what is unfinished, which frees the pages.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from flashtile._validate import _fail
from flashtile.engine.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("flashtile.engine")


class AsyncEngine:
    """One LLM driven from asyncio. ``make_llm`` is called in the worker thread, so the
    engine is built, stepped and aborted in one thread (CUDA state is per thread).

    stream_interval: the tokens of a prompt a reader of DELTA outputs waits for before it
    is woken (vLLM's and SGLang's ``--stream-interval``); a prompt's first and last
    outputs wake it at once. 1 (default): every token; more: fewer, larger chunks, so
    less host work per token for a server streaming to many clients."""

    def __init__(self, make_llm, stream_interval: int = 1):
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) \
                or stream_interval < 1:
            _fail(ValueError, "stream_interval", "an int >= 1", repr(stream_interval))
        self.stream_interval = stream_interval
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashtile")
        self.llm = self._executor.submit(make_llm).result()
        # request id -> (its stream, its prompt's index in the stream)
        self._streams: dict[str, tuple[RequestStream, int]] = {}
        self._wake = self._task = None

    async def start(self):
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop())

    async def stop(self):
        """Stop the loop, then the engine (its worker processes under tensor
        parallelism), in the engine's thread once a running step has finished."""
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        await self._call(self.llm.shutdown)
        self._executor.shutdown(wait=True)

    @property
    def running(self) -> bool:
        """Whether the loop is there to step the engine (started and not dead)."""
        return self._task is not None and not self._task.done()

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def add(self, prompts, params: SamplingParams) -> "RequestStream":
        """Queue prompts (token id lists) with one SamplingParams, n requests a prompt
        (SamplingParams.completions): the stream's index of completion j of prompt i is
        i * n + j, OpenAI's choice index. ValueError if the engine refuses one (then none
        of them runs)."""
        if not self.running:
            raise RuntimeError("the engine loop is not running")
        prompts, params = zip(*[(p, c) for p in prompts for c in params.completions()])
        ids = [uuid.uuid4().hex for _ in prompts]
        stream = RequestStream(self, ids, params[0].output_kind, self.stream_interval)
        for i, rid in enumerate(ids):
            self._streams[rid] = (stream, i)
        try:
            await self._call(self._add_all, ids, prompts, params)
        except BaseException:
            stream.close()
            raise
        self._wake.set()
        return stream

    async def metrics(self, model_name: str) -> str:
        """The engine's Prometheus metrics, read in its thread between steps."""
        from flashtile.engine.metrics import render

        return await self._call(render, self.llm, model_name)

    def _add_all(self, ids, prompts, params):
        for rid, prompt, p in zip(ids, prompts, params):
            self.llm.add_request(prompt, p, request_id=rid)

    def abort_later(self, ids):
        """Abort requests after whatever engine call is running (no wait)."""
        try:
            self._executor.submit(self._abort, ids)
        except RuntimeError:  # shut down: the engine is gone with its requests
            pass

    def _abort(self, ids):
        for rid in ids:
            self.llm.abort_request(rid)

    def _step(self):
        llm = self.llm
        if not llm.has_unfinished_requests():
            return [], False
        outputs = llm.step()
        return outputs, llm.has_unfinished_requests()

    async def _loop(self):
        while True:
            await self._wake.wait()
            self._wake.clear()  # an add after this sets it again: no lost wake-up
            busy = True
            while busy:
                try:
                    outputs, busy = await self._call(self._step)
                except Exception as err:  # fail the requests, keep serving the next ones
                    log.exception("engine step failed")
                    await self._fail_all(err)
                    break
                streams = self._streams
                for out in outputs:
                    entry = streams.get(out.request_id)
                    if entry is not None:  # else aborted while this step ran
                        entry[0].put((entry[1], out))

    async def _fail_all(self, err):
        """Abort every request known now and end their streams with the error (requests
        added while this runs are not part of the failed step and go on)."""
        ids = list(self._streams)
        streams = {id(s): s for s, _ in self._streams.values()}.values()
        try:
            await self._call(self._abort, ids)
        except Exception:
            log.exception("aborting after a failed step failed too")
        error = RuntimeError(f"engine step failed: {type(err).__name__}: {err}")
        for stream in streams:
            stream.put(error)


class RequestStream:
    """The outputs of one HTTP request's prompts, as (prompt index, RequestOutput) pairs
    of the kind its SamplingParams.output_kind asks for: ``async for index, output in
    stream`` takes them one by one, ``next_outputs()`` all that have arrived; both end
    when every prompt finished. ``close()`` aborts what is unfinished.

    The engine loop hands a stream each step's outputs with ``put``, which wakes its
    reader at most once per step however many prompts it has, and for DELTA outputs only
    once ``interval`` tokens of a prompt wait (or its first or last output)."""

    def __init__(self, engine: AsyncEngine, ids, output_kind=RequestOutputKind.CUMULATIVE,
                 interval: int = 1):
        self.engine, self.ids, self.pending = engine, ids, set(ids)
        self.output_kind = output_kind
        self.interval = interval if output_kind is RequestOutputKind.DELTA else 1
        self._items: deque = deque()  # (index, output) pairs, or an Exception
        self._ready = False  # what is queued is worth waking the reader for
        self._waiter: Optional[asyncio.Future] = None  # set while the reader waits
        self._started: set = set()  # prompt indices whose first output was read
        self._held: dict = {}  # prompt index -> its tokens queued since the last read

    def put(self, item):
        """Queue an (index, output) pair or an Exception (the engine loop's side)."""
        self._items.append(item)
        if not self._ready and self._wakes(item):
            self._ready = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    def _wakes(self, item) -> bool:
        if self.interval == 1 or isinstance(item, Exception):
            return True
        index, out = item
        if out.finished or index not in self._started:
            return True
        held = self._held[index] = self._held.get(index, 0) + len(out.outputs[0].token_ids)
        return held >= self.interval

    async def _wait(self):
        if not self.pending:
            raise StopAsyncIteration
        while not self._ready:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def _take(self, item):
        if isinstance(item, Exception):
            raise item
        index, out = item
        self._started.add(index)
        if out.finished:
            self.pending.discard(out.request_id)
        return index, out

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self._wait()
        item = self._items.popleft()
        self._ready, self._held = bool(self._items), {}
        return self._take(item)

    async def next_outputs(self) -> dict:
        """{prompt index: its output}, all that arrived, waiting for at least one. A
        reader that fell behind the engine (a busy server streams to hundreds of clients
        from one thread) catches up with one output per prompt for several steps: the
        newest (cumulative outputs), or the deltas added up (RequestOutput.add)."""
        await self._wait()
        items = list(self._items)
        self._items.clear()
        self._ready, self._held = False, {}
        latest = {}
        for item in items:
            index, out = self._take(item)
            if index in latest and self.output_kind is RequestOutputKind.DELTA:
                latest[index].add(out)
            else:
                latest[index] = out
        return latest

    def close(self):
        for rid in self.ids:
            self.engine._streams.pop(rid, None)
        if self.pending:
            self.engine.abort_later(sorted(self.pending))
            self.pending = set()
