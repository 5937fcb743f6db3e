"""DeepSeek-style mixture of experts: a router picks top-k routed experts per token, a
shared expert sees every token, and the outputs add up.

    scores  = softmax(x @ Wg)                          (V2)  |  sigmoid(x @ Wg)        (V3)
    choose  = top-k of scores, optionally within the     |  top-k of scores + bias, within
              top groups by their best score               |  the top groups by their 2 best
    weights = chosen scores * routed_scaling_factor        |  chosen scores (normalised) * scale
    y       = sum_k weights_k * expert_k(x) + shared(x)

Routing runs in fp32, as transformers keeps the gate. Experts run one at a time over the
tokens that chose them (a per-expert loop in ascending expert order, the reference's order,
so sums accumulate alike); on CPU with a handful of experts per step this is the simple and
fast enough choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxwarden.layers.linear import LinearWeight
from ctxwarden.layers.mlp import gated_mlp


@dataclass(frozen=True)
class Routing:
    """How a router turns scores into expert choices (read from the config's MoE fields)."""

    num_experts_per_tok: int
    scoring: str  # "softmax" (DeepSeek-V2) or "sigmoid" (V3, with a score correction bias)
    topk_method: str = "greedy"  # V2: greedy | group_limited_greedy; V3 is always grouped
    num_groups: int | None = None
    topk_groups: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; supported: "
                             "greedy, group_limited_greedy (V2), noaux_tc (V3)")
        grouped = self.scoring == "sigmoid" or self.topk_method == "group_limited_greedy"
        if grouped and not (self.num_groups and self.topk_groups):
            raise ValueError(f"{self.topk_method} routing needs n_group and topk_group, got "
                             f"{self.num_groups} and {self.topk_groups}")


@dataclass
class MoEWeights:
    """One MoE block: the router, the routed experts, and the shared expert."""

    gate: torch.Tensor  # [num_experts, hidden], fp32
    score_bias: torch.Tensor | None  # [num_experts] (V3's e_score_correction_bias)
    experts: list[tuple[LinearWeight, LinearWeight]]  # (gate_up [2 inter, hidden], down)
    shared: tuple[LinearWeight, LinearWeight] | None


def route(x: torch.Tensor, w: MoEWeights, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] and their weights [T, k] (fp32) for tokens x [T, hidden]."""
    logits = x.float() @ w.gate.float().t()  # [T, E]
    if r.scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores + w.score_bias if w.score_bias is not None else scores
        choice = _keep_top_groups(choice, r, per_group=lambda g: g.topk(2, dim=-1)[0].sum(-1),
                                  fill=float("-inf"))
        ids = torch.topk(choice, r.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if r.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    else:
        scores = logits.softmax(-1)
        if r.topk_method == "group_limited_greedy":
            scores = _keep_top_groups(scores, r, per_group=lambda g: g.max(-1).values, fill=0.0)
        weights, ids = torch.topk(scores, r.num_experts_per_tok, dim=-1, sorted=False)
    return ids, weights * r.routed_scaling_factor


def _keep_top_groups(scores: torch.Tensor, r: Routing, per_group, fill: float) -> torch.Tensor:
    """Scores [T, E] with experts outside each token's `topk_groups` best groups set to fill."""
    t, e = scores.shape
    grouped = scores.view(t, r.num_groups, e // r.num_groups)
    best = torch.topk(per_group(grouped), r.topk_groups, dim=-1, sorted=False)[1]  # [T, groups]
    keep = torch.zeros(t, r.num_groups, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], fill).view(t, e)


def moe_forward(x: torch.Tensor, w: MoEWeights, r: Routing, act) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]: routed experts weighted by the router, plus the shared one."""
    ids, weights = route(x, w, r)
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():  # ascending, as the reference loops
        tokens, slot = torch.where(ids == expert)
        y = gated_mlp(x.index_select(0, tokens), *w.experts[expert], act)
        out.index_add_(0, tokens, y * weights[tokens, slot, None].to(y.dtype))
    if w.shared is not None:
        out = out + gated_mlp(x, *w.shared, act)
    return out
