"""Tier keys: what a stored block's identity is made of (no torch).

    namespace = BLAKE2b(format version | weights fingerprint | tokenizer fingerprint |
                        activation dtype | KV dtype | layout | block size | RoPE settings)
    root      = kv.prefix.root_hash(tenant namespace, extra_keys=(namespace,))
    h[j]      = the prefix chain over full blocks (kv.prefix), exactly the pool's cache key
    object key   "cw<v>:<ns8>:o:<hex h[last block of the object]>"
    manifest key "cw<v>:<ns8>:m:<hex h[last block of the store]>:<hex of its Merkle root, 16 B>"

The namespace enters the root of every chain, so a different model, dtype, block size,
RoPE setting or tenant never even computes the same key; the value's header repeats the
root so that a value stored under the wrong key is caught on read as well.

Weights fingerprint: xxh3-128 over the *whole* content of every weight file (plus its
size and name), never a sample: a sample would let a model whose weights were perturbed
outside the sampled ranges hit another model's KV. xxh3 runs at about 7 GB/s on one core
here, so a 16 GB checkpoint costs about 2-3 s at start-up (bounded by the disk read when
the files are not in the page cache); a 135M-parameter GGUF about 20 ms. It is computed
only when a tier is configured.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import xxhash

from ctxwarden.kv.prefix import BlockHash

FORMAT_VERSION = 1
_READ_CHUNK_BYTES = 16 * 1024 * 1024


def fingerprint_files(paths: Iterable[Path]) -> str:
    """xxh3-128 over each file's name, size and full content, in the order given (hex)."""
    h = xxhash.xxh3_128()
    for path in paths:
        path = Path(path)
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class TierNamespace:
    """Everything that decides the bytes of a block's KV besides its tokens and its tenant."""

    weights_fingerprint: str
    tokenizer_fingerprint: str
    dtype: str  # activations: KV computed in bf16 differs from KV computed in fp32
    kv_dtype: str
    layout: str  # the KV layout's groups, layers, windows, page bytes (repr)
    block_size: int
    rope: str  # every RoPE field, params included (JSON)
    weights_mode: str = "fp32"  # how the weights are multiplied (auto keeps GGUF codes): changes the KV
    prompt_attention: str = "fp32"  # prompt rows' attention precision (ModelRunner.prompt_attention)
    format_version: int = FORMAT_VERSION

    @property
    def digest(self) -> bytes:
        """A 32-byte BLAKE2b digest of every field (the chain's extra key)."""
        fields = (self.format_version, self.weights_fingerprint, self.tokenizer_fingerprint,
                  self.dtype, self.kv_dtype, self.layout, self.block_size, self.rope, self.weights_mode,
                  self.prompt_attention)
        payload = json.dumps(fields, separators=(",", ":")).encode()
        return hashlib.blake2b(payload, digest_size=32, person=b"ctxwarden-ns").digest()

    @property
    def key_prefix(self) -> str:
        """`cw<version>:<first 8 hex of the digest>`: groups one model's keys (SCAN, DEL)."""
        return f"cw{self.format_version}:{self.digest.hex()[:8]}"


def rope_description(rope, rope_local) -> str:
    """The RoPE settings of a ModelSpec as canonical JSON (theta, type, partial, params)."""
    def one(r):
        if r is None:
            return None
        return {"theta": r.theta, "type": r.rope_type, "partial": r.partial_rotary_factor,
                "params": {k: r.params[k] for k in sorted(r.params)}}
    return json.dumps({"rope": one(rope), "local": one(rope_local)}, sort_keys=True, default=str)


def object_key(prefix: str, last_block_hash: BlockHash) -> str:
    """The key of the object whose last block has chain hash `last_block_hash`."""
    return f"{prefix}:o:{last_block_hash.hex()}"


def manifest_key(prefix: str, last_block_hash: BlockHash, store_root: bytes) -> str:
    """The key of the manifest committing a store that ends with `last_block_hash`.

    The store's Merkle root is part of the key: two stores of the same prefix whose bytes
    differ (another replica, another batch shape) each get their own commit record, so an
    old record can never block, or vouch for, a newer store's objects.
    """
    return f"{prefix}:m:{last_block_hash.hex()}:{store_root[:16].hex()}"
