"""The incident timeline: a server's events merged with its memory samples (no torch).

    rows, by time: every event (arrival ... finish, error), every memory sample (leak basis
    RssAnon + VmSwap, cgroup usage, KV blocks in use, queue depth), and an `oom_kill` row
    wherever the cgroup's OOM-kill count rose between two samples (the kill happened in that
    interval, so the row sits at the later sample)

Input is the JSON of the server's `GET /debug/events` ({"events", "samples",
"sample_interval_s"}). `ctxwarden diag timeline --json` prints `Timeline.to_dict()`:
{"since", "until", "sample_interval_s", "counts": {kind: n}, "peak": {the sample with the
highest leak basis}, "rows": [{"time", "type": "event" | "sample" | "oom_kill", ...}]}.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class Timeline:
    """Events, samples and OOM-kill rows merged in time order."""

    rows: tuple[dict, ...]
    sample_interval_s: float | None

    @property
    def events(self) -> list[dict]:
        """The event rows, in time order."""
        return [r for r in self.rows if r["type"] == "event"]

    @property
    def samples(self) -> list[dict]:
        """The memory-sample rows, in time order."""
        return [r for r in self.rows if r["type"] == "sample"]

    @property
    def peak(self) -> dict | None:
        """The sample with the highest leak basis (the memory spike), None without samples."""
        samples = self.samples
        return max(samples, key=lambda s: s["leak_basis_bytes"]) if samples else None

    def to_dict(self) -> dict:
        """The stable JSON (module doc)."""
        times = [r["time"] for r in self.rows]
        counts = Counter(r["kind"] if r["type"] == "event" else r["type"] for r in self.rows)
        return {"since": min(times) if times else None, "until": max(times) if times else None,
                "sample_interval_s": self.sample_interval_s, "counts": dict(counts), "peak": self.peak,
                "rows": list(self.rows)}


def build_timeline(debug_events: dict) -> Timeline:
    """Merge a /debug/events answer into one time-ordered Timeline."""
    events = [{"type": "event", **e} for e in debug_events.get("events", [])]
    samples = [{"type": "sample", **s} for s in debug_events.get("samples", [])]
    kills = _oom_kill_rows(samples)
    # a sample and an event at the same instant: the event first (it caused what is sampled)
    order = {"event": 0, "oom_kill": 1, "sample": 2}
    rows = sorted(events + samples + kills, key=lambda r: (r["time"], order[r["type"]], r.get("seq", 0)))
    return Timeline(tuple(rows), debug_events.get("sample_interval_s"))


def _oom_kill_rows(samples: list[dict]) -> list[dict]:
    out = []
    for before, after in zip(samples, samples[1:]):
        a, b = before.get("oom_kill"), after.get("oom_kill")
        if a is not None and b is not None and b > a:
            out.append({"type": "oom_kill", "time": after["time"], "count": b - a, "after": before["time"]})
    return out


_EVENT_COLORS = {"error": "red", "refuse": "darkorange", "preempt": "purple", "swap": "teal", "abort": "gray"}


def plot_timeline(tl: Timeline, path: str, title: str = "incident timeline") -> None:
    """One PNG: leak basis (MiB) and KV blocks in use (% of the pool) over time; queue depth;
    error / refuse / preempt / swap / abort events and OOM kills marked as vertical lines."""
    from ctxwarden.diagnostics.plots import _pyplot

    plt = _pyplot()
    samples = tl.samples
    t0 = min((r["time"] for r in tl.rows), default=0.0)
    fig, (ax_m, ax_q) = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True, height_ratios=(3, 1))
    xs = [s["time"] - t0 for s in samples]
    ax_m.plot(xs, [s["leak_basis_bytes"] / MiB for s in samples], "k.-", label="RssAnon + VmSwap (MiB)")
    ax_kv = ax_m.twinx()
    for name in sorted({n for s in samples for n in s.get("engines", {})}):
        kv = [s["engines"][name] for s in samples if name in s.get("engines", {})]
        x_kv = [s["time"] - t0 for s in samples if name in s.get("engines", {})]
        ax_kv.plot(x_kv, [100.0 * e["kv_blocks_in_use"] / max(1, e["kv_blocks_total"]) for e in kv], "b-",
                   alpha=0.6, label=f"KV in use, % ({name})")
        ax_q.plot(x_kv, [e["waiting"] for e in kv], "g-", label=f"waiting ({name})")
        ax_q.plot(x_kv, [e["running"] for e in kv], "c-", label=f"running ({name})")
    marked = set()
    for r in tl.rows:
        kind = r.get("kind") if r["type"] == "event" else r["type"]
        color = _EVENT_COLORS.get(kind, "crimson" if kind == "oom_kill" else None)
        if color is None:
            continue
        for ax in (ax_m, ax_q):
            ax.axvline(r["time"] - t0, color=color, lw=1, alpha=0.7, label=kind if ax is ax_m and kind not in marked
                       else None)
        marked.add(kind)
    ax_m.set_ylabel("MiB")
    ax_kv.set_ylabel("KV blocks in use (%)")
    ax_kv.set_ylim(0, 105)
    ax_q.set_ylabel("requests")
    ax_q.set_xlabel("seconds since the first row")
    lines, labels = [], []
    for ax in (ax_m, ax_kv):
        h, lab = ax.get_legend_handles_labels()
        lines += h
        labels += lab
    ax_m.legend(lines, labels, loc="upper left", fontsize=8)
    ax_q.legend(loc="upper left", fontsize=8)
    ax_m.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
