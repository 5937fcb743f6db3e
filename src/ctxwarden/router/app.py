"""The router's HTTP app: pick a replica by prefix and load, proxy, keep replicas' health.

    POST /v1/completions, /v1/chat/completions
        -> prefix key of the body (tenant-salted) -> replicas in rendezvous order, bounded by load
        -> forward (streamed as it arrives); a replica that cannot be reached is marked down
           and the next one is tried (only before any byte of a response went out)
    GET /v1/models  -> any healthy replica       GET /health -> 200 while one replica is healthy
    GET /metrics    -> requests per replica and status, health, in-flight, failovers

Health: every `health_interval_s` each replica's /health is asked (timeout half the
interval). A refused connection (the replica is dead or restarting) or a non-200 answer
takes it out of routing at once, so it stops getting traffic within one interval (at once,
if a request finds it unreachable first); a check that merely times out counts only when
the next one times out too (a busy replica answers slowly, it is not down).
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.background import BackgroundTask

from ctxwarden.router.affinity import AffinityConfig, choose, prefix_key, prompt_bytes, tenant_salt

log = logging.getLogger("ctxwarden.router")
_FORWARD_REQUEST = ("authorization", "content-type", "accept", "x-request-id")
_FORWARD_RESPONSE = ("content-type", "x-request-id", "retry-after", "x-context-window", "x-context-used",
                     "x-context-remaining", "x-ctxwarden-served-by")


@dataclass(frozen=True)
class RouterConfig:
    """The replicas (base URLs), how often their health is checked, the affinity rule."""

    replicas: tuple[str, ...]
    health_interval_s: float = 2.0
    request_timeout_s: float = 600.0
    affinity: AffinityConfig = field(default_factory=AffinityConfig)

    def __post_init__(self):
        if not self.replicas:
            raise ValueError("the router needs at least one --replica URL (e.g. http://127.0.0.1:8001)")
        bad = [r for r in self.replicas if not r.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"replica URLs must start with http:// or https://, got {', '.join(bad)}")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError("each --replica may be given once")
        if self.health_interval_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError(f"health_interval_s and request_timeout_s must be > 0, got "
                             f"{self.health_interval_s}, {self.request_timeout_s}")
        object.__setattr__(self, "replicas", tuple(r.rstrip("/") for r in self.replicas))


class Replicas:
    """Health and in-flight counts of every replica, and the router's metrics."""

    def __init__(self, urls: tuple[str, ...]):
        self.urls = urls
        self.healthy = {u: False for u in urls}  # until the first check answers
        self.slow_checks = {u: 0 for u in urls}  # health checks in a row that timed out
        self.in_flight = {u: 0 for u in urls}
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("ctxwarden_router_requests", "Requests proxied, by replica and status.",
                                ["replica", "status"], registry=self.registry)
        self.failovers = Counter("ctxwarden_router_failovers", "Requests moved to another replica "
                                 "because theirs could not be reached.", registry=self.registry)
        self.health_gauge = Gauge("ctxwarden_router_replica_healthy", "1 while a replica's last health "
                                  "check answered 200.", ["replica"], registry=self.registry)
        self.flight_gauge = Gauge("ctxwarden_router_in_flight", "Requests in flight per replica.",
                                  ["replica"], registry=self.registry)

    def healthy_in_flight(self) -> dict[str, int]:
        """In-flight counts of the healthy replicas only (the candidates)."""
        return {u: self.in_flight[u] for u in self.urls if self.healthy[u]}

    def mark(self, url: str, is_healthy: bool) -> None:
        """Record a replica's health (a check's answer, or a request that could not reach it)."""
        if self.healthy[url] != is_healthy:
            log.log(logging.INFO if is_healthy else logging.WARNING, "replica %s is %s", url,
                    "healthy" if is_healthy else "DOWN: no traffic until it answers")
        self.healthy[url] = is_healthy
        self.health_gauge.labels(replica=url).set(int(is_healthy))

    def begin(self, url: str) -> None:
        """A request was sent to `url`."""
        self.in_flight[url] += 1
        self.flight_gauge.labels(replica=url).set(self.in_flight[url])

    def end(self, url: str, status: int) -> None:
        """A request to `url` ended with `status` (its response fully relayed, or failed)."""
        self.in_flight[url] -= 1
        self.flight_gauge.labels(replica=url).set(self.in_flight[url])
        self.requests.labels(replica=url, status=str(status)).inc()


async def check_all(client: httpx.AsyncClient, replicas: Replicas, timeout_s: float) -> None:
    """Ask every replica's /health once, concurrently."""
    async def one(url: str) -> None:
        try:
            ok = (await client.get(url + "/health", timeout=timeout_s)).status_code == 200
        except httpx.TimeoutException:
            replicas.slow_checks[url] += 1
            if replicas.slow_checks[url] >= 2:
                replicas.mark(url, False)
            return
        except httpx.HTTPError:
            ok = False
        replicas.slow_checks[url] = 0
        replicas.mark(url, ok)
    await asyncio.gather(*(one(u) for u in replicas.urls))


async def _health_loop(client: httpx.AsyncClient, replicas: Replicas, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await check_all(client, replicas, interval_s / 2)


def _error(status: int, message: str, code: str) -> JSONResponse:
    headers = {"retry-after": "1"} if status == 503 else {}
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status, headers=headers)


def create_router(config: RouterConfig) -> FastAPI:
    """The router app; health checks start with it (one round before the first request)."""
    replicas = Replicas(config.replicas)
    client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s, connect=2.0))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await check_all(client, replicas, config.health_interval_s / 2)
        task = asyncio.create_task(_health_loop(client, replicas, config.health_interval_s))
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="ctxwarden router", lifespan=lifespan)
    app.state.replicas = replicas

    @app.get("/health")
    async def health():
        """200 while at least one replica is healthy."""
        status = 200 if any(replicas.healthy.values()) else 503
        return JSONResponse({"status": "ok" if status == 200 else "unavailable", "replicas": replicas.healthy},
                            status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text of the router's own numbers."""
        return Response(generate_latest(replicas.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        """The model list of the first healthy replica."""
        return await _proxy(client, replicas, config, request, "/v1/models", b"", {})

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, _completion_route(client, replicas, config, path), methods=["POST"])
    return app


def _completion_route(client, replicas: Replicas, config: RouterConfig, path: str):
    async def route(request: Request):
        body = await request.body()
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            data = {}
        return await _proxy(client, replicas, config, request, path, body, data if isinstance(data, dict) else {})
    route.__name__ = "proxy_" + path.strip("/").replace("/", "_")
    return route


async def _proxy(client, replicas: Replicas, config: RouterConfig, request: Request, path: str,
                 body: bytes, data: dict):
    """Send the request to the chosen replica; fail over while no response has begun."""
    auth = request.headers.get("authorization")
    key = prefix_key(prompt_bytes(data), tenant_salt(auth), config.affinity)
    headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_REQUEST}
    for k, url in enumerate(choose(key, replicas.healthy_in_flight(), config.affinity)):
        method = "POST" if body else "GET"
        upstream = client.build_request(method, url + path, content=body or None, headers=headers)
        replicas.begin(url)
        try:
            response = await client.send(upstream, stream=True)
        except httpx.TransportError as e:
            replicas.end(url, 502)
            replicas.mark(url, False)
            replicas.failovers.inc()
            log.warning("replica %s unreachable (%s); trying the next", url, type(e).__name__)
            continue
        return _relay(response, replicas, url)
    return _error(503, "No healthy replica can serve this request now; retry shortly.", "no_replica")


def _relay(response: httpx.Response, replicas: Replicas, url: str) -> StreamingResponse:
    """Stream the replica's response through as its bytes arrive."""
    headers = {k: v for k, v in response.headers.items() if k.lower() in _FORWARD_RESPONSE}
    headers["x-ctxwarden-replica"] = url

    async def body():
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            log.warning("replica %s broke off a response", url)

    async def done() -> None:
        await response.aclose()
        replicas.end(url, response.status_code)

    return StreamingResponse(body(), status_code=response.status_code, headers=headers,
                             background=BackgroundTask(done))
