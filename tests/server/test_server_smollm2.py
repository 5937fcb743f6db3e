"""The real SmolLM2-135M-Instruct behind the server, through the official client."""

from __future__ import annotations

import openai
import pytest

from ctxwarden.server.app import ServerConfig

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def smol(serve):
    with serve(ServerConfig.build(kv_memory="128MiB")) as s:
        yield s


def test_chat_plain_and_streamed_agree_and_answer(smol):
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0, timeout=120)
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    plain = client.chat.completions.create(model=models[0].id, messages=QUESTION, max_tokens=12, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=models[0].id, messages=QUESTION, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert "Paris" in plain.choices[0].message.content
    assert streamed == plain.choices[0].message.content
    assert plain.usage.prompt_tokens > 20 and plain.usage.completion_tokens <= 12


def test_long_prompt_repeat_hits_the_prefix_cache(smol):
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0, timeout=120)
    context = "The committee met on Tuesday to review the budget. " * 20
    messages = [{"role": "system", "content": context}, {"role": "user", "content": "Summarise."}]
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=1)
    second = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=1)
    assert first.usage.prompt_tokens > 200
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert smol.metric("ctxwarden_prefix_cache_hits_tokens_total") >= second.usage.prompt_tokens_details.cached_tokens
