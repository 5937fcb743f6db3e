"""Argument readers shared by the diag subcommands."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|min|h)?\s*$")
_SECONDS = {"ms": 1e-3, "s": 1.0, None: 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration_s(text: str) -> float:
    """'2s', '100ms', '1.5', '10m' -> seconds (a bare number is seconds)."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a duration; use e.g. 2s, 100ms, 10m")
    return float(m.group(1)) * _SECONDS[m.group(2)]
