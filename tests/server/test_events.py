"""Event ring, ids and the request log on a live server.

One request's events come in order with its x-request-id, tenant and W3C trace id; a refusal
is an event with its status; the latency histograms carry the request id as an exemplar in
OpenMetrics; the server's request log is read by `diag lengths` / `slo-risk` as it is.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ctxwarden.diagnostics.request_log import read_lengths, read_request_log
from ctxwarden.server.app import ServerConfig
from ctxwarden.server.events import EventRing
from key_files import admin_and_alpha_keys

ADMIN = {"Authorization": "Bearer key-admin"}
ALPHA = {"Authorization": "Bearer key-alpha"}
TRACE = "0af7651916cd43dd8448eb211c80319c"


@pytest.fixture(scope="module")
def logged_server(serve, tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("events")
    keys = admin_and_alpha_keys(root)
    log = root / "requests.jsonl"
    with serve(ServerConfig.build(model=str(tiny_dir), kv_memory="8MiB", api_keys=str(keys),
                                  request_log=str(log))) as s:
        s.request_log = log
        yield s


def _complete(server, prompt, max_tokens, request_id, headers=None):
    return httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.engines[0].name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True}, headers={**ALPHA, "x-request-id": request_id, **(headers or {})})


def _events(server, **params):
    r = httpx.get(server.url + "/debug/events", headers=ADMIN, params=params, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["events"]


def test_one_requests_events_in_order_with_its_ids(logged_server):
    r = _complete(logged_server, list(range(1, 40)), 4, "evt-1", {"traceparent": f"00-{TRACE}-b7ad6b7169203331-01"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "evt-1"
    events = _events(logged_server, request_id="evt-1")
    assert [e["kind"] for e in events] == ["arrival", "admit", "schedule", "finish"]
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    assert {(e["tenant"], e["trace_id"]) for e in events} == {("alpha", TRACE)}
    assert events[1]["detail"]["prompt_tokens"] == 39
    assert events[-1]["detail"] == {"engine_request_id": events[1]["detail"]["engine_request_id"],
                                    "reason": "length", "prompt_tokens": 39, "completion_tokens": 4}


def test_a_malformed_traceparent_is_ignored_and_a_refusal_is_an_event(logged_server):
    r = _complete(logged_server, list(range(1, 10)), 10**6, "evt-refused", {"traceparent": f"00-{TRACE}-0000000000000000-01"})
    assert r.status_code == 400
    (arrival, refuse) = _events(logged_server, request_id="evt-refused")
    assert (arrival["kind"], refuse["kind"], refuse["detail"]["status"]) == ("arrival", "refuse", 400)
    assert refuse["detail"]["code"] == "context_length_exceeded" and refuse["trace_id"] is None


def test_latency_histograms_carry_request_ids_as_exemplars(logged_server):
    assert _complete(logged_server, list(range(1, 20)), 3, "evt-exemplar").status_code == 200
    r = httpx.get(logged_server.url + "/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=10)
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    lines = [ln for ln in r.text.splitlines() if ln.startswith("ctxwarden_time_to_first_token_seconds_bucket")]
    assert any('# {request_id="evt-exemplar"}' in ln for ln in lines), lines
    plain = httpx.get(logged_server.url + "/metrics", timeout=10)
    assert plain.headers["content-type"].startswith("text/plain") and "# {" not in plain.text


def test_the_request_log_feeds_diag_lengths_and_slo_risk(logged_server, capsys):
    from ctxwarden.cli import main

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: _complete(logged_server, [1 + (i * 13 + j) % 500 for j in range(5 + 3 * i)],
                                                    3, f"log-{i}"), range(20)))
    assert [r.status_code for r in replies] == [200] * 20
    records = {r.request_id: r for r in read_request_log(logged_server.request_log)}
    for i in range(20):
        rec = records[f"log-{i}"]
        assert (rec.tenant, rec.prompt_tokens, rec.completion_tokens, rec.status) == ("alpha", 5 + 3 * i, 3, "ok")
        assert 0 < rec.ttft_s < 60 and rec.tpot_s > 0
    text = logged_server.request_log.read_text()
    assert set(json.loads(text.splitlines()[0])) == {"time", "request_id", "tenant", "prompt_tokens",
                                                      "completion_tokens", "cached_tokens", "ttft_s", "tpot_s", "status"}
    assert sorted(read_lengths(logged_server.request_log)) == sorted(r.prompt_tokens for r in records.values())
    assert main(["diag", "slo-risk", str(logged_server.request_log), "--ttft", "30s", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["measured"]
    assert (measured["num_requests"], measured["num_violations"]) == (len(records), 0)


def test_the_ring_is_bounded_and_filters():
    ring = EventRing(capacity=3, clock=iter(range(100)).__next__)
    for i in range(5):
        ring.record("arrival", f"r{i}")
    assert [e["request_id"] for e in ring.events()] == ["r2", "r3", "r4"]
    assert [e["request_id"] for e in ring.events(since=3)] == ["r3", "r4"]
    assert ring.events(request_id="r0") == [] and len(ring) == 3
    with pytest.raises(ValueError, match="capacity >= 1"):
        EventRing(0)
