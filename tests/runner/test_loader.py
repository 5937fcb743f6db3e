"""Loading refuses bad checkpoints with errors that name the file and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ctxwarden.errors import ConfigError, UnsupportedArchitecture, WeightsError
from ctxwarden.models import load_model
from ctxwarden.runner import ForwardBatch, ModelRunner, RunnerConfig, SequenceInput


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(model_dir, change):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    return path


def test_missing_tensor_is_named(tiny_model, tmp_path):
    d = _copy(tiny_model("llama"), tmp_path / "m")
    path = _rewrite_weights(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*missing") as e:
        load_model(d)
    assert str(path) in str(e.value)


def test_wrong_shape_is_named(tiny_model, tmp_path):
    d = _copy(tiny_model("llama"), tmp_path / "m")
    _rewrite_weights(d, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(WeightsError, match=r"model\.norm\.weight.*shape \[63\].*\[64\]"):
        load_model(d)


def test_unsupported_tensor_type_is_named(tiny_model, tmp_path):
    d = _copy(tiny_model("llama"), tmp_path / "m")
    _rewrite_weights(d, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(WeightsError, match=r"model\.norm\.weight.*I32"):
        load_model(d)


def test_unsupported_architecture_is_named(tiny_model, tmp_path):
    d = _copy(tiny_model("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="smollm3")  # the planner knows it; the runner does not run it
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match=r"smollm3") as e:
        load_model(d)
    assert str(d) in str(e.value)


def test_config_without_weights_is_refused(tiny_model, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_model("llama") / "config.json", d / "config.json")
    with pytest.raises(WeightsError, match="no weight files"):
        load_model(d)


def test_sharded_checkpoint_loads_through_its_index(tiny_model, tmp_path):
    src = tiny_model("qwen2")
    d = tmp_path / "sharded"
    d.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, d / name)
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    batch = ForwardBatch((SequenceInput.chunk([5, 6, 7], 0, ((0,),), "all"),))
    whole = ModelRunner(src, RunnerConfig(num_blocks=1)).forward(batch)
    sharded = ModelRunner(d, RunnerConfig(num_blocks=1)).forward(batch)
    assert torch.equal(whole, sharded)


def test_checkpoint_without_tokenizer_runs_on_token_ids(tiny_model):
    d = tiny_model("mistral")  # built with_tokenizer=False
    assert not (d / "tokenizer.json").exists()
    logits = ModelRunner(d, RunnerConfig(num_blocks=1)).forward(
        ForwardBatch((SequenceInput.chunk([1, 2, 3], 0, ((0,),)),)))
    assert logits.shape == (1, 512) and torch.isfinite(logits).all()


def test_short_block_table_is_refused(tiny_model):
    runner = ModelRunner(tiny_model("llama"), RunnerConfig(num_blocks=4, block_size=4))
    with pytest.raises(ValueError, match=r"5 tokens need 2 blocks of 4, the table has 1"):
        runner.forward(ForwardBatch((SequenceInput.chunk([1, 2, 3, 4, 5], 0, ((0,),)),)))


def test_layer_types_mismatch_is_a_config_error(tiny_model, tmp_path):
    d = _copy(tiny_model("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="layer_types"):
        load_model(d)


def test_transformers_5_saved_config_loads_and_matches(tiny_model, tmp_path):
    """Re-save a checkpoint with the installed transformers (5.x writes rope_parameters,
    dtype, layer_types): our loader reads that layout and the logits are unchanged."""
    from runner_parity import hf_model

    src = tiny_model("gemma2", sliding_window=24, max_position=256,
                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    hf_model(src).save_pretrained(str(tmp_path / "resaved"))
    cfg = json.loads((tmp_path / "resaved" / "config.json").read_text())
    batch = ForwardBatch((SequenceInput.chunk(list(range(3, 40)), 0, ((0, 1, 2), (3, 4, 5)), "all"),))
    before = ModelRunner(src, RunnerConfig(num_blocks=6)).forward(batch)
    after = ModelRunner(tmp_path / "resaved", RunnerConfig(num_blocks=6)).forward(batch)
    assert "rope_scaling" in json.loads((src / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and "layer_types" in cfg
    assert torch.allclose(before, after, atol=1e-6)
