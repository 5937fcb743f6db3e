"""fp8 KV against bf16 and fp32 KV on SmolLM2-135M-Instruct: passkey and perplexity.

The same engine settings for every --kv-dtypes entry (weights and activations --dtype,
prefix cache off), one after another in this process:

  passkey     length x depth, teacher-forced log p of the 5-digit key and whether every key
              token ranks first (long_context_quality.passkey_grid, the issue's probe);
              plus the same prompts without the needle: what a lost key scores.
  perplexity  of --ppl-tokens of Austen (../shared/corpora) scored in one pass (prompt
              logprobs), each dtype against fp32 KV.

Run: nice -n 10 .venv/bin/python benchmarks/fp8_kv_quality.py [--lengths 1536,4096]
Results: benchmarks/results/fp8_kv_quality.json and fp8_kv_quality.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
import long_context_quality as lcq  # noqa: E402  (the probe's grid and engine settings)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=lcq._ints, default=[1536, 4096])
    ap.add_argument("--depths", type=lcq._floats, default=[0.1, 0.5, 0.9])
    ap.add_argument("--kv-dtypes", type=lambda s: s.split(","), default=["fp32", "bf16", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="fp32", help="weights and activations")
    return ap.parse_args()


def no_key_rows(args, progress) -> list[dict]:
    """The probe with a needle that names another key: what the asked key scores when lost."""
    from ctxwarden.diagnostics.passkey import build_passkey_prompt, score_passkey

    llm = lcq.load(args, args.kv_dtypes[0], **lcq.mode_options("none", args, max(args.lengths)))
    rows, task = [], progress.add_task("no-key control", total=len(args.lengths))
    for length in args.lengths:
        prompt = build_passkey_prompt(llm.tokenizer, length, 0.5, "90576")  # needle names 90576
        decoy = build_passkey_prompt(llm.tokenizer, length, 0.5, lcq.KEY)
        scored = type(prompt)(prompt.token_ids[:-prompt.num_key_tokens] + decoy.token_ids[-decoy.num_key_tokens:],
                              decoy.num_key_tokens, prompt.needle_position)
        rows.append({"length": length, "logprob": score_passkey(llm, scored).logprob})
        progress.advance(task)
    llm.close()
    return rows


def perplexities(args, progress) -> dict:
    from ctxwarden.sampling import SamplingParams

    out, task = {}, progress.add_task("perplexity", total=len(args.kv_dtypes))
    for kv in args.kv_dtypes:
        llm = lcq.load(args, kv)
        ids = llm.tokenizer.encode(lcq.corpus_text()[100_000:100_000 + 8 * args.ppl_tokens])[:args.ppl_tokens]
        scored = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), show_progress=False)[0]
        nll = [-t.logprob for t in scored.prompt_logprobs if t is not None]
        out[kv] = math.exp(sum(nll) / len(nll))
        llm.close()
        progress.advance(task)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, base = result["passkey"], "bf16"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    cells = sorted({(r["length"], r["depth"]) for r in rows})
    labels = [f"{n // 1024 if n % 1024 == 0 else n / 1024:g}K@{d:.0%}" for n, d in cells]
    for kv in result["args"]["kv_dtypes"]:
        ys = [next(r["logprob"] for r in rows if r["kv_dtype"] == kv and (r["length"], r["depth"]) == c) for c in cells]
        left.plot(range(len(cells)), ys, "o-", label=f"{kv} KV")
    lost = min(r["logprob"] for r in result["no_key"])
    left.axhline(lost, color="grey", ls=":", label=f"key not in prompt ({lost:.1f})")
    left.set_xticks(range(len(cells)), labels, rotation=45, fontsize=8)
    left.set_ylabel("log p(key), teacher-forced")
    left.set_title("passkey (length @ depth)")
    left.legend(fontsize=7)
    kvs = result["args"]["kv_dtypes"]
    ppl = result["perplexity"]
    right.bar(kvs, [100 * (ppl[k] / ppl["fp32"] - 1) for k in kvs])
    right.set_ylabel("perplexity vs fp32 KV (%)")
    right.set_title(f"Austen, {result['args']['ppl_tokens']} tokens (fp32: {ppl['fp32']:.2f})")
    fig.suptitle(f"SmolLM2-135M, KV dtypes ({result['machine']['date']}, load {result['machine']['load_avg_start'][0]:.1f})")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    result = {"machine": lcq.machine(), "args": vars(args), "key": lcq.KEY}
    columns = (*Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        result["passkey"] = [r for kv in args.kv_dtypes for r in lcq.passkey_grid(args, progress, ["none"], kv)]
        result["no_key"] = no_key_rows(args, progress)
        result["perplexity"] = perplexities(args, progress)
    result["machine"]["load_avg_end"] = os.getloadavg()
    for kv in args.kv_dtypes:
        deltas = [r["logprob"] - b["logprob"] for r in result["passkey"] if r["kv_dtype"] == kv
                  for b in result["passkey"] if b["kv_dtype"] == "bf16" and (b["length"], b["depth"]) == (r["length"], r["depth"])]
        result.setdefault("delta_vs_bf16", {})[kv] = {"min": min(deltas), "max": max(deltas)} if deltas else None
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fp8_kv_quality.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / "fp8_kv_quality.png")
    print(json.dumps({k: result[k] for k in ("delta_vs_bf16", "perplexity", "no_key")}, indent=1))


if __name__ == "__main__":
    main()
