"""What the live attention monitor costs: engine step times with sampling off, on, and unwrapped.

Four engines on the same checkpoint (default SmolLM2-135M-Instruct) in one process:

    unwrapped    --attention-sample-rate 0, then checked: the runner's backend is the plain
                 backend (no MonitoredAttention anywhere): the reference
    rate 0       a second engine built the same way (the product path; against the
                 reference this is an A/A comparison: it shows the measurement's own spread)
    wrapped      the backend wrapped in the monitor, but no request sampled (a rate of 1e-12:
                 the cost of the wrapper's one branch per layer)
    rate 1       every request monitored (the monitor's full cost)

Each round runs, on every engine in turn (the order rotates by round, so drift in the shared
CPUs' speed spreads over all four): --batch requests of --prompt-tokens random token ids
prefilled in one step (timed), then --decode-steps decode steps (each timed). Per engine the
median step time; per round the ratio to the reference's median in that round, reported as
median, interquartile range and range over rounds. Results: benchmarks/results/attention_monitor_overhead.{json,png}.

Run: nice -n 10 .venv/bin/python benchmarks/attention_monitor_overhead.py [--rounds 12]  (about 3 min)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from diagnostics_demo import machine_note  # noqa: E402
OUT = ROOT / "benchmarks" / "results" / "attention_monitor_overhead"
CONFIGS = (("unwrapped", 0.0), ("rate 0", 0.0), ("wrapped, none sampled", 1e-12), ("rate 1", 1.0))


def build(model: str | None, rate: float, kv_memory: str):
    """An engine with the given sample rate (prefix caching off: every round computes)."""
    from ctxwarden.engine.config import EngineConfig
    from ctxwarden.engine.engine import Engine
    from ctxwarden.runner.attention_monitor import MonitoredAttention

    engine = Engine(EngineConfig.build(model=model, kv_memory=kv_memory, attention_sample_rate=rate,
                                       enable_prefix_caching=False))
    if rate == 0.0 and isinstance(engine.runner.backend, MonitoredAttention):
        raise AssertionError("sampling off must leave the backend unwrapped")
    if rate > 0.0 and not isinstance(engine.runner.backend, MonitoredAttention):
        raise AssertionError("sampling on must wrap the backend")
    return engine


def one_round(engine, prompts: list[list[int]], decode_steps: int, tag: str) -> tuple[float, list[float]]:
    """(prefill step seconds, decode step seconds) of one batch of requests on `engine`."""
    from ctxwarden.sampling import SamplingParams

    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    for k, ids in enumerate(prompts):
        engine.add_request(ids, params, request_id=f"{tag}-{k}")
    times = []
    while engine.has_unfinished_requests:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.release_finished()
    engine.attention_done.clear()
    return times[0], times[1:1 + decode_steps]


def summarise(samples: dict, reference: str) -> dict:
    """Per engine and phase: median step time; per round ratios to the reference."""
    out = {}
    for name, rounds in samples.items():
        out[name] = {}
        for phase in ("prefill", "decode"):
            medians = [statistics.median(r[phase]) for r in rounds]
            ratios = [m / statistics.median(ref[phase]) for m, ref in zip(medians, samples[reference])]
            q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
            out[name][phase] = {"median_step_s": statistics.median(medians), "min_round_s": min(medians),
                                "max_round_s": max(medians), "ratio_median": statistics.median(ratios),
                                "ratio_q1": q1, "ratio_q3": q3, "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return out


def plot(summary: dict, path: Path, note: str) -> None:
    """Ratios to the unwrapped backend per phase, with the range over rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, phase in zip(axes, ("prefill", "decode")):
        mid = [summary[n][phase]["ratio_median"] for n in names]
        lo = [m - summary[n][phase]["ratio_min"] for m, n in zip(mid, names)]
        hi = [summary[n][phase]["ratio_max"] - m for m, n in zip(mid, names)]
        ax.bar(range(len(names)), mid, yerr=[lo, hi], capsize=4, color=["0.6", "0.6", "tab:blue", "tab:orange"])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(names)), names, rotation=15)
        ax.set_title(f"{phase} step: time / unwrapped (median, range over rounds)")
    axes[0].set_ylabel("step time ratio")
    fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    """Build the engines, run the rounds, write JSON and PNG."""
    from rich.progress import Progress

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--kv-memory", default="256MiB")
    p.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not recorded")
    args = p.parse_args()
    rng = random.Random(0)
    note = f"{machine_note()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} (at start)"
    samples: dict[str, list] = {name: [] for name, _ in CONFIGS}
    with Progress() as progress:
        task = progress.add_task("engines", total=len(CONFIGS))
        engines = {}
        for name, rate in CONFIGS:
            engines[name] = build(args.model, rate, args.kv_memory)
            progress.advance(task)
        task = progress.add_task("rounds", total=(args.warmup_rounds + args.rounds) * len(CONFIGS))
        for r in range(-args.warmup_rounds, args.rounds):
            prompts = [[rng.randrange(100, 40_000) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
            order = [CONFIGS[(k + r) % len(CONFIGS)][0] for k in range(len(CONFIGS))]
            for name in order:
                prefill, decode = one_round(engines[name], prompts, args.decode_steps, f"r{r}")
                if r >= 0:
                    samples[name].append({"prefill": [prefill], "decode": decode})
                progress.advance(task)
    summary = summarise(samples, "unwrapped")
    note += f", at end {os.getloadavg()[0]:.1f}"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": note, "model": engines["unwrapped"].checkpoint.name, "args": vars(args),
              "summary": summary, "samples": samples}
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(summary, OUT.with_suffix(".png"), f"{result['model']}: {args.batch} x {args.prompt_tokens}-token prompts, "
         f"{args.decode_steps} decode steps, {args.rounds} rounds; {note}")
    for name, phases in summary.items():
        print(f"{name:>22}: " + "; ".join(
            f"{ph} {v['median_step_s'] * 1e3:7.1f} ms x{v['ratio_median']:.3f} (IQR {v['ratio_q1']:.3f}-"
            f"{v['ratio_q3']:.3f}, range {v['ratio_min']:.3f}-{v['ratio_max']:.3f})"
            for ph, v in phases.items()))
    print(f"written {OUT.with_suffix('.json')} and .png ({note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
