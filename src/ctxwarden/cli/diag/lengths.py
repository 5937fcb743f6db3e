"""`ctxwarden diag lengths FILE`: fit request-length models, compare, choose one or none."""

from __future__ import annotations

import argparse
import json

HELP = "Fit lognormal, truncated/censored lognormal, gamma and a 2-lognormal mixture to request lengths."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `diag lengths`."""
    p.add_argument("file", help="request log (JSONL) or a CSV trace with a token-count column")
    p.add_argument("--column", default=None,
                   help="CSV column or log field (default: ContextTokens for CSV, prompt_tokens for logs)")
    p.add_argument("--max-ks", type=float, default=0.05,
                   help="a model fits when its Kolmogorov-Smirnov D is at most this (default 0.05)")
    p.add_argument("--png", default=None, metavar="FILE", help="write histogram + CDF plots")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    """Read the lengths, fit, print (table or JSON), plot if asked."""
    from ctxwarden.diagnostics.lengths import analyze_lengths
    from ctxwarden.diagnostics.request_log import CSV_DEFAULT_COLUMN, LOG_DEFAULT_FIELD, is_csv, read_lengths

    values = read_lengths(args.file, args.column)
    report = analyze_lengths(values, max_ks=args.max_ks)
    if args.png:
        from ctxwarden.diagnostics.plots import plot_lengths

        column = args.column or (CSV_DEFAULT_COLUMN if is_csv(args.file) else LOG_DEFAULT_FIELD)
        plot_lengths(values, report, args.png, title=column)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _render(report, args.png)
    return 0


def _render(report, png: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    c.print(f"n {report.n:,}   median {report.median:,.0f}   p99 {report.p99:,.0f}   "
            f"cap {report.cap:,} ({report.share_at_cap:.2%} of requests at the cap)")
    t = Table(title="candidates (discrete maximum likelihood)")
    for col in ("model", "parameters", "KS D", "AIC", "dAIC"):
        t.add_column(col, justify="left" if col in ("model", "parameters") else "right")
    best_aic = min(f.aic for f in report.fits)
    for f in sorted(report.fits, key=lambda f: f.aic):
        params = ", ".join(f"{k} {v:.4g}" for k, v in f.params.items())
        mark = " <- chosen" if f.model == report.chosen else ""
        t.add_row(f.model + mark, params, f"{f.ks:.4f}", f"{f.aic:,.1f}", f"{f.aic - best_aic:,.1f}")
    c.print(t)
    c.print(f"chosen: {report.chosen or 'none'}: {report.reason}")
    if png:
        c.print(f"plot written to {png}")
