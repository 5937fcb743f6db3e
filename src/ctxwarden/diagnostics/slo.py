"""SLO risk by prompt-length bucket, and a latency model that predicts it for a new length mix.

Measured risk. A request violates the SLO when it failed (status "error"), when its time to
first token exceeds `ttft_s`, or (with `tpot_s`) when its time per output token exceeds it.
Requests that never produced a token without an error (aborted: the client left) are left out.
Per bucket: share of traffic, P(violation) with a Wilson score interval, expected violations
per 1,000 requests of all traffic that come from this bucket (the column sums to the overall
rate) and the bucket's share of all violations.

Predicted risk. TTFT is fitted as a + b L + c L^2 (L: prompt tokens prefill computed, i.e.
not served from the prefix cache; a, b, c >= 0; least squares on ln TTFT, so the noise is
multiplicative and long prompts do not dominate), and the ratios measured / fitted are kept
as the noise (queueing included, as it was measured). P(TTFT > T | L) is the share of those ratios above T / fit(L). Only TTFT is
predicted; lengths beyond the longest one fitted are flagged as extrapolated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from scipy import optimize

from ctxwarden.diagnostics.request_log import RequestRecord

WILSON_Z_95 = 1.959963984540054
MIN_FIT_REQUESTS = 10


@dataclass(frozen=True)
class SLO:
    """Latency objectives: time to first token, and optionally time per output token."""

    ttft_s: float
    tpot_s: float | None = None

    def __post_init__(self):
        if not self.ttft_s > 0 or (self.tpot_s is not None and not self.tpot_s > 0):
            raise ValueError(f"SLO targets must be > 0 s, got ttft {self.ttft_s}, tpot {self.tpot_s}")


@dataclass(frozen=True)
class BucketRisk:
    """One length bucket [lo_tokens, hi_tokens): traffic, violations and their rates."""

    lo_tokens: int
    hi_tokens: int
    num_requests: int
    share_of_traffic: float
    num_violations: int
    p_violation: float
    p_low: float  # Wilson interval (measured) or equal to p_violation (predicted)
    p_high: float
    violations_per_1000: float  # per 1,000 requests of ALL traffic, from this bucket
    share_of_violations: float


@dataclass(frozen=True)
class SLORisk:
    """Measured risk per bucket for one SLO, with the totals."""

    slo: SLO
    buckets: tuple[BucketRisk, ...]
    num_requests: int
    num_excluded: int
    num_violations: int

    def to_dict(self) -> dict:
        """JSON-ready (docs/diagnostics.md)."""
        return {"slo": asdict(self.slo), "num_requests": self.num_requests,
                "num_excluded": self.num_excluded, "num_violations": self.num_violations,
                "buckets": [asdict(b) for b in self.buckets]}


def wilson_interval(num_successes: int, num_trials: int, z: float = WILSON_Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; (0, 1) when there are no trials."""
    if num_trials == 0:
        return 0.0, 1.0
    p = num_successes / num_trials
    denom = 1 + z * z / num_trials
    centre = (p + z * z / (2 * num_trials)) / denom
    half = z * np.sqrt(p * (1 - p) / num_trials + z * z / (4 * num_trials**2)) / denom
    # exact ends at 0 and n (the formula leaves rounding dust of 1e-18 there)
    lo = 0.0 if num_successes == 0 else max(0.0, centre - half)
    hi = 1.0 if num_successes == num_trials else min(1.0, centre + half)
    return float(lo), float(hi)


def is_violation(record: RequestRecord, slo: SLO) -> bool | None:
    """True / False, or None when the request is left out (aborted before any token)."""
    if record.status == "error":
        return True
    if record.ttft_s is None:
        return None
    late_tpot = slo.tpot_s is not None and record.tpot_s is not None and record.tpot_s > slo.tpot_s
    return record.ttft_s > slo.ttft_s or late_tpot


def default_edges(lengths) -> tuple[int, ...]:
    """Bucket edges 0, 128, 256, ... doubling until the longest length is inside."""
    top = int(max(lengths)) if len(lengths) else 1
    edges = [0, 128]
    while edges[-1] <= top:
        edges.append(edges[-1] * 2)
    return tuple(edges)


def parse_edges(text: str) -> tuple[int, ...]:
    """'0,512,2048,8192' -> edges; they must start at 0 and increase."""
    try:
        edges = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--buckets must be comma-separated token counts, got {text!r}") from None
    if len(edges) < 2 or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--buckets must start at 0 and increase (e.g. 0,512,2048), got {text!r}")
    return edges


def measure_risk(records: list[RequestRecord], slo: SLO, edges: tuple[int, ...] | None = None) -> SLORisk:
    """Measured SLO risk per prompt-length bucket (empty buckets are left out)."""
    judged = [(r.prompt_tokens, v) for r in records if (v := is_violation(r, slo)) is not None]
    if not judged:
        raise ValueError("no request in the log can be judged (all aborted before a token)")
    lengths = np.array([j[0] for j in judged])
    viol = np.array([j[1] for j in judged], dtype=bool)
    edges = edges or default_edges(lengths)
    total_viol = int(viol.sum())
    buckets = []
    for lo, hi in _spans(edges, int(lengths.max())):
        inside = (lengths >= lo) & (lengths < hi)
        if inside.any():
            buckets.append(_bucket(lo, hi, int(inside.sum()), int(viol[inside].sum()), len(judged), total_viol))
    return SLORisk(slo, tuple(buckets), len(judged), len(records) - len(judged), total_viol)


def _spans(edges: tuple[int, ...], longest: int) -> list[tuple[int, int]]:
    spans = list(zip(edges, edges[1:]))
    if longest >= edges[-1]:  # lengths past the last edge get their own open bucket
        spans.append((edges[-1], longest + 1))
    return spans


def _bucket(lo: int, hi: int, n: int, k: int, n_total: int, k_total: int) -> BucketRisk:
    p_low, p_high = wilson_interval(k, n)
    return BucketRisk(lo, hi, n, n / n_total, k, k / n, p_low, p_high,
                      1000.0 * k / n_total, k / k_total if k_total else 0.0)


@dataclass(frozen=True)
class LatencyModel:
    """TTFT(L) = a + b L + c L^2 seconds, with the measured/fitted ratios as the noise."""

    a_s: float
    b_s_per_token: float
    c_s_per_token2: float
    log_ratios: tuple[float, ...]  # ln(measured / fitted), sorted
    max_fitted_tokens: int
    num_requests: int

    def ttft_s(self, computed_tokens) -> np.ndarray:
        """The fitted (typical) TTFT for prompts of `computed_tokens` uncached tokens."""
        L = np.asarray(computed_tokens, dtype=float)
        return self.a_s + self.b_s_per_token * L + self.c_s_per_token2 * L * L

    def p_ttft_over(self, computed_tokens, ttft_s: float) -> np.ndarray:
        """P(TTFT > ttft_s) for each length, from the empirical noise ratios."""
        ratios = np.asarray(self.log_ratios)
        need = np.log(ttft_s / np.maximum(self.ttft_s(computed_tokens), 1e-12))
        # share of ratios strictly above the needed one
        return 1.0 - np.searchsorted(ratios, need, side="right") / len(ratios)

    def to_dict(self) -> dict:
        """Coefficients and noise summary (the full ratio list stays out of the JSON)."""
        r = np.asarray(self.log_ratios)
        return {"a_s": self.a_s, "b_s_per_token": self.b_s_per_token,
                "c_s_per_token2": self.c_s_per_token2, "max_fitted_tokens": self.max_fitted_tokens,
                "num_requests": self.num_requests,
                "ratio_p50": float(np.exp(np.median(r))), "ratio_p90": float(np.exp(np.percentile(r, 90)))}


def fit_latency_model(records: list[RequestRecord]) -> LatencyModel:
    """Fit TTFT against computed prompt tokens on the requests that produced a token."""
    rows = [(r.computed_prompt_tokens, r.ttft_s) for r in records if r.ttft_s is not None and r.ttft_s > 0]
    if len(rows) < MIN_FIT_REQUESTS:
        raise ValueError(f"a latency model needs at least {MIN_FIT_REQUESTS} requests with a TTFT, "
                         f"got {len(rows)}")
    L = np.array([r[0] for r in rows], dtype=float)
    t = np.array([r[1] for r in rows], dtype=float)
    coef = _fit_log_quadratic(L, t)
    fitted = np.maximum(coef[0] + coef[1] * L + coef[2] * L * L, 1e-12)
    return LatencyModel(float(coef[0]), float(coef[1]), float(coef[2]),
                        tuple(np.sort(np.log(t / fitted)).tolist()), int(L.max()), len(rows))


def _fit_log_quadratic(L: np.ndarray, t: np.ndarray) -> np.ndarray:
    """(a, b, c) >= 0 minimising sum (ln t - ln(a + b L + c L^2))^2: the maximum-likelihood fit
    under multiplicative (lognormal) noise, which queueing delays resemble."""
    scale = np.array([np.median(t), np.median(t) / max(L.max(), 1.0), np.median(t) / max(L.max(), 1.0) ** 2])

    def residuals(u: np.ndarray) -> np.ndarray:
        u = u * scale
        return np.log(t) - np.log(np.maximum(u[0] + u[1] * L + u[2] * L * L, 1e-12))

    start = np.array([0.5, 0.5, 0.5])
    return optimize.least_squares(residuals, start, bounds=(0.0, np.inf)).x * scale


@dataclass(frozen=True)
class RiskPrediction:
    """Predicted TTFT risk per bucket for a length mix, from a latency model."""

    slo: SLO
    buckets: tuple[BucketRisk, ...]
    num_requests: int
    share_extrapolated: float  # share of the mix longer than the model's longest fitted prompt

    def to_dict(self) -> dict:
        """JSON-ready (docs/diagnostics.md)."""
        return {"slo": asdict(self.slo), "num_requests": self.num_requests,
                "share_extrapolated": self.share_extrapolated,
                "buckets": [asdict(b) for b in self.buckets]}


def predict_risk(model: LatencyModel, prompt_tokens, slo: SLO, edges: tuple[int, ...] | None = None,
                 computed_tokens=None) -> RiskPrediction:
    """Expected TTFT violations per prompt-length bucket if this mix were served like the fitted log.

    `computed_tokens` (default: all of `prompt_tokens`) is what prefill computes per request,
    for a mix whose prefix-cache hits are known.
    """
    L = np.asarray(prompt_tokens, dtype=float)
    if L.size == 0:
        raise ValueError("the length mix to predict is empty")
    computed = L if computed_tokens is None else np.asarray(computed_tokens, dtype=float)
    p = model.p_ttft_over(computed, slo.ttft_s)
    edges = edges or default_edges(L)
    expected_total = float(p.sum())
    buckets = []
    for lo, hi in _spans(edges, int(L.max())):
        inside = (L >= lo) & (L < hi)
        if inside.any():
            k = float(p[inside].sum())
            n = int(inside.sum())
            buckets.append(BucketRisk(lo, hi, n, n / L.size, round(k), k / n, k / n, k / n,
                                      1000.0 * k / L.size, k / expected_total if expected_total else 0.0))
    return RiskPrediction(slo, tuple(buckets), int(L.size),
                          float((computed > model.max_fitted_tokens).mean()))
