"""The OpenAI-compatible HTTP app: routes, readiness, tenants, streaming, draining.

    request -> request-id + body-size middleware -> auth (tenant) -> readiness (503)
            -> validate (pydantic, 400) -> pick the model (fallback on an over-window prompt)
            -> submit every choice (refusals: 400 / 429) -> stream (SSE) or collect -> respond

`create_app(config)` loads the model(s) in the background on startup (503 + Retry-After
meanwhile); `create_app(config, engines=[...])` serves engines built by the caller.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import Response

from ctxwarden.diagnostics.cgroup import DEFAULT_CGROUP_ROOT
from ctxwarden.engine.config import SERVER_MAX_QUEUE_DELAY_S, SERVER_MAX_WAITING, EngineConfig
from ctxwarden.errors import ContextLengthExceeded, TenantLimitExceeded
from ctxwarden.server import errors
from ctxwarden.server.async_engine import AsyncEngine
from ctxwarden.server.calls import Call, EventStreamResponse
from ctxwarden.server.debug import add_debug_routes
from ctxwarden.server.errors import APIError, unavailable
from ctxwarden.server.generation import Generation, Job, submit
from ctxwarden.server.metrics import ServerMetrics
from ctxwarden.server.middleware import (RequestContextMiddleware, RequestIdLogFilter, request_id_var,
                                         trace_id_var)
from ctxwarden.server.crash import CrashRecorder
from ctxwarden.server.events import EventRing
from ctxwarden.server.overflow import FITTING_POLICIES, OverflowReport, check_policy, fit_job
from ctxwarden.server.owners import RequestTags
from ctxwarden.server.request_log import RequestLogWriter, record_of
from ctxwarden.server.sampler import MemorySampler
from ctxwarden.server.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                       CompletionRequest, CompletionResponse, ErrorResponse,
                                       ModelCard, ModelList)
from ctxwarden.server.tenants import Tenant, TenantDirectory, TokenRateLimiter

log = logging.getLogger("ctxwarden.server")
__all__ = ["ServerConfig", "ServerState", "create_app", "build_engines", "RequestIdLogFilter", "request_id_var"]

_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 500, 503)}


_SERVER_FIELDS = ("fallback_model", "on_overflow", "served_model_name", "api_keys", "max_body_bytes",
                  "drain_timeout_s", "cgroup_root", "request_log", "crash_dir", "crash_window_s",
                  "debug_dump_prompts", "memory_sample_interval_s", "leak_warmup_requests")


def _server_engine_config() -> EngineConfig:
    return EngineConfig(max_waiting=SERVER_MAX_WAITING, max_queue_delay_s=SERVER_MAX_QUEUE_DELAY_S)


@dataclass(frozen=True)
class ServerConfig:
    """How to serve: the engine (one EngineConfig, shared by the fallback), keys and limits."""

    engine: EngineConfig = field(default_factory=_server_engine_config)
    fallback_model: str | None = None  # same engine options, another model
    on_overflow: str | None = None  # OVERFLOW_POLICIES; None: fallback with a fallback model, else error
    served_model_name: str | None = None
    api_keys: str | None = None  # path of the key file
    max_body_bytes: int = 4 * 1024 * 1024
    drain_timeout_s: float = 60.0
    cgroup_root: str = DEFAULT_CGROUP_ROOT  # where /debug/memory reads the memory cgroup
    request_log: str | None = None  # append one JSONL line per finished request (no text)
    crash_dir: str | None = None  # the first 5xx / engine failure writes a crash bundle here
    crash_window_s: float = 600.0  # the events and samples a bundle keeps
    debug_dump_prompts: bool = False  # crash bundles include the failing request's prompts
    memory_sample_interval_s: float = 1.0  # the timeline's memory samples (0: none)
    leak_warmup_requests: int = 100  # the slow-leak slope skips the first requests (caches filling)

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        default = "fallback" if self.fallback_model else "error"
        object.__setattr__(self, "on_overflow", check_policy(self.on_overflow or default, "on_overflow"))
        if self.leak_warmup_requests < 0:
            raise ValueError(f"leak_warmup_requests must be >= 0, got {self.leak_warmup_requests}")
        if self.memory_sample_interval_s < 0 or self.crash_window_s <= 0:
            raise ValueError(f"memory_sample_interval_s must be >= 0 and crash_window_s > 0, got "
                             f"{self.memory_sample_interval_s} and {self.crash_window_s}")

    @classmethod
    def build(cls, **options) -> "ServerConfig":
        """Server fields by name; every other option is an EngineConfig field (as LLM takes).

        The queue is bounded at SERVER_MAX_WAITING and the predicted queue delay at
        SERVER_MAX_QUEUE_DELAY_S unless `max_waiting` / `max_queue_delay_s` are given.
        """
        server = {k: options.pop(k) for k in _SERVER_FIELDS if k in options}
        options.setdefault("max_waiting", SERVER_MAX_WAITING)
        options.setdefault("max_queue_delay_s", SERVER_MAX_QUEUE_DELAY_S)
        return cls(engine=EngineConfig.build(**options), **server)

    def engine_configs(self) -> list[EngineConfig]:
        """The primary model's engine config, then the fallback's (same options)."""
        fallback = [replace(self.engine, model=self.fallback_model)] if self.fallback_model else []
        return [self.engine] + fallback


@dataclass
class ServerState:
    """Readiness and in-flight accounting (the drain waits for in_flight to reach 0)."""

    phase: str = "loading"  # loading | ready | draining | failed
    engines: list[AsyncEngine] = field(default_factory=list)  # primary first, then the fallback
    in_flight: int = 0
    num_completed_requests: int = 0  # requests answered (any status) since the start: the leak slope's x
    failure: str | None = None  # why the phase is "failed": a load error or a dead engine
    events: EventRing = field(default_factory=EventRing)  # every engine records here too
    on_fail: object = None  # called with the reason when the server fails (the crash bundle)

    def check_ready(self) -> None:
        """Raise 503 + Retry-After unless new requests are accepted now."""
        if self.phase == "loading":
            raise unavailable("The model is still loading; retry shortly.")
        if self.phase == "draining":
            raise unavailable("The server is shutting down and accepts no new requests.")
        if self.phase == "failed":
            raise unavailable(f"The server cannot serve: {self.failure}; it must be restarted.")

    def fail(self, reason: str) -> None:
        """Nothing more can be served (/health 503); the process should exit non-zero."""
        self.failure, self.phase = reason, "failed"
        if self.on_fail is not None:
            self.on_fail(reason)

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


def build_engines(config: ServerConfig, on_failure=None) -> list[AsyncEngine]:
    """Load the primary (and fallback) model and start their engine threads."""
    from ctxwarden.engine.engine import Engine

    out = []
    for k, engine_config in enumerate(config.engine_configs()):
        engine = Engine(engine_config)
        name = config.served_model_name if (k == 0 and config.served_model_name) else engine.checkpoint.name
        out.append(AsyncEngine(engine, name, on_failure))
    for e in out:
        e.start()
    return out


async def _load(state: ServerState, config: ServerConfig) -> None:
    def on_failure(message: str) -> None:  # on an engine thread: one attribute write each
        state.fail(f"the engine failed: {message}")

    try:
        state.engines = await asyncio.to_thread(build_engines, config, on_failure)
    except Exception as e:  # noqa: BLE001 - reported by /health and every 503
        log.exception("loading the model failed")
        state.fail(f"the model failed to load: {type(e).__name__}: {e}")
        return
    for e in state.engines:
        e.events = state.events
    state.phase = "ready" if state.phase == "loading" else state.phase
    log.info("serving %s", ", ".join(f"{e.name} (window {e.max_model_len})" for e in state.engines))


def create_app(config: ServerConfig, engines: list[AsyncEngine] | None = None) -> FastAPI:
    """The FastAPI app. Without `engines`, the model(s) load in the background on startup."""
    state = ServerState(phase="ready" if engines else "loading", engines=list(engines or []))
    tenants = TenantDirectory.load(config.api_keys) if config.api_keys else TenantDirectory.open()
    metrics = ServerMetrics()
    limiter = TokenRateLimiter()
    request_log, sampler, crash = _diagnostics(config, state)
    for e in state.engines:  # engines built by the caller report their failure here too
        e.on_failure = e.on_failure or (lambda message: state.fail(f"the engine failed: {message}"))
        e.events = state.events

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None if engines else asyncio.create_task(_load(state, config))
        if sampler is not None:
            sampler.start()
        yield
        if loader is not None and not loader.done():
            loader.cancel()
        for e in state.engines:
            await asyncio.to_thread(e.stop)
        for part in (sampler, request_log):
            if part is not None:
                part.close()

    app = FastAPI(title="ctxwarden", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over the ctxwarden paged-KV engine.")
    app.state.server, app.state.metrics, app.state.config = state, metrics, config
    app.state.limiter = limiter
    errors.install(app)
    app.add_middleware(RequestContextMiddleware, max_body_bytes=config.max_body_bytes)

    tenant_of, admin_of = _auth_dependencies(tenants)
    app.state.admin_of = admin_of  # for the diagnostics routes
    app.state.sampler = sampler
    _add_info_routes(app, state, metrics, tenant_of)
    add_debug_routes(app, state, admin_of, config.cgroup_root, sampler)
    _add_completion_routes(app, _Serving(state, metrics, limiter, config.on_overflow, request_log, crash),
                           tenant_of)
    return app


def _auth_dependencies(tenants: TenantDirectory):
    """FastAPI dependencies: the caller's tenant (from its API key), and the same for admins."""
    async def tenant_of(authorization: str | None = Header(default=None)) -> Tenant:
        tenant = tenants.resolve(authorization)
        if tenant is None:
            msg = "Missing API key: send 'Authorization: Bearer KEY'." if not authorization else "Unknown API key."
            raise APIError(401, msg, "invalid_request_error", code="invalid_api_key")
        return tenant

    async def admin_of(request: Request, tenant: Tenant = Depends(tenant_of)) -> Tenant:
        """The /debug endpoints: an admin key (role=admin in the key file); without a key
        file, callers on loopback only."""
        if tenants.requires_key and not tenant.is_admin:
            raise APIError(403, "This endpoint needs an admin key (role=admin in the --api-keys file).",
                           "permission_error", code="admin_required")
        if not tenants.requires_key and not _is_loopback(request.client.host if request.client else ""):
            raise APIError(403, "Without --api-keys, /debug answers only on loopback.", "permission_error",
                           code="admin_required")
        return tenant

    return tenant_of, admin_of


def _diagnostics(config: ServerConfig, state: ServerState):
    """The request log, the 1 Hz memory sampler and the crash recorder the config asks for."""
    request_log = RequestLogWriter(config.request_log) if config.request_log else None
    sampler = MemorySampler(lambda: state.engines, config.cgroup_root, config.memory_sample_interval_s,
                            completed_of=lambda: state.num_completed_requests,
                            warmup_requests=config.leak_warmup_requests) if config.memory_sample_interval_s else None
    crash = CrashRecorder(config.crash_dir, state, sampler, config.cgroup_root, config.crash_window_s,
                          config.debug_dump_prompts) if config.crash_dir else None
    state.on_fail = crash.on_engine_failure if crash else None
    return request_log, sampler, crash


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
        return ModelList(data=[_model_card(e) for e in state.engines])

    @app.get("/metrics", response_class=Response)
    async def prometheus(accept: str | None = Header(default=None)) -> Response:
        """Prometheus text, from the snapshot each engine publishes (never waits on a step);
        OpenMetrics (with exemplars: request and trace ids on the latency histograms) when
        the scraper's Accept header asks for application/openmetrics-text."""
        snapshots = {e.name: e.stats for e in state.engines}
        sampler = app.state.sampler
        body, media_type = metrics.render_negotiated(snapshots, accept, {e.name: e.memory for e in state.engines},
                                                     sampler.latest() if sampler is not None else None,
                                                     {e.name: e.attention for e in state.engines},
                                                     sampler.slope if sampler is not None else None)
        return Response(body, media_type=media_type)


def _model_card(e: AsyncEngine) -> ModelCard:
    """One served model: its admitted length and, in ctxwarden's fields, what it attends to."""
    c = e.engine.config
    streaming = c.is_unbounded_length
    return ModelCard(id=e.name, context_window=e.max_model_len, context_mode="streaming" if streaming else "full",
                     model_window=e.engine.window.window_tokens,
                     attention_window=c.sink_tokens + c.window_tokens if streaming else None,
                     rope_scaling=c.rope_scaling)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in ("localhost", "testclient")


def _add_completion_routes(app: FastAPI, serving: "_Serving", tenant_of) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request, tenant: Tenant = Depends(tenant_of)):
        """Text completion (legacy API), streamed or not."""
        return await serving.serve(_completion_job(body), body, tenant, "cmpl", request.receive)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: Tenant = Depends(tenant_of)):
        """Chat completion, streamed or not."""
        return await serving.serve(_chat_job(body), body, tenant, "chatcmpl", request.receive)


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


@dataclass
class _Serving:
    """What every completion request needs: readiness, metrics, the tokens-per-minute books."""

    state: ServerState
    metrics: ServerMetrics
    limiter: TokenRateLimiter
    default_overflow: str = "error"  # ServerConfig.on_overflow
    request_log: RequestLogWriter | None = None
    crash: CrashRecorder | None = None

    async def serve(self, job: Job, body, tenant: Tenant, prefix: str, receive):
        """Admit, submit and answer one completion request (JSON or a stream)."""
        tags = RequestTags(request_id_var.get(), tenant.name, trace_id_var.get())
        self.state.events.record_tags("arrival", tags, body.model, {"stream": bool(body.stream), "n": job.n})
        try:
            self.state.check_ready()
            self.state.in_flight += 1
        except APIError as e:
            self._refused(tags, e.status, e)
            raise
        try:
            api_id = f"{prefix}-{uuid.uuid4().hex}"
            gen, overflow = await self._start(job, body, tenant, api_id, tags)
        except BaseException as e:
            self.state.in_flight -= 1
            self._refused(tags, e.status if isinstance(e, APIError) else 499, e)
            raise
        log.info("%s: %d choice(s) on %s, tenant %s, %d prompt tokens", api_id, len(gen.choices),
                 gen.engine.name, tenant.name, gen.max_prompt_tokens)
        call = Call(self.metrics, gen, api_id, int(time.time()), job, body,
                    on_settle=lambda c: self._settled(c, tenant), overflow=overflow, tags=tags)
        if body.stream:
            return EventStreamResponse(call.events(), media_type="text/event-stream", headers=call.headers(),
                                       on_close=call.settle)
        return await call.collect(receive)

    def _refused(self, tags: RequestTags, status: int, error: BaseException) -> None:
        self.metrics.count_request(status)
        kind = "abort" if status == 499 else "refuse"
        self.state.events.record_tags(kind, tags, None, {"status": status, "code": getattr(error, "code", None),
                                                         "message": str(getattr(error, "message", error))[:300]})

    async def _start(self, job: Job, body, tenant: Tenant, api_id: str,
                     tags: RequestTags) -> tuple[Generation, OverflowReport]:
        """Submit on the requested model; a prompt over its window gets the request's overflow
        policy (fallback: the next model; truncate / semantic: fitted, then submitted again).
        Then book its tokens against the tenant's tokens per minute."""
        policy = (body.ctxwarden.on_overflow if body.ctxwarden else None) or self.default_overflow
        candidates = self.state.route(body.model)
        for k, engine in enumerate(candidates):
            try:
                gen = await self._submit(engine, job, api_id, tenant, tags)
                report = OverflowReport(policy, fell_back_from=candidates[k - 1].name if k else None)
                return self._book(gen, tenant, job), report
            except ContextLengthExceeded as e:
                if policy == "fallback" and k < len(candidates) - 1:
                    log.info("prompt over %s's window (%d tokens); trying %s", engine.name, e.max_model_len,
                             candidates[k + 1].name)
                    continue
                if policy in FITTING_POLICIES:
                    return await self._fit_and_start(engine, job, policy, api_id, tenant, tags)
                raise errors.overflow_error(e, job.prompt_param, policy, has_fallback=len(self.state.engines) > 1) from e
        raise AssertionError("route() returns at least one engine")

    async def _submit(self, engine: AsyncEngine, job: Job, api_id: str, tenant: Tenant,
                      tags: RequestTags) -> Generation:
        try:
            return await submit(engine, job, api_id, tenant.namespace, tenant.share, tags)
        except (ContextLengthExceeded, APIError):
            raise
        except Exception as e:  # noqa: BLE001 - every refusal becomes its API error
            raise errors.from_engine_error(e, job.prompt_param) from e

    async def _fit_and_start(self, engine: AsyncEngine, job: Job, policy: str, api_id: str, tenant: Tenant,
                             tags: RequestTags):
        """Fit the prompts to `engine`'s window (context toolkit, off the event loop), submit."""
        try:
            fitted, report = await asyncio.to_thread(fit_job, job, engine, policy)
            gen = await self._submit(engine, fitted, api_id, tenant, tags)
        except ContextLengthExceeded as e:  # the parts the policy keeps are already too long
            raise errors.from_engine_error(e, job.prompt_param) from e
        except ValueError as e:
            raise APIError(400, f"on_overflow {policy!r} cannot fit this prompt: {e}", param=job.prompt_param,
                           code="context_length_exceeded") from e
        log.info("%s: %s dropped %d prompt tokens on %s", api_id, policy, report.dropped_tokens, engine.name)
        return self._book(gen, tenant, fitted), report

    def _book(self, gen: Generation, tenant: Tenant, job: Job) -> Generation:
        try:
            self.limiter.reserve(tenant, gen.num_booked_tokens)
        except TenantLimitExceeded as e:
            gen.abort_unfinished()  # submitted a moment ago: nothing of it has run yet
            raise errors.from_engine_error(e, job.prompt_param) from e
        return gen

    def _settled(self, call: Call, tenant: Tenant) -> None:
        self.limiter.refund(tenant, call.gen.num_booked_tokens - call.gen.num_used_tokens)
        self.state.in_flight -= 1
        self.state.num_completed_requests += 1
        if self.request_log is not None:
            self.request_log.write(record_of(call.gen, call.tags.request_id, tenant.name, call.status))
        if self.crash is not None and call.status >= 500:
            self.crash.on_5xx(call)
