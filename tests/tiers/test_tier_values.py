"""Tier configuration, keys and the self-verifying value format (no model, no torch)."""

from __future__ import annotations

import os

import pytest

from ctxwarden.engine.config import EngineConfig
from ctxwarden.kv.prefix import extend_chain, root_hash
from ctxwarden.kv.tiers import TierNamespace, parse_tiers
from ctxwarden.kv.tiers.config import TierSpec, TiersConfig, format_tier
from ctxwarden.kv.tiers.value import (NO_KEY, Expected, IntegrityError, Manifest, ObjectHeader,
                                      PageFormat, block_sum, decode_manifest, decode_object,
                                      encode_manifest, encode_object, merkle_root)

BS = 4
PAGE = PageFormat("fp32", (2, 2, BS, 1, 2), 2 * 2 * BS * 1 * 2 * 4)


def test_parse_tiers_orders_and_reads_options():
    cfg = parse_tiers("redis://127.0.0.1:6379/0?object_bytes=64KiB&timeout_ms=100,ram:4GiB,disk:/a:b/c:20GiB")
    assert [t.kind for t in cfg.tiers] == ["ram", "disk", "redis"]  # lookup order, not written order
    ram, disk, redis = cfg.tiers
    assert ram.capacity_bytes == 4 * 1024**3
    assert disk.path == "/a:b/c" and disk.capacity_bytes == 20 * 1024**3  # the size is after the last ':'
    assert redis.url == "redis://127.0.0.1:6379/0" and redis.object_bytes == 65536 and redis.timeout_ms == 100
    assert parse_tiers(str(cfg)) == cfg  # formats back to what it read
    assert format_tier(TierSpec("disk", 10, "/x", object_bytes=4096)) == "disk:/x:10?object_bytes=4096"
    assert not parse_tiers(None).is_enabled and not parse_tiers("").is_enabled


@pytest.mark.parametrize("text, words", [
    ("ram", "cannot read tier"), ("disk:/x", "cannot read tier"), ("ram:0", "byte budget"),
    ("ram:1GiB,ram:2GiB", "once"), ("redis://h:1?speed=9", "unknown tier option(s) speed"),
    ("tape:/dev/st0:1GiB", "cannot read tier"), ("ram:lots", "byte size"),
])
def test_bad_tier_text_is_a_clear_error(text, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_tiers(text)


def test_engine_config_parses_tiers_and_refuses_bad_combinations():
    cfg = EngineConfig(kv_tiers="ram:1GiB")
    assert isinstance(cfg.kv_tiers, TiersConfig) and cfg.kv_tiers.get("ram").capacity_bytes == 1024**3
    assert EngineConfig().kv_tiers == TiersConfig()  # off unless named
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_tiers="ram:1GiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="rolling-window"):
        EngineConfig(kv_tiers="ram:1GiB", window_tokens=64)


def test_serve_and_generate_take_kv_tiers():
    from ctxwarden.cli import build_parser
    from ctxwarden.cli._engine_args import engine_config_from_args

    for command in ("serve", "generate"):
        extra = ["--prompt", "x"] if command == "generate" else []
        args = build_parser().parse_args([command, "--kv-tiers", "ram:2GiB,redis://127.0.0.1:1", *extra])
        cfg = engine_config_from_args(args)
        assert [t.kind for t in cfg.kv_tiers.tiers] == ["ram", "redis"]


def _namespace(**changes) -> TierNamespace:
    fields = dict(weights_fingerprint="w", tokenizer_fingerprint="t", dtype="fp32", kv_dtype="fp32",
                  layout="L", block_size=16, rope='{"theta": 10000}')
    fields.update(changes)
    return TierNamespace(**fields)


@pytest.mark.parametrize("change", [dict(weights_fingerprint="w2"), dict(tokenizer_fingerprint="t2"),
                                    dict(dtype="bf16"), dict(kv_dtype="bf16"), dict(layout="L2"),
                                    dict(block_size=32), dict(rope='{"theta": 500000}'), dict(format_version=2),
                                    dict(weights_mode="auto")])
def test_every_namespace_field_changes_the_digest(change):
    assert _namespace(**change).digest != _namespace().digest
    assert _namespace().digest == _namespace().digest  # and it is stable


def _chain(tokens, root):
    chain = []
    extend_chain(chain, root, tokens, BS, len(tokens) // BS)
    return chain


def _object(tokens, root, first, n, pages, stored_tokens=None):
    """An object of blocks [first, first + n); `stored_tokens` puts other ids in its header."""
    chain = _chain(tokens, root)
    sums = tuple(block_sum(p) for p in pages)
    h = ObjectHeader(root, chain[first + n - 1], root if first == 0 else chain[first - 1], merkle_root(sums),
                     NO_KEY, first, n, sums)
    stored = (stored_tokens or tokens)[first * BS:(first + n) * BS]
    return encode_object(h, BS, PAGE, stored, pages), chain


def _expected(tokens, root):
    return Expected(root, _chain(tokens, root), tokens, BS, PAGE)


def test_object_round_trip_and_every_corruption_is_detected():
    root = root_hash("tenant", (b"model",))
    tokens = list(range(100, 124))  # 6 blocks
    pages = [os.urandom(PAGE.page_bytes) for _ in range(3)]
    value, chain = _object(tokens, root, 2, 3, pages)
    header, views = decode_object(value, _expected(tokens, root), 2, 3)
    assert [bytes(v) for v in views] == pages and header.own_key == chain[4]

    other_root = root_hash("tenant", (b"other-model",))
    other_value, _ = _object(tokens, other_root, 2, 3, pages)
    neighbour, _ = _object(tokens, root, 1, 3, [os.urandom(PAGE.page_bytes) for _ in range(3)])
    wrong_tokens = tokens[:9] + [7] + tokens[10:]
    bad = {
        "checksum": [_flip(value, len(value) - 5), _flip(value, 30)],  # a page byte, a header byte
        "truncated": [value[:-1], value[:10], value + b"x"],
        "format": [b"XXXX" + value[4:]],
        "namespace": [other_value],  # another model's value under this key
        "key": [neighbour],  # a value swapped in from another key
        "tokens": [_object(tokens, root, 2, 3, pages, stored_tokens=wrong_tokens)[0]],
    }
    exp = _expected(tokens, root)
    for reason, values in bad.items():
        for v in values:
            with pytest.raises(IntegrityError) as e:
                decode_object(v, exp, 2, 3)
            assert e.value.reason in (reason, "checksum", "truncated"), (reason, e.value)
    # the identity checks are reached for values that are well-formed: exact reasons
    for reason in ("namespace", "key", "tokens"):
        with pytest.raises(IntegrityError) as e:
            decode_object(bad[reason][0], exp, 2, 3)
        assert e.value.reason == reason


def _flip(value: bytes, at: int) -> bytes:
    b = bytearray(value)
    b[at] ^= 0x10
    return bytes(b)


def test_manifest_round_trip_and_merkle_root():
    root = root_hash("", (b"m",))
    sums = tuple(os.urandom(16) for _ in range(5))
    own = os.urandom(32)
    m = Manifest(root, own, merkle_root(sums), 4, ((os.urandom(32), 4, 3), (own, 7, 2)), sums)
    assert decode_manifest(encode_manifest(m), root, own) == m
    forged = Manifest(root, own, merkle_root(sums[:-1]), 4, m.objects, sums)
    with pytest.raises(IntegrityError, match="Merkle"):
        decode_manifest(encode_manifest(forged), root, own)
    with pytest.raises(IntegrityError) as e:
        decode_manifest(encode_manifest(m), root, os.urandom(32))
    assert e.value.reason == "key"
    assert merkle_root(sums) != merkle_root(sums[::-1])  # order matters
