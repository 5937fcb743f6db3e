"""Diff two memory snapshots: what grew, by how much, ranked; owners that appeared or left.

Every numeric leaf of the snapshot JSON is compared under a dotted key
(`process.rss_anon_bytes`, `cgroup.stat.anon`, `cgroup.events.oom_kill`, ...). Leaves are
ranked within their unit, bytes first: a byte and an event count cannot be ranked against
each other. Units come from the name: `*_bytes` and the byte entries of memory.stat are
bytes; memory.stat entries named pg*, workingset_*, thp_*, zswp* (and v1 total_ versions)
and memory.events are event counts; num_blocks_* are blocks; PSI avg* are percent.
"""

from __future__ import annotations

from dataclasses import dataclass

UNIT_ORDER = ("bytes", "blocks", "count", "percent", "us", "ratio", "number")
_COUNT_PREFIXES = ("pg", "workingset_", "thp_", "zswp")
_SKIPPED = {"time", "schema_version", "pid", "version"}


@dataclass(frozen=True)
class Change:
    """One numeric leaf that differs between the two snapshots."""

    key: str
    unit: str
    before: float | None  # None: the key is new in the second snapshot
    after: float | None  # None: the key is gone in the second snapshot
    delta: float

    @property
    def relative(self) -> float | None:
        """delta / before (None when before is missing or 0)."""
        return self.delta / self.before if self.before else None


@dataclass(frozen=True)
class SnapshotDiff:
    """The ranked changes and the owner turnover between snapshot A and snapshot B."""

    elapsed_s: float
    changes: tuple[Change, ...]  # ranked: by unit (UNIT_ORDER), then growth first, largest first
    owners_new: tuple[dict, ...]
    owners_gone: tuple[dict, ...]

    def to_dict(self) -> dict:
        """JSON-ready (docs/diagnostics.md)."""
        return {"elapsed_s": self.elapsed_s,
                "changes": [{"key": c.key, "unit": c.unit, "before": c.before, "after": c.after,
                             "delta": c.delta, "relative": c.relative} for c in self.changes],
                "owners_new": list(self.owners_new), "owners_gone": list(self.owners_gone)}


def unit_of(key: str) -> str:
    """The unit of a dotted snapshot key (module doc)."""
    leaf = key.rsplit(".", 1)[-1]
    section = key.split(".")[1] if key.startswith("cgroup.") and key.count(".") >= 2 else ""
    if leaf.endswith("_bytes"):
        return "bytes"
    if leaf.startswith("num_blocks_"):
        return "blocks"
    if section == "pressure":
        return "us" if leaf == "total_us" else "percent"
    if section == "events" or (section == "stat" and leaf.removeprefix("total_").startswith(_COUNT_PREFIXES)):
        return "count"
    if section == "stat":
        return "bytes"
    if leaf in ("internal_waste", "external_fragmentation"):
        return "ratio"
    return "count" if leaf.startswith("num_") else "number"


def flatten(obj, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts under dotted keys (lists and bookkeeping keys skipped)."""
    out: dict[str, float] = {}
    for key, value in (obj or {}).items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _SKIPPED:
            out[path] = float(value)
    return out


def diff_snapshots(a: dict, b: dict) -> SnapshotDiff:
    """Compare snapshot dicts A (before) and B (after); unchanged leaves are left out."""
    fa, fb = flatten({k: a.get(k) for k in ("process", "cgroup", "kv")}), \
        flatten({k: b.get(k) for k in ("process", "cgroup", "kv")})
    changes = []
    for key in sorted(fa.keys() | fb.keys()):
        before, after = fa.get(key), fb.get(key)
        delta = (after or 0.0) - (before or 0.0)
        if delta != 0 or (before is None) != (after is None):
            changes.append(Change(key, unit_of(key), before, after, delta))
    changes.sort(key=lambda c: (UNIT_ORDER.index(c.unit), c.delta <= 0, -abs(c.delta)))
    ids_a = {o.get("request_id") for o in a.get("owners", [])}
    ids_b = {o.get("request_id") for o in b.get("owners", [])}
    return SnapshotDiff(elapsed_s=float(b.get("time", 0)) - float(a.get("time", 0)), changes=tuple(changes),
                        owners_new=tuple(o for o in b.get("owners", []) if o.get("request_id") not in ids_a),
                        owners_gone=tuple(o for o in a.get("owners", []) if o.get("request_id") not in ids_b))
