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

FULL = "full_attention"
SLIDING = "sliding_attention"

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
    """Parse a config dict as transformers 4.x or 5.x writes it into a ModelSpec."""
    outer = raw
    if isinstance(raw.get("text_config"), Mapping):
        raw = {**raw["text_config"], **{k: v for k, v in outer.items() if k == "torch_dtype"}}
    r = _Reader(raw, source)
    model_type = r.req("model_type", str)
    family = _family(model_type, raw, source)
    num_layers = r.req("num_hidden_layers", int)
    hidden = r.req("hidden_size", int)
    heads = r.req("num_attention_heads", int)
    kv_heads = r.opt("num_key_value_heads", int, heads) or heads
    head_dim = r.opt("head_dim", int, None) or _default_head_dim(hidden, heads, source)
    sliding_window = r.opt("sliding_window", int, None)
    layer_types = _layer_types(r, family, num_layers, sliding_window)
    if SLIDING not in layer_types:
        sliding_window = None
    rope, rope_local = _rope(r, family)
    return ModelSpec(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=r.opt("intermediate_size", int, 4 * hidden),
        vocab_size=r.req("vocab_size", int),
        max_position_embeddings=r.opt("max_position_embeddings", int, 2048),
        layer_types=layer_types,
        sliding_window=sliding_window,
        rope=rope,
        rope_local=rope_local,
        mla=_mla(r) if family in MLA else None,
        rms_norm_eps=float(r.opt("rms_norm_eps", (int, float), 1e-6)),
        tie_word_embeddings=_tied(outer, raw, family),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
        hidden_act=str(raw.get("hidden_act") or raw.get("hidden_activation") or "silu"),
        attn_logit_softcapping=r.opt("attn_logit_softcapping", (int, float), None),
        final_logit_softcapping=r.opt("final_logit_softcapping", (int, float), None),
        query_pre_attn_scalar=r.opt("query_pre_attn_scalar", (int, float), None),
        dtype=str(outer.get("dtype") or outer.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        bos_token_id=_first_int(raw.get("bos_token_id")),
        eos_token_ids=_int_tuple(raw.get("eos_token_id")),
        moe=_moe(raw),
        source=source,
    )


class _Reader:
    """Typed field access that names the file and the field on every error."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw, self.source = raw, source

    def req(self, name: str, typ):
        if name not in self.raw or self.raw[name] is None:
            raise ConfigError(self.source, name, "is required but missing")
        return self._check(name, self.raw[name], typ)

    def opt(self, name: str, typ, default):
        value = self.raw.get(name)
        return default if value is None else self._check(name, value, typ)

    def _check(self, name, value, typ):
        if isinstance(value, bool) or not isinstance(value, typ):
            raise ConfigError(self.source, name, f"expected {_type_name(typ)}, got {value!r}")
        if isinstance(value, (int, float)) and value < 0:
            raise ConfigError(self.source, name, f"must not be negative, got {value!r}")
        return value


def _type_name(typ) -> str:
    if isinstance(typ, tuple):
        return " or ".join(t.__name__ for t in typ)
    return typ.__name__


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


def _default_head_dim(hidden: int, heads: int, source: str) -> int:
    if hidden % heads:
        raise ConfigError(
            source, "head_dim", f"missing and hidden_size {hidden} is not divisible by {heads} heads"
        )
    return hidden // heads


def _layer_types(r: _Reader, family: str, num_layers: int, window: int | None) -> tuple[str, ...]:
    """Each layer's attention kind, by the family's own rule when the config is silent."""
    explicit = r.raw.get("layer_types")
    if explicit is not None:
        if not isinstance(explicit, list) or any(t not in (FULL, SLIDING) for t in explicit):
            raise ConfigError(
                r.source, "layer_types", f"entries must be '{FULL}' or '{SLIDING}', got {explicit!r}"
            )
        return tuple(explicit)
    if family in ("gemma2",):
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    if family in ("gemma3", "gemma3_text"):
        pattern = r.opt("sliding_window_pattern", int, 6)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if family == "qwen2" or family == "qwen3":
        if not r.raw.get("use_sliding_window") or window is None:
            return (FULL,) * num_layers
        first = r.opt("max_window_layers", int, num_layers)
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    if family in ("mistral", "phi3") and window is not None:
        return (SLIDING,) * num_layers
    return (FULL,) * num_layers


def _rope(r: _Reader, family: str) -> tuple[RopeConfig, RopeConfig | None]:
    """Normalise 4.x `rope_theta`/`rope_scaling` and 5.x `rope_parameters`."""
    partial = float(r.opt("partial_rotary_factor", (int, float), 1.0))
    params = r.raw.get("rope_parameters")
    if isinstance(params, Mapping) and FULL in params:  # 5.x per-layer-type dicts
        full = _rope_from_dict(r, params[FULL], "rope_parameters.full_attention", partial)
        local = params.get(SLIDING)
        return full, _rope_from_dict(r, local, "rope_parameters.sliding_attention", partial) if local else None
    if isinstance(params, Mapping):
        return _rope_from_dict(r, params, "rope_parameters", partial), _gemma3_local(r, partial)
    theta = float(r.opt("rope_theta", (int, float), 10000.0))
    scaling = r.raw.get("rope_scaling")
    merged = {"rope_theta": theta, **(scaling if isinstance(scaling, Mapping) else {})}
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(r.source, "rope_scaling", f"expected an object or null, got {scaling!r}")
    return _rope_from_dict(r, merged, "rope_scaling", partial), _gemma3_local(r, partial)


def _rope_from_dict(r: _Reader, d: Mapping[str, Any], name: str, partial: float) -> RopeConfig:
    rope_type = d.get("rope_type") or d.get("type") or "default"
    if rope_type == "su":  # early Phi-3 configs
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(r.source, f"{name}.rope_type", f"unknown RoPE variant {rope_type!r}; known: {ROPE_TYPES}")
    theta = d.get("rope_theta", r.raw.get("rope_theta", 10000.0))
    partial = float(d.get("partial_rotary_factor", partial))
    extra = {k: v for k, v in d.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}
    if rope_type in ("llama3", "yarn", "longrope"):
        # As transformers does: a top-level original_max_position_embeddings (Phi-3 writes
        # one) wins over the rope dict's; without either, the trained length is the max.
        top = r.raw.get("original_max_position_embeddings")
        if top is not None:
            extra["original_max_position_embeddings"] = top
        extra.setdefault("original_max_position_embeddings", r.raw.get("max_position_embeddings", 2048))
    if rope_type in ("linear", "dynamic", "yarn", "llama3") and "factor" not in extra:
        raise ConfigError(r.source, f"{name}.factor", f"RoPE variant {rope_type!r} needs a factor")
    return RopeConfig(theta=float(theta), rope_type=rope_type, partial_rotary_factor=partial, params=extra)


def _gemma3_local(r: _Reader, partial: float) -> RopeConfig | None:
    base = r.raw.get("rope_local_base_freq")
    return RopeConfig(theta=float(base), partial_rotary_factor=partial) if base else None


def _mla(r: _Reader) -> MLAConfig:
    return MLAConfig(
        kv_lora_rank=r.req("kv_lora_rank", int),
        qk_rope_head_dim=r.req("qk_rope_head_dim", int),
        qk_nope_head_dim=r.req("qk_nope_head_dim", int),
        v_head_dim=r.req("v_head_dim", int),
        q_lora_rank=r.opt("q_lora_rank", int, None),
    )


def _moe(raw: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace",
            "num_experts", "num_experts_per_tok", "moe_layer_freq")
    return {k: raw[k] for k in keys if raw.get(k) is not None}


def _tied(outer: Mapping[str, Any], raw: Mapping[str, Any], family: str) -> bool:
    """Gemma ties its LM head to the embeddings by default; the others do not."""
    for d in (raw, outer):
        if d.get("tie_word_embeddings") is not None:
            return bool(d["tie_word_embeddings"])
    return family in GEMMA


def _first_int(value) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value if isinstance(value, int) else None


def _int_tuple(value) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return (value,) if isinstance(value, int) else ()
