"""AsyncEngine: one LLM driven from an asyncio event loop, for many concurrent clients.

The engine is not thread-safe, so every engine call (add_request, step, abort_request)
runs in one worker thread, one at a time, in the order submitted. One asyncio task keeps
stepping while requests are unfinished: it submits a step, and while the step runs (a GPU
step takes milliseconds) the event loop is free to accept and parse requests and to
stream the previous step's tokens. Each caller gets a ``RequestStream``: an asyncio.Queue
of its requests' outputs; closing it aborts what is unfinished, which frees the pages.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

from flashtile.engine.sampling_params import SamplingParams

log = logging.getLogger("flashtile.engine")


class AsyncEngine:
    """One LLM driven from asyncio. ``make_llm`` is called in the worker thread, so the
    engine is built, stepped and aborted in one thread (CUDA state is per thread)."""

    def __init__(self, make_llm):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashtile")
        self.llm = self._executor.submit(make_llm).result()
        self._streams: dict[str, tuple[asyncio.Queue, int]] = {}  # request id -> (queue, i)
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
        """Queue prompts (token id lists) with one SamplingParams; ValueError if the
        engine refuses one (then none of them runs)."""
        if not self.running:
            raise RuntimeError("the engine loop is not running")
        ids = [uuid.uuid4().hex for _ in prompts]
        stream = RequestStream(self, ids)
        for i, rid in enumerate(ids):
            self._streams[rid] = (stream.queue, i)
        try:
            await self._call(self._add_all, ids, prompts, params)
        except BaseException:
            stream.close()
            raise
        self._wake.set()
        return stream

    def _add_all(self, ids, prompts, params):
        for rid, prompt in zip(ids, prompts):
            self.llm.add_request(prompt, params, request_id=rid)

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
                for out in outputs:
                    entry = self._streams.get(out.request_id)
                    if entry is not None:  # else aborted while this step ran
                        entry[0].put_nowait((entry[1], out))

    async def _fail_all(self, err):
        """Abort every request known now and end their streams with the error (requests
        added while this runs are not part of the failed step and go on)."""
        ids = list(self._streams)
        queues = {id(q): q for q, _ in self._streams.values()}.values()
        try:
            await self._call(self._abort, ids)
        except Exception:
            log.exception("aborting after a failed step failed too")
        error = RuntimeError(f"engine step failed: {type(err).__name__}: {err}")
        for queue in queues:
            queue.put_nowait(error)


class RequestStream:
    """The outputs of one HTTP request's prompts: ``async for index, output in stream``,
    each a cumulative RequestOutput; ends when every prompt finished. ``close()`` aborts
    what is unfinished."""

    def __init__(self, engine: AsyncEngine, ids):
        self.engine, self.ids, self.pending = engine, ids, set(ids)
        self.queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.pending:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        index, out = item
        if out.finished:
            self.pending.discard(out.request_id)
        return index, out

    async def next_outputs(self) -> dict:
        """{prompt index: its newest output}, waiting for at least one. Outputs are
        cumulative, so a reader that fell behind the engine (a busy server streams to
        hundreds of clients from one thread) catches up with one chunk for several
        tokens instead of one chunk each."""
        if not self.pending:
            raise StopAsyncIteration
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        latest = {}
        for item in items:
            if isinstance(item, Exception):
                raise item
            index, out = item
            if out.finished:
                self.pending.discard(out.request_id)
            latest[index] = out
        return latest

    def close(self):
        for rid in self.ids:
            self.engine._streams.pop(rid, None)
        if self.pending:
            self.engine.abort_later(sorted(self.pending))
            self.pending = set()
