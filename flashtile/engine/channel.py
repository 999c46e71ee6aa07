"""Rank 0 -> tensor-parallel workers: each step's message written once into shared memory.

nano-vllm's scheme (a shared-memory buffer every worker reads, a pickled method name and
its arguments), with a handshake so that rank 0 never overwrites a message still being
read: with asynchronous scheduling rank 0 launches the next step as soon as its device
work is queued, while a worker may still be reading the previous one.

- ``Channel`` (rank 0): ``send(obj)`` pickles obj into the buffer (in chunks of its size if
  larger) and writes a header (bytes, more to come) into each worker's notify pipe; before
  reusing the buffer it waits for every worker's acknowledgement on its status pipe.
  ``expect(kind)`` waits for a status message ("started", "ready") from every worker.
- ``WorkerEnd`` (a worker): ``recv()`` blocks on its notify pipe, copies the chunk out and
  acknowledges it before unpickling; ``report(kind, payload)`` writes a status message.

Every wait of rank 0 also watches the workers' processes, so a worker that dies or
reports an error (``report("error", traceback)``) becomes a ``WorkerError`` at once
instead of a hang, and a worker whose rank 0 went away reads end-of-file and exits.
"""

from __future__ import annotations

import pickle
import struct
from multiprocessing import connection
from multiprocessing.shared_memory import SharedMemory

HEADER = struct.Struct("<QB")  # chunk bytes, 1 if more chunks of the message follow
CAPACITY = 4 * 2**20  # a decode step at batch 256 is ~70 KB, a prefill of 8192 tokens ~0.3 MB


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed, died or stopped answering."""


class WorkerEnd:
    """A worker's side of the channel; picklable, passed to the worker process."""

    def __init__(self, rank: int, shm_name: str, notify, status):
        self.rank, self.shm_name, self.notify, self.status = rank, shm_name, notify, status
        self.shm = None

    def __getstate__(self):
        return {**self.__dict__, "shm": None}

    def open(self):
        # Python < 3.13 registers an attached segment with the resource tracker, which is
        # rank 0's too (spawn shares it): rank 0's unlink unregisters it once for all.
        self.shm = SharedMemory(name=self.shm_name)

    def recv(self):
        """The next message (blocking); EOFError once rank 0 has gone."""
        parts = []
        while True:
            size, more = HEADER.unpack(self.notify.recv_bytes())
            parts.append(bytes(self.shm.buf[:size]))
            self.status.send(("ack", None))
            if not more:
                return pickle.loads(b"".join(parts))

    def report(self, kind: str, payload=None):
        self.status.send((kind, payload))

    def close(self):
        if self.shm is not None:
            self.shm.close()
        self.notify.close()
        self.status.close()


class Channel:
    """Rank 0's side for ``readers`` workers (ranks 1..readers). ``watch(processes)``
    must be called once the workers are started."""

    def __init__(self, ctx, readers: int, capacity: int = CAPACITY):
        self.shm = SharedMemory(create=True, size=capacity)
        self.capacity = capacity
        notify = [ctx.Pipe(duplex=False) for _ in range(readers)]  # (read end, write end)
        status = [ctx.Pipe(duplex=False) for _ in range(readers)]
        self.ends = [WorkerEnd(i + 1, self.shm.name, n[0], s[1])
                     for i, (n, s) in enumerate(zip(notify, status))]
        self._notify = [n[1] for n in notify]
        self._status = [s[0] for s in status]
        self._unacked = [0] * readers
        self.processes = []
        self.errors: dict[int, str] = {}  # rank -> what the worker reported

    def watch(self, processes):
        """The workers' processes, started: close rank 0's copies of their ends, so that
        a worker's exit reads as end-of-file."""
        self.processes = processes
        for end in self.ends:
            end.notify.close()
            end.status.close()

    def send(self, obj, timeout_s: float):
        data = memoryview(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        for start in range(0, len(data), self.capacity):
            chunk = data[start:start + self.capacity]
            for i in range(len(self._notify)):
                while self._unacked[i]:
                    self._next(i, timeout_s)
            self.shm.buf[:len(chunk)] = chunk
            header = HEADER.pack(len(chunk), start + self.capacity < len(data))
            for i, conn in enumerate(self._notify):
                try:
                    conn.send_bytes(header)
                except OSError:  # its end is closed: the worker is gone
                    raise WorkerError(self.failure(i)) from None
                self._unacked[i] += 1

    def expect(self, kind: str, timeout_s: float):
        """Wait for a status message ``kind`` from every worker."""
        for i in range(len(self._status)):
            while self._next(i, timeout_s)[0] != kind:
                pass

    def _next(self, i: int, timeout_s: float):
        """Worker i's next status message; an acknowledgement is counted off."""
        conn, process = self._status[i], self.processes[i]
        if not connection.wait([conn, process.sentinel], timeout_s):
            raise WorkerError(f"tensor-parallel worker rank {i + 1} did not answer in "
                              f"{timeout_s:.0f} s")
        try:
            kind, payload = conn.recv()  # a dead worker's last report is still readable
        except EOFError:
            raise WorkerError(self.failure(i)) from None
        if kind == "error":
            self.errors[i + 1] = payload
            raise WorkerError(self.failure(i))
        if kind == "ack":
            self._unacked[i] -= 1
        return kind, payload

    def failure(self, i: int) -> str:
        """What is known of worker i's failure, for an error message."""
        rank = i + 1
        if rank in self.errors:
            return f"tensor-parallel worker rank {rank} failed:\n{self.errors[rank]}"
        process = self.processes[i]
        process.join(1.0)  # its exit code, if it is exiting
        return (f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code "
                f"{process.exitcode}" if process.exitcode is not None else
                f"tensor-parallel worker rank {rank} (pid {process.pid}) stopped answering")

    def collect_errors(self) -> dict[int, str]:
        """Read every error report waiting in the status pipes (without blocking)."""
        for i, conn in enumerate(self._status):
            try:
                while conn.poll():
                    kind, payload = conn.recv()
                    if kind == "error":
                        self.errors[i + 1] = payload
                    elif kind == "ack":
                        self._unacked[i] -= 1
            except (EOFError, OSError):
                pass
        return self.errors

    def close(self):
        for conn in self._notify + self._status:
            conn.close()
        self.shm.close()
        self.shm.unlink()
