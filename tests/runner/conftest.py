"""Tiny random checkpoints, built once per test session with `make_checkpoint`."""

from __future__ import annotations

import pytest

from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, **options) -> directory of a tiny checkpoint (cached per options)."""
    made = {}

    def build(arch: str, **options):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(arch)
            options.setdefault("with_tokenizer", False)
            made[key] = make_checkpoint(MakeModelOptions(arch=arch, out_dir=out, **options))
        return made[key]

    return build
