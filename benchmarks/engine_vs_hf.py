"""ctxwarden's engine beside transformers and llama.cpp on SmolLM2-135M-Instruct.

Every (peer, workload) pair runs in a fresh child process, so peak RSS is that peer's own
and one peer's caches never help another. The parent runs the children in turn under one
OpenMP wait policy (pass --omp passive|active|both), collects their JSON, writes
benchmarks/results/engine_vs_hf.json, a PNG, and prints the ratio table.

Workloads (the engine issue's):
- throughput: 16 requests x 512-token prompts (Austen), 128 new tokens each, greedy, fp32.
  ctxwarden: one generate() call (continuous batching). transformers: one batched
  generate() (left padding). llama.cpp: one request at a time (its Python API has no batch).
- long_prompt: one 8,000-token prompt, 1 new token: time to first token, peak RSS.
- decode: batch-1 decode, 128-token prompt, 256 new tokens: ms per token.
- prefix_cache (ctxwarden only): a shared 4K-token prefix, cold then warm TTFT.
- pressure (ctxwarden only): a KV pool sized for 4 sequences, 16 submitted: all complete,
  outputs identical to an unpressured run, preemptions counted.

Run: .venv/bin/python benchmarks/engine_vs_hf.py [--omp both] [--quick]
llama.cpp is optional: `pip install llama-cpp-python` (builds from source, ~9 minutes);
the benchmark notes it and skips it when absent. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# shared/ sits beside the checkout (CI, /work/main) or one level further up (a worktree)
CORPUS = next((d / "shared" / "corpora" / "austen" for d in (ROOT.parent, ROOT.parent.parent)
               if (d / "shared" / "corpora" / "austen").is_dir()), ROOT.parent / "shared" / "corpora" / "austen")

PEERS = ("ctxwarden", "transformers", "llama.cpp")
WORKLOADS = {
    "throughput": PEERS,
    "long_prompt": PEERS,
    "decode": PEERS,
    "prefix_cache": ("ctxwarden",),
    "pressure": ("ctxwarden",),
}


# ---------------------------------------------------------------------------------------
# shared inputs: the same token ids for every peer


def corpus_ids(tokenizer_encode, num_tokens: int, offset_chars: int = 0) -> list[int]:
    text = "".join(p.read_text() for p in sorted(CORPUS.glob("*.txt")))[offset_chars:]
    ids = tokenizer_encode(text[: num_tokens * 8])
    if len(ids) < num_tokens:
        raise RuntimeError(f"the corpus gave {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def workload_prompts(name: str, encode, quick: bool) -> list[list[int]]:
    scale = 4 if quick else 1
    if name == "throughput":
        return [corpus_ids(encode, 512 // scale, 20_000 * i) for i in range(16 // scale)]
    if name == "long_prompt":
        return [corpus_ids(encode, 8000 // scale, 7)]
    if name == "decode":
        return [corpus_ids(encode, 128, 99)]
    raise KeyError(name)


def new_tokens(name: str, quick: bool) -> int:
    n = {"throughput": 128, "long_prompt": 1, "decode": 256}[name]
    return max(1, n // 4) if quick else n


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------------------------------
# children: one peer, one workload, one JSON line on stdout


# The KV pool is allocated (and touched) whole at start-up, so it is sized to the workload,
# as an operator would size it, with room to spare: SmolLM2 fp32 holds 46,080 B per token
# (throughput 16 x 640 tokens = 472 MB, long_prompt 8,001 tokens = 369 MB). Peers allocate
# only what they use, so a 2 GiB pool here would measure the setting, not the engine.
KV_MEMORY = {"throughput": "640MiB", "long_prompt": "400MiB", "decode": "64MiB",
             "prefix_cache": "512MiB"}


def child_ctxwarden(workload: str, quick: bool) -> dict:
    from ctxwarden import LLM, SamplingParams

    llm = LLM(kv_memory=KV_MEMORY.get(workload, "2GiB"), max_batched_tokens=2048)
    encode = lambda t: llm.tokenizer.encode(t)  # noqa: E731
    if workload == "prefix_cache":
        return _ctx_prefix_cache(llm, encode, quick)
    if workload == "pressure":
        return _ctx_pressure(encode, quick)
    prompts = workload_prompts(workload, encode, quick)
    params = SamplingParams(max_tokens=new_tokens(workload, quick), temperature=0, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return _summary(workload, wall, [len(o.token_ids) for o in outs],
                    [o.time_to_first_token_s for o in outs], [list(o.token_ids) for o in outs])


def _ctx_prefix_cache(llm, encode, quick: bool) -> dict:
    from ctxwarden import SamplingParams

    prefix = corpus_ids(encode, 4096 // (4 if quick else 1), 333)
    params = SamplingParams(max_tokens=1, temperature=0)
    ttft = []
    for question in (" Who is the heroine?", " Who is the heroine?", " Where does she live?"):
        out = llm.generate([prefix + encode(question)], params)[0]
        ttft.append((out.time_to_first_token_s, out.num_cached_tokens))
    return {"workload": "prefix_cache", "cold_ttft_s": ttft[0][0], "warm_same_ttft_s": ttft[1][0],
            "warm_other_question_ttft_s": ttft[2][0], "cached_tokens": [t[1] for t in ttft],
            "warm_over_cold": ttft[2][0] / ttft[0][0], "peak_rss_mb": peak_rss_mb()}


def _ctx_pressure(encode, quick: bool) -> dict:
    """16 requests whose final length fits 4 at a time: short prompts, long answers.

    Admission only needs the prompt's blocks, so all 16 start; as they grow the pool runs
    out and the scheduler must preempt. Outputs must equal an unpressured run.
    """
    from ctxwarden import LLM, SamplingParams

    prompts = [corpus_ids(encode, 64, 5_000 * i) for i in range(16)]
    params = SamplingParams(max_tokens=96 if quick else 192, temperature=0, ignore_eos=True)
    calm = LLM(kv_memory="1GiB").generate(prompts, params)
    page = LLM(kv_memory="64MiB").engine.runner.layout.page_bytes
    per_seq = -(-(64 + params.max_tokens) // 16)
    out = {"workload": "pressure", "sequences_room": 4, "submitted": 16}
    for mode in ("swap", "recompute"):
        tight = LLM(kv_memory=4 * per_seq * page, preemption_mode=mode, enable_prefix_caching=False)
        start = time.perf_counter()
        pressed = tight.generate(prompts, params)
        stats = tight.engine.stats()
        out[mode] = {"wall_s": time.perf_counter() - start,
                     "all_complete": all(o.finish_reason == "length" for o in pressed),
                     "identical_to_unpressured": [o.token_ids for o in pressed] == [o.token_ids for o in calm],
                     "preemptions": stats.num_preemptions_swap + stats.num_preemptions_recompute,
                     "blocks_in_use_after": stats.kv.num_blocks_in_use}
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def child_transformers(workload: str, quick: bool) -> dict:
    import torch
    import transformers

    from ctxwarden.spec.checkpoint import default_model_path

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    encode = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = workload_prompts(workload, encode, quick)
    n_new = new_tokens(workload, quick)
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:1, -16:], attention_mask=mask[:1, -16:], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                             do_sample=False, pad_token_id=pad)
        wall = time.perf_counter() - start
    gen = out[:, width:].tolist()
    ttft = [wall] if n_new == 1 else [None] * len(prompts)
    return _summary(workload, wall, [len(g) for g in gen], ttft, gen)


def child_llamacpp(workload: str, quick: bool) -> dict:
    import llama_cpp

    from ctxwarden.spec.checkpoint import default_model_path

    llm = llama_cpp.Llama(str(default_model_path()), n_ctx=8192 + 64, n_threads=2, n_batch=512,
                          logits_all=False, verbose=False)
    encode = lambda t: llm.tokenize(t.encode(), add_bos=False, special=False)  # noqa: E731
    prompts = workload_prompts(workload, encode, quick)
    n_new = new_tokens(workload, quick)
    gens, ttfts = [], []
    start = time.perf_counter()
    for p in prompts:
        llm.reset()
        t0 = time.perf_counter()
        toks = []
        for tok in llm.generate(p, top_k=1, temp=0.0, reset=True):
            if not toks:
                ttfts.append(time.perf_counter() - t0)
            toks.append(tok)
            if len(toks) >= n_new:
                break
        gens.append(toks)
    wall = time.perf_counter() - start
    return _summary(workload, wall, [len(g) for g in gens], ttfts, gens)


def _summary(workload: str, wall: float, counts: list[int], ttfts, gens) -> dict:
    total = sum(counts)
    out = {"workload": workload, "wall_s": wall, "new_tokens": total,
           "tokens_per_s": total / wall, "peak_rss_mb": peak_rss_mb(),
           "ttft_s": ttfts[0] if ttfts and ttfts[0] is not None else None,
           "first_tokens": [g[:8] for g in gens[:4]]}
    if workload == "decode":
        out["ms_per_token"] = 1000 * (wall - (ttfts[0] or 0)) / max(total - 1, 1) if ttfts[0] else 1000 * wall / total
    return out


CHILDREN = {"ctxwarden": child_ctxwarden, "transformers": child_transformers, "llama.cpp": child_llamacpp}


# ---------------------------------------------------------------------------------------
# parent


def run_child(peer: str, workload: str, omp: str, quick: bool, timeout_s: int) -> dict:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if omp == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = [sys.executable, __file__, "--child", peer, workload] + (["--quick"] if quick else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def has_llamacpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("PEER", "WORKLOAD"))
    ap.add_argument("--omp", choices=["passive", "active", "both"], default="passive")
    ap.add_argument("--quick", action="store_true", help="quarter-size workloads (smoke run)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per child")
    ap.add_argument("--merge", action="store_true",
                    help="keep the runs already in the results file; replace only those run now")
    args = ap.parse_args()
    if args.child:
        peer, workload = args.child
        print(json.dumps(CHILDREN[peer](workload, args.quick)))
        return
    from rich.progress import Progress

    policies = ["passive", "active"] if args.omp == "both" else [args.omp]
    jobs = [(omp, w, p) for omp in policies for w in args.workloads.split(",") for p in WORKLOADS[w]]
    name = "engine_vs_hf_quick" if args.quick else "engine_vs_hf"
    results = _previous(RESULTS / f"{name}.json") if args.merge else {}
    results.update({"machine": _machine(), "quick": args.quick})
    results.setdefault("runs", {})
    with Progress() as bar:
        task = bar.add_task("benchmark", total=len(jobs))
        for omp, workload, peer in jobs:
            bar.update(task, description=f"{omp} {workload} {peer}")
            if peer == "llama.cpp" and not has_llamacpp():
                res = {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
            else:
                res = run_child(peer, workload, omp, args.quick, args.timeout)
            results["runs"].setdefault(omp, {}).setdefault(workload, {})[peer] = res
            bar.advance(task)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2))
    table = render_table(results)
    (RESULTS / f"{name}.md").write_text(table)
    plot(results, RESULTS / f"{name}.png")
    print(table)


def _previous(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _machine() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}


def render_table(results: dict) -> str:
    rows = [f"Machine: {results['machine']['cpu_count']} vCPU, torch {results['machine']['torch']}, "
            f"{results['machine']['date']}{' (quick)' if results['quick'] else ''}", ""]
    for omp, by_w in results["runs"].items():
        rows += [f"### OMP_WAIT_POLICY={omp}", "", "| workload | metric | ctxwarden | transformers | llama.cpp | "
                 "ctxwarden / transformers | ctxwarden / llama.cpp |", "|---|---|---|---|---|---|---|"]
        for workload, metric, better in (("throughput", "tokens_per_s", "higher"), ("long_prompt", "ttft_s", "lower"),
                                         ("long_prompt", "peak_rss_mb", "lower"), ("decode", "ms_per_token", "lower")):
            peers = by_w.get(workload, {})
            vals = [peers.get(p, {}).get(metric) for p in PEERS]
            cells = [f"{v:.3g}" if isinstance(v, (int, float)) else "-" for v in vals]
            ratios = [_ratio(vals[0], v, better) for v in vals[1:]]
            rows.append(f"| {workload} | {metric} ({better} is better) | " + " | ".join(cells + ratios) + " |")
        rows.append("")
        pc = by_w.get("prefix_cache", {}).get("ctxwarden", {})
        if "cold_ttft_s" in pc:
            rows.append(f"prefix cache: cold TTFT {pc['cold_ttft_s']:.2f} s, warm (new question) "
                        f"{pc['warm_other_question_ttft_s']:.3f} s = {100 * pc['warm_over_cold']:.1f}% of cold; "
                        f"cached tokens {pc['cached_tokens']}")
        pr = by_w.get("pressure", {}).get("ctxwarden", {})
        for mode in ("swap", "recompute"):
            if mode in pr:
                m = pr[mode]
                rows.append(f"pressure ({mode}): 16 requests in a pool for 4: all complete {m['all_complete']}, "
                            f"identical {m['identical_to_unpressured']}, preemptions {m['preemptions']}, "
                            f"blocks in use after {m['blocks_in_use_after']}, {m['wall_s']:.1f} s")
        rows.append("")
    return "\n".join(rows) + "\n"


def _ratio(ours, theirs, better: str) -> str:
    if not isinstance(ours, (int, float)) or not isinstance(theirs, (int, float)) or not ours or not theirs:
        return "-"
    r = ours / theirs if better == "higher" else theirs / ours
    return f"{r:.2f}x"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("throughput", "tokens_per_s", "tokens/s (16 x 512, 128 new)"),
               ("long_prompt", "ttft_s", "8K-token TTFT (s)"),
               ("long_prompt", "peak_rss_mb", "8K-token peak RSS (MB)"),
               ("decode", "ms_per_token", "batch-1 decode (ms/token)")]
    policies = list(results["runs"])
    fig, axes = plt.subplots(len(policies), len(metrics), figsize=(16, 3.6 * len(policies)), squeeze=False)
    for i, omp in enumerate(policies):
        for j, (w, m, title) in enumerate(metrics):
            peers = results["runs"][omp].get(w, {})
            vals = [peers.get(p, {}).get(m) or 0 for p in PEERS]
            axes[i][j].bar(PEERS, vals, color=["tab:green", "tab:blue", "tab:orange"])
            axes[i][j].set_title(f"{title}\nOMP {omp}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
