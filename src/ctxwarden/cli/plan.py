"""`ctxwarden plan MODEL`: the exact KV and memory plan, as a table, JSON or a plot."""

from __future__ import annotations

import argparse
import json

from ctxwarden.engine.config import WEIGHTS_MODES, resolve_weights_mode

HELP = "Exact KV-cache and memory plan for a model and a budget."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, config.json or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per sequence to plan for (default: the model's window)")
    p.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--weights", default=None, choices=[*WEIGHTS_MODES, "stored"],
                   help="count the weights as this weights mode holds them on this machine's "
                        "kernels (default: $CTXWARDEN_WEIGHTS, else auto, as serve does); "
                        "stored: the bytes the checkpoint's headers give")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype the weights are loaded for (default fp32, as serve)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--memory", default="24GiB", help="total memory budget, e.g. 24GiB, 80GB")
    p.add_argument("--activation-reserve", default=None,
                   help="bytes kept for activations (default: sized from --max-batched-tokens)")
    p.add_argument("--max-batched-tokens", type=int, default=2048,
                   help="tokens one step processes (prefill chunk); sizes the reserve and the "
                        "sliding-window peak")
    p.add_argument("--sink-tokens", type=int, default=0, help="sink mode: tokens kept at the start")
    p.add_argument("--window", type=int, default=None, help="sink mode: rolling window after the sinks")
    p.add_argument("--train", action="store_true", help="also estimate training memory")
    p.add_argument("--micro-batch", type=int, default=1, help="--train: sequences per micro-batch")
    p.add_argument("--train-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="write KV bytes vs context per layer kind, with the budget line")


def run(args: argparse.Namespace) -> int:
    from ctxwarden.spec.checkpoint import resolve_checkpoint
    from ctxwarden.units import parse_bytes
    from ctxwarden.plan import plan_checkpoint
    from ctxwarden.plan.train import FORMULA, plan_training

    _validate(args)
    ckpt = resolve_checkpoint(args.model)
    reserve = parse_bytes(args.activation_reserve) if args.activation_reserve else None
    weights = resolve_weights_mode(args.weights)
    caps = None
    if weights != "stored" and ckpt.weights_bytes is not None:
        from ctxwarden.layers.linear import kernel_caps  # imports torch and ext/: what the runner runs on

        caps = kernel_caps()
    plan = plan_checkpoint(
        ckpt, parse_bytes(args.memory), weights=None if weights == "stored" else weights,
        dtype=args.dtype, caps=caps, context_tokens=args.context, kv_dtype=args.kv_dtype,
        block_size=args.block_size, activation_reserve_bytes=reserve,
        max_batched_tokens=args.max_batched_tokens, window_tokens=args.window,
        sink_tokens=args.sink_tokens,
    )
    train = (plan_training(ckpt.spec, plan.context_tokens, args.micro_batch, args.train_dtype)
             if args.train else None)
    if args.plot:
        from ctxwarden.plan.plot import plot_kv_vs_context

        plot_kv_vs_context(ckpt.spec, plan, args.plot)
    if args.json:
        out = plan.to_dict()
        if train:
            out["train"] = {**train.to_dict(), "formula": FORMULA}
        print(json.dumps(out, indent=2))
    else:
        _render(plan, train, FORMULA, args.plot)
    return 0


def _validate(args: argparse.Namespace) -> None:
    for name in ("context", "block_size", "max_batched_tokens", "micro_batch", "window"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.sink_tokens and not args.window:
        raise ValueError("--sink-tokens needs --window (the rolling window after the sinks)")


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024**3:,.2f} GiB"


def _render_defaulted(console, plan) -> None:
    """The fields config.json left out and the value each took from its family's defaults."""
    if not plan.defaulted:
        console.print("defaulted: none (config.json states every field the plan reads)")
        return
    shown = ", ".join(f"{name}={value!r}" for name, value in plan.defaulted.items())
    console.print(f"defaulted (not in config.json, {plan.model_type} class defaults): {shown}")


def _render(plan, train, formula: str, plot_path: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    t = Table(title=f"ctxwarden plan: {plan.model} ({plan.model_type}), kv {plan.kv_dtype}, "
                    f"block {plan.block_size}, context {plan.context_tokens:,}", show_header=False)
    rows = [
        ("memory budget", _gib(plan.memory_bytes)),
        ("weights", f"{plan.weights_bytes / 1024**2:,.1f} MiB ({plan.weights_source})"),
        ("activation reserve", _gib(plan.activation_reserve_bytes)),
        ("KV budget", _gib(plan.kv_budget_bytes)),
        ("kv_bytes_per_token", f"{plan.kv_bytes_per_token:,} B"),
        ("kv_bytes_per_sequence", f"{plan.kv_bytes_per_sequence:,} B ({_gib(plan.kv_bytes_per_sequence)})"),
        ("kv_bytes_per_sequence_blocks", f"{plan.kv_bytes_per_sequence_blocks:,} B"),
        ("page (block) bytes", f"{plan.page_bytes:,} B x {plan.num_kv_groups} group(s)"),
        ("num_blocks", f"{plan.num_blocks:,}"),
        ("max_tokens_in_pool", f"{plan.max_tokens_in_pool:,}"),
        ("max_concurrency", f"{plan.max_concurrency:,} sequences of {plan.context_tokens:,} tokens"),
        ("max_context", "unbounded (every layer rolls)" if plan.max_context is None
         else f"{plan.max_context:,} tokens (model window {plan.model_window_tokens:,})"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    c.print(t)
    kinds = Table(title="per layer kind")
    for col in ("kind", "layers", "window", "bytes/token", "bytes/sequence", "after blocks"):
        kinds.add_column(col, justify="right")
    for k in plan.layer_kinds:
        kinds.add_row(k.kind, str(k.num_layers), str(k.window_tokens or "-"),
                      f"{k.kv_bytes_per_token:,}", f"{k.kv_bytes_per_sequence:,}",
                      f"{k.kv_bytes_per_sequence_blocks:,}")
    c.print(kinds)
    _render_defaulted(c, plan)
    if train:
        tt = Table(title=f"training, {train.sequence_tokens:,} tokens x {train.micro_batch}, "
                         f"{train.param_dtype} + Adam ({train.parameters / 1e9:.2f} B params)", show_header=False)
        for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
                  "activations_checkpointed_bytes", "total_bytes", "total_checkpointed_bytes"):
            tt.add_row(k, _gib(getattr(train, k)))
        c.print(tt)
        c.print(formula)
    if plot_path:
        c.print(f"plot written to {plot_path}")
