"""bf16 weights and a bf16 KV pool run the same paths; the CLI stays torch-free to import."""

from __future__ import annotations

import subprocess
import sys

import torch

from runner_parity import hf_model, hf_reference, make_runner, paged_run, prompt_ids


def test_bf16_weights_and_kv_stay_close_to_fp32_reference(tiny_model):
    model_dir = tiny_model("gemma2", sliding_window=24)
    ref = hf_reference(hf_model(model_dir), prompt_ids(40, 512), 4)
    runner = make_runner(model_dir, 16, 48, dtype="bfloat16", kv_dtype="bf16")
    assert runner.kv_cache.keys[0].dtype == torch.bfloat16
    ours = paged_run(runner, prompt_ids(40, 512), 4)
    assert ours.prefill_logits.dtype == torch.float32
    diff = (ours.prefill_logits - ref.prefill_logits).abs().max().item()
    scale = ref.prefill_logits.abs().max().item()
    assert diff < 0.05 * scale, f"bf16 drifted {diff:.3f} on logits of magnitude {scale:.3f}"


def test_fp32_model_with_bf16_kv_pool(tiny_model):
    model_dir = tiny_model("llama")
    ref = hf_reference(hf_model(model_dir), prompt_ids(40, 512), 4)
    ours = paged_run(make_runner(model_dir, 16, 48, kv_dtype="bf16"), prompt_ids(40, 512), 4)
    diff = (ours.prefill_logits - ref.prefill_logits).abs().max().item()
    assert 0 < diff < 0.02  # K/V rounded to bf16: close, and not bit-identical


def test_cli_parser_does_not_import_torch():
    code = ("import sys, ctxwarden.cli as c; c.build_parser(); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_auto_keeps_a_bf16_checkpoint_in_bf16_with_fp32_compute(tiny_model, tmp_path):
    """A BF16 safetensors checkpoint under weights=auto (fp32 model, vector build): the
    projections stay bf16 (half the bytes), the tied embedding is one shared bf16 table, and
    the logits are transformers' fp32 run of the same file within the fp32 parity bound."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ctxwarden.ext import has_vector_kernels

    src = tiny_model("llama")  # ties its embeddings
    model_dir = tmp_path / "bf16"
    shutil.copytree(src, model_dir)
    for f in model_dir.glob("*.safetensors"):
        save_file({k: v.bfloat16() for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    ref = hf_reference(hf_model(model_dir), prompt_ids(40, 512), 4)
    auto, fp32 = (make_runner(model_dir, 16, 48, weights=w) for w in ("auto", "fp32"))
    qkv = auto.model.layers[0].qkv
    assert qkv.weight.dtype == (torch.bfloat16 if has_vector_kernels() else torch.float32)
    if has_vector_kernels():
        assert auto.model.embed_tokens is auto.model.lm_head.weight  # one table, not two
        assert auto.model.weights_bytes < 0.6 * fp32.model.weights_bytes
    for runner in (auto, fp32):
        ours = paged_run(runner, prompt_ids(40, 512), 4)
        assert (ours.prefill_logits - ref.prefill_logits).abs().max().item() < 1e-4
        assert all((a - b).abs().max().item() < 1e-4 for a, b in zip(ours.decode_logits, ref.decode_logits))
