"""`ctxwarden count FILE|-`: exact token count of a text or a chat, template included."""

from __future__ import annotations

import argparse
import json

from ctxwarden.cli._text_input import add_input_arguments, read_input, read_messages

HELP = "Count the tokens of a text or chat exactly (tokenizer.json, GGUF, tiktoken)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_input_arguments(p)


def run(args: argparse.Namespace) -> int:
    from ctxwarden.context.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    raw = read_input(args.file)
    out = {"tokenizer": tok.describe(), "chars": len(raw)}
    if args.messages:
        messages = read_messages(raw)
        out["tokens"] = tok.count_messages(messages)
        out["exact"] = tok.is_chat_count_exact
        out["content_tokens"] = sum(tok.count_many([m["content"] for m in messages]))
        out["template_tokens"] = out["tokens"] - out["content_tokens"]
    else:
        out["tokens"] = tok.count_prompt(raw)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        detail = f" ({out['template_tokens']} of them chat template)" if args.messages else ""
        approx = "" if out.get("exact", tok.is_exact) else " (estimate: no chat template, or chars/4)"
        print(f"{out['tokens']} tokens{detail}{approx}  [{tok.name}, {tok.kind}]")
    return 0
