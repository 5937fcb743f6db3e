"""Preemption policy: swap to host or recompute, whichever costs less.

Swapping moves the request's KV pages to host memory and back: 2 x bytes / copy bandwidth.
Recomputing re-runs the prefill: tokens x FLOPs per token / matmul throughput (its full
blocks stay in the prefix cache, so it is often cheaper than this bound, but under the very
pressure that caused the preemption they are the first to be evicted, so we do not count
on them). Defaults are this machine's measured figures (shared/PERF-NOTES.md): 27 GB/s
copy, about 80 GFLOP/s fp32 matmul.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreemptionCost:
    """What one token costs to recompute and to swap, and the machine's rates."""

    flops_per_token: float  # about 2 x parameters
    kv_bytes_per_token: int  # over every layer
    copy_bytes_per_s: float = 27e9
    flops_per_s: float = 80e9

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens * self.flops_per_token / self.flops_per_s

    def swap_s(self, num_tokens: int) -> float:
        return 2 * num_tokens * self.kv_bytes_per_token / self.copy_bytes_per_s


def choose_preemption_mode(cost: PreemptionCost, num_computed_tokens: int) -> str:
    """'swap' when moving the KV both ways is cheaper than recomputing it, else 'recompute'."""
    if num_computed_tokens == 0:
        return "recompute"  # nothing to save
    swap, recompute = cost.swap_s(num_computed_tokens), cost.recompute_s(num_computed_tokens)
    return "swap" if swap < recompute else "recompute"
