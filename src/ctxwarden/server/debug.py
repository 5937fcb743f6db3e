"""The /debug endpoints (admin key; loopback only without a key file): engines, events, memory.

`/debug/memory` answers the snapshot JSON of `ctxwarden diag mem snapshot --json`
(docs/diagnostics.md): this process and its cgroup, read now (off the event loop), and each
engine's KV pool and owners as its engine thread last published them (never computed here:
a step may be running). Owner ages are brought forward to the time of the answer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, replace

from fastapi import Depends, FastAPI

from ctxwarden.diagnostics.cgroup import lookup_cgroup
from ctxwarden.diagnostics.process_memory import read_process_memory
from ctxwarden.diagnostics.snapshot import MemorySnapshot
from ctxwarden.server.attention import MAX_RESULTS
from ctxwarden.server.errors import APIError
from ctxwarden.server.protocol import ErrorResponse


def add_debug_routes(app: FastAPI, state, admin_of, cgroup_root: str, sampler=None) -> None:
    """GET /debug/engines, /debug/events, /debug/attention/{request_id} and /debug/memory."""
    @app.get("/debug/engines", responses={403: {"model": ErrorResponse}})
    async def debug_engines(tenant=Depends(admin_of)) -> dict:
        """Every engine's latest published stats, whole (admin only)."""
        return {"phase": state.phase, "failure": state.failure,
                "engines": {e.name: {"failure": e.failure, "stats": asdict(e.stats)} for e in state.engines}}

    @app.get("/debug/events", responses={403: {"model": ErrorResponse}})
    async def debug_events(since_s: float | None = None, request_id: str | None = None,
                           tenant=Depends(admin_of)) -> dict:
        """The event ring and the memory samples (oldest first): the last `since_s` seconds;
        one request's events only with `request_id` (admin only)."""
        now = time.time()
        since = None if since_s is None else now - since_s
        events = await asyncio.to_thread(state.events.events, since, request_id)
        samples = sampler.samples(since) if sampler is not None else []
        return {"time": now, "capacity": state.events.capacity, "events": events,
                "sample_interval_s": sampler.interval_s if sampler is not None else None, "samples": samples}

    @app.get("/debug/attention/{request_id}", responses={403: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
    async def debug_attention(request_id: str, tenant=Depends(admin_of)) -> dict:
        """A sampled request's attention: per layer and head entropy and sink mass, the sink
        rate, collapse alerts (admin only)."""
        for e in state.engines:
            found = e.attention.get(request_id)
            if found:
                return {"request_id": request_id, "choices": found}
        rates = {e.name: getattr(e.engine.config, "attention_sample_rate", 0.0) for e in state.engines}
        raise APIError(404, f"No attention record for request {request_id!r}: only sampled requests have one "
                       f"(--attention-sample-rate: {rates}), and only the last {MAX_RESULTS} are kept.",
                       param="request_id", code="not_found")

    @app.get("/debug/memory", responses={403: {"model": ErrorResponse}})
    async def debug_memory(tenant=Depends(admin_of)) -> dict:
        """Process, cgroup, KV pool and KV owners (admin only)."""
        slope = sampler.slope if sampler is not None else None
        return await asyncio.to_thread(server_snapshot, state.engines, cgroup_root, slope)


def server_snapshot(engines, cgroup_root: str, slope=None) -> dict:
    """The server's memory snapshot as JSON: `kv` is the primary model's pool, `owners`
    every model's, `engines` each model's pool by name, `leak_slope` the sampler's last
    slow-leak fit (diagnostics.leaks.RequestSlope; null before one)."""
    process = read_process_memory()
    found = lookup_cgroup(process.pid, cgroup_root)
    now = time.time()
    views = [(e.name, e.memory) for e in engines]
    owners = tuple(replace(o, age_s=o.age_s + max(0.0, now - v.time)) for _, v in views for o in v.owners)
    notes = [found.reason] if found.reason else []
    if not views:
        notes.append("kv and owners: no engine is loaded yet")
    snap = MemorySnapshot(now, process, found.memory, views[0][1].kv if views else None, owners, tuple(notes))
    out = snap.to_dict()
    out["engines"] = {name: {"published": v.time, "kv": v.kv.to_dict(), "p99_latency_s": e.book.p99_latency_s}
                      for (name, v), e in zip(views, engines)}
    out["leak_slope"] = slope.to_dict() if slope is not None else None
    return out
