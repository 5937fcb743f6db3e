"""Writes dashboards/ctxwarden.json: a Grafana dashboard with a panel for every metric
`ctxwarden serve` exports on /metrics (tests/server/test_dashboard.py checks both ways
against a live server). Run: python dashboards/build_dashboard.py
"""

from __future__ import annotations

import json
from pathlib import Path

M = '{model=~"$model"}'
W = "[$__rate_interval]"


def q(expr: str, legend: str = "") -> dict:
    return {"expr": expr, "legendFormat": legend}


def quantiles(metric: str, by: str = "") -> list[dict]:
    group = f"le{', ' + by if by else ''}"
    label = f"{{{{{by}}}}} " if by else ""
    return [q(f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{M}{W})))", f"{label}p{int(p * 100)}")
            for p in (0.5, 0.99)]


ROWS = {
    "Requests": [
        ("Requests by status (per s)", "reqps", [q(f"sum by (status) (rate(ctxwarden_requests_total{W}))", "{{status}}")]),
        ("Abandoned requests (per s)", "reqps", [q(f"rate(ctxwarden_requests_abandoned_total{W})", "abandoned")]),
        ("Time to first token", "s", quantiles("ctxwarden_time_to_first_token_seconds")
         + [q(f"rate(ctxwarden_time_to_first_token_seconds_sum{W}) / rate(ctxwarden_time_to_first_token_seconds_count{W})", "mean")]),
        ("Time per output token", "s", quantiles("ctxwarden_time_per_output_token_seconds")
         + [q(f"rate(ctxwarden_time_per_output_token_seconds_sum{W}) / rate(ctxwarden_time_per_output_token_seconds_count{W})", "mean")]),
        ("Running and waiting", "short", [q(f"ctxwarden_requests_running{M}", "running {{model}}"),
                                          q(f"ctxwarden_requests_waiting{M}", "waiting {{model}}")]),
        ("Preemptions (per s)", "short", [q(f"rate(ctxwarden_preemptions_total{M}{W})", "{{model}}")]),
    ],
    "KV cache": [
        ("KV blocks", "short", [q(f"ctxwarden_kv_blocks_total{M}", "total"), q(f"ctxwarden_kv_blocks_in_use{M}", "in use"),
                                q(f"ctxwarden_kv_blocks_cached{M}", "cached")]),
        ("KV pool in use", "percentunit", [q(f"ctxwarden_kv_blocks_in_use{M} / ctxwarden_kv_blocks_total{M}", "{{model}}")]),
        ("KV blocks by owner risk", "short", [q(f"ctxwarden_kv_owner_blocks{M}", "{{risk}}"),
                                              q(f"ctxwarden_kv_leaked_blocks{M}", "leaked (idle audit)")]),
        ("External fragmentation", "percentunit", [q(f"ctxwarden_kv_fragmentation_ratio{M}", "{{model}}")]),
        ("Prefix cache hit rate", "percentunit", [q(f"rate(ctxwarden_prefix_cache_hits_tokens_total{M}{W}) / "
                                                    f"rate(ctxwarden_prefix_cache_queries_tokens_total{M}{W})", "{{model}}")]),
        ("Cross-tenant prefix hits (must stay 0)", "short", [q(f"ctxwarden_cross_tenant_prefix_hits_total{M}", "{{model}}")]),
    ],
    "Memory": [
        ("Server process memory", "bytes", [q("ctxwarden_process_leak_basis_bytes", "RssAnon + VmSwap"),
                                            q("ctxwarden_process_rss_anon_bytes", "RssAnon"),
                                            q("ctxwarden_process_swap_bytes", "VmSwap")]),
        ("OOM kills in the memory cgroup", "short", [q("ctxwarden_cgroup_oom_kills", "oom_kill")]),
        ("Slow-leak slope (bytes per request)", "bytes", [
            q('ctxwarden_process_rss_slope_bytes_per_request{bound="estimate"}', "slope"),
            q('ctxwarden_process_rss_slope_bytes_per_request{bound="low"}', "95% low"),
            q('ctxwarden_process_rss_slope_bytes_per_request{bound="high"}', "95% high")]),
        ("Slow-leak fit", "short", [q("ctxwarden_process_rss_slope_r_squared", "R^2"),
                                    q("ctxwarden_process_rss_slope_completed_requests", "completed requests fitted")]),
    ],
    "Attention monitor": [
        ("Monitored requests (per s)", "reqps", [q(f"rate(ctxwarden_attention_sampled_requests_total{M}{W})", "{{model}}")]),
        ("Attention collapse alerts (per s)", "short", [q(f"rate(ctxwarden_attention_collapse_alerts_total{M}{W})",
                                                          "{{model}}")]),
    ],
    "KV tiers": [
        ("Tier hits and misses (blocks per s)", "short", [q(f"rate(ctxwarden_kv_tier_hits_total{M}{W})", "hits {{tier}}"),
                                                          q(f"rate(ctxwarden_kv_tier_misses_total{M}{W})", "misses {{tier}}")]),
        ("Tier bytes (per s)", "Bps", [q(f"rate(ctxwarden_kv_tier_bytes_in_total{M}{W})", "in {{tier}}"),
                                       q(f"rate(ctxwarden_kv_tier_bytes_out_total{M}{W})", "out {{tier}}")]),
        ("Tier stores (per s)", "short", [q(f"rate(ctxwarden_kv_tier_stores_total{M}{W})", "stored {{tier}}"),
                                          q(f"rate(ctxwarden_kv_tier_dropped_stores_total{M}{W})", "dropped {{tier}}")]),
        ("Tier fetch time", "s", quantiles("ctxwarden_kv_tier_fetch_seconds", "tier")
         + [q(f"rate(ctxwarden_kv_tier_fetch_seconds_sum{M}{W}) / rate(ctxwarden_kv_tier_fetch_seconds_count{M}{W})", "mean {{tier}}"),
            q(f"rate(ctxwarden_kv_tier_verify_seconds_total{M}{W})", "verifying {{tier}} (s per s)")]),
        ("Tier breakers", "short", [q(f"ctxwarden_kv_tier_breaker_state{M}", "state {{tier}} (0 closed, 2 open)"),
                                    q(f"increase(ctxwarden_kv_tier_breaker_opens_total{M}{W})", "opens {{tier}}"),
                                    q(f"ctxwarden_kv_tier_degraded{M}", "degraded {{tier}}")]),
        ("Tier used bytes", "bytes", [q(f"ctxwarden_kv_tier_used_bytes{M}", "{{tier}}")]),
        ("Tier integrity failures (per s)", "short", [q(f"rate(ctxwarden_kv_tier_integrity_failures_total{M}{W})",
                                                        "{{tier}} {{reason}}")]),
        ("Tier decisions (per s)", "short", [q(f"rate(ctxwarden_kv_tier_decisions_total{M}{W})", "{{tier}} {{decision}}")]),
        ("Heap trims", "short", [q(f"rate(ctxwarden_heap_trims_total{M}{W})", "trims/s {{model}}"),
                                 q(f"rate(ctxwarden_heap_released_bytes_total{M}{W})", "released bytes/s {{model}}")]),
    ],
    "Throughput": [
        ("Tokens (per s)", "short", [q(f"rate(ctxwarden_prompt_tokens_computed_total{M}{W})", "prompt computed {{model}}"),
                                     q(f"rate(ctxwarden_generation_tokens_total{M}{W})", "generated {{model}}")]),
    ],
}


def build() -> dict:
    panels, y, pid = [], 0, 1
    for row, specs in ROWS.items():
        panels.append({"type": "row", "title": row, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for k, (title, unit, targets) in enumerate(specs):
            panels.append({"type": "timeseries", "title": title, "id": pid,
                           "datasource": {"type": "prometheus", "uid": "${datasource}"},
                           "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                           "gridPos": {"h": 8, "w": 8, "x": 8 * (k % 3), "y": y + 8 * (k // 3)},
                           "targets": [{**t, "refId": chr(ord("A") + i),
                                        "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                                       for i, t in enumerate(targets)]})
            pid += 1
        y += 8 * ((len(specs) + 2) // 3)
    return {"title": "ctxwarden", "uid": "ctxwarden-overview", "schemaVersion": 39, "version": 1,
            "tags": ["ctxwarden", "llm-serving"], "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
            "templating": {"list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {"name": "model", "type": "query", "label": "model", "includeAll": True, "multi": True,
                 "current": {"text": "All", "value": "$__all"}, "allValue": ".*",
                 "datasource": {"type": "prometheus", "uid": "${datasource}"},
                 "query": {"query": "label_values(ctxwarden_kv_blocks_total, model)", "refId": "models"},
                 "definition": "label_values(ctxwarden_kv_blocks_total, model)", "refresh": 2}]},
            "panels": panels}


if __name__ == "__main__":
    out = Path(__file__).with_name("ctxwarden.json")
    out.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {out}")
