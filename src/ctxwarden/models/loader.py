"""Weight sources: Hugging Face safetensors directories and GGUF files, read lazily.

A `WeightSource` first answers from headers alone (`infos`: name -> shape and type), so that
`check` can refuse a checkpoint that lacks a tensor, has a wrong shape or an unsupported
type before any tensor memory is committed. Tensors are then read one at a time:

- safetensors: `safe_open` memory-maps each shard; the index file picks the shards.
- GGUF: `gguf.GGUFReader` memory-maps the file; quantised blocks are dequantised with
  `gguf.quants.dequantize`; names are mapped to Hugging Face names; llama.cpp's Q/K row
  permutation (interleaved RoPE pairs) is undone so the NeoX-style rotary of HF applies;
  Gemma's norms, stored by llama.cpp as 1 + w, get their 1 taken back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ctxwarden.engine.config import WEIGHTS_MODES
from ctxwarden.ext import has_vector_kernels
from ctxwarden.errors import WeightsError
from ctxwarden.layers.quant import (GGUF_KINDS, GROUP, Q4, Q8, QuantizedWeight, from_gguf_blocks,
                                    permute_rows, quantize)
from ctxwarden.spec.checkpoint import Checkpoint, resolve_checkpoint
from ctxwarden.spec.dtypes import ACTIVATION_DTYPES, DTYPES, canonical_dtype

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F64": torch.float64}

_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_GGUF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_qkv": "self_attn.qkv_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
               "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "ffn_up_gate": "mlp.gate_up_proj"}
_GGUF_GEMMA2_LAYER = {**_GGUF_LAYER, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# Multimodal wrappers (Gemma-3 4B and up) keep the language model under a prefix: hub files
# (transformers 4.x) as language_model.model.* / language_model.lm_head.*, transformers 5.x
# saves as model.language_model.*. Read under the text model's names; the vision tower and
# projector keep theirs (no architecture here asks for them).
_TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                        ("model.language_model.", "model."))
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def torch_dtype(name: str, allowed: tuple[str, ...] = ACTIVATION_DTYPES, what: str = "dtype") -> torch.dtype:
    """The torch dtype of a dtype name in either vocabulary (float32 / fp32, bfloat16 / bf16)."""
    return getattr(torch, DTYPES[canonical_dtype(name, allowed, what)].torch_name)


@dataclass(frozen=True)
class TensorInfo:
    """What a header says about one tensor, under its Hugging Face name."""

    name: str
    shape: tuple[int, ...]
    type_name: str  # safetensors dtype (F32, BF16, ...) or GGML type (Q4_1, F16, ...)
    file: Path


class WeightSource:
    """Tensors of one checkpoint, by Hugging Face name. Headers first, data on `get`."""

    infos: dict[str, TensorInfo]

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Refuse missing tensors, wrong shapes and unsupported types, naming each one."""
        for name, shape in expected.items():
            info = self.infos.get(name)
            if info is None:
                raise WeightsError(self.describe(), name, "is missing from the checkpoint")
            if info.shape != tuple(shape):
                raise WeightsError(str(info.file), name,
                                   f"has shape {list(info.shape)}, the config implies {list(shape)}")
            if not self.is_supported(info):
                raise WeightsError(str(info.file), name,
                                   f"has tensor type {info.type_name}, which cannot be loaded; "
                                   f"supported: {', '.join(self.supported_types())}")

    def describe(self) -> str:
        files = sorted({str(i.file) for i in self.infos.values()})
        return files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"

    def is_supported(self, info: TensorInfo) -> bool:
        return info.type_name in self.supported_types()

    def supported_types(self) -> tuple[str, ...]:
        raise NotImplementedError

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def get_linear(self, name: str, weights: str, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
        """A projection weight as `weights` mode stores it (see WEIGHTS_MODES).

        auto keeps what the file stores quantized (GGUF Q4_0 / Q4_1 / Q8_0) quantized, keeps
        a BF16 tensor in bf16 where the ext/ kernels multiply it in fp32 (an fp32 model on
        a vector build: the same numbers as the weight widened to fp32, half the bytes,
        faster decode; layers/linear.py) and loads the rest in `dtype`; auto-int8act stores the same, its quantized weights
        marked for int8 activations (layers/linear.py); int4 / int8 quantize every projection (a GGUF tensor
        already of that kind is kept as it is); fp32 / bf16 are dense.
        """
        if weights in ("fp32", "bf16"):
            return self.get(name, torch.float32 if weights == "fp32" else torch.bfloat16)
        stored = self.get_quantized(name)
        if weights == "auto-int8act" and stored is not None:
            return replace(stored, int8_activations=True)
        if weights in ("auto", "auto-int8act"):
            if stored is not None:
                return stored
            if (self.infos[name].type_name == "BF16" and dtype == torch.float32
                    and has_vector_kernels()):
                return self.get(name, torch.bfloat16)  # exact: BF16 -> bf16
            return self.get(name, dtype)
        kind = {"int4": Q4, "int8": Q8}[weights]
        if stored is not None and stored.kind == kind:
            return stored
        dense = self.get(name, torch.float32)
        return quantize(dense, kind) if dense.shape[-1] % GROUP == 0 else dense.to(dtype)

    def get_quantized(self, name: str) -> QuantizedWeight | None:
        """The tensor's codes as stored, if the file stores it group-quantized (GGUF)."""
        return None


class SafetensorsSource(WeightSource):
    """Shards of a Hugging Face directory, memory-mapped by `safetensors.safe_open`."""

    def __init__(self, files: tuple[Path, ...]):
        from safetensors import safe_open

        from ctxwarden.spec.checkpoint import read_safetensors_header

        self.infos, self._stored_names = {}, {}
        self._handles = {}
        for f in files:
            for stored, meta in read_safetensors_header(f).items():
                if stored != "__metadata__":
                    name = _text_model_name(stored)
                    self.infos[name] = TensorInfo(name, tuple(meta["shape"]), meta["dtype"], f)
                    self._stored_names[name] = stored
            self._handles[f] = safe_open(str(f), framework="pt")

    def supported_types(self) -> tuple[str, ...]:
        return tuple(_SAFETENSORS_DTYPES)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        info = self.infos[name]
        return self._handles[info.file].get_tensor(self._stored_names[name]).to(dtype)


def _text_model_name(stored: str) -> str:
    """A wrapper's language-model tensor under the text model's own name (others as stored)."""
    for prefix, text in _TEXT_MODEL_PREFIXES:
        if stored.startswith(prefix):
            return text + stored[len(prefix):]
    return stored


class GGUFSource(WeightSource):
    """One GGUF file: tensors mapped to HF names and dequantised on `get`.

    The header is read with ctxwarden.spec.gguf_header (no gguf.GGUFReader: it builds a view for
    every field and took seconds); each tensor's bytes are read from one memory map.
    """

    def __init__(self, path: Path, model_type: str, num_heads: int, num_kv_heads: int):
        from gguf import GGMLQuantizationType

        from ctxwarden.spec.gguf_header import read_gguf_header

        self.path, self.model_type = path, model_type
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        header = read_gguf_header(path)
        self._map = np.memmap(path, dtype=np.uint8, mode="r", offset=header.data_offset)
        self._tensors, self.infos = {}, {}
        for t in header.tensors:
            hf = _gguf_to_hf_name(t.name, model_type)
            if hf is None:
                continue  # llama.cpp extras such as rope_freqs: recomputed from the config
            qtype = _quant_type(GGMLQuantizationType, t, path)
            self.infos[hf] = TensorInfo(hf, t.shape, qtype.name, path)
            self._tensors[hf] = (t, qtype)

    def supported_types(self) -> tuple[str, ...]:
        from gguf.quants import _type_traits

        return ("F32", "F16", *sorted(q.name for q in _type_traits))

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t, qtype = self._tensors[name]
        data = _dequantize(self._map, t, qtype).reshape(self.infos[name].shape)
        out = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy
        heads = self._rope_permuted_heads(name)
        if heads:
            out = _unpermute_rope_rows(out, heads)
        if self.model_type == "gemma2" and name.endswith("norm.weight"):
            out = out - 1.0
        return out.to(dtype)

    def get_quantized(self, name: str) -> QuantizedWeight | None:
        t, qtype = self._tensors[name]
        shape = self.infos[name].shape
        if qtype.name not in GGUF_KINDS or len(shape) != 2:
            return None
        from gguf.constants import GGML_QUANT_SIZES

        block, type_size = GGML_QUANT_SIZES[qtype]
        raw = self._map[t.offset:t.offset + int(np.prod(t.dims)) // block * type_size]
        q = from_gguf_blocks(raw, qtype.name, shape)
        heads = self._rope_permuted_heads(name)
        if heads:
            order = _unpermute_rope_rows(torch.arange(shape[0])[:, None], heads)[:, 0]
            q = permute_rows(q, order)
        return q

    def _rope_permuted_heads(self, name: str) -> int:
        """Heads of a llama.cpp Q/K weight whose rows must be un-permuted; 0 for the rest."""
        if self.model_type not in ("llama", "mistral"):
            return 0
        if name.endswith("self_attn.q_proj.weight"):
            return self.num_heads
        return self.num_kv_heads if name.endswith("self_attn.k_proj.weight") else 0


def _quant_type(enum, t, path: Path):
    try:
        return enum(t.type_id)
    except ValueError:
        raise WeightsError(str(path), t.name, f"unknown GGML tensor type id {t.type_id}") from None


def _dequantize(data_map: np.ndarray, t, qtype) -> np.ndarray:
    """The tensor's values as float32, from its bytes in the file's data section."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    block, type_size = GGML_QUANT_SIZES[qtype]
    num_elements = int(np.prod(t.dims))
    raw = data_map[t.offset:t.offset + num_elements // block * type_size]
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32)
    rows = raw.reshape(-1, t.dims[0] // block * type_size)  # one row of the fastest dim
    return dequantize(rows, qtype)


def _gguf_to_hf_name(name: str, model_type: str) -> str | None:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _GGUF_BLOCK.match(name)
    table = _GGUF_GEMMA2_LAYER if model_type == "gemma2" else _GGUF_LAYER
    if m is None or m.group(2) not in table:
        return None
    return f"model.layers.{m.group(1)}.{table[m.group(2)]}.{m.group(3)}"


def _unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, pairs (0, d/2), (1, d/2+1)... interleaved.

    llama.cpp's converter reorders each head's rows as reshape(heads, 2, d/2).swap(1, 2) so
    that its rotary can rotate adjacent pairs; the inverse restores the half-split order.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def open_weights(ckpt: Checkpoint) -> WeightSource:
    """A lazy weight source for a resolved checkpoint (safetensors or GGUF)."""
    if ckpt.format == "safetensors":
        return SafetensorsSource(ckpt.weight_files)
    if ckpt.format == "gguf":
        spec = ckpt.spec
        return GGUFSource(ckpt.weight_files[0], spec.model_type, spec.num_attention_heads,
                          spec.num_kv_heads)
    raise WeightsError(str(ckpt.path), "<all>",
                       "the checkpoint has no weight files (*.safetensors or .gguf); it can be "
                       "planned but not run. Build one with `ctxwarden make-model`.")


def load_model(model: str | Path | Checkpoint | None = None, dtype: str = "float32",
               weights: str = "fp32"):
    """Load a checkpoint (HF dir, config.json dir, .gguf, or None = default) for inference.

    Order matters: the architecture and every tensor's name, shape and type are checked
    from headers first, so a bad checkpoint fails before any weight memory is committed.
    """
    from ctxwarden.models.registry import model_class

    ckpt = model if isinstance(model, Checkpoint) else resolve_checkpoint(model)
    cls = model_class(ckpt.spec, str(ckpt.path))
    source = open_weights(ckpt)
    source.check(cls.expected_tensors(ckpt.spec))
    if weights not in WEIGHTS_MODES:
        raise ValueError(f"weights must be one of {WEIGHTS_MODES}, got {weights!r}")
    with torch.inference_mode():
        return cls.from_weights(ckpt.spec, source, torch_dtype(dtype), weights)
