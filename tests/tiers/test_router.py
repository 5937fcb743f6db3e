"""`ctxwarden route`: prefix affinity, the load bound, health checks, failover, real replicas."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from live_server import ServerThread

from ctxwarden.router.affinity import AffinityConfig, choose, prefix_key, prompt_bytes, rank, tenant_salt
from ctxwarden.router.app import RouterConfig, create_router
from ctxwarden.server.app import ServerConfig, create_app

REPLICAS = ("http://r1", "http://r2", "http://r3")
HEALTH_INTERVAL_S = 0.5
MODEL = "router-tiny"


def test_the_prefix_key_reads_the_first_blocks_and_the_tenant():
    cfg = AffinityConfig(block_bytes=4, num_blocks=2)
    salt = tenant_salt("Bearer key-a")
    assert prefix_key(b"abcdefgh-tail-1", salt, cfg) == prefix_key(b"abcdefgh-tail-2", salt, cfg)
    assert prefix_key(b"abcdefgX", salt, cfg) != prefix_key(b"abcdefgh", salt, cfg)
    assert prefix_key(b"abcdefgh", tenant_salt("Bearer key-b"), cfg) != prefix_key(b"abcdefgh", salt, cfg)
    assert prefix_key(b"ab", salt, cfg) != prefix_key(b"abc", salt, cfg)  # short prompts: all of it
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}
    assert prompt_bytes(chat) == b"system\0S\0user\0Q\0"
    assert prompt_bytes({"prompt": [1, 2]}) == prompt_bytes({"prompt": [[1, 2], [3]]})


def test_choose_follows_rendezvous_order_within_the_load_bound():
    cfg = AffinityConfig(load_factor=1.25, min_in_flight=4)
    key = prefix_key(b"x" * 2000, tenant_salt(None), cfg)
    order = rank(key, list(REPLICAS))
    idle = dict.fromkeys(REPLICAS, 0)
    assert choose(key, idle, cfg) == order
    assert choose(key, {order[0]: 3, order[1]: 0, order[2]: 0}, cfg)[0] == order[0]  # 3 < floor 4: stays
    # full: bound = max(4, ceil(1.25 * (4 + 1) / 3)) = 4 and it holds 4 -> the second choice
    assert choose(key, {order[0]: 4, order[1]: 0, order[2]: 0}, cfg) == [order[1], order[0], order[2]]
    # under heavy load the bound grows with the mean: ceil(1.25 * (30 + 1) / 3) = 13
    assert choose(key, {order[0]: 12, order[1]: 9, order[2]: 9}, cfg)[0] == order[0]
    assert choose(key, {order[0]: 13, order[1]: 9, order[2]: 8}, cfg)[0] == order[1]
    # a replica removed moves only its own keys: the others keep their first choice
    keys = [prefix_key(bytes([i]) * 300, "t", cfg) for i in range(200)]
    before = {k: rank(k, list(REPLICAS))[0] for k in keys}
    after = {k: rank(k, list(REPLICAS[:2]))[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != REPLICAS[2])
    assert 40 < sum(before[k] == REPLICAS[2] for k in keys) < 100  # about a third each


@pytest.fixture
def cluster(tiny_dir):
    """Two tiny replicas and a router in front (health every 0.5 s)."""
    config = ServerConfig.build(model=str(tiny_dir), kv_memory="8MiB", served_model_name=MODEL)
    replicas = [ServerThread(lambda: create_app(config)).start() for _ in range(2)]
    router = ServerThread(lambda: create_router(RouterConfig(tuple(r.url for r in replicas),
                                                             health_interval_s=HEALTH_INTERVAL_S))).start()
    yield router, replicas
    for s in [router, *replicas]:
        s.stop()


def _ask(router: ServerThread, seed: int, stream: bool = False) -> httpx.Response:
    rng = random.Random(seed)
    prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(150))
    return httpx.post(router.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream})


def _replica_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-ctxwarden-replica"]


def test_router_keeps_a_prefix_on_one_replica_and_drops_a_dead_one_within_an_interval(cluster, tiny_dir):
    router, replicas = cluster
    model = httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert model == MODEL
    homes = {seed: {_replica_of(_ask(router, seed)) for _ in range(3)} for seed in range(12)}
    assert all(len(h) == 1 for h in homes.values())  # one prefix, one replica
    assert {h for hs in homes.values() for h in hs} == {r.url for r in replicas}  # both get work
    stream = _ask(router, 0, stream=True)
    assert _replica_of(stream) in homes[0] and stream.text.rstrip().endswith("data: [DONE]")
    victim = next(r for r in replicas if r.url in homes[0])
    victim.stop()  # a replica restart begins
    stopped = time.monotonic()
    while httpx.get(router.url + "/health", timeout=5).json()["replicas"][victim.url]:
        time.sleep(0.02)
    assert time.monotonic() - stopped <= HEALTH_INTERVAL_S + 0.25  # gone within one health interval
    moved = {_replica_of(_ask(router, 0)) for _ in range(3)}
    assert moved == {r.url for r in replicas} - {victim.url}
    victim.start()  # back on the same port: traffic returns at the next check
    deadline = time.monotonic() + 5
    while not httpx.get(router.url + "/health", timeout=5).json()["replicas"][victim.url]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert _replica_of(_ask(router, 0)) == victim.url
    assert router.metric("ctxwarden_router_replica_healthy") == 2


def test_a_request_to_an_unreachable_replica_fails_over_at_once(tiny_dir):
    config = ServerConfig.build(model=str(tiny_dir), kv_memory="8MiB", served_model_name=MODEL)
    live = ServerThread(lambda: create_app(config)).start()
    dead = ServerThread(lambda: create_app(config)).start()
    router = ServerThread(lambda: create_router(RouterConfig((live.url, dead.url), health_interval_s=60))).start()
    try:
        dead.stop()  # the router still believes it healthy: the next check is a minute away
        for seed in range(8):
            assert _replica_of(_ask(router, seed)) == live.url
        assert not httpx.get(router.url + "/health", timeout=5).json()["replicas"][dead.url]
        live.stop()
        r = _ask(router, 0)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
    finally:
        for s in (router, live, dead):
            s.stop()


def test_router_config_refuses_bad_replicas():
    with pytest.raises(ValueError, match="at least one"):
        RouterConfig(())
    with pytest.raises(ValueError, match="http://"):
        RouterConfig(("127.0.0.1:8001",))
    with pytest.raises(ValueError, match="once"):
        RouterConfig(("http://a", "http://a"))
