"""Schema-driven fuzzing of /openapi.json: no generated request may get a 5xx.

Bounded: a 128-token model (every generation is short), a fixed number of examples per
mode, and a wall-clock budget after which remaining examples are not sent.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings

from ctxwarden.server.app import ServerConfig

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = 40  # per generation mode
BUDGET_S = 40.0


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_never_get_a_5xx(small_window_dir, serve, mode):
    from schemathesis import GenerationMode

    with serve(ServerConfig.build(model=str(small_window_dir), kv_memory="8MiB", max_waiting=64)) as s:
        schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
        strategy = schema.as_strategy(GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE)
        started, statuses, model = time.monotonic(), [], s.engines[0].name

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def check(case):
            if time.monotonic() - started > BUDGET_S:
                return
            if mode == "positive" and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = model  # a random id is a 404 before the engine is reached
            response = case.call(base_url=s.url, timeout=30)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["message"] and "type" in error and "code" in error

        check()
        assert statuses, "no request was sent"
        assert s.wait_metric("ctxwarden_kv_blocks_in_use", 0) == 0
