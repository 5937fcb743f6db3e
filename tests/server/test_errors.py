"""Every refusal: the documented status, an OpenAI error object, `param` and `code`."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ctxwarden.server.app import ServerConfig, create_app

AUTH = {"Authorization": "Bearer key-alpha"}


def _post(server, path, body=None, content=None, headers=None):
    return httpx.post(server.url + path, json=body, content=content, timeout=30,
                      headers={**AUTH, "content-type": "application/json", **(headers or {})})


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_malformed_json_is_400_with_param(tiny_server):
    err = _error(_post(tiny_server, "/v1/chat/completions", content=b'{"model": "x", "messages": ['), 400)
    assert err["param"] == "body" and err["code"] == "invalid_json"


@pytest.mark.parametrize("field, value, param", [
    ("temperature", -1, "temperature"), ("top_p", 0, "top_p"), ("n", 0, "n"), ("max_tokens", 0, "max_tokens"),
    ("messages", [], "messages"), ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
    ("stop", 5, "stop"), ("top_logprobs", 3, "top_logprobs"),
])
def test_invalid_chat_parameter_is_400_naming_it(tiny_server, tiny_model_id, field, value, param):
    body = {"model": tiny_model_id, "messages": [{"role": "user", "content": "hi"}], field: value}
    err = _error(_post(tiny_server, "/v1/chat/completions", body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_missing_required_field_and_bad_token_ids(tiny_server, tiny_model_id):
    err = _error(_post(tiny_server, "/v1/completions", {"model": tiny_model_id}), 400)
    assert err["param"] == "prompt"
    err = _error(_post(tiny_server, "/v1/completions", {"model": tiny_model_id, "prompt": [99999]}), 400)
    assert err["param"] == "prompt" and "512" in err["message"]  # the vocabulary size


def test_unknown_model_is_404_and_unknown_route_is_an_error_object(tiny_server):
    err = _error(_post(tiny_server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    _error(httpx.get(tiny_server.url + "/v1/nothing-here"), 404)


def test_body_over_the_limit_is_413(tiny_server, tiny_model_id):
    big = {"model": tiny_model_id, "prompt": "x" * (300 * 1024)}
    err = _error(_post(tiny_server, "/v1/completions", big), 413)
    assert err["code"] == "request_too_large" and str(256 * 1024) in err["message"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "m", "prompt": "'
        for _ in range(40):
            yield b"y" * 8192
        yield b'"}'
    r = httpx.post(tiny_server.url + "/v1/completions", content=chunked(), headers=AUTH, timeout=30)
    _error(r, 413)


def test_kv_capacity_exceeded_is_400_not_retryable(tiny_dir, serve):
    # 64 KiB holds 8 blocks of 16 tokens (2 layers x 2 KV heads x 16 dims x fp32 x K,V = 512 B/token).
    with serve(ServerConfig.build(model=str(tiny_dir), kv_memory="64KiB")) as s:
        assert s.metric("ctxwarden_kv_blocks_total") == 8
        r = httpx.post(s.url + "/v1/completions", timeout=30,
                       json={"model": s.engines[0].name, "prompt": [5] * 300, "max_tokens": 10})
        err = _error(r, 400)
        assert err["code"] == "kv_capacity_exceeded" and "8" in err["message"] and "kv_memory" in err["message"]


def test_queue_full_is_429_with_retry_after(long_window_dir, serve):
    # The first request would run for 8000 tokens (seconds); closing its stream aborts it.
    with serve(ServerConfig.build(model=str(long_window_dir), kv_memory="16MiB", max_num_seqs=1, max_waiting=1)) as s:
        model = s.engines[0].name
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 8000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=s.url, timeout=30) as c1, httpx.Client(base_url=s.url, timeout=30) as c2:
            with c1.stream("POST", "/v1/completions", json=body) as running:
                lines = running.iter_lines()  # kept: a dropped iterator closes the stream
                while not next(lines).startswith("data:"):  # a token: it holds the only running slot
                    pass
                with c2.stream("POST", "/v1/completions", json=body) as waiting:
                    assert waiting.status_code == 200  # it waits in the queue (bound 1)
                    r = httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
                    err = _error(r, 429)
                    assert r.headers["retry-after"] == "1" and err["code"] == "queue_full"
                    assert "1 of 1" in err["message"]
        assert s.wait_metric("ctxwarden_kv_blocks_in_use", 0) == 0
        assert s.metric("ctxwarden_requests_total", status="429") == 1


def test_loading_is_503_with_retry_after(tiny_dir):
    # No lifespan runs under ASGITransport, so the model never finishes loading: the app
    # answers exactly as it does during a real load.
    app = create_app(ServerConfig.build(model=str(tiny_dir)))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [await c.get("/health"),
                    await c.post("/v1/completions", json={"model": "m", "prompt": "hi"})]

    for r in asyncio.run(go()):
        err = _error(r, 503)
        assert r.headers["retry-after"] == "1" and "loading" in err["message"]


def test_bad_engine_options_are_named_before_anything_loads():
    with pytest.raises(ValueError, match="dtype 'int3' is not one of fp32, bf16, fp16"):
        ServerConfig.build(dtype="int3")
    with pytest.raises(TypeError, match="unknown engine option"):
        ServerConfig.build(kv_memroy="1GiB")
    config = ServerConfig.build(dtype="bfloat16", fallback_model="x", block_size=32)
    assert [c.model for c in config.engine_configs()] == [None, "x"]
    assert {c.block_size for c in config.engine_configs()} == {32} and config.engine.max_waiting == 256
