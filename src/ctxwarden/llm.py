"""The offline API: `LLM(model).generate(prompts, params)`, `chat(...)`, `stream(...)`.

    from ctxwarden import LLM, SamplingParams
    llm = LLM(kv_memory="2GiB")                       # SmolLM2-135M-Instruct by default
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(out[0].text, out[0].finish_reason)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from ctxwarden.engine.config import EngineConfig
from ctxwarden.engine.engine import Engine
from ctxwarden.request import Request, StepOutput
from ctxwarden.sampling import SamplingParams


@dataclass(frozen=True)
class RequestOutput:
    """One finished request: its text, tokens, why it ended, logprobs, timing, cache use."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: tuple | None
    prompt_logprobs: tuple | None
    num_cached_tokens: int
    num_preemptions: int
    time_to_first_token_s: float | None
    total_time_s: float | None

    @classmethod
    def of(cls, req: Request) -> "RequestOutput":
        ttft = req.first_token_s - req.arrival_s if req.first_token_s else None
        total = req.finished_s - req.arrival_s if req.finished_s else None
        return cls(req.request_id, tuple(req.prompt_token_ids), req.output_text,
                   tuple(req.output_token_ids),
                   req.finish_reason.value if req.finish_reason else None,
                   tuple(req.logprobs) if req.params.logprobs is not None else None,
                   tuple(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
                   req.num_cached_tokens, req.num_preemptions, ttft, total)


class LLM:
    """A model loaded once, serving batches of prompts through the engine."""

    def __init__(self, model: str | None = None, kv_memory: int | str | None = None, **engine_options):
        """Load `model` (HF dir, .gguf, None: SmolLM2-135M-Instruct) into an engine.

        `engine_options` are EngineConfig's fields (block_size, dtype, kv_dtype,
        max_num_seqs, max_batched_tokens, max_model_len, enable_prefix_caching,
        kv_tiers='ram:4GiB,redis://127.0.0.1:6379', rope_scaling={"rope_type": "yarn", "factor": 4}
        (the window becomes trained x factor), sink_tokens=4 with window_tokens=1020 (streaming) ...);
        `kv_memory` and `swap_space` may be strings with units ('2GiB'). Defaults are
        EngineConfig's.
        """
        self.engine = Engine(EngineConfig.build(kv_memory=kv_memory, model=model, **engine_options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """An LLM over an engine built from a ready EngineConfig (as the CLI builds one)."""
        llm = cls.__new__(cls)
        llm.engine = Engine(config)
        return llm

    def close(self) -> None:
        """Stop the KV tiers' background threads (writers, health probe); a no-op without tiers."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 show_progress: bool | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Every prompt is checked before any runs: one that can never fit raises
        (ContextLengthExceeded / KVCapacityExceeded) and nothing is queued.
        """
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        params_list = _broadcast(params, len(prompts))
        ids = [self.engine.encode(p) for p in prompts]
        for p_ids, sp in zip(ids, params_list):
            self.engine.check_admissible(len(p_ids), sp.max_tokens)
        reqs = [self.engine.add_request(p_ids, sp) for p_ids, sp in zip(ids, params_list)]
        self._drain(reqs, _wants_progress(show_progress, ids))
        outputs = [RequestOutput.of(r) for r in reqs]
        self.engine.release_finished()
        return outputs

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], params: SamplingParams | None = None,
             show_progress: bool | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in convs], params, show_progress)

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's template, ready to answer."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so no chat template; pass token ids")
        rendered = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        return self.tokenizer.encode(rendered)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Yield each step's output for one prompt as it is produced (text deltas)."""
        req = self.engine.add_request(list(prompt) if not isinstance(prompt, str) else prompt, params)
        try:
            while not req.is_finished:
                for out in self.engine.step():
                    if out.request_id == req.request_id:
                        yield out
        finally:
            if not req.is_finished:
                self.engine.abort(req.request_id)  # the caller stopped iterating: free now
            self.engine.release_finished()

    def _drain(self, reqs: list[Request], show_progress: bool) -> None:
        if not show_progress:
            while any(not r.is_finished for r in reqs):
                self.engine.step()
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        total_prompt = sum(r.num_prompt_tokens for r in reqs)
        with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=True) as bar:
            prefill = bar.add_task("prefill tokens", total=total_prompt)
            done = bar.add_task("requests", total=len(reqs))
            while any(not r.is_finished for r in reqs):
                self.engine.step()
                bar.update(prefill, completed=sum(min(r.num_computed_tokens, r.num_prompt_tokens)
                                                  if not r.is_finished else r.num_prompt_tokens for r in reqs))
                bar.update(done, completed=sum(r.is_finished for r in reqs))


def _is_token_list(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and isinstance(x[0], int)


def _broadcast(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one or one per prompt")
    return list(params)


def _wants_progress(show: bool | None, ids: list[list[int]]) -> bool:
    """Default: a bar for large batches (>= 32 prompts) or long prefill (>= 4K tokens)."""
    if show is not None:
        return show
    import sys

    return sys.stderr.isatty() and (len(ids) >= 32 or sum(map(len, ids)) >= 4096)
