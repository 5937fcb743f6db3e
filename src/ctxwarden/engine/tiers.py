"""Moving KV pages between the torch pool and the tiers' bytes (the scheduler decides what).

Once per step, around the forward pass:

    before:  spilled pages (evicted this step) -> bytes -> RAM tier      (read before any write)
             tier fills (verified bytes)       -> pool pages -> then cached by the scheduler
    after:   a request whose prompt is now computed, or that finished  -> its new full blocks
             -> bytes -> disk and Redis writers (asynchronous, droppable)

Also here: the namespace fingerprint of a loaded model (weights, tokenizer, dtypes, layout,
RoPE) and the start-up calibration of the prefill rate the cost model uses.
"""

from __future__ import annotations

import logging
import time

from ctxwarden.kv.prefix import extend_chain, root_hash
from ctxwarden.kv.tiers import (KVTiers, PageFormat, SpilledPage, StoreJob, TierNamespace,
                                TiersConfig, fingerprint_files)
from ctxwarden.kv.tiers.keys import rope_description
from ctxwarden.runner.inputs import ForwardBatch, SequenceInput
from ctxwarden.runner.kv_cache import PagedKVCache
from ctxwarden.scheduler import ScheduledSeq, SchedulerOutput
from ctxwarden.spec.checkpoint import Checkpoint

log = logging.getLogger("ctxwarden.engine.tiers")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tier_namespace(checkpoint: Checkpoint, dtype: str, kv_dtype: str, layout, block_size: int,
                   weights_mode: str, prompt_attention: str = "fp32") -> TierNamespace:
    """What decides a block's bytes besides its tokens: hashed weights and tokenizer, dtypes,
    the weights mode, the prompt rows' attention precision, layout, block size and RoPE.
    Costs one read of the weight files (xxh3, see kv.tiers.keys)."""
    started = time.perf_counter()
    weights = fingerprint_files(checkpoint.weight_files) if checkpoint.weight_files else "no-weights"
    tok_files = [checkpoint.model_dir / n for n in _TOKENIZER_FILES if (checkpoint.model_dir / n).is_file()]
    tokenizer = fingerprint_files(tok_files) if checkpoint.format != "gguf" and tok_files else "in-weights-file"
    spec = checkpoint.spec
    ns = TierNamespace(weights, tokenizer, dtype, kv_dtype, repr(layout), block_size,
                       rope_description(spec.rope, spec.rope_local), weights_mode, prompt_attention)
    log.info("kv tiers: namespace %s (weights hashed in %.2f s)", ns.key_prefix, time.perf_counter() - started)
    return ns


def open_tiers(config: TiersConfig, namespace: TierNamespace, cache: PagedKVCache, kv_dtype: str) -> KVTiers:
    """The tier client for one engine's pool (full-attention layouts only)."""
    if any(g.window_tokens is not None for g in cache.layout.groups) or cache.layout.num_groups != 1:
        raise ValueError("kv_tiers needs a model whose layers all use full attention (one KV "
                         "group); this layout has sliding-window groups: drop --kv-tiers")
    page = PageFormat(kv_dtype, cache.page_shape, cache.layout.page_bytes)
    return KVTiers(config, namespace, page, cache.block_size)


def calibrate_prefill(runner, tiers: KVTiers, num_tokens: int) -> None:
    """Time one real prefill of `num_tokens` on free pages (the pool is empty at start-up).

    The first forward pays one-off costs (weight reorders, first touch), so the second is
    the one measured. Real prefill steps then keep the rate current.
    """
    bs = runner.layout.block_size
    pages = tuple(range(-(-num_tokens // bs)))
    tokens = [i % runner.spec.vocab_size for i in range(num_tokens)]
    batch = ForwardBatch((SequenceInput.chunk(tokens, 0, (pages,), "last"),))
    runner.forward(batch)
    started = time.perf_counter()
    runner.forward(batch)
    elapsed = time.perf_counter() - started
    tiers.cost.calibrate_prefill(num_tokens, elapsed)
    log.info("kv tiers: prefill calibrated at %.0f tokens/s (%d tokens)", num_tokens / elapsed, num_tokens)


class TierMover:
    """Copies pages between the pool and the tiers, and tracks what each request has stored."""

    def __init__(self, cache: PagedKVCache, tiers: KVTiers, extra_keys: tuple[bytes, ...]):
        self.cache, self.tiers, self.extra_keys = cache, tiers, extra_keys
        self.block_size = cache.block_size
        self._stored_blocks: dict[str, int] = {}  # request -> leading blocks already handed to writers
        self._writes_through = any(t.writer is not None for t in tiers.tiers)

    def before_forward(self, out: SchedulerOutput) -> None:
        """Spill this step's evicted pages (before anything writes a page); write tier fills."""
        if out.spilled:
            self._spill(out)
        for fill in out.filled:
            self.cache.write_pages(fill.page_ids, fill.pages)

    def _spill(self, out: SchedulerOutput) -> None:
        rows = self.cache.read_pages([e.page_id for e in out.spilled])
        self.tiers.spill([SpilledPage(e.root, e.block_index, e.block_hash, e.parent_hash, e.token_ids, rows[i])
                          for i, e in enumerate(out.spilled)])

    def after_forward(self, scheduled: tuple[ScheduledSeq, ...]) -> None:
        """Store the new full blocks of requests whose prompt just finished, or that ended."""
        if not self._writes_through:
            return
        for s in scheduled:
            req = s.request
            rid = req.request_id
            if rid not in self._stored_blocks:
                self._stored_blocks[rid] = req.num_cached_tokens // self.block_size
            prompt_done = s.is_sampled and len(req.output_token_ids) <= 1
            if prompt_done or req.is_finished:
                self._store(s)
            if req.is_finished:
                del self._stored_blocks[rid]

    def _store(self, s: ScheduledSeq) -> None:
        req, bs = s.request, self.block_size
        end = req.num_computed_tokens // bs
        first = self._aligned(self._stored_blocks[req.request_id])
        if end <= first:
            return
        tokens = tuple(req.all_token_ids[:end * bs])
        root = root_hash(req.namespace, self.extra_keys + req.cache_keys)
        chain: list[bytes] = []
        extend_chain(chain, root, tokens, bs, end)
        rows = self.cache.read_pages(s.block_tables.groups[0][first:end])
        self.tiers.store(StoreJob(root, tuple(chain), tokens, first, tuple(rows)))
        self._stored_blocks[req.request_id] = end

    def _aligned(self, num_blocks: int) -> int:
        """The first block to copy so that every writer can start an aligned object."""
        groups = [t.blocks_per_object for t in self.tiers.tiers if t.writer is not None]
        return min((num_blocks // g) * g for g in groups)

    def forget(self, request_id: str) -> None:
        """Drop a request's store mark (it ended without a final step)."""
        self._stored_blocks.pop(request_id, None)
