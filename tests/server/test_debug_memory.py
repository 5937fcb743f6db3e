"""/debug/memory on a live server: KV owners with risk by age, a planted leak, clean traffic.

The leak is planted the way real ones happen: the KV manager's `free` skips one request's
sequence (a release path that forgot it), and the test keeps a 64 MiB tensor alive in the
server's process. The snapshot must name the request (id, tenant, blocks, age) and show the
64 MiB; 200 clean requests must leave no owner at risk.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from ctxwarden.diagnostics.doctor import server_findings
from ctxwarden.diagnostics.memdiff import diff_snapshots
from ctxwarden.server.app import ServerConfig

ADMIN = {"Authorization": "Bearer key-admin"}
ALPHA = {"Authorization": "Bearer key-alpha"}
MiB = 2**20


@pytest.fixture(scope="module")
def debug_server(serve, tiny_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("debug-keys") / "keys.txt"
    keys.write_text("key-admin ops role=admin\nkey-alpha alpha\n")
    keys.chmod(0o600)
    with serve(ServerConfig.build(model=str(tiny_dir), kv_memory="8MiB", api_keys=str(keys))) as s:
        yield s


def _snapshot(server) -> dict:
    r = httpx.get(server.url + "/debug/memory", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _complete(server, prompt, max_tokens: int, request_id: str | None = None, headers=None) -> httpx.Response:
    h = {**ALPHA, **(headers or {}), **({"x-request-id": request_id} if request_id else {})}
    return httpx.post(server.url + "/v1/completions", headers=h, timeout=60, json={
        "model": server.engines[0].name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def _wait_owner(server, predicate, timeout_s: float = 10.0) -> tuple[dict, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        snap = _snapshot(server)
        found = [o for o in snap["owners"] if predicate(o)]
        if found or time.monotonic() > deadline:
            return snap, (found[0] if found else None)
        time.sleep(0.1)


def test_debug_memory_needs_an_admin_key(debug_server):
    r = httpx.get(debug_server.url + "/debug/memory", headers=ALPHA, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    assert httpx.get(debug_server.url + "/debug/memory", timeout=10).status_code == 401


def test_clean_requests_leave_no_owner_at_risk(debug_server):
    async def clients() -> list[int]:
        limit = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=debug_server.url, headers=ALPHA, timeout=60) as client:
            async def one(i: int) -> int:
                async with limit:
                    r = await client.post("/v1/completions", json={
                        # 16 tokens, not 4: in one full-suite run on an AVX2 EPYC the watcher
                        # saw no owner at all (alone it always did; the cause was not found)
                        "model": debug_server.engines[0].name, "max_tokens": 16, "ignore_eos": True,
                        "temperature": 0,
                        "prompt": [1 + (i * 7 + j) % 500 for j in range(8 + i % 40)]})
                    return r.status_code

            async def watch(task) -> set:
                seen = set()
                while not task.done():
                    r = await client.get("/debug/memory", headers=ADMIN)
                    seen |= {o["risk"] for o in r.json()["owners"]}
                    await asyncio.sleep(0.02)  # often enough to see owners of 200 short requests
                return seen

            work = asyncio.ensure_future(asyncio.gather(*[one(i) for i in range(200)]))
            statuses, seen = await asyncio.gather(work, watch(work))
            return statuses, seen

    statuses, worst = asyncio.run(clients())
    assert statuses == [200] * 200
    assert worst == {"OK"}, worst  # live owners were seen while the requests ran, none at risk
    deadline = time.monotonic() + 5
    while (snap := _snapshot(debug_server))["owners"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the last request's blocks go with the engine's next publication
    assert snap["owners"] == []
    assert snap["kv"]["num_blocks_in_use"] == 0 and snap["kv"]["num_blocks_total"] > 0
    assert set(snap) >= {"time", "process", "cgroup", "kv", "owners"}
    assert [f.severity for f in server_findings(snap) if f.severity in ("critical", "high")] == []


def test_planted_leak_is_named_with_request_tenant_and_age(debug_server):
    import torch

    engine = debug_server.engines[0]

    def plant(e):
        real_free = e.scheduler.kv.free

        def free(seq_id, num_computed_tokens=None):
            tags = engine.book.tags_of(seq_id)
            if tags is None or tags.request_id != "leaky-1":  # the one release path that "forgets"
                real_free(seq_id, num_computed_tokens)
        e.scheduler.kv.free = free
        return real_free

    before = _snapshot(debug_server)
    real_free = debug_server.engine_call(plant)
    kept = torch.ones(16 * MiB)  # 64 MiB held by the server's process (the test hook's tensor)
    try:
        trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        r = _complete(debug_server, list(range(1, 126)), 2, "leaky-1", {"traceparent": trace})
        finished_at = time.monotonic()
        assert r.status_code == 200, r.text
        after, owner = _wait_owner(debug_server, lambda o: o["request_id"] == "leaky-1" and o["risk"] == "HIGH")
        waited_s = time.monotonic() - finished_at
        assert owner is not None, after["owners"]
        assert (owner["tenant"], owner["state"], owner["blocks"]) == ("alpha", "finished", 8)
        assert owner["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert abs(owner["age_s"] - waited_s) < 1.0, (owner["age_s"], waited_s)
        diff = diff_snapshots(before, after)
        grown = {c.key: c.delta for c in diff.changes}
        assert grown["process.leak_basis_bytes"] >= 60 * MiB, grown
        assert grown["kv.num_blocks_in_use"] == 8
        assert "leaky-1" in [o["request_id"] for o in diff.owners_new]
        assert debug_server.metric("ctxwarden_kv_owner_blocks", risk="HIGH") == 8
        assert debug_server.metric("ctxwarden_process_leak_basis_bytes") >= before["process"]["leak_basis_bytes"] \
            + 60 * MiB  # the 1 Hz sample behind the gauge: wait for one
        high = [f for f in server_findings(after) if f.severity == "high"]
        assert len(high) == 1 and "leaky-1 (tenant alpha, 8 blocks" in high[0].evidence
    finally:
        del kept

        def undo(e):
            e.scheduler.kv.free = real_free
            for seq in e.scheduler.kv.sequences():
                if engine.book.tags_of(seq.seq_id) is not None:
                    real_free(seq.seq_id)
        debug_server.engine_call(undo)


def test_diag_mem_snapshot_reads_a_server(debug_server, capsys):
    from ctxwarden.cli import main

    assert main(["diag", "mem", "snapshot", "--url", debug_server.url, "--api-key", "key-admin", "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["kv"]["num_blocks_total"] == debug_server.engines[0].engine.num_blocks
    assert main(["diag", "mem", "snapshot", "--url", debug_server.url, "--api-key", "key-alpha"]) == 2
    assert "answered 403: This endpoint needs an admin key" in capsys.readouterr().err
