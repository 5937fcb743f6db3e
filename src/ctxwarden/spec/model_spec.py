"""Model specs parsed from Hugging Face `config.json` files (transformers 4.x and 5.x).

`ModelSpec` is the one description of a model that every stage reads: the planner's
arithmetic, the block manager's layer groups, the runner's shapes. It is a frozen dataclass
built once by `parse_model_config`; loading the JSON is `load_model_config` (the only I/O).

What differs between the two transformers generations, and is normalised here:
- RoPE: 4.x writes `rope_theta` + `rope_scaling` (with `type` or `rope_type`); 5.x writes
  `rope_parameters` (with `rope_type` and `rope_theta`), for some models one dict per layer
  type (`{"full_attention": {...}, "sliding_attention": {...}}`).
- dtype: 4.x `torch_dtype`, 5.x `dtype`.
- Multimodal checkpoints nest the language model under `text_config`.

Published files leave out what equals their transformers class's default (Gemma-3's
`text_config` has no `vocab_size`, `rope_theta`, `sliding_window_pattern`, ...): such fields
take the family default from `spec.family_defaults`, and `ModelSpec.defaulted` records them.

Layer kinds are always explicit in the spec (`layer_types`), derived from each family's
own rule when the config does not list them: the same rules transformers applies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ctxwarden.errors import ConfigError
from ctxwarden.spec.dtypes import canonical_dtype
from ctxwarden.spec.family_defaults import (
    FULL, MULTIMODAL_DEFAULTS, MULTIMODAL_TEXT_TYPE, NULLABLE, SCALED_ROPE_TYPES, SLIDING,
    activation_field, default_head_dim, default_layer_types, family_defaults,
    normalise_activation, rope_type_alias, trained_positions,
)

# Families whose layout the planner and the runner understand.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm", "smollm3")
GEMMA = ("gemma", "gemma2", "gemma3", "gemma3_text")
MLA = ("deepseek_v2", "deepseek_v3")
SUPPORTED_FAMILIES = LLAMA_LIKE + GEMMA + MLA

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters for one layer kind.

    `params` holds the variant's own fields (factor, original_max_position_embeddings,
    low_freq_factor, short_factor, ...), exactly as the config wrote them.
    """

    theta: float
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    params: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not one of {ROPE_TYPES}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds the compressed latent."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    rope_interleave: bool = True  # rotary pairs (0, 1), (2, 3) ... as DeepSeek's weights lay them out

    @property
    def cache_dim(self) -> int:
        """Values cached per token per layer: the latent plus the decoupled RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """Everything ctxwarden needs to know about a decoder-only transformer."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope: RopeConfig
    rope_local: RopeConfig | None = None  # gemma3-style sliding layers with their own base
    mla: MLAConfig | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    dtype: str = "float32"  # the stored weights' dtype, as config.json spells it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: Mapping[str, Any] = field(default_factory=dict, compare=False)
    # Fields the config left out, with the value its family's transformers class gave them.
    # Not compared: two files that spell out different defaults describe the same model.
    defaulted: Mapping[str, Any] = field(default_factory=dict, compare=False)
    source: str = "<memory>"

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                self.source,
                "layer_types",
                f"has {len(self.layer_types)} entries but num_hidden_layers is {self.num_layers}",
            )
        try:
            canonical_dtype(self.dtype)
        except ValueError as e:
            raise ConfigError(self.source, "torch_dtype", str(e)) from None
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ConfigError(
                self.source, "sliding_window", "sliding layers are declared but no window is set"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                self.source,
                "num_key_value_heads",
                f"{self.num_kv_heads} does not divide num_attention_heads "
                f"{self.num_attention_heads}",
            )

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    @property
    def num_sliding_layers(self) -> int:
        return sum(t == SLIDING for t in self.layer_types)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @property
    def window_tokens(self) -> int | None:
        """The sliding window when every layer slides (mistral-style), else None."""
        return self.sliding_window if self.num_full_layers == 0 else None

    def window_for_layer(self, layer_id: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_id] == SLIDING else None

    def rope_for_layer(self, layer_id: int) -> RopeConfig:
        if self.layer_types[layer_id] == SLIDING and self.rope_local is not None:
            return self.rope_local
        return self.rope


def load_model_config(path: str | Path) -> ModelSpec:
    """Read a `config.json` (or a directory holding one) and parse it into a ModelSpec."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), "<file>", "file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(str(path), "<json>", f"not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "<json>", "top level is not an object")
    return parse_model_config(raw, source=str(path))


def parse_model_config(raw: Mapping[str, Any], source: str = "<config>") -> ModelSpec:
    """Parse a config dict as transformers 4.x or 5.x writes it into a ModelSpec.

    A field the file leaves out takes the value the family's transformers config class
    gives it (`spec.family_defaults`); `ModelSpec.defaulted` lists those fields and values.
    """
    r = _reader(raw, source)
    num_layers = r.get("num_hidden_layers", int)
    hidden, heads = r.get("hidden_size", int), _at_least_one(r, "num_attention_heads")
    layer_types = _layer_types(r, num_layers)
    rope, rope_local = _rope(r)
    return ModelSpec(
        model_type=r.model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=_kv_heads(r, heads),
        head_dim=_head_dim(r, hidden, heads),
        intermediate_size=r.get("intermediate_size", int),
        vocab_size=r.get("vocab_size", int),
        max_position_embeddings=r.get("max_position_embeddings", int),
        layer_types=layer_types,
        sliding_window=r.get("sliding_window", int) if SLIDING in layer_types else None,
        rope=rope,
        rope_local=rope_local,
        mla=_mla(r) if r.family in MLA else None,
        rms_norm_eps=float(r.get("rms_norm_eps", (int, float))),
        tie_word_embeddings=_tied(r),
        attention_bias=r.get("attention_bias", bool),
        qk_norm=r.model_type in ("qwen3", "gemma3", "gemma3_text"),
        hidden_act=normalise_activation(r.family, r.get(activation_field(r.family), str)),
        attn_logit_softcapping=r.get("attn_logit_softcapping", (int, float)),
        final_logit_softcapping=r.get("final_logit_softcapping", (int, float)),
        query_pre_attn_scalar=r.get("query_pre_attn_scalar", (int, float), required=False),
        dtype=_dtype(r),
        bos_token_id=_first_int(r.raw.get("bos_token_id")),
        eos_token_ids=_int_tuple(r.raw.get("eos_token_id")),
        moe=_moe(r),
        defaulted=dict(r.defaulted),
        source=source,
    )


class _Reader:
    """Typed field access: the file's value, else the family default (noted), else an error.

    Every error names the file and the field. `defaulted` collects, in reading order, each
    field the parser needed that the file left out, with the value used in its place.
    """

    def __init__(self, raw: Mapping[str, Any], outer: Mapping[str, Any], source: str,
                 model_type: str, family: str):
        self.raw, self.outer, self.source = raw, outer, source
        self.model_type, self.family = model_type, family
        self.row = family_defaults(family)
        self.defaulted: dict[str, Any] = {}

    def get(self, name: str, typ, required: bool = True):
        """The field as written; the family default when absent; None where None is allowed."""
        if name not in self.raw:
            return self._default(name, required)
        value = self.raw[name]
        if value is None:
            if name in NULLABLE:
                return None
            hint = f" (the {self.family} default is {self.row[name]!r})" if name in self.row else ""
            raise ConfigError(self.source, name, f"is null; give a value or leave it out{hint}")
        return self._check(name, value, typ)

    def derived(self, name: str, value):
        """Note the value a rule computed for a field the file leaves out; returns it."""
        if name not in self.raw:
            self.defaulted[name] = value
        return value

    def _default(self, name: str, required: bool):
        if name in self.row:
            self.defaulted.setdefault(name, self.row[name])
            return self.row[name]
        if required and name not in NULLABLE:
            raise ConfigError(self.source, name, "is required but missing")
        return None

    def _check(self, name, value, typ):
        if (typ is bool) != isinstance(value, bool) or not isinstance(value, typ):
            raise ConfigError(self.source, name, f"expected {_type_name(typ)}, got {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ConfigError(self.source, name, f"must not be negative, got {value!r}")
        return value


def _type_name(typ) -> str:
    if isinstance(typ, tuple):
        return " or ".join(t.__name__ for t in typ)
    return typ.__name__


def _reader(raw: Mapping[str, Any], source: str) -> _Reader:
    """Open the language model's fields: `text_config` for multimodal wrappers, else the top."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        model_type = _model_type(raw, source)
        return _Reader(raw, raw, source, model_type, _family(model_type, raw, source))
    model_type = text.get("model_type") or MULTIMODAL_TEXT_TYPE.get(raw.get("model_type"))
    if not isinstance(model_type, str):
        raise ConfigError(source, "text_config.model_type", "is required but missing")
    r = _Reader(text, raw, source, model_type, _family(model_type, text, source))
    if "model_type" not in text:
        r.defaulted["model_type"] = model_type
    return r


def _model_type(raw: Mapping[str, Any], source: str) -> str:
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(source, "model_type", f"is required (a string), got {model_type!r}")
    return model_type


def _family(model_type: str, raw: Mapping[str, Any], source: str) -> str:
    if model_type in SUPPORTED_FAMILIES:
        return model_type
    if isinstance(raw.get("layer_types"), list):
        return "generic"  # any config that states its layer kinds explicitly
    raise ConfigError(
        source,
        "model_type",
        f"unknown family {model_type!r}; supported: {', '.join(SUPPORTED_FAMILIES)}, "
        "or any config that lists 'layer_types'",
    )


def _at_least_one(r: _Reader, name: str) -> int:
    value = r.get(name, int)
    if value < 1:  # a divisor of the shapes below
        raise ConfigError(r.source, name, f"must be >= 1, got {value}")
    return value


def _kv_heads(r: _Reader, heads: int) -> int:
    if r.get("num_key_value_heads", int) is None:
        return r.derived("num_key_value_heads", heads)
    return _at_least_one(r, "num_key_value_heads")


def _head_dim(r: _Reader, hidden: int, heads: int) -> int:
    head_dim = default_head_dim(r.family, r.get, hidden, heads)
    if head_dim is None:
        raise ConfigError(
            r.source, "head_dim", f"missing and hidden_size {hidden} is not divisible by {heads} heads"
        )
    return r.derived("head_dim", head_dim)


def _layer_types(r: _Reader, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention kind: as listed, else by the family's own rule."""
    explicit = r.raw.get("layer_types")
    if explicit is None:
        try:
            return default_layer_types(r.family, r.get, num_layers)
        except ConfigError:  # a field the rule read, already named
            raise
        except ValueError as e:  # only SmolLM3's no_rope_layers can disagree with the count
            raise ConfigError(r.source, "no_rope_layers", str(e)) from None
    if not isinstance(explicit, list) or any(t not in (FULL, SLIDING) for t in explicit):
        raise ConfigError(
            r.source, "layer_types", f"entries must be '{FULL}' or '{SLIDING}', got {explicit!r}"
        )
    return tuple(explicit)


def _rope(r: _Reader) -> tuple[RopeConfig, RopeConfig | None]:
    """Normalise 4.x `rope_theta`/`rope_scaling` and 5.x `rope_parameters`."""
    partial = float(r.get("partial_rotary_factor", (int, float), required=False) or 1.0)
    params = r.raw.get("rope_parameters")
    if isinstance(params, Mapping) and FULL in params:  # 5.x per-layer-type dicts
        full = _rope_from_dict(r, params[FULL], "rope_parameters.full_attention", partial)
        local = params.get(SLIDING)
        if local is None:
            return full, _gemma3_local(r, partial)
        return full, _rope_from_dict(r, local, "rope_parameters.sliding_attention", partial, SLIDING)
    if isinstance(params, Mapping):
        return _rope_from_dict(r, params, "rope_parameters", partial), _gemma3_local(r, partial)
    scaling = r.raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(r.source, "rope_scaling", f"expected an object or null, got {scaling!r}")
    return _rope_from_dict(r, scaling or {}, "rope_scaling", partial), _gemma3_local(r, partial)


def _rope_from_dict(r: _Reader, d: Mapping[str, Any], name: str, partial: float,
                    kind: str = FULL) -> RopeConfig:
    rope_type = rope_type_alias(r.family, d.get("rope_type") or d.get("type") or "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(r.source, f"{name}.rope_type", f"unknown RoPE variant {rope_type!r}; known: {ROPE_TYPES}")
    theta = d.get("rope_theta")
    if theta is None and kind == SLIDING:  # Gemma-3's sliding layers: their own base
        theta = r.get("rope_local_base_freq", (int, float), required=False)
    if theta is None:  # as transformers: the top-level base, else the family's
        theta = r.get("rope_theta", (int, float))
    partial = float(d.get("partial_rotary_factor", partial))
    extra = {k: v for k, v in d.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}
    if rope_type in SCALED_ROPE_TYPES:
        extra["original_max_position_embeddings"] = trained_positions(r.family, r.get, d)
    if rope_type in ("linear", "dynamic", "yarn", "llama3") and "factor" not in extra:
        raise ConfigError(r.source, f"{name}.factor", f"RoPE variant {rope_type!r} needs a factor")
    return RopeConfig(theta=float(theta), rope_type=rope_type, partial_rotary_factor=partial, params=extra)


def _gemma3_local(r: _Reader, partial: float) -> RopeConfig | None:
    """Gemma-3's sliding layers rotate with their own base (default 10,000), unscaled."""
    if r.family not in ("gemma3", "gemma3_text") and "rope_local_base_freq" not in r.raw:
        return None
    base = r.get("rope_local_base_freq", (int, float))  # the gemma3 rows default it
    return RopeConfig(theta=float(base), partial_rotary_factor=partial)


def _mla(r: _Reader) -> MLAConfig:
    return MLAConfig(
        kv_lora_rank=r.get("kv_lora_rank", int),
        qk_rope_head_dim=r.get("qk_rope_head_dim", int),
        qk_nope_head_dim=r.get("qk_nope_head_dim", int),
        v_head_dim=r.get("v_head_dim", int),
        q_lora_rank=r.get("q_lora_rank", int),
        # V2's class always rotates interleaved pairs; V3's reads the flag (default true)
        rope_interleave=(r.get("rope_interleave", bool) if r.family == "deepseek_v3" else True),
    )


_MOE_KEYS = ("n_routed_experts", "n_shared_experts", "moe_intermediate_size",
             "first_k_dense_replace", "num_experts", "num_experts_per_tok", "moe_layer_freq")


# How DeepSeek's routers pick experts (the MLA families only): name -> type
_ROUTING_KEYS = {"routed_scaling_factor": (int, float), "topk_method": str, "n_group": int,
                 "topk_group": int, "norm_topk_prob": bool}


def _moe(r: _Reader) -> dict[str, Any]:
    """MoE shape: DeepSeek's class defaults, or whatever MoE fields another config writes."""
    values = {k: r.get(k, (int, float), required=False) for k in _MOE_KEYS}
    if r.family in MLA:
        values.update({k: r.get(k, t, required=False) for k, t in _ROUTING_KEYS.items()
                       if not (r.family == "deepseek_v3" and k == "topk_method")})
    return {k: v for k, v in values.items() if v is not None}


def _tied(r: _Reader) -> bool:
    """The LM head shares the embeddings; a multimodal wrapper decides for its text model."""
    wrapper = r.outer.get("model_type")
    if r.outer is r.raw or wrapper not in MULTIMODAL_DEFAULTS:
        return r.get("tie_word_embeddings", bool)
    if r.outer.get("tie_word_embeddings") is not None:
        return bool(r.outer["tie_word_embeddings"])
    tied = MULTIMODAL_DEFAULTS[wrapper]["tie_word_embeddings"]
    r.defaulted["tie_word_embeddings"] = tied
    return tied


def _dtype(r: _Reader) -> str:
    for d in (r.outer, r.raw):
        for key in ("dtype", "torch_dtype"):
            if d.get(key):
                return str(d[key])
    return "float32"


def _first_int(value) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value if isinstance(value, int) else None


def _int_tuple(value) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return (value,) if isinstance(value, int) else ()
