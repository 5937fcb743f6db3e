"""Shared test setup: OpenMP must not spin on these 2 shared cores (set before torch loads)."""

import contextlib
import functools
import io
import os
import sys

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_GGUF_READERS: dict = {}


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers' GGUF loading, with the file parsed once per session instead of once per
    call. transformers builds a `gguf.GGUFReader` for the config, again for the weights and
    again for the tokenizer (each ~5 s on a Zen 3: it walks the 49,152-entry vocabulary in
    Python), and a `TensorNameMap` for every module it visits (397 of them, ~6.5 s in all).
    Both are read-only once built, so they are shared; what transformers computes from them
    (the dequantized weights, the tokenizer) is unchanged. Only inside the two fixtures below."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = real_reader(path, mode)
        return _GGUF_READERS[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer():
    """transformers' tokenizer from the default model's GGUF, loaded once per session (it
    parses the GGUF's metadata in Python: ~15 s on a 2-vCPU Zen 1)."""
    transformers = pytest.importorskip("transformers")
    from ctxwarden.spec.checkpoint import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with _gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_smollm2(hf_smollm2_tokenizer):
    """transformers on the default model's GGUF (dequantized to fp32, eager attention), loaded
    once per session (~5 s on a Zen 3 with the GGUF parsed once; 18 s without): (tokenizer,
    model). The reference of every SmolLM2 parity test."""
    transformers = pytest.importorskip("transformers")
    import torch

    from ctxwarden.spec.checkpoint import default_model_path

    path = default_model_path()
    with _gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32, attn_implementation="eager")
    return hf_smollm2_tokenizer, model.eval()


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `ctxwarden ARGS...` in this process: `cli(*args, stdin="")` -> (exit code, stdout,
    stderr). No new interpreter and no second torch import (each costs 2-3 s); argparse's
    refusals (SystemExit) give their exit code as the command line would. tests/test_smoke.py
    and tests/context/test_cli.py keep one real `python -m ctxwarden` each."""
    from ctxwarden.cli import main

    def run(*args, stdin: str = ""):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()  # drop anything printed before
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run
