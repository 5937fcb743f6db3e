"""Real `serve` apps sharing one real Redis: warm replicas, tenant isolation, Redis faults.

Replicas run in threads of this process (each its own engine, pool and tier client), over
HTTP on loopback; Redis is a real redis-server that the fault tests SIGKILL and SIGSTOP.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import ServerThread

from ctxwarden.server.app import ServerConfig, create_app

PROMPT_TOKENS = 600
HIT_TOKENS = 592
KEYS = {"key-alpha": "alpha", "key-beta": "beta"}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("".join(f"{k} {t}\n" for k, t in KEYS.items()))
    return path


@pytest.fixture
def replicas(tiny_dir, key_file, redis_server):
    """`replicas(n)`: n fresh replicas on the test's Redis (stopped at the end)."""
    started = []

    def make(n: int = 1) -> list[ServerThread]:
        tiers = f"{redis_server.url}?object_bytes=32KiB&timeout_ms=200&probe_interval_ms=100"
        config = ServerConfig.build(model=str(tiny_dir), kv_memory="8MiB", api_keys=str(key_file),
                                    kv_tiers=tiers, kv_tier_fetch="always", max_batched_tokens=HIT_TOKENS)
        new = [ServerThread(lambda: create_app(config)).start() for _ in range(n)]
        started.extend(new)
        return new
    yield make
    for s in started:
        s.stop()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)]


def _complete(server: ServerThread, seed: int, key: str = "key-alpha", max_tokens: int = 8) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                   json={"model": server.app.state.server.engines[0].name, "prompt": _prompt(seed),
                         "max_tokens": max_tokens, "temperature": 0, "logprobs": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"text": body["choices"][0]["text"], "logprobs": body["choices"][0]["logprobs"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def _wait_stores(server: ServerThread, num_stores: int, timeout_s: float = 20) -> None:
    """Until the replica has written `num_stores` stores to Redis (they are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while server.metric("ctxwarden_kv_tier_stores_total", tier="redis") < num_stores:
        assert time.monotonic() < deadline, "stores did not reach Redis"
        time.sleep(0.05)


def _wait_breaker(server: ServerThread, state: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while server.metric("ctxwarden_kv_tier_breaker_state", tier="redis") != state:
        assert time.monotonic() < deadline, f"breaker never reached state {state}"
        time.sleep(0.05)


def test_a_prompt_computed_by_one_replica_is_served_warm_by_another(replicas):
    a, b = replicas(2)
    first = _complete(a, seed=0)
    _wait_stores(a, 2)  # the prompt (when its prefill ended) and the finished sequence
    warm = _complete(b, seed=0)
    assert (first["cached"], warm["cached"]) == (0, HIT_TOKENS)
    assert warm["text"] == first["text"] and warm["logprobs"] == first["logprobs"]
    assert b.metric("ctxwarden_kv_tier_hits_total", tier="redis") == HIT_TOKENS // 16
    assert b.metric("ctxwarden_kv_tier_decisions_total", tier="redis", decision="fetch") == 1
    assert b.metric("ctxwarden_kv_tier_bytes_out_total", tier="redis") > 0
    assert b.metric("ctxwarden_kv_tier_fetch_seconds_count", tier="redis") == 1
    assert a.metric("ctxwarden_kv_tier_bytes_in_total", tier="redis") > 0
    assert b.metric("ctxwarden_kv_tier_integrity_failures_total") == 0


def test_tenants_never_share_prefixes_across_replicas(replicas):
    a, b = replicas(2)
    _complete(a, seed=1, key="key-alpha")
    _wait_stores(a, 2)
    assert _complete(b, seed=1, key="key-beta")["cached"] == 0  # the same prompt, another tenant
    assert _complete(b, seed=1, key="key-alpha")["cached"] == HIT_TOKENS  # its own tenant hits
    for s in (a, b):
        assert s.metric("ctxwarden_cross_tenant_prefix_hits_total") == 0
        assert s.metric("ctxwarden_kv_tier_integrity_failures_total") == 0


def _wave(server: ServerThread, seeds, during=None) -> list[dict]:
    """Send one request per seed at once; `during()` runs while they are in flight."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        futures = [pool.submit(_complete, server, s, "key-alpha", 16) for s in seeds]
        if during is not None:
            time.sleep(0.05)
            during()
        return [f.result() for f in futures]


def _assert_same(got: dict, want: dict) -> None:
    """The same greedy text; logprobs equal up to float rounding (concurrent requests share
    steps, so their prefill chunks, and the order of sums, differ from a lone request's)."""
    assert got["text"] == want["text"]
    g, w = got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]
    assert max(abs(x - y) for x, y in zip(g, w)) < 1e-4


def test_redis_hung_then_killed_mid_run_every_request_completes(replicas, redis_server):
    writer, hung_reader, killed_reader = replicas(3)
    expected = {s: _complete(writer, s, max_tokens=16) for s in range(17)}
    _wait_stores(writer, 2 * 17)
    # Hung (SIGSTOP): warm first, then 8 concurrent long prompts while Redis answers nothing.
    assert [r["cached"] for r in _wave(hung_reader, range(0, 2))] == [HIT_TOKENS] * 2
    redis_server.stop()
    for r, s in zip(_wave(hung_reader, range(2, 10)), range(2, 10)):
        _assert_same(r, expected[s])
    assert hung_reader.metric("ctxwarden_kv_tier_breaker_opens_total", tier="redis") >= 1
    redis_server.cont()
    _wait_breaker(hung_reader, 0)
    assert [r["cached"] for r in _wave(hung_reader, range(10, 12))] == [HIT_TOKENS] * 2  # hits resume
    # Killed (SIGKILL) while 8 requests are in flight, then 8 more against the dead server.
    first = _wave(killed_reader, range(0, 8), during=redis_server.kill)
    second = _wave(killed_reader, range(8, 16))
    for r, s in zip(first + second, range(16)):
        _assert_same(r, expected[s])
    # Not closed: open, or half-open where the 1 s cooldown ran out since its last failure
    # (on a slow machine the second wave can take longer than that).
    assert killed_reader.metric("ctxwarden_kv_tier_breaker_state", tier="redis") in (1, 2)
    assert killed_reader.metric("ctxwarden_kv_tier_breaker_opens_total", tier="redis") >= 1
    redis_server.start()  # a restart: empty, same port
    _wait_breaker(killed_reader, 0)
    _complete(killed_reader, 16)  # computed again (Redis lost it), stored to the new server
    _wait_stores(killed_reader, 1)
    again = _complete(replicas(1)[0], 16, max_tokens=16)  # a replica that never saw it
    assert again["cached"] == HIT_TOKENS and again["text"] == expected[16]["text"]
    for s in (hung_reader, killed_reader):
        assert s.metric("ctxwarden_requests_total", status="500") == 0
