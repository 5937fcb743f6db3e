"""all-MiniLM-L6-v2 with our own stack: tokenizers + safetensors + torch, no transformers.

The sentence-transformers pipeline this reproduces (checked by a parity test, cosine >= 0.999):
WordPiece (lower-cased, [CLS] text [SEP], cut at max_seq_length = 256) -> BERT (6 layers,
hidden 384, 12 heads of 32, post-LayerNorm, exact GELU) -> mean of the last hidden states
over the real tokens -> L2 normalisation. So the dot product of two embeddings is their cosine.

Speed: texts are sorted by length and batched by a token budget, so padding stays a few
percent; the query/key/value projections run as one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors
from tokenizers import Tokenizer

from ctxwarden.embed.locate import MINILM_NAME, MiniLMFiles, read_minilm_files
from ctxwarden.errors import ConfigError

DEFAULT_BATCH_TOKENS = 8192  # padded word pieces per forward: big enough for the matmuls, small for memory


@dataclass(frozen=True)
class _Layer:
    """One BERT layer's weights; q, k and v are stacked into one [3 * hidden, hidden] matmul."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor
    out_weight: torch.Tensor
    out_bias: torch.Tensor
    attn_norm: tuple[torch.Tensor, torch.Tensor]
    up_weight: torch.Tensor
    up_bias: torch.Tensor
    down_weight: torch.Tensor
    down_bias: torch.Tensor
    mlp_norm: tuple[torch.Tensor, torch.Tensor]


def _layer(w: dict[str, torch.Tensor], i: int, dtype: torch.dtype) -> _Layer:
    """Layer i's weights; matmul weights (and their biases) in `dtype`, norms in fp32."""
    p = f"encoder.layer.{i}."
    a = p + "attention."
    qkv = [a + f"self.{n}." for n in ("query", "key", "value")]
    return _Layer(
        torch.cat([w[n + "weight"] for n in qkv]).to(dtype), torch.cat([w[n + "bias"] for n in qkv]).to(dtype),
        w[a + "output.dense.weight"].to(dtype), w[a + "output.dense.bias"].to(dtype),
        (w[a + "output.LayerNorm.weight"], w[a + "output.LayerNorm.bias"]),
        w[p + "intermediate.dense.weight"].to(dtype), w[p + "intermediate.dense.bias"].to(dtype),
        w[p + "output.dense.weight"].to(dtype), w[p + "output.dense.bias"].to(dtype),
        (w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"]))


class MiniLMEncoder:
    """Texts -> unit-length float32 embeddings [num_texts, 384]."""

    name = MINILM_NAME

    def __init__(self, files: MiniLMFiles | None = None, batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 dtype: str = "auto"):
        files = read_minilm_files() if files is None else files
        cfg = files.config
        self.num_heads, self.eps = int(cfg["num_attention_heads"]), float(cfg["layer_norm_eps"])
        self.dim, self.batch_tokens = int(cfg["hidden_size"]), batch_tokens
        self.max_seq_length = min(files.max_seq_length, int(cfg["max_position_embeddings"]))
        w = load_safetensors(files.safetensors_bytes)
        _check_weights(files, w, int(cfg["num_hidden_layers"]))
        self.word = w["embeddings.word_embeddings.weight"]
        self.position = w["embeddings.position_embeddings.weight"]
        self.token_type0 = w["embeddings.token_type_embeddings.weight"][0]  # one segment: type 0
        self.embed_norm = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        self.dtype = _matmul_dtype(dtype)
        self.layers = [_layer(w, i, self.dtype) for i in range(int(cfg["num_hidden_layers"]))]
        self.tokenizer = Tokenizer.from_str(files.tokenizer_json)
        self.tokenizer.no_padding()  # we pad per batch, to the longest text in it
        self.tokenizer.enable_truncation(self.max_seq_length)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of `texts`, in their order: float32 [len(texts), dim], each of norm 1."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        ids = [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=True)]
        with torch.inference_mode():
            for batch in _length_batches(ids, self.batch_tokens):
                out[batch] = self._embed([ids[i] for i in batch]).numpy()
        return out

    def count_word_pieces(self, texts: Sequence[str]) -> int:
        """Word pieces the model reads for `texts` (after the cut at max_seq_length)."""
        return sum(len(e.ids) for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=True))

    def _embed(self, ids: list[list[int]]) -> torch.Tensor:
        """Padded batch -> pooled, normalised embeddings [batch, dim]."""
        length = max(map(len, ids))
        tokens = torch.zeros(len(ids), length, dtype=torch.long)
        mask = torch.zeros(len(ids), length, dtype=torch.bool)
        for row, seq in enumerate(ids):
            tokens[row, :len(seq)] = torch.tensor(seq)
            mask[row, :len(seq)] = True
        h = self.word[tokens] + self.position[:length] + self.token_type0  # [B, L, D]
        h = F.layer_norm(h, (self.dim,), *self.embed_norm, self.eps)
        attn_mask = mask[:, None, None, :]  # [B, 1, 1, L]: every query sees the real keys only
        for layer in self.layers:
            h = self._layer(h, layer, attn_mask)
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=-1)

    def _layer(self, h: torch.Tensor, w: _Layer, attn_mask: torch.Tensor) -> torch.Tensor:
        """One post-LN BERT layer. h [B, L, D] stays fp32 (residuals and norms); the matmuls,
        attention and GELU run in self.dtype (what torch.autocast would do, without
        re-casting the weights on every call)."""
        b, length, d = h.shape
        x = h.to(self.dtype)
        qkv = F.linear(x, w.qkv_weight, w.qkv_bias).view(b, length, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, L, head_dim]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        a = a.transpose(1, 2).reshape(b, length, d)
        h = F.layer_norm(h + F.linear(a, w.out_weight, w.out_bias).float(), (d,), *w.attn_norm, self.eps)
        up = F.gelu(F.linear(h.to(self.dtype), w.up_weight, w.up_bias))  # exact (erf) GELU, as BERT's "gelu"
        down = F.linear(up, w.down_weight, w.down_bias).float()
        return F.layer_norm(h + down, (d,), *w.mlp_norm, self.eps)


def _matmul_dtype(name: str) -> torch.dtype:
    """"auto": bf16 where the CPU has native bf16 dot products (AVX512-BF16 / AMX), else fp32."""
    if name == "auto":
        return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {name!r}")
    return torch.float32 if name == "float32" else torch.bfloat16


def _length_batches(ids: list[list[int]], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by similar length, each group's padded size <= batch_tokens (or 1 text)."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending length: the newest text is the longest of its group
        if current and (len(current) + 1) * len(ids[i]) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def _check_weights(files: MiniLMFiles, w: dict[str, torch.Tensor], num_layers: int) -> None:
    needed = ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
              "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight",
              f"encoder.layer.{num_layers - 1}.output.LayerNorm.bias"]
    missing = [n for n in needed if n not in w]
    if missing:
        raise ConfigError(f"{files.source}:model.safetensors", missing[0], "is missing: not a BERT checkpoint")
