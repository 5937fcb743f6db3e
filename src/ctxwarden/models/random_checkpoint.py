"""Random-weight checkpoints in Hugging Face format, for tests, demos and benchmarks.

`make_checkpoint(options)` writes config.json, model.safetensors and generation_config.json
that transformers loads as-is (its configs in 4.x style, which 5.x also reads), plus a
byte-level BPE tokenizer trained with `tokenizers` on local text (tokenizer.json and
tokenizer_config.json with a ChatML chat template). No network is touched.

Weights are N(0, 0.02) like transformers' own init, so logits are small but not
degenerate; norm weights are 1 (0 for Gemma's 1 + w convention) plus a little noise, so a
test that gets the norm convention wrong fails instead of passing by symmetry.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "deepseek_v2", "deepseek_v3")
_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
          "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
          "phi3": "Phi3ForCausalLM",
          "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
_MODEL_TYPE = {"gemma3": "gemma3_text"}  # make-model's gemma3 is the text model
_GEMMA = ("gemma2", "gemma3")  # (1 + w) norms: their weights are drawn around 0
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The tokenizer's training text ships with the package (about 50K characters from each of
# Jane Austen's six novels, public domain): a checkpoint's tokenizer depends only on the
# options, never on the machine it is made on.
_TRAINING_TEXT = "data/tokenizer_text.txt.gz"
_CORPUS_CHARS = 400_000  # of a --corpus directory: a few thousand merges, about a second


@dataclass(frozen=True)
class MakeModelOptions:
    """Sizes and options of a random checkpoint (defaults: a tiny, fast model)."""

    arch: str
    out_dir: Path
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    sliding_window: int | None = None
    partial_rotary_factor: float | None = None
    seed: int = 0
    with_tokenizer: bool = True
    corpus_dir: Path | None = None
    # config.json fields written over the architecture's own (e.g. DeepSeek's q_lora_rank,
    # topk_method, rope_interleave); checked by parsing the result like any config
    config_overrides: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"--arch {self.arch!r} is not one of {', '.join(ARCHS)}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "vocab_size", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"--kv-heads {self.num_kv_heads} must divide --heads {self.num_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by --heads "
                             f"{self.num_heads}; pass --head-dim")
        if self.sliding_window is not None and self.arch == "llama":
            raise ValueError("llama has no sliding window; use --arch mistral, qwen2, qwen3, "
                             "gemma2 or phi3 with --sliding-window")
        if self.with_tokenizer and self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"--vocab-size {self.vocab_size} is too small for a byte-level "
                             f"tokenizer (needs >= {256 + len(SPECIAL_TOKENS)}); raise it or "
                             "pass --no-tokenizer")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


def build_config(o: MakeModelOptions) -> dict[str, Any]:
    """The config.json of the checkpoint (transformers 4.x layout)."""
    cfg: dict[str, Any] = {
        "architectures": [_CLASS[o.arch]], "model_type": _MODEL_TYPE.get(o.arch, o.arch),
        "hidden_size": o.hidden_size, "intermediate_size": o.intermediate_size,
        "num_hidden_layers": o.num_layers, "num_attention_heads": o.num_heads,
        "num_key_value_heads": o.num_kv_heads, "head_dim": o.resolved_head_dim,
        "vocab_size": o.vocab_size, "max_position_embeddings": o.max_position,
        "rms_norm_eps": 1e-6, "rope_theta": o.rope_theta, "rope_scaling": o.rope_scaling,
        "hidden_act": "silu", "tie_word_embeddings": o.arch in ("llama", *_GEMMA),
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
        "attention_dropout": 0.0,
    }
    if o.arch in ("llama", "mistral", "qwen3"):
        cfg["attention_bias"] = False
    cfg.update(_arch_config(o))
    if o.partial_rotary_factor is not None:
        cfg["partial_rotary_factor"] = o.partial_rotary_factor
    cfg.update(o.config_overrides or {})
    return cfg


def _arch_config(o: MakeModelOptions) -> dict[str, Any]:
    if o.arch in ("mistral", "phi3"):
        extra = {"sliding_window": o.sliding_window}
        if o.arch == "phi3":
            original = (o.rope_scaling or {}).get("original_max_position_embeddings", o.max_position)
            extra.update({"resid_pdrop": 0.0, "embd_pdrop": 0.0,
                          "original_max_position_embeddings": original})
        return extra
    if o.arch in ("qwen2", "qwen3"):
        return {"sliding_window": o.sliding_window, "use_sliding_window": o.sliding_window is not None,
                "max_window_layers": 0 if o.sliding_window else o.num_layers}
    if o.arch == "gemma2":
        return {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": o.resolved_head_dim, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "sliding_window": o.sliding_window or 4096,
                "attention_bias": False}
    if o.arch == "gemma3":
        return _gemma3_config(o)
    if o.arch in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_config(o)
    return {}


def _gemma3_config(o: MakeModelOptions) -> dict[str, Any]:
    """5 local : 1 global; local RoPE base 10,000 unscaled, global `rope_theta` + scaling.

    query_pre_attn_scalar is hidden / heads, Gemma-3-27B's rule (168 there, head_dim 128),
    so a checkpoint made with --head-dim tells a scale taken from head_dim apart.
    """
    return {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": o.hidden_size // o.num_heads, "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0, "sliding_window": o.sliding_window or 4096,
            "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "attention_bias": False}


def _deepseek_config(o: MakeModelOptions) -> dict[str, Any]:
    """Tiny MLA + MoE: latent 32, rope 8 / nope 16 / v 16 per head, 4 experts (top 2) + 1
    shared, layer 0 dense. V2 as DeepSeek-V2-Lite (no query LoRA, softmax greedy routing);
    V3 with query LoRA and sigmoid routing over 2 groups (1 kept), interleaved rope."""
    cfg = {"num_key_value_heads": o.num_heads, "head_dim": 8, "kv_lora_rank": 32,
           "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
           "moe_intermediate_size": 32, "first_k_dense_replace": 1, "attention_bias": False,
           "mlp_bias": False}
    if o.arch == "deepseek_v2":
        return {**cfg, "q_lora_rank": None, "topk_method": "greedy", "n_group": None,
                "topk_group": None, "routed_scaling_factor": 1.0, "norm_topk_prob": False}
    return {**cfg, "q_lora_rank": 48, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "rope_interleave": True}


def make_checkpoint(o: MakeModelOptions) -> Path:
    """Write the checkpoint (and tokenizer) into `o.out_dir`; returns the directory."""
    from ctxwarden.spec.model_spec import parse_model_config

    out = Path(o.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(o)
    spec = parse_model_config(config, source=str(out / "config.json"))  # our own check first
    _write_weights(spec, o.seed, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if o.with_tokenizer:
        write_tokenizer(out, o.vocab_size, o.max_position, o.corpus_dir)
    return out


def _write_weights(spec, seed: int, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from ctxwarden.models.registry import model_class

    gen = torch.Generator().manual_seed(seed)
    expected = model_class(spec, str(path)).expected_tensors(spec)
    tensors = {}
    for name, shape in expected.items():
        if name.endswith("norm.weight"):
            base = 0.0 if spec.model_type in ("gemma2", "gemma3_text") else 1.0
            tensors[name] = base + 0.05 * torch.randn(shape, generator=gen)
        else:
            tensors[name] = 0.02 * torch.randn(shape, generator=gen)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def write_tokenizer(out: Path, vocab_size: int, max_position: int, corpus_dir: Path | None) -> None:
    """Train a byte-level BPE on local text; save tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_training_text(corpus_dir), trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
              "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0], "unk_token": None,
              "model_max_length": max_position, "add_bos_token": False,
              "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _training_text(corpus_dir: Path | None) -> list[str]:
    """Lines of `corpus_dir`'s text files (when given), else of the text shipped with us."""
    if corpus_dir is None:
        with resources.files("ctxwarden.models").joinpath(_TRAINING_TEXT).open("rb") as f:
            return gzip.decompress(f.read()).decode("utf-8").splitlines(keepends=True)
    files = sorted(p for p in Path(corpus_dir).rglob("*") if p.suffix in (".txt", ".rst", ".md"))
    if not files:
        raise FileNotFoundError(f"--corpus {corpus_dir} holds no .txt, .rst or .md file to train on")
    share = _CORPUS_CHARS // len(files) + 1  # an even share of each file
    return [line for f in files for line in f.read_text(errors="replace")[:share].splitlines(keepends=True)]
