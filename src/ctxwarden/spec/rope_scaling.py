"""RoPE scaling chosen at serving time: `LLM(rope_scaling=...)`, `serve --rope-scaling JSON`.

The option takes the dict transformers reads from a config's `rope_scaling` (4.x) or
`rope_parameters` (5.x): `{"rope_type": "yarn", "factor": 4}` (or `"type"`), with the
variant's own fields. It replaces the full-attention layers' RoPE of the checkpoint
(Gemma-3's local layers keep theirs, as in transformers) and stretches the window:

    trained window  = the file's original_max_position_embeddings if it is already scaled,
                      else its max_position_embeddings (or the option's own
                      original_max_position_embeddings)
    scaled window   = int(trained window * factor)

`ModelSpec.max_position_embeddings` stays the trained window: dynamic NTK reads it as the
length past which it stretches the base, the other variants read the trained window from
their params (`original_max_position_embeddings`, filled in here). Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from ctxwarden.spec.model_spec import ModelSpec, RopeConfig

SCALING_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")
_COMMON_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings", "rope_theta")
_VARIANT_KEYS = {
    "linear": (), "dynamic": (),
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "attention_factor"),
    "llama3": ("low_freq_factor", "high_freq_factor"),
}
_REQUIRED_KEYS = {"longrope": ("short_factor", "long_factor"), "llama3": ("low_freq_factor", "high_freq_factor")}


@dataclass(frozen=True)
class ScaledWindow:
    """The window a RoPE scaling gives a model: trained x factor."""

    rope_type: str
    factor: float
    trained_tokens: int
    window_tokens: int


def parse_rope_scaling(value: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The option as a checked dict (None: no scaling). JSON text or a mapping.

    Errors name the bad value and the choices: an unknown variant, a missing or
    non-positive factor, a field the variant does not read.
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"rope_scaling is not valid JSON ({e}): {value!r}; give e.g. "
                             '\'{"rope_type": "yarn", "factor": 4}\'') from None
    if not isinstance(value, Mapping):
        raise ValueError(f"rope_scaling must be a JSON object, got {value!r}")
    scaling = dict(value)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in SCALING_TYPES:
        raise ValueError(f"rope_scaling rope_type {rope_type!r} is not a scaling method; "
                         f"choose one of {', '.join(SCALING_TYPES)}")
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    _check_keys(scaling, rope_type)
    return scaling


def _check_keys(scaling: dict[str, Any], rope_type: str) -> None:
    allowed = _COMMON_KEYS + _VARIANT_KEYS[rope_type]
    unknown = sorted(set(scaling) - set(allowed))
    if unknown:
        raise ValueError(f"rope_scaling field(s) {', '.join(unknown)} are not read by {rope_type!r}; "
                         f"its fields are {', '.join(k for k in allowed if k != 'type')}")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise ValueError(f"rope_scaling {rope_type!r} needs a factor >= 1 (the window multiplier), "
                         f"got {factor!r}")
    missing = [k for k in _REQUIRED_KEYS.get(rope_type, ()) if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling {rope_type!r} needs {', '.join(missing)}")
    original = scaling.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise ValueError(f"rope_scaling original_max_position_embeddings must be a positive integer, "
                         f"got {original!r}")


def trained_window(spec: ModelSpec) -> int:
    """The window the checkpoint was trained for, before any scaling it already carries."""
    original = spec.rope.params.get("original_max_position_embeddings")
    if spec.rope.rope_type != "default" and isinstance(original, int):
        return original
    return spec.max_position_embeddings


def scaled_window(spec: ModelSpec, scaling: Mapping[str, Any]) -> ScaledWindow:
    """Trained window, factor and the window they give (see the module doc)."""
    trained = scaling.get("original_max_position_embeddings") or trained_window(spec)
    factor = float(scaling["factor"])
    return ScaledWindow(scaling["rope_type"], factor, trained, int(math.floor(trained * factor)))


def apply_rope_scaling(spec: ModelSpec, scaling: Mapping[str, Any]) -> ModelSpec:
    """`spec` with its full-attention RoPE replaced by `scaling` (a parse_rope_scaling dict)."""
    window = scaled_window(spec, scaling)
    params = {k: v for k, v in scaling.items() if k not in ("rope_type", "rope_theta")}
    params["original_max_position_embeddings"] = window.trained_tokens
    if scaling["rope_type"] == "longrope":
        _check_longrope_lengths(spec, params)
    rope = RopeConfig(theta=float(scaling.get("rope_theta", spec.rope.theta)), rope_type=scaling["rope_type"],
                      partial_rotary_factor=spec.rope.partial_rotary_factor, params=params)
    return replace(spec, rope=rope, max_position_embeddings=trained_window(spec))


def _check_longrope_lengths(spec: ModelSpec, params: Mapping[str, Any]) -> None:
    half = int(spec.head_dim * spec.rope.partial_rotary_factor) // 2
    for key in ("short_factor", "long_factor"):
        values = params[key]
        if not isinstance(values, list) or len(values) != half:
            got = len(values) if isinstance(values, list) else repr(values)
            raise ValueError(f"rope_scaling longrope {key} must be a list of {half} numbers "
                             f"(rotary dim / 2 of this model), got {got}")
