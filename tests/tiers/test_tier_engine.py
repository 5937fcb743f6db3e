"""The engine with KV tiers on a tiny checkpoint: identical outputs, isolation, faults, holes.

Every engine here chunks its prefill at the hit boundary (max_batched_tokens = the cached
prefix), so a cold run computes exactly what a warm run computes after its hit: greedy
tokens *and* logprobs must then be bit-identical whether the prefix comes from the pool,
RAM, disk, Redis, or nowhere.
"""

from __future__ import annotations

import random
import shutil

import pytest
from tier_faults import tmpfs
from safetensors.torch import load_file, save_file

from ctxwarden.llm import LLM
from ctxwarden.sampling import SamplingParams

BS = 16
PROMPT_TOKENS = 600
HIT_TOKENS = (PROMPT_TOKENS - 1) // BS * BS  # 592: the last prompt token is always computed
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
SMALL_OBJECTS = "object_bytes=32KiB"  # 4 blocks of the tiny model per object


def _prompt(seed=0, n=PROMPT_TOKENS):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _llm(model_dir, tiers=None, kv_memory="8MiB", **options):
    """An engine chunking at the hit boundary; it fetches whatever a tier holds (these tests
    are about what a fetch returns: the cost model's choices are tested in test_tier_cost)."""
    options.setdefault("max_batched_tokens", HIT_TOKENS)
    options.setdefault("kv_tier_fetch", "always")
    return LLM(str(model_dir), kv_memory=kv_memory, kv_tiers=tiers, **options)


def _run(llm, prompt):
    out = llm.generate([prompt], PARAMS)[0]
    return out, [(t.token_id, t.logprob, tuple((a.token_id, a.logprob) for a in t.top_logprobs))
                 for t in out.logprobs]


def _store(model_dir, tiers, seed):
    """One engine computes the prompt, its stores reach the tier, and it shuts down."""
    writer = _llm(model_dir, tiers)
    _run(writer, _prompt(seed))
    assert writer.engine.tiers.flush(10)
    writer.engine.close()


def _tier(llm, name):
    return next(t for t in llm.engine.stats().tiers if t.tier == name)


@pytest.fixture
def cold(tiny_dir):
    """The reference: no cache of any kind, the same chunking."""
    llm = _llm(tiny_dir, enable_prefix_caching=False)
    return {seed: _run(llm, _prompt(seed))[1] for seed in (0, 1, 2, 3)}


def test_outputs_are_identical_from_pool_ram_disk_redis_and_cold(tiny_dir, tmp_path, redis_server, cold):
    prompt = _prompt(0)
    # pool: the same engine again
    ram = _llm(tiny_dir, "ram:4MiB", kv_memory=45 * 8192)  # 45 pages: room for one prompt
    assert ram.engine.num_blocks == 45
    first, first_lp = _run(ram, prompt)
    again, again_lp = _run(ram, prompt)
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, HIT_TOKENS)
    # RAM: two other prompts push it out of the pool; it spills, then comes back
    _run(ram, _prompt(1))
    _run(ram, _prompt(2))
    back, back_lp = _run(ram, prompt)
    assert back.num_cached_tokens == HIT_TOKENS and _tier(ram, "ram").num_hit_blocks >= HIT_TOKENS // BS - 2
    # disk and Redis: computed and stored by one engine, read by a fresh one (a restart)
    shared = {"disk": f"disk:{tmp_path}:64MiB?{SMALL_OBJECTS}", "redis": f"{redis_server.url}?{SMALL_OBJECTS}"}
    outputs = {"cold": cold[0], "computed": first_lp, "pool": again_lp, "ram": back_lp}
    for name, tiers in shared.items():
        _store(tiny_dir, tiers, 0)
        reader = _llm(tiny_dir, tiers)
        out, outputs[name] = _run(reader, prompt)
        assert out.num_cached_tokens == HIT_TOKENS and _tier(reader, name).num_hit_blocks == HIT_TOKENS // BS
        assert _tier(reader, name).decision("fetch") == 1
        reader.engine.close()
    assert all(lp == cold[0] for lp in outputs.values()), {k: v[:1] for k, v in outputs.items()}
    ram.engine.close()


def _perturbed_copy(src, dst):
    """The same checkpoint, same file names, one weight nudged by 1e-3."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] += 1e-3
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_changed_model_dtype_or_block_size_never_hits(tiny_dir, tmp_path, redis_server):
    tiers = f"{redis_server.url}?{SMALL_OBJECTS}"
    _store(tiny_dir, tiers, 0)
    perturbed = _perturbed_copy(tiny_dir, tmp_path / tiny_dir.name)
    variants = {"perturbed weights": (perturbed, {}), "bf16": (tiny_dir, {"dtype": "bf16"}),
                "block size 32": (tiny_dir, {"block_size": 32}), "int8 weights": (tiny_dir, {"weights": "int8"})}
    for name, (model_dir, options) in variants.items():
        llm = _llm(model_dir, tiers, **options)
        out, _ = _run(llm, _prompt(0))
        stats = _tier(llm, "redis")
        assert out.num_cached_tokens == 0 and stats.num_hit_blocks == 0, name
        assert sum(dict(stats.integrity_failures).values()) == 0, name  # not even a key in common
        llm.engine.close()
    same = _llm(tiny_dir, tiers)  # and the unchanged model still hits
    assert _run(same, _prompt(0))[0].num_cached_tokens == HIT_TOKENS
    same.engine.close()


def test_a_hole_in_the_chain_is_used_up_to_the_hole_and_output_stays_equal(tiny_dir, redis_server, cold):
    tiers = f"{redis_server.url}?{SMALL_OBJECTS}"
    _store(tiny_dir, tiers, 1)
    client = redis_server.client()
    objects = sorted(k for k in client.keys("*:o:*"))
    assert len(objects) == -(-(PROMPT_TOKENS + 7) // BS // 4)  # prompt + outputs, 4 blocks an object
    reader = _llm(tiny_dir, tiers)
    victim = _object_holding_block(reader, client, _prompt(1), block=20)  # object [20..23]
    client.delete(victim)
    out, lp = _run(reader, _prompt(1))
    assert out.num_cached_tokens == 20 * BS  # blocks 0..19, then the hole
    assert lp[0][0] == cold[1][0][0]  # same greedy tokens (logprobs differ: another chunking)
    assert [t[0] for t in lp] == [t[0] for t in cold[1]]
    reader.engine.close()


def _object_holding_block(llm, client, prompt, block):
    from ctxwarden.kv.tiers.keys import object_key

    eng = llm.engine
    chain = eng.scheduler.kv.block_hashes(prompt, "", eng.scheduler.extra_keys)
    key = object_key(eng.tiers.key_prefix, chain[block + 3])
    assert client.exists(key)
    return key


def test_a_corrupted_value_is_detected_and_recomputed_end_to_end(tiny_dir, redis_server, cold):
    tiers = f"{redis_server.url}?{SMALL_OBJECTS}"
    _store(tiny_dir, tiers, 2)
    reader = _llm(tiny_dir, tiers)
    client = redis_server.client()
    key = _object_holding_block(reader, client, _prompt(2), block=8)
    value = bytearray(client.get(key))
    value[-100] ^= 0x04  # one bit of one K/V value
    client.set(key, bytes(value))
    out, lp = _run(reader, _prompt(2))
    assert out.num_cached_tokens == 8 * BS
    assert _tier(reader, "redis").integrity("checksum") == 1
    assert [t[0] for t in lp] == [t[0] for t in cold[2]]
    assert reader.engine.tiers.flush(10)
    assert client.get(key) not in (None, bytes(value))  # deleted, then stored afresh by the recompute
    again, _ = _run(_llm(tiny_dir, tiers), _prompt(2))
    assert again.num_cached_tokens == HIT_TOKENS  # healed
    reader.engine.close()


def test_a_full_disk_never_reaches_a_request(tiny_dir, tmp_path, cold):
    with tmpfs(tmp_path / "full", "256k") as mount:
        llm = _llm(tiny_dir, f"disk:{mount}:64MiB?{SMALL_OBJECTS}")  # the cap is far above the disk
        for seed in (0, 1, 2, 3):  # about 330 KB of KV each: the disk fills during the first
            out, lp = _run(llm, _prompt(seed))
            assert out.finish_reason == "length" and lp == cold[seed]
            llm.engine.tiers.flush(10)
        stats = _tier(llm, "disk")
        assert stats.num_store_errors == 1 and stats.is_degraded  # the first ENOSPC stops the writes
        assert stats.num_dropped_stores >= 3  # the later prompts' stores, dropped at once
        assert not any(".tmp." in p.name for p in mount.glob("*/*"))
        llm.engine.close()


def test_swap_preemption_keeps_pages_in_the_ram_tier_store(tiny_dir):
    prompts = [_prompt(s, 50) for s in range(12)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    calm = [o.token_ids for o in LLM(str(tiny_dir), kv_memory="8MiB").generate(prompts, params)]
    tight = LLM(str(tiny_dir), kv_memory=4 * 6 * 8192, preemption_mode="swap", kv_tiers="ram:4MiB")
    assert tight.engine.swap.store is tight.engine.tiers.ram_store()
    pressed = [o.token_ids for o in tight.generate(prompts, params)]
    assert pressed == calm
    assert tight.engine.stats().num_preemptions_swap > 0
    assert tight.engine.swap.num_bytes == 0  # every swapped page came back
    tight.engine.close()


def test_a_prefix_cache_reset_spills_to_ram_and_comes_back(tiny_dir, cold):
    llm = _llm(tiny_dir, "ram:4MiB")
    _run(llm, _prompt(3))
    evicted = llm.engine.reset_prefix_cache()
    assert evicted == (PROMPT_TOKENS + 7) // BS  # every full block of the prompt and its output
    assert llm.engine.stats().kv.num_blocks_cached == 0
    out, lp = _run(llm, _prompt(3))
    assert out.num_cached_tokens == HIT_TOKENS and _tier(llm, "ram").num_hit_blocks == HIT_TOKENS // BS
    assert lp == cold[3]
    assert _tier(llm, "ram").verify_seconds_sum > 0
    llm.engine.close()
