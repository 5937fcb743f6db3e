"""Asynchronous, droppable stores: one writer thread per write-through tier (no torch).

A store never makes a request wait: `submit` queues the job and returns at once, or drops
it when the queued bytes would pass the budget (a slow or dead tier must not pile up host
memory). The thread writes jobs in order; a failed write is counted by the caller's write
function and the job is dropped (the KV is still in the pool; a later store may succeed).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("ctxwarden.kv.tiers")


class StoreWriter:
    """A bounded queue of store jobs and the thread that writes them."""

    def __init__(self, name: str, max_queue_bytes: int, write: Callable[[object], None]):
        self.name, self.max_queue_bytes, self._write = name, max_queue_bytes, write
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.queued_bytes = 0
        self._num_pending = 0
        self._thread = threading.Thread(target=self._loop, name=f"kv-tier-writer-{name}", daemon=True)
        self._thread.start()

    def submit(self, job) -> bool:
        """Queue `job` (it has `num_bytes`); False when it would pass the byte budget."""
        with self._lock:
            if self.queued_bytes + job.num_bytes > self.max_queue_bytes:
                return False
            self.queued_bytes += job.num_bytes
            self._num_pending += 1
        self._queue.put(job)
        return True

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception:  # noqa: BLE001 - one bad job must not stop the writer
                log.exception("kv tier %s: a store failed", self.name)
            with self._lock:
                self.queued_bytes -= job.num_bytes
                self._num_pending -= 1
                self._idle.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued job is written; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._num_pending == 0, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the job in hand; jobs still queued are dropped."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join(timeout_s)
