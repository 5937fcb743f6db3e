"""The slow-leak detector: does memory (or TTFT) grow with the number of requests served?

Samples pair a count of completed requests with the process's RssAnon + VmSwap (file pages
such as memory-mapped weights come and go on their own; a leak is anonymous memory). The
slope is fitted robustly (Theil-Sen: the median of all pairwise slopes, with its
distribution-free confidence interval), so a garbage-collection spike or an allocator step
moves it little; R^2 of that line says whether growth is steady (a leak) or a step.

Allocator retention looks like a leak: glibc keeps freed heap pages for reuse. The trim
probe calls `malloc_trim(0)` (which hands free pages back to the kernel) in the process
being sampled: a slope that survives the trim is memory still referenced, one that vanishes
was retention.

TTFT drift: Huber regression of TTFT on [1, L, L^2, completed requests] (L: prompt
tokens), so a mix that drifts towards longer prompts is not mistaken for a slowing engine;
its confidence interval comes from a bootstrap over requests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import asdict, dataclass

import numpy as np

from ctxwarden.diagnostics.process_memory import read_leak_basis_bytes

MIN_SAMPLES = 10
MAX_FIT_POINTS = 2000  # Theil-Sen is O(n^2): thin longer series evenly
DEFAULT_MIN_SLOPE_BYTES = 1024.0  # per request: below this a "leak" is noise for any real service
DEFAULT_MIN_R_SQUARED = 0.5
HUBER_K = 1.345  # Huber's constant: 95% efficiency under normal noise


@dataclass(frozen=True)
class SlopeFit:
    """y = intercept + slope x, robustly; slope interval at `confidence`."""

    slope: float
    intercept: float
    slope_low: float
    slope_high: float
    r_squared: float | None  # None when y does not vary at all
    num_samples: int
    confidence: float

    @property
    def contains_zero(self) -> bool:
        """True when the slope interval includes 0 (no evidence of growth or shrinkage)."""
        return self.slope_low <= 0.0 <= self.slope_high


def robust_slope(x, y, confidence: float = 0.95, max_points: int = MAX_FIT_POINTS) -> SlopeFit:
    """Theil-Sen fit with its confidence interval and the R^2 of the fitted line (series
    longer than `max_points` thinned evenly)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size != y.size or x.size < MIN_SAMPLES:
        raise ValueError(f"a slope needs at least {MIN_SAMPLES} paired samples, got {x.size} x and {y.size} y")
    if np.ptp(x) == 0:
        raise ValueError("every sample has the same x (completed requests): nothing to fit against")
    if x.size > max_points:
        keep = np.linspace(0, x.size - 1, max_points).round().astype(int)
        x, y = x[keep], y[keep]
    from scipy import stats  # here, not at import: scipy.stats took 1.7 s of every server's start

    slope, intercept, low, high = stats.theilslopes(y, x, alpha=confidence)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = None if ss_tot == 0 else 1.0 - float(((y - intercept - slope * x) ** 2).sum()) / ss_tot
    return SlopeFit(float(slope), float(intercept), float(low), float(high), r2, int(x.size), confidence)


SERVER_FIT_POINTS = 400  # a server refits every few seconds: 80,000 pairwise slopes at most


@dataclass(frozen=True)
class RequestSlope:
    """A server's slope of RssAnon + VmSwap per completed request, and the requests it spans."""

    fit: SlopeFit
    first_completed: int
    last_completed: int

    def to_dict(self) -> dict:
        """JSON-ready: the fit's fields, the requests it spans, the unit."""
        return {**asdict(self.fit), "first_completed": self.first_completed, "last_completed": self.last_completed,
                "unit": "bytes per request"}


def per_request_slope(samples: list[dict], warmup_requests: int = 0,
                      max_points: int = SERVER_FIT_POINTS) -> RequestSlope | None:
    """The Theil-Sen slope of a server's memory samples ({"completed_requests",
    "leak_basis_bytes"}) against completed requests, skipping those before
    `warmup_requests`. The samples of one count are reduced to their median first (an
    idle server samples the same count for as long as it idles, and those would outweigh
    the busy minutes). None until MIN_SAMPLES distinct counts exist."""
    by_count: dict[int, list[int]] = {}
    for s in samples:
        c = s.get("completed_requests")
        if c is not None and c >= warmup_requests:
            by_count.setdefault(int(c), []).append(s["leak_basis_bytes"])
    if len(by_count) < MIN_SAMPLES:
        return None
    x = sorted(by_count)
    fit = robust_slope(x, [float(np.median(by_count[c])) for c in x], max_points=max_points)
    return RequestSlope(fit, x[0], x[-1])


@dataclass(frozen=True)
class DriftFit:
    """TTFT change per 1,000 completed requests at a fixed prompt length, with its interval."""

    seconds_per_1000_requests: float
    low: float
    high: float
    median_ttft_s: float
    num_samples: int

    @property
    def contains_zero(self) -> bool:
        """True when the interval includes 0 (no evidence of drift)."""
        return self.low <= 0.0 <= self.high


def ttft_drift(completed, prompt_tokens, ttft_s, confidence: float = 0.95, num_bootstrap: int = 200,
               seed: int = 0) -> DriftFit:
    """Huber regression of TTFT on prompt length (linear + quadratic) and completed requests."""
    c, L, t = (np.asarray(v, dtype=float) for v in (completed, prompt_tokens, ttft_s))
    if not c.size == L.size == t.size or c.size < MIN_SAMPLES:
        raise ValueError(f"TTFT drift needs at least {MIN_SAMPLES} requests with completed count, "
                         f"prompt tokens and TTFT each, got {c.size}, {L.size}, {t.size}")
    design = _drift_design(c, L)
    beta = huber_regression(design, t)
    rng = np.random.default_rng(seed)
    draws = [huber_regression(design[idx], t[idx])[3] for idx in
             (rng.integers(0, t.size, t.size) for _ in range(num_bootstrap))]
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(draws, [tail, 100 - tail])
    return DriftFit(1000 * float(beta[3]) / _scale(c), 1000 * float(lo) / _scale(c),
                    1000 * float(hi) / _scale(c), float(np.median(t)), int(t.size))


def _scale(v: np.ndarray) -> float:
    return float(max(np.abs(v).max(), 1.0))


def _drift_design(c: np.ndarray, L: np.ndarray) -> np.ndarray:
    # columns scaled to [0, 1] so the IRLS solve is well conditioned; slopes are unscaled after
    Ls = L / _scale(L)
    return np.stack([np.ones_like(c), Ls, Ls * Ls, c / _scale(c)], axis=1)


def huber_regression(design: np.ndarray, y: np.ndarray, num_iterations: int = 50) -> np.ndarray:
    """Coefficients minimising Huber's loss (k = 1.345 MAD-scaled residuals), by IRLS."""
    beta = np.linalg.lstsq(design, y, rcond=None)[0]
    for _ in range(num_iterations):
        r = y - design @ beta
        scale = max(1.4826 * np.median(np.abs(r - np.median(r))), 1e-12)
        w = np.minimum(1.0, HUBER_K * scale / np.maximum(np.abs(r), 1e-300))
        sw = np.sqrt(w)
        new = np.linalg.lstsq(design * sw[:, None], y * sw, rcond=None)[0]
        if np.allclose(new, beta, rtol=1e-10, atol=1e-14):
            return new
        beta = new
    return beta


@dataclass(frozen=True)
class LeakSample:
    """One observation: requests completed so far and the leak basis (RssAnon + VmSwap) then."""

    completed_requests: int
    leak_basis_bytes: int
    trimmed_leak_basis_bytes: int | None = None  # right after malloc_trim(0) (trim probe)
    prompt_tokens: int | None = None  # of the request that just completed (for TTFT drift)
    ttft_s: float | None = None


@dataclass(frozen=True)
class LeakReport:
    """Slopes (raw and after trim), TTFT drift, and the verdict with its reason."""

    rss: SlopeFit
    trimmed: SlopeFit | None
    ttft: DriftFit | None
    verdict: str  # leak | allocator retention | no leak | inconclusive
    reason: str

    def to_dict(self) -> dict:
        """JSON-ready (docs/diagnostics.md)."""
        return {"verdict": self.verdict, "reason": self.reason,
                "rss": {**asdict(self.rss), "unit": "bytes per request"},
                "trimmed": {**asdict(self.trimmed), "unit": "bytes per request"} if self.trimmed else None,
                "ttft": asdict(self.ttft) if self.ttft else None}


def assess_leak(samples: list[LeakSample], min_slope_bytes: float = DEFAULT_MIN_SLOPE_BYTES,
                min_r_squared: float = DEFAULT_MIN_R_SQUARED, warmup_requests: int = 0) -> LeakReport:
    """Fit every series the samples carry and decide (see `_verdict` for the rules)."""
    kept = [s for s in samples if s.completed_requests >= warmup_requests]
    x = [s.completed_requests for s in kept]
    rss = robust_slope(x, [s.leak_basis_bytes for s in kept])
    trimmed_ys = [s.trimmed_leak_basis_bytes for s in kept]
    trimmed = robust_slope(x, trimmed_ys) if all(v is not None for v in trimmed_ys) else None
    timed = [s for s in kept if s.ttft_s is not None and s.prompt_tokens is not None]
    ttft = (ttft_drift([s.completed_requests for s in timed], [s.prompt_tokens for s in timed],
                       [s.ttft_s for s in timed]) if len(timed) >= MIN_SAMPLES else None)
    verdict, reason = _verdict(rss, trimmed, min_slope_bytes, min_r_squared)
    return LeakReport(rss, trimmed, ttft, verdict, reason)


def slope_verdict(fit: SlopeFit, min_slope_bytes: float = DEFAULT_MIN_SLOPE_BYTES,
                  min_r_squared: float = DEFAULT_MIN_R_SQUARED) -> tuple[str, str]:
    """(verdict, reason) of one slope without a trim probe: leak, inconclusive or no leak."""
    return _verdict(fit, None, min_slope_bytes, min_r_squared)


def _grows(fit: SlopeFit, min_slope_bytes: float) -> bool:
    return fit.slope_low > 0 and fit.slope >= min_slope_bytes


def _verdict(rss: SlopeFit, trimmed: SlopeFit | None, min_slope: float, min_r2: float) -> tuple[str, str]:
    """leak: steady growth (interval above 0, slope >= min, R^2 >= min) that survives a trim;
    allocator retention: growth that malloc_trim removes; no leak: no growth; else inconclusive."""
    slope = f"{rss.slope:,.0f} B/request ({rss.slope_low:,.0f} to {rss.slope_high:,.0f}), R^2 {rss.r_squared or 0:.2f}"
    if not _grows(rss, min_slope):
        return "no leak", f"slope {slope}: below {min_slope:,.0f} B/request or its interval includes 0"
    if (rss.r_squared or 0) < min_r2:
        return "inconclusive", f"slope {slope}: growth, but not steady (R^2 < {min_r2}): a step or noise"
    if trimmed is not None and not _grows(trimmed, min_slope):
        return "allocator retention", (f"slope {slope}, but {trimmed.slope:,.0f} B/request after "
                                       "malloc_trim: the allocator keeps freed pages, nothing is referenced")
    return "leak", f"slope {slope}: steady growth" + (" that survives malloc_trim" if trimmed else "")


@dataclass(frozen=True)
class TrimResult:
    """What malloc_trim(0) handed back to the kernel in this process."""

    is_available: bool  # False: not glibc (musl, macOS): nothing was called
    before_bytes: int
    after_bytes: int

    @property
    def released_bytes(self) -> int:
        """Leak-basis bytes the trim returned to the kernel."""
        return self.before_bytes - self.after_bytes


def malloc_trim() -> bool | None:
    """Call glibc's malloc_trim(0) in this process; None where there is no glibc."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def trim_probe() -> TrimResult:
    """RssAnon + VmSwap of this process before and after malloc_trim(0)."""
    before = read_leak_basis_bytes()
    available = malloc_trim() is not None
    return TrimResult(available, before, read_leak_basis_bytes())
