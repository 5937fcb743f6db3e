"""One prompt's attention statistics, offline: `ctxwarden diag attention` (torch).

An engine with every request monitored runs the prompt as one whole-prompt prefill (no
prefix cache, so every row is computed; every row observed, rollout kept) and returns the
record of `runner.attention_monitor` as the JSON of docs/diagnostics.md.
"""

from __future__ import annotations

from ctxwarden.runner.attention_monitor import RequestAttention


def probe_attention(engine, token_ids: list[int]) -> RequestAttention:
    """Run `token_ids` through `engine` (built with attention_sample_rate=1 and no prefix
    caching) as one prefill and return its attention record."""
    from ctxwarden.sampling import SamplingParams

    monitor = engine.attention
    if monitor is None:
        raise ValueError("the engine monitors no attention: build it with attention_sample_rate=1.0")
    if len(token_ids) > engine.config.max_batched_tokens:
        raise ValueError(f"the prompt has {len(token_ids)} tokens; one prefill step takes at most "
                         f"{engine.config.max_batched_tokens} (raise max_batched_tokens)")
    monitor.prefill_stride, monitor.keep_full = 1, True
    req = engine.add_request(list(token_ids), SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests:
        engine.step()
    engine.release_finished()
    return engine.attention_done.pop(req.request_id)
