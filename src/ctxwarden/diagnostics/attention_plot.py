"""The PNG of `ctxwarden diag attention`: entropy heatmap, rollout heatmap, mass by decile."""

from __future__ import annotations

import numpy as np

from ctxwarden.diagnostics.plots import _pyplot


def plot_attention(out: dict, rollout, path: str) -> None:
    """Layer x head entropy (normalised), the rollout matrix, and the last row's mass by decile."""
    plt = _pyplot()
    ent = np.array([[np.nan if h["entropy"] is None else h["entropy"] for h in layer] for layer in out["layers"]])
    fig, (ax_e, ax_r, ax_p) = plt.subplots(1, 3, figsize=(16, 5), width_ratios=(1.2, 1.2, 1))
    im = ax_e.imshow(ent, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax_e.set_xlabel("head")
    ax_e.set_ylabel("layer")
    ax_e.set_title(f"entropy / log(visible keys); sink rate {out['sink_rate']:.0%}")
    fig.colorbar(im, ax=ax_e)
    r = np.asarray(rollout)
    im = ax_r.imshow(r, cmap="magma", norm=_log_norm(r))
    ax_r.set_xlabel("key position")
    ax_r.set_ylabel("query position")
    ax_r.set_title("attention rollout (0.5 A + 0.5 I, heads averaged)")
    fig.colorbar(im, ax=ax_r)
    ax_p.bar(range(1, 11), out["position_mass"], color="0.4")
    ax_p.set_xlabel("context decile (1 = the first tenth)")
    ax_p.set_ylabel("attention mass of the last token")
    ax_p.set_title("mass by position")
    fig.suptitle(f"{out['model']}: {out['num_tokens']:,} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_norm(r):
    from matplotlib.colors import LogNorm

    positive = r[r > 0]
    return LogNorm(vmin=max(float(positive.min()), 1e-6), vmax=float(positive.max())) if positive.size else None
