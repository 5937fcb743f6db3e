"""Quantized weights in groups of 32 along the input dimension: what `weights=` modes hold.

    q4 (int4): codes uint8 [N, K/2], scale and zero fp16 [N, K/32]; w = scale * code + zero
               group g of a row is 16 bytes: element i in the low nibble of byte i, element
               16 + i in its high nibble (GGUF's Q4_0 / Q4_1 block order, so their codes are
               kept as they are: Q4_1 has zero = m, Q4_0 has zero = -8 * scale)
    q8 (int8): codes int8 [N, K], scale fp16 [N, K/32]; w = scale * code (GGUF's Q8_0)

Scales stay fp16 as the GGUF stores them (a fifth of q4's bytes: 4 of 20 per group, and
decode reads every byte each step); the kernels in ext/ widen them to fp32 in registers
and reproduce the dequantized fp32 model exactly (up to summation order). Dense weights are
quantized here the way llama.cpp's converter does it (Q4_1: min / max per group; Q8_0:
absmax / 127), so `int4` / `int8` on a safetensors checkpoint store what a GGUF would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
Q4, Q8 = "q4", "q8"


@dataclass(frozen=True)
class QuantizedWeight:
    """One [out_features, in_features] weight as group-quantized codes."""

    kind: str  # Q4 | Q8
    codes: torch.Tensor
    scale: torch.Tensor  # fp16 [N, K / 32]
    zero: torch.Tensor | None  # fp16 [N, K / 32] (q4 only)
    # multiplied with activations rounded to int8 per group (weights="auto-int8act")
    int8_activations: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        # from the scales [N, K / 32]: a q4 weight packed into panels keeps no row-major
        # codes (layers/linear.py pack_linear), its scales and zero points stay
        return (self.scale.shape[0], self.scale.shape[1] * GROUP)

    @property
    def has_codes(self) -> bool:
        """False where the row-major codes were dropped for panels (`codes` is then empty)."""
        return self.codes.numel() > 0 or self.scale.numel() == 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.zero) if t is not None)


def quantize(w: torch.Tensor, kind: str) -> QuantizedWeight:
    """Quantize a dense [N, K] weight (K a multiple of 32) to q4 or q8 groups."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"{kind} needs in_features to be a multiple of {GROUP}, got {k}")
    groups = w.float().reshape(n, k // GROUP, GROUP)
    if kind == Q8:
        scale = (groups.abs().amax(-1) / 127).half()
        codes = torch.clamp(torch.round(groups / _nonzero(scale.float())[..., None]), -127, 127)
        return QuantizedWeight(Q8, codes.to(torch.int8).reshape(n, k), scale, None)
    low, high = groups.amin(-1).half(), groups.amax(-1)
    scale = ((high - low.float()) / 15).half()
    codes = torch.floor((groups - low.float()[..., None]) / _nonzero(scale.float())[..., None] + 0.5)
    codes = torch.clamp(codes, 0, 15).to(torch.uint8)
    return QuantizedWeight(Q4, _pack_nibbles(codes).reshape(n, k // 2), scale, low)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 32] codes 0..15 -> [..., 16] bytes: element i low nibble, i + 16 high nibble."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def dequantize(q: QuantizedWeight) -> torch.Tensor:
    """The fp32 [N, K] weight the codes stand for."""
    n, k = q.shape
    if q.kind == Q8:
        return (q.codes.reshape(n, -1, GROUP).float() * q.scale.float()[..., None]).reshape(n, k)
    b = q.codes.reshape(n, -1, 16)
    codes = torch.cat((b & 0x0F, b >> 4), dim=-1).float()  # [N, G, 32]
    return (codes * q.scale.float()[..., None] + q.zero.float()[..., None]).reshape(n, k)


def stack_rows(parts: list) -> torch.Tensor | QuantizedWeight:
    """Stack weights along out_features (q, k, v -> qkv): dense tensors or one quant kind."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    kinds = {p.kind if isinstance(p, QuantizedWeight) else "dense" for p in parts}
    if len(kinds) > 1:  # mixed storage (a GGUF with Q4_1 q and Q8_0 v, say): go dense
        dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.float32)
        return torch.cat([dequantize(p).to(dtype) if isinstance(p, QuantizedWeight) else p
                          for p in parts])
    zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts])
    return QuantizedWeight(parts[0].kind, torch.cat([p.codes for p in parts]),
                           torch.cat([p.scale for p in parts]), zero,
                           all(p.int8_activations for p in parts))


def permute_rows(q: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    """Rows reordered (output features); groups run along the input dim, so they move whole."""
    zero = None if q.zero is None else q.zero[order]
    return QuantizedWeight(q.kind, q.codes[order], q.scale[order], zero, q.int8_activations)


def rows_of(q: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows `ids` of the weight (an embedding lookup without dequantizing the table)."""
    picked = QuantizedWeight(q.kind, q.codes.index_select(0, ids), q.scale.index_select(0, ids),
                             None if q.zero is None else q.zero.index_select(0, ids))
    return dequantize(picked)


# ---- GGUF blocks -> codes, without dequantizing -----------------------------------------

GGUF_KINDS = {"Q4_0": Q4, "Q4_1": Q4, "Q8_0": Q8}


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A Q4_0 / Q4_1 / Q8_0 tensor's bytes (rows of blocks) as a QuantizedWeight."""
    n, k = shape
    blocks = raw.reshape(n * (k // GROUP), -1)
    scale = _f16_column(blocks, 0).reshape(n, k // GROUP)
    if type_name == "Q8_0":
        codes = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(n, k)
        return QuantizedWeight(Q8, torch.from_numpy(codes.copy()), scale, None)
    if type_name == "Q4_1":
        zero, start = _f16_column(blocks, 2).reshape(n, k // GROUP), 4
    else:  # Q4_0: w = d * (code - 8) = d * code - 8 d (exact in fp16 short of overflow)
        zero, start = -8 * scale, 2
    codes = np.ascontiguousarray(blocks[:, start:]).reshape(n, k // 2)
    return QuantizedWeight(Q4, torch.from_numpy(codes.copy()), scale, zero)


def _f16_column(blocks: np.ndarray, at: int) -> torch.Tensor:
    half = np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16)[:, 0]
    return torch.from_numpy(half.copy())
