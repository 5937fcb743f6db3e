"""The weights' bytes in their runtime layout: what the runner will hold for a weights mode.

A checkpoint's headers say what the file stores (SmolLM2's GGUF: 97 MiB of Q4_1 and Q8_0
blocks). The runner holds something else: norms in the compute dtype, quantized tensors as
codes and fp16 scales (layers/quant.py), dense ones in the mode's dtype, and on AVX-512 VNNI
builds under `auto-int8act` every quantized projection packed into panels for the tile
kernels (layers/linear.py: a q4 weight's panels replace its row-major codes; a q8 one keeps
its codes beside its panels, 38 bytes per group of 32 where the codes take 32). A plan that
counts the file's bytes undercounts that process by a third; this module counts the layout,
tensor by tensor, from the headers alone (no torch), with the loader's own rules:

- mode fp32 / bf16: every projection dense in that dtype;
- auto / auto-int8act: GGUF Q4_0 / Q4_1 / Q8_0 stay q4 / q8 (auto-int8act marks them for
  int8 activations); a BF16 projection stays bf16 in an fp32 model on a vector build; the
  rest in the compute dtype;
- int4 / int8: every projection whose input size is a multiple of 32 quantized (a tensor
  already of that kind kept); int4's lm_head at 8 bits;
- q, k, v and gate, up stack into one weight each (mixed kinds go dense);
- a tied embedding shares the lm_head's tensor when that is quantized or dense in the
  compute dtype or bf16; where the lm_head is reordered for oneDNN it is a second copy;
- without the vector kernels a quantized weight is dequantized to fp32 at load.

`tests/plan/test_weights_layout.py` holds this to the bytes the loaded model reports
(`weights_bytes`) for every weights mode on the real checkpoint. Families with their own
loader (DeepSeek's MLA) are not modeled: `runtime_weights_bytes` returns None for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GROUP = 32  # layers/quant.py GROUP
PANEL_ROWS = 16  # ext kGemmCols: weight rows per panel
Q4_PANEL_GROUP_BYTES = 4 * 64 + 2 * 2 * PANEL_ROWS  # per panel and group: codes, fp16 scales, zeros
Q8_PANEL_GROUP_BYTES = PANEL_ROWS * (32 + 2 + 4)  # codes, fp16 scale, int32 -128 sum(w)

GGUF_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}
QUANT_KINDS = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # engine/config.py's short names
MODELED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True)
class KernelCaps:
    """What the runtime's kernels do with a weight (from ctxwarden.ext; see `kernel_caps`)."""

    vector: bool  # ext's vector kernels: quantized weights stay quantized, fp32 stays plain
    panels: bool  # AVX-512 VNNI panel tiles: weights with int8 activations packed at load
    onednn_bf16: bool = False  # a bf16 weight in a bf16 model is reordered for oneDNN


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a header describes it, under its role in the model."""

    role: str  # embed, lm_head, q, k, v, qkv, o, gate, up, gate_up, down, other (norms,
    # biases: loaded in the compute dtype), unused (what the loader never reads)
    layer: int | None
    shape: tuple[int, ...]
    type_name: str  # safetensors dtype (F32, BF16) or GGML type (Q4_1, F16)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


_GGUF_ROLES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_qkv": "qkv", "attn_output": "o",
               "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_HF_ROLES = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
             "self_attn.qkv_proj": "qkv", "self_attn.o_proj": "o", "mlp.gate_proj": "gate",
             "mlp.up_proj": "up", "mlp.gate_up_proj": "gate_up", "mlp.down_proj": "down"}
_STACKS = (("q", "k", "v"), ("gate", "up"))


def role_of(name: str) -> tuple[str, int | None]:
    """(role, layer) of a GGUF or Hugging Face tensor name."""
    if name in ("token_embd.weight", "model.embed_tokens.weight"):
        return "embed", None
    if name in ("output.weight", "lm_head.weight"):
        return "lm_head", None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if m and m.group(2) in _GGUF_ROLES:
        return _GGUF_ROLES[m.group(2)], int(m.group(1))
    m = re.fullmatch(r"model\.layers\.(\d+)\.([\w.]+)\.weight", name)
    if m and m.group(2) in _HF_ROLES:
        return _HF_ROLES[m.group(2)], int(m.group(1))
    return ("other" if "norm" in name or name.endswith(".bias") else "unused"), None


def runtime_weights_bytes(tensors: list[StoredTensor], *, model_type: str, tied: bool, mode: str,
                          dtype: str, caps: KernelCaps) -> int | None:
    """Bytes the runner holds for these tensors under `mode` with compute `dtype`; None for a
    family whose loader this does not model."""
    if model_type not in MODELED_TYPES:
        return None
    dtype = DTYPE_NAMES.get(dtype, dtype)
    act = DTYPE_BYTES[dtype]
    total, layers = 0, {}
    embed = next((t for t in tensors if t.role == "embed"), None)
    for t in tensors:
        if t.role == "other":
            total += t.numel * act
        elif t.role not in ("embed", "lm_head", "unused"):  # unused: rope_freqs and the like
            layers.setdefault(t.layer, {})[t.role] = t
    for parts in layers.values():
        for stack in _STACKS:
            if all(r in parts for r in stack):
                total += _weight_bytes(_stacked([_load_kind(parts.pop(r), mode, dtype, caps) for r in stack]),
                                       caps, dtype)
        total += sum(_weight_bytes(_load_kind(t, mode, dtype, caps), caps, dtype) for t in parts.values())
    head_mode = "int8" if mode == "int4" else mode
    if embed is None:
        return total
    if not tied:
        head = next((t for t in tensors if t.role == "lm_head"), None)
        total += embed.numel * act
        return total + (_weight_bytes(_load_kind(head, head_mode, dtype, caps), caps, dtype) if head else 0)
    kind = _load_kind(embed, head_mode, dtype, caps)
    shared = kind.quant is not None or kind.dense in (dtype, "bfloat16")
    table = kind.nbytes if shared else embed.numel * act
    return total + table + _weight_bytes(kind, caps, dtype, shared_with_table=shared)


@dataclass(frozen=True)
class _Kind:
    """How the loader hands one (possibly stacked) weight to pack_linear."""

    n: int
    k: int
    quant: str | None  # q4 | q8 | None (dense)
    int8_activations: bool = False
    dense: str = "float32"  # its dtype, when dense

    @property
    def nbytes(self) -> int:
        if self.quant == "q4":
            return self.n * self.k // 2 + self.n * (self.k // GROUP) * 4
        if self.quant == "q8":
            return self.n * self.k + self.n * (self.k // GROUP) * 2
        return self.n * self.k * DTYPE_BYTES[self.dense]


def _load_kind(t: StoredTensor, mode: str, dtype: str, caps: KernelCaps) -> _Kind:
    """models/loader.py WeightSource.get_linear, by bytes."""
    n, k = t.shape
    stored = QUANT_KINDS.get(t.type_name)
    if mode in ("fp32", "bf16"):
        return _Kind(n, k, None, dense="float32" if mode == "fp32" else "bfloat16")
    if mode in ("auto", "auto-int8act"):
        if stored:
            return _Kind(n, k, stored, int8_activations=mode == "auto-int8act")
        if t.type_name == "BF16" and dtype == "float32" and caps.vector:
            return _Kind(n, k, None, dense="bfloat16")
        return _Kind(n, k, None, dense=dtype)
    kind = {"int4": "q4", "int8": "q8"}[mode]
    if stored == kind or k % GROUP == 0:
        return _Kind(n, k, kind)
    return _Kind(n, k, None, dense=dtype)


def _stacked(parts: list[_Kind]) -> _Kind:
    """layers/quant.py stack_rows: one kind stays that kind, mixed kinds go dense (in the
    first dense part's dtype, else fp32)."""
    n, k = sum(p.n for p in parts), parts[0].k
    kinds = {p.quant for p in parts}
    if len(kinds) == 1 and None not in kinds:
        return _Kind(n, k, parts[0].quant, all(p.int8_activations for p in parts))
    dense = [p.dense for p in parts if p.quant is None]
    return _Kind(n, k, None, dense=dense[0] if dense else "float32")


def _weight_bytes(w: _Kind, caps: KernelCaps, dtype: str, shared_with_table: bool = False) -> int:
    """layers/linear.py pack_linear, by bytes (`shared_with_table`: a tied lm_head, whose
    table bytes are counted already)."""
    rows16 = -(-w.n // PANEL_ROWS)
    groups = w.k // GROUP
    if w.quant is not None and caps.vector:
        if not (w.int8_activations and caps.panels):
            return 0 if shared_with_table else w.nbytes
        if w.quant == "q4":
            panels = rows16 * groups * Q4_PANEL_GROUP_BYTES
            # the panels replace the codes; a tied table keeps its own codes for lookups
            return panels + (0 if shared_with_table else w.n * groups * 4)
        panels = rows16 * groups * Q8_PANEL_GROUP_BYTES
        return panels + (0 if shared_with_table else w.nbytes)
    if w.quant is not None:  # no vector kernels: dequantized to fp32 (and the table kept)
        return w.n * w.k * 4
    if shared_with_table:  # the table's own tensor, unless oneDNN reorders a copy (can_pack)
        plain_kernel = caps.vector and w.dense in ("float32", "bfloat16") and "float32" in (w.dense, dtype)
        reorderable = w.dense == "float32" or (w.dense == "bfloat16" and caps.onednn_bf16)
        return w.nbytes if reorderable and not plain_kernel else 0
    return w.nbytes


def gguf_tensors(header) -> list[StoredTensor]:
    """The StoredTensors of a GGUFHeader (spec/gguf_header.py)."""
    out = []
    for t in header.tensors:
        role, layer = role_of(t.name)
        out.append(StoredTensor(role, layer, t.shape, GGUF_TYPE_NAMES.get(t.type_id, f"type{t.type_id}")))
    return out


def safetensors_tensors(headers: list[dict]) -> list[StoredTensor]:
    """The StoredTensors of safetensors headers (name -> {dtype, shape, data_offsets})."""
    out = []
    for header in headers:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            role, layer = role_of(name)
            out.append(StoredTensor(role, layer, tuple(info["shape"]), info["dtype"]))
    return out


__all__ = ["KernelCaps", "StoredTensor", "runtime_weights_bytes", "role_of", "gguf_tensors",
           "safetensors_tensors"]
