"""`ctxwarden chunk FILE|-`: token-exact chunks with character offsets."""

from __future__ import annotations

import argparse
import json

from ctxwarden.cli._text_input import add_input_arguments, read_input

HELP = "Split a text into chunks of at most N tokens (exact), with overlap and character offsets."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_input_arguments(p, messages=False)
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per chunk, at most (default 512)")
    p.add_argument("--overlap", type=int, default=0, help="tokens repeated between neighbours (default 0)")
    p.add_argument("--boundaries", default="paragraph", choices=["paragraph", "sentence", "token"],
                   help="strongest boundary to prefer (default paragraph, then sentence, clause, word, token)")


def run(args: argparse.Namespace) -> int:
    from ctxwarden.context.chunk import chunk
    from ctxwarden.context.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    text = read_input(args.file)
    chunks = chunk(text, args.max_tokens, tok, overlap_tokens=args.overlap, boundaries=args.boundaries)
    if args.json:
        print(json.dumps([c.to_dict() for c in chunks], indent=2, ensure_ascii=False))
        return 0
    print(f"{len(chunks)} chunks of at most {args.max_tokens} {tok.name} tokens")
    for i, c in enumerate(chunks):
        print(f"{i:5d}  chars {c.start}-{c.end}  {c.tokens:5d} tokens  {c.text[:60]!r}")
    return 0
