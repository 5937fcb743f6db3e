"""ctxwarden: a long-context LLM inference runtime.

    from ctxwarden import LLM, SamplingParams
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):  # lazy: `import ctxwarden` must not import torch
    if name == "LLM":
        from ctxwarden.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ctxwarden.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'ctxwarden' has no attribute {name!r}")
