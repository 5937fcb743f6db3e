"""Length fitting: known distributions are recovered and chosen; the real trace is rejected."""

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from ctxwarden.diagnostics.lengths import (CANDIDATES, analyze_lengths, discrete_cdf, discrete_pmf,
                                           fitted_theta, length_counts)

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "azure-llm-inference-2023-conv.csv"


def truncated_lognormal(rng, mu, sigma, cap, n):
    """Token counts from a lognormal, keeping only those <= cap (rejection sampling)."""
    out = np.empty(0)
    while out.size < n:
        v = np.round(rng.lognormal(mu, sigma, 2 * n))
        out = np.concatenate([out, v[(v >= 1) & (v <= cap)]])
    return out[:n].astype(int)


def fit_of(report, model):
    return next(f for f in report.fits if f.model == model)


def test_truncated_lognormal_is_recovered_and_chosen():
    mu, sigma = 6.6, 1.0
    x = truncated_lognormal(np.random.default_rng(14), mu, sigma, cap=2048, n=20_000)
    report = analyze_lengths(x)
    assert report.chosen == "lognormal_truncated", report.reason
    fit = fit_of(report, "lognormal_truncated")
    assert fit.params["mu"] == pytest.approx(mu, rel=0.02)
    assert fit.params["sigma"] == pytest.approx(sigma, rel=0.02)
    # the untruncated fit is biased low: the truncation is what it misses
    assert fit_of(report, "lognormal").params["mu"] < mu - 0.1


def test_censored_lognormal_piles_at_the_cap_and_is_chosen():
    rng = np.random.default_rng(3)
    x = np.minimum(np.maximum(np.round(rng.lognormal(5.0, 0.9, 20_000)), 1), 400).astype(int)
    report = analyze_lengths(x)
    assert report.cap == 400
    assert report.share_at_cap == pytest.approx(np.mean(x == 400))
    assert report.share_at_cap > 0.05
    assert report.chosen == "lognormal_censored", report.reason
    fit = fit_of(report, "lognormal_censored")
    assert fit.params["mu"] == pytest.approx(5.0, rel=0.02)
    assert fit.params["sigma"] == pytest.approx(0.9, rel=0.02)


@pytest.mark.parametrize("seed", range(3))
def test_plain_lognormal_prefers_the_model_without_a_cap(seed):
    x = np.maximum(np.round(np.random.default_rng(seed).lognormal(6.0, 0.7, 10_000)), 1).astype(int)
    report = analyze_lengths(x)
    assert report.chosen == "lognormal", report.reason
    assert not report.is_pile_at_cap


def test_gamma_sample_chooses_gamma():
    x = np.maximum(np.round(np.random.default_rng(6).gamma(3.0, 200.0, 10_000)), 1).astype(int)
    report = analyze_lengths(x)
    assert report.chosen == "gamma", report.reason
    assert fit_of(report, "gamma").params["shape"] == pytest.approx(3.0, rel=0.05)


def test_two_modes_choose_the_mixture():
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.lognormal(4.5, 0.4, 6000), rng.lognormal(7.0, 0.3, 4000)])
    report = analyze_lengths(np.maximum(np.round(x), 1).astype(int))
    assert report.chosen == "lognormal_mixture2", report.reason
    p = fit_of(report, "lognormal_mixture2").params
    mus = sorted([(p["mu1"], p["weight1"]), (p["mu2"], 1 - p["weight1"])])
    assert mus[0][0] == pytest.approx(4.5, abs=0.05) and mus[1][0] == pytest.approx(7.0, abs=0.05)
    assert mus[0][1] == pytest.approx(0.6, abs=0.02)


def test_ks_distance_matches_a_brute_force_scan():
    x = np.maximum(np.round(np.random.default_rng(8).lognormal(4.0, 1.2, 3000)), 1).astype(int)
    report = analyze_lengths(x)
    grid = np.arange(0, report.cap + 1)
    ecdf = np.searchsorted(np.sort(x), grid, side="right") / x.size
    for fit in report.fits:
        cand, theta = fitted_theta(fit)
        brute = np.abs(ecdf - discrete_cdf(cand, theta, grid, report.cap)).max()
        assert fit.ks == pytest.approx(brute, abs=1e-12), fit.model


def test_pmf_sums_to_the_cdf_for_every_candidate():
    x = np.maximum(np.round(np.random.default_rng(9).lognormal(4.0, 0.8, 2000)), 1).astype(int)
    report = analyze_lengths(x)
    k = np.arange(1, report.cap + 1)
    for fit in report.fits:
        cand, theta = fitted_theta(fit)
        pmf = discrete_pmf(cand, theta, k, report.cap)
        cdf = discrete_cdf(cand, theta, k, report.cap)
        below_one = cand.family.cdf(np.array(0.5), theta)  # mass of counts < 1
        assert np.cumsum(pmf) + below_one / (1 if cand.cap_mode != "truncated" else
                                             cand.family.cdf(np.array(report.cap + 0.5), theta)) \
            == pytest.approx(cdf, abs=1e-9), fit.model


def test_candidate_loglik_matches_scipy_for_the_lognormal():
    x = np.maximum(np.round(np.random.default_rng(10).lognormal(5.0, 0.6, 2000)), 1).astype(int)
    fit = fit_of(analyze_lengths(x), "lognormal")
    dist = stats.lognorm(s=fit.params["sigma"], scale=np.exp(fit.params["mu"]))
    direct = np.log(dist.cdf(x + 0.5) - dist.cdf(x - 0.5)).sum()
    assert fit.log_likelihood == pytest.approx(direct, rel=1e-9)
    assert fit.aic == pytest.approx(4 - 2 * direct, rel=1e-9)


def test_bad_samples_are_refused_with_the_limit():
    with pytest.raises(ValueError, match="at least 20"):
        length_counts([5] * 3)
    with pytest.raises(ValueError, match="whole numbers >= 1"):
        length_counts([1.5] + [3] * 30)
    with pytest.raises(ValueError, match="whole numbers >= 1"):
        length_counts([0] + [3] * 30)
    assert [c.name for c in CANDIDATES][:2] == ["lognormal", "lognormal_truncated"]


@pytest.mark.skipif(not TRACE.is_file(), reason=f"production trace not present at {TRACE}")
def test_real_azure_trace_rejects_every_simple_model():
    import csv

    with open(TRACE) as f:
        x = [int(r["ContextTokens"]) for r in csv.DictReader(f)]
    report = analyze_lengths(x)
    assert (report.n, report.median, report.p99) == (19_366, 1020, 4142)
    assert report.chosen is None and "no candidate" in report.reason
    lognormal = fit_of(report, "lognormal")
    # the trace's README: a single lognormal D = 0.16 (mu 6.63, sigma 0.99), gamma better (0.14)
    assert lognormal.ks == pytest.approx(0.16, abs=0.01)
    assert lognormal.params["mu"] == pytest.approx(6.63, abs=0.01)
    assert fit_of(report, "gamma").ks < lognormal.ks


def test_cli_lengths_json_and_png(tmp_path, cli):
    x = truncated_lognormal(np.random.default_rng(1), 5.5, 0.8, cap=1000, n=3000)
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"t,{v},{v // 3 + 1}\n" for v in x))
    png = tmp_path / "lengths.png"
    rc, out, _ = cli("diag", "lengths", trace, "--json", "--png", png)
    got = json.loads(out)
    assert rc == 0
    assert set(got) >= {"n", "median", "p99", "cap", "share_at_cap", "fits", "chosen"}
    assert got["n"] == 3000 and got["cap"] == int(x.max())
    # no pile at the cap: the censored model is not fitted
    assert got["pile_at_cap"] is False
    assert {f["model"] for f in got["fits"]} == {c.name for c in CANDIDATES} - {"lognormal_censored"}
    assert all(set(f) >= {"model", "params", "ks", "aic"} for f in got["fits"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = cli("diag", "lengths", trace, "--column", "Nope")
    assert rc == 2 and "no column 'Nope'" in err
