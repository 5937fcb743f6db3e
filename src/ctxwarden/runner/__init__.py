"""The only torch owner: KV tensors, step inputs, paged attention, and the model runner.

    ForwardBatch (token ids + block tables per sequence)
        -> StepInputs (flat tensors, slot mappings, key gathers)   inputs.py
        -> model forward, layer by layer                            models/
             writes new K/V through the slot mapping                kv_cache.py
             reads K/V through the block tables                     attention.py
        -> logits [rows asked for, vocab] fp32                      model_runner.py
"""

from ctxwarden.runner.inputs import ForwardBatch, SequenceInput
from ctxwarden.runner.kv_cache import PagedKVCache
from ctxwarden.runner.model_runner import ModelRunner, RunnerConfig

__all__ = ["ForwardBatch", "ModelRunner", "PagedKVCache", "RunnerConfig", "SequenceInput"]
