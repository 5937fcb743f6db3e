"""Input helpers shared by `count`, `fit` and `chunk`: read FILE or stdin, parse chat messages."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_input_arguments(p: argparse.ArgumentParser, messages: bool = True) -> None:
    """FILE|-, --tokenizer, --json (and --messages where chat input makes sense)."""
    p.add_argument("file", metavar="FILE", help="text file to read, or - for stdin")
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="cl100k_base, o200k_base, estimate, default, a model directory, tokenizer.json "
                        "or .gguf (default: the default model's, SmolLM2-135M-Instruct)")
    if messages:
        p.add_argument("--messages", action="store_true",
                       help='FILE is a JSON list of {"role", "content"} chat messages; the chat template is counted')
    p.add_argument("--json", action="store_true", help="machine-readable output")


def read_input(path: str) -> str:
    """The text of FILE, or of stdin when FILE is '-'."""
    if path == "-":
        return sys.stdin.read()
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"input file {path!r} does not exist (pass a file, or - for stdin)")
    return file.read_text(encoding="utf-8")


def read_messages(raw: str) -> list[dict]:
    """A JSON list of chat messages (a {"messages": [...]} request body works too)."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"--messages input is not JSON: {e}") from e
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list):
        raise ValueError('--messages input must be a JSON list of {"role": ..., "content": ...} objects')
    return data
