"""Named errors. Every refusal names the limit, the value and the fix.

Kept in one module so that the server can map each error class to an HTTP status and an
OpenAI error code without importing the stage that raised it.
"""

from __future__ import annotations


class CtxwardenError(Exception):
    """Base class of every error ctxwarden raises on purpose."""


class ConfigError(CtxwardenError, ValueError):
    """A model config (config.json or GGUF metadata) is malformed or unsupported.

    The message always names the file and the field.
    """

    def __init__(self, source: str, field: str, problem: str):
        self.source = source
        self.field = field
        self.problem = problem
        super().__init__(f"{source}: field '{field}': {problem}")


class ModelNotFound(CtxwardenError, FileNotFoundError):
    """A model path (or the default model package) cannot be found."""


class ContextLengthExceeded(CtxwardenError, ValueError):
    """A request can never fit the model's window (prompt + max_tokens > max_model_len)."""

    def __init__(self, max_model_len: int, prompt_tokens: int, max_tokens: int, detail: str = ""):
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        total = prompt_tokens + max_tokens
        msg = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens."
        )
        if detail:
            msg += " " + detail
        super().__init__(msg)


class KVCapacityExceeded(CtxwardenError, ValueError):
    """A request needs more KV blocks than the whole pool holds: it can never be served."""

    def __init__(self, blocks_needed: int, num_blocks: int, max_context_tokens: int):
        self.blocks_needed = blocks_needed
        self.num_blocks = num_blocks
        self.max_context_tokens = max_context_tokens
        super().__init__(
            f"The request needs {blocks_needed} KV blocks but the whole pool holds "
            f"{num_blocks} (the longest sequence it can hold is {max_context_tokens} tokens). "
            f"Give the engine more kv_memory, shorten the prompt, or lower max_tokens."
        )


class Overloaded(CtxwardenError, RuntimeError):
    """A request would wait too long: refused now with a time to retry (the server answers 429).

    `retry_after_s` is the engine's own estimate of when the same request would be admitted.
    """

    retry_after_s: float = 1.0


class QueueFull(Overloaded):
    """The bounded waiting queue is full: try again later."""

    def __init__(self, num_waiting: int, max_waiting: int, retry_after_s: float = 1.0):
        self.num_waiting = num_waiting
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        super().__init__(
            f"The waiting queue is full ({num_waiting} of {max_waiting} requests waiting). "
            f"Retry after {retry_after_s:.0f} s, or raise max_waiting."
        )


class QueueDelayExceeded(Overloaded):
    """The predicted time to first token is over the limit (deadline-aware admission)."""

    def __init__(self, predicted_s: float, limit_s: float, num_tokens_ahead: int, prefill_tokens_per_s: float):
        self.predicted_s, self.limit_s = predicted_s, limit_s
        self.retry_after_s = max(1.0, predicted_s - limit_s)
        super().__init__(
            f"This request would wait about {predicted_s:.1f} s for its first token ({num_tokens_ahead} "
            f"prompt tokens to compute first, at the measured {prefill_tokens_per_s:.0f} tokens/s for its "
            f"share), over the limit of {limit_s:.1f} s (max_queue_delay_s). Retry after "
            f"{self.retry_after_s:.0f} s, or send a shorter prompt."
        )


class TenantLimitExceeded(Overloaded):
    """One tenant is over one of its own limits (queued requests, tokens per minute)."""

    def __init__(self, tenant: str, what: str, value: float, limit: float, retry_after_s: float):
        self.tenant, self.what, self.value, self.limit = tenant, what, value, limit
        self.retry_after_s = max(1.0, retry_after_s)
        super().__init__(
            f"Tenant {tenant!r} is over its limit of {limit:g} {what} ({value:g} with this request). "
            f"Retry after {self.retry_after_s:.0f} s; other tenants are not affected."
        )

class EngineFailed(CtxwardenError, RuntimeError):
    """The engine loop died; nothing more can be served until the process restarts."""


# --- KV block manager (ctxwarden.kv) ---------------------------------------------------


class KVPoolExhausted(CtxwardenError, RuntimeError):
    """The pool has fewer allocatable blocks (free + evictable cached) than a call needs.

    Raised by the act half of a check/act pair (`allocate`, `append`) when the check half
    (`can_allocate`, `can_append`) was skipped or the pool changed in between.
    """

    def __init__(self, num_blocks_needed: int, num_blocks_available: int, num_blocks_total: int):
        self.num_blocks_needed = num_blocks_needed
        self.num_blocks_available = num_blocks_available
        self.num_blocks_total = num_blocks_total
        super().__init__(
            f"KV pool exhausted: the call needs {num_blocks_needed} blocks but only "
            f"{num_blocks_available} of {num_blocks_total} are free or evictable. Ask "
            f"can_allocate/can_append first, then preempt or wait for a sequence to finish."
        )


class DoubleFree(CtxwardenError, RuntimeError):
    """A block or a sequence is released a second time."""


class UseAfterFree(CtxwardenError, RuntimeError):
    """A released sequence (or a released block) is used again."""


class UnknownSequence(CtxwardenError, LookupError):
    """A sequence id the KV manager has never allocated."""


class SequenceExists(CtxwardenError, ValueError):
    """`allocate` was called for a sequence id that already holds blocks."""


class WeightsError(CtxwardenError, ValueError):
    """A checkpoint's tensors cannot be loaded: missing, misshapen or of an unsupported type.

    Raised while reading headers, before any tensor memory is committed; the message names
    the file and the tensor.
    """

    def __init__(self, source: str, tensor: str, problem: str):
        self.source = source
        self.tensor = tensor
        self.problem = problem
        super().__init__(f"{source}: tensor '{tensor}': {problem}")


class UnsupportedArchitecture(CtxwardenError, ValueError):
    """The runner has no implementation for a checkpoint's architecture."""

    def __init__(self, source: str, model_type: str, supported: tuple[str, ...]):
        self.source = source
        self.model_type = model_type
        super().__init__(
            f"{source}: architecture {model_type!r} cannot be run; the runner implements "
            f"{', '.join(supported)}. (`ctxwarden plan` still works for any config.)"
        )

class InvalidSamplingParams(CtxwardenError, ValueError):
    """A sampling parameter is outside its accepted range (an HTTP 400 with `param` = field)."""

    def __init__(self, field: str, value: object, accepted: str):
        self.field = field
        self.value = value
        self.accepted = accepted
        super().__init__(f"Invalid sampling parameter '{field}' = {value!r}: must be {accepted}.")


class UnknownTokenizer(CtxwardenError, ValueError):
    """A tokenizer name or path that is neither a known name nor a tokenizer file."""

    def __init__(self, name: str, available: list[str], hint: str = ""):
        self.name = name
        self.available = available
        msg = (f"Unknown tokenizer {name!r}. Available names: {', '.join(available)}; or pass a path "
               "to a Hugging Face directory (tokenizer.json), a tokenizer.json file or a .gguf file.")
        super().__init__(msg + (f" ({hint})" if hint else ""))


class TokenizerError(CtxwardenError, ValueError):
    """A tokenizer file is there but cannot be read (malformed JSON, unknown model type)."""


class NoTokenizer(CtxwardenError, FileNotFoundError):
    """A checkpoint ships no tokenizer (no tokenizer.json; a GGUF without a vocabulary)."""


class FragmentError(CtxwardenError, ValueError):
    """A context fragment is invalid; the message names the fragment and the field."""

    def __init__(self, fragment_id: str, field: str, problem: str):
        self.fragment_id = fragment_id
        self.field = field
        self.problem = problem
        super().__init__(f"fragment {fragment_id!r}: field '{field}': {problem}")


class RequiredContextExceeded(CtxwardenError, ValueError):
    """Required context fragments need more tokens than the budget holds."""

    def __init__(self, budget_tokens: int, required_tokens: int, fragment_ids: list[str]):
        self.budget_tokens = budget_tokens
        self.required_tokens = required_tokens
        self.fragment_ids = fragment_ids
        super().__init__(
            f"The required fragments ({', '.join(fragment_ids)}) need {required_tokens} tokens but "
            f"the budget is {budget_tokens}. Raise the budget, shorten them, or mark fewer as required.")


class ChunkTooSmall(CtxwardenError, ValueError):
    """A single character needs more tokens than a chunk's max_tokens allows."""


