"""The parent side of `ctxwarden bench`: inputs, round-robin children, table, JSON, PNG."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ctxwarden.cli.bench import METRICS, PEERS

CHILD = Path(__file__).with_name("bench_children.py")
SIZES = {"W1": (16, 512, 128), "W2": (1, 8000, 1), "W3": (1, 128, 128)}  # prompts, tokens, new
# KV pool per workload, sized as an operator would (SmolLM2 fp32 KV: 46,080 B per token)
KV_MEMORY = {"W1": "768MiB", "W2": "512MiB", "W3": "64MiB"}


def corpus_text() -> str:
    """Austen from shared/corpora (beside the checkout, or one level further up)."""
    here = Path.cwd().resolve()
    for base in (here, *here.parents):
        folder = base / "shared" / "corpora" / "austen"
        if folder.is_dir():
            return "".join(p.read_text() for p in sorted(folder.glob("*.txt")))
    raise FileNotFoundError("shared/corpora/austen not found beside this checkout; the "
                            "benchmark prompts are cut from it")


def workload_inputs(name: str, quick: bool, weights: str, kv_dtype: str | None = None) -> dict:
    """The token ids and settings every peer of one workload gets."""
    from ctxwarden.spec.checkpoint import default_model_path
    from ctxwarden.context.tokenizers import load_tokenizer

    num_prompts, num_tokens, num_new = SIZES[name]
    if quick:
        num_prompts, num_tokens, num_new = max(1, num_prompts // 4), num_tokens // 4, max(1, num_new // 4)
    text, tok = corpus_text(), load_tokenizer()
    prompts = [tok.encode(text[20_000 * i + 7:20_000 * i + 7 + num_tokens * 8])[:num_tokens]
               for i in range(num_prompts)]
    return {"prompts": prompts, "new_tokens": num_new, "gguf": str(default_model_path()),
            "kv_memory": KV_MEMORY[name], "weights": weights, "kv_dtype": kv_dtype,
            "threads": os.cpu_count() or 1}


def run_child(peer: str, workload: str, inputs: Path, omp: str, python: str, timeout_s: int) -> dict:
    """One fresh process; its JSON line, or {'error': ...}."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if omp == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    exe = python if peer == "llama.cpp" else sys.executable
    try:
        done = subprocess.run([exe, str(CHILD), peer, workload, str(inputs)], capture_output=True,
                              text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    except OSError as e:
        return {"error": f"{exe}: {e}"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def run_bench(args) -> int:
    """Run every round, print the table, write JSON and PNG."""
    from rich.progress import Progress

    workloads, peers = args.workloads.split(","), args.peers.split(",")
    policies = ["passive", "active"] if args.omp == "both" else [args.omp]
    runs: dict = {omp: {w: {p: [] for p in peers} for w in workloads} for omp in policies}
    jobs = [(omp, r, w, p) for omp in policies for r in range(args.repeats) for w in workloads for p in peers]
    with tempfile.TemporaryDirectory() as tmp, Progress() as bar:
        paths = {}
        for w in workloads:
            paths[w] = Path(tmp) / f"{w}.json"
            paths[w].write_text(json.dumps(workload_inputs(w, args.quick, args.weights, args.kv_dtype)))
        task = bar.add_task("bench", total=len(jobs))
        results = {"machine": machine(), "args": vars(args) | {"_module": None}, "runs": runs}
        for omp, r, w, p in jobs:
            bar.update(task, description=f"{omp} round {r + 1} {w} {p}")
            runs[omp][w][p].append(run_child(p, w, paths[w], omp, args.peers_python, args.timeout))
            write_results(results, Path(args.out))  # after every child: a cut-short run keeps its data
            bar.advance(task)
    print(write_results(results, Path(args.out)))
    return 0


def write_results(results: dict, out: Path) -> str:
    """bench.json, bench.md and bench.png in `out`; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    table = render_table(results)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "bench.md").write_text(table)
    plot(results, out / "bench.png")
    return table


def machine() -> dict:
    """Where and when: CPU model and flags that matter, cores, kernels, torch, date."""
    import torch

    from ctxwarden.diagnostics.environment import read_cpu
    from ctxwarden.ext import simd_level

    cpu = read_cpu()
    return {"cpu": cpu["model"] or "?", "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "flags": [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
                      if cpu["flags"].get(f)],
            "kernels": simd_level(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M")}


def stats(samples: list[dict], metric: str) -> dict | None:
    """Median and min-max of one metric over a pair's runs (errors left out)."""
    vals = [s[metric] for s in samples if isinstance(s.get(metric), (int, float))]
    if not vals:
        errors = [s.get("error") or s.get("skipped") for s in samples if "error" in s or "skipped" in s]
        return {"error": errors[0]} if errors else None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def render_table(results: dict) -> str:
    """Markdown: one table per wait policy, medians with spread, ratios of medians."""
    m = results["machine"]
    rows = [f"Machine: {m['cpu']}, {m['cpu_count']} vCPU ({', '.join(m['flags'])}), torch {m['torch']}, "
            f"{m['date']}; ctxwarden weights={results['args']['weights']}, "
            f"kv {results['args'].get('kv_dtype') or 'fp32 (the compute dtype)'}, kernels {m.get('kernels', '?')}; median [min-max] of "
            f"{results['args']['repeats']} fresh processes per cell, run round-robin", ""]
    for omp, by_w in results["runs"].items():
        rows += [f"### OMP_WAIT_POLICY={'PASSIVE' if omp == 'passive' else 'unset (threads spin)'}", "",
                 "| workload | " + " | ".join(PEERS) + " | transformers / ctxwarden | llama.cpp / ctxwarden |",
                 "|---|" + "---|" * (len(PEERS) + 2)]
        for key, (metric, _better, label) in METRICS.items():
            peers = by_w.get(key.split("_")[0], {})
            cells = [stats(peers.get(p, []), metric) for p in PEERS]
            rows.append(f"| {label} | " + " | ".join(_cell(c) for c in cells) + " | "
                        + " | ".join(_ratio(cells[0], c) for c in cells[1:]) + " |")
        rows += ["", *_plan_line(by_w.get("W2", {}).get("ctxwarden", [])), ""]
    return "\n".join(rows) + "\n"


def _plan_line(samples: list[dict]) -> list[str]:
    """ctxwarden's W2 peak RSS against its memory plan (issue 11: <= the plan + 10%)."""
    over, resident = stats(samples, "rss_over_plan"), stats(samples, "kv_resident_mb")
    plan = next((s["plan"] for s in samples if "plan" in s), None)
    if not over or "median" not in over or plan is None:
        return []
    return [f"ctxwarden W2 peak RSS / plan: {_cell(over)} (plan {plan['total_mb']:,.0f} MB = weights "
            f"{plan['weights_mb']:,.0f} + KV {plan['kv_mb']:,.0f} + activation reserve with the runtime "
            f"{plan['activation_reserve_mb']:,.0f}; plan/capacity.py process_plan)"
            + (f"; KV pages resident after the run {_cell(resident)} MB" if resident and "median" in resident else "")]


def _cell(c: dict | None) -> str:
    if c is None:
        return "-"
    if "error" in c:
        return "error"
    return f"{c['median']:.3g} [{c['min']:.3g}-{c['max']:.3g}]"


def _ratio(ours: dict | None, theirs: dict | None) -> str:
    """theirs / ours for lower-is-better metrics: > 1 means ctxwarden is faster."""
    if not ours or not theirs or "median" not in ours or "median" not in theirs or not ours["median"]:
        return "-"
    return f"{theirs['median'] / ours['median']:.2f}x"


def plot(results: dict, path: Path) -> None:
    """Bars of the medians with min-max whiskers, one row per wait policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(results["runs"])
    fig, axes = plt.subplots(len(policies), len(METRICS), figsize=(16, 3.6 * len(policies)), squeeze=False)
    for i, omp in enumerate(policies):
        for j, (key, (metric, _b, label)) in enumerate(METRICS.items()):
            cells = [stats(results["runs"][omp].get(key.split("_")[0], {}).get(p, []), metric) for p in PEERS]
            med = [c["median"] if c and "median" in c else 0 for c in cells]
            err = [[(c["median"] - c["min"]) if c and "median" in c else 0 for c in cells],
                   [(c["max"] - c["median"]) if c and "median" in c else 0 for c in cells]]
            axes[i][j].bar(PEERS, med, yerr=err, color=["tab:green", "tab:blue", "tab:orange"], capsize=4)
            axes[i][j].set_title(f"{label}\nOMP {omp} (lower is better)", fontsize=9)
    fig.suptitle(f"ctxwarden bench: {results['machine']['cpu']}, {results['machine']['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
