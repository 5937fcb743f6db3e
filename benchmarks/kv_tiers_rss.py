"""Memory soak: with a RAM tier of B bytes, RSS stays within (base + B) x 1.05 over a long run.

SmolLM2-135M-Instruct with a small KV pool (so almost every request evicts, and spills to
the RAM tier) serves distinct 1K-token prompts from the shipped text, one in four a repeat
(fetched back from RAM), for --minutes (10 by default). RSS is read from /proc after each
request. `base` is the RSS after the warm-up requests less what the RAM tier held then.
Writes benchmarks/results/kv_tiers_rss.json and .png; exits 1 if the bound is broken.
A script, not a test:  .venv/bin/python benchmarks/kv_tiers_rss.py [--minutes 10] [--ram 256MiB]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TEXT = ROOT / "src" / "ctxwarden" / "models" / "data" / "tokenizer_text.txt.gz"
WARMUP_REQUESTS = 3


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--ram", default="256MiB")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    args = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from rich.progress import Progress

    from ctxwarden.llm import LLM
    from ctxwarden.sampling import SamplingParams
    from ctxwarden.units import parse_bytes

    budget = parse_bytes(args.ram)
    llm = LLM(kv_memory="96MiB", kv_tiers=f"ram:{budget}")
    text = gzip.open(TEXT, "rt", encoding="utf-8").read()
    rng, seen, samples = random.Random(0), [], []
    params = SamplingParams(max_tokens=4, temperature=0.0)
    deadline = time.monotonic() + args.minutes * 60
    base = None
    with Progress() as bar:
        task = bar.add_task("soak", total=args.minutes * 60)
        while time.monotonic() < deadline:
            if seen and rng.random() < 0.25:
                ids = rng.choice(seen)
            else:
                at = rng.randrange(0, len(text) - 8 * args.prompt_tokens)
                ids = llm.tokenizer.encode(text[at:at + 8 * args.prompt_tokens])[:args.prompt_tokens]
                seen.append(ids)
            out = llm.generate([ids], params)[0]
            ram = llm.engine.stats().tiers[0]
            samples.append({"t_s": round(args.minutes * 60 - (deadline - time.monotonic()), 2), "rss": rss_bytes(),
                            "ram_tier_bytes": ram.used_bytes, "cached_tokens": out.num_cached_tokens})
            if len(samples) == WARMUP_REQUESTS:
                base = samples[-1]["rss"] - ram.used_bytes
            bar.update(task, completed=samples[-1]["t_s"])
    peak = max(s["rss"] for s in samples[WARMUP_REQUESTS:])
    bound = (base + budget) * 1.05
    ram = llm.engine.stats().tiers[0]
    result = {"minutes": args.minutes, "ram_budget_bytes": budget, "base_rss_bytes": base, "peak_rss_bytes": peak,
              "bound_bytes": bound, "within_bound": peak <= bound, "requests": len(samples),
              "ram_tier_hit_blocks": ram.num_hit_blocks, "ram_tier_stores": ram.num_stores, "samples": samples}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_tiers_rss.json").write_text(json.dumps(result, indent=1))
    _plot(result, RESULTS / "kv_tiers_rss.png")
    print(f"base {base / 2**20:.0f} MiB + RAM tier {budget / 2**20:.0f} MiB: peak RSS {peak / 2**20:.0f} MiB, "
          f"bound {bound / 2**20:.0f} MiB, {'within' if peak <= bound else 'OVER'} ({len(samples)} requests)")
    return 0 if peak <= bound else 1


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in r["samples"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [s["rss"] / 2**20 for s in r["samples"]], label="RSS")
    ax.plot(t, [(r["base_rss_bytes"] + s["ram_tier_bytes"]) / 2**20 for s in r["samples"]], label="base + RAM tier bytes")
    ax.axhline(r["bound_bytes"] / 2**20, color="red", linestyle="--", label="(base + budget) x 1.05")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MiB")
    ax.set_title(f"RSS with a {r['ram_budget_bytes'] / 2**20:.0f} MiB RAM tier, {r['requests']} requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
