"""`ctxwarden make-model --arch ARCH --out DIR`: a random-weight HF checkpoint + tokenizer."""

from __future__ import annotations

import argparse
import json

HELP = "Write a random-weight Hugging Face checkpoint (and a trained BPE tokenizer)."

_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "deepseek_v2", "deepseek_v3")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", required=True, choices=_ARCHS)
    p.add_argument("--out", required=True, help="directory to write (created if missing)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--max-position", type=int, default=4096)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rope-scaling", default=None,
                   help='JSON, e.g. \'{"rope_type": "linear", "factor": 2.0}\'')
    p.add_argument("--partial-rotary", type=float, default=None,
                   help="fraction of head_dim that is rotated (phi3-style partial RoPE)")
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tokenizer", action="store_true", help="weights and config only")
    p.add_argument("--corpus", default=None, help="text directory to train the tokenizer on "
                                                  "(default: the Austen excerpts shipped with ctxwarden)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint

    options = MakeModelOptions(
        arch=args.arch, out_dir=Path(args.out), hidden_size=args.hidden_size,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.head_dim, intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size, max_position=args.max_position, rope_theta=args.rope_theta,
        rope_scaling=_rope_scaling(args.rope_scaling), sliding_window=args.sliding_window,
        partial_rotary_factor=args.partial_rotary, seed=args.seed,
        with_tokenizer=not args.no_tokenizer,
        corpus_dir=Path(args.corpus) if args.corpus else None)
    out = make_checkpoint(options)
    files = sorted(p.name for p in out.iterdir())
    if args.json:
        print(json.dumps({"out": str(out), "arch": args.arch, "files": files}))
    else:
        print(f"wrote {args.arch} checkpoint to {out}: {', '.join(files)}")
    return 0


def _rope_scaling(text: str | None):
    """--rope-scaling JSON, checked as the engine checks its rope_scaling option."""
    from ctxwarden.spec.rope_scaling import parse_rope_scaling

    return parse_rope_scaling(text)
