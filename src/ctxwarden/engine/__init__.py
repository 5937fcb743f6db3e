"""The engine: one loop over the scheduler, the runner and output processing.

    engine.py   Engine.add_request / step / abort / stats: the loop
    config.py   EngineConfig: every knob, validated once, frozen (no torch)
    outputs.py  OutputProcessor: a step's logits -> tokens, text, stops, StepOutputs
    swap.py     HostSwapSpace: preempted requests' pages kept in host memory

`from ctxwarden.engine import Engine, EngineConfig` works; importing the package alone
does not import torch (the CLI builds an EngineConfig before deciding to load a model).
"""

__all__ = ["Engine", "EngineConfig", "EngineStats"]


def __getattr__(name):
    if name == "EngineConfig":
        from ctxwarden.engine.config import EngineConfig

        return EngineConfig
    if name in ("Engine", "EngineStats"):
        from ctxwarden.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ctxwarden.engine' has no attribute {name!r}")
