"""Live attention results: each sampled request's statistics and collapse alerts (no torch).

The engine thread hands over a finished request's record (runner.attention_monitor); here it
becomes the JSON of `GET /debug/attention/{request_id}` and is checked against the per-head
baseline (diagnostics.attention.CollapseDetector): an alert is a log line naming the layer
and the head, and counts in `ctxwarden_attention_collapse_alerts`. The last
MAX_RESULTS requests are kept.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import asdict

from ctxwarden.diagnostics.attention import CollapseDetector

log = logging.getLogger("ctxwarden.server.attention")
MAX_RESULTS = 256


class AttentionResults:
    """Results by the client's request id (a list: one per choice); written on the engine thread."""

    def __init__(self, model: str, detector: CollapseDetector | None = None):
        self.model = model
        self.detector = detector or CollapseDetector()
        self.num_sampled = 0
        self.num_alerts = 0
        self._results: OrderedDict[str, list[dict]] = OrderedDict()

    def add(self, engine_request_id: str, tags, record) -> dict:
        """Check one finished request's record (RequestAttention) and keep its JSON."""
        out = record.to_dict()
        alerts = self.detector.observe([[h["entropy"] for h in layer] for layer in out["layers"]])
        request_id = tags.request_id if tags is not None else engine_request_id
        result = {"model": self.model, "request_id": request_id, "engine_request_id": engine_request_id,
                  "tenant": getattr(tags, "tenant", None), "trace_id": getattr(tags, "trace_id", None),
                  "rows_observed": int(record.entropy_rows[0]) if record.num_layers else 0,
                  "calibrated": self.detector.is_calibrated, **out, "alerts": [asdict(a) for a in alerts]}
        self.num_sampled += 1
        self.num_alerts += len(alerts)
        for a in alerts:
            log.warning("attention collapse in request %s: layer %d head %d entropy %.4f below %.4f (baseline "
                        "%.4f, spread %.4f)", request_id, a.layer, a.head, a.entropy, a.threshold,
                        a.baseline_mean, a.baseline_spread)
        self._results.setdefault(request_id, []).append(result)
        self._results.move_to_end(request_id)
        while len(self._results) > MAX_RESULTS:
            self._results.popitem(last=False)
        return result

    def get(self, request_id: str) -> list[dict] | None:
        """The results of one request (every sampled choice), None if none is kept."""
        found = self._results.get(request_id)
        return list(found) if found is not None else None
