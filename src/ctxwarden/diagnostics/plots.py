"""PNG renderings of diagnostics results (matplotlib, Agg backend; imported only when asked)."""

from __future__ import annotations

import numpy as np

from ctxwarden.diagnostics.lengths import LengthReport, discrete_cdf, discrete_pmf, fitted_theta


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lengths(values, report: LengthReport, path: str, title: str = "request lengths") -> None:
    """Histogram on log-spaced bins with each fit's expected counts, and ECDF vs model CDFs."""
    plt = _pyplot()
    x = np.asarray(values, dtype=np.int64)
    support = np.arange(1, report.cap + 1)
    edges = np.unique(np.round(np.geomspace(1, report.cap + 1, 60)).astype(np.int64))
    fig, (ax_h, ax_c) = plt.subplots(1, 2, figsize=(13, 5))
    ax_h.hist(x, bins=edges, color="0.75", label=f"observed (n = {report.n:,})")
    ks = np.arange(1, report.cap + 1)
    ecdf = np.searchsorted(np.sort(x), ks, side="right") / x.size
    ax_c.plot(ks, ecdf, "k-", lw=2, label="observed")
    for fit in report.fits:
        cand, theta = fitted_theta(fit)
        pmf = discrete_pmf(cand, theta, support, report.cap)
        per_bin = np.add.reduceat(pmf, edges[:-1] - 1)[: len(edges) - 1] * report.n
        style = "-" if fit.model == report.chosen else "--"
        label = f"{fit.model} (D {fit.ks:.3f})" + (" chosen" if fit.model == report.chosen else "")
        ax_h.step(edges[:-1], per_bin, where="post", ls=style, label=label)
        ax_c.plot(ks, discrete_cdf(cand, theta, ks, report.cap), ls=style, label=label)
    for ax in (ax_h, ax_c):
        ax.set_xscale("log")
        ax.axvline(report.cap, color="r", ls=":", lw=1, label=f"cap {report.cap:,}" if ax is ax_h else None)
        ax.set_xlabel("tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_h.set_ylabel("requests per bin")
    ax_c.set_ylabel("P(length <= x)")
    verdict = f"chosen: {report.chosen}" if report.chosen else f"none fits (KS D > {report.max_ks:g})"
    fig.suptitle(f"{title}: median {report.median:,.0f}, p99 {report.p99:,.0f}, {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_slo_risk(measured, predicted, path: str) -> None:
    """P(violation) per length bucket: measured with Wilson bars, predicted as points; traffic share."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    labels = [f"{b.lo_tokens:,}-{b.hi_tokens - 1:,}" for b in measured.buckets]
    pos = np.arange(len(labels))
    p = np.array([b.p_violation for b in measured.buckets])
    err = np.array([[b.p_violation - b.p_low for b in measured.buckets],
                    [b.p_high - b.p_violation for b in measured.buckets]])
    ax.bar(pos, p, yerr=err, capsize=4, color="tab:red", alpha=0.7, label="measured P(violation), 95% Wilson")
    if predicted is not None:
        by_lo = {b.lo_tokens: b.p_violation for b in predicted.buckets}
        ys = [by_lo.get(b.lo_tokens, np.nan) for b in measured.buckets]
        ax.plot(pos, ys, "kD", label="predicted (latency model)")
    share = ax.twinx()
    share.plot(pos, [b.share_of_traffic for b in measured.buckets], "o-", color="tab:blue", alpha=0.6)
    share.set_ylabel("share of traffic", color="tab:blue")
    ax.set_xticks(pos, labels, rotation=30, ha="right")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("P(violation)")
    slo = measured.slo
    target = f"TTFT <= {slo.ttft_s:g} s" + (f", TPOT <= {slo.tpot_s * 1000:g} ms" if slo.tpot_s else "")
    ax.set_title(f"SLO risk by prompt length ({target}; {measured.num_requests:,} requests)")
    ax.legend(loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_leak(samples, report, path: str) -> None:
    """Leak basis (and after trim) against completed requests with the robust line; TTFT if any."""
    plt = _pyplot()
    x = np.array([s.completed_requests for s in samples], dtype=float)
    timed = [s for s in samples if s.ttft_s is not None]
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(13 if timed else 7, 5), squeeze=False)
    ax = axes[0][0]
    ax.plot(x, [s.leak_basis_bytes / 2**20 for s in samples], ".", ms=3, label="RssAnon + VmSwap")
    r = report.rss
    ax.plot(x, (r.intercept + r.slope * x) / 2**20, "r-",
            label=f"Theil-Sen {r.slope / 1024:,.1f} KiB/request (R^2 {r.r_squared or 0:.2f})")
    if report.trimmed:
        ax.plot(x, [s.trimmed_leak_basis_bytes / 2**20 for s in samples], ".", ms=3, label="after malloc_trim")
    ax.set_xlabel("completed requests")
    ax.set_ylabel("MiB")
    ax.set_title(f"memory per request: {report.verdict}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    if timed:
        tx = axes[0][1]
        sc = tx.scatter([s.completed_requests for s in timed], [s.ttft_s * 1000 for s in timed],
                        c=[s.prompt_tokens for s in timed], s=6, cmap="viridis")
        fig.colorbar(sc, ax=tx, label="prompt tokens")
        d = report.ttft
        tx.set_title("TTFT" + (f": drift {d.seconds_per_1000_requests * 1000:+.1f} ms / 1,000 requests "
                               f"at fixed length" if d else ""))
        tx.set_xlabel("completed requests")
        tx.set_ylabel("TTFT (ms)")
        tx.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
