"""The salted hash chain: namespaces, extra keys and prefixes all change every later hash."""

import hashlib

import pytest

from ctxwarden.kv import extend_chain, hash_block, root_hash


def test_chain_matches_hand_computed_blake2b():
    root = root_hash("tenant-a")
    chain = []
    extend_chain(chain, root, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 2)
    payload = root + b"".join(t.to_bytes(8, "little", signed=True) for t in (1, 2, 3, 4))
    assert chain[0] == hashlib.blake2b(payload, digest_size=32).digest()
    assert chain[1] == hash_block(chain[0], [5, 6, 7, 8])
    assert len(chain) == 2  # the partial block [9] has no hash


def test_namespace_enters_the_first_block_and_every_later_one():
    tokens = list(range(12))
    a, b = [], []
    extend_chain(a, root_hash("a"), tokens, 4, 3)
    extend_chain(b, root_hash("b"), tokens, 4, 3)
    assert all(x != y for x, y in zip(a, b))


def test_extra_keys_are_typed_and_length_prefixed():
    assert root_hash("", ("1",)) != root_hash("", (1,)) != root_hash("", (b"1",))
    assert root_hash("", ("ab", "c")) != root_hash("", ("a", "bc"))
    assert root_hash("ab") != root_hash("a", ("b",))
    with pytest.raises(TypeError, match="extra keys must be str, bytes or int"):
        root_hash("", (1.5,))


def test_a_block_hash_names_its_whole_prefix():
    root = root_hash("")
    a, b = [], []
    extend_chain(a, root, [1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    extend_chain(b, root, [0, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert a[1] != b[1]  # same tokens in block 1, different block 0


def test_extending_in_steps_equals_hashing_at_once():
    tokens = list(range(40))
    whole, steps = [], []
    extend_chain(whole, root_hash("x"), tokens, 8, 5)
    for n in (1, 1, 3, 5):
        extend_chain(steps, root_hash("x"), tokens, 8, n)
    assert whole == steps
