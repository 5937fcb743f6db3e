"""Model architectures and their weight loading (safetensors directories and GGUF files).

`load_model(path)` is the entry point: it resolves the checkpoint, checks every tensor the
architecture needs against the file headers (names, shapes, types) before reading any data,
then builds the model in the requested dtype.
"""

from ctxwarden.models.loader import load_model, open_weights
from ctxwarden.models.registry import SUPPORTED_MODEL_TYPES, model_class

__all__ = ["SUPPORTED_MODEL_TYPES", "load_model", "model_class", "open_weights"]
