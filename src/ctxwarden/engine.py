"""The engine: one `step()` moves every request forward by one scheduled chunk.

    step = schedule (admit, chunk, preempt; KV slots allocated)
         -> move swapped pages (out to host, back in)
         -> run the model on the batch (paged KV)
         -> sample the rows that end a prompt or decode
         -> detokenize, check stops, release finished requests' blocks
         -> emit StepOutputs

Invariants: a request that can never fit is refused in `add_request` (ContextLengthExceeded
or KVCapacityExceeded), never queued; finish, stop, abort, error and preemption release
every block in the step they happen; when the engine goes idle the block audit runs and any
leak shows in `stats().kv.leaked_blocks`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from ctxwarden.checkpoint import resolve_checkpoint
from ctxwarden.engine_config import EngineConfig
from ctxwarden.errors import CtxwardenError
from ctxwarden.kv import KVCacheManager, KVStats
from ctxwarden.plan import kv_bytes_per_token, plan_memory
from ctxwarden.plan.params import count_parameters
from ctxwarden.request import FinishReason, Request, RequestStatus, StepOutput
from ctxwarden.runner.inputs import ForwardBatch, SequenceInput
from ctxwarden.runner.kv_cache import PageCopy
from ctxwarden.runner.model_runner import ModelRunner, RunnerConfig
from ctxwarden.sampling import SamplingParams
from ctxwarden.sampling.detokenize import IncrementalDetokenizer
from ctxwarden.sampling.sampler import Sampler, SamplingRow, make_generator, prompt_logprobs
from ctxwarden.sampling.stop import check_finish
from ctxwarden.scheduler import (PreemptionCost, ScheduledSeq, Scheduler, SchedulerConfig,
                                 SchedulerOutput)

log = logging.getLogger("ctxwarden.engine")


@dataclass
class _SamplingState:
    """Per-request state the sampler and detokenizer keep across steps."""

    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None


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


class Engine:
    """Continuous-batching engine over a paged KV cache. Single-threaded: callers serialise."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.checkpoint = resolve_checkpoint(config.model)
        self.spec = self.checkpoint.spec
        self.num_blocks = self._plan_num_blocks()
        self.runner = ModelRunner(self.checkpoint, RunnerConfig(
            num_blocks=self.num_blocks, block_size=config.block_size, kv_dtype=config.kv_dtype,
            dtype=config.dtype, window_tokens=config.window_tokens, sink_tokens=config.sink_tokens,
            weights=config.weights))
        self.kv = KVCacheManager(self.runner.layout, self.num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, self._scheduler_config(), PreemptionCost(
            flops_per_token=2.0 * count_parameters(self.spec),
            kv_bytes_per_token=kv_bytes_per_token(self.spec, config.kv_dtype)))
        self.tokenizer = _load_tokenizer(self.checkpoint)
        self.eos_token_ids = set(self.spec.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()))
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._host_pages: dict[str, dict[tuple[int, int], PageCopy]] = {}
        self._pending: list[StepOutput] = []
        self._ids = itertools.count()
        self._counters = {"steps": 0, "generated": 0, "prompt": 0}
        self._last_tokens_per_s = 0.0
        self._last_audit = None

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

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(max_num_seqs=c.max_num_seqs, max_batched_tokens=c.max_batched_tokens,
                               max_waiting=c.max_waiting, preemption_mode=c.preemption_mode,
                               swap_space_bytes=c.swap_space_bytes, window_tokens=self.window_tokens,
                               is_unbounded_length=bool(c.sink_tokens or c.window_tokens))

    @property
    def window_tokens(self) -> int:
        """The model's context window: prompt + max_tokens must fit (except in sink mode)."""
        return self.config.max_model_len or self.spec.max_position_embeddings

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

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, namespace: str = "", priority: int = 0) -> Request:
        """Queue a request; raises at once if it can never be served (nothing is queued)."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty: it needs at least 1 token")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.prompt_logprobs is not None:
            # every prompt position must be computed to be scored: a cache hit would skip
            # some, so such a request gets a namespace of its own (vLLM skips the cache too)
            namespace = f"{namespace}\x1fprompt-logprobs:{request_id}"
        req = Request(request_id, ids, params, namespace=namespace, priority=priority)
        req.sampling_state = _SamplingState(
            None if params.is_greedy else make_generator(params.seed),
            self._detokenizer(ids, params))
        self.scheduler.add(req)
        self.requests[request_id] = req
        return req

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer.backend, prompt_ids,
                                      skip_special_tokens=params.skip_special_tokens,
                                      stop=params.stop,
                                      include_stop_str_in_output=params.include_stop_str_in_output)

    def abort(self, request_id: str) -> bool:
        """Abort a request now: its blocks are free when this returns. False if unknown."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._finish(req, FinishReason.ABORT)
        self._pending.append(self._output(req, (), "", ()))
        return True

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    # --- the loop ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Schedule, run, sample, emit. Returns this step's outputs (and any abort notices)."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self._move_swapped_pages(plan)
        outputs, self._pending = self._pending, []
        outputs += [self._refused(r) for r in plan.refused]
        if plan.scheduled:
            outputs += self._run(plan.scheduled)
        self._counters["steps"] += 1
        elapsed = time.perf_counter() - started
        self._last_tokens_per_s = plan.num_batched_tokens / elapsed if elapsed > 0 else 0.0
        if not self.scheduler.has_work:
            self._last_audit = self.kv.audit(live_seq_ids=())
        return outputs

    def _run(self, scheduled: tuple[ScheduledSeq, ...]) -> list[StepOutput]:
        batch = ForwardBatch(tuple(self._sequence_input(s) for s in scheduled))
        try:
            logits = self.runner.forward(batch)
        except Exception as e:  # noqa: BLE001 - one bad step must not leak or kill the engine
            log.exception("forward failed; ending the %d requests of this step", len(scheduled))
            return [self._fail(s.request, e) for s in scheduled]
        for s in scheduled:
            self.scheduler.after_step(s)
            if s.request.num_computed_tokens <= s.request.num_prompt_tokens:
                self._counters["prompt"] += s.num_new_tokens
        sampled, sample_logits = self._split_logits(scheduled, logits)
        return self._sample(sampled, sample_logits) if sampled else []

    def _sequence_input(self, s: ScheduledSeq) -> SequenceInput:
        req, start = s.request, s.request.num_computed_tokens
        tables = tuple(tuple(0 if b is None else b for b in t) for t in self.kv.block_tables(req.request_id))
        wants = _wants_prompt_logprobs(req, start, s.num_new_tokens)
        logits = "all" if wants else ("last" if s.is_sampled else "none")
        return SequenceInput.chunk(req.all_token_ids[start:start + s.num_new_tokens], start, tables, logits)

    def _split_logits(self, scheduled, logits: torch.Tensor):
        """Pick each sampled request's last row; feed prompt-logprob rows to their request."""
        sampled, rows, at = [], [], 0
        for s in scheduled:
            n_rows = self._num_logits_rows(s)
            if n_rows > 1 or (n_rows == 1 and not s.is_sampled):
                self._record_prompt_logprobs(s, logits[at:at + n_rows])
            if s.is_sampled:
                sampled.append(s.request)
                rows.append(at + n_rows - 1)
            at += n_rows
        return sampled, logits[rows] if rows else logits[:0]

    def _num_logits_rows(self, s: ScheduledSeq) -> int:
        start = s.request.num_computed_tokens - s.num_new_tokens  # computed was advanced
        wants = _wants_prompt_logprobs(s.request, start, s.num_new_tokens)
        return s.num_new_tokens if wants else int(s.is_sampled)

    def _record_prompt_logprobs(self, s: ScheduledSeq, rows: torch.Tensor) -> None:
        """Logprobs of prompt tokens not scored yet, under the logits of the positions before.

        Row i holds the logits of position start + i, which predict token start + i + 1.
        """
        req = s.request
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]  # the first prompt token has no context
        start = req.num_computed_tokens - s.num_new_tokens
        first = len(req.prompt_logprobs) - 1  # the next position whose logits score a token
        targets = req.prompt_token_ids[first + 1:start + rows.shape[0] + 1]
        if targets:
            window = req.prompt_token_ids[first:first + 1 + len(targets)]
            rows = rows[first - start:first - start + len(targets)]
            req.prompt_logprobs += prompt_logprobs(rows, window, req.params.prompt_logprobs)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        rows = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.sampling_state.generator)
                for r in reqs]
        result = self.sampler.sample(logits, rows)
        return [self._accept(r, result[i]) for i, r in enumerate(reqs)]

    def _accept(self, req: Request, scored) -> StepOutput:
        token = scored.token_id
        req.output_token_ids.append(token)
        self._counters["generated"] += 1
        if req.first_token_s is None:
            req.first_token_s = time.monotonic()
        if req.params.logprobs is not None:
            req.logprobs.append(scored)
        detok = req.sampling_state.detokenizer
        delta = detok.push(token) if detok is not None else ""
        stop_string = detok.stop_string if detok is not None else None
        reason = check_finish(req.params, token, len(req.output_token_ids), self.eos_token_ids, stop_string)
        if reason is None and req.num_tokens >= self.window_tokens and not self.scheduler.config.is_unbounded_length:
            reason = FinishReason.LENGTH  # the window is full (admission makes this rare)
        if reason is not None:
            if detok is not None and not detok.is_finished:
                delta += detok.flush()
            req.stop_reason = stop_string or (token if token in req.params.stop_token_ids else None)
            self._finish(req, reason)
        req.output_text += delta
        return self._output(req, (token,), delta, (scored,) if req.params.logprobs is not None else ())

    def _refused(self, req: Request) -> StepOutput:
        self._release_engine_state(req)  # the scheduler has already finished it
        return self._output(req, (), "", (), error=(
            f"the request could not be given KV blocks even in an empty pool of {self.num_blocks} "
            "blocks; this is a bug in admission arithmetic, please report it"))

    def _fail(self, req: Request, error: Exception) -> StepOutput:
        self._finish(req, FinishReason.ERROR)
        return self._output(req, (), "", (), error=f"{type(error).__name__}: {error}")

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        self._release_engine_state(req)

    def _release_engine_state(self, req: Request) -> None:
        """What the engine itself keeps for a finished request: its host pages, its clock."""
        self._host_pages.pop(req.request_id, None)
        req.finished_s = time.monotonic()

    def _output(self, req: Request, tokens, delta: str, logprobs, error: str | None = None) -> StepOutput:
        return StepOutput(req.request_id, tuple(tokens), delta, req.is_finished, req.finish_reason,
                          req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens,
                          tuple(logprobs), req.stop_reason, error)

    # --- swapping ---------------------------------------------------------------------------

    def _move_swapped_pages(self, plan: SchedulerOutput) -> None:
        """Copy preempted requests' pages to host, then swapped-in requests' pages back.

        Order matters: a page freed by a swap-out may be handed to a swap-in in the same
        step, so every read happens before any write. Nothing is overwritten before the
        forward pass, which runs after this.
        """
        cache = self.runner.kv_cache
        for p in plan.preempted:
            if p.mode == "swap":
                self._host_pages[p.request.request_id] = {
                    (g, j): cache.read_page(b) for g, t in enumerate(p.block_tables)
                    for j, b in enumerate(t) if b is not None}
        for s in plan.swapped_in:
            saved = self._host_pages.pop(s.request.request_id)
            for g, table in enumerate(s.block_tables):
                for j, b in enumerate(table):
                    if b is not None and j >= s.num_hit_blocks and (g, j) in saved:
                        cache.write_page(b, saved[(g, j)])

    # --- stats ------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Queues, KV pool, preemptions and the last idle audit, as one object."""
        sched = self.scheduler
        audit = self._last_audit
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=sum(r.status is RequestStatus.WAITING for r in sched.waiting),
            num_swapped=sum(r.status is RequestStatus.SWAPPED for r in sched.waiting),
            num_preemptions_swap=sched.num_preemptions["swap"],
            num_preemptions_recompute=sched.num_preemptions["recompute"],
            num_steps=self._counters["steps"], num_generated_tokens=self._counters["generated"],
            num_prompt_tokens_computed=self._counters["prompt"],
            last_step_tokens_per_s=self._last_tokens_per_s,
            kv=self.kv.stats(run_audit_check=False),
            leaked_blocks=_leaked_blocks(audit), audit_findings=tuple(audit.findings) if audit else ())

    def release_finished(self) -> None:
        """Forget finished requests (their blocks were released when they finished)."""
        for rid in [rid for rid, r in self.requests.items() if r.is_finished]:
            del self.requests[rid]


def _wants_prompt_logprobs(req: Request, start: int, num_new_tokens: int) -> bool:
    """Whether a chunk [start, start + n) holds the next position whose logits score a token.

    Scores are recorded in order. A recompute after preemption (or a partial prefix hit on
    the request's own blocks) can start before or at that position: the chunk then scores
    from it on; a chunk wholly before it scores nothing again.
    """
    if req.params.prompt_logprobs is None:
        return False
    first = len(req.prompt_logprobs) - 1 if req.prompt_logprobs is not None else 0
    return start <= first < min(start + num_new_tokens, req.num_prompt_tokens - 1)


def _leaked_blocks(audit) -> int:
    if audit is None:
        return 0
    return sum(o.num_blocks for o in audit.owners if not o.is_live)


def _load_tokenizer(checkpoint):
    """The checkpoint's tokenizer (tokenizer.json, or the GGUF's own), or None if it has none."""
    from ctxwarden.context.tokenizers import load_tokenizer

    try:
        return load_tokenizer(checkpoint.path if checkpoint.format == "gguf" else checkpoint.model_dir)
    except (CtxwardenError, ValueError, FileNotFoundError):
        return None
