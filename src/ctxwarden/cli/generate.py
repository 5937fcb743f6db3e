"""`ctxwarden generate`: run one prompt through the engine and print (or stream) the text."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Generate text for one prompt with the paged engine."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ctxwarden.cli._engine_args import add_engine_arguments

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from a file ('-' for stdin)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="--chat: a system message")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    from ctxwarden.cli._engine_args import engine_config_from_args
    from ctxwarden.llm import LLM
    from ctxwarden.sampling import SamplingParams

    text = _read_prompt(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    llm = LLM.from_config(engine_config_from_args(args))
    prompt = llm.apply_chat_template(_messages(args, text)) if args.chat else text
    if args.stream and not args.json:
        for out in llm.stream(prompt, params):
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    result = llm.generate([prompt], params)[0]
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": list(result.token_ids),
                          "finish_reason": result.finish_reason,
                          "prompt_tokens": len(result.prompt_token_ids),
                          "completion_tokens": len(result.token_ids),
                          "time_to_first_token_s": result.time_to_first_token_s,
                          "total_time_s": result.total_time_s}, indent=2))
    else:
        print(result.text)
    return 0


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    with open(args.prompt_file, encoding="utf-8") as f:
        return f.read()


def _messages(args: argparse.Namespace, text: str) -> list[dict]:
    system = [{"role": "system", "content": args.system}] if args.system else []
    return system + [{"role": "user", "content": text}]
