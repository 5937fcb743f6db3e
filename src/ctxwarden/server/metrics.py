"""Prometheus metrics, on a registry of the app's own (never the process-global one).

Engine and KV numbers are read from `EngineStats` snapshots at scrape time (a collector, so
cumulative engine counters are exported as counters without being re-counted here); request
outcomes and latencies are counted by the server as they happen.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
)


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

    def describe(self):
        return []  # collected lazily: the snapshot is set just before each scrape


class ServerMetrics:
    """The app's registry: engine snapshots plus request counters and latency histograms."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self._engines = _EngineCollector()
        self.registry.register(self._engines)
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
