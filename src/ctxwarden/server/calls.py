"""One admitted API request from submission to its last byte: collect or stream, then settle.

    collect (JSON)  : wait for every choice while watching the ASGI receive channel; a client
                      that disconnects aborts every unfinished choice at once (its blocks are
                      free before the next engine step) and is counted as abandoned
    events (SSE)    : yield chunks; EventStreamResponse cancels the generator on disconnect
    settle (once)   : abort what is left, give back unused tokens-per-minute, observe latency,
                      count the status, leave the in-flight count

A choice that ended with an error is a 500 (`engine_error`); if the engine itself died it is
a 503 (`engine_failed`): the request may succeed once the server has restarted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

import anyio
from fastapi.responses import JSONResponse, StreamingResponse

from ctxwarden.server import responses
from ctxwarden.server.errors import APIError, RETRY_AFTER_S
from ctxwarden.server.generation import Generation, Job
from ctxwarden.server.metrics import ServerMetrics
from ctxwarden.server.middleware import request_id_var
from ctxwarden.server.overflow import OverflowReport

log = logging.getLogger("ctxwarden.server")


@dataclass
class Call:
    """One admitted request. `on_settle(call)` runs once, whichever way it ends."""

    metrics: ServerMetrics
    gen: Generation
    api_id: str
    created: int
    job: Job
    body: Any
    on_settle: Callable[["Call"], None]
    overflow: OverflowReport | None = None  # the overflow policy and what it dropped
    status: int = 499
    is_settled: bool = False
    is_abandoned: bool = False

    @property
    def top_k(self) -> int | None:
        return self.job.sampling.get("logprobs")

    def headers(self) -> dict[str, str]:
        """Context headers (what the model attends to: see context_headers) and the overflow
        report (policy, tokens dropped and from where)."""
        out = {"x-request-id": request_id_var.get(), "x-ctxwarden-served-by": self.gen.engine.name}
        out.update(context_headers(self.gen.engine.engine, self.gen.max_prompt_tokens))
        out.update(self.overflow.headers() if self.overflow else {})
        return out

    # --- JSON -----------------------------------------------------------------------------

    async def collect(self, receive) -> JSONResponse:
        """Wait for every choice (aborting them if the client leaves); the whole response."""
        watcher = asyncio.ensure_future(self._abort_on_disconnect(receive))
        try:
            while not self.gen.is_finished:
                await self.gen.next()
            if self.is_abandoned:
                return JSONResponse({}, status_code=499)  # nobody is there to read it
            self._raise_if_failed()
            self.status = 200
            return JSONResponse(self._response().model_dump(), headers=self.headers())
        finally:
            watcher.cancel()
            self.settle()

    async def _abort_on_disconnect(self, receive) -> None:
        """Abort every unfinished choice when the ASGI channel says the client has gone."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.is_abandoned = True
        aborted = self.gen.abort_unfinished()
        if aborted:
            self.metrics.abandoned.inc()
            log.info("%s: client disconnected before the response; aborted %d choice(s)", self.api_id, aborted)

    def _raise_if_failed(self) -> None:
        failed = [c for c in self.gen.choices if c.finish_reason == "error"]
        if not failed:
            return
        if self.gen.engine.failure is not None:
            self.status = 503
            raise APIError(503, f"The engine failed ({self.gen.engine.failure}); the server is restarting. "
                           "Retry shortly.", "service_unavailable", code="engine_failed",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.status = 500
        raise APIError(500, f"generation failed: {failed[0].error}", "server_error", code="engine_error")

    def _response(self):
        make = responses.chat_response if self.job.is_chat else responses.completion_response
        response = make(self.gen, self.api_id, self.created, self.gen.engine.name, self.top_k)
        response.ctxwarden = self.overflow.to_dict() if self.overflow else None
        return response

    # --- SSE ------------------------------------------------------------------------------

    async def events(self):
        """The SSE stream; a client that goes away aborts every unfinished choice."""
        model = self.gen.engine.name
        try:
            if self.job.is_chat:
                for c in self.gen.choices:
                    yield responses.sse(responses.chat_role_chunk(self.api_id, self.created, model, c.index))
            else:
                yield ": admitted\n\n"  # an SSE comment: headers go out now, even while queued
            while not self.gen.is_finished:
                choice, out = await self.gen.next()
                if out.error:
                    yield responses.sse(self._error_event(out.error))
                    return
                if out.text_delta or out.finished or out.new_logprobs:
                    yield responses.sse(self._chunk(choice, out, model))
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield responses.sse(responses.usage_chunk(self.gen, self.api_id, self.created, model, self.job.is_chat))
            yield "data: [DONE]\n\n"
            self.status = 200
        finally:
            self.settle()

    def _error_event(self, error: str) -> dict:
        if self.gen.engine.failure is not None:
            self.status = 503
            return {"error": {"message": f"The engine failed ({self.gen.engine.failure}); retry shortly.",
                              "type": "service_unavailable", "param": None, "code": "engine_failed"}}
        self.status = 500
        return {"error": {"message": f"generation failed: {error}", "type": "server_error", "param": None,
                          "code": "engine_error"}}

    def _chunk(self, choice, out, model: str):
        make = responses.chat_chunk if self.job.is_chat else responses.completion_chunk
        return make(self.gen, choice, out, self.api_id, self.created, model, self.top_k)

    # --- the end ----------------------------------------------------------------------------

    def settle(self) -> None:
        """End the call (once): abort what is left, observe latency, count, hand back."""
        if self.is_settled:
            return
        self.is_settled = True
        aborted = self.gen.abort_unfinished()
        if aborted:
            log.info("%s: client went away; aborted %d choice(s)", self.api_id, aborted)
        self._observe_latency()
        self.metrics.count_request(self.status)
        self.on_settle(self)
        log.info("%s: finished with status %d", self.api_id, self.status)

    def _observe_latency(self) -> None:
        for c in self.gen.choices:
            if c.first_token_s is None:
                continue
            self.metrics.time_to_first_token.observe(c.first_token_s - self.gen.arrival_s)
            if c.finished_s is not None and len(c.token_ids) > 1:
                self.metrics.time_per_output_token.observe((c.finished_s - c.first_token_s) / (len(c.token_ids) - 1))


def context_headers(engine, num_prompt_tokens: int) -> dict[str, str]:
    """x-context-*: the window, the tokens used, what is left, and what the model attends to.

    full mode:      window = max_model_len; remaining = window - used
    streaming mode: (sinks + rolling window) window = sink_tokens + window_tokens, the most
                    any token attends to; attended = min(used, window); evicted = the prompt
                    tokens the model no longer sees; no remaining (the length is unbounded)
    A max_model_len raised past the model's window without RoPE scaling adds
    x-context-trained-window and a warning saying so.
    """
    c = engine.config
    if c.is_unbounded_length:
        window = c.sink_tokens + c.window_tokens
        attended = min(num_prompt_tokens, window)
        return {"x-context-mode": "streaming", "x-context-window": str(window),
                "x-context-sink-tokens": str(c.sink_tokens), "x-context-window-tokens": str(c.window_tokens),
                "x-context-used": str(num_prompt_tokens), "x-context-attended": str(attended),
                "x-context-evicted": str(num_prompt_tokens - attended)}
    window = engine.max_model_len
    out = {"x-context-mode": "full", "x-context-window": str(window), "x-context-used": str(num_prompt_tokens),
           "x-context-remaining": str(max(0, window - num_prompt_tokens))}
    if engine.is_past_trained_window:
        trained = engine.window.window_tokens
        out["x-context-trained-window"] = str(trained)
        out["x-ctxwarden-warning"] = (f"max_model_len {window} is past the model's window of {trained} tokens "
                                      "without RoPE scaling (--allow-long-max-model-len): positions past it "
                                      "were never trained")
    return out


class EventStreamResponse(StreamingResponse):
    """A streaming response that always watches for the client leaving.

    On disconnect the body generator is cancelled (its `finally` aborts the engine
    requests) whichever ASGI spec version the server speaks; `on_close` runs last, even if
    the generator never started.
    """

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
            self.on_close()
