"""y = x @ W.T with the weight laid out once, at load time, for this CPU's matmul library.

Measured on the 2-vCPU Zen 4 machines (fp32, 30 weights of [3072, 576] in turn, so they
come from DRAM as in a real forward): oneDNN with its weight reordered ahead of time beats
`x @ W.t()` (MKL sgemm on a transposed view) at every row count a step has:
1 row 1.2-1.8x, 4 rows 2-3.5x, 16 rows 1.7-2.1x, 2048 rows 1.35-1.5x. Small row counts
gain most because MKL's small-M path reads the transposed weight poorly.

The reordered tensor replaces the plain one (no second copy is kept). Where oneDNN is not
built in, or for dtypes other than fp32, the plain weight is used with `F.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LinearWeight:
    """One projection's weight [out_features, in_features], plain or reordered for oneDNN."""

    weight: torch.Tensor
    is_packed: bool
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes the (possibly reordered) weight holds."""
        return self.weight.nbytes


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `pack_linear` would reorder this weight (fp32 on a CPU with oneDNN)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available())


def pack_linear(weight: torch.Tensor, enabled: bool = True) -> LinearWeight:
    """Prepare `weight` [out, in] for `linear`; reordered for oneDNN when that is possible."""
    out_features, in_features = weight.shape
    if enabled and can_pack(weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        return LinearWeight(packed, True, out_features, in_features)
    return LinearWeight(weight, False, out_features, in_features)


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """x [..., in] -> [..., out] = x @ W.T."""
    if w.is_packed:
        return torch.ops.mkldnn._linear_pointwise(x, w.weight, None, "none", [], "")
    return F.linear(x, w.weight)
