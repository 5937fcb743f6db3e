"""The engine on its own thread, driven from asyncio.

The Engine is single-threaded, so exactly one thread touches it: the loop below. Loop:

    take commands (block while idle) -> apply them in order (submit, abort, call)
    -> if there is work: engine.step() -> hand each StepOutput to its request's sink

Submissions, aborts and calls cross into that thread through one FIFO queue, so an abort
queued after a submit always finds its request. Outputs cross back through
`loop.call_soon_threadsafe` onto the request's asyncio.Queue. `Engine.abort` frees the
request's blocks inside the call, so a disconnected client's blocks are free before the
next step runs.

Monitoring never waits on the engine: after each step (at most PUBLISH_INTERVAL_S apart,
and whenever the engine goes idle) the thread publishes an `EngineStats` snapshot that
/metrics reads as it is. An exception escaping `Engine.step` is fatal: the engine is marked
failed, every live request ends with an error at once, later submissions raise
EngineFailed, and `on_failure` tells the server (which turns /health to 503 and exits
non-zero so a supervisor restarts it). Per-request failures inside a step (a bad forward)
are not fatal: the engine ends those requests and goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ctxwarden.errors import EngineFailed
from ctxwarden.request import FinishReason, StepOutput

log = logging.getLogger("ctxwarden.server.engine")

IDLE_POLL_S = 0.5  # how often an idle loop wakes to notice a stop request
STOP_TIMEOUT_S = 30.0
PUBLISH_INTERVAL_S = 0.2  # the stats snapshot is at most this old while the engine runs


@dataclass(frozen=True)
class Admitted:
    """A request the engine accepted: its id and its prompt length in tokens."""

    request_id: str
    num_prompt_tokens: int


@dataclass(frozen=True)
class _Submit:
    prompt: Any  # list[int] | str
    params: Any  # SamplingParams
    request_id: str
    namespace: str
    share: Any  # TenantShare
    sink: Callable[[StepOutput], None]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


class _Stop:
    pass


class AsyncEngine:
    """One Engine, its thread, and the asyncio-facing submit / abort / call."""

    def __init__(self, engine, name: str, on_failure: Callable[[str], None] | None = None):
        self.engine = engine
        self.name = name
        self.on_failure = on_failure
        self.failure: str | None = None  # set once, when the loop dies
        self.stats = engine.stats()  # the latest published snapshot
        self._published_at = time.monotonic()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[StepOutput], None]] = {}
        self._needs_flush = False  # an abort's notice is emitted by the next step
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_streaming(self) -> bool:
        """Sink / rolling-window mode: prompts past max_model_len are served."""
        return self.engine.config.is_unbounded_length

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Abort whatever is left and end the engine thread."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout_s)
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()  # the KV tiers' writer and probe threads

    # --- the asyncio side -------------------------------------------------------------------

    async def submit(self, prompt, params, request_id: str, namespace: str,
                     outputs: asyncio.Queue, share=None) -> Admitted:
        """Queue a request; its StepOutputs arrive on `outputs`. Raises the engine's refusal."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        loop = asyncio.get_running_loop()

        def sink(out: StepOutput) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Submit(prompt, params, request_id, namespace, share, sink, future))
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (thread-safe, returns at once)."""
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    # --- the engine thread ------------------------------------------------------------------

    def _has_work(self) -> bool:
        return self._needs_flush or self.engine.has_unfinished_requests

    def _next_commands(self) -> list:
        """Every queued command; waits for the first one only while the engine is idle."""
        commands = []
        if not self._has_work():
            try:
                commands.append(self._commands.get(timeout=IDLE_POLL_S))
            except queue.Empty:
                return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _loop(self) -> None:
        while self.failure is None:
            for command in self._next_commands():
                if isinstance(command, _Stop):
                    self._abort_all()
                    return
                self._apply(command)
            if self._has_work():
                self._step()
            self._publish()
        self._refuse_until_stopped()

    def _publish(self, force: bool = False) -> None:
        """Replace the stats snapshot (atomically: one attribute) if it is due."""
        now = time.monotonic()
        if force or not self._has_work() or now - self._published_at >= PUBLISH_INTERVAL_S:
            self.stats, self._published_at = self.engine.stats(), now

    def _apply(self, command) -> None:
        if isinstance(command, _Submit):
            self._add(command)
        elif isinstance(command, _Abort):
            if self.engine.abort(command.request_id):
                self._needs_flush = True
        elif isinstance(command, _Call):
            _settle(command.future, command.fn, self.engine)

    def _add(self, c: _Submit) -> None:
        if not c.future.set_running_or_notify_cancel():
            return
        try:
            req = self.engine.add_request(c.prompt, c.params, request_id=c.request_id, namespace=c.namespace,
                                          share=c.share)
        except Exception as e:  # noqa: BLE001 - every refusal goes back to the caller
            c.future.set_exception(e)
            return
        self._sinks[c.request_id] = c.sink
        c.future.set_result(Admitted(c.request_id, req.num_prompt_tokens))

    def _step(self) -> None:
        self._needs_flush = False
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fatal: loud, never a hang
            self._fail(f"{type(e).__name__}: {e}")
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)
            if out.finished:
                self._sinks.pop(out.request_id, None)
        self.engine.release_finished()

    def _fail(self, message: str) -> None:
        """The engine loop is dead: end every live request with an error and say so once."""
        log.critical("engine %s failed: %s; ending %d live request(s); the server must restart",
                     self.name, message, len(self._sinks), exc_info=True)
        self.failure = message
        self._abort_all(FinishReason.ERROR, flush=False)
        if self.on_failure is not None:
            try:
                self.on_failure(message)
            except Exception:  # noqa: BLE001 - the failure is already recorded
                log.exception("on_failure callback failed")

    def _refuse_until_stopped(self) -> None:
        """After a failure: refuse every submission and call until stop() (no engine calls)."""
        while True:
            command = self._commands.get()
            if isinstance(command, _Stop):
                return
            if isinstance(command, (_Submit, _Call)) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineFailed(self.failure))

    def _abort_all(self, reason: FinishReason = FinishReason.ABORT, flush: bool = True) -> None:
        """End every live request (engine stop or failure); each sink hears of it."""
        error = f"the engine failed: {self.failure}" if reason is FinishReason.ERROR else None
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - keep ending the others
                log.exception("abort of %s failed", request_id)
            sink(StepOutput(request_id, (), "", True, reason, 0, 0, 0, error=error))
        self._sinks.clear()
        if not flush:
            return
        try:
            self.engine.step()  # flush the abort notices (already delivered above)
            self.engine.release_finished()
        except Exception:  # noqa: BLE001
            log.exception("flushing aborts failed")


def _settle(future: concurrent.futures.Future, fn, engine) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(engine))
    except Exception as e:  # noqa: BLE001 - the caller gets the error
        future.set_exception(e)
