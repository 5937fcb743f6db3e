"""The gated feed-forward block: down(act(gate(x)) * up(x)), gate and up in one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ctxwarden.layers.linear import LinearWeight, linear


def activation(name: str):
    """The elementwise function a config's `hidden_act` names (silu, gelu, gelu_pytorch_tanh)."""
    table = {
        "silu": F.silu,
        "swish": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    }
    if name not in table:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(table)}")
    return table[name]


def gated_mlp(x: torch.Tensor, gate_up: LinearWeight, down: LinearWeight, act) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]; `gate_up` [2 * inter, hidden] is gate rows then up rows."""
    gu = linear(x, gate_up)  # [T, 2 * inter]: one matmul reads the input once
    gate, up = gu.chunk(2, dim=-1)
    return linear(act(gate) * up, down)
