"""Byte sizes written by people ('2GiB', '512MB') read as integers (no torch, no I/O)."""

from __future__ import annotations

import math

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """'24GiB', '512MB', '2G', 1024 -> bytes. Binary (KiB, MiB, GiB) and decimal (KB, MB, GB)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte count must not be negative, got {text}")
        return text
    s = str(text).strip().lower().replace(" ", "").replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot read {text!r} as a byte size; use e.g. 2GiB, 512MiB, 24GB or 1073741824")
    value = float(num)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"byte size must be a finite non-negative number, got {text!r}")
    return int(value * _UNITS[unit])
