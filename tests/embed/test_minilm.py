"""all-MiniLM-L6-v2 on our own stack: parity with sentence-transformers, locating and reading the wheel."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ctxwarden.embed.locate import MINILM_ZIP, find_minilm_zip, minilm_zip_path, read_minilm_files
from ctxwarden.embed.minilm import MiniLMEncoder
from ctxwarden.errors import ConfigError, ModelNotFound

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
CORPORA = (SHARED if SHARED.is_dir() else Path("/work/shared")) / "corpora"


@pytest.fixture(scope="module")
def files():
    return read_minilm_files()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Prose, code, headings, mixed scripts, an empty string and a text past the 256-piece cut."""
    emma = (CORPORA / "austen" / "emma.txt").read_text()[20_000:26_000]
    docs = (CORPORA / "python-docs.rst").read_text()[50_000:53_000]
    pieces = [p.strip() for p in (emma + "\n\n" + docs).split("\n\n") if p.strip()][:40]
    return pieces + ["", "Which digits unlock it?", "日本語の文章です。👨‍👩‍👧 🇫🇷 Ünïcödé", "word " * 600,
                     "def f(x):\n    return x ** 2  # square"]


@pytest.fixture(scope="module")
def reference(files, texts, tmp_path_factory) -> np.ndarray:
    """sentence-transformers' embeddings of the same texts, from the same files (extracted for it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: nothing to fetch, make sure of it
    from sentence_transformers import SentenceTransformer

    model_dir = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(files.source) as z:
        z.extractall(model_dir)
    model = SentenceTransformer(str(model_dir), device="cpu")
    return model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)


@pytest.mark.parametrize("dtype,min_cosine", [("float32", 0.99999), ("auto", 0.999)])
def test_parity_with_sentence_transformers(files, texts, reference, dtype, min_cosine):
    ours = MiniLMEncoder(files, dtype=dtype).encode(texts)
    assert ours.shape == reference.shape == (len(texts), 384) and ours.dtype == np.float32
    cosines = (ours * reference).sum(axis=1)
    assert cosines.min() >= min_cosine, (dtype, cosines.min(), texts[int(cosines.argmin())][:80])
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_batching_does_not_change_embeddings(files, texts):
    """Padding and the attention mask: a text embedded in a batch equals it embedded alone."""
    enc = MiniLMEncoder(files, batch_tokens=512, dtype="float32")
    together = enc.encode(texts)
    alone = np.stack([enc.encode([t])[0] for t in texts])
    assert np.abs(together - alone).max() < 1e-5


def test_long_text_is_cut_at_max_seq_length(files):
    enc = MiniLMEncoder(files, dtype="float32")
    assert enc.max_seq_length == 256 and enc.count_word_pieces(["word " * 600]) == 256
    a, b = enc.encode(["word " * 600 + "tail", "word " * 254])  # both read as 254 x "word" + specials
    assert float(a @ b) > 0.99999


def test_meaning_not_words(files):
    """The point of the model: a paraphrase with no shared word is closer than an unrelated sentence."""
    q, para, other = MiniLMEncoder(files).encode([
        "How many tapers stay lit in the noblewoman's parlour each night?",
        "Lady Morland keeps eleven wax candles burning in the drawing room every evening.",
        "The committee approved the railway budget for the northern line."])
    assert float(q @ para) > float(q @ other) + 0.2


def test_locates_the_wheel_without_importing_it():
    import sys

    path = find_minilm_zip()
    assert path is not None and path.name == MINILM_ZIP and path == minilm_zip_path()
    assert "site-packages" in path.parts or "dist-packages" in path.parts
    assert "all_minilm_l6_v2" not in sys.modules  # its __init__ prints; we only read the zip


def _zip_with(tmp_path: Path, files, **overrides) -> Path:
    out = tmp_path / "model.zip"
    with zipfile.ZipFile(files.source) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            if name in overrides:
                if overrides[name] is not None:
                    dst.writestr(name, overrides[name])
            elif name != "model.safetensors":  # the weights are not needed to test the checks
                dst.writestr(name, src.read(name))
        dst.writestr("model.safetensors", b"")
    return out


def test_a_zip_missing_files_names_them(tmp_path, files):
    with pytest.raises(ModelNotFound, match="tokenizer.json"):
        read_minilm_files(_zip_with(tmp_path, files, **{"tokenizer.json": None}))


def test_unsupported_pooling_and_activation_are_named(tmp_path, files):
    cls_pooling = json.dumps({**files.pooling, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True})
    with pytest.raises(ConfigError, match="pooling_mode"):
        read_minilm_files(_zip_with(tmp_path, files, **{"1_Pooling/config.json": cls_pooling}))
    relu = json.dumps({**files.config, "hidden_act": "relu"})
    with pytest.raises(ConfigError, match="hidden_act"):
        read_minilm_files(_zip_with(tmp_path, files, **{"config.json": relu}))


def test_dtype_is_validated(files):
    with pytest.raises(ValueError, match="'auto', 'float32' or 'bfloat16'"):
        MiniLMEncoder(files, dtype="int8")
