"""`ctxwarden diag leak`: the slow-leak detector, on recorded samples or on a live engine run.

With SAMPLES (JSONL of LeakSample fields) it fits and judges them. With --model it serves
--requests prompts through an engine in this process, one after another, and samples this
process's RssAnon + VmSwap after each (after gc.collect(), so cyclic garbage waiting for the
collector is not counted); --trim-probe also records the figure right after malloc_trim(0).
"""

from __future__ import annotations

import argparse
import json

HELP = "Slow-leak detector: RSS (RssAnon+VmSwap) slope per request, TTFT drift, malloc_trim probe."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `diag leak`."""
    p.add_argument("samples", nargs="?", default=None, help="JSONL samples to judge (omit with --model)")
    p.add_argument("--model", default=None, help="run this model in-process and sample it (HF dir or .gguf)")
    p.add_argument("--default-model", action="store_true", help="--model SmolLM2-135M-Instruct (the default)")
    p.add_argument("--requests", type=int, default=200, help="--model: requests to serve (default 200)")
    p.add_argument("--prompt-tokens", type=int, default=64,
                   help="--model: longest prompt; lengths are uniform in [half, all] (default 64)")
    p.add_argument("--max-tokens", type=int, default=8, help="--model: tokens to generate per request")
    p.add_argument("--kv-memory", default="256MiB", help="--model: KV pool size")
    p.add_argument("--trim-probe", action="store_true", help="--model: also sample after malloc_trim(0)")
    p.add_argument("--warmup", type=int, default=0, help="ignore samples before this many requests")
    p.add_argument("--min-slope", type=float, default=1024.0, help="bytes per request that count as a leak")
    p.add_argument("--samples-out", default=None, metavar="FILE", help="--model: write the samples (JSONL)")
    p.add_argument("--png", default=None, metavar="FILE", help="plot memory and TTFT against requests")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    """Get samples (file or live run), judge them, render."""
    from ctxwarden.diagnostics.leaks import assess_leak

    samples = _live_samples(args) if (args.model or args.default_model) else _read_samples(args.samples)
    if args.samples_out:
        with open(args.samples_out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(s.__dict__) + "\n" for s in samples)
    report = assess_leak(samples, min_slope_bytes=args.min_slope, warmup_requests=args.warmup)
    if args.png:
        from ctxwarden.diagnostics.plots import plot_leak

        plot_leak(samples, report, args.png)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _render(report, args)
    return 0


def _read_samples(path: str | None):
    from ctxwarden.diagnostics.leaks import LeakSample

    if path is None:
        raise ValueError("give a SAMPLES file, or --model M / --default-model to sample a live engine")
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    try:
        return [LeakSample(**json.loads(line)) for line in lines]
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{path}: not leak samples ({e}); fields: completed_requests, leak_basis_bytes, "
                         "trimmed_leak_basis_bytes, prompt_tokens, ttft_s") from None


def _live_samples(args):
    import gc

    import numpy as np
    from rich.progress import Progress

    from ctxwarden.diagnostics.leaks import LeakSample, malloc_trim
    from ctxwarden.diagnostics.process_memory import read_leak_basis_bytes
    from ctxwarden.llm import LLM
    from ctxwarden.sampling import SamplingParams

    if args.requests < 10 or args.prompt_tokens < 2:
        raise ValueError(f"--requests must be >= 10 and --prompt-tokens >= 2, got {args.requests}, "
                         f"{args.prompt_tokens}")
    llm = LLM(args.model, kv_memory=args.kv_memory)
    vocab = llm.engine.spec.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    samples = []
    with Progress(transient=True) as bar:
        task = bar.add_task("requests", total=args.requests)
        for i in range(1, args.requests + 1):
            # random ids: every prompt is new, so the prefix cache cannot hide per-request costs
            ids = rng.integers(0, vocab, int(rng.integers(args.prompt_tokens // 2, args.prompt_tokens + 1))).tolist()
            out = llm.generate([ids], params, show_progress=False)[0]
            gc.collect()
            basis = read_leak_basis_bytes()
            trimmed = read_leak_basis_bytes() if args.trim_probe and malloc_trim() is not None else None
            samples.append(LeakSample(i, basis, trimmed, len(ids), out.time_to_first_token_s))
            bar.advance(task)
    return samples


def _render(report, args) -> None:
    from rich.console import Console

    c = Console()
    r = report.rss
    c.print(f"[bold]{report.verdict}[/bold]: {report.reason}")
    c.print(f"RssAnon+VmSwap: {r.slope:,.0f} B/request, {r.confidence:.0%} interval "
            f"{r.slope_low:,.0f} to {r.slope_high:,.0f}, R^2 {r.r_squared if r.r_squared is not None else float('nan'):.3f}, "
            f"{r.num_samples} samples")
    if report.trimmed:
        t = report.trimmed
        c.print(f"after malloc_trim: {t.slope:,.0f} B/request ({t.slope_low:,.0f} to {t.slope_high:,.0f})")
    if report.ttft:
        d = report.ttft
        c.print(f"TTFT drift at fixed prompt length: {d.seconds_per_1000_requests * 1000:+,.1f} ms per 1,000 "
                f"requests ({d.low * 1000:+,.1f} to {d.high * 1000:+,.1f}); median TTFT {d.median_ttft_s * 1000:,.1f} ms")
    if args.png:
        c.print(f"plot written to {args.png}")
