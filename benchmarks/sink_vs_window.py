"""Sink (StreamingLLM) mode against plain sliding-window attention, side by side.

Same SmolLM2 engine settings, same prompt, a rolling window of --window tokens; sink mode
adds --sinks kept tokens (scored against the re-positioned query). Each mode runs in turn,
--repeats times round-robin, in this one process (the model is loaded once per mode).
Issue 11's target: sink mode within 1.2x of the window-only time.

Run: .venv/bin/python benchmarks/sink_vs_window.py [--tokens 12000] [--repeats 2] [--kv-dtype fp32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=12_000)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--kv-dtype", default="fp32")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sink_vs_window.json")
    args = ap.parse_args()
    from ctxwarden import LLM, SamplingParams
    from ctxwarden.cli.bench_run import corpus_text

    engines = {name: LLM(kv_memory="256MiB", window_tokens=args.window, sink_tokens=sinks,
                         weights=args.weights, kv_dtype=args.kv_dtype, enable_prefix_caching=False)
               for name, sinks in (("window", 0), ("sink", args.sinks))}
    ids = engines["window"].tokenizer.encode(corpus_text()[:args.tokens * 8])[:args.tokens]
    params = SamplingParams(max_tokens=1, temperature=0)
    times = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate([ids], params)
            times[name].append(time.perf_counter() - start)
    med = {n: statistics.median(t) for n, t in times.items()}
    result = {"tokens": args.tokens, "window": args.window, "sinks": args.sinks, "weights": args.weights,
              "kv_dtype": args.kv_dtype,
              "prompt_attention": {n: llm.engine.runner.prompt_attention for n, llm in engines.items()},
              "times_s": times,
              "sink_over_window": med["sink"] / med["window"], "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.tokens} tokens, window {args.window}: window-only {med['window']:.1f} s, "
          f"sink {med['sink']:.1f} s -> {result['sink_over_window']:.2f}x (runs {times})")


if __name__ == "__main__":
    main()
