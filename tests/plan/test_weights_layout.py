"""The planner's weights (plan/weights.py) against the bytes the loaded model holds.

`ctxwarden plan` counts weights in the runtime layout of a weights mode, tensor by tensor
from the headers; the loader then builds that layout. Each test loads the real thing and
compares byte for byte, on this machine's kernels (so a VNNI build checks the panels, an
AVX2 one the plain codes).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ctxwarden.engine.config import WEIGHTS_MODES
from ctxwarden.layers.linear import kernel_caps
from ctxwarden.models.loader import load_model
from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint
from ctxwarden.plan import plan_checkpoint
from ctxwarden.plan.checkpoint_plan import planned_weights
from ctxwarden.spec.checkpoint import resolve_checkpoint

MiB = 1024**2


def _held(ckpt, mode: str, dtype: str) -> int:
    return load_model(ckpt, dtype, mode).weights_bytes


@pytest.mark.slow
@pytest.mark.parametrize("mode", WEIGHTS_MODES)
def test_smollm2_gguf_plan_is_what_the_runner_holds(mode):
    ckpt = resolve_checkpoint(None)
    planned, source = planned_weights(ckpt, mode, "float32", kernel_caps())
    held = _held(ckpt, mode, "float32")
    print(f"{mode}: planned {planned / MiB:.2f} MiB, held {held / MiB:.2f} MiB, stored {ckpt.weights_bytes / MiB:.2f}")
    assert planned == held, (mode, planned, held)
    assert source.startswith(f"{mode} layout")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Random checkpoints of the modeled families (fp32), and a llama one stored in BF16."""
    out = {}
    for arch in ("llama", "qwen2", "qwen3", "phi3", "gemma2"):
        out[arch] = make_checkpoint(MakeModelOptions(arch=arch, out_dir=tmp_path_factory.mktemp(arch),
                                                     hidden_size=64, intermediate_size=96, vocab_size=256,
                                                     with_tokenizer=False))
    bf16 = make_checkpoint(MakeModelOptions(arch="llama", out_dir=tmp_path_factory.mktemp("bf16"),
                                            hidden_size=64, vocab_size=256, with_tokenizer=False))
    for f in bf16.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    out["llama-bf16"] = bf16
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "llama-bf16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_checkpoint_plan_is_what_the_runner_holds(checkpoints, arch, dtype):
    ckpt = resolve_checkpoint(str(checkpoints[arch]))
    for mode in WEIGHTS_MODES:
        planned, _ = planned_weights(ckpt, mode, dtype, kernel_caps())
        assert planned == _held(ckpt, mode, dtype), (arch, dtype, mode)


def test_an_unmodeled_family_falls_back_to_the_stored_bytes(tmp_path):
    ckpt = resolve_checkpoint(str(make_checkpoint(MakeModelOptions(arch="deepseek_v2", out_dir=tmp_path,
                                                                   with_tokenizer=False))))
    planned, source = planned_weights(ckpt, "auto", "float32", kernel_caps())
    assert planned == ckpt.weights_bytes and "not modeled" in source


def test_the_memory_plan_takes_the_runtime_bytes_from_its_budget():
    ckpt = resolve_checkpoint(None)
    stored = plan_checkpoint(ckpt, 2 * 1024**3, context_tokens=8192)
    held = plan_checkpoint(ckpt, 2 * 1024**3, weights="auto-int8act", caps=kernel_caps(), context_tokens=8192)
    assert stored.weights_bytes == ckpt.weights_bytes and stored.weights_source == "gguf header"
    assert held.kv_budget_bytes == stored.kv_budget_bytes - (held.weights_bytes - stored.weights_bytes)


@pytest.mark.parametrize("mode", WEIGHTS_MODES)
def test_a_tensor_the_loader_never_reads_adds_nothing(mode):
    """A llama3 GGUF stores `rope_freqs.weight` (1-D, the rope scaling factors; the loader
    computes its own). It is not a projection: planning it as one raised. With it the plan
    must count what it counts without it, in every weights mode."""
    from ctxwarden.plan.weights import StoredTensor, gguf_tensors, role_of, runtime_weights_bytes
    from ctxwarden.spec.gguf_header import read_gguf_header

    ckpt = resolve_checkpoint(None)
    tensors = gguf_tensors(read_gguf_header(ckpt.weight_files[0]))
    assert role_of("rope_freqs.weight") == ("unused", None)
    extra = StoredTensor(*role_of("rope_freqs.weight"), (ckpt.spec.head_dim // 2,), "F32")

    def plan(ts):
        return runtime_weights_bytes(ts, model_type=ckpt.spec.model_type, tied=ckpt.spec.tie_word_embeddings,
                                     mode=mode, dtype="float32", caps=kernel_caps())

    assert plan(tensors + [extra]) == plan(tensors) > 0
