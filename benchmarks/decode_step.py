"""One decode step of B sequences against the weight matmuls of that step alone.

For B in --batches: B sequences of a --context-token prompt are prefilled, then decode
steps run through the runner (paged attention, fused ops, sampling rows); the same
process times the step's weight matmuls alone (every projection and the lm_head at B
rows, through the same `linear`, on the model's own weights), interleaved with the steps.
Issue 11's target: a 16-sequence step within 2x its matmuls (what is not matmul is
attention, norms, rotary, KV writes and dispatch).

Run: .venv/bin/python benchmarks/decode_step.py [--weights auto] [--kv-dtype fp32] [--batches 1,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def streamed_bytes(model) -> int:
    """Weight bytes one decode step reads: every weight held, except that a projection
    packed into panels (layers/linear.py's int8_panels) is read from its panels alone, not
    also from its row-major codes (and a tied embedding's lookup reads a few rows)."""
    held = [model.lm_head] + [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    return model.weights_bytes - sum(w.quant.nbytes for w in held if getattr(w, "panels", None) is not None)


def matmuls_only(model, rows: int) -> float:
    """Seconds for every projection of every layer plus the lm_head at `rows` rows."""
    from ctxwarden.layers.linear import linear

    h = torch.randn(rows, model.spec.hidden_size)
    inter = torch.randn(rows, model.spec.intermediate_size)
    attn = torch.randn(rows, model.q_size)
    start = time.perf_counter()
    for w in model.layers:
        linear(h, w.qkv), linear(attn, w.o), linear(h, w.gate_up), linear(inter, w.down)
    linear(h, model.lm_head)
    return time.perf_counter() - start


def read_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best of `repeats` full reads of a buffer far larger than any cache (GB/s)."""
    buf = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def decode_steps(runner, batch: int, context: int, steps: int) -> list[float]:
    """Seconds per decode step of `batch` sequences after `context`-token prompts."""
    from ctxwarden.runner import ForwardBatch, SequenceInput

    per_seq = -(-(context + steps + 1) // runner.layout.block_size)
    tables = [(tuple(range(b * per_seq, (b + 1) * per_seq)),) for b in range(batch)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40_000, (context,), generator=g).tolist() for _ in range(batch)]
    for p, t in zip(prompts, tables):
        runner.forward(ForwardBatch((SequenceInput.chunk(p, 0, t),)))
    out = []
    for i in range(steps):
        batch_in = ForwardBatch(tuple(SequenceInput.chunk([1234], context + i, t) for t in tables))
        start = time.perf_counter()
        runner.forward(batch_in)
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--kv-dtype", default="fp32")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    from ctxwarden.runner import ModelRunner, RunnerConfig

    results, bandwidth = {}, read_bandwidth_gbs()
    for batch in (int(b) for b in args.batches.split(",")):
        per_seq = -(-(args.context + args.steps + 1) // 16)
        runner = ModelRunner(None, RunnerConfig(num_blocks=batch * per_seq, weights=args.weights,
                                                kv_dtype=args.kv_dtype))
        with torch.inference_mode():
            steps = decode_steps(runner, batch, args.context, args.steps)
            mm = [matmuls_only(runner.model, batch) for _ in range(args.steps)]
        step_s, mm_s = statistics.median(steps[2:]), statistics.median(mm[2:])
        floor_s = streamed_bytes(runner.model) / (bandwidth * 1e9)
        results[batch] = {"step_ms": 1e3 * step_s, "matmuls_ms": 1e3 * mm_s, "ratio": step_s / mm_s,
                          "step_ms_min_max": [1e3 * min(steps[2:]), 1e3 * max(steps[2:])],
                          "weights_mb": runner.model.weights_bytes / 1e6,
                          "streamed_mb": streamed_bytes(runner.model) / 1e6,
                          "weight_streaming_floor_ms": 1e3 * floor_s, "step_over_floor": step_s / floor_s}
        print(f"batch {batch:3d}: step {1e3 * step_s:7.2f} ms, matmuls alone {1e3 * mm_s:7.2f} ms "
              f"-> {step_s / mm_s:.2f}x; weights read {streamed_bytes(runner.model) / 1e6:.0f} MB / "
              f"{bandwidth:.1f} GB/s = floor {1e3 * floor_s:.1f} ms ({step_s / floor_s:.2f}x)", flush=True)
    out = ROOT / "benchmarks" / "results" / "decode_step.json"
    name = f"decode_step_{args.weights}_kv{args.kv_dtype}.json"
    out = out.with_name(name)
    out.write_text(json.dumps({"weights": args.weights, "kv_dtype": args.kv_dtype, "context": args.context,
                               "results": results,
                               "read_bandwidth_gbs": bandwidth,
                               "threads": torch.get_num_threads(),
                               "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))


if __name__ == "__main__":
    main()
