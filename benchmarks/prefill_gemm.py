"""Prefill-sized matmuls and attention of SmolLM2's shapes, per compute path, side by side.

Which path should a prefill step take on this CPU? For one layer's four projections
(qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576) at R rows it times, in one
process and interleaved rounds:

- `fp32 F.linear`: MKL sgemm on the weight as stored (today's `auto` / `fp32` prefill);
- `fp32 oneDNN`: the same weight reordered once for oneDNN (`_linear_pointwise`);
- `bf16 oneDNN`: bf16 weight and activations through oneDNN (`weights="bf16"`);

and causal attention of one layer (9 heads of 64, T queries over T keys) through torch's
flash attention in fp32 and in bf16. It prints and writes the medians, the spread
(min-max over rounds) and the machine (cli/bench_run.py's `machine`), so a session can
see whether bf16 prefill or a reordered fp32 weight pays on the machine it runs on
(neither did on the AVX2 EPYC; see docs/runner.md).

Run: .venv/bin/python benchmarks/prefill_gemm.py [--rows 64,512,2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of one SmolLM2 layer


def timed(fn, repeats: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def gemm_paths(rows: int) -> dict[str, callable]:
    """One layer's four projections at `rows` rows, per path (each a zero-argument call)."""
    torch.manual_seed(0)
    xs = {i: torch.randn(rows, i) for i, _ in SHAPES}
    ws = [torch.randn(o, i) for i, o in SHAPES]
    paths = {"fp32 F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in ws]}
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
        paths["fp32 oneDNN"] = lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                        for w, p in zip(ws, packed)]
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            xb = {i: x.bfloat16() for i, x in xs.items()}
            packed_b = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) for w in ws]
            paths["bf16 oneDNN"] = lambda: [torch.ops.mkldnn._linear_pointwise(xb[w.shape[1]], p, None, "none",
                                                                               [], "")
                                            for w, p in zip(ws, packed_b)]
    return paths


def attention_paths(tokens: int) -> dict[str, callable]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 9, tokens, 64) for _ in range(3))
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    return {"fp32 flash": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "bf16 flash": lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,512,2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/prefill_gemm.json"))
    args = ap.parse_args()
    from rich.progress import Progress

    cases = [("gemm", r, gemm_paths(r)) for r in map(int, args.rows.split(","))]
    cases += [("attention", r, attention_paths(r)) for r in map(int, args.rows.split(","))]
    samples: dict = {}
    with Progress() as progress:
        task = progress.add_task("rounds", total=args.rounds * sum(len(p) for _, _, p in cases))
        for _ in range(args.rounds):  # interleaved: every path sees the same machine state
            for kind, rows, paths in cases:
                for name, fn in paths.items():
                    samples.setdefault((kind, rows, name), []).append(timed(fn))
                    progress.advance(task)
    results = []
    for (kind, rows, name), ts in samples.items():
        base = statistics.median(samples[(kind, rows, "fp32 F.linear" if kind == "gemm" else "fp32 flash")])
        results.append({"kind": kind, "rows": rows, "path": name, "median_ms": 1e3 * statistics.median(ts),
                        "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
                        "speedup_vs_fp32": base / statistics.median(ts)})
        print(f"{kind:9s} {rows:5d} {name:14s} {results[-1]['median_ms']:8.2f} ms "
              f"(spread {results[-1]['min_ms']:.2f}-{results[-1]['max_ms']:.2f})  "
              f"{results[-1]['speedup_vs_fp32']:.2f}x fp32")
    from ctxwarden.cli.bench_run import machine

    out = {"machine": {**machine(), "threads": torch.get_num_threads()},
           "rounds": args.rounds, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
