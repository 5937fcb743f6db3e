"""Rotary position embeddings: default, linear, dynamic NTK, YaRN, LongRoPE, Llama-3, partial.

The formulas follow the papers as transformers' `modeling_rope_utils` states them (same
inverse frequencies, same attention scaling), re-derived here from a `RopeConfig`.

Two variants depend on the sequence length seen so far, and transformers decides that per
forward call from the largest position in it: dynamic NTK stretches the base once positions
pass `max_position_embeddings`, LongRoPE switches from `short_factor` to `long_factor` past
`original_max_position_embeddings`. Here the decision is made per token from the length its
sequence is given (runner/inputs.py `rope_lengths`): the engine gives every prompt token the
prompt's length, so a prompt prefilled in chunks rotates as transformers' one forward over it,
and a generated token at position p the length p + 1, as its decode step in `generate`. Keys
already cached keep the rotation they were written with, exactly as in transformers.

Tokens are rotated NeoX-style (first half against second half), the layout of Hugging Face
checkpoints; GGUF llama weights are un-permuted at load time to match.
"""

from __future__ import annotations

import math

import torch

from ctxwarden.spec.model_spec import RopeConfig

_LENGTH_DEPENDENT = ("dynamic", "longrope")


class RotaryEmbedding:
    """Cos/sin tables for one RoPE configuration; `rotate` applies them to q or k."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int):
        self.rope = rope
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.max_position_embeddings = max_position_embeddings
        self.inv_freq, self.attention_scaling = _inv_freq(rope, self.rotary_dim,
                                                          max_position_embeddings, None)

    @property
    def is_length_dependent(self) -> bool:
        """Whether the frequencies depend on the sequence length (dynamic NTK, LongRoPE)."""
        return self.rope.rope_type in _LENGTH_DEPENDENT

    def rotates_by_length(self, seq_len: int) -> bool:
        """Whether a prompt of `seq_len` tokens is rotated otherwise than a short one (a
        length-dependent variant past its threshold): its KV then only matches prompts of the
        same length."""
        if not self.is_length_dependent:
            return False
        inv_freq, scaling = _inv_freq(self.rope, self.rotary_dim, self.max_position_embeddings, seq_len)
        return scaling != self.attention_scaling or not torch.equal(inv_freq, self.inv_freq)

    def cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [num_tokens, rotary_dim] for `positions` [num_tokens].

        `seq_lens` [num_tokens] is, per token, the length its sequence reaches in this forward
        (needed only by the length-dependent variants).
        """
        if not self.is_length_dependent or seq_lens is None:
            return self._table(positions, self.inv_freq)
        cos = torch.empty(positions.shape[0], self.rotary_dim)
        sin = torch.empty_like(cos)
        for seq_len in torch.unique(seq_lens).tolist():
            rows = seq_lens == seq_len
            inv_freq, _ = _inv_freq(self.rope, self.rotary_dim, self.max_position_embeddings, seq_len)
            cos[rows], sin[rows] = self._table(positions[rows], inv_freq)
        return cos, sin

    def _table(self, positions: torch.Tensor, inv_freq: torch.Tensor):
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, rotary_dim]; dims past rotary_dim pass."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def _inv_freq(rope: RopeConfig, dim: int, max_pos: int, seq_len: int | None
              ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] and the cos/sin scaling for one variant."""
    p = rope.params
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = rope.theta
    kind = rope.rope_type
    if kind == "default":
        return 1.0 / base ** exponents, 1.0
    if kind == "linear":
        return 1.0 / base ** exponents / float(p["factor"]), 1.0
    if kind == "dynamic":
        return _dynamic_ntk(base, float(p["factor"]), dim, exponents, max_pos, seq_len), 1.0
    if kind == "yarn":
        return _yarn(base, p, dim, exponents, max_pos)
    if kind == "longrope":
        return _longrope(base, p, exponents, max_pos, seq_len)
    if kind == "llama3":
        return _llama3(1.0 / base ** exponents, p), 1.0
    raise ValueError(f"RoPE variant {kind!r} is not implemented")


def _dynamic_ntk(base: float, factor: float, dim: int, exponents: torch.Tensor, max_pos: int,
                 seq_len: int | None) -> torch.Tensor:
    # Below the trained length the base is unchanged; above it, NTK-aware base stretching.
    length = torch.tensor(float(max(seq_len or max_pos, max_pos)))
    stretched = base * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / stretched ** exponents


def _yarn(base: float, p, dim: int, exponents: torch.Tensor, max_pos: int
          ) -> tuple[torch.Tensor, float]:
    original = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / original
    scaling = p.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        scaling = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                   if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate by factor
    pos_freqs = base ** exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(scaling)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(base: float, p, exponents: torch.Tensor, max_pos: int, seq_len: int | None
              ) -> tuple[torch.Tensor, float]:
    original = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / original
    scaling = p.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    use_long = seq_len is not None and seq_len > original
    ext = torch.tensor(p["long_factor"] if use_long else p["short_factor"], dtype=torch.float32)
    return 1.0 / (ext * base ** exponents), float(scaling)


def _llama3(inv_freq: torch.Tensor, p) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by factor, short ones kept, and the
    # band between is a smooth blend of the two.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled)
