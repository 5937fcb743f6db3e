"""`ctxwarden diag timeline --url URL`: a server's events merged with its memory samples."""

from __future__ import annotations

import argparse
import json
import time

HELP = "Incident timeline of a running server: events, memory samples, OOM kills, queue depth; PNG."

_SHOWN_KINDS = ("refuse", "preempt", "swap", "error", "abort")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `diag timeline`."""
    from ctxwarden.cli.diag.mem import add_url_arguments

    add_url_arguments(p)
    p.add_argument("--since", default="10m", help="how far back (default 10m; e.g. 30s, 2h)")
    p.add_argument("--png", default=None, metavar="FILE", help="memory and KV use over time, events marked")
    p.add_argument("--all", action="store_true", help="list every event (default: errors, refusals, "
                   "preemptions, swaps, aborts and OOM kills; the rest are counted)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    """Fetch /debug/events, merge, render."""
    from ctxwarden.cli.diag._args import parse_duration_s
    from ctxwarden.cli.diag.mem import fetch_server_json
    from ctxwarden.diagnostics.timeline import build_timeline, plot_timeline

    if not args.url:
        raise ValueError("diag timeline needs --url URL (a running `ctxwarden serve`)")
    since_s = parse_duration_s(args.since)
    tl = build_timeline(fetch_server_json(args.url, "/debug/events", args.api_key, {"since_s": since_s}))
    if args.png:
        plot_timeline(tl, args.png, title=f"{args.url}: the last {args.since}")
    if args.json:
        print(json.dumps(tl.to_dict(), indent=2))
    else:
        _render(tl, args)
    return 0


def _render(tl, args) -> None:
    from rich.console import Console

    c = Console()
    d = tl.to_dict()
    counts = ", ".join(f"{k} {v:,}" for k, v in sorted(d["counts"].items()))
    c.print(f"{len(tl.rows):,} rows over the last {args.since}: {counts or 'nothing'}", highlight=False)
    peak = tl.peak
    if peak is not None:
        c.print(f"memory peak: RssAnon + VmSwap {peak['leak_basis_bytes'] / 2**20:,.1f} MiB at "
                f"{_clock(peak['time'])}", highlight=False)
    for r in tl.rows:
        kind = r.get("kind") if r["type"] == "event" else r["type"]
        if r["type"] == "sample" or (not args.all and kind not in _SHOWN_KINDS + ("oom_kill",)):
            continue
        who = f"{r.get('request_id') or '-'} tenant {r.get('tenant') or '-'}" if r["type"] == "event" else ""
        detail = json.dumps(r.get("detail")) if r.get("detail") else (f"+{r['count']}" if kind == "oom_kill" else "")
        c.print(f"{_clock(r['time'])} {kind:>9} {who} {detail}", highlight=False)
    if args.png:
        c.print(f"plot written to {args.png}")


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"
