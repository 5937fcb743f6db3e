"""KV bytes against context length per layer kind, with the KV budget line (PNG)."""

from __future__ import annotations

from ctxwarden.spec.model_spec import ModelSpec
from ctxwarden.plan.capacity import MemoryPlan, kv_bytes_at
from ctxwarden.plan.kv import kv_layout


def plot_kv_vs_context(spec: ModelSpec, plan: MemoryPlan, path: str) -> None:
    """Write a PNG: one line per layer kind and their sum, log-spaced contexts, budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = kv_layout(spec, plan.kv_dtype, plan.block_size)
    top = max(plan.context_tokens, spec.max_position_embeddings) * 2
    contexts = sorted({int(256 * 2 ** (i / 4)) for i in range(0, 200) if 256 * 2 ** (i / 4) <= top})
    series: dict[str, list[float]] = {}
    for ctx in contexts:
        for name, b in kv_bytes_at(spec, layout, ctx).items():
            series.setdefault(name, []).append(b / 1024**3)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, ys in series.items():
        ax.plot(contexts, ys, label=name)
    if len(series) > 1:
        ax.plot(contexts, [sum(v) for v in zip(*series.values())], "k-", lw=2, label="total")
    ax.axhline(plan.kv_budget_bytes / 1024**3, color="r", ls="--",
               label=f"KV budget ({plan.kv_budget_bytes / 1024**3:.1f} GiB)")
    ax.axvline(spec.max_position_embeddings, color="gray", ls=":", label="model window")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"KV bytes per sequence (GiB, {plan.kv_dtype})")
    ax.set_title(f"{plan.model}: KV cache per sequence")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
