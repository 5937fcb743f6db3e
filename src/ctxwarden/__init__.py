"""ctxwarden: a long-context LLM inference runtime."""

__version__ = "0.1.0"
