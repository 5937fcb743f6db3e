"""`ctxwarden diag mem snapshot|diff`: memory of a process and its cgroup; ranked differences."""

from __future__ import annotations

import argparse
import json

HELP = "Memory snapshot of a process (RSS/USS/PSS, RssAnon+VmSwap, cgroup v2) or a ranked diff of two."

_CGROUP_ROWS = (("memory.current", "memory_current_bytes"), ("memory.max", "memory_max_bytes"),
                ("headroom to memory.max", "headroom_bytes"), ("memory.peak", "memory_peak_bytes"),
                ("memory.swap.current", "swap_current_bytes"))
_STAT_KEYS = ("anon", "file", "file_mapped", "shmem", "rss", "cache", "mapped_file", "swap", "pgmajfault",
              "workingset_refault_anon", "workingset_refault_file")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `diag mem snapshot` and `diag mem diff`."""
    sub = p.add_subparsers(dest="mem_command", metavar="ACTION")
    sub.required = True
    snap = sub.add_parser("snapshot", help="snapshot one process (default: this command itself)")
    snap.add_argument("--pid", type=int, default=None, help="process to snapshot (default: this one)")
    add_url_arguments(snap)
    snap.add_argument("--cgroup-root", default="/sys/fs/cgroup", help="where the cgroup hierarchy is mounted")
    snap.add_argument("--out", default=None, metavar="FILE", help="also write the JSON to FILE")
    snap.add_argument("--json", action="store_true", help="print the JSON snapshot")
    diff = sub.add_parser("diff", help="what grew between snapshot A and snapshot B, ranked")
    diff.add_argument("a", help="snapshot JSON taken first")
    diff.add_argument("b", help="snapshot JSON taken later")
    diff.add_argument("--top", type=int, default=25, help="rows to show per table (default 25)")
    diff.add_argument("--json", action="store_true", help="machine-readable output")


def add_url_arguments(p: argparse.ArgumentParser) -> None:
    """--url and --api-key: read a running server's /debug/memory instead of a pid."""
    p.add_argument("--url", default=None, help="a running `ctxwarden serve`: read its /debug/memory (KV pool and "
                   "owners included)")
    p.add_argument("--api-key", default=None, help="--url: an admin key of the server's --api-keys file "
                   "(default: $CTXWARDEN_API_KEY; none needed on loopback without a key file)")


def fetch_server_json(url: str, path: str, api_key: str | None, params: dict | None = None) -> dict:
    """GET url + path (a /debug endpoint) as JSON; errors name the server's own message."""
    import os

    import httpx

    key = api_key or os.environ.get("CTXWARDEN_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(url.rstrip("/") + path, headers=headers, params=params, timeout=30)
    except httpx.TransportError as e:
        raise ValueError(f"cannot reach {url}: {e}; is `ctxwarden serve` running there?") from None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise ValueError(f"{url}{path} answered {r.status_code}: {message}")
    return r.json()


def run(args: argparse.Namespace) -> int:
    """Dispatch to snapshot or diff."""
    return _snapshot(args) if args.mem_command == "snapshot" else _diff(args)


def _snapshot(args) -> int:
    from ctxwarden.diagnostics.snapshot import take_snapshot

    if args.url and args.pid is not None:
        raise ValueError("give --url (a server's snapshot) or --pid (a local process), not both")
    if args.url:
        snap = fetch_server_json(args.url, "/debug/memory", args.api_key)
    else:
        snap = take_snapshot(args.pid, args.cgroup_root).to_dict()
    text = json.dumps(snap, indent=2)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        _render_snapshot(snap, args.out)
    return 0


def _render_snapshot(snap: dict, out: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    p = snap["process"]
    t = Table(title=f"process {p['pid']}", show_header=False)
    for key in ("rss_bytes", "uss_bytes", "pss_bytes", "rss_anon_bytes", "rss_file_bytes", "rss_shmem_bytes",
                "swap_bytes", "leak_basis_bytes", "peak_rss_bytes", "vms_bytes"):
        t.add_row(key, _mib(p[key]))
    t.add_row("num_threads", str(p["num_threads"]))
    c.print(t)
    cg = snap["cgroup"]
    if cg:
        g = Table(title=f"cgroup v{cg['version']}: {cg['path']}", show_header=False)
        for label, key in _CGROUP_ROWS:
            g.add_row(label, "no limit" if key == "memory_max_bytes" and cg[key] is None else _mib(cg[key]))
        for key in _STAT_KEYS:
            if key in cg["stat"]:
                g.add_row(f"memory.stat {key}", _mib(cg["stat"][key]) if "pg" not in key and "workingset" not in key
                          else f"{cg['stat'][key]:,}")
        for key, value in cg["events"].items():
            g.add_row(f"memory.events {key}", f"{value:,}")
        for kind, v in (cg["pressure"] or {}).items():
            g.add_row(f"pressure {kind} ({cg['pressure_scope']})", f"avg10 {v['avg10']:.2f}% avg60 {v['avg60']:.2f}%")
        c.print(g)
    _render_kv(c, snap)
    for note in snap["notes"]:
        c.print(f"[yellow]note:[/yellow] {note}")
    if out:
        c.print(f"snapshot written to {out}")


def _render_kv(c, snap: dict) -> None:
    from rich.table import Table

    kv = snap.get("kv")
    if kv:
        c.print(f"KV pool: {kv['num_blocks_in_use']:,} of {kv['num_blocks_total']:,} blocks in use "
                f"({_mib(kv['in_use_bytes'])} of {_mib(kv['total_bytes'])}), {kv['num_blocks_cached']:,} cached, "
                f"{kv['num_blocks_free']:,} free; external fragmentation {kv['external_fragmentation']:.1%}, "
                f"host swap {_mib(kv['host_swap_bytes'])}", highlight=False)
    owners = snap.get("owners") or []
    if not owners:
        if kv:
            c.print("KV owners: none (no request holds blocks)")
        return
    t = Table(title="KV owners (worst first)")
    for col in ("risk", "request id", "tenant", "state", "blocks", "age", "trace id"):
        t.add_column(col, justify="right" if col in ("blocks", "age") else "left")
    rank = {"CRITICAL": 0, "HIGH": 1, "OK": 2}
    for o in sorted(owners, key=lambda o: (rank.get(o["risk"], 3), -o["age_s"])):
        t.add_row(o["risk"], str(o["request_id"] or f"(none: {o.get('engine_request_id') or 'no sequence'})"),
                  str(o["tenant"] or "-"), o["state"], f"{o['blocks']:,}", f"{o['age_s']:.1f} s",
                  o.get("trace_id") or "-")
    c.print(t)


def _diff(args) -> int:
    from ctxwarden.diagnostics.memdiff import diff_snapshots

    snaps = []
    for path in (args.a, args.b):
        try:
            with open(path, encoding="utf-8") as f:
                snaps.append(json.load(f))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a snapshot JSON ({e}); make one with `ctxwarden diag mem "
                             "snapshot --out FILE`") from None
    result = diff_snapshots(*snaps)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        _render_diff(result, args.top)
    return 0


def _render_diff(result, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    c.print(f"{result.elapsed_s:,.1f} s between the snapshots; {len(result.changes)} figures changed")
    for unit in dict.fromkeys(ch.unit for ch in result.changes):
        t = Table(title=f"changes in {unit}, largest growth first")
        for col in ("key", "before", "after", "delta", "relative"):
            t.add_column(col, justify="left" if col == "key" else "right")
        for ch in [ch for ch in result.changes if ch.unit == unit][:top]:
            fmt = _mib if unit == "bytes" else _number
            delta = ("+" if ch.delta > 0 else "") + fmt(ch.delta)
            rel = "-" if ch.relative is None else f"{ch.relative:+.1%}"
            t.add_row(ch.key, fmt(ch.before), fmt(ch.after), delta, rel)
        c.print(t)
    for label, owners in (("new owners", result.owners_new), ("owners gone", result.owners_gone)):
        if owners:
            c.print(f"{label}: " + ", ".join(f"{o.get('request_id')} ({o.get('blocks')} blocks)" for o in owners))


def _mib(v) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (B, KiB, MiB, GiB)."""
    if v is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= size:
            return f"{v / size:,.1f} {unit}"
    return f"{v:,.0f} B"


def _number(v) -> str:
    if v is None:
        return "-"
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.4g}"
