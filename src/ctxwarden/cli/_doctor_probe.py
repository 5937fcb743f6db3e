"""`python -m ctxwarden.cli._doctor_probe --model M`: load a model in a fresh process and measure it.

Run by `ctxwarden doctor --model M` so the measurement starts from a clean interpreter and
the doctor's own process never imports torch. Prints one JSON object: the fields of
`ctxwarden.diagnostics.doctor.ModelMeasurement`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _tensor_bytes(obj, seen: set, depth: int = 0) -> int:
    """Bytes of every distinct tensor reachable from `obj` (attributes, lists, dicts)."""
    import torch

    if depth > 8 or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("ctxwarden"):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0


def measure(model: str | None, kv_memory: str, dtype: str) -> dict:
    """Memory before torch, after torch, after load and after one short request."""
    from ctxwarden.diagnostics.process_memory import read_process_memory

    before_torch = read_process_memory()
    import torch  # noqa: F401  (its import is part of what a server pays)

    from ctxwarden.llm import LLM
    from ctxwarden.sampling import SamplingParams

    baseline = read_process_memory()
    start = time.perf_counter()
    llm = LLM(model, kv_memory=kv_memory, dtype=dtype)
    load_s = time.perf_counter() - start
    loaded = read_process_memory()
    engine = llm.engine
    out = llm.generate([list(range(1, 17))], SamplingParams(max_tokens=4, temperature=0.0), show_progress=False)[0]
    after = read_process_memory()
    ckpt = engine.checkpoint
    return {
        "model": ckpt.name, "format": ckpt.format, "dtype": dtype,
        "weights_planned_bytes": engine.weights_plan[0], "weights_plan_source": engine.weights_plan[1],
        "weights_loaded_bytes": _tensor_bytes(engine.runner.model, set()),
        "kv_planned_bytes": engine.num_blocks * engine.runner.layout.page_bytes,
        "kv_allocated_bytes": engine.runner.kv_cache.nbytes, "num_blocks": engine.num_blocks,
        "page_bytes": engine.runner.layout.page_bytes, "load_s": load_s, "ttft_s": out.time_to_first_token_s,
        "rss_before_torch_bytes": before_torch.rss_bytes, "rss_baseline_bytes": baseline.rss_bytes,
        "rss_loaded_bytes": loaded.rss_bytes, "rss_anon_loaded_bytes": loaded.rss_anon_bytes,
        "rss_file_loaded_bytes": loaded.rss_file_bytes, "rss_anon_baseline_bytes": baseline.rss_anon_bytes,
        "rss_file_baseline_bytes": baseline.rss_file_bytes, "rss_after_request_bytes": after.rss_bytes,
        "peak_rss_bytes": after.peak_rss_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    """Parse, measure, print JSON."""
    p = argparse.ArgumentParser(prog="python -m ctxwarden.cli._doctor_probe")
    p.add_argument("--model", default=None)
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.model, args.kv_memory, args.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
