"""Continuous batching with chunked prefill, fair tenants and preemption instead of OOM (no torch).

Algorithm of one `schedule()` call (vLLM v1's unified view: a request is just "tokens known"
vs "tokens computed", prefill and decode are the same thing at different sizes):

0. Running and waiting requests are ordered by (priority, tenant service, arrival): the
   least-served tenant first (start-time fair queuing, fairness.py).
1. Running requests, in that order: each gets min(known - computed, budget) new tokens; a
   prefill chunk of a tenant more served than one that is decoding is capped at about one
   decode step's worth of tokens. If the pool cannot slot them, the last running request
   (the most-served tenant's latest) is preempted (swap to host or recompute, chosen by
   cost) until it can; a request may end up preempting itself.
2. If nothing was preempted, waiting requests (new, recompute-preempted, swapped) are
   admitted in the same order while the token budget, `max_num_seqs` and the pool allow;
   a tenant at its own `max_running` is skipped. A new request first takes its cached
   prefix (salted by its namespace), then a chunk.
3. A scheduled request is *sampled* when its chunk reaches its last known token.

Invariant between steps: for every running request, the KV manager holds exactly
`num_computed_tokens` slotted tokens. Whether a request can *ever* fit was decided once at
`add` with the planner's `blocks_needed`; a request that can never fit is never queued,
and one predicted to wait past `max_queue_delay_s` is refused there with a retry time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ctxwarden.errors import (ContextLengthExceeded, KVCapacityExceeded, QueueDelayExceeded, QueueFull,
                              TenantLimitExceeded)
from ctxwarden.kv import AuditReport, BlockTables, EvictedBlock, KVCacheManager, KVStats
from ctxwarden.plan.kv import blocks_needed, max_sequence_tokens
from ctxwarden.request import FinishReason, Request, RequestStatus
from ctxwarden.scheduler.fairness import FairShare, StepRates
from ctxwarden.scheduler.policy import PreemptionCost, choose_preemption_mode
from ctxwarden.scheduler.tiering import TierFill, fetch_prefix

log = logging.getLogger("ctxwarden.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits. `max_waiting` bounds the queue (the server answers 429 past it)."""

    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    max_waiting: int | None = None
    preemption_mode: str = "auto"  # auto | recompute | swap
    swap_space_bytes: int = 4 * 1024**3
    max_model_len: int = 2048  # the model's context window: prompt + max_tokens must fit
    is_unbounded_length: bool = False  # sink mode streams past the window
    max_queue_delay_s: float | None = None  # refuse a request predicted to wait longer (429)
    contended_prefill_tokens: int | None = None  # None: one decode step's worth, measured

    def __post_init__(self):
        for name in ("max_num_seqs", "max_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"preemption_mode must be auto, recompute or swap, got {self.preemption_mode!r}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_queue_delay_s is not None and not self.max_queue_delay_s > 0:
            raise ValueError(f"max_queue_delay_s must be > 0, got {self.max_queue_delay_s}")
        if self.contended_prefill_tokens is not None and self.contended_prefill_tokens < 1:
            raise ValueError(f"contended_prefill_tokens must be >= 1, got {self.contended_prefill_tokens}")


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: `num_new_tokens` from `request.num_computed_tokens`.

    `block_tables` are the request's pages after slotting this chunk: what the runner
    reads and writes for it.
    """

    request: Request
    num_new_tokens: int
    is_sampled: bool
    block_tables: BlockTables
    is_decode: bool = False  # one token after the whole prompt: latency-bound work


@dataclass(frozen=True)
class Preemption:
    """A request pushed out of the pool this step, and the pages it held (swap copies them)."""

    request: Request
    mode: str  # "swap" | "recompute"
    block_tables: BlockTables


@dataclass(frozen=True)
class SwapIn:
    """A swapped request back in the pool: where its pages now live."""

    request: Request
    block_tables: BlockTables
    num_hit_blocks: int  # leading logical blocks served by the prefix cache: not rewritten


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's queues, its preemption counts and the KV manager's numbers."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    swapped_bytes: int
    kv: KVStats
    tiers: tuple = ()  # kv.tiers.TierStats per configured tier


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's decisions: the batch, who was preempted, swapped in or refused."""

    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Preemption, ...]
    swapped_in: tuple[SwapIn, ...]
    refused: tuple[Request, ...] = ()  # could not enter an empty pool: finished with ERROR
    filled: tuple[TierFill, ...] = ()  # tier pages to write before the forward, then cache
    spilled: tuple[EvictedBlock, ...] = ()  # pages evicted this step: read before any write

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting and running queues and every call into the KV manager."""

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, cost: PreemptionCost,
                 tiers=None, extra_keys: tuple[bytes, ...] = (), tier_fetch: str = "auto",
                 prompt_blocks_only: bool = False):
        self.kv = kv
        # Only blocks within a request's prompt are shared (looked up, cached, fetched): the
        # runner attends prompt rows at another precision than generated ones, so KV that a
        # token made as generated is not the KV it makes in a prompt (ModelRunner.prompt_rows_apart).
        self.prompt_blocks_only = prompt_blocks_only
        self.config = config
        self.cost = cost
        self.tiers = tiers  # kv.tiers.KVTiers, or None: prefixes live in the pool only
        self.extra_keys = extra_keys  # salts every chain (the tiers' model namespace)
        self.tier_fetch = tier_fetch  # auto (the cost model decides) | always
        self._fills: list[TierFill] = []
        self.waiting: list[Request] = []  # sorted by the fair key at each schedule()
        self.running: list[Request] = []
        self.fair = FairShare()
        self.rates = StepRates()
        self.swapped_bytes = 0
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self._num_known: dict[str, int] = {}  # tokens the KV manager knows, per request
        self._swap_tables: dict[str, BlockTables] = {}  # what swapped-out requests held

    # --- admission -------------------------------------------------------------------------

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise now if the request can never be served; the same arithmetic as the planner."""
        total = num_prompt_tokens + max_tokens
        if not self.config.is_unbounded_length and total > self.config.max_model_len:
            raise ContextLengthExceeded(self.config.max_model_len, num_prompt_tokens, max_tokens)
        needed = blocks_needed(total, self.kv.layout, self.config.max_batched_tokens)
        if needed > self.kv.pool.num_blocks:
            longest = max_sequence_tokens(self.kv.pool.num_blocks, self.kv.layout,
                                          self.config.max_batched_tokens)
            raise KVCapacityExceeded(needed, self.kv.pool.num_blocks, longest or total)

    def add(self, request: Request) -> None:
        """Queue a request after checking that it can ever fit and would not wait too long.

        Raises (queueing nothing) ContextLengthExceeded / KVCapacityExceeded (never fits),
        QueueFull, TenantLimitExceeded (its tenant's queue is full) or QueueDelayExceeded
        (the predicted time to first token is over `max_queue_delay_s`).
        """
        self.check_admissible(request.num_prompt_tokens, request.params.max_tokens)
        self._check_queue_room(request)
        self._check_queue_delay(request)
        request.status = RequestStatus.WAITING
        self.fair.activate(request.namespace)
        self.waiting.append(request)

    def _check_queue_room(self, request: Request) -> None:
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            head = min(self.waiting, key=self.fair.key)
            raise QueueFull(len(self.waiting), self.config.max_waiting,
                            self._seconds_for(head.num_tokens - head.num_computed_tokens))
        share = request.share
        if share.max_waiting is not None:
            mine = [r for r in self.waiting if r.namespace == request.namespace]
            if len(mine) >= share.max_waiting:
                raise TenantLimitExceeded(share.name, "queued requests", len(mine) + 1, share.max_waiting,
                                          self._seconds_for(mine[0].num_tokens - mine[0].num_computed_tokens))

    def _check_queue_delay(self, request: Request) -> None:
        limit, rate = self.config.max_queue_delay_s, self.rates.prefill_tokens_per_s
        if limit is None or rate is None:
            return  # off, or nothing measured yet: no prediction to refuse on
        ahead = self.fair.predicted_wait_tokens(request.namespace, request.share.weight,
                                                request.num_prompt_tokens, self._backlog())
        if ahead / rate > limit:
            raise QueueDelayExceeded(ahead / rate, limit, int(ahead), rate)

    def _backlog(self) -> dict[str, tuple[int, float]]:
        """Uncomputed prompt tokens per tenant (running prefills and waiting requests)."""
        out: dict[str, tuple[int, float]] = {}
        for r in self.running + self.waiting:
            todo = max(0, r.num_prompt_tokens - r.num_computed_tokens) if r.status is RequestStatus.RUNNING \
                else (0 if r.status is RequestStatus.SWAPPED else r.num_tokens - r.num_computed_tokens)
            out[r.namespace] = (out.get(r.namespace, (0, 0.0))[0] + todo, r.share.weight)
        return out

    def _seconds_for(self, num_tokens: int) -> float:
        rate = self.rates.prefill_tokens_per_s
        return max(1.0, num_tokens / rate) if rate else 1.0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch; every KV slot it needs is allocated on return."""
        self.running.sort(key=self.fair.key)
        self.waiting.sort(key=self.fair.key)
        budget = self._step_budget()
        scheduled: list[ScheduledSeq] = []
        preempted: list[Preemption] = []
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            req = self.running[i]
            n = budget.chunk(req, req.num_tokens - req.num_computed_tokens, self.fair)
            if n == 0:
                i += 1  # its prefill yields this step to a less-served tenant
            elif self._slot_running(req, n, preempted):
                scheduled.append(self._scheduled(req, n))
                budget.take(req, n, self.fair)
                i += 1
        swapped_in: list[SwapIn] = []
        refused: list[Request] = []
        if not preempted:
            self._admit_waiting(budget, scheduled, swapped_in, refused)
        filled, self._fills = tuple(self._fills), []
        return SchedulerOutput(tuple(scheduled), tuple(preempted), tuple(swapped_in), tuple(refused),
                               filled, tuple(self.kv.drain_evicted()))

    def _step_budget(self) -> "_StepBudget":
        decoding = [r.namespace for r in self.running if _is_decoding(r)]
        contenders = set(decoding) | {r.namespace for r in self.waiting if not self._is_at_running_limit(r)}
        return _StepBudget(self.config.max_batched_tokens, self._contended_cap(len(decoding)), contenders)

    def _contended_cap(self, num_decode_seqs: int) -> int:
        """Prefill tokens that cost about one decode step of this batch (measured), or the
        fixed setting; before anything is measured, a sixteenth of the step budget."""
        if self.config.contended_prefill_tokens is not None:
            return self.config.contended_prefill_tokens
        step_s = self.rates.decode_step_s(num_decode_seqs)
        measured = self.rates.prefill_tokens_in(step_s) if step_s is not None else None
        return max(self.kv.block_size, measured if measured else self.config.max_batched_tokens // 16)

    def _slot_running(self, req: Request, n: int, preempted: list[Preemption]) -> bool:
        """Slot `n` tokens for a running request, preempting from the back until they fit."""
        while not self.kv.can_append(req.request_id, n):
            victim = self.running[-1]
            preempted.append(self._preempt(victim))
            if victim is req:
                return False
        known = self._num_known[req.request_id]
        self.kv.append(req.request_id, req.all_token_ids[known:], num_new_tokens=n)
        self._num_known[req.request_id] = req.num_tokens
        return True

    def _admit_waiting(self, budget: "_StepBudget", scheduled: list[ScheduledSeq], swapped_in: list[SwapIn],
                       refused: list[Request]) -> None:
        i = 0
        while i < len(self.waiting) and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            if self._is_at_running_limit(req):
                i += 1  # its tenant's own cap: it waits, nobody else is held up
                continue
            if req.status is RequestStatus.SWAPPED:
                admitted, n = self._swap_in(req, swapped_in), 0
            else:
                n = self._admit_new(req, budget)
                admitted = n is not None
            if n == 0 and req.status is RequestStatus.WAITING:
                i += 1  # no contended budget left for its prefill this step
                continue
            if not admitted:
                if self.running or scheduled:
                    break  # fair order: the head waits for blocks, nobody overtakes it
                # Nothing of ours holds a block, so the pool will never have more room:
                # waiting would hang forever. Admission arithmetic should make this
                # unreachable; if it is reached, end the request instead of hanging.
                self._refuse(req, refused)
                continue
            if n:
                scheduled.append(self._scheduled(req, n))
                budget.take(req, n, self.fair)

    def _scheduled(self, req: Request, n: int) -> ScheduledSeq:
        return ScheduledSeq(req, n, req.num_computed_tokens + n == req.num_tokens,
                            BlockTables.of(self.kv.block_tables(req.request_id)),
                            is_decode=n == 1 and _is_decoding(req))

    def _is_at_running_limit(self, req: Request) -> bool:
        limit = req.share.max_running
        return limit is not None and sum(r.namespace == req.namespace for r in self.running) >= limit

    def _refuse(self, req: Request, refused: list[Request]) -> None:
        log.error("request %s cannot enter an empty pool of %d blocks; ending it",
                  req.request_id, self.kv.pool.num_blocks)
        self.finish(req, FinishReason.ERROR)
        refused.append(req)

    def _shared_tokens(self, req: Request) -> int | None:
        """How many leading tokens of `req` may share cached blocks (None: all)."""
        return req.num_prompt_tokens if self.prompt_blocks_only else None

    def _chain_keys(self, req: Request) -> tuple[bytes, ...]:
        """What salts `req`'s prefix chain besides its namespace: the model's keys, then its own."""
        return self.extra_keys + req.cache_keys

    def _admit_new(self, req: Request, budget: "_StepBudget") -> int | None:
        """Allocate a waiting request's prefix hit, what the tiers supply after it, and its
        first chunk: its new tokens, 0 when the step has no contended budget left for it,
        None when the pool cannot hold it."""
        tokens, reads, keys = req.all_token_ids, req.reads_prefix_cache, self._chain_keys(req)
        shared = self._shared_tokens(req)
        hit = self.kv.find_prefix(tokens, req.namespace, keys, read_cache=reads, shared_tokens=shared)
        n = budget.chunk(req, len(tokens) - hit.num_computed_tokens, self.fair)
        if n == 0:
            return 0
        if not self.kv.can_allocate(tokens, req.namespace, keys, max_num_new_tokens=n, read_cache=reads,
                                    shared_tokens=shared):
            return None
        fetched = self._fetch_from_tiers(req, hit.num_computed_tokens // self.kv.block_size, n)
        num_fetched = fetched.num_blocks if fetched else 0
        n = min(len(tokens) - hit.num_computed_tokens - num_fetched * self.kv.block_size, n)
        alloc = self.kv.allocate(req.request_id, tokens, req.namespace, keys, max_num_new_tokens=n,
                                 read_cache=reads, num_fetched_blocks=num_fetched, shared_tokens=shared)
        if fetched:
            pages = self.kv.block_tables(req.request_id)[0][fetched.first_block:][:num_fetched]
            self._fills.append(TierFill(req, tuple(pages), fetched.first_block, fetched.pages))
        self._num_known[req.request_id] = len(tokens)
        if req.num_preemptions == 0:
            req.num_cached_tokens = alloc.num_computed_tokens
        req.num_computed_tokens = alloc.num_computed_tokens
        self._move_to_running(req)
        return alloc.num_new_tokens

    def _swap_in(self, req: Request, swapped_in: list[SwapIn]) -> bool:
        tokens, reads = req.all_token_ids[:req.num_computed_tokens], req.reads_prefix_cache
        keys, shared = self._chain_keys(req), self._shared_tokens(req)
        if not self.kv.can_allocate(tokens, req.namespace, keys, read_cache=reads, shared_tokens=shared):
            return False
        alloc = self.kv.allocate(req.request_id, tokens, req.namespace, keys, read_cache=reads,
                                 shared_tokens=shared)
        self._num_known[req.request_id] = len(tokens)
        self.swapped_bytes -= self._bytes_of(self._swap_tables.pop(req.request_id))
        self._move_to_running(req)
        hit_blocks = alloc.num_computed_tokens // self.kv.block_size
        swapped_in.append(SwapIn(req, BlockTables.of(self.kv.block_tables(req.request_id)), hit_blocks))
        return True

    def _move_to_running(self, req: Request) -> None:
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    # --- KV tiers ---------------------------------------------------------------------------

    def _fetch_from_tiers(self, req: Request, num_hit_blocks: int, max_chunk_tokens: int):
        """Verified tier pages after the pool's hit, if the cost model says they pay and the
        pool can hold them with a chunk of up to `max_chunk_tokens` (else None: the request
        computes, as without tiers)."""
        if self.tiers is None or not req.reads_prefix_cache:
            return None
        bs, tokens = self.kv.block_size, req.all_token_ids
        most = (len(tokens) - 1) // bs - num_hit_blocks
        shared = self._shared_tokens(req)
        if shared is not None:
            most = min(most, shared // bs - num_hit_blocks)
        if most < 1:
            return None
        n, keys = min(len(tokens) - (num_hit_blocks + most) * bs, max_chunk_tokens), self._chain_keys(req)
        if not self.kv.can_allocate(tokens, req.namespace, keys, max_num_new_tokens=n, num_fetched_blocks=most,
                                    shared_tokens=shared):
            return None  # under pool pressure: no room for fetched pages now
        return fetch_prefix(self.tiers, self.kv, req, num_hit_blocks, keys, most, self.tier_fetch)

    def reset_prefix_cache(self) -> tuple[int, SchedulerOutput]:
        """Evict the pool's unowned cached blocks: how many, and the spills to copy out now."""
        n = self.kv.reset_prefix_cache()
        return n, SchedulerOutput((), (), (), spilled=tuple(self.kv.drain_evicted()))

    def commit_fills(self, out: SchedulerOutput) -> None:
        """The engine wrote this step's tier pages into the pool: cache them now."""
        for fill in out.filled:
            if fill.request.status is RequestStatus.RUNNING:
                self.kv.commit_fetched(fill.request.request_id)

    # --- preemption and release -----------------------------------------------------------

    def _preempt(self, req: Request) -> Preemption:
        tables = BlockTables.of(self.kv.block_tables(req.request_id))
        mode = self._preemption_mode(req, tables)
        self.kv.free(req.request_id, req.num_computed_tokens)
        del self._num_known[req.request_id]
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions[mode] += 1
        if mode == "swap":
            req.status = RequestStatus.SWAPPED
            self._swap_tables[req.request_id] = tables
            self.swapped_bytes += self._bytes_of(tables)
        else:
            req.status = RequestStatus.WAITING
            req.num_computed_tokens = 0  # its full blocks stay cached: the recompute hits them
        self.waiting.append(req)
        log.info("preempted %s by %s: %d computed tokens, %d blocks freed (preemption #%d of it)",
                 req.request_id, mode, req.num_computed_tokens if mode == "swap" else 0,
                 tables.num_held_blocks, req.num_preemptions)
        return Preemption(req, mode, tables)

    def _preemption_mode(self, req: Request, tables: BlockTables) -> str:
        if any(g.window_tokens is not None for g in self.kv.layout.groups):
            # A swap-in re-slots every computed token at once, which a rolling window never
            # holds; recompute re-enters chunk by chunk, releasing blocks as it goes.
            return "recompute"
        if self.config.preemption_mode != "auto":
            mode = self.config.preemption_mode
        else:
            mode = choose_preemption_mode(self.cost, req.num_computed_tokens)
        if mode == "swap" and self.swapped_bytes + self._bytes_of(tables) > self.config.swap_space_bytes:
            mode = "recompute"  # no host room left: recompute never needs any
        return mode

    def _bytes_of(self, tables: BlockTables) -> int:
        return tables.num_held_blocks * self.kv.layout.page_bytes

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request and release everything it holds, now (finish, stop, abort, error)."""
        if req.status is RequestStatus.RUNNING:
            # only computed tokens' blocks may stay in the prefix cache: after a failed step
            # the slots of this step's chunk hold nothing
            self.kv.free(req.request_id, req.num_computed_tokens)
            del self._num_known[req.request_id]
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.SWAPPED):
            self.waiting.remove(req)
            tables = self._swap_tables.pop(req.request_id, None)
            if tables is not None:
                self.swapped_bytes -= self._bytes_of(tables)
        if req.status is not RequestStatus.FINISHED:
            self.fair.deactivate(req.namespace)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def after_step(self, done: ScheduledSeq) -> None:
        """Record that a scheduled chunk's KV is now computed (and charge its tenant)."""
        done.request.num_computed_tokens += done.num_new_tokens
        self.fair.charge(done.request.namespace, done.num_new_tokens, done.request.share.weight)

    def observe_step(self, work: SchedulerOutput, elapsed_s: float) -> None:
        """Fold a finished step's time into the measured rates (fair caps, admission)."""
        num_decode = sum(s.is_decode for s in work.scheduled)
        self.rates.observe(work.num_batched_tokens - num_decode, num_decode, elapsed_s)

    # --- what the engine reads --------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        """Queues, preemptions and the KV manager's numbers (its audit not run: O(blocks))."""
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=sum(r.status is RequestStatus.WAITING for r in self.waiting),
            num_swapped=sum(r.status is RequestStatus.SWAPPED for r in self.waiting),
            num_preemptions_swap=self.num_preemptions["swap"],
            num_preemptions_recompute=self.num_preemptions["recompute"],
            swapped_bytes=self.swapped_bytes, kv=self.kv.stats(run_audit_check=False),
            tiers=self.tiers.stats() if self.tiers is not None else ())

    def audit(self) -> AuditReport:
        """Recount the pool with the running requests as the only live owners."""
        return self.kv.audit(live_seq_ids=[r.request_id for r in self.running])


def _is_decoding(req: Request) -> bool:
    """Whether a request's prompt (and any recomputed output) is computed: it decodes."""
    return req.num_computed_tokens >= req.num_tokens - 1 and req.num_computed_tokens >= req.num_prompt_tokens


class _StepBudget:
    """Tokens left in one step, and how many of them contended prefill may still take.

    A prefill chunk is contended when a less-served tenant than its own has a request
    decoding or waiting this step; all contended chunks of a step share one cap.
    """

    def __init__(self, tokens: int, contended_tokens: int, contenders: set[str]):
        self.tokens, self.contended_tokens, self.contenders = tokens, contended_tokens, contenders

    def chunk(self, req: Request, num_todo: int, fair: FairShare) -> int:
        """The tokens `req` may take now (0: none this step)."""
        n = min(num_todo, self.tokens)
        if n > 1 and fair.is_contended(req.namespace, self.contenders):
            n = min(n, self.contended_tokens)
        return n

    def take(self, req: Request, n: int, fair: FairShare) -> None:
        """Spend `n` tokens on `req`."""
        self.tokens -= n
        if n > 1 and fair.is_contended(req.namespace, self.contenders):
            self.contended_tokens -= n
