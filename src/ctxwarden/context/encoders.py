"""Sentence encoders for the dense ranker: a registry by name, loaded on first use, with an LRU cache.

The context toolkit never imports torch. An encoder is named here by module and class
(`ENCODERS`) and imported with importlib only when a dense or hybrid ranking is asked for;
`is_encoder_available` answers "could it load?" without importing anything.

Every loaded encoder is wrapped in a `CachedEncoder`: embeddings are kept per segment, keyed
by a BLAKE2b hash of its text, least recently used first out, at most `max_entries` of them
(65,536 x 384 float32 = 96 MiB at most). Re-fitting the same document (a refit round, the
next turn of a chat, another question about the same file) encodes only what is new.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

DEFAULT_ENCODER = "all-MiniLM-L6-v2"
# name -> (module, class, the package whose files it needs); the module may import torch.
ENCODERS = {"all-MiniLM-L6-v2": ("ctxwarden.embed.minilm", "MiniLMEncoder", "all_minilm_l6_v2")}
DEFAULT_CACHE_ENTRIES = 65_536

_loaded: dict[str, "CachedEncoder"] = {}
_load_lock = threading.Lock()


class Encoder(Protocol):
    """What the dense ranker needs from a model: unit-length embeddings, one row per text."""

    name: str
    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [len(texts), dim], each row of norm 1 (so a dot product is a cosine)."""
        ...


@dataclass(frozen=True)
class CacheStats:
    """Embedding cache counters since the encoder was loaded."""

    hits: int
    misses: int
    entries: int
    max_entries: int


class CachedEncoder:
    """An encoder behind a bounded LRU cache of embeddings keyed by segment hash (thread-safe)."""

    def __init__(self, encoder: Encoder, max_entries: int = DEFAULT_CACHE_ENTRIES):
        if not isinstance(max_entries, int) or max_entries < 0:
            raise ValueError(f"max_entries must be a non-negative integer, got {max_entries!r}")
        self.encoder, self.max_entries = encoder, max_entries
        self.name, self.dim = encoder.name, encoder.dim
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of `texts` [len(texts), dim]; only texts not in the cache are encoded (once each)."""
        keys = [_key(t) for t in texts]
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        with self._lock:
            missing = self._fill_hits(keys, out)
        if missing:
            new = self.encoder.encode([texts[rows[0]] for rows in missing.values()])
            with self._lock:
                self._store(missing, new, out)
        return out

    def clear(self) -> None:
        """Forget every cached embedding (the counters stay)."""
        with self._lock:
            self._cache.clear()

    def stats(self) -> CacheStats:
        """Hits, misses and entries so far."""
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._cache), self.max_entries)

    def _fill_hits(self, keys: list[bytes], out: np.ndarray) -> dict[bytes, list[int]]:
        """Copy cached rows into out; return the missing keys with the rows that need them."""
        missing: dict[bytes, list[int]] = {}
        for row, key in enumerate(keys):
            vec = self._cache.get(key)
            if vec is None:
                missing.setdefault(key, []).append(row)
                continue
            self._cache.move_to_end(key)
            out[row] = vec
            self._hits += 1
        self._misses += sum(map(len, missing.values()))
        return missing

    def _store(self, missing: dict[bytes, list[int]], new: np.ndarray, out: np.ndarray) -> None:
        for (key, rows), vec in zip(missing.items(), new):
            out[rows] = vec
            if self.max_entries:
                self._cache[key] = vec.copy()
                self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)  # least recently used


def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _check_name(name: str) -> tuple[str, str, str]:
    if name not in ENCODERS:
        raise ValueError(f"unknown encoder {name!r}; known encoders: {', '.join(ENCODERS)}")
    return ENCODERS[name]


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None  # finds, does not import
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def is_encoder_available(name: str = DEFAULT_ENCODER) -> bool:
    """True when the encoder could load here: torch and the model's package are installed."""
    _, _, package = _check_name(name)
    return name in _loaded or (_has_module("torch") and _has_module(package))


def load_encoder(name: str = DEFAULT_ENCODER) -> CachedEncoder:
    """The named encoder, loaded once per process (about 1 s for MiniLM) and cached."""
    module, cls, _ = _check_name(name)
    with _load_lock:
        if name not in _loaded:
            _loaded[name] = CachedEncoder(getattr(importlib.import_module(module), cls)())
        return _loaded[name]
