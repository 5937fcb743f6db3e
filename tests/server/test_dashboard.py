"""The Grafana dashboard (dashboards/ctxwarden.json) against what a live server exports.

Every metric a panel queries must be a sample name /metrics really has (a counter as
`_total`, a histogram as `_bucket` / `_sum` / `_count`), and every family the server
exports must be on some panel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "ctxwarden.json"
_NAME = re.compile(r"\bctxwarden_[a-z0-9_]+")


def _exported(url: str) -> dict[str, str]:
    """family -> type, from the TYPE lines of a scrape (created timestamps left out)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if not name.endswith("_created"):
                out[name] = kind
    return out


def _sample_names(families: dict[str, str]) -> set[str]:
    names = set()
    for name, kind in families.items():
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return names


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def test_every_panel_queries_exported_metrics_and_every_metric_has_a_panel(tiny_server):
    dashboard = json.loads(DASHBOARD.read_text())
    families = _exported(tiny_server.url)
    names = _sample_names(families)
    assert len(families) >= 30 and "ctxwarden_kv_owner_blocks" in families
    queried = set()
    for title, expr in _queries(dashboard):
        found = set(_NAME.findall(expr))
        assert found, f"panel {title!r} queries no ctxwarden metric: {expr}"
        assert found <= names, f"panel {title!r} queries {sorted(found - names)}, which /metrics does not export"
        queried |= found
    unshown = [f for f, kind in families.items()
               if not (({f"{f}_bucket", f"{f}_sum", f"{f}_count"} if kind == "histogram" else {f}) & queried)]
    assert unshown == [], f"exported but on no panel: {unshown}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["refId"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"])
