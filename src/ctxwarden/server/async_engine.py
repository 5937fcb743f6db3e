"""The engine on its own thread, driven from asyncio.

The Engine is single-threaded, so exactly one thread touches it: the loop below. Loop:

    take commands (block while idle) -> apply them in order (submit, abort, call)
    -> if there is work: engine.step() -> hand each StepOutput to its request's sink

Submissions, aborts and calls cross into that thread through one FIFO queue, so an abort
queued after a submit always finds its request. Outputs cross back through
`loop.call_soon_threadsafe` onto the request's asyncio.Queue. `Engine.abort` frees the
request's blocks inside the call, so a disconnected client's blocks are free before the
next step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ctxwarden.request import FinishReason, StepOutput

log = logging.getLogger("ctxwarden.server.engine")

IDLE_POLL_S = 0.5  # how often an idle loop wakes to notice a stop request
STOP_TIMEOUT_S = 30.0


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

    def __init__(self, engine, name: str):
        self.engine = engine
        self.name = name
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[StepOutput], None]] = {}
        self._needs_flush = False  # an abort's notice is emitted by the next step
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

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
                     outputs: asyncio.Queue) -> Admitted:
        """Queue a request; its StepOutputs arrive on `outputs`. Raises the engine's refusal."""
        loop = asyncio.get_running_loop()

        def sink(out: StepOutput) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Submit(prompt, params, request_id, namespace, sink, future))
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
        while True:
            for command in self._next_commands():
                if isinstance(command, _Stop):
                    self._abort_all()
                    return
                self._apply(command)
            if self._has_work():
                self._step()

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
            req = self.engine.add_request(c.prompt, c.params, request_id=c.request_id, namespace=c.namespace)
        except Exception as e:  # noqa: BLE001 - every refusal goes back to the caller
            c.future.set_exception(e)
            return
        self._sinks[c.request_id] = c.sink
        c.future.set_result(Admitted(c.request_id, req.num_prompt_tokens))

    def _step(self) -> None:
        self._needs_flush = False
        try:
            outputs = self.engine.step()
        except Exception:  # noqa: BLE001 - a bug here must not hang every client
            log.exception("engine step failed; aborting the %d live requests", len(self._sinks))
            self._abort_all(FinishReason.ERROR)
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)
            if out.finished:
                self._sinks.pop(out.request_id, None)
        self.engine.release_finished()

    def _abort_all(self, reason: FinishReason = FinishReason.ABORT) -> None:
        """End every live request (engine stop or a failed step); each sink hears of it."""
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - keep ending the others
                log.exception("abort of %s failed", request_id)
            sink(StepOutput(request_id, (), "", True, reason, 0, 0, 0,
                            error="the engine stopped" if reason is FinishReason.ERROR else None))
        self._sinks.clear()
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
