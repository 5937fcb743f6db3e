"""The official openai client against a live server on the tiny model."""

from __future__ import annotations

import time

import httpx
import openai
import pytest


MSGS = [{"role": "user", "content": "Tell me a story about a cat."}]


def test_models_lists_the_served_model(openai_client, tiny_model_id):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [tiny_model_id]
    assert models.data[0].model_extra["context_window"] == 1024


def test_chat_plain_and_streamed_give_the_same_greedy_text(openai_client, tiny_model_id):
    plain = openai_client.chat.completions.create(model=tiny_model_id, messages=MSGS, max_tokens=20,
                                                  temperature=0, extra_body={"ignore_eos": True})
    chunks = list(openai_client.chat.completions.create(
        model=tiny_model_id, messages=MSGS, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert plain.choices[0].message.content == streamed and streamed
    assert plain.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens > 0


def test_completions_logprobs_are_consistent_with_greedy(openai_client, tiny_model_id):
    out = openai_client.completions.create(model=tiny_model_id, prompt="Once upon a time", max_tokens=6,
                                           temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the argmax


def test_completions_streamed_equal_plain_with_two_prompts(openai_client, tiny_model_id):
    kw = dict(model=tiny_model_id, prompt=["Once upon a time", "The end"], max_tokens=7, temperature=0,
              extra_body={"ignore_eos": True})
    plain = openai_client.completions.create(**kw)
    texts = {0: "", 1: ""}
    for chunk in openai_client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [c.index for c in plain.choices] == [0, 1]
    assert [texts[0], texts[1]] == [c.text for c in plain.choices] and texts[0] != texts[1]
    assert plain.usage.completion_tokens == 14


def test_chat_logprobs_and_top_logprobs(openai_client, tiny_model_id):
    out = openai_client.chat.completions.create(model=tiny_model_id, messages=MSGS, max_tokens=4,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == out.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
               for t in content)


def test_n_stop_seed_and_max_completion_tokens(openai_client, tiny_model_id):
    kw = dict(model=tiny_model_id, messages=MSGS, temperature=1.0, seed=7, n=3,
              max_completion_tokens=9, max_tokens=500, extra_body={"ignore_eos": True})
    a, b = openai_client.chat.completions.create(**kw), openai_client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # choices differ from each other
    assert a.usage.completion_tokens == 27  # max_completion_tokens wins over max_tokens
    text = a.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop.strip():
        cut = openai_client.chat.completions.create(**{**kw, "n": 1, "stop": [stop]})
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == text[:text.index(stop)]


def test_over_window_is_a_400_context_length_exceeded(openai_client, tiny_model_id):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=tiny_model_id, prompt=[5] * 1000, max_tokens=100)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    msg = e.value.message
    assert "1024" in msg and "1000" in msg and "100" in msg
    assert e.value.response.headers["x-context-window"] == "1024"


def test_missing_and_unknown_keys_are_401(tiny_server, tiny_model_id):
    for key in ("not-a-key", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(tiny_server.url + "/v1/chat/completions", headers=headers, timeout=10,
                       json={"model": tiny_model_id, "messages": MSGS})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_tenants_never_share_prefix_cache(tiny_server, tiny_model_id, api_keys):
    prompt = "The quick brown fox jumps over the lazy dog. " * 12 + f" {time.time()}"
    clients = {t: openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=k, max_retries=0)
               for k, t in api_keys.items()}

    def cached(tenant):
        out = clients[tenant].completions.create(model=tiny_model_id, prompt=prompt, max_tokens=2, temperature=0)
        assert out.usage.prompt_tokens > 64
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("alpha") == 0
    assert cached("beta") == 0  # same prompt, other tenant: no hit
    assert cached("alpha") > 0  # same tenant again: hit
    assert tiny_server.metric("ctxwarden_cross_tenant_prefix_hits_total") == 0


def test_context_and_request_id_headers(tiny_server, tiny_model_id):
    r = httpx.post(tiny_server.url + "/v1/completions", timeout=30,
                   headers={"Authorization": "Bearer key-alpha", "x-request-id": "trace-42"},
                   json={"model": tiny_model_id, "prompt": [5, 6, 7, 8], "max_tokens": 3})
    assert r.status_code == 200
    h = r.headers
    assert h["x-request-id"] == "trace-42" and h["x-context-window"] == "1024"
    assert h["x-context-used"] == "4" and h["x-context-remaining"] == "1020"
    assert h["x-ctxwarden-served-by"] == tiny_model_id and r.json()["model"] == tiny_model_id
    generated = httpx.get(tiny_server.url + "/health").headers["x-request-id"]
    assert len(generated) == 32


def test_request_id_is_in_every_log_line_of_the_request(tiny_server, tiny_model_id, caplog):
    from ctxwarden.server.app import RequestIdLogFilter

    caplog.handler.addFilter(RequestIdLogFilter())
    with caplog.at_level("INFO", logger="ctxwarden.server"):
        httpx.post(tiny_server.url + "/v1/completions", timeout=30,
                   headers={"Authorization": "Bearer key-alpha", "x-request-id": "trace-log-1"},
                   json={"model": tiny_model_id, "prompt": "hi", "max_tokens": 2}).raise_for_status()
    ours = [r for r in caplog.records if r.name == "ctxwarden.server" and "cmpl-" in r.getMessage()]
    assert len(ours) >= 2 and {r.request_id for r in ours} == {"trace-log-1"}


def test_abort_mid_stream_frees_blocks(tiny_server, openai_client, tiny_model_id):
    before = tiny_server.metric("ctxwarden_requests_total", status="499")
    generated_before = tiny_server.engine_call(lambda e: e.stats().num_generated_tokens)
    stream = openai_client.chat.completions.create(model=tiny_model_id, messages=MSGS, max_tokens=900,
                                                   stream=True, extra_body={"ignore_eos": True})
    for i, _ in zip(range(3), stream):
        pass
    stream.close()
    assert tiny_server.wait_metric("ctxwarden_kv_blocks_in_use", 0) == 0
    deadline = time.monotonic() + 10
    while tiny_server.metric("ctxwarden_requests_total", status="499") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiny_server.metric("ctxwarden_requests_total", status="499") == before + 1
    generated = tiny_server.engine_call(lambda e: e.stats().num_generated_tokens) - generated_before
    assert generated < 900  # it was cut short, not run to the end
    assert tiny_server.engine_call(lambda e: e.audit().is_clean)
