"""One benchmark run in a fresh process: `python bench_children.py PEER WORKLOAD INPUTS.json`.

Run by `ctxwarden bench` (cli/bench.py), never imported by it: each child is a new
interpreter, so peak RSS is that peer's own and no peer warms another's caches. The file
imports nothing from ctxwarden at the top, because the llama.cpp child runs under the
benchmark's own virtual environment (benchmarks/.venv-peers), where ctxwarden is absent.
Every peer reads the same token ids from INPUTS.json and prints one JSON line.

Workloads (issue 11):
    W1  16 prompts x 512 tokens, 128 new tokens each, greedy: wall seconds, tokens/s
    W2  one 8,000-token prompt, 1 new token: time to first token, peak RSS
    W3  batch-1 decode after a 128-token prompt, 128 new tokens: ms per token
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def summary(wall_s: float, gens: list[list[int]], ttft_s: float | None, decode_s: float | None) -> dict:
    """The JSON line every child prints: wall, tokens, TTFT, decode rate, peak RSS."""
    total = sum(len(g) for g in gens)
    out = {"wall_s": wall_s, "new_tokens": total, "tokens_per_s": total / wall_s,
           "ttft_s": ttft_s, "peak_rss_mb": peak_rss_mb(), "first_tokens": [g[:8] for g in gens[:2]]}
    if decode_s is not None and total > 1:
        out["ms_per_token"] = 1000 * decode_s / (total - 1)
    return out


def run_ctxwarden(inputs: dict) -> dict:
    from ctxwarden import LLM, SamplingParams

    prompts, n_new = inputs["prompts"], inputs["new_tokens"]
    llm = LLM(inputs.get("model"), kv_memory=inputs["kv_memory"], max_batched_tokens=2048,
              weights=inputs.get("weights", "auto"), kv_dtype=inputs.get("kv_dtype"))
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    ttft = outs[0].time_to_first_token_s
    out = summary(wall, [list(o.token_ids) for o in outs], ttft, wall - ttft if len(outs) == 1 else None)
    return out | memory_plan(llm.engine, [len(p) + n_new for p in prompts])


def memory_plan(engine, sequence_tokens: list[int]) -> dict:
    """The plan this run's peak RSS is held to (plan/capacity.py process_plan), MB."""
    from ctxwarden.plan.capacity import process_plan

    plan = process_plan(engine.spec, engine.runner.layout, weights_bytes=engine.weights_plan[0],
                        sequence_tokens=sequence_tokens, max_batched_tokens=engine.config.max_batched_tokens)
    mb = {k.replace("_bytes", "_mb"): v / 2**20 for k, v in plan.items()}
    resident = engine.runner.kv_cache.resident_bytes()  # the pool's pages written so far
    return {"plan": mb, "plan_mb": mb["total_mb"], "rss_over_plan": peak_rss_mb() / mb["total_mb"],
            "weights_held_mb": engine.runner.model.weights_bytes / 2**20,
            "kv_resident_mb": None if resident is None else resident / 2**20}


def run_transformers(inputs: dict) -> dict:
    import torch
    import transformers

    path = Path(inputs["gguf"])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    prompts, n_new = inputs["prompts"], inputs["new_tokens"]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:1, -16:], attention_mask=mask[:1, -16:], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        first = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
        ttft = time.perf_counter() - start
        out = first if n_new == 1 else model.generate(
            ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
            pad_token_id=0)
        wall = time.perf_counter() - start - (ttft if n_new > 1 else 0)
    gens = out[:, width:].tolist()
    return summary(wall, gens, ttft, wall - ttft if len(prompts) == 1 and n_new > 1 else None)


def run_llamacpp(inputs: dict) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(inputs["gguf"], n_ctx=8192 + 256, n_threads=inputs["threads"],
                          n_batch=512, verbose=False)
    prompts, n_new = inputs["prompts"], inputs["new_tokens"]
    gens, ttft = [], None
    start = time.perf_counter()
    for p in prompts:  # llama-cpp-python's API has no batching: one request at a time
        t0, toks = time.perf_counter(), []
        for tok in llm.generate(p, top_k=1, temp=0.0, reset=True):
            if not toks and ttft is None:
                ttft = time.perf_counter() - t0
            toks.append(tok)
            if len(toks) >= n_new:
                break
        gens.append(toks)
    wall = time.perf_counter() - start
    return summary(wall, gens, ttft, wall - ttft if len(prompts) == 1 else None)


RUNNERS = {"ctxwarden": run_ctxwarden, "transformers": run_transformers, "llama.cpp": run_llamacpp}


def main() -> int:
    """Run one (peer, workload) and print its JSON line."""
    peer, workload, inputs_path = sys.argv[1:4]
    inputs = json.loads(Path(inputs_path).read_text())
    result = RUNNERS[peer](inputs)
    result.update({"peer": peer, "workload": workload})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
