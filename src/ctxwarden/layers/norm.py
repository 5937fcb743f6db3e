"""RMSNorm, in the two conventions checkpoints use: `w * x` (llama) and `(1 + w) * x` (gemma)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Normalise the last dim of x by its root mean square, then scale by (offset + weight).

    Computed in fp32 whatever x's dtype (a bf16 mean of squares loses the small values),
    and cast back. Llama multiplies after the cast, Gemma before: both orders are kept so
    that bf16 runs round like their reference.
    """
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x32 * (offset + weight.float())).to(dtype)
    return weight * x32.to(dtype)
