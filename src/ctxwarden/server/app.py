"""The OpenAI-compatible HTTP app: routes, readiness, tenants, streaming, draining.

    request -> request-id + body-size middleware -> auth (tenant) -> readiness (503)
            -> validate (pydantic, 400) -> pick the model (fallback on an over-window prompt)
            -> submit every choice (refusals: 400 / 429) -> stream (SSE) or collect -> respond

`create_app(config)` loads the model(s) in the background on startup (503 + Retry-After
meanwhile); `create_app(config, engines=[...])` serves engines built by the caller.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ctxwarden.errors import ContextLengthExceeded
from ctxwarden.server import errors, responses
from ctxwarden.server.async_engine import AsyncEngine
from ctxwarden.server.errors import APIError, unavailable
from ctxwarden.server.generation import Generation, Job, submit
from ctxwarden.server.metrics import ServerMetrics
from ctxwarden.server.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                       CompletionRequest, CompletionResponse, ErrorResponse,
                                       ModelCard, ModelList)
from ctxwarden.server.tenants import Tenant, TenantDirectory

log = logging.getLogger("ctxwarden.server")
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 500, 503)}


@dataclass(frozen=True)
class ServerConfig:
    """How to serve: the model(s), engine sizes, keys and limits."""

    model: str | None = None
    fallback_model: str | None = None
    served_model_name: str | None = None
    kv_memory: str = "1GiB"
    max_num_seqs: int = 64
    max_waiting: int | None = 256
    max_batched_tokens: int = 2048
    dtype: str = "float32"
    api_keys: str | None = None  # path of the key file
    max_body_bytes: int = 4 * 1024 * 1024
    drain_timeout_s: float = 60.0
    weights: str | None = None  # EngineConfig.weights; None: its default (auto)

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


@dataclass
class ServerState:
    """Readiness and in-flight accounting (the drain waits for in_flight to reach 0)."""

    phase: str = "loading"  # loading | ready | draining | failed
    engines: list[AsyncEngine] = field(default_factory=list)  # primary first, then the fallback
    in_flight: int = 0
    load_error: str | None = None

    def check_ready(self) -> None:
        """Raise 503 + Retry-After unless new requests are accepted now."""
        if self.phase == "loading":
            raise unavailable("The model is still loading; retry shortly.")
        if self.phase == "draining":
            raise unavailable("The server is shutting down and accepts no new requests.")
        if self.phase == "failed":
            raise unavailable(f"The model failed to load: {self.load_error}")

    def begin_drain(self) -> None:
        """Refuse new requests from now on (503); running ones continue."""
        if self.phase != "failed":
            self.phase = "draining"

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (True) or the timeout passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    def route(self, model: str) -> list[AsyncEngine]:
        """Engines to try for `model`, in order; 404 if no served model has that id."""
        names = [e.name for e in self.engines]
        if model not in names:
            raise APIError(404, f"The model {model!r} does not exist; this server serves {', '.join(names)}.",
                           param="model", code="model_not_found")
        i = names.index(model)
        return self.engines[i:]  # the primary falls back to the next; a fallback has none


def build_engines(config: ServerConfig) -> list[AsyncEngine]:
    """Load the primary (and fallback) model and start their engine threads."""
    from ctxwarden.engine import Engine
    from ctxwarden.engine_config import EngineConfig

    kv_dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[config.dtype]
    out = []
    for k, path in enumerate([config.model] + ([config.fallback_model] if config.fallback_model else [])):
        engine = Engine(EngineConfig.build(kv_memory=config.kv_memory, model=path, dtype=config.dtype,
                                           kv_dtype=kv_dtype, max_num_seqs=config.max_num_seqs,
                                           max_waiting=config.max_waiting,
                                           max_batched_tokens=config.max_batched_tokens,
                                           **({"weights": config.weights} if config.weights else {})))
        name = config.served_model_name if (k == 0 and config.served_model_name) else engine.checkpoint.name
        out.append(AsyncEngine(engine, name))
    for e in out:
        e.start()
    return out


async def _load(state: ServerState, config: ServerConfig) -> None:
    try:
        state.engines = await asyncio.to_thread(build_engines, config)
    except Exception as e:  # noqa: BLE001 - reported by /health and every 503
        log.exception("loading the model failed")
        state.load_error, state.phase = f"{type(e).__name__}: {e}", "failed"
        return
    state.phase = "ready" if state.phase == "loading" else state.phase
    log.info("serving %s", ", ".join(f"{e.name} (window {e.window_tokens})" for e in state.engines))


def create_app(config: ServerConfig, engines: list[AsyncEngine] | None = None) -> FastAPI:
    """The FastAPI app. Without `engines`, the model(s) load in the background on startup."""
    state = ServerState(phase="ready" if engines else "loading", engines=list(engines or []))
    tenants = TenantDirectory.load(config.api_keys) if config.api_keys else TenantDirectory.open()
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None if engines else asyncio.create_task(_load(state, config))
        yield
        if loader is not None and not loader.done():
            loader.cancel()
        for e in state.engines:
            await asyncio.to_thread(e.stop)

    app = FastAPI(title="ctxwarden", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over the ctxwarden paged-KV engine.")
    app.state.server, app.state.metrics, app.state.config = state, metrics, config
    errors.install(app)
    app.add_middleware(RequestContextMiddleware, max_body_bytes=config.max_body_bytes)

    async def tenant_of(authorization: str | None = Header(default=None)) -> Tenant:
        tenant = tenants.resolve(authorization)
        if tenant is None:
            msg = "Missing API key: send 'Authorization: Bearer KEY'." if not authorization else "Unknown API key."
            raise APIError(401, msg, "invalid_request_error", code="invalid_api_key")
        return tenant

    _add_info_routes(app, state, metrics, tenant_of)
    _add_completion_routes(app, state, metrics, tenant_of)
    return app


def _add_info_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics, tenant_of) -> None:
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> dict:
        """200 when requests are accepted; 503 + Retry-After while loading, draining or failed."""
        state.check_ready()
        return {"status": "ok", "models": [e.name for e in state.engines]}

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models(tenant: Tenant = Depends(tenant_of)) -> ModelList:
        """The served models (the primary first) and their context windows."""
        state.check_ready()
        return ModelList(data=[ModelCard(id=e.name, context_window=e.window_tokens) for e in state.engines])

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text: KV pool, prefix cache, queues, outcomes, latencies."""
        snapshots = {e.name: await e.call(lambda eng: eng.stats()) for e in state.engines}
        return Response(metrics.render(snapshots), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_completion_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics, tenant_of) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, tenant: Tenant = Depends(tenant_of)):
        """Text completion (legacy API), streamed or not."""
        return await _serve(state, metrics, _completion_job(body), body, tenant, "cmpl")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, tenant: Tenant = Depends(tenant_of)):
        """Chat completion, streamed or not."""
        return await _serve(state, metrics, _chat_job(body), body, tenant, "chatcmpl")


def _sampling(body, logprobs: int | None) -> dict:
    fields = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
              "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty}
    out = {k: v for k, v in fields.items() if v is not None}
    stop = body.stop
    out.update(stop=(stop,) if isinstance(stop, str) else tuple(stop or ()), ignore_eos=body.ignore_eos,
               logprobs=logprobs)
    return out


def _chat_job(body: ChatCompletionRequest) -> Job:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true.", param="top_logprobs", code="invalid_value")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    messages = tuple({"role": m.role, "content": m.text} for m in body.messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return Job(True, (messages,), body.n, max_tokens, _sampling(body, logprobs), body.seed, "messages")


def _completion_job(body: CompletionRequest) -> Job:
    if body.echo:
        raise APIError(400, "echo is not supported by this server; send echo: false.", param="echo",
                       code="unsupported_value")
    p = body.prompt
    prompts = (p,) if isinstance(p, str) or isinstance(p[0], int) else tuple(p)
    return Job(False, prompts, body.n, body.max_tokens, _sampling(body, body.logprobs), body.seed, "prompt")


async def _start(state: ServerState, job: Job, model: str, tenant: Tenant, api_id: str) -> Generation:
    """Submit on the requested model; an over-window prompt moves on to the fallback model."""
    candidates = state.route(model)
    for k, engine in enumerate(candidates):
        try:
            return await submit(engine, job, api_id, tenant.namespace)
        except ContextLengthExceeded as e:
            if k == len(candidates) - 1:
                raise errors.from_engine_error(e, job.prompt_param) from e
            log.info("prompt over %s's window (%d tokens); trying %s", engine.name, e.window_tokens,
                     candidates[k + 1].name)
        except Exception as e:  # noqa: BLE001 - every refusal becomes its API error
            raise errors.from_engine_error(e, job.prompt_param) from e
    raise AssertionError("route() returns at least one engine")


async def _serve(state: ServerState, metrics: ServerMetrics, job: Job, body, tenant: Tenant, prefix: str):
    """Admit, submit and answer one completion request (JSON or a stream)."""
    try:
        state.check_ready()
        state.in_flight += 1
    except APIError as e:
        metrics.count_request(e.status)
        raise
    try:
        api_id = f"{prefix}-{uuid.uuid4().hex}"
        gen = await _start(state, job, body.model, tenant, api_id)
    except BaseException as e:
        state.in_flight -= 1
        metrics.count_request(e.status if isinstance(e, APIError) else 499)
        raise
    log.info("%s: %d choice(s) on %s, tenant %s, %d prompt tokens", api_id, len(gen.choices),
             gen.engine.name, tenant.name, gen.max_prompt_tokens)
    call = _Call(state, metrics, gen, api_id, int(time.time()), job, body)
    if body.stream:
        return EventStreamResponse(call.events(), media_type="text/event-stream", headers=call.headers(),
                                   on_close=call.close)
    return await call.collect()


@dataclass
class _Call:
    """One admitted request from submission to its last byte."""

    state: ServerState
    metrics: ServerMetrics
    gen: Generation
    api_id: str
    created: int
    job: Job
    body: object
    is_closed: bool = False

    @property
    def top_k(self) -> int | None:
        return self.job.sampling.get("logprobs")

    def headers(self) -> dict[str, str]:
        """Context headers: the window, the tokens the prompt uses, and what is left."""
        window, used = self.gen.engine.window_tokens, self.gen.max_prompt_tokens
        return {"x-request-id": request_id_var.get(), "x-context-window": str(window),
                "x-context-used": str(used), "x-context-remaining": str(max(0, window - used)),
                "x-ctxwarden-served-by": self.gen.engine.name}

    async def collect(self) -> JSONResponse:
        """Wait for every choice; the whole response at once."""
        status = 499
        try:
            while not self.gen.is_finished:
                await self.gen.next()
            failed = [c for c in self.gen.choices if c.finish_reason == "error"]
            if failed:
                status = 500
                raise APIError(500, f"generation failed: {failed[0].error}", "server_error", code="engine_error")
            status = 200
            return JSONResponse(self._response().model_dump(), headers=self.headers())
        finally:
            self._finish(status)

    def _response(self):
        make = responses.chat_response if self.job.is_chat else responses.completion_response
        return make(self.gen, self.api_id, self.created, self.gen.engine.name, self.top_k)

    async def events(self):
        """The SSE stream; a client that goes away aborts every unfinished choice."""
        status, model = 499, self.gen.engine.name
        try:
            if self.job.is_chat:
                for c in self.gen.choices:
                    yield responses.sse(responses.chat_role_chunk(self.api_id, self.created, model, c.index))
            else:
                yield ": admitted\n\n"  # an SSE comment: headers go out now, even while queued
            while not self.gen.is_finished:
                choice, out = await self.gen.next()
                if out.error:
                    status = 500
                    yield responses.sse({"error": {"message": f"generation failed: {out.error}",
                                                   "type": "server_error", "param": None, "code": "engine_error"}})
                    return
                if out.text_delta or out.finished or out.new_logprobs:
                    yield responses.sse(self._chunk(choice, out, model))
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield responses.sse(responses.usage_chunk(self.gen, self.api_id, self.created, model, self.job.is_chat))
            yield "data: [DONE]\n\n"
            status = 200
        finally:
            self._finish(status)

    def _chunk(self, choice, out, model: str):
        make = responses.chat_chunk if self.job.is_chat else responses.completion_chunk
        return make(self.gen, choice, out, self.api_id, self.created, model, self.top_k)

    def close(self) -> None:
        """End the call as abandoned by the client, unless it already ended."""
        self._finish(499)

    def _finish(self, status: int) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        aborted = self.gen.abort_unfinished()
        if aborted:
            log.info("%s: client went away; aborted %d choice(s)", self.api_id, aborted)
        self._observe_latency()
        self.metrics.count_request(status)
        self.state.in_flight -= 1
        log.info("%s: finished with status %d", self.api_id, status)

    def _observe_latency(self) -> None:
        for c in self.gen.choices:
            if c.first_token_s is None:
                continue
            self.metrics.time_to_first_token.observe(c.first_token_s - self.gen.arrival_s)
            if c.finished_s is not None and len(c.token_ids) > 1:
                self.metrics.time_per_output_token.observe((c.finished_s - c.first_token_s) / (len(c.token_ids) - 1))


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


class RequestContextMiddleware:
    """x-request-id on every response (and in every log line); 413 for oversized bodies."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = _clean_request_id(headers.get(b"x-request-id", b"").decode("latin-1"))
        token = request_id_var.set(rid)
        send = _with_request_id(send, rid)
        try:
            length = headers.get(b"content-length", b"").decode("latin-1")
            if length.isdigit() and int(length) > self.max_body_bytes:
                return await self._too_large(f"is {int(length)} bytes")(scope, receive, send)
            messages = await self._read_body(receive)
            if messages is None:
                return await self._too_large("exceeds that")(scope, receive, send)
            await self.app(scope, _replay(messages, receive), send)
        finally:
            request_id_var.reset(token)

    def _too_large(self, what: str) -> Response:
        return APIError(413, f"The request body {what}; this server accepts at most {self.max_body_bytes} "
                        "bytes (--max-body-bytes).", param="body", code="request_too_large").response()

    async def _read_body(self, receive) -> list[dict] | None:
        """The body's messages, read up front (None past the limit: chunked bodies have no length)."""
        messages, num_bytes = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[dict], receive):
    """A receive() that returns the buffered body first, then the live channel (disconnects)."""
    pending = list(messages)

    async def replay():
        return pending.pop(0) if pending else await receive()
    return replay


def _with_request_id(send, rid: str):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
            message = {**message, "headers": headers + [(b"x-request-id", rid.encode("latin-1"))]}
        await send(message)
    return wrapped


def _clean_request_id(given: str) -> str:
    """The client's x-request-id if it is short and printable; a fresh one otherwise."""
    if given and len(given) <= 128 and given.isprintable() and given.isascii():
        return given
    return uuid.uuid4().hex


class RequestIdLogFilter(logging.Filter):
    """Adds `request_id` to every log record (the current request's, or '-')."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True
