"""Request-length distributions: fit candidates by maximum likelihood, compare, choose or reject.

Algorithm. Token counts are whole numbers, so every candidate is scored as a discrete model:
P(k) = F(k + 0.5) - F(k - 0.5) for a continuous CDF F (which also makes the likelihoods of
all candidates comparable, AIC included). The observed maximum is the cap:

- `lognormal`, `gamma`, `lognormal_mixture2`: F as is; mass above the cap is simply missed;
- `lognormal_truncated`: values above the cap were dropped, P(k) / F(cap + 0.5);
- `lognormal_censored`: values above the cap were clipped to it, P(cap) = 1 - F(cap - 0.5)
  (outputs cut at max_tokens pile up there).

The cap counts as a fitted parameter of the last two. The censored model is fitted only when
the count at the cap is a pile: at least 3 and improbable (Poisson tail < 1e-3) against the
counts per value in the top tenth below it. (Otherwise it would always win: the largest
value of any sample is "at the cap", and the tail mass beats one value's probability.) Each fit reports the Kolmogorov-Smirnov
distance D between the empirical CDF and the model's CDF on the observed counts, and
AIC = 2 k - 2 ln L. The chosen model has the lowest AIC among those with D <= `max_ks`; when
no candidate is that close, none is chosen (large samples reject every simple model, which
is the honest answer for production traces). A model that uses the cap must beat the best
model without one by CAP_EVIDENCE_AIC: the cap is estimated at the sample maximum, and on
data with no cap its likelihood gain is about 2 Exp(1) ~ chi2(2), so AIC's penalty of 2
would pick it one time in seven by chance; 10 makes that about 1 in 400 (a real cap of even
1% of the mass gains far more). Last, a model with fewer parameters within PARSIMONY_AIC of
the choice is preferred (Burnham & Anderson's "substantial support").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

from ctxwarden.diagnostics.distributions import Gamma, LogNormal, LogNormalMixture2

CAP_NONE, CAP_TRUNCATED, CAP_CENSORED = "none", "truncated", "censored"
DEFAULT_MAX_KS = 0.05
MIN_SAMPLES = 20
MIN_PILE_COUNT = 3
PILE_P_VALUE = 1e-3
CAP_EVIDENCE_AIC = 10.0
PARSIMONY_AIC = 2.0


@dataclass(frozen=True)
class Candidate:
    """One model to fit: a continuous family and how it treats the cap."""

    name: str
    family: object  # LogNormal | Gamma | LogNormalMixture2
    cap_mode: str = CAP_NONE

    @property
    def num_params(self) -> int:
        """The family's parameters, plus the cap when the cap shapes the model."""
        return self.family.num_params + (self.cap_mode != CAP_NONE)


CANDIDATES = (
    Candidate("lognormal", LogNormal()),
    Candidate("lognormal_truncated", LogNormal(), CAP_TRUNCATED),
    Candidate("lognormal_censored", LogNormal(), CAP_CENSORED),
    Candidate("gamma", Gamma()),
    Candidate("lognormal_mixture2", LogNormalMixture2()),
)


@dataclass(frozen=True)
class LengthCounts:
    """A sample of token counts as its distinct values (ascending) and how often each occurs."""

    values: np.ndarray  # int64, ascending, unique
    counts: np.ndarray  # int64, same length

    @property
    def n(self) -> int:
        """Number of observations."""
        return int(self.counts.sum())

    @property
    def cap(self) -> int:
        """The largest observed count: where truncation or censoring would act."""
        return int(self.values[-1])


@dataclass(frozen=True)
class LengthFit:
    """One fitted candidate: readable parameters, KS distance, log-likelihood and AIC."""

    model: str
    params: dict[str, float]
    ks: float
    log_likelihood: float
    num_params: int

    @property
    def aic(self) -> float:
        """Akaike's information criterion, 2 k - 2 ln L (lower is better)."""
        return 2 * self.num_params - 2 * self.log_likelihood

    def to_dict(self) -> dict:
        """JSON-ready: model, params, ks, aic (the stable keys) plus ln L and k."""
        return {"model": self.model, "params": self.params, "ks": self.ks, "aic": self.aic,
                "log_likelihood": self.log_likelihood, "num_params": self.num_params}


@dataclass(frozen=True)
class LengthReport:
    """Summary of a length sample, every candidate's fit and the choice (or None)."""

    n: int
    median: float
    p99: float
    cap: int
    share_at_cap: float
    is_pile_at_cap: bool  # the censored model was fitted
    fits: tuple[LengthFit, ...]
    chosen: str | None
    max_ks: float
    reason: str  # why this model was chosen, or why none was

    def to_dict(self) -> dict:
        """The `ctxwarden diag lengths --json` object (docs/diagnostics.md)."""
        return {"n": self.n, "median": self.median, "p99": self.p99, "cap": self.cap,
                "share_at_cap": self.share_at_cap, "pile_at_cap": self.is_pile_at_cap, "fits": [f.to_dict() for f in self.fits],
                "chosen": self.chosen, "max_ks": self.max_ks, "reason": self.reason}


def length_counts(values) -> LengthCounts:
    """Validate a sample of token counts (whole numbers >= 1, at least MIN_SAMPLES) and count it."""
    x = np.asarray(values, dtype=float).ravel()
    if x.size < MIN_SAMPLES:
        raise ValueError(f"a length fit needs at least {MIN_SAMPLES} values, got {x.size}; "
                         "pass a longer log")
    bad = x[(x < 1) | (x != np.round(x)) | ~np.isfinite(x)]
    if bad.size:
        raise ValueError(f"token counts must be whole numbers >= 1; got {bad[0]!r} "
                         f"({bad.size} such values): filter failed or empty requests first")
    vals, counts = np.unique(x.astype(np.int64), return_counts=True)
    return LengthCounts(vals, counts)


def analyze_lengths(values, max_ks: float = DEFAULT_MAX_KS) -> LengthReport:
    """Fit every candidate to `values`, compare them and choose one or none (see module doc)."""
    if not 0 < max_ks <= 1:
        raise ValueError(f"max_ks must be in (0, 1], got {max_ks}")
    data = length_counts(values)
    pile = is_pile_at_cap(data)
    fits = tuple(fit_candidate(c, data) for c in CANDIDATES if pile or c.cap_mode != CAP_CENSORED)
    chosen, reason = choose_fit(fits, max_ks)
    x = np.repeat(data.values, data.counts)
    return LengthReport(n=data.n, median=float(np.median(x)), p99=float(np.percentile(x, 99)),
                        cap=data.cap, share_at_cap=float(data.counts[-1] / data.n), is_pile_at_cap=pile,
                        fits=fits, chosen=chosen, max_ks=max_ks, reason=reason)


def is_pile_at_cap(data: LengthCounts) -> bool:
    """True when the cap holds far more requests than the values just below it (see module doc)."""
    at_cap = int(data.counts[-1])
    if at_cap < MIN_PILE_COUNT:
        return False
    lo = int(0.9 * data.cap)
    width = max(data.cap - lo, 1)
    below = data.counts[(data.values >= lo) & (data.values < data.cap)].sum()
    per_value = max(below, 0.5) / width  # 0.5: a floor so an empty window still gives a rate
    return bool(stats.poisson.sf(at_cap - 1, per_value) < PILE_P_VALUE)


def choose_fit(fits: tuple[LengthFit, ...], max_ks: float) -> tuple[str | None, str]:
    """Lowest AIC among fits with KS D <= max_ks, after the cap and parsimony rules (module doc);
    None, with the closest fit named, when no fit is within max_ks."""
    ok = sorted((f for f in fits if f.ks <= max_ks), key=lambda f: f.aic)
    if not ok:
        best = min(fits, key=lambda f: f.ks)
        return None, (f"no candidate is within KS D <= {max_ks:g}; the closest is {best.model} "
                      f"(D = {best.ks:.3f}): describe this sample empirically")
    best, why = ok[0], f"lowest AIC among {len(ok)} candidate(s) with KS D <= {max_ks:g}"
    no_cap = [f for f in ok if not _uses_cap(f)]
    if _uses_cap(best) and no_cap and no_cap[0].aic - best.aic < CAP_EVIDENCE_AIC:
        best, why = no_cap[0], (f"{ok[0].model} is only {no_cap[0].aic - ok[0].aic:.1f} AIC lower, under "
                                f"the {CAP_EVIDENCE_AIC:g} a cap model needs: no evidence of a cap")
    simpler = [f for f in ok if f.num_params < best.num_params and f.aic - best.aic <= PARSIMONY_AIC
               and (not _uses_cap(f) or _uses_cap(best))]
    if simpler:
        fewest = min(simpler, key=lambda f: (f.num_params, f.aic))
        return fewest.model, (f"within {PARSIMONY_AIC:g} AIC of {best.model} "
                              f"({fewest.aic - best.aic:+.1f}) with fewer parameters")
    others = [f for f in ok if f is not best]
    margin = f", AIC {others[0].aic - best.aic:.1f} below {others[0].model}" if others else ""
    return best.model, why + margin


def _uses_cap(fit: LengthFit) -> bool:
    return next(c for c in CANDIDATES if c.name == fit.model).cap_mode != CAP_NONE


def fit_candidate(candidate: Candidate, data: LengthCounts) -> LengthFit:
    """Maximum-likelihood fit of one candidate to counted data; KS distance at the optimum."""
    log_x = np.log(data.values.astype(float))
    weights = data.counts.astype(float)
    starts = candidate.family.starts(log_x, weights)
    best = min((_maximise(candidate, data, s) for s in starts), key=lambda r: r.fun)
    return LengthFit(model=candidate.name, params=candidate.family.params(best.x),
                     ks=ks_distance(candidate, best.x, data), log_likelihood=-float(best.fun),
                     num_params=candidate.num_params)


def _maximise(candidate: Candidate, data: LengthCounts, start: np.ndarray):
    def nll(theta: np.ndarray) -> float:
        p = discrete_pmf(candidate, theta, data.values, data.cap)
        return -float(data.counts @ np.log(np.maximum(p, 1e-300)))

    return optimize.minimize(nll, start, method="Nelder-Mead",
                             options={"xatol": 1e-7, "fatol": 1e-7, "maxiter": 4000, "adaptive": True})


def discrete_pmf(candidate: Candidate, theta: np.ndarray, k: np.ndarray, cap: int) -> np.ndarray:
    """P(count == k) under the candidate, with the cap applied as the candidate says."""
    fam = candidate.family
    n = len(k)
    cdf, sf = fam.cdf_sf(np.concatenate([k - 0.5, k + 0.5]), theta)  # one pass over both edges
    # Subtract CDFs below the median and survival functions above it: the tail keeps its digits.
    p = np.where(cdf[:n] < 0.5, cdf[n:] - cdf[:n], sf[:n] - sf[n:])
    if candidate.cap_mode == CAP_TRUNCATED:
        p = p / max(float(fam.cdf(np.array(cap + 0.5), theta)), 1e-300)
    elif candidate.cap_mode == CAP_CENSORED:
        p = np.where(k >= cap, fam.sf(np.array(cap - 0.5), theta), p)
    return p


def discrete_cdf(candidate: Candidate, theta: np.ndarray, k: np.ndarray, cap: int) -> np.ndarray:
    """P(count <= k) under the candidate (1 at the cap for the truncated and censored models)."""
    f = candidate.family.cdf(np.asarray(k, dtype=float) + 0.5, theta)
    if candidate.cap_mode == CAP_TRUNCATED:
        f = f / max(float(candidate.family.cdf(np.array(cap + 0.5), theta)), 1e-300)
    if candidate.cap_mode != CAP_NONE:
        f = np.where(np.asarray(k) >= cap, 1.0, np.minimum(f, 1.0))
    return f


def ks_distance(candidate: Candidate, theta: np.ndarray, data: LengthCounts) -> float:
    """sup |ECDF - model CDF| over the observed counts, checked on both sides of every jump."""
    ecdf = np.cumsum(data.counts) / data.n
    after = discrete_cdf(candidate, theta, data.values, data.cap)
    before = discrete_cdf(candidate, theta, data.values - 1, data.cap)
    ecdf_before = np.concatenate([[0.0], ecdf[:-1]])
    return float(max(np.abs(ecdf - after).max(), np.abs(ecdf_before - before).max()))


def fitted_theta(fit: LengthFit) -> tuple[Candidate, np.ndarray]:
    """The candidate and its unconstrained parameter vector back from a fit (for plots)."""
    cand = next(c for c in CANDIDATES if c.name == fit.model)
    p = fit.params
    if isinstance(cand.family, LogNormal):
        return cand, np.array([p["mu"], np.log(p["sigma"])])
    if isinstance(cand.family, Gamma):
        return cand, np.log([p["shape"], p["scale"]])
    return cand, np.array([cand.family.theta_of_weight(p["weight1"]), p["mu1"], np.log(p["sigma1"]), p["mu2"], np.log(p["sigma2"])])
