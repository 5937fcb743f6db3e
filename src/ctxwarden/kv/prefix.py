"""Prefix-cache hashes: a salted hash chain over full blocks of token ids.

    root  = H("ctxwarden/kv/prefix/v1" | namespace | extra keys)      (never a block)
    h[0]  = H(root | tokens[0:bs])
    h[j]  = H(h[j-1] | tokens[j*bs:(j+1)*bs])

A block's hash names its whole prefix, not just its own tokens: two prompts share block j
only if they agree on every token up to the end of block j. The namespace (the tenant) and
the extra keys (adapter, model revision, ...) enter the root, so every block of the chain
inherits them: a lookup in one namespace can only find blocks hashed in that namespace.

H is BLAKE2b with a 32-byte digest: a cryptographic hash, so nobody can craft a prompt
whose blocks collide with another tenant's (Python's hash() is seeded per process and
would also make keys unstable across processes, which the tiers need).
Every field is length-prefixed so that no two different inputs encode to the same bytes.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Sequence

BlockHash = bytes  # a 32-byte digest
DIGEST_BYTES = 32
_DOMAIN = b"ctxwarden/kv/prefix/v1"


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Little-endian int64s: the same bytes on every machine (a shared tier compares them)."""
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _encode_field(value: str | bytes | int) -> bytes:
    """Type tag + length + bytes: "1" and 1 and b"1" all encode differently."""
    if isinstance(value, bool) or not isinstance(value, (str, bytes, int)):
        raise TypeError(f"extra keys must be str, bytes or int, got {type(value).__name__}")
    if isinstance(value, int):
        tag, raw = b"i", str(value).encode()
    elif isinstance(value, str):
        tag, raw = b"s", value.encode()
    else:
        tag, raw = b"b", value
    return tag + len(raw).to_bytes(8, "little") + raw


def root_hash(namespace: str, extra_keys: Sequence[str | bytes | int] = ()) -> BlockHash:
    """The chain's salt: the parent hash of block 0 for this namespace and extra keys."""
    h = hashlib.blake2b(_DOMAIN, digest_size=DIGEST_BYTES)
    h.update(_encode_field(namespace))
    h.update(len(extra_keys).to_bytes(8, "little"))
    for key in extra_keys:
        h.update(_encode_field(key))
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block given its parent's hash (or the root for block 0)."""
    payload = parent + token_bytes(token_ids)
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest()


def extend_chain(chain: list[BlockHash], root: BlockHash, token_ids: Sequence[int],
                 block_size: int, num_full_blocks: int) -> None:
    """Append hashes to `chain` (in place) until it covers `num_full_blocks` blocks.

    `token_ids` must hold at least num_full_blocks * block_size tokens. Extending in place
    keeps appends O(new blocks): a decode step hashes one block every block_size tokens.
    """
    start = len(chain)
    if start >= num_full_blocks:
        return
    parent = chain[-1] if chain else root
    # Pack every new block's tokens in one C call, then hash slices of it: per block this
    # leaves one concatenation and one BLAKE2b call in the Python loop.
    data = memoryview(token_bytes(token_ids[start * block_size:num_full_blocks * block_size]))
    stride = 8 * block_size
    blake2b = hashlib.blake2b
    for off in range(0, len(data), stride):
        parent = blake2b(parent + data[off:off + stride], digest_size=DIGEST_BYTES).digest()
        chain.append(parent)
