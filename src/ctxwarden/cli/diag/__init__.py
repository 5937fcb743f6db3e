"""`ctxwarden diag ...`: diagnostics subcommands, one module each in this package.

Each module defines HELP, add_arguments(parser) and run(args) like a top-level command; as
there, only argparse is imported until a subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib

HELP = "Diagnostics: request lengths, SLO risk, memory snapshots and diffs, slow-leak detection, timeline, attention."

# name -> module under ctxwarden.cli.diag
SUBCOMMANDS = {
    "lengths": "lengths",
    "slo-risk": "slo_risk",
    "mem": "mem",
    "leak": "leak",
    "timeline": "timeline",
    "attention": "attention",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register every diag subcommand under `p`."""
    sub = p.add_subparsers(dest="diag_command", metavar="SUBCOMMAND")
    sub.required = True
    for name, module in SUBCOMMANDS.items():
        mod = _load(module)
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        sp.set_defaults(_diag_module=module)
        mod.add_arguments(sp)


def run(args: argparse.Namespace) -> int:
    """Run the chosen diag subcommand."""
    return _load(args._diag_module).run(args)


def _load(module: str):
    return importlib.import_module(f"ctxwarden.cli.diag.{module}")
