"""Gemma 3 (text): the Gemma 2 decoder with q/k norms and two RoPE tables, no soft-caps.

What changes from gemma2.py, and where each change lives:

- layers are 5 local : 1 global (`sliding_window_pattern` 6, or `layer_types`); the
  spec's layer_types give each layer its kind and the KV layout its window;
- per-layer-type RoPE: local layers rotate with `rope_local_base_freq` (10,000, never
  scaled), global ones with `rope_theta` plus `rope_scaling` (linear x8 on 4B and up);
  the spec holds both tables (`rope`, `rope_local`) and llama.attention picks one per layer;
- q and k are RMS-normalised per head before RoPE, with Gemma's (1 + w) convention
  (spec.qk_norm; llama.attention applies `self.norm`, which carries norm_offset = 1);
- query_pre_attn_scalar, embedding scaling and the sandwich norms are Gemma 2's (inherited);
  attention and final soft-capping apply only when the config sets them (Gemma 3's do not).
"""

from __future__ import annotations

from ctxwarden.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text decoder over the paged KV cache (every difference is in the spec)."""
