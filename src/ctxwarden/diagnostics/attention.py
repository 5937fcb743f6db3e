"""Attention-collapse alerts against a calibrated per-head baseline (no torch).

Entropy collapse (a head that stops spreading its attention) is judged per head, against
that head's own behaviour: sink heads are low-entropy by nature, so one global threshold
would flag them forever. The first `calibration_requests` monitored requests set each
head's mean and spread (the larger of the standard deviation and 1.4826 x the median
absolute deviation); after that a request whose normalised entropy in a head falls below

    mean - max(num_sigma x spread, min_drop)

raises an alert naming the layer and the head. `min_drop` keeps heads that barely vary
across prompts (random weights: entropy ~1.0 everywhere) from alerting on noise.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

DEFAULT_CALIBRATION_REQUESTS = 16
DEFAULT_NUM_SIGMA = 6.0
DEFAULT_MIN_DROP = 0.002


@dataclass(frozen=True)
class CollapseAlert:
    """One head of one request far below its baseline entropy."""

    layer: int
    head: int
    entropy: float
    baseline_mean: float
    baseline_spread: float
    threshold: float


@dataclass
class CollapseDetector:
    """Calibrates on the first requests, then checks every later one (module doc)."""

    calibration_requests: int = DEFAULT_CALIBRATION_REQUESTS
    num_sigma: float = DEFAULT_NUM_SIGMA
    min_drop: float = DEFAULT_MIN_DROP
    _calibration: list = field(default_factory=list)  # per request: [L][H] entropies
    baseline: list | None = None  # [L][H] (mean, spread)

    def __post_init__(self):
        if self.calibration_requests < 2:
            raise ValueError(f"calibration_requests must be >= 2 (a spread needs two), got {self.calibration_requests}")

    @property
    def is_calibrated(self) -> bool:
        """Whether the baseline is set (alerts are raised only after that)."""
        return self.baseline is not None

    def observe(self, entropy: list[list[float | None]]) -> list[CollapseAlert]:
        """Fold one request's [layer][head] entropies in; the alerts it raises (none while calibrating)."""
        if self.baseline is None:
            self._calibration.append(entropy)
            if len(self._calibration) >= self.calibration_requests:
                self.baseline = _baseline(self._calibration)
            return []
        out = []
        for l, heads in enumerate(entropy):
            for h, value in enumerate(heads):
                mean, spread = self.baseline[l][h]
                if value is None or mean is None:
                    continue
                threshold = mean - max(self.num_sigma * spread, self.min_drop)
                if value < threshold:
                    out.append(CollapseAlert(l, h, value, mean, spread, threshold))
        return out


def _baseline(requests: list) -> list:
    num_layers, num_heads = len(requests[0]), len(requests[0][0])
    out = []
    for l in range(num_layers):
        row = []
        for h in range(num_heads):
            values = [r[l][h] for r in requests if r[l][h] is not None]
            if len(values) < 2:
                row.append((None, None))
                continue
            median = statistics.median(values)
            mad = 1.4826 * statistics.median(abs(v - median) for v in values)
            row.append((statistics.fmean(values), max(statistics.stdev(values), mad)))
        out.append(row)
    return out
