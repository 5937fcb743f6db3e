"""`ctxwarden diag slo-risk LOG --ttft 2s [--tpot 100ms]`: SLO risk by prompt-length bucket."""

from __future__ import annotations

import argparse
import json

HELP = "SLO risk by prompt-length bucket from a request log; predict it for a new length mix."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `diag slo-risk`."""
    p.add_argument("log", help="request log (JSONL) with TTFT per request")
    p.add_argument("--ttft", required=True, help="time-to-first-token objective, e.g. 2s, 500ms")
    p.add_argument("--tpot", default=None, help="time-per-output-token objective, e.g. 100ms")
    p.add_argument("--buckets", default=None,
                   help="bucket edges in prompt tokens, e.g. 0,512,2048,8192 (default: 0,128,256,... doubling)")
    p.add_argument("--predict", default=None, metavar="FILE",
                   help="a length mix (request log or CSV trace) to predict TTFT risk for")
    p.add_argument("--predict-column", default=None, help="CSV column or log field of --predict")
    p.add_argument("--predict-scale", type=float, default=1.0,
                   help="multiply the --predict lengths by this (e.g. to fit a trace to a smaller window)")
    p.add_argument("--png", default=None, metavar="FILE", help="write P(violation) per bucket")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    """Measure risk, fit the latency model, predict if asked, and render."""
    from ctxwarden.cli.diag._args import parse_duration_s
    from ctxwarden.diagnostics.request_log import read_request_log
    from ctxwarden.diagnostics.slo import SLO, fit_latency_model, measure_risk, parse_edges

    slo = SLO(parse_duration_s(args.ttft), parse_duration_s(args.tpot) if args.tpot else None)
    edges = parse_edges(args.buckets) if args.buckets else None
    records = read_request_log(args.log)
    measured = measure_risk(records, slo, edges)
    model = fit_latency_model(records)
    predicted = _predict(args, model, slo, edges or tuple(b.lo_tokens for b in measured.buckets))
    if args.png:
        from ctxwarden.diagnostics.plots import plot_slo_risk

        plot_slo_risk(measured, predicted, args.png)
    if args.json:
        out = {"measured": measured.to_dict(), "latency_model": model.to_dict(),
               "predicted": predicted.to_dict() if predicted else None}
        print(json.dumps(out, indent=2))
    else:
        _render(measured, model, predicted, args)
    return 0


def _predict(args, model, slo, edges):
    if not args.predict:
        return None
    from ctxwarden.diagnostics.request_log import read_lengths
    from ctxwarden.diagnostics.slo import predict_risk

    if not args.predict_scale > 0:
        raise ValueError(f"--predict-scale must be > 0, got {args.predict_scale}")
    lengths = [max(1, round(v * args.predict_scale)) for v in read_lengths(args.predict, args.predict_column)]
    if edges[0] != 0:
        edges = (0, *edges)
    return predict_risk(model, lengths, slo, edges)


def _render(measured, model, predicted, args) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    slo = measured.slo
    c.print(f"{measured.num_requests:,} requests judged ({measured.num_excluded} left out), "
            f"{measured.num_violations:,} violations of TTFT <= {slo.ttft_s:g} s"
            + (f" / TPOT <= {slo.tpot_s * 1000:g} ms" if slo.tpot_s else ""))
    c.print(_table("measured", measured.buckets, with_interval=True))
    m = model.to_dict()
    c.print(f"latency model: TTFT = {m['a_s']:.3g} s + {m['b_s_per_token']:.3g} s/token x L + "
            f"{m['c_s_per_token2']:.3g} s/token^2 x L^2 (L <= {m['max_fitted_tokens']:,} fitted; "
            f"measured/fitted p50 {m['ratio_p50']:.2f}, p90 {m['ratio_p90']:.2f})")
    if predicted:
        c.print(_table(f"predicted TTFT risk for {args.predict} (x{args.predict_scale:g})",
                       predicted.buckets, with_interval=False))
        if predicted.share_extrapolated:
            c.print(f"[yellow]{predicted.share_extrapolated:.1%} of the mix is longer than any fitted "
                    "prompt: those predictions extrapolate[/yellow]")
    if args.png:
        c.print(f"plot written to {args.png}")


def _table(title: str, buckets, with_interval: bool):
    from rich.table import Table

    t = Table(title=title)
    for col in ("prompt tokens", "requests", "share", "P(violation)", "95% interval",
                "violations / 1,000", "share of violations"):
        if col != "95% interval" or with_interval:
            t.add_column(col, justify="right")
    for b in buckets:
        row = [f"{b.lo_tokens:,}-{b.hi_tokens - 1:,}", f"{b.num_requests:,}", f"{b.share_of_traffic:.1%}",
               f"{b.p_violation:.3f}"]
        if with_interval:
            row.append(f"{b.p_low:.3f}-{b.p_high:.3f}")
        row += [f"{b.violations_per_1000:.1f}", f"{b.share_of_violations:.1%}"]
        t.add_row(*row)
    return t
