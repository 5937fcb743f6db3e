"""Past the window through the real server and the official openai client (issue 15):
streaming mode serves a 12K-token prompt with the x-context-* headers, every overflow policy
(extra_body) says what it dropped and cuts what it says, RoPE scaling stretches the window."""

from __future__ import annotations

import random

import httpx
import pytest

from ctxwarden.context import fit
from ctxwarden.server.app import ServerConfig

openai = pytest.importorskip("openai")

WORDS = ("river garden letter morning carriage window evening sister village honour field "
         "answer music dinner quiet friend walk house reason summer").split()


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))).capitalize() + "."
            for _ in range(n)]


def _client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _model(server) -> str:
    return server.engines[0].name


# --- streaming mode -----------------------------------------------------------------------------


def test_streaming_mode_serves_a_12k_token_prompt_with_the_context_headers(tiny_dir, serve):
    """Window 1,024; 4 sinks + a 256-token rolling window serve a 12K-token conversation."""
    with serve(ServerConfig.build(model=str(tiny_dir), kv_memory="8MiB", sink_tokens=4, window_tokens=256)) as s:
        tok = s.engines[0].tokenizer
        document = " ".join(_sentences(380))
        messages = [{"role": "user", "content": document + " What was the first word?"}]
        num_tokens = tok.count_messages(messages, True)
        assert 12_000 <= num_tokens < 14_000
        raw = _client(s).chat.completions.with_raw_response.create(
            model=_model(s), messages=messages, max_tokens=4, temperature=0)
        reply, h = raw.parse(), raw.headers
        assert reply.usage.prompt_tokens == num_tokens and reply.usage.completion_tokens >= 1
        assert h["x-context-mode"] == "streaming"
        card = _client(s).models.list().data[0].model_extra
        assert (card["context_mode"], card["attention_window"], card["model_window"]) == ("streaming", 260, 1024)
        assert (h["x-context-sink-tokens"], h["x-context-window-tokens"], h["x-context-window"]) == ("4", "256", "260")
        assert int(h["x-context-used"]) == num_tokens and h["x-context-attended"] == "260"
        assert int(h["x-context-evicted"]) == num_tokens - 260 and "x-context-remaining" not in h
        # streamed too: the headers come with the event stream
        with _client(s).chat.completions.with_streaming_response.create(
                model=_model(s), messages=messages, max_tokens=2, temperature=0, stream=True) as stream:
            assert stream.headers["x-context-mode"] == "streaming"
            assert int(stream.headers["x-context-evicted"]) == num_tokens - 260
            assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in stream.parse())


def test_full_mode_refuses_the_same_prompt_and_says_full(tiny_server, tiny_model_id):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="key-alpha", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=tiny_model_id, messages=[{"role": "user", "content": "Hello there."}], max_tokens=2)
    assert raw.headers["x-context-mode"] == "full" and raw.headers["x-context-window"] == "1024"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=tiny_model_id, max_tokens=2,
                                       messages=[{"role": "user", "content": " ".join(_sentences(400))}])
    assert e.value.code == "context_length_exceeded"
    assert "on_overflow" in e.value.message and "truncate-head" in e.value.message  # the way out


# --- overflow policies ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_server(small_window_dir, serve):
    """A 128-token window (the default policy: error)."""
    with serve(ServerConfig.build(model=str(small_window_dir), kv_memory="8MiB")) as s:
        yield s


def _scores(reply) -> list[float]:
    return [t.logprob for t in reply.choices[0].logprobs.content]


def _chat(client, model, messages, policy: str | None, max_tokens: int = 4):
    extra = {"ctxwarden": {"on_overflow": policy}} if policy else None
    return client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True, extra_body=extra)


LONG_CHAT = [{"role": "system", "content": "You answer briefly."},
             {"role": "user", "content": " ".join(_sentences(40, seed=3)) + " Which river was named?"}]


@pytest.mark.parametrize("policy, where", [("truncate-head", "head"), ("truncate-middle", "middle"),
                                           ("keep-tail-semantic", "sentences")])
def test_fitting_policies_report_and_serve_exactly_the_fitted_prompt(small_server, policy, where):
    client, model = _client(small_server), _model(small_server)
    tok = small_server.engines[0].tokenizer
    original = tok.count_messages(LONG_CHAT, True)
    assert original > 128
    raw = _chat(client, model, LONG_CHAT, policy)
    reply, h = raw.parse(), raw.headers
    report = reply.model_extra["ctxwarden"]
    assert report["on_overflow"] == policy and report["dropped_from"] == [where]
    assert report["dropped_tokens"] == original - reply.usage.prompt_tokens > 0
    assert reply.usage.prompt_tokens + 4 <= 128
    assert h["x-ctxwarden-dropped-tokens"] == str(report["dropped_tokens"]) and h["x-ctxwarden-dropped-from"] == where
    cut = report["cuts"][0]
    assert cut["message_index"] == 1 and cut["original_tokens"] == original  # the long user message
    if policy == "keep-tail-semantic":
        assert cut["removed"] and all(r["part"] == 1 for r in cut["removed"])
    # the model saw exactly what the context toolkit fits: same prompt, same logprobs
    fitted = fit(LONG_CHAT, 128, 4, tok, policy)
    direct = _chat(client, model, [{"role": m.role, "content": m.content} for m in fitted.messages], None).parse()
    assert direct.usage.prompt_tokens == reply.usage.prompt_tokens
    assert _scores(direct) == pytest.approx(_scores(reply), abs=1e-6)


def test_token_id_prompts_are_cut_as_ids_where_the_policy_says(small_server):
    client, model = _client(small_server), _model(small_server)
    ids = [(11 * i) % 400 + 20 for i in range(300)]

    def complete(prompt, policy=None):
        extra = {"ctxwarden": {"on_overflow": policy}} if policy else None
        return client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                           logprobs=0, extra_body=extra)

    head, middle = complete(ids, "truncate-head"), complete(ids, "truncate-middle")
    assert head.headers["x-ctxwarden-dropped-tokens"] == middle.headers["x-ctxwarden-dropped-tokens"] == "180"
    want_head = complete(ids[-120:]).parse().choices[0].logprobs.token_logprobs
    want_middle = complete(ids[:60] + ids[-60:]).parse().choices[0].logprobs.token_logprobs
    assert head.parse().choices[0].logprobs.token_logprobs == pytest.approx(want_head, abs=1e-6)
    assert middle.parse().choices[0].logprobs.token_logprobs == pytest.approx(want_middle, abs=1e-6)
    assert want_head != pytest.approx(want_middle, abs=1e-6)  # the two cuts are told apart
    with pytest.raises(openai.BadRequestError, match="send the prompt as text"):
        complete(ids, "keep-tail-semantic")


def test_a_prompt_that_fits_is_untouched_and_says_so(small_server):
    raw = _chat(_client(small_server), _model(small_server), [{"role": "user", "content": "Hi."}], "truncate-head")
    assert raw.parse().model_extra["ctxwarden"]["dropped_tokens"] == 0
    assert raw.headers["x-ctxwarden-overflow"] == "truncate-head" and "x-ctxwarden-dropped-from" not in raw.headers


def test_error_is_the_default_and_a_bad_policy_names_the_choices(small_server):
    client, model = _client(small_server), _model(small_server)
    for policy in (None, "error"):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, model, LONG_CHAT, policy)
        assert e.value.code == "context_length_exceeded" and "128 tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, model, LONG_CHAT, "truncate-tail")
    assert e.value.body["param"] == "ctxwarden.on_overflow" and "keep-tail-semantic" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, model, LONG_CHAT, "fallback")
    assert "--fallback-model" in e.value.message and e.value.code == "context_length_exceeded"


def test_server_default_policy_applies_when_the_request_names_none(small_window_dir, serve):
    with serve(ServerConfig.build(model=str(small_window_dir), kv_memory="8MiB", on_overflow="truncate-head")) as s:
        reply = _chat(_client(s), _model(s), LONG_CHAT, None).parse()
        assert reply.model_extra["ctxwarden"]["on_overflow"] == "truncate-head"
        assert reply.model_extra["ctxwarden"]["dropped_tokens"] > 0
    with pytest.raises(ValueError, match="'drop' is not an overflow policy; choose one of error, truncate-head"):
        ServerConfig.build(model=str(small_window_dir), on_overflow="drop")


def test_fallback_policy_and_error_on_a_server_with_a_fallback(small_window_dir, long_window_dir, serve):
    with serve(ServerConfig.build(model=str(small_window_dir), fallback_model=str(long_window_dir),
                                  kv_memory="8MiB")) as s:
        client, (primary, fallback) = _client(s), (e.name for e in s.engines)
        raw = _chat(client, primary, LONG_CHAT, "fallback")
        report = raw.parse().model_extra["ctxwarden"]
        assert raw.headers["x-ctxwarden-served-by"] == fallback and raw.parse().model == fallback
        assert report["fell_back_from"] == primary and report["dropped_tokens"] == 0
        assert raw.headers["x-ctxwarden-fell-back-from"] == primary
        assert _chat(client, primary, LONG_CHAT, None).headers["x-ctxwarden-served-by"] == fallback  # the default
        with pytest.raises(openai.BadRequestError, match="maximum context length is 128"):
            _chat(client, primary, LONG_CHAT, "error")  # asked for the error: no fallback


# --- RoPE scaling and a raised max_model_len ------------------------------------------------------


def test_rope_scaling_stretches_the_window_the_server_advertises_and_admits(tiny_dir, serve):
    yarn = '{"rope_type": "yarn", "factor": 4}'
    with serve(ServerConfig.build(model=str(tiny_dir), kv_memory="16MiB", rope_scaling=yarn)) as s:
        client = _client(s)
        card = client.models.list().data[0].model_extra
        assert (card["context_window"], card["model_window"], card["context_mode"]) == (4096, 4096, "full")
        assert card["rope_scaling"]["rope_type"] == "yarn" and card["attention_window"] is None
        messages = [{"role": "user", "content": " ".join(_sentences(100))}]
        raw = client.chat.completions.with_raw_response.create(model=_model(s), messages=messages, max_tokens=2)
        assert 1024 < raw.parse().usage.prompt_tokens < 4096 and raw.headers["x-context-window"] == "4096"
        assert "x-ctxwarden-warning" not in raw.headers


def test_allow_long_max_model_len_says_so_on_every_response(tiny_dir, serve):
    from ctxwarden.engine.engine import Engine

    with pytest.raises(ValueError, match="allow-long-max-model-len"):
        Engine(ServerConfig.build(model=str(tiny_dir), kv_memory="16MiB", max_model_len=2048).engine)
    with serve(ServerConfig.build(model=str(tiny_dir), kv_memory="16MiB", max_model_len=2048,
                                  allow_long_max_model_len=True)) as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": _model(s), "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-context-window"] == "2048"
        assert r.headers["x-context-trained-window"] == "1024" and "never trained" in r.headers["x-ctxwarden-warning"]
