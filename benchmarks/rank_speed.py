"""Ranking a 64K-token document vs prefilling it: is the dense ranker cheap next to the model?

For a 65,536-token excerpt (SmolLM2 tokens) of Emma and of the Python docs, with a
question at the end, in one process and interleaved with the model runs below:

  segment      cutting it into sentence units (what every ranker starts from)
  lexical      rank_segments(..., "lexical") over those units (BM25)
  hybrid cold  rank_segments(..., "hybrid") with an empty embedding cache (every unit embedded)
  hybrid warm  the same again: every unit's embedding comes from the cache
  fit          fit(..., "keep-tail-semantic", ranker="hybrid") into an 8,192-token window, cold cache

SmolLM2-135M-Instruct's prefill (ctxwarden.LLM, fp32, prefix cache off, one new prompt per
repeat, time to first token with max_tokens=1) is measured at 4,096 and 8,191 tokens; 64K
is beyond its 8,192-token window, so its prefill there is estimated two ways: linear from
the 8K rate (a lower bound: attention grows with the square of the length), and with
t(n) = a n + b n^2 fitted through the 4K and 8K medians.

    python benchmarks/rank_speed.py [--repeats 3] [--corpora DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import context_quality as cq
from ctxwarden.context import fit, load_tokenizer, semantic
from ctxwarden.context.encoders import load_encoder
from ctxwarden.context.rank import rank_segments

DOC_TOKENS = 65_536
PREFILL_TOKENS = (4096, 8191)  # 8,192 is the window: one token is left for the first sample
QUESTION = "\n\nQuestion: Which passage above describes a change of plans, and why?"


def _excerpt(text: str, tok, num_tokens: int, offset_chars: int = 0) -> str:
    cuts = tok.cuts(text[offset_chars:offset_chars + num_tokens * 6])
    k = int(np.searchsorted(cuts.cut_tokens, num_tokens, side="right")) - 1
    return text[offset_chars:offset_chars + int(cuts.cut_chars[k])]


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def rank_once(doc: str, tok) -> dict[str, float]:
    """One repeat of every ranking measurement on `doc` (cache cleared first)."""
    encoder = load_encoder()
    seg_s, units = _timed(lambda: semantic.build_units([doc], set(), tok, tail_budget_tokens=4096))
    segments = [doc[u.start:u.end] for u in units if not u.is_protected]
    question = semantic.question_text(units, [doc])
    lexical_s, _ = _timed(lambda: rank_segments(question, segments, "lexical"))
    encoder.clear()
    cold_s, _ = _timed(lambda: rank_segments(question, segments, "hybrid"))
    warm_s, _ = _timed(lambda: rank_segments(question, segments, "hybrid"))
    encoder.clear()
    fit_s, r = _timed(lambda: fit(doc, 8192, 256, tok, "keep-tail-semantic", ranker="hybrid"))
    assert r.prompt_tokens <= 8192 - 256
    return {"segment_s": seg_s, "lexical_s": lexical_s, "hybrid_cold_s": cold_s, "hybrid_warm_s": warm_s,
            "fit_hybrid_cold_s": fit_s, "num_segments": len(segments),
            "num_word_pieces": encoder.encoder.count_word_pieces(segments)}


def prefill_once(llm, text: str, num_tokens: int) -> float:
    """Seconds to the first token of a fresh num_tokens-token prompt (prefill + one sample)."""
    from ctxwarden import SamplingParams

    ids = llm.tokenizer.encode(text)[:num_tokens]
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), show_progress=False)[0]
    return out.time_to_first_token_s


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3), "max": round(max(values), 3)}


def estimate_prefill(medians: dict[int, float], num_tokens: int) -> dict[str, float]:
    """64K prefill from the 4K/8K medians: linear at the 8K rate, and a n + b n^2 through both points."""
    (n1, t1), (n2, t2) = sorted(medians.items())
    b = (t2 / n2 - t1 / n1) / (n2 - n1)  # from t/n = a + b n
    a = t1 / n1 - b * n1
    # b <= 0: the 8K prompt cost no more per token than the 4K one (noise on shared cores), so
    # the run measured no quadratic term and only the linear lower bound is reported
    quadratic = round(a * num_tokens + b * num_tokens ** 2, 1) if b > 0 else None
    return {"linear_from_8k_s": round(t2 * num_tokens / n2, 1), "quadratic_fit_s": quadratic,
            "fit_a_s_per_token": a, "fit_b_s_per_token2": b}


def run(repeats: int, corpora: Path) -> dict:
    from ctxwarden import LLM

    tok = load_tokenizer()
    sources = cq._sources(corpora)
    docs = {"emma": _excerpt(sources["austen"][0], tok, DOC_TOKENS) + QUESTION,
            "python-docs": _excerpt(sources["python-docs"][0], tok, DOC_TOKENS) + QUESTION}
    load_s, _ = _timed(load_encoder)
    llm = LLM(kv_memory="1GiB", enable_prefix_caching=False)
    ranks: dict[str, list[dict]] = {name: [] for name in docs}
    prefill: dict[int, list[float]] = {n: [] for n in PREFILL_TOKENS}
    prose = sources["austen"][1]
    for rep in range(repeats):  # interleaved, so both sides see the same load on the shared cores
        for name, doc in docs.items():
            ranks[name].append(rank_once(doc, tok))
        for n in PREFILL_TOKENS:
            prefill[n].append(prefill_once(llm, _excerpt(prose, tok, n + 64, offset_chars=rep * 50_000), n))
    return {"encoder_load_s": round(load_s, 2), "rank": ranks, "prefill_s": prefill}


def summarise(raw: dict) -> dict:
    """min / median / max of every timing; the 64K prefill estimate; prefill / ranking ratios."""
    medians = {n: statistics.median(v) for n, v in raw["prefill_s"].items()}
    est = estimate_prefill(medians, DOC_TOKENS)
    out = {"prefill_s": {str(n): _spread(v) for n, v in raw["prefill_s"].items()}, "prefill_64k_estimate": est,
           "encoder_load_s": raw["encoder_load_s"], "documents": {}}
    for name, reps in raw["rank"].items():
        row = {k: _spread([r[k] for r in reps]) for k in reps[0] if k.endswith("_s")}
        row["num_segments"], row["num_word_pieces"] = reps[0]["num_segments"], reps[0]["num_word_pieces"]
        cold = row["hybrid_cold_s"]["median"]
        row["prefill_linear_over_hybrid_cold"] = round(est["linear_from_8k_s"] / cold, 1)
        row["prefill_quadratic_over_hybrid_cold"] = (round(est["quadratic_fit_s"] / cold, 1)
                                                     if est["quadratic_fit_s"] else None)
        out["documents"][name] = row
    return out


def plot(summary: dict, path: Path) -> None:
    """Seconds, log scale: ranking each document vs SmolLM2 prefill (measured and estimated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colours = [], [], []
    for name, row in summary["documents"].items():
        for key, label in (("lexical_s", "lexical"), ("hybrid_cold_s", "hybrid, cold"),
                           ("hybrid_warm_s", "hybrid, warm"), ("fit_hybrid_cold_s", "fit hybrid")):
            labels.append(f"{name}: {label}")
            values.append(row[key]["median"])
            colours.append("C0")
    for n, st in summary["prefill_s"].items():
        labels.append(f"SmolLM2 prefill {int(n):,} tokens (measured)")
        values.append(st["median"])
        colours.append("C1")
    est = summary["prefill_64k_estimate"]
    labels.append("SmolLM2 prefill 64K (linear from 8K, a lower bound)")
    values.append(est["linear_from_8k_s"])
    colours.append("C3")
    if est["quadratic_fit_s"]:
        labels.append("SmolLM2 prefill 64K (a n + b n^2 through 4K, 8K)")
        values.append(est["quadratic_fit_s"])
        colours.append("C3")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ys = list(range(len(labels)))[::-1]  # first label on top
    ax.barh(ys, values, color=colours)
    ax.set_yticks(ys, labels)
    ax.set_xscale("log")
    ax.set_xlabel("seconds (median), log scale")
    ax.set_title("Ranking a 65,536-token document vs prefilling it (2 shared cores)")
    for y, v in zip(ys, values):
        ax.text(v, y, f" {v:.3g} s", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--replot", action="store_true", help="summarise and plot the saved raw timings again")
    ap.add_argument("--corpora", default=None)
    ap.add_argument("--out", type=Path, default=cq.ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    saved = args.out / "rank_speed.json"
    if args.replot:
        data = json.loads(saved.read_text())
        raw = {**data["raw"], "prefill_s": {int(n): v for n, v in data["raw"]["prefill_s"].items()}}
        summary = {**summarise(raw), "meta": data["summary"]["meta"]}
        return _save(saved, summary, raw, args.out)
    raw = run(args.repeats, cq.corpora_dir(args.corpora))
    summary = summarise(raw)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    summary["meta"] = {"repeats": args.repeats, "doc_tokens": DOC_TOKENS, "machine": machine,
                       "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
                       "load_average_after": os.getloadavg()}
    _save(saved, summary, raw, args.out)


def _save(path: Path, summary: dict, raw: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": summary, "raw": raw}, indent=2))
    plot(summary, out / "rank_speed.png")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
