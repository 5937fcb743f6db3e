"""Data type names: one vocabulary and one table of bytes for the whole package (no torch).

Users may write a dtype the torch way (`float32`, `bfloat16`, `float16`, `float8_e4m3fn`)
or the short way (`fp32`, `bf16`, `fp16`, `fp8`); config.json files write the torch way.
Inside ctxwarden every dtype is its canonical short name, resolved once by `canonical_dtype`
where it enters (a config, a CLI flag, a checkpoint header); the runner turns a canonical
name into a torch dtype with `DTYPES[name].torch_name`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One element type: its canonical name, torch's attribute name and its size."""

    name: str
    torch_name: str
    num_bytes: int


DTYPES = {d.name: d for d in (
    DType("fp32", "float32", 4),
    DType("bf16", "bfloat16", 2),
    DType("fp16", "float16", 2),
    DType("fp8_e4m3", "float8_e4m3fn", 1),
    DType("fp8_e5m2", "float8_e5m2", 1),
)}

_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
            "fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e4m3": "fp8_e4m3",
            "float8_e5m2": "fp8_e5m2"}

# What each stage can compute in or store (the planner plans fp8 KV; the runner stores it
# only once an fp8 KV path exists).
ACTIVATION_DTYPES = ("fp32", "bf16", "fp16")
KV_DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")


def canonical_dtype(name: str, allowed: tuple[str, ...] = tuple(DTYPES), what: str = "dtype") -> str:
    """The canonical short name of `name` (either vocabulary); ValueError names the choices."""
    key = str(name).strip().lower()
    canonical = _ALIASES.get(key, key)
    if canonical not in allowed:
        raise ValueError(f"{what} {name!r} is not one of {', '.join(allowed)} "
                         f"(torch names such as float32 / bfloat16 are accepted too)")
    return canonical


def dtype_bytes(name: str) -> int:
    """Bytes of one element of `name` (either vocabulary); ValueError for an unknown name."""
    return DTYPES[canonical_dtype(name)].num_bytes
