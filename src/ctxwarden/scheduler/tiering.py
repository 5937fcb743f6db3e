"""Fetch or recompute a new request's prefix from the KV tiers (no torch).

Called by the scheduler when it admits a request whose prefix the pool holds only in part:

    blocks [hit, end) are wanted (end stops before the last prompt token: it is computed)
    -> too short to pay for even one round trip?            skipped, nothing looked up
    -> lookup: RAM, then disk, then Redis continue the prefix, each from where the last stopped
    -> per run, the cost model: fetch (with a deadline at the break-even point) or skip
    -> fetched pages are verified bytes; the scheduler allocates pages for them, the engine
       writes them into the pool, and only then are they cached (KVCacheManager.commit_fetched)

Every decision is counted per tier (fetch / skipped / recompute) and logged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from ctxwarden.kv import KVCacheManager
from ctxwarden.kv.tiers import Decision, Expected, KVTiers
from ctxwarden.request import Request

log = logging.getLogger("ctxwarden.scheduler.tiers")
ALWAYS_DEADLINE_S = 30.0  # policy "always": only the tiers' own socket timeouts cut a fetch short


@dataclass(frozen=True)
class FetchedPrefix:
    """Verified pages of blocks [first_block, first_block + len(pages)) of a prompt."""

    first_block: int
    pages: tuple[memoryview, ...]
    sources: tuple[tuple[str, int], ...]  # (tier, blocks it supplied), in block order

    @property
    def num_blocks(self) -> int:
        return len(self.pages)


@dataclass(frozen=True)
class TierFill:
    """Pages a tier supplied for a request this step: the engine writes them, then they are cached."""

    request: Request
    page_ids: tuple[int, ...]  # the pool pages of blocks first_block .. first_block + n - 1
    first_block: int
    pages: tuple[memoryview, ...]


def num_wanted_blocks(req: Request, num_hit_blocks: int, block_size: int) -> int:
    """Full prompt blocks after the pool's hit that a tier could supply (last token excluded)."""
    return max(0, (len(req.all_token_ids) - 1) // block_size - num_hit_blocks)


def fetch_prefix(tiers: KVTiers, kv: KVCacheManager, req: Request, num_hit_blocks: int,
                 extra_keys: Sequence[bytes], max_blocks: int, policy: str = "auto") -> FetchedPrefix | None:
    """Fetch up to `max_blocks` blocks after the pool's hit, where the cost model says it pays
    (policy "auto"), or wherever a tier holds them ("always": no skip, no break-even deadline)."""
    bs = kv.block_size
    end = num_hit_blocks + min(max_blocks, num_wanted_blocks(req, num_hit_blocks, bs))
    if end <= num_hit_blocks or (policy == "auto" and _too_short(tiers, (end - num_hit_blocks) * bs, req)):
        return None
    tokens = req.all_token_ids
    exp = Expected(kv.root(req.namespace, extra_keys), kv.block_hashes(tokens, req.namespace, extra_keys),
                   tokens, bs, tiers.page)
    pages, sources, at = [], [], num_hit_blocks
    for run in tiers.lookup(exp, num_hit_blocks, end):
        if run.first_block != at:
            break
        d = tiers.cost.decide(run.tier, run.num_blocks * bs, run.num_blocks * tiers.page.page_bytes,
                              1 + len(run.objects) // tiers.tier(run.tier).spec.batch_objects)
        if policy == "always":
            d = Decision(d.tier, "fetch", d.fetch_s, max(d.recompute_s, ALWAYS_DEADLINE_S))
        tiers.count_decision(run.tier, d.action)
        if not d.is_fetch:
            log.info("%s: %d blocks in %s skipped: fetch %.4f s >= recompute %.4f s", req.request_id,
                     run.num_blocks, run.tier, d.fetch_s, d.recompute_s)
            break
        if d.is_probe:
            log.info("%s: probing %s (estimate %.4f s is stale; recompute %.4f s)", req.request_id, run.tier,
                     d.fetch_s, d.recompute_s)
        result = tiers.fetch(run, exp, time.monotonic() + d.recompute_s)
        pages.extend(result.pages)
        sources.append((run.tier, result.num_blocks))
        at += result.num_blocks
        if result.shortfall:
            break
    return FetchedPrefix(num_hit_blocks, tuple(pages), tuple(sources)) if pages else None


def _too_short(tiers: KVTiers, num_tokens: int, req: Request) -> bool:
    """Whether recomputing `num_tokens` is cheaper than one round trip to the fastest tier."""
    recompute = tiers.cost.recompute_s(num_tokens)
    if recompute > min(tiers.cost.latency_s(t.name) for t in tiers.tiers):
        return False
    for t in tiers.tiers:
        tiers.count_decision(t.name, "skipped")
    log.debug("%s: %d tokens recompute in %.5f s; not worth a lookup", req.request_id, num_tokens, recompute)
    return True
