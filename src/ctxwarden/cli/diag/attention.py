"""`ctxwarden diag attention PROMPT|--tokens FILE`: per-head entropy, sink mass, rollout of one prompt."""

from __future__ import annotations

import argparse
import json

HELP = "Attention of one prompt: layer x head entropy and sink mass, sink rate, rollout, mass by decile; PNG."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `diag attention`."""
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (tokenized by the model's tokenizer)")
    p.add_argument("--tokens", default=None, metavar="FILE", help="a JSON list of token ids instead of PROMPT")
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--png", default=None, metavar="FILE", help="entropy heatmap, rollout heatmap, mass by decile")
    p.add_argument("--json", action="store_true", help="machine-readable output (docs/diagnostics.md)")


def run(args: argparse.Namespace) -> int:
    """Run the prompt through a monitored engine, render."""
    from ctxwarden.engine.config import EngineConfig
    from ctxwarden.engine.engine import Engine
    from ctxwarden.runner.attention_probe import probe_attention

    if (args.prompt is None) == (args.tokens is None):
        raise ValueError("give PROMPT or --tokens FILE (one of them)")
    ids = _token_ids(args)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, kv_memory_bytes=_pool_bytes(len(ids)),
                                 attention_sample_rate=1.0, enable_prefix_caching=False,
                                 max_batched_tokens=max(2048, len(ids))))
    ids = engine.encode(ids if args.tokens else args.prompt)
    record = probe_attention(engine, ids)
    out = {"model": engine.checkpoint.name, "num_tokens": len(ids), **record.to_dict()}
    if args.png:
        from ctxwarden.diagnostics.attention_plot import plot_attention

        plot_attention(out, record.rollout.numpy(), args.png)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _render(out, args.png)
    return 0


def _token_ids(args) -> list[int] | str:
    if not args.tokens:
        return args.prompt
    try:
        with open(args.tokens, encoding="utf-8") as f:
            ids = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{args.tokens}: not a JSON list of token ids ({e})") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise ValueError(f"{args.tokens}: expected a non-empty JSON list of integer token ids")
    return ids


def _pool_bytes(num_tokens: int) -> int:
    return 64 * 2**20 + num_tokens * 2**16  # generous: the planner cuts it into blocks


def _render(out: dict, png: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    c.print(f"{out['model']}: {out['num_tokens']:,} tokens; sink rate {out['sink_rate']:.1%} of heads "
            f"(alpha > 0.3)", highlight=False)
    t = Table(title="normalised entropy per head (sink mass in brackets)")
    t.add_column("layer", justify="right")
    for h in range(len(out["layers"][0])):
        t.add_column(f"h{h}", justify="right")
    for l, heads in enumerate(out["layers"]):
        t.add_row(str(l), *[f"{x['entropy']:.2f} ({x['sink_mass']:.2f})" if x["entropy"] is not None else "-"
                            for x in heads])
    c.print(t)
    c.print("attention mass of the last token by context decile: "
            + " ".join(f"{m:.2f}" for m in out["position_mass"]), highlight=False)
    if png:
        c.print(f"plot written to {png}")
