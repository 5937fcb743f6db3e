"""`ctxwarden fit FILE|- --window N`: make a prompt fit window - max_tokens, by a named strategy."""

from __future__ import annotations

import argparse
import json
import sys

from ctxwarden.cli._text_input import add_input_arguments, read_input, read_messages

HELP = "Fit a prompt into a window: error, truncate-head/middle/tail, keep-tail-semantic or chunk."
STRATEGY_NAMES = ("error", "truncate-head", "truncate-middle", "truncate-tail", "keep-tail-semantic", "chunk")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_input_arguments(p)
    p.add_argument("--window", type=int, required=True, help="the model's context window, in tokens")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens reserved for the completion (default 256)")
    p.add_argument("--strategy", default="error", choices=STRATEGY_NAMES, help="what to do when it does not fit")
    p.add_argument("--ranker", default=None, choices=("auto", "lexical", "dense", "hybrid"),
                   help="how keep-tail-semantic ranks sentences against the question: lexical (BM25), dense "
                        "(all-MiniLM-L6-v2 embeddings) or hybrid (both); default auto = hybrid when the "
                        "embedding model is installed, else lexical")


def run(args: argparse.Namespace) -> int:
    from ctxwarden.context.fit import fit
    from ctxwarden.context.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    raw = read_input(args.file)
    prompt = read_messages(raw) if args.messages else raw
    result = fit(prompt, args.window, args.max_tokens, tok, args.strategy, ranker=args.ranker)
    if args.json:
        print(json.dumps({"tokenizer": tok.name, **result.to_dict()}, indent=2, ensure_ascii=False))
        return 0
    print(f"{result.original_tokens} -> {result.prompt_tokens} tokens (budget {result.budget_tokens} = window "
          f"{result.window_tokens} - max_tokens {result.max_tokens} - overhead {result.overhead_tokens}), "
          f"strategy {result.strategy}{_ranker_note(result)}", file=sys.stderr)
    if result.chunks:
        sys.stdout.write("\n\f\n".join(c.text for c in result.chunks))  # form feed between pieces
    elif result.messages is not None:
        print(json.dumps([{"role": m.role, "content": m.content} for m in result.messages], indent=2,
                         ensure_ascii=False))
    else:
        sys.stdout.write(result.text)
    return 0


def _ranker_note(result) -> str:
    """", ranker hybrid, 12 spans removed" for keep-tail-semantic; nothing for the others."""
    if result.strategy != "keep-tail-semantic":
        return ""
    if result.ranker is None:
        return " (it fits: nothing ranked or removed)"
    return f", ranker {result.ranker}, {len(result.removed)} spans removed (marked [...])"
