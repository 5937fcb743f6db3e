"""RoPE scaling as an option (issue 15): LLM(rope_scaling=...) == the same scaling written into
config.json; the window follows; max_model_len past it is refused; bad options name the fix."""

from __future__ import annotations

import json
import shutil

import pytest

from ctxwarden import LLM, SamplingParams
from ctxwarden.engine.config import EngineConfig
from ctxwarden.engine.tiers import tier_namespace
from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint

TRAINED = 64  # the tiny model's max_position_embeddings
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(200)]  # 200 tokens: past the trained window
HEAD_HALF = 8  # head_dim 16 -> 8 rotary frequencies

# option -> how a transformers checkpoint writes the same scaling into config.json
VARIANTS = {
    "linear": ({"rope_type": "linear", "factor": 4}, {"type": "linear", "factor": 4}, TRAINED),
    "dynamic": ({"rope_type": "dynamic", "factor": 4}, {"type": "dynamic", "factor": 4}, TRAINED),
    "yarn": ({"rope_type": "yarn", "factor": 4},
             {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": TRAINED}, 4 * TRAINED),
    "longrope": ({"rope_type": "longrope", "factor": 4, "short_factor": [1.0] * HEAD_HALF,
                  "long_factor": [1.0 + i for i in range(HEAD_HALF)]},
                 {"rope_type": "longrope", "short_factor": [1.0] * HEAD_HALF,
                  "long_factor": [1.0 + i for i in range(HEAD_HALF)],
                  "original_max_position_embeddings": TRAINED}, 4 * TRAINED),
    "llama3": ({"rope_type": "llama3", "factor": 4, "low_freq_factor": 1, "high_freq_factor": 4},
               {"rope_type": "llama3", "factor": 4, "low_freq_factor": 1, "high_freq_factor": 4,
                "original_max_position_embeddings": TRAINED}, 4 * TRAINED),
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(MakeModelOptions(arch="llama", out_dir=tmp_path_factory.mktemp("rope-base"),
                                            max_position=TRAINED, with_tokenizer=False))


def _edited(base_dir, tmp_path, rope_scaling: dict, max_position: int):
    out = tmp_path / "edited"
    shutil.copytree(base_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(rope_scaling=rope_scaling, max_position_embeddings=max_position)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _prompt_logprobs(llm: LLM) -> list[float]:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    return [lp.logprob for lp in out.prompt_logprobs[1:]]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_option_equals_the_scaling_written_into_config(base_dir, tmp_path, variant):
    option, in_file, file_max_pos = VARIANTS[variant]
    long_ok = {"max_model_len": 4 * TRAINED, "allow_long_max_model_len": True}
    scaled = LLM(str(base_dir), kv_memory="4MiB", rope_scaling=option)
    assert scaled.engine.max_model_len == 4 * TRAINED  # the window follows the factor
    edited = LLM(str(_edited(base_dir, tmp_path, in_file, file_max_pos)), kv_memory="4MiB",
                 **(long_ok if file_max_pos == TRAINED else {}))
    unscaled = LLM(str(base_dir), kv_memory="4MiB", **long_ok)
    got, want, plain = _prompt_logprobs(scaled), _prompt_logprobs(edited), _prompt_logprobs(unscaled)
    assert got == pytest.approx(want, abs=1e-5)
    # the option really changed the rotation: past the trained window the logprobs move
    assert max(abs(a - b) for a, b in zip(got[TRAINED:], plain[TRAINED:])) > 1e-3


def test_max_model_len_below_the_scaled_window_wins(base_dir):
    llm = LLM(str(base_dir), kv_memory="4MiB", rope_scaling={"rope_type": "yarn", "factor": 4}, max_model_len=100)
    assert llm.engine.max_model_len == 100 and not llm.engine.is_past_trained_window


def test_max_model_len_past_the_window_is_refused_without_scaling(base_dir):
    with pytest.raises(ValueError) as e:
        LLM(str(base_dir), kv_memory="4MiB", max_model_len=200)
    msg = str(e.value)
    assert "max_model_len 200" in msg and f"window of {TRAINED} tokens" in msg
    assert "--rope-scaling" in msg and '"factor": 4' in msg and "--allow-long-max-model-len" in msg
    with pytest.raises(ValueError, match="larger rope_scaling factor"):
        LLM(str(base_dir), kv_memory="4MiB", max_model_len=300, rope_scaling={"rope_type": "linear", "factor": 2})
    llm = LLM(str(base_dir), kv_memory="4MiB", max_model_len=200, allow_long_max_model_len=True)
    assert llm.engine.max_model_len == 200 and llm.engine.is_past_trained_window


@pytest.mark.parametrize("value, fragment", [
    ('{"rope_type": "yarn", factor: 4}', "not valid JSON"),
    ('{"rope_type": "ntk", "factor": 4}', "'ntk' is not a scaling method; choose one of linear, dynamic, yarn"),
    ('{"factor": 4}', "None is not a scaling method"),
    ('{"rope_type": "yarn"}', "needs a factor >= 1"),
    ('{"rope_type": "linear", "factor": 0.5}', "got 0.5"),
    ('{"rope_type": "linear", "factor": 2, "beta_fast": 8}', "beta_fast are not read by 'linear'"),
    ('{"rope_type": "llama3", "factor": 8}', "needs low_freq_factor, high_freq_factor"),
    ('[1, 2]', "must be a JSON object"),
])
def test_bad_rope_scaling_names_the_value_and_the_choices(value, fragment):
    with pytest.raises(ValueError) as e:
        EngineConfig(rope_scaling=value)
    assert fragment in str(e.value)


def test_type_key_of_transformers_4_is_accepted():
    assert EngineConfig(rope_scaling='{"type": "dynamic", "factor": 2}').rope_scaling == {
        "rope_type": "dynamic", "factor": 2}


def test_longrope_factor_lists_must_match_the_rotary_dim(base_dir):
    bad = {"rope_type": "longrope", "factor": 4, "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}
    with pytest.raises(ValueError, match=f"list of {HEAD_HALF} numbers"):
        LLM(str(base_dir), kv_memory="4MiB", rope_scaling=bad)


def test_kv_tier_namespace_includes_the_scaling(base_dir):
    def namespace(llm: LLM):
        e = llm.engine
        return tier_namespace(e.checkpoint, "fp32", "fp32", e.runner.layout, 16, "auto").key_prefix

    plain = namespace(LLM(str(base_dir), kv_memory="4MiB"))
    yarn4 = namespace(LLM(str(base_dir), kv_memory="4MiB", rope_scaling={"rope_type": "yarn", "factor": 4}))
    yarn2 = namespace(LLM(str(base_dir), kv_memory="4MiB", rope_scaling={"rope_type": "yarn", "factor": 2}))
    assert len({plain, yarn4, yarn2}) == 3


def test_serve_and_generate_take_rope_scaling_and_the_long_flag():
    from ctxwarden.cli import build_parser
    from ctxwarden.cli._engine_args import engine_config_from_args

    for command in ("serve", "generate"):
        extra = ["--prompt", "x"] if command == "generate" else []
        args = build_parser().parse_args([command, "--rope-scaling", '{"type": "yarn", "factor": 4}',
                                          "--allow-long-max-model-len", *extra])
        cfg = engine_config_from_args(args)
        assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4} and cfg.allow_long_max_model_len
    args = build_parser().parse_args(["serve", "--on-overflow", "truncate-middle"])
    assert args.on_overflow == "truncate-middle"


@pytest.mark.parametrize("variant", ["dynamic", "longrope"])
def test_length_dependent_rope_kv_is_shared_only_with_prompts_of_the_same_length(base_dir, variant):
    """A 200-token prompt past the trained window (64) rotates its keys for 200 tokens; a
    48-token prompt that starts the same way must not reuse them (it rotates as a short prompt),
    while the same long prompt again does. The short prompt's output equals a fresh engine's."""
    option = {"rope_scaling": VARIANTS[variant][0], "enable_prefix_caching": True, "block_size": 16,
              "kv_memory": "8MiB"}
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1)
    short = PROMPT[:48]

    def run(llm, prompt):
        out = llm.generate([prompt], params)[0]
        return out.token_ids, [lp.logprob for lp in out.logprobs], out.num_cached_tokens

    fresh = run(LLM(model=str(base_dir), **option), short)
    llm = LLM(model=str(base_dir), **option)
    run(llm, PROMPT)
    after_long = run(llm, short)
    assert after_long[2] == 0 and after_long[:2] == fresh[:2]
    assert run(llm, PROMPT)[2] >= 192  # the same length still shares its blocks
    assert run(llm, short)[2] >= 32  # and short prompts share among themselves
