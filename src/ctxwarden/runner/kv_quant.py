"""fp8 KV rows: float8 codes with one power-of-two scale per (token, KV head), in the page.

Row layout of an fp8 pool (uint8 [num_blocks, block_size, Hkv, D + 1]):

    byte  0 .. D-1   the head's D values as float8 codes (e4m3fn or e5m2), x / 2^k
    byte  D          k + 127: the scale's exponent (E8M0, as OCP microscaling formats)

Why a scale per (token, head), and a power of two:

- A token's bytes depend on that token's K/V alone. With a scale per block, a later token
  with a larger value rescales the codes already written, so a sequence decoded token by
  token, prefilled in chunks, or recomputed after preemption would store different bytes
  for the same tokens; here all three store exactly the same bytes, and a prefix-cache or
  tier hit is the same value a recompute would write.
- float8 is floating point: its relative precision (3 mantissa bits e4m3, 2 e5m2) does not
  depend on the scale. The scale only keeps the head's largest value in range (amax maps
  into (max/2, max]) and the small ones out of the subnormals; a power of two does that as
  well as any real scale, costs one byte, and applies exactly (x * 2^k rounds nothing).
- One byte per D codes: a token costs 2 * Hkv * (D + 1) bytes per layer, 50.8% of bf16 at
  D = 64, 50.4% at D = 128 (a scale per block of 16 tokens would be 50.05%, order-dependent).

The pages are plain bytes to everything else (swap, tiers, prefix cache, read_pages), so
those paths need nothing new; attention dequantizes the rows it gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_EXPONENT_BIAS = 127  # one byte per row: plan.kv.KV_SCALE_BYTES_PER_ROW counts it


def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] (any float dtype) -> uint8 [..., D + 1]: codes of x / 2^k, then k + 127.

    k is the smallest power of two with amax / 2^k <= the format's max (all-zero rows get
    the smallest k); frexp makes it exact, the clamp guards rows whose amax is the max.
    """
    x = x.float()
    fmax = torch.finfo(fp8_dtype).max
    amax = x.abs().amax(-1, keepdim=True)  # [..., 1]
    mantissa, exponent = torch.frexp(amax / fmax)  # amax / fmax = m * 2^e, m in [0.5, 1)
    k = exponent - (mantissa == 0.5).to(exponent.dtype)  # ceil(log2): exact powers of two
    k = torch.where(amax > 0, k, -_EXPONENT_BIAS).clamp(-_EXPONENT_BIAS, 127)
    # x * 2^-k, exact (torch.ldexp is the same product, ~20x slower: it goes through pow)
    codes = (x * torch.exp2(-k.float())).clamp_(-fmax, fmax).to(fp8_dtype).view(torch.uint8)
    return torch.cat([codes, (k + _EXPONENT_BIAS).to(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., D + 1] rows (as quantize_rows writes them) -> fp32 [..., D]."""
    codes = rows[..., :-1]
    # a 256-entry table: 2x faster than torch's float8 -> float32 cast on CPU
    values = _code_values(fp8_dtype).index_select(0, codes.reshape(-1).int()).view(codes.shape)
    return values * torch.exp2(rows[..., -1:].float() - _EXPONENT_BIAS)


_CODE_VALUES: dict[torch.dtype, torch.Tensor] = {}


def _code_values(fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 [256]: the value of every byte as a `fp8_dtype` code (built once per format)."""
    if fp8_dtype not in _CODE_VALUES:
        _CODE_VALUES[fp8_dtype] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    return _CODE_VALUES[fp8_dtype]


@dataclass(frozen=True)
class Fp8Rows:
    """A flat fp8 pool [slots, Hkv, D + 1] seen as the rows it encodes [slots, Hkv, D].

    It answers the two calls attention's gather makes of a flat pool: `index_select(0, ids)`
    (the selected rows, dequantized to fp32) and `shape`.
    """

    flat: torch.Tensor  # uint8 [slots, Hkv, D + 1]
    fp8_dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.flat.shape[:-1], self.flat.shape[-1] - 1))

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.flat.index_select(dim, index), self.fp8_dtype)
