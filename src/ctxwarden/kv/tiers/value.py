"""Self-verifying values: objects (a run of KV blocks) and manifests (a store's commit record).

Every value starts with the same frame; the header is checksummed on its own, each block's
bytes have their own checksum, so any bit flip, truncation or stray value is caught:

    b"CWKV" | u16 format version | u8 kind (1 object, 2 manifest) | u8 0 | u32 header bytes
    | header | xxh3-128(frame + header) | payload

    object header    root (namespace + tenant) 32 | own key 32 (chain hash of its last block)
                     | parent key 32 | store root 32 (Merkle root of the store it belongs to)
                     | manifest key 32 | u32 first block | u32 num blocks | u32 block size
                     | u64 page bytes | dtype 8 | u8 ndim + u32 dims (page shape)
                     | token ids (int64 LE, num blocks x block size) | xxh3-128 per block
    object payload   num blocks x page bytes (the pages, in block order)

    manifest header  root 32 | own key 32 | store root 32 (Merkle root of the block digests)
                     | u32 first block | u32 num blocks | u32 num objects
                     | per object: own key 32, u32 first block, u32 num blocks
                     | xxh3-128 per block

A reader states what it expects (`Expected`: the root, the chain hashes and token ids of
the blocks, the page format); anything else raises IntegrityError with a reason, which
the caller counts, deletes and treats as a miss. Checksums are for corruption, not for an
attacker who can write to the store: keys and the tenant salt are BLAKE2b, the per-block
sums xxh3 (about 7 GB/s, so checking costs a few percent of a fetch).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

import xxhash

from ctxwarden.kv.prefix import BlockHash, token_bytes

MAGIC = b"CWKV"
VERSION = 1
KIND_OBJECT, KIND_MANIFEST = 1, 2
SUM_BYTES = 16
NO_KEY = bytes(32)
_FRAME = struct.Struct("<4sHBBI")
_OBJECT_FIXED = struct.Struct("<32s32s32s32s32sIIIQ8sB")
_MANIFEST_FIXED = struct.Struct("<32s32s32sIII")
_ENTRY = struct.Struct("<32sII")
INTEGRITY_REASONS = ("truncated", "format", "checksum", "namespace", "key", "parent", "tokens",
                     "shape", "manifest")


class IntegrityError(ValueError):
    """A stored value failed verification; `reason` is one of INTEGRITY_REASONS."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


@dataclass(frozen=True)
class PageFormat:
    """What one page's bytes are: dtype name, shape, byte count."""

    dtype: str
    shape: tuple[int, ...]
    page_bytes: int


@dataclass(frozen=True)
class ObjectHeader:
    """The decoded header of an object (its pages not yet checked)."""

    root: bytes
    own_key: BlockHash
    parent_key: BlockHash
    store_root: bytes
    manifest_key: BlockHash
    first_block: int
    num_blocks: int
    block_sums: tuple[bytes, ...]


@dataclass(frozen=True)
class Manifest:
    """A store's commit record: its objects and the digest of every block it wrote."""

    root: bytes
    own_key: BlockHash
    store_root: bytes
    first_block: int
    objects: tuple[tuple[BlockHash, int, int], ...]  # (own key, first block, num blocks)
    block_sums: tuple[bytes, ...]


@dataclass(frozen=True)
class Expected:
    """What a reader knows the blocks [first_block, first_block + n) must be."""

    root: bytes
    chain: Sequence[BlockHash]  # the prompt's chain hashes, indexed by block
    token_ids: Sequence[int]  # the prompt's tokens
    block_size: int
    page: PageFormat

    def parent(self, block: int) -> BlockHash:
        """The chain hash before `block` (the root for block 0)."""
        return self.root if block == 0 else self.chain[block - 1]


def block_sum(page: bytes | memoryview) -> bytes:
    """The checksum of one page's bytes (xxh3-128)."""
    return xxhash.xxh3_128_digest(page)


def merkle_root(sums: Sequence[bytes]) -> bytes:
    """A binary BLAKE2b tree over block checksums (an odd node is carried up as it is)."""
    level = [hashlib.blake2b(b"leaf" + s, digest_size=32).digest() for s in sums] or [NO_KEY]
    while len(level) > 1:
        pairs = [level[i:i + 2] for i in range(0, len(level), 2)]
        level = [hashlib.blake2b(b"node" + p[0] + p[1], digest_size=32).digest() if len(p) == 2 else p[0]
                 for p in pairs]
    return level[0]


def _frame(kind: int, header: bytes) -> bytes:
    head = _FRAME.pack(MAGIC, VERSION, kind, 0, len(header)) + header
    return head + xxhash.xxh3_128_digest(head)


def encode_object(h: ObjectHeader, block_size: int, page: PageFormat, token_ids: Sequence[int],
                  pages: Sequence[bytes | memoryview]) -> bytes:
    """One object: header + every page; `token_ids` are the object's blocks' tokens."""
    if len(pages) != h.num_blocks or len(token_ids) != h.num_blocks * block_size:
        raise ValueError(f"an object of {h.num_blocks} blocks needs as many pages and "
                         f"{h.num_blocks * block_size} token ids, got {len(pages)} and {len(token_ids)}")
    fixed = _OBJECT_FIXED.pack(h.root, h.own_key, h.parent_key, h.store_root, h.manifest_key,
                               h.first_block, h.num_blocks, block_size, page.page_bytes,
                               page.dtype.encode().ljust(8, b"\0"), len(page.shape))
    dims = struct.pack(f"<{len(page.shape)}I", *page.shape)
    header = fixed + dims + token_bytes(token_ids) + b"".join(h.block_sums)
    return b"".join([_frame(KIND_OBJECT, header), *pages])


def encode_manifest(m: Manifest) -> bytes:
    """One manifest (no payload)."""
    fixed = _MANIFEST_FIXED.pack(m.root, m.own_key, m.store_root, m.first_block,
                                 len(m.block_sums), len(m.objects))
    entries = b"".join(_ENTRY.pack(*o) for o in m.objects)
    return _frame(KIND_MANIFEST, fixed + entries + b"".join(m.block_sums))


def _open_frame(data: bytes | memoryview, kind: int) -> tuple[memoryview, int]:
    """(header view, payload offset), after checking magic, version, kind and the checksum."""
    view = memoryview(data)
    if len(view) < _FRAME.size + SUM_BYTES:
        raise IntegrityError("truncated", f"{len(view)} bytes is shorter than a frame")
    magic, version, got_kind, _, header_len = _FRAME.unpack_from(view)
    if magic != MAGIC or version != VERSION or got_kind != kind:
        raise IntegrityError("format", f"magic {magic!r}, version {version}, kind {got_kind}; "
                             f"expected {MAGIC!r}, {VERSION}, {kind}")
    end = _FRAME.size + header_len
    if len(view) < end + SUM_BYTES:
        raise IntegrityError("truncated", f"{len(view)} bytes, the header alone needs {end + SUM_BYTES}")
    if xxhash.xxh3_128_digest(view[:end]) != view[end:end + SUM_BYTES]:
        raise IntegrityError("checksum", "the header checksum does not match")
    return view[_FRAME.size:end], end + SUM_BYTES


def decode_object(data: bytes | memoryview, exp: Expected, first_block: int,
                  num_blocks: int) -> tuple[ObjectHeader, list[memoryview]]:
    """Verify an object against what the reader expects; its pages, one view per block.

    Raises IntegrityError (reason in INTEGRITY_REASONS) on any mismatch.
    """
    header, offset = _open_frame(data, KIND_OBJECT)
    h, tokens = _read_object_header(header, exp)
    _check_identity(h, exp, first_block, num_blocks)
    bs = exp.block_size
    want = token_bytes(exp.token_ids[first_block * bs:(first_block + num_blocks) * bs])
    if tokens != want:
        raise IntegrityError("tokens", f"blocks {first_block}..{first_block + num_blocks - 1} hold other token ids")
    view, size = memoryview(data), exp.page.page_bytes
    if len(view) != offset + num_blocks * size:
        raise IntegrityError("truncated", f"{len(view)} bytes, expected {offset + num_blocks * size}")
    pages = [view[offset + i * size:offset + (i + 1) * size] for i in range(num_blocks)]
    for i, (p, s) in enumerate(zip(pages, h.block_sums)):
        if block_sum(p) != s:
            raise IntegrityError("checksum", f"block {first_block + i}'s bytes do not match its checksum")
    return h, pages


def _read_object_header(header: memoryview, exp: Expected) -> tuple[ObjectHeader, memoryview]:
    if len(header) < _OBJECT_FIXED.size:
        raise IntegrityError("truncated", "the object header is cut short")
    (root, own, parent, store_root, manifest, first, n, bs, page_bytes, dtype,
     ndim) = _OBJECT_FIXED.unpack_from(header)
    at = _OBJECT_FIXED.size
    shape = struct.unpack_from(f"<{ndim}I", header, at) if len(header) >= at + 4 * ndim else None
    at += 4 * ndim
    page = PageFormat(dtype.rstrip(b"\0").decode(errors="replace"), tuple(shape or ()), page_bytes)
    if bs != exp.block_size or page != exp.page:
        raise IntegrityError("shape", f"block size {bs}, page {page}; expected {exp.block_size}, {exp.page}")
    if len(header) != at + n * bs * 8 + n * SUM_BYTES:
        raise IntegrityError("truncated", "the object header's token ids or checksums are cut short")
    tokens = header[at:at + n * bs * 8]
    sums_at = at + n * bs * 8
    sums = tuple(bytes(header[sums_at + i * SUM_BYTES:sums_at + (i + 1) * SUM_BYTES]) for i in range(n))
    return ObjectHeader(root, own, parent, store_root, manifest, first, n, sums), tokens


def _check_identity(h: ObjectHeader, exp: Expected, first_block: int, num_blocks: int) -> None:
    if h.root != exp.root:
        raise IntegrityError("namespace", "the value belongs to another model, dtype, layout or tenant")
    last = first_block + num_blocks - 1
    if h.first_block != first_block or h.num_blocks != num_blocks or h.own_key != exp.chain[last]:
        raise IntegrityError("key", f"the value holds blocks {h.first_block}..{h.first_block + h.num_blocks - 1} "
                             f"of another chain, expected {first_block}..{last} of this one")
    if h.parent_key != exp.parent(first_block):
        raise IntegrityError("parent", f"block {first_block}'s parent key does not match")


def decode_manifest(data: bytes | memoryview, root: bytes, own_key: BlockHash) -> Manifest:
    """Verify a manifest (frame, checksum, identity, Merkle root) and return it."""
    header, offset = _open_frame(data, KIND_MANIFEST)
    if len(header) < _MANIFEST_FIXED.size or offset != len(memoryview(data)):
        raise IntegrityError("truncated", "the manifest is cut short or has trailing bytes")
    got_root, own, store_root, first, num_blocks, num_objects = _MANIFEST_FIXED.unpack_from(header)
    at = _MANIFEST_FIXED.size
    if len(header) != at + num_objects * _ENTRY.size + num_blocks * SUM_BYTES:
        raise IntegrityError("truncated", "the manifest's entries are cut short")
    objects = tuple(_ENTRY.unpack_from(header, at + i * _ENTRY.size) for i in range(num_objects))
    at += num_objects * _ENTRY.size
    sums = tuple(bytes(header[at + i * SUM_BYTES:at + (i + 1) * SUM_BYTES]) for i in range(num_blocks))
    if got_root != root:
        raise IntegrityError("namespace", "the manifest belongs to another model or tenant")
    if own != own_key:
        raise IntegrityError("key", "the manifest commits another store")
    if merkle_root(sums) != store_root:
        raise IntegrityError("manifest", "the block digests do not hash to the manifest's Merkle root")
    return Manifest(got_root, own, store_root, first, objects, sums)
