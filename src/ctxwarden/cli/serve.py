"""`ctxwarden serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

SIGTERM (or Ctrl+C) drains: new requests get 503 + Retry-After, running ones finish (up
to --drain-timeout), then the server exits 0. A second signal exits at once. If an engine
dies, every request gets a 503 at once, /health turns 503, and the server exits 1 as soon
as nothing is in flight, so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import time

HELP = "Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /metrics)."

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s trace=%(trace_id)s] %(message)s"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ctxwarden.cli._engine_args import add_engine_arguments
    from ctxwarden.engine.config import SERVER_MAX_QUEUE_DELAY_S, SERVER_MAX_WAITING
    from ctxwarden.server.overflow import OVERFLOW_POLICIES

    p.add_argument("--fallback-model", default=None,
                   help="a larger-window model that serves prompts over --model's window (same engine options)")
    p.add_argument("--on-overflow", default=None, choices=OVERFLOW_POLICIES,
                   help="what a prompt over the window gets unless the request says (ctxwarden.on_overflow): "
                        "error (400), truncate-head, truncate-middle, keep-tail-semantic, fallback "
                        "(default: fallback with --fallback-model, else error)")
    p.add_argument("--served-model-name", default=None, help="the primary model's id in the API")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="file of 'API_KEY TENANT_NAME' lines (# comments); without it, no auth, one tenant")
    p.add_argument("--allow-anonymous", action="store_true",
                   help="allow a non-loopback --host without --api-keys")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="413 past this request size")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to let requests finish on SIGTERM")
    p.add_argument("--request-log", default=None, metavar="FILE",
                   help="append one JSONL line per finished request (ids, tenant, token counts, TTFT, TPOT, "
                   "status; never text) for `ctxwarden diag lengths|slo-risk`")
    p.add_argument("--crash-dir", default=None, metavar="DIR",
                   help="on the first 5xx or engine failure write a crash bundle here (events, memory, the "
                   "failing request's metadata; no prompt text)")
    p.add_argument("--debug-dump-prompts", action="store_true",
                   help="--crash-dir: include the failing request's prompts (they may hold user data)")
    p.add_argument("--leak-warmup-requests", type=int, default=100, metavar="N",
                   help="the slow-leak slope on /metrics skips the first N completed requests (caches filling)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_arguments(p, max_waiting=SERVER_MAX_WAITING, max_queue_delay_s=SERVER_MAX_QUEUE_DELAY_S)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ctxwarden.cli._engine_args import engine_config_from_args
    from ctxwarden.server.app import RequestIdLogFilter, ServerConfig, create_app

    _check_exposure(args)
    config = ServerConfig(engine=engine_config_from_args(args), fallback_model=args.fallback_model,
                          on_overflow=args.on_overflow, served_model_name=args.served_model_name,
                          api_keys=args.api_keys, max_body_bytes=args.max_body_bytes,
                          drain_timeout_s=args.drain_timeout, request_log=args.request_log,
                          crash_dir=args.crash_dir, debug_dump_prompts=args.debug_dump_prompts,
                          leak_warmup_requests=args.leak_warmup_requests)
    _configure_logging(args.log_level, RequestIdLogFilter())
    app = create_app(config)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                                           log_level=args.log_level, timeout_graceful_shutdown=5))
    server.state, server.drain_timeout_s = app.state.server, args.drain_timeout
    server.run()
    if server.state.phase == "failed":
        logging.getLogger("ctxwarden.server").critical("exiting with status 1: %s", server.state.failure)
        return 1
    return 0


def _check_exposure(args: argparse.Namespace) -> None:
    """Refuse to serve everyone without keys unless asked to explicitly."""
    try:
        is_loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        is_loopback = args.host == "localhost"
    if not is_loopback and not args.api_keys and not args.allow_anonymous:
        raise ValueError(f"--host {args.host} is reachable from other machines but no --api-keys file is "
                         "given; add --api-keys FILE, or --allow-anonymous to serve without keys")


def _configure_logging(level: str, request_filter: logging.Filter) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    handler.addFilter(request_filter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _server_class():
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """uvicorn, but the first SIGTERM/SIGINT drains before exiting."""

        state = None
        drain_timeout_s = 60.0
        _drain_deadline: float | None = None

        def handle_exit(self, sig, frame) -> None:
            if self._drain_deadline is None and self.state is not None:
                logging.getLogger("ctxwarden.server").info(
                    "signal %d: draining %d request(s), refusing new ones", sig, self.state.in_flight)
                self.state.begin_drain()
                self._drain_deadline = time.monotonic() + self.drain_timeout_s
                return  # not recorded as captured: a finished drain exits 0
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.state is not None and self.state.phase == "failed" and self.state.engines \
                    and self.state.in_flight == 0:
                self.should_exit = True  # a dead engine: every request has had its 503
            if self._drain_deadline is not None and not self.should_exit:
                if self.state.in_flight == 0 or time.monotonic() > self._drain_deadline:
                    self.should_exit = True
            return await super().on_tick(counter)

    return _DrainingServer


def DrainingServer(config):  # noqa: N802 - reads as the class it builds
    """A uvicorn.Server that drains on the first SIGTERM (class built lazily: uvicorn imports late)."""
    return _server_class()(config)
