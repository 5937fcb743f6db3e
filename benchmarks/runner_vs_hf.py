"""Benchmark (not a test): ctxwarden's paged runner vs transformers on SmolLM2-135M-Instruct.

Both load the same Q4_1 GGUF dequantised to fp32. Measured per framework, each in its own
subprocess (so peak RSS is its own): prefill time of 1K / 4K / 8K-token prompts (real text,
logits of the last row only for both), batch-1 decode ms/token after a 128-token prompt,
and peak RSS. Results: benchmarks/results/runner_vs_hf.json and .png, ratios printed.

    PYTHONPATH=src OMP_WAIT_POLICY=PASSIVE python benchmarks/runner_vs_hf.py [--lengths 1024 4096 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DECODE_PROMPT, DECODE_TOKENS = 128, 64


def _prompt_ids(max_len: int) -> list[int]:
    from transformers import AutoTokenizer

    from ctxwarden.spec.checkpoint import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    corpus = Path(__file__).resolve().parents[1].parent / "shared" / "corpora" / "austen"
    text = " ".join(p.read_text() for p in sorted(corpus.glob("*.txt"))) if corpus.is_dir() else "word " * 20000
    return tok(text[: max_len * 8])["input_ids"][:max_len]


def _ours(ids: list[int], lengths: list[int]) -> dict:
    from ctxwarden.plan.kv import cdiv
    from ctxwarden.runner import ForwardBatch, ModelRunner, RunnerConfig, SequenceInput

    block = 16
    runner = ModelRunner(None, RunnerConfig(num_blocks=cdiv(max(lengths) + DECODE_TOKENS, block) + 1,
                                            block_size=block))
    table = (tuple(range(runner.config.num_blocks)),)

    def step(tokens, cached):
        return runner.forward(ForwardBatch((SequenceInput.chunk(tokens, cached, table),)))[0]

    prefill = {}
    for n in lengths:
        t = time.perf_counter()
        step(ids[:n], 0)
        prefill[n] = time.perf_counter() - t
    token = int(step(ids[:DECODE_PROMPT], 0).argmax())
    t = time.perf_counter()
    for i in range(DECODE_TOKENS):
        token = int(step([token], DECODE_PROMPT + i).argmax())
    return {"prefill_s": prefill, "decode_ms_per_token": 1000 * (time.perf_counter() - t) / DECODE_TOKENS}


def _hf(ids: list[int], lengths: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from ctxwarden.spec.checkpoint import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    prefill = {}
    with torch.inference_mode():
        for n in lengths:
            t = time.perf_counter()
            model(torch.tensor([ids[:n]]), use_cache=True, logits_to_keep=1)
            prefill[n] = time.perf_counter() - t
        out = model(torch.tensor([ids[:DECODE_PROMPT]]), use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        t = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
    return {"prefill_s": prefill, "decode_ms_per_token": 1000 * (time.perf_counter() - t) / DECODE_TOKENS}


def _worker(which: str, ids_file: str, lengths: list[int]) -> None:
    ids = json.loads(Path(ids_file).read_text())
    result = (_ours if which == "ctxwarden" else _hf)(ids, lengths)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def _run_worker(which: str, ids_file: Path, lengths: list[int]) -> dict:
    cmd = [sys.executable, __file__, "--worker", which, "--ids", str(ids_file),
           "--lengths", *map(str, lengths)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode:
        raise RuntimeError(f"{which} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(results["frameworks"])
    lengths = results["lengths"]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        r = results["frameworks"][name]
        a.bar([j + i * width for j in range(len(lengths))], [r["prefill_s"][str(n)] for n in lengths],
              width, label=name)
        b.bar(i, r["decode_ms_per_token"], label=name)
    a.set_xticks([j + width / 2 for j in range(len(lengths))], [f"{n // 1024}K" for n in lengths])
    a.set_ylabel("prefill seconds"), a.set_title("SmolLM2-135M fp32 prefill"), a.legend()
    b.set_xticks(range(len(names)), names), b.set_ylabel("ms / token")
    b.set_title(f"decode after {DECODE_PROMPT} tokens")
    fig.suptitle(f"OMP_WAIT_POLICY={results['omp_wait_policy']}, {results['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--worker", choices=["ctxwarden", "transformers"])
    p.add_argument("--ids")
    args = p.parse_args()
    if args.worker:
        return _worker(args.worker, args.ids, args.lengths)
    import torch

    RESULTS.mkdir(parents=True, exist_ok=True)
    ids_file = RESULTS / ".prompt_ids.json"
    ids_file.write_text(json.dumps(_prompt_ids(max(args.lengths))))
    frameworks = {w: _run_worker(w, ids_file, args.lengths) for w in ("ctxwarden", "transformers")}
    ids_file.unlink()
    results = {"model": "SmolLM2-135M-Instruct Q4_1 GGUF -> fp32", "lengths": args.lengths,
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
               "threads": torch.get_num_threads(), "frameworks": frameworks}
    (RESULTS / "runner_vs_hf.json").write_text(json.dumps(results, indent=2))
    _plot(results, RESULTS / "runner_vs_hf.png")
    ours, hf = frameworks["ctxwarden"], frameworks["transformers"]
    print("| metric | ctxwarden | transformers | ratio (hf / ours) |\n|---|---|---|---|")
    for n in args.lengths:
        o, h = ours["prefill_s"][str(n)], hf["prefill_s"][str(n)]
        print(f"| prefill {n} tokens (s) | {o:.2f} | {h:.2f} | {h / o:.2f}x |")
    o, h = ours["decode_ms_per_token"], hf["decode_ms_per_token"]
    print(f"| decode ms/token | {o:.1f} | {h:.1f} | {h / o:.2f}x |")
    print(f"| peak RSS MB | {ours['peak_rss_mb']:.0f} | {hf['peak_rss_mb']:.0f} | "
          f"{hf['peak_rss_mb'] / ours['peak_rss_mb']:.2f}x |")


if __name__ == "__main__":
    main()
