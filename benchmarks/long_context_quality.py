"""Long-context quality of SmolLM2-135M-Instruct (trained window 8,192) past and inside its window.

Four measurements, each a flag-sized grid (defaults: the reduced grid this shared 2-core
machine runs in a few minutes; the issue's full grid is the command at the bottom):

  passkey     length x depth x mode, teacher-forced log p of a 5-digit key after "The pass key
              is " (ctxwarden.diagnostics.passkey) and whether every key token ranks first.
              Modes: none (max_model_len raised, unscaled), linear, dynamic (NTK), yarn (all
              with --factor), sinks (streaming: --sinks + --window). One heatmap per mode.
  kv dtype    the passkey grid again for --kv-modes with each --kv-dtypes (fp32 / bf16; fp8
              when the runner offers it), side by side in the JSON and one PNG.
  perplexity  streaming over --ppl-tokens of ../shared/corpora text (Austen), per --ppl-bucket
              tokens: sinks + window vs window-only vs full attention (full only inside the
              trained window). One curve per mode.
  overflow    the truncation A/B through the real server's overflow policies: a passkey
              prompt over the server's --overflow-window, sent by the official openai client
              with extra_body {"ctxwarden": {"on_overflow": P}}; greedy answer contains the
              key?, tokens dropped (from the response's report).

    nice -n 10 .venv/bin/python benchmarks/long_context_quality.py            # reduced grid
    .venv/bin/python benchmarks/long_context_quality.py --lengths 1024,2048,4096,8192,12288,16384,32768 \\
        --depths 0.1,0.3,0.5,0.7,0.9 --ppl-tokens 65536 --overflow-depths 0.1,0.3,0.5,0.7,0.9   # full

Results: benchmarks/results/long_context_quality.json and long_context_quality_*.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRAINED_WINDOW = 8192
KEY = "48213"
MODES = ("none", "linear", "dynamic", "yarn", "sinks")
POLICIES = ("truncate-head", "truncate-middle", "keep-tail-semantic")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=_ints, default=[2048, 4096])
    ap.add_argument("--depths", type=_floats, default=[0.1, 0.5, 0.9])
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    ap.add_argument("--factor", type=float, default=4.0, help="linear / dynamic / yarn factor")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=1020, help="sinks mode: the rolling window")
    ap.add_argument("--kv-dtypes", type=lambda s: s.split(","), default=["fp32", "bf16"])
    ap.add_argument("--kv-modes", type=lambda s: s.split(","), default=["none"])
    ap.add_argument("--ppl-tokens", type=int, default=10_000)
    ap.add_argument("--ppl-bucket", type=int, default=1000)
    ap.add_argument("--overflow-window", type=int, default=2048)
    ap.add_argument("--overflow-tokens", type=int, default=3000)
    ap.add_argument("--overflow-depths", type=_floats, default=[0.1, 0.5, 0.9])
    ap.add_argument("--dtype", default="bf16", help="weights and activations (bf16: the fastest prefill here)")
    ap.add_argument("--skip", type=lambda s: s.split(","), default=[], help="passkey,kv,ppl,overflow")
    return ap.parse_args()


# --- engines ------------------------------------------------------------------------------------


def mode_options(mode: str, args, max_len: int) -> dict:
    """EngineConfig options of one mode for prompts up to `max_len` tokens."""
    scaled = {"linear": "linear", "dynamic": "dynamic", "yarn": "yarn"}
    if mode == "none":
        # + 1: the probe is scored with one token to generate after the prompt
        return {"max_model_len": max(max_len + 1, TRAINED_WINDOW),
                "allow_long_max_model_len": max_len + 1 > TRAINED_WINDOW}
    if mode in scaled:
        return {"rope_scaling": {"rope_type": scaled[mode], "factor": args.factor}}
    if mode == "sinks":
        return {"sink_tokens": args.sinks, "window_tokens": args.window}
    if mode == "window-only":
        return {"window_tokens": args.sinks + args.window}
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}, window-only")


def load(args, kv_dtype: str | None = None, **options):
    """The model in --dtype; with a KV dtype, fp32 activations and the GGUF's own Q4_1 weights
    (exact fp32 kernels), so that bf16 KV is a real rounding of fp32 K/V (bf16 activations
    would make an fp32 KV hold bf16 values exactly)."""
    from ctxwarden import LLM

    dtype, weights = ("fp32", "auto") if kv_dtype else (args.dtype, args.dtype)
    return LLM(kv_memory="2GiB", dtype=dtype, weights=weights, kv_dtype=kv_dtype,
               enable_prefix_caching=False, max_batched_tokens=4096, **options)


# --- passkey grid -------------------------------------------------------------------------------


def passkey_grid(args, progress, modes, kv_dtype=None) -> list[dict]:
    """One row per (mode, length, depth): log p of the key and whether it ranks first."""
    from ctxwarden.diagnostics.passkey import build_passkey_prompt, score_passkey

    rows = []
    task = progress.add_task(f"passkey kv={kv_dtype or args.dtype}", total=len(modes) * len(args.lengths) * len(args.depths))
    for mode in modes:
        llm = load(args, kv_dtype, **mode_options(mode, args, max(args.lengths)))
        for length in args.lengths:
            for depth in args.depths:
                prompt = build_passkey_prompt(llm.tokenizer, length, depth, KEY)
                started = time.perf_counter()
                score = score_passkey(llm, prompt)
                rows.append({"mode": mode, "kv_dtype": kv_dtype or args.dtype, "activations": "fp32" if kv_dtype
                             else args.dtype, "length": length, "depth": depth,
                             "logprob": score.logprob, "is_top1": score.is_top1,
                             "seconds": time.perf_counter() - started})
                progress.advance(task)
        llm.close()
    return rows


# --- streaming perplexity -----------------------------------------------------------------------


def corpus_text() -> str:
    from ctxwarden.cli.bench_run import corpus_text as austen

    return austen()


def perplexity_curves(args, progress) -> dict:
    """Per-bucket perplexity of the same corpus tokens under sinks / window-only / full."""
    from ctxwarden.sampling import SamplingParams

    curves = {}
    runs = (("sinks", args.ppl_tokens), ("window-only", args.ppl_tokens), ("full", min(args.ppl_tokens, TRAINED_WINDOW - 1)))
    task = progress.add_task("perplexity", total=len(runs))
    ids = None
    for mode, num_tokens in runs:
        llm = load(args, **({} if mode == "full" else mode_options(mode, args, num_tokens)))
        if ids is None:
            ids = llm.tokenizer.encode(corpus_text()[: args.ppl_tokens * 8])[: args.ppl_tokens]
        out = llm.generate([ids[:num_tokens]], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                           show_progress=False)[0]
        logps = [lp.logprob for lp in out.prompt_logprobs[1:]]
        curves[mode] = [math.exp(-sum(logps[i:i + args.ppl_bucket]) / len(logps[i:i + args.ppl_bucket]))
                        for i in range(0, len(logps), args.ppl_bucket)]
        llm.close()
        progress.advance(task)
    return {"bucket_tokens": args.ppl_bucket, "tokens": args.ppl_tokens, "curves": curves,
            "sinks": args.sinks, "window": args.window}


# --- overflow policies through the server --------------------------------------------------------


def overflow_ab(args, progress) -> list[dict]:
    """Each policy x depth through a real server (loopback) and the official openai client."""
    import openai

    from ctxwarden.diagnostics.passkey import build_passkey_prompt
    from ctxwarden.server.app import ServerConfig, create_app
    from live_server import ServerThread  # tests/live_server.py

    config = ServerConfig.build(kv_memory="1GiB", dtype=args.dtype, weights=args.dtype,
                                max_model_len=args.overflow_window, enable_prefix_caching=False)
    server = ServerThread(lambda: create_app(config)).start()
    rows = []
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        tok = server.app.state.server.engines[0].tokenizer
        task = progress.add_task("overflow policies", total=len(POLICIES) * len(args.overflow_depths))
        for depth in args.overflow_depths:
            prompt = build_passkey_prompt(tok, args.overflow_tokens, depth, KEY)
            text = tok.decode(list(prompt.token_ids[:-prompt.num_key_tokens]))
            for policy in POLICIES:
                rows.append(_one_overflow(client, model, text, policy, depth))
                progress.advance(task)
    finally:
        server.stop()
    return rows


def _one_overflow(client, model: str, text: str, policy: str, depth: float) -> dict:
    reply = client.completions.create(model=model, prompt=text, max_tokens=8, temperature=0, logprobs=1,
                                      extra_body={"ctxwarden": {"on_overflow": policy}})
    report = reply.model_extra["ctxwarden"]
    answer = reply.choices[0].text
    return {"policy": policy, "depth": depth, "answer": answer, "has_key": KEY in answer,
            "dropped_tokens": report["dropped_tokens"], "prompt_tokens": reply.usage.prompt_tokens,
            "first_token_logprob": reply.choices[0].logprobs.token_logprobs[0]}


# --- plots --------------------------------------------------------------------------------------


def plot_passkey(rows: list[dict], modes, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(modes), figsize=(3.2 * len(modes), 3.2), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        grid = [[next(r["logprob"] for r in rows if r["mode"] == mode and r["length"] == n and r["depth"] == d)
                 for n in args.lengths] for d in args.depths]
        im = ax.imshow(grid, vmin=-15, vmax=0, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(args.lengths)), [f"{n // 1024}K" for n in args.lengths])
        ax.set_yticks(range(len(args.depths)), [f"{d:.0%}" for d in args.depths])
        ax.set_title(mode)
        ax.set_xlabel("prompt length")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", color="w" if v < -7 else "k", fontsize=8)
    axes[0][0].set_ylabel("key depth")
    fig.colorbar(im, ax=axes[0].tolist(), label="log p(key)")
    fig.suptitle("SmolLM2-135M passkey, teacher-forced log p of the key (0 = certain)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_perplexity(ppl: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for mode, curve in ppl["curves"].items():
        xs = [(i + 1) * ppl["bucket_tokens"] for i in range(len(curve))]
        ax.plot(xs, curve, marker="o", label=mode)
    ax.axvline(TRAINED_WINDOW, color="grey", ls=":", label="trained window")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel(f"perplexity per {ppl['bucket_tokens']} tokens")
    ax.set_title(f"Streaming perplexity, Austen ({ppl['sinks']} sinks + {ppl['window']}-token window)")
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_overflow(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    depths = sorted({r["depth"] for r in rows})
    width = 0.8 / len(POLICIES)
    for k, policy in enumerate(POLICIES):
        ys = [next(r["first_token_logprob"] for r in rows if r["policy"] == policy and r["depth"] == d) for d in depths]
        ax.bar([i + k * width for i in range(len(depths))], ys, width, label=policy)
    ax.set_xticks([i + width for i in range(len(depths))], [f"key at {d:.0%}" for d in depths])
    ax.set_ylabel("log p of the first answer token")
    ax.set_title("Overflow policies through the server (prompt over the window)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------


def machine() -> dict:
    import torch

    return {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_avg_start": os.getloadavg(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}


def run(args) -> dict:
    """Every section not skipped; each stores its rows, its machine and the flags it ran with."""
    result = {"key": KEY}
    columns = (*Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    sections = {"passkey": lambda p: passkey_grid(args, p, args.modes),
                "kv_dtype": lambda p: [r for kv in args.kv_dtypes for r in passkey_grid(args, p, args.kv_modes, kv)],
                "perplexity": lambda p: perplexity_curves(args, p), "overflow": lambda p: overflow_ab(args, p)}
    plots = {"passkey": lambda rows: plot_passkey(rows, args.modes, args, RESULTS / "long_context_quality_passkey.png"),
             "kv_dtype": lambda rows: plot_kv(rows, args, RESULTS / "long_context_quality_kv_dtype.png"),
             "perplexity": lambda ppl: plot_perplexity(ppl, RESULTS / "long_context_quality_perplexity.png"),
             "overflow": lambda rows: plot_overflow(rows, RESULTS / "long_context_quality_overflow.png")}
    with Progress(*columns) as progress:
        for name, measure in sections.items():
            if {"kv_dtype": "kv", "perplexity": "ppl"}.get(name, name) in args.skip:
                continue
            started = machine()
            result[name] = measure(progress)
            plots[name](result[name])
            result[f"{name}_run"] = {"machine": dict(started, load_avg_end=os.getloadavg()), "args": vars(args)}
    return result


def plot_kv(rows: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    labels = [f"{r['mode']} {r['length'] // 1024}K @{r['depth']:.0%}" for r in rows if r["kv_dtype"] == args.kv_dtypes[0]]
    width = 0.8 / len(args.kv_dtypes)
    for k, kv in enumerate(args.kv_dtypes):
        ys = [r["logprob"] for r in rows if r["kv_dtype"] == kv]
        ax.bar([i + k * width for i in range(len(ys))], ys, width, label=f"KV {kv}")
    ax.set_xticks([i + width / 2 for i in range(len(labels))], labels, rotation=30, fontsize=7, ha="right")
    ax.set_ylabel("log p(key)")
    ax.set_title("Passkey by KV dtype (fp32 activations, Q4_1 weights)")
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import sys

    sys.path.insert(0, str(ROOT / "tests"))  # live_server: the loopback server thread
    result = run(args)
    out = RESULTS / "long_context_quality.json"
    previous = json.loads(out.read_text()) if out.is_file() else {}
    previous.update(result)  # a run with --skip keeps the other sections of the last run
    out.write_text(json.dumps(previous, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
