"""Which replica should serve a request: the one most likely to hold its prefix, within a load bound.

    key      = a BLAKE2b chain (as kv.prefix chains blocks) over the prompt's first `num_blocks`
               blocks of `block_bytes` UTF-8 bytes, salted by the tenant (its API key's
               digest), so two tenants' identical prompts are routed independently
    ranking  = rendezvous (highest random weight) hashing: replicas ordered by
               BLAKE2b(key | replica); adding or removing a replica moves only its share
    bound    = the first replica in that order whose in-flight count is below
               max(min_in_flight, ceil(load_factor x (in-flight + 1) / healthy replicas)):
               one hot prefix spills to its second-ranked replica instead of flooding one
               (the floor keeps affinity at low load: a replica batches several requests)

The router has no tokenizer, so it chains over bytes of text, not over token ids: equal
prompt prefixes still get equal keys, which is all routing needs.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ctxwarden.kv.prefix import BlockHash, root_hash


@dataclass(frozen=True)
class AffinityConfig:
    """How much of a prompt names its prefix, and how far load may skew."""

    block_bytes: int = 256
    num_blocks: int = 4  # the first 1 KiB of the prompt picks the replica
    load_factor: float = 1.25
    min_in_flight: int = 4  # below this a replica is never "full"

    def __post_init__(self):
        if self.block_bytes < 1 or self.num_blocks < 1:
            raise ValueError(f"block_bytes and num_blocks must be >= 1, got {self.block_bytes}, {self.num_blocks}")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1.0 (1.0 = perfectly even), got {self.load_factor}")


def prompt_bytes(body: Mapping) -> bytes:
    """The bytes a request's prefix is read from: chat messages in order, or the prompt."""
    if "messages" in body:
        parts = [f"{m.get('role', '')}\0{_content(m.get('content'))}\0" for m in body.get("messages") or ()]
        return "".join(parts).encode()
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of prompts: the first picks the replica
    if isinstance(prompt, list):
        return json.dumps(prompt[: 4096]).encode()
    return str(prompt).encode()


def _content(content) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def prefix_key(data: bytes, tenant_salt: str, config: AffinityConfig) -> BlockHash:
    """The chain hash after the first full blocks of `data` (the root alone if none is full)."""
    h = root_hash("route:" + tenant_salt)
    bs = config.block_bytes
    num_full = min(config.num_blocks, len(data) // bs)
    for j in range(num_full):
        h = hashlib.blake2b(h + data[j * bs:(j + 1) * bs], digest_size=32).digest()
    if num_full == 0:
        h = hashlib.blake2b(h + data, digest_size=32).digest()  # a short prompt: all of it
    return h


def tenant_salt(authorization: str | None) -> str:
    """A digest of the Authorization header: the tenant, without keeping the key."""
    return hashlib.blake2b((authorization or "").encode(), digest_size=16).hexdigest()


def rank(key: BlockHash, replicas: Sequence[str]) -> list[str]:
    """Replicas in rendezvous order for `key` (highest weight first)."""
    return sorted(replicas, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest(), reverse=True)


def choose(key: BlockHash, in_flight: Mapping[str, int], config: AffinityConfig) -> list[str]:
    """Healthy replicas (the keys of `in_flight`) in the order to try: the first within the
    load bound, then the rest in rendezvous order (fallbacks when one fails)."""
    ranked = rank(key, list(in_flight))
    if not ranked:
        return []
    bound = max(config.min_in_flight, math.ceil(config.load_factor * (sum(in_flight.values()) + 1) / len(ranked)))
    first = next((r for r in ranked if in_flight[r] < bound), ranked[0])
    return [first] + [r for r in ranked if r != first]
