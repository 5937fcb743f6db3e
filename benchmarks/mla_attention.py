"""MLA attention, absorbed (what the runner does) against expanded, side by side.

One DeepSeek-V2-Lite-shaped layer (hidden 2048, 16 heads, latent 512, nope 128, rope 64,
v 128; random weights, one dense MLP layer), run through the real ModelRunner over the
same paged cache, with both of the runner's MLA paths forced in turn (`model.force_path`):
absorbed (queries absorbed into the latent, attention over the
cached rows) and expanded (per step: gather the cached latents, expand k_nope and v for
every head with kv_b_proj, flash attention over H heads). The two agree to fp32 rounding
(checked on every measured step). Measured:

- decode: one new token after N cached tokens (N = 512, 2048, 8192);
- prefill: a whole prompt of N tokens from an empty cache;
- chunk: a chunk of N new tokens after --chunk-after cached ones (chunked prefill).

Variants alternate within each repeat (best of --repeats), so load drift hits both alike.
Multiply-adds per head, absorbed: r (dn + dv) per query + 2 (r + dr) per (query, key) pair;
expanded: r (dn + dv) per key + dn + dr + dv per pair. Decode re-expands every cached key
each step; a prompt's first chunk expands as many keys as absorbing would absorb queries.

Run: .venv/bin/python benchmarks/mla_attention.py [--repeats 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
V2_LITE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
           "head_dim": 64, "first_k_dense_replace": 1, "q_lora_rank": None}


def _checkpoint(tmp: Path) -> Path:
    from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint

    return make_checkpoint(MakeModelOptions(
        arch="deepseek_v2", out_dir=tmp, hidden_size=2048, num_layers=1, num_heads=16,
        num_kv_heads=16, intermediate_size=256, vocab_size=512, max_position=16384,
        with_tokenizer=False, config_overrides=V2_LITE))


def _timed(fn) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _measure(runner, model, kind: str, n: int, repeats: int, chunk_after: int) -> dict:
    """Best seconds of each variant for one (kind, N), alternating, with their max diff."""
    from ctxwarden.models.deepseek import expansion_pays
    from ctxwarden.runner import ForwardBatch, SequenceInput

    bs = runner.layout.block_size
    cached = {"decode": n, "prefill": 0, "chunk": chunk_after}[kind]
    new = 1 if kind == "decode" else n
    table = (tuple(range(-(-(cached + new) // bs))),)
    if cached:  # fill the cache once (the runner's own choice of path); steps rewrite after it
        runner.forward(ForwardBatch((SequenceInput.chunk([3 + i % 500 for i in range(cached)], 0, table),)))
    batch = ForwardBatch((SequenceInput.chunk([7 + i % 500 for i in range(new)], cached, table),))
    chosen = "expanded" if expansion_pays(model.spec.mla, new, cached + new) else "absorbed"
    best, outs = {"absorbed": float("inf"), "expanded": float("inf")}, {}
    for _ in range(repeats):
        for name in best:
            model.force_path = name
            seconds, outs[name] = _timed(lambda: runner.forward(batch))
            best[name] = min(best[name], seconds)
    model.force_path = None
    diff = (outs["absorbed"] - outs["expanded"]).abs().max().item()
    return {"kind": kind, "tokens": n, "cached_tokens": cached, "runner_picks": chosen,
            "absorbed_s": best["absorbed"], "expanded_s": best["expanded"],
            "expanded_over_absorbed": best["expanded"] / best["absorbed"], "max_logit_diff": diff}


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, kind in zip(axes, ("decode", "prefill", "chunk")):
        sel = [r for r in rows if r["kind"] == kind]
        xs = [r["tokens"] for r in sel]
        for name in ("absorbed", "expanded"):
            ax.plot(xs, [r[f"{name}_s"] * 1e3 for r in sel], marker="o", label=name)
        xlabel = {"decode": "tokens in context", "prefill": "prompt tokens",
                  "chunk": f"new tokens after {sel[0]['cached_tokens'] if sel else 0} cached"}[kind]
        ax.set(xscale="log", yscale="log", xlabel=xlabel,
               ylabel="ms per step (1 layer)", title=f"MLA {kind} (DeepSeek-V2-Lite shapes)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--chunk-tokens", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--chunk-after", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    from rich.progress import track

    from ctxwarden.runner import ModelRunner, RunnerConfig

    with tempfile.TemporaryDirectory() as tmp:
        most = max(args.decode_tokens + args.prefill_tokens + [args.chunk_after + max(args.chunk_tokens)]) + 1
        runner = ModelRunner(_checkpoint(Path(tmp)), RunnerConfig(num_blocks=-(-most // 16), block_size=16))
        cases = ([("decode", n) for n in args.decode_tokens] + [("prefill", n) for n in args.prefill_tokens]
                 + [("chunk", n) for n in args.chunk_tokens])
        rows = [_measure(runner, runner.model, kind, n, args.repeats, args.chunk_after)
                for kind, n in track(cases, description="MLA absorbed vs expanded")]
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                         f"load {os.getloadavg()[0]:.1f}", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mla_attention.json").write_text(json.dumps(result, indent=1))
    _plot(rows, args.out / "mla_attention.png")
    for r in rows:
        print(f"{r['kind']:8s} {r['tokens']:6d} (+{r['cached_tokens']} cached, runner: {r['runner_picks']}): absorbed {r['absorbed_s'] * 1e3:8.1f} ms, expanded "
              f"{r['expanded_s'] * 1e3:8.1f} ms ({r['expanded_over_absorbed']:.2f}x), diff {r['max_logit_diff']:.1e}")


if __name__ == "__main__":
    main()
