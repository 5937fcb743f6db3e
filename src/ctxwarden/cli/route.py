"""`ctxwarden route`: an OpenAI-compatible front that sends each request to the replica most
likely to hold its prefix (bounded by load), with health checks. See docs/kv-tiers.md."""

from __future__ import annotations

import argparse

HELP = "Route requests across `ctxwarden serve` replicas by prompt prefix (bounded by load)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for each)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--health-interval", type=float, default=2.0, metavar="S",
                   help="seconds between health checks; a dead replica is dropped within one")
    p.add_argument("--load-factor", type=float, default=1.25,
                   help="a replica takes at most this times the mean in-flight load (>= 1)")
    p.add_argument("--affinity-bytes", type=int, default=1024, metavar="N",
                   help="leading prompt bytes that pick the replica (in blocks of 256)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ctxwarden.router.affinity import AffinityConfig
    from ctxwarden.router.app import RouterConfig, create_router

    affinity = AffinityConfig(num_blocks=max(1, args.affinity_bytes // 256), load_factor=args.load_factor)
    config = RouterConfig(tuple(args.replica), health_interval_s=args.health_interval, affinity=affinity)
    uvicorn.run(create_router(config), host=args.host, port=args.port, log_level=args.log_level)
    return 0
