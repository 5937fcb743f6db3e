"""The engine: one `step()` moves every request forward by one scheduled chunk.

    step = schedule (admit, chunk, preempt, fetch from tiers)      scheduler/
         -> spill evicted pages, move swapped pages, write fills   engine/tiers.py, swap.py
         -> run the model on the batch (paged KV)                   runner/
         -> logits -> prompt logprobs, tokens, text, stops          engine/outputs.py
         -> store newly computed blocks to the tiers (async)        engine/tiers.py
         -> emit StepOutputs

The engine talks to the KV pool only through the scheduler, and to logits only through
the output processor. Invariants: a request that can never fit is refused in
`add_request` (ContextLengthExceeded or KVCapacityExceeded), never queued; finish, stop,
abort, error and preemption release every block in the step they happen; when the engine
goes idle the block audit runs and any leak shows in `stats().leaked_blocks`, and the
freed heap of the steps' temporaries goes back to the kernel (engine/heap.py: RSS at rest
does not drift with the mix of step sizes seen, issue 17).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from ctxwarden.engine.config import EngineConfig
from ctxwarden.engine.heap import HeapTrimmer
from ctxwarden.engine.holders import KVHolders, kv_holders
from ctxwarden.engine.outputs import OutputProcessor, output_of
from ctxwarden.engine.swap import HostSwapSpace
from ctxwarden.engine.tiers import TierMover, calibrate_prefill, open_tiers, tier_namespace
from ctxwarden.errors import NoTokenizer
from ctxwarden.kv import AuditReport, KVCacheManager, KVStats
from ctxwarden.plan import kv_bytes_per_token, plan_memory
from ctxwarden.plan.checkpoint_plan import planned_weights
from ctxwarden.plan.params import count_parameters
from ctxwarden.request import FinishReason, Request, StepOutput, TenantShare
from ctxwarden.runner.attention_monitor import MAX_FINISHED_RECORDS, attach_monitor, is_sampled
from ctxwarden.runner.inputs import ForwardBatch
from ctxwarden.runner.model_runner import ModelRunner, RunnerConfig
from ctxwarden.sampling import SamplingParams
from ctxwarden.scheduler import PreemptionCost, ScheduledSeq, Scheduler, SchedulerConfig
from ctxwarden.spec.checkpoint import Checkpoint, resolve_checkpoint
from ctxwarden.spec.rope_scaling import ScaledWindow, apply_rope_scaling, scaled_window, trained_window

log = logging.getLogger("ctxwarden.engine")


@dataclass(frozen=True)
class EngineStats:
    """One look at the engine: queues, KV pool, preemptions, throughput."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_steps: int
    num_generated_tokens: int
    num_prompt_tokens_computed: int
    last_step_tokens_per_s: float
    kv: KVStats
    leaked_blocks: int  # from the last idle audit
    audit_findings: tuple = field(default=())
    tiers: tuple = field(default=())  # kv.tiers.TierStats per configured tier
    num_heap_trims: int = 0  # malloc_trim calls (engine.heap): at idle and every 30 s of load
    heap_released_bytes: int = 0  # RssAnon + swap those trims handed back to the kernel


class Engine:
    """Continuous-batching engine over a paged KV cache. Single-threaded: callers serialise."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.checkpoint, self.window = _scaled_checkpoint(resolve_checkpoint(config.model), config)
        self.spec = self.checkpoint.spec
        self.num_blocks = self._plan_num_blocks()
        self.runner = ModelRunner(self.checkpoint, RunnerConfig(
            num_blocks=self.num_blocks, block_size=config.block_size, kv_dtype=config.kv_dtype,
            dtype=config.dtype, window_tokens=config.window_tokens, sink_tokens=config.sink_tokens,
            weights=config.weights, prompt_attention=config.prompt_attention))
        self.attention = attach_monitor(self.runner, config.attention_sample_rate)  # None: off
        self.attention_done: OrderedDict = OrderedDict()  # request id -> RequestAttention (finished)
        self.tiers, extra_keys = self._open_tiers()
        self.scheduler = Scheduler(
            KVCacheManager(self.runner.layout, self.num_blocks, config.enable_prefix_caching,
                           record_evictions=self.tiers is not None and self.tiers.has_ram),
            self._scheduler_config(), PreemptionCost(
                flops_per_token=2.0 * count_parameters(self.spec),
                kv_bytes_per_token=kv_bytes_per_token(self.spec, config.kv_dtype)),
            tiers=self.tiers, extra_keys=extra_keys, tier_fetch=config.kv_tier_fetch,
            prompt_blocks_only=self.runner.prompt_rows_apart)
        self.tokenizer = _load_tokenizer(self.checkpoint)
        eos = set(self.spec.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()))
        self.outputs = OutputProcessor(self.tokenizer, eos, None if config.is_unbounded_length
                                       else self.max_model_len, self._finish)
        self.swap = HostSwapSpace(self.runner.kv_cache, self.tiers.ram_store() if self.tiers else None)
        self.mover = TierMover(self.runner.kv_cache, self.tiers, extra_keys) if self.tiers else None
        self.requests: dict[str, Request] = {}
        self._pending: list[StepOutput] = []
        self._ids = itertools.count()
        self._counters = {"steps": 0, "prompt": 0}
        self._last_tokens_per_s = 0.0
        self._last_audit: AuditReport | None = None
        self.heap = HeapTrimmer()
        self.last_work = None  # the last step's SchedulerOutput (read by the server's event ring)

    # --- setup ------------------------------------------------------------------------------

    def _plan_num_blocks(self) -> int:
        """The pool is `kv_memory` bytes cut into pages: the planner's own arithmetic."""
        plan = plan_memory(self.spec, memory_bytes=self.config.kv_memory_bytes, weights_bytes=0,
                           weights_source="not counted: kv_memory is the KV pool alone",
                           kv_dtype=self.config.kv_dtype, block_size=self.config.block_size,
                           activation_reserve_bytes=0, window_tokens=self.config.window_tokens,
                           sink_tokens=self.config.sink_tokens,
                           max_batched_tokens=self.config.max_batched_tokens)
        if plan.num_blocks < 1:
            raise ValueError(f"kv_memory {self.config.kv_memory_bytes} B is smaller than one KV "
                             f"block ({plan.page_bytes} B); give the engine more kv_memory")
        return plan.num_blocks

    def _open_tiers(self):
        """The KV tiers and the chain salt they need (None, () when no tier is configured)."""
        c = self.config
        if not c.kv_tiers.is_enabled:
            return None, ()
        ns = tier_namespace(self.checkpoint, c.dtype, c.kv_dtype, self.runner.layout, c.block_size, c.weights,
                            self.runner.prompt_attention)
        tiers = open_tiers(c.kv_tiers, ns, self.runner.kv_cache, c.kv_dtype)
        calibrate_prefill(self.runner, tiers, min(256, self.num_blocks * c.block_size,
                                                  c.max_batched_tokens, self.max_model_len))
        return tiers, (ns.digest,)

    def close(self) -> None:
        """Stop the tiers' writer and probe threads (queued stores are dropped)."""
        if self.tiers is not None:
            self.tiers.close()

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(max_num_seqs=c.max_num_seqs, max_batched_tokens=c.max_batched_tokens,
                               max_waiting=c.max_waiting, preemption_mode=c.preemption_mode,
                               swap_space_bytes=c.swap_space_bytes, max_model_len=self.max_model_len,
                               is_unbounded_length=c.is_unbounded_length,
                               max_queue_delay_s=c.max_queue_delay_s,
                               contended_prefill_tokens=c.contended_prefill_tokens)

    @property
    def max_model_len(self) -> int:
        """The window admitted against: prompt + max_tokens must fit (except in sink mode)."""
        return self.config.max_model_len or self.window.window_tokens

    @property
    def is_past_trained_window(self) -> bool:
        """max_model_len was raised past the model's window without RoPE scaling (allowed
        by allow_long_max_model_len): positions past the window were never trained."""
        return self.max_model_len > self.window.window_tokens

    # --- requests ---------------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text is tokenized as transformers does, BOS included)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer files: pass token ids, not text")
            return list(self.tokenizer.backend.encode(prompt, add_special_tokens=True).ids)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size}) (the vocabulary); "
                             f"got {bad[:5]}")
        return ids

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise now (ContextLengthExceeded / KVCapacityExceeded) if a request can never fit."""
        self.scheduler.check_admissible(num_prompt_tokens, max_tokens)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, namespace: str = "", priority: int = 0,
                    share: TenantShare | None = None) -> Request:
        """Queue a request; raises at once if it can never be served (nothing is queued).

        `namespace` is the tenant (it salts the prefix cache and keys fair sharing);
        `share` is that tenant's weight and caps.
        """
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty: it needs at least 1 token")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # every prompt position must be computed to be scored, so such a request takes no
        # prefix-cache hit (vLLM skips the cache too); its blocks are still cached for others
        req = Request(request_id, ids, params, namespace=namespace, priority=priority,
                      reads_prefix_cache=params.prompt_logprobs is None, share=share or TenantShare(),
                      cache_keys=self.runner.model.rope_cache_keys(len(ids)))
        self.outputs.start(req)
        self.scheduler.add(req)
        self.requests[request_id] = req
        return req

    def abort(self, request_id: str) -> bool:
        """Abort a request now: its blocks are free when this returns. False if unknown."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._finish(req, FinishReason.ABORT)
        self._pending.append(output_of(req))
        return True

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    # --- the loop ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Schedule, run, sample, emit. Returns this step's outputs (and any abort notices)."""
        started = time.perf_counter()
        work = self.last_work = self.scheduler.schedule()
        if self.mover is not None:
            self.mover.before_forward(work)  # spill reads come before the swap-in writes
        self.swap.move(work)
        self.scheduler.commit_fills(work)
        outputs, self._pending = self._pending, []
        outputs += [self._refused(r) for r in work.refused]
        if work.scheduled:
            outputs += self._run(work.scheduled)
            if self.mover is not None:
                self.mover.after_forward(work.scheduled)
        self._counters["steps"] += 1
        elapsed = time.perf_counter() - started
        self.scheduler.observe_step(work, elapsed)
        self._last_tokens_per_s = work.num_batched_tokens / elapsed if elapsed > 0 else 0.0
        idle = not self.scheduler.has_work
        if idle:
            self._last_audit = self.scheduler.audit()
        self.heap.after_step(idle)  # the freed step temporaries back to the kernel (issue 17)
        return outputs

    def _run(self, scheduled: tuple[ScheduledSeq, ...]) -> list[StepOutput]:
        batch = ForwardBatch(tuple(self.outputs.sequence_input(s) for s in scheduled))
        if self.attention is not None:
            rate = self.config.attention_sample_rate
            self.attention.begin(tuple(s.request.request_id if is_sampled(s.request.request_id, rate) else None
                                       for s in scheduled), tuple(s.request.num_prompt_tokens for s in scheduled))
        started = time.perf_counter()
        try:
            logits = self.runner.forward(batch)
        except Exception as e:  # noqa: BLE001 - one bad step must not leak or kill the engine
            log.exception("forward failed; ending the %d requests of this step", len(scheduled))
            return [self._fail(s.request, e) for s in scheduled]
        num_prompt_tokens = 0
        for s in scheduled:
            self.scheduler.after_step(s)
            if s.request.num_computed_tokens <= s.request.num_prompt_tokens:
                num_prompt_tokens += s.num_new_tokens
        self._counters["prompt"] += num_prompt_tokens
        if self.tiers is not None and num_prompt_tokens >= 64:  # a prefill step: keep the rate current
            self.tiers.cost.observe_prefill(num_prompt_tokens, time.perf_counter() - started)
        return self.outputs.process(scheduled, batch, logits)

    def _refused(self, req: Request) -> StepOutput:
        self._release_engine_state(req)  # the scheduler has already finished it
        return output_of(req, error=(
            f"the request could not be given KV blocks even in an empty pool of {self.num_blocks} "
            "blocks; this is a bug in admission arithmetic, please report it"))

    def _fail(self, req: Request, error: Exception) -> StepOutput:
        self._finish(req, FinishReason.ERROR)
        return output_of(req, error=f"{type(error).__name__}: {error}")

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        self._release_engine_state(req)

    def _release_engine_state(self, req: Request) -> None:
        """What the engine itself keeps for a finished request: its host pages, its clock."""
        self.swap.drop(req.request_id)
        if self.attention is not None and (record := self.attention.pop(req.request_id)) is not None:
            self.attention_done[req.request_id] = record
            while len(self.attention_done) > MAX_FINISHED_RECORDS:
                self.attention_done.popitem(last=False)
        if self.mover is not None and req.finish_reason is not FinishReason.LENGTH \
                and req.finish_reason is not FinishReason.STOP:
            self.mover.forget(req.request_id)  # aborted or failed: no final store
        req.finished_s = time.monotonic()

    # --- stats ------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Queues, KV pool, preemptions and the last idle audit, as one object."""
        sched, audit = self.scheduler.stats(), self._last_audit
        return EngineStats(
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_swapped=sched.num_swapped, num_preemptions_swap=sched.num_preemptions_swap,
            num_preemptions_recompute=sched.num_preemptions_recompute,
            num_steps=self._counters["steps"], num_generated_tokens=self.outputs.num_generated_tokens,
            num_prompt_tokens_computed=self._counters["prompt"],
            last_step_tokens_per_s=self._last_tokens_per_s, kv=sched.kv,
            leaked_blocks=_leaked_blocks(audit), audit_findings=tuple(audit.findings) if audit else (),
            tiers=sched.tiers, num_heap_trims=self.heap.num_trims,
            heap_released_bytes=self.heap.released_bytes)

    @functools.cached_property
    def weights_plan(self) -> tuple[int, str]:
        """(bytes, source): the planner's count of this engine's weights in the runtime layout
        of its weights mode (plan/weights.py), against which `runner.model.weights_bytes` is
        what it holds. Read from the checkpoint's headers once, on first use."""
        from ctxwarden.layers.linear import kernel_caps

        return planned_weights(self.checkpoint, self.config.weights, self.config.dtype, kernel_caps())

    def kv_holders(self) -> KVHolders:
        """Who holds KV blocks now (ctxwarden.engine.holders); between steps only."""
        return kv_holders(self)

    def audit(self) -> AuditReport:
        """Recount the KV pool now: every invariant, and blocks owned by no running request."""
        return self.scheduler.audit()

    def reset_prefix_cache(self) -> int:
        """Evict every cached block no request holds; with a RAM tier they spill there first.

        Returns how many blocks were evicted. Their pages are copied out here, before any
        step can reuse them: call it between steps (never from another thread).
        """
        n, spills = self.scheduler.reset_prefix_cache()
        if self.mover is not None:
            self.mover.before_forward(spills)
        return n

    def release_finished(self) -> None:
        """Forget finished requests (their blocks were released when they finished)."""
        for rid in [rid for rid, r in self.requests.items() if r.is_finished]:
            del self.requests[rid]


def _leaked_blocks(audit: AuditReport | None) -> int:
    if audit is None:
        return 0
    return sum(o.num_blocks for o in audit.owners if not o.is_live)


def _scaled_checkpoint(checkpoint: Checkpoint, config: EngineConfig) -> tuple[Checkpoint, ScaledWindow]:
    """The checkpoint with `config.rope_scaling` applied, and the window it gives.

    A max_model_len past that window is refused unless allow_long_max_model_len says the
    user knows the model will see positions it was never trained on.
    """
    spec = checkpoint.spec
    if config.rope_scaling is None:
        window = ScaledWindow(spec.rope.rope_type, 1.0, trained_window(spec), spec.max_position_embeddings)
    else:
        window = scaled_window(spec, config.rope_scaling)
        checkpoint = replace(checkpoint, spec=apply_rope_scaling(spec, config.rope_scaling))
    if config.max_model_len and config.max_model_len > window.window_tokens and not config.allow_long_max_model_len:
        how = ("with RoPE scaling, e.g. --rope-scaling '{\"rope_type\": \"yarn\", \"factor\": %g}'"
               % math.ceil(config.max_model_len / window.trained_tokens) if config.rope_scaling is None
               else "with a larger rope_scaling factor")
        raise ValueError(f"max_model_len {config.max_model_len} is past the model's window of "
                         f"{window.window_tokens} tokens ({_window_origin(window, config)}); extend it {how}, "
                         "or pass --allow-long-max-model-len (allow_long_max_model_len=True) to serve "
                         "positions the model was never trained on")
    return checkpoint, window


def _window_origin(window: ScaledWindow, config: EngineConfig) -> str:
    if config.rope_scaling is None:
        return "max_position_embeddings, no RoPE scaling"
    return f"trained {window.trained_tokens} x {window.rope_type} factor {window.factor:g}"


def _load_tokenizer(checkpoint: Checkpoint):
    """The checkpoint's tokenizer, or None when it ships none; a malformed one raises.

    A safetensors directory has one when it holds tokenizer.json; a GGUF when its metadata
    holds a vocabulary (`tokenizer.ggml.tokens`).
    """
    from ctxwarden.context.tokenizers import load_tokenizer

    if checkpoint.format != "gguf" and not (checkpoint.model_dir / "tokenizer.json").is_file():
        return None
    try:
        return load_tokenizer(checkpoint.path if checkpoint.format == "gguf" else checkpoint.model_dir)
    except NoTokenizer:
        return None
