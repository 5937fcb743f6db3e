"""The live attention monitor on a server: records per request, a calibrated collapse alert.

Every request is sampled (--attention-sample-rate 1). After the baseline's calibration
requests, clean prompts raise no alert; with the queries scaled x10 (a hook on the monitor:
softmax gets sharper in every head) one request trips the alert, named by layer and head in
the log and counted on /metrics.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ctxwarden.diagnostics.attention import DEFAULT_CALIBRATION_REQUESTS
from ctxwarden.server.app import ServerConfig

ADMIN = {"Authorization": "Bearer key-admin"}
ALPHA = {"Authorization": "Bearer key-alpha"}


@pytest.fixture(scope="module")
def monitored(serve, tiny_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("attention-keys") / "keys.txt"
    keys.write_text("key-admin ops role=admin\nkey-alpha alpha\n")
    keys.chmod(0o600)
    with serve(ServerConfig.build(model=str(tiny_dir), kv_memory="8MiB", api_keys=str(keys),
                                  attention_sample_rate=1.0)) as s:
        yield s


def _complete(server, i: int, request_id: str):
    return httpx.post(server.url + "/v1/completions", headers={**ALPHA, "x-request-id": request_id}, timeout=60,
                      json={"model": server.engines[0].name, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                            "prompt": [1 + (i * 29 + 7 * j) % 500 for j in range(20 + i % 17)]})


def _attention(server, request_id: str) -> httpx.Response:
    return httpx.get(f"{server.url}/debug/attention/{request_id}", headers=ADMIN, timeout=10)


def test_clean_requests_calibrate_and_a_x10_query_scale_trips_the_alert(monitored, caplog):
    n_clean = DEFAULT_CALIBRATION_REQUESTS + 4
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: _complete(monitored, i, f"clean-{i}"), range(n_clean)))
    assert [r.status_code for r in replies] == [200] * n_clean
    records = [_attention(monitored, f"clean-{i}").json()["choices"][0] for i in range(n_clean)]
    assert all(not r["alerts"] for r in records)
    assert records[-1]["calibrated"] and records[-1]["tenant"] == "alpha"
    layers = records[-1]["layers"]
    assert len(layers) == 2 and len(layers[0]) == 4 and all(0 < h["entropy"] <= 1 for h in layers[0])
    assert monitored.metric("ctxwarden_attention_collapse_alerts_total") == 0
    assert monitored.metric("ctxwarden_attention_sampled_requests_total") == n_clean

    def scale(engine, factor):
        engine.attention.query_scale = factor
    monitored.engine_call(lambda e: scale(e, 10.0))
    try:
        with caplog.at_level(logging.WARNING, logger="ctxwarden.server.attention"):
            assert _complete(monitored, 999, "sharp-1").status_code == 200
    finally:
        monitored.engine_call(lambda e: scale(e, 1.0))
    (record,) = _attention(monitored, "sharp-1").json()["choices"]
    assert record["alerts"], record
    alert = record["alerts"][0]
    assert alert["entropy"] < alert["threshold"] < alert["baseline_mean"]
    assert f"layer {alert['layer']} head {alert['head']}" in caplog.text and "sharp-1" in caplog.text
    assert monitored.metric("ctxwarden_attention_collapse_alerts_total") == len(record["alerts"])


def test_an_unsampled_or_unknown_request_is_a_404_that_says_why(monitored):
    r = _attention(monitored, "never-sent")
    assert r.status_code == 404 and "--attention-sample-rate" in r.json()["error"]["message"]


def test_diag_attention_cli_json_and_png(tiny_dir, tmp_path, capsys):
    from ctxwarden.cli import main

    tokens = tmp_path / "ids.json"
    tokens.write_text(json.dumps([1 + (5 * j) % 500 for j in range(33)]))
    png = tmp_path / "attention.png"
    assert main(["diag", "attention", "--tokens", str(tokens), "--model", str(tiny_dir), "--json",
                 "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"model", "num_tokens", "layers", "sink_rate", "rollout_last_row", "position_mass"}
    assert out["num_tokens"] == 33 and len(out["rollout_last_row"]) == 33 and len(out["position_mass"]) == 10
    assert abs(sum(out["position_mass"]) - 1) < 1e-6 and png.stat().st_size > 10_000
    assert main(["diag", "attention", "--model", str(tiny_dir)]) == 2
    assert "give PROMPT or --tokens FILE" in capsys.readouterr().err
