"""The `ctxwarden` command. Each subcommand lives in its own module of this package.

A command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their command runs, so `ctxwarden plan` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> module under ctxwarden.cli; one line per command.
COMMANDS = {
    "plan": "plan",
    "make-model": "make_model",
    "generate": "generate",
    "count": "count",
    "fit": "fit",
    "chunk": "chunk",
    "serve": "serve",
    "route": "route",
    "diag": "diag",
    "doctor": "doctor",
    "bench": "bench",
}

# The environment as the user left it, before main() sets its defaults (`doctor` reports it).
USER_ENV: dict[str, str | None] = {}

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctxwarden", description="Long-context LLM inference runtime.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in COMMANDS.items():
        mod = _load(module)  # command modules import only argparse at top level
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        p.set_defaults(_module=module)
        mod.add_arguments(p)
    return parser


def _load(module: str):
    return importlib.import_module(f"ctxwarden.cli.{module}")


def main(argv: list[str] | None = None) -> int:
    USER_ENV["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    try:
        return _load(args._module).run(args) or 0
    except (ValueError, FileNotFoundError) as e:  # our named errors subclass these
        print(f"ctxwarden {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ctxwarden ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
