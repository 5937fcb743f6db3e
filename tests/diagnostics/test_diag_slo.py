"""SLO risk: Wilson intervals cover, buckets add up, the latency model predicts held-out risk."""

import json

import numpy as np
import pytest

from ctxwarden.diagnostics.request_log import RequestRecord, read_lengths, read_request_log
from ctxwarden.diagnostics.slo import (SLO, default_edges, fit_latency_model, is_violation,
                                       measure_risk, parse_edges, predict_risk, wilson_interval)

A_S, B_S, C_S = 0.05, 2e-4, 5e-8  # the synthetic server's prefill time: a + b L + c L^2


def record(i, prompt, ttft, tpot=0.05, status="ok", cached=0):
    return RequestRecord(time=1000.0 + i, request_id=f"r{i}", tenant="t", prompt_tokens=prompt,
                         completion_tokens=16, cached_tokens=cached, ttft_s=ttft, tpot_s=tpot,
                         status=status)


def synthetic_log(rng, n, noise_sigma=0.25):
    """Requests whose TTFT is the quadratic above times lognormal noise (queueing-like)."""
    lengths = np.maximum(np.round(rng.lognormal(6.5, 0.9, n)), 1).astype(int)
    ttft = (A_S + B_S * lengths + C_S * lengths**2) * rng.lognormal(0.0, noise_sigma, n)
    return [record(i, int(L), float(t)) for i, (L, t) in enumerate(zip(lengths, ttft))]


def test_wilson_interval_textbook_values():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_wilson_interval_covers_at_its_nominal_rate():
    rng = np.random.default_rng(0)
    p, n = 0.08, 60
    hits = [lo <= p <= hi for lo, hi in (wilson_interval(int(k), n) for k in rng.binomial(n, p, 4000))]
    assert 0.92 <= np.mean(hits) <= 0.98


def test_violation_rules():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    assert is_violation(record(0, 10, 0.5), slo) is False
    assert is_violation(record(0, 10, 1.5), slo) is True
    assert is_violation(record(0, 10, 0.5, tpot=0.2), slo) is True
    assert is_violation(record(0, 10, None, tpot=None, status="error"), slo) is True
    assert is_violation(record(0, 10, None, tpot=None, status="abort"), slo) is None
    assert is_violation(record(0, 10, 0.5, tpot=0.2), SLO(ttft_s=1.0)) is False


def test_buckets_count_exactly_and_add_up():
    recs = ([record(i, 100, 0.1) for i in range(6)] + [record(i, 100, 3.0) for i in range(6, 8)]
            + [record(i, 700, 3.0) for i in range(8, 10)] + [record(10, 5000, None, status="abort")])
    risk = measure_risk(recs, SLO(ttft_s=1.0), edges=(0, 512, 1024))
    assert (risk.num_requests, risk.num_excluded, risk.num_violations) == (10, 1, 4)
    low, high = risk.buckets
    assert (low.lo_tokens, low.hi_tokens, low.num_requests, low.num_violations) == (0, 512, 8, 2)
    assert (high.num_requests, high.num_violations, high.p_violation) == (2, 2, 1.0)
    assert low.p_low < 0.25 < low.p_high
    assert sum(b.share_of_traffic for b in risk.buckets) == pytest.approx(1.0)
    assert sum(b.share_of_violations for b in risk.buckets) == pytest.approx(1.0)
    assert sum(b.violations_per_1000 for b in risk.buckets) == pytest.approx(400.0)


def test_lengths_past_the_last_edge_get_an_open_bucket():
    risk = measure_risk([record(0, 100, 0.1), record(1, 9000, 5.0)], SLO(1.0), edges=(0, 1024))
    assert [(b.lo_tokens, b.hi_tokens) for b in risk.buckets] == [(0, 1024), (1024, 9001)]
    assert default_edges([100, 3000]) == (0, 128, 256, 512, 1024, 2048, 4096)
    with pytest.raises(ValueError, match="start at 0"):
        parse_edges("10,20")


def test_latency_model_recovers_the_prefill_curve():
    model = fit_latency_model(synthetic_log(np.random.default_rng(1), 4000, noise_sigma=0.05))
    L = np.array([100, 1000, 4000])
    assert model.ttft_s(L) == pytest.approx(A_S + B_S * L + C_S * L**2, rel=0.05)


def test_cached_tokens_are_not_charged_to_prefill():
    recs = [record(i, 2000, A_S + B_S * 200 + C_S * 200**2, cached=1800) for i in range(20)]
    recs += [record(20 + i, L, A_S + B_S * L + C_S * L**2) for i, L in enumerate(range(100, 4100, 200))]
    model = fit_latency_model(recs)
    assert model.ttft_s(200) == pytest.approx(A_S + B_S * 200 + C_S * 200**2, rel=0.02)


def test_prediction_lies_inside_the_held_out_measured_intervals():
    rng = np.random.default_rng(2)
    slo = SLO(ttft_s=0.6)
    model = fit_latency_model(synthetic_log(rng, 3000))
    held_out = synthetic_log(rng, 3000)
    measured = measure_risk(held_out, slo)
    predicted = predict_risk(model, [r.prompt_tokens for r in held_out], slo,
                             edges=tuple(b.lo_tokens for b in measured.buckets))
    assert [b.lo_tokens for b in predicted.buckets] == [b.lo_tokens for b in measured.buckets]
    informative = [i for i, b in enumerate(measured.buckets) if 0.02 < b.p_violation < 0.98]
    assert len(informative) >= 2  # the test has teeth: risk changes across several buckets
    # Each bucket's 95% interval misses the truth 1 time in 20, so k buckets all inside would
    # fail a perfect model 1 - 0.95^k of the time: ask for every bucket inside its 99%
    # interval and all but one inside the 95% one.
    inside_95 = 0
    for m, p in zip(measured.buckets, predicted.buckets):
        lo99, hi99 = wilson_interval(m.num_violations, m.num_requests, z=2.5758)
        assert lo99 <= p.p_violation <= hi99, (m, p)
        inside_95 += m.p_low <= p.p_violation <= m.p_high
    assert inside_95 >= len(measured.buckets) - 1


def test_request_log_round_trip_and_errors(tmp_path):
    recs = synthetic_log(np.random.default_rng(3), 30)
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in recs))
    assert read_request_log(path) == recs
    assert read_lengths(path) == [r.prompt_tokens for r in recs]
    assert read_lengths(path, "completion_tokens") == [16] * 30
    path.write_text(recs[0].to_json() + "\n{\"time\": 1}\n")
    with pytest.raises(ValueError, match=r"requests.jsonl:2: not a request-log record"):
        read_request_log(path)
    with pytest.raises(ValueError, match="status must be one of"):
        record(0, 1, 0.1, status="fine")


def test_cli_slo_risk_json_prediction_and_png(tmp_path, cli):
    rng = np.random.default_rng(4)
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(r.to_json() + "\n" for r in synthetic_log(rng, 2000)))
    mix = tmp_path / "mix.csv"
    mix.write_text("ContextTokens\n" + "".join(f"{v}\n" for v in rng.integers(1, 3000, 500)))
    png = tmp_path / "risk.png"
    rc, out, _ = cli("diag", "slo-risk", log, "--ttft", "600ms", "--tpot", "100ms", "--predict", mix,
                     "--json", "--png", png)
    got = json.loads(out)
    assert rc == 0
    assert got["measured"]["slo"] == {"ttft_s": 0.6, "tpot_s": 0.1}
    assert got["measured"]["num_requests"] == 2000
    assert sum(b["num_requests"] for b in got["measured"]["buckets"]) == 2000
    assert got["predicted"]["num_requests"] == 500
    assert got["latency_model"]["c_s_per_token2"] >= 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    rc, _, err = cli("diag", "slo-risk", log, "--ttft", "soon")
    assert rc == 2 and "cannot read 'soon' as a duration" in err
