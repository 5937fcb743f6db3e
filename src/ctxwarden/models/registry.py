"""Which class runs which `model_type`."""

from __future__ import annotations

from ctxwarden.spec.model_spec import ModelSpec
from ctxwarden.errors import UnsupportedArchitecture

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
                         "gemma3_text", "deepseek_v2", "deepseek_v3")


def model_class(spec: ModelSpec, source: str):
    """The model class for `spec.model_type`; UnsupportedArchitecture (naming it) otherwise."""
    if spec.model_type in ("gemma3", "gemma3_text"):
        from ctxwarden.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if spec.model_type == "gemma2":
        from ctxwarden.models.gemma2 import Gemma2ForCausalLM

        return Gemma2ForCausalLM
    if spec.model_type in ("deepseek_v2", "deepseek_v3"):
        from ctxwarden.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    if spec.model_type in ("llama", "mistral", "qwen2", "qwen3", "phi3"):
        from ctxwarden.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    raise UnsupportedArchitecture(source, spec.model_type, SUPPORTED_MODEL_TYPES)
