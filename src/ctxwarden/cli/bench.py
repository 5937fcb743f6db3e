"""`ctxwarden bench`: W1 / W2 / W3 for ctxwarden, transformers and llama.cpp, side by side.

Every (peer, workload, repeat) is a fresh process (cli/bench_children.py), run round-robin
(repeat 1 of every pair, then repeat 2, ...) so that a noisy minute on shared cores hits
every peer alike; each OpenMP wait policy asked for gets its own rounds. Prints the table
(median, min-max spread, ratios of medians), and writes benchmarks/results/bench.json and
bench.png. transformers must be importable (the [test] extra); llama.cpp comes from the
benchmark's own environment (--peers-python, default benchmarks/.venv-peers/bin/python:
`make bench-peers` builds llama-cpp-python there); a missing peer is reported, not fatal.
"""

from __future__ import annotations

import argparse

HELP = "Benchmark ctxwarden against transformers and llama.cpp (W1 throughput, W2 8K TTFT, W3 decode)."

PEERS = ("ctxwarden", "transformers", "llama.cpp")
WORKLOADS = ("W1", "W2", "W3")
# workload -> (metric, better, label)
METRICS = {"W1": ("wall_s", "lower", "16 x 512 -> 128, wall s"),
           "W2": ("ttft_s", "lower", "8,000-token prompt, TTFT s"),
           "W2_rss": ("peak_rss_mb", "lower", "8,000-token prompt, peak RSS MB"),
           "W3": ("ms_per_token", "lower", "batch-1 decode, ms/token")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="W1,W2,W3", help="comma-separated subset of W1,W2,W3")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of " + ",".join(PEERS))
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per (peer, workload)")
    p.add_argument("--omp", choices=["passive", "active", "both"], default="both",
                   help="OMP_WAIT_POLICY for the children (active = unset: threads spin)")
    p.add_argument("--weights", default="auto", help="ctxwarden's weights mode")
    p.add_argument("--kv-dtype", default=None,
                   help="ctxwarden's KV cache dtype (default: its compute dtype, fp32; bf16 halves "
                        "the bytes decode attention reads, perplexity within 0.2%% of fp32 KV: "
                        "tests/engine/test_fp8_kv_quality.py)")
    p.add_argument("--quick", action="store_true", help="quarter-size workloads (a smoke run)")
    p.add_argument("--peers-python", default="benchmarks/.venv-peers/bin/python",
                   help="interpreter with llama-cpp-python installed")
    p.add_argument("--out", default="benchmarks/results", help="folder for bench.json / bench.png")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per child")


def run(args: argparse.Namespace) -> int:
    from ctxwarden.cli.bench_run import run_bench

    return run_bench(args)
