"""Fallback to a larger-window model, and the API key file."""

from __future__ import annotations

import openai
import pytest

from ctxwarden.server.app import ServerConfig
from ctxwarden.server.tenants import KeyFileError, Tenant, TenantDirectory


def test_over_window_prompt_is_served_by_the_fallback(small_window_dir, long_window_dir, serve):
    with serve(ServerConfig.build(model=str(small_window_dir), fallback_model=str(long_window_dir),
                            kv_memory="8MiB")) as s:
        primary, fallback = (e.name for e in s.engines)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [primary, fallback]
        short = client.completions.with_raw_response.create(model=primary, prompt=[5] * 20, max_tokens=4)
        assert short.headers["x-ctxwarden-served-by"] == primary and short.parse().model == primary
        long = client.completions.with_raw_response.create(model=primary, prompt=[5] * 200, max_tokens=4)
        assert long.headers["x-ctxwarden-served-by"] == fallback and long.parse().model == fallback
        assert long.headers["x-context-window"] == "8192" and long.parse().usage.prompt_tokens == 200
        with pytest.raises(openai.BadRequestError) as e:  # over both windows: still a clean 400
            client.completions.create(model=primary, prompt=[5] * 9000, max_tokens=4)
        assert e.value.code == "context_length_exceeded" and "8192" in e.value.message


def test_without_a_fallback_the_small_window_refuses(small_window_dir, serve):
    with serve(ServerConfig.build(model=str(small_window_dir), kv_memory="8MiB")) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=s.engines[0].name, prompt=[5] * 200, max_tokens=4)
        assert e.value.code == "context_length_exceeded" and "128" in e.value.message


def test_key_file_parsing(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\nsk-1 acme   # trailing comment\n\nsk-2 globex\n")
    d = TenantDirectory.load(path)
    assert d.resolve("Bearer sk-1") == Tenant("acme") and d.resolve("bearer sk-2") == Tenant("globex")
    assert d.resolve("Bearer sk-3") is None and d.resolve(None) is None and d.resolve("sk-1") is None
    assert Tenant("acme").namespace != Tenant("globex").namespace
    assert TenantDirectory.open().resolve(None).name == "default"
    path.write_text("sk-1 acme extra\n")
    with pytest.raises(KeyFileError, match=r"keys:1: expected 'API_KEY TENANT_NAME', got 3"):
        TenantDirectory.load(path)
    path.write_text("sk-1 acme\nsk-1 globex\n")
    with pytest.raises(KeyFileError, match="keys:2"):
        TenantDirectory.load(path)


def test_key_file_options_roles_and_their_errors(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("sk-1 acme weight=2 max_running=4 max_queued=8 tpm=1000\nsk-2 acme weight=2 max_running=4 "
                    "max_queued=8 tpm=1000\nsk-3 ops role=admin\n")
    path.chmod(0o644)
    d = TenantDirectory.load(path)
    assert "readable by other users" in caplog.text and "chmod 600" in caplog.text
    acme = d.resolve("Bearer sk-2")
    assert (acme.weight, acme.max_running, acme.max_queued, acme.tokens_per_minute) == (2.0, 4, 8, 1000)
    assert acme.share.weight == 2.0 and not acme.is_admin and d.resolve("Bearer sk-3").is_admin
    for text, message in (("sk-1 acme weight=0\n", "weight must be > 0"),
                          ("sk-1 acme colour=red\n", "unknown option 'colour'"),
                          ("sk-1 acme tpm=lots\n", "tpm='lots' is not a int"),
                          ("sk-1 acme role=root\n", "the only role is 'admin'"),
                          ("sk-1 acme\nsk-2 acme weight=3\n", "keys:2: tenant 'acme' is listed with other options")):
        path.write_text(text)
        with pytest.raises(KeyFileError, match=message):
            TenantDirectory.load(path)


def test_tokens_per_minute_books_refunds_and_says_when_to_retry():
    from ctxwarden.errors import TenantLimitExceeded
    from ctxwarden.server.tenants import TokenRateLimiter

    now = [100.0]
    limiter, tenant = TokenRateLimiter(clock=lambda: now[0]), Tenant("acme", tokens_per_minute=1000)
    limiter.reserve(tenant, 600)
    now[0] += 20
    with pytest.raises(TenantLimitExceeded, match="over its limit of 1000 tokens per minute") as e:
        limiter.reserve(tenant, 500)
    assert e.value.retry_after_s == pytest.approx(40.0)  # when the first booking leaves the window
    limiter.refund(tenant, 200)  # only 400 of the 600 were used
    limiter.reserve(tenant, 500)
    now[0] += 41
    limiter.reserve(tenant, 500)  # the first booking has expired; the 500 of t=120 has not
    limiter.reserve(Tenant("unlimited"), 10**9)
