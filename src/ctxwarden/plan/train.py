"""Training-memory estimate: weights, gradients, optimizer states and activations.

The formulas are in FORMULA below; `ctxwarden plan --train` prints them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ctxwarden.spec.dtypes import canonical_dtype, dtype_bytes
from ctxwarden.spec.model_spec import ModelSpec
from ctxwarden.plan.params import count_parameters

FORMULA = """\
    weights      = P * bytes(param dtype)
    gradients    = P * bytes(grad dtype)
    optimizer    = P * (2 * bytes(state dtype) + master)   Adam keeps m and v; mixed precision
                   adds an fp32 master copy (master = 4 bytes) when params are not fp32
    activations  = L * s * b * h * (34 + 5 * a * s / h) * bytes/2
                   (Korthikanti et al. 2022, per transformer layer, 16-bit activations;
                    the 5as/h term is the attention score matrix, 0 with flash attention)
    checkpointed = L * 2 * s * b * h * bytes/2  +  one layer's full activations
                   (only each layer's input is kept; one layer is recomputed at a time)

P parameters, L layers, s sequence length, b micro-batch, h hidden size, a attention heads.
"""


@dataclass(frozen=True)
class TrainPlan:
    parameters: int
    sequence_tokens: int
    micro_batch: int
    param_dtype: str
    optimizer_dtype: str
    flash_attention: bool
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    activations_checkpointed_bytes: int
    total_bytes: int
    total_checkpointed_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def plan_training(spec: ModelSpec, sequence_tokens: int, micro_batch: int = 1,
                  param_dtype: str = "bf16", optimizer_dtype: str = "fp32",
                  flash_attention: bool = True) -> TrainPlan:
    """Estimate training memory for one micro-batch of `sequence_tokens` tokens with Adam."""
    param_dtype = canonical_dtype(param_dtype, what="param_dtype")
    optimizer_dtype = canonical_dtype(optimizer_dtype, what="optimizer_dtype")
    if sequence_tokens < 1 or micro_batch < 1:
        raise ValueError("sequence_tokens and micro_batch must be >= 1")
    p = count_parameters(spec)
    pb = dtype_bytes(param_dtype)
    master = 4 if param_dtype != "fp32" else 0
    weights, grads = p * pb, p * pb
    optimizer = p * (2 * dtype_bytes(optimizer_dtype) + master)
    s, b, h, a = sequence_tokens, micro_batch, spec.hidden_size, spec.num_attention_heads
    scale = pb / 2  # the published constants count 16-bit activations
    attention_term = 0 if flash_attention else 5 * a * s / h
    per_layer = s * b * h * (34 + attention_term) * scale
    acts = int(spec.num_layers * per_layer)
    ckpt = int(spec.num_layers * 2 * s * b * h * scale + per_layer)
    static = weights + grads + optimizer
    return TrainPlan(p, s, b, param_dtype, optimizer_dtype, flash_attention, weights, grads,
                     optimizer, acts, ckpt, static + acts, static + ckpt)
