"""Prometheus metrics, on a registry of the app's own (never the process-global one).

Engine and KV numbers are read from `EngineStats` snapshots at scrape time (a collector, so
cumulative engine counters are exported as counters without being re-counted here); request
outcomes and latencies are counted by the server as they happen.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ctxwarden.kv.tiers.breaker import STATE_VALUES
from ctxwarden.kv.tiers.stats import DECISIONS, FETCH_BUCKETS_S
from ctxwarden.kv.tiers.value import INTEGRITY_REASONS

EXEMPLAR_ID_CHARS = 64  # + "request_id" + "trace_id" + a 32-hex trace id stays under 128
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_GAUGES = (  # name, help, stats -> value
    ("ctxwarden_kv_blocks_total", "KV blocks in the pool.", lambda s: s.kv.num_blocks_total),
    ("ctxwarden_kv_blocks_in_use", "KV blocks held by live requests.", lambda s: s.kv.num_blocks_in_use),
    ("ctxwarden_kv_blocks_cached", "Free KV blocks still holding reusable prefix-cache content.",
     lambda s: s.kv.num_blocks_cached),
    ("ctxwarden_kv_fragmentation_ratio",
     "External fragmentation: 1 - largest run of allocatable blocks / allocatable blocks.",
     lambda s: s.kv.fragmentation.external_fragmentation),
    ("ctxwarden_kv_leaked_blocks", "Blocks owned by no live request at the last idle audit (must be 0).",
     lambda s: s.leaked_blocks),
    ("ctxwarden_requests_running", "Sequences running in the engine.", lambda s: s.num_running),
    ("ctxwarden_requests_waiting", "Sequences waiting (or swapped out) in the engine.",
     lambda s: s.num_waiting + s.num_swapped),
)

_COUNTERS = (
    ("ctxwarden_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.kv.num_prefix_query_tokens),
    ("ctxwarden_prefix_cache_hits_tokens", "Prompt tokens served by the prefix cache.",
     lambda s: s.kv.num_prefix_hit_tokens),
    ("ctxwarden_cross_tenant_prefix_hits", "Prefix-cache hits on another tenant's block (must be 0).",
     lambda s: s.kv.num_cross_namespace_hits),
    ("ctxwarden_preemptions", "Preemptions (swap + recompute).",
     lambda s: s.num_preemptions_swap + s.num_preemptions_recompute),
    ("ctxwarden_prompt_tokens_computed", "Prompt tokens run through the model (prefix-cache hits excluded, "
     "recomputation after preemption included).", lambda s: s.num_prompt_tokens_computed),
    ("ctxwarden_generation_tokens", "Tokens generated.", lambda s: s.num_generated_tokens),
    ("ctxwarden_heap_trims", "malloc_trim calls that handed freed step temporaries back to the "
     "kernel (when the engine goes idle, and every 30 s under load).", lambda s: s.num_heap_trims),
    ("ctxwarden_heap_released_bytes", "RssAnon + swap bytes those trims released.",
     lambda s: s.heap_released_bytes),
)


_TIER_COUNTERS = (  # name, help, TierStats -> value; labelled by model and tier
    ("ctxwarden_kv_tier_hits", "KV blocks served by a tier (fetched and verified).", lambda t: t.num_hit_blocks),
    ("ctxwarden_kv_tier_misses", "KV blocks looked up in a tier and not served by it.", lambda t: t.num_miss_blocks),
    ("ctxwarden_kv_tier_bytes_in", "Bytes stored into a tier.", lambda t: t.bytes_in),
    ("ctxwarden_kv_tier_bytes_out", "Bytes fetched (and verified) from a tier.", lambda t: t.bytes_out),
    ("ctxwarden_kv_tier_stores", "Stores written to a tier.", lambda t: t.num_stores),
    ("ctxwarden_kv_tier_dropped_stores", "Stores dropped (queue full or breaker open).",
     lambda t: t.num_dropped_stores),
    ("ctxwarden_kv_tier_breaker_opens", "Times a tier's circuit breaker opened.", lambda t: t.num_breaker_opens),
    ("ctxwarden_kv_tier_verify_seconds", "Seconds of fetch time spent verifying values (headers, "
     "checksums, commit records).", lambda t: t.verify_seconds_sum),
)
_TIER_GAUGES = (
    ("ctxwarden_kv_tier_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.",
     lambda t: STATE_VALUES[t.breaker_state]),
    ("ctxwarden_kv_tier_degraded", "1 while a tier's writes are suspended after an error (e.g. a full disk).",
     lambda t: int(t.is_degraded)),
    ("ctxwarden_kv_tier_used_bytes", "Bytes a tier holds (RAM, disk; 0 for Redis).", lambda t: t.used_bytes),
)


def _tier_families(snapshots: dict):
    """Per-tier families from each model's EngineStats.tiers (empty without tiers)."""
    rows = [(model, t) for model, stats in snapshots.items() for t in getattr(stats, "tiers", ())]
    for kind, specs in ((CounterMetricFamily, _TIER_COUNTERS), (GaugeMetricFamily, _TIER_GAUGES)):
        for name, help_text, read in specs:
            family = kind(name, help_text, labels=["model", "tier"])
            for model, t in rows:
                family.add_metric([model, t.tier], float(read(t)))
            yield family
    integrity = CounterMetricFamily("ctxwarden_kv_tier_integrity_failures", "Values that failed "
                                    "verification (deleted, recomputed).", labels=["model", "tier", "reason"])
    decisions = CounterMetricFamily("ctxwarden_kv_tier_decisions", "Per request: fetch, skipped "
                                    "(recompute was cheaper), recompute (a fetch fell short).",
                                    labels=["model", "tier", "decision"])
    for model, t in rows:
        for reason in INTEGRITY_REASONS:
            integrity.add_metric([model, t.tier, reason], float(t.integrity(reason)))
        for action in DECISIONS:
            decisions.add_metric([model, t.tier, action], float(t.decision(action)))
    yield integrity
    yield decisions
    yield _fetch_histogram(rows)


def _fetch_histogram(rows) -> HistogramMetricFamily:
    family = HistogramMetricFamily("ctxwarden_kv_tier_fetch_seconds", "Wall time of one tier fetch, "
                                   "verification included.", labels=["model", "tier"])
    for model, t in rows:
        cumulative, buckets = 0, []
        for bound, count in zip(FETCH_BUCKETS_S + (float("inf"),), t.fetch_bucket_counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        family.add_metric([model, t.tier], buckets, t.fetch_seconds_sum)
    return family


class _EngineCollector:
    """Exports the latest EngineStats of each served model, labelled by model."""

    def __init__(self):
        self.snapshots: dict[str, object] = {}

    def collect(self):
        for name, help_text, read in _GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["model"])
            for model, stats in self.snapshots.items():
                family.add_metric([model], float(read(stats)))
            yield family
        for name, help_text, read in _COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=["model"])
            for model, stats in self.snapshots.items():
                family.add_metric([model], float(read(stats)))
            yield family
        yield from _tier_families(self.snapshots)

    def describe(self):
        return []  # collected lazily: the snapshot is set just before each scrape


def _slope_families(slope):
    """The slow-leak slope (absent until the sampler has fitted one)."""
    bounds = GaugeMetricFamily("ctxwarden_process_rss_slope_bytes_per_request", "Theil-Sen slope of RssAnon + "
                               "VmSwap per completed request, with its 95% interval (bound: estimate, low, high).",
                               labels=["bound"])
    r2 = GaugeMetricFamily("ctxwarden_process_rss_slope_r_squared", "R^2 of the slow-leak slope's line "
                           "(near 1: steady growth; near 0: a step or noise).")
    span = GaugeMetricFamily("ctxwarden_process_rss_slope_completed_requests", "Completed requests at the newest "
                             "sample of the slope's fit (the fit spans the ring after the warm-up).")
    if slope is not None:
        fit = slope.fit
        for bound, value in (("estimate", fit.slope), ("low", fit.slope_low), ("high", fit.slope_high)):
            bounds.add_metric([bound], float(value))
        if fit.r_squared is not None:
            r2.add_metric([], float(fit.r_squared))
        span.add_metric([], float(slope.last_completed))
    return bounds, r2, span


class _DiagnosticsCollector:
    """KV blocks by owner risk (from each engine's published MemoryView) and this process's
    memory (from the sampler's latest sample): nothing is read or computed at scrape time."""

    RISKS = ("OK", "HIGH", "CRITICAL")

    def __init__(self):
        self.views: dict[str, object] = {}  # model -> server.owners.MemoryView
        self.attention: dict[str, object] = {}  # model -> server.attention.AttentionResults
        self.sample: dict | None = None
        self.slope = None  # diagnostics.leaks.RequestSlope: the sampler's last fit

    def collect(self):
        owners = GaugeMetricFamily("ctxwarden_kv_owner_blocks", "KV blocks by owner risk: OK (live or just "
                                   "finished), HIGH (finished > 2x p99 latency ago), CRITICAL (no owner).",
                                   labels=["model", "risk"])
        for model, view in self.views.items():
            for risk in self.RISKS:
                owners.add_metric([model, risk], float(sum(o.blocks for o in view.owners if o.risk == risk)))
        yield owners
        for key, help_text in (("leak_basis_bytes", "RssAnon + VmSwap of the server process (last 1 Hz sample)."),
                               ("rss_anon_bytes", "RssAnon of the server process (last sample)."),
                               ("swap_bytes", "VmSwap of the server process (last sample).")):
            family = GaugeMetricFamily(f"ctxwarden_process_{key}", help_text)
            if self.sample is not None:
                family.add_metric([], float(self.sample[key]))
            yield family
        sampled = CounterMetricFamily("ctxwarden_attention_sampled_requests", "Requests whose attention was "
                                      "monitored (--attention-sample-rate).", labels=["model"])
        alerts = CounterMetricFamily("ctxwarden_attention_collapse_alerts", "Heads of monitored requests whose "
                                     "entropy fell far below their calibrated baseline.", labels=["model"])
        for model, results in self.attention.items():
            sampled.add_metric([model], float(results.num_sampled))
            alerts.add_metric([model], float(results.num_alerts))
        yield sampled
        yield alerts
        yield from _slope_families(self.slope)
        kills = GaugeMetricFamily("ctxwarden_cgroup_oom_kills", "OOM kills the memory cgroup has recorded "
                                  "(memory.events oom_kill; absent without a memory cgroup).")
        if self.sample is not None and self.sample.get("oom_kill") is not None:
            kills.add_metric([], float(self.sample["oom_kill"]))
        yield kills

    def describe(self):
        return []


class ServerMetrics:
    """The app's registry: engine snapshots plus request counters and latency histograms."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self._engines = _EngineCollector()
        self.registry.register(self._engines)
        self._diagnostics = _DiagnosticsCollector()
        self.registry.register(self._diagnostics)
        self.requests = Counter("ctxwarden_requests", "Completion requests by final HTTP status "
                                "(499: the client went away).", ["status"], registry=self.registry)
        self.abandoned = Counter("ctxwarden_requests_abandoned", "Non-streaming requests whose client "
                                 "disconnected before the response; their choices were aborted at once.",
                                 registry=self.registry)
        self.time_to_first_token = Histogram(
            "ctxwarden_time_to_first_token_seconds", "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.time_per_output_token = Histogram(
            "ctxwarden_time_per_output_token_seconds", "Mean time between generated tokens of a request.",
            buckets=_LATENCY_BUCKETS_S, registry=self.registry)

    def count_request(self, status: int) -> None:
        """Count one completion request by its final status."""
        self.requests.labels(status=str(status)).inc()

    def render(self, snapshots: dict[str, object]) -> bytes:
        """Prometheus text for the given per-model EngineStats snapshots."""
        self._engines.snapshots = snapshots
        return generate_latest(self.registry)

    def render_negotiated(self, snapshots: dict[str, object], accept: str | None, views: dict | None = None,
                          sample: dict | None = None, attention: dict | None = None,
                          slope=None) -> tuple[bytes, str]:
        """(body, content type): OpenMetrics if `accept` asks for it, else Prometheus text.
        `views` (model -> MemoryView), `sample` (the latest memory sample) and `slope` (the
        sampler's last RequestSlope) feed the owner-risk, process-memory and leak-slope gauges."""
        self._diagnostics.views, self._diagnostics.sample = views or {}, sample
        self._diagnostics.slope = slope
        self._diagnostics.attention = attention or {}
        if accept and "application/openmetrics-text" in accept:
            self._engines.snapshots = snapshots
            return openmetrics.generate_latest(self.registry), openmetrics.CONTENT_TYPE_LATEST
        return self.render(snapshots), "text/plain; version=0.0.4; charset=utf-8"

    @staticmethod
    def exemplar(tags) -> dict[str, str] | None:
        """Exemplar labels of a request: its id (cut to fit) and trace id (OpenMetrics
        allows 128 characters of exemplar labels in all)."""
        if tags is None:
            return None
        out = {"request_id": tags.request_id[:EXEMPLAR_ID_CHARS]}
        if tags.trace_id:
            out["trace_id"] = tags.trace_id
        return out
