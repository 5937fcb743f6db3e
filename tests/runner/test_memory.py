"""Planned == measured: the bytes of KV tensors the runner allocates are the planner's."""

from __future__ import annotations

import pytest

from ctxwarden.spec.checkpoint import resolve_checkpoint
from ctxwarden.plan import plan_memory
from ctxwarden.runner import ModelRunner, RunnerConfig

MiB = 1024 ** 2


@pytest.mark.parametrize("arch,kv_dtype,block_size,window,sinks", [
    ("llama", "fp32", 16, None, 0),
    ("llama", "bf16", 32, None, 0),
    ("gemma2", "fp32", 16, None, 0),  # two groups (sliding + full) sharing one pool
    ("qwen3", "fp16", 1, None, 0),
    ("llama", "fp32", 16, 64, 4),  # sink mode
])
def test_allocated_kv_bytes_equal_the_plan(tiny_model, arch, kv_dtype, block_size, window, sinks):
    options = {"sliding_window": 24} if arch == "gemma2" else {}
    ckpt = resolve_checkpoint(tiny_model(arch, **options))
    plan = plan_memory(ckpt.spec, memory_bytes=ckpt.weights_bytes + 3 * MiB,
                       weights_bytes=ckpt.weights_bytes, weights_source="safetensors header",
                       kv_dtype=kv_dtype, block_size=block_size, activation_reserve_bytes=0,
                       window_tokens=window, sink_tokens=sinks)
    runner = ModelRunner(ckpt, RunnerConfig(num_blocks=plan.num_blocks, block_size=block_size,
                                            kv_dtype=kv_dtype, window_tokens=window, sink_tokens=sinks))
    tensors = runner.kv_cache.keys + runner.kv_cache.values
    assert plan.num_blocks > 0
    assert sum(t.nbytes for t in tensors) == plan.kv_pool_bytes
    assert len(tensors) == 2 * runner.layout.layers_per_group
    assert all(t.shape == (plan.num_blocks, block_size, ckpt.spec.num_kv_heads, ckpt.spec.head_dim)
               for t in tensors)


def test_the_pool_is_resident_only_where_blocks_were_written(tiny_model):
    """RSS tracks use: after a prompt, each pool tensor holds in memory the pages its written
    blocks span and nothing else (pages are 4 KiB: the pool must not take huge pages, which
    made 2 MiB resident per tensor on first write, nor be cleared at allocation)."""
    import mmap

    from ctxwarden.runner import ForwardBatch, SequenceInput

    ckpt = resolve_checkpoint(tiny_model("llama"))
    runner = ModelRunner(ckpt, RunnerConfig(num_blocks=8192, block_size=16, kv_dtype="fp32"))
    pool = runner.kv_cache
    tensors = pool.keys + pool.values
    assert min(t.nbytes for t in tensors) >= 8 * MiB  # where numpy's zeros asked for huge pages
    assert pool.resident_bytes() == 0
    prompt = list(range(5, 5 + 300))
    blocks = tuple(range(-(-len(prompt) // 16)))
    runner.forward(ForwardBatch((SequenceInput.chunk(prompt, 0, (blocks,)),)))
    block_bytes = tensors[0][0].nbytes
    per_tensor = -(-len(blocks) * block_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    assert per_tensor * len(tensors) <= pool.resident_bytes() <= (per_tensor + mmap.PAGESIZE) * len(tensors)
