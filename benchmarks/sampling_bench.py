"""Time one Sampler.sample call at SmolLM2's vocabulary (49,152) for common settings.

Not part of pytest. Logits are drawn peaked like a language model's (a few tokens hold most
of the mass), since top-p cost depends on where its cutoff falls. Prints a JSON object of
milliseconds per call (median of repeats). Run:
    OMP_WAIT_POLICY=PASSIVE python benchmarks/sampling_bench.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from ctxwarden.sampling.params import SamplingParams
from ctxwarden.sampling.sampler import Sampler, SamplingRow, make_generator

VOCAB = 49_152
SETTINGS = {
    "greedy": SamplingParams.greedy(),
    "temperature": SamplingParams(temperature=0.8),
    "top_p_0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "top_k_50+top_p+min_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    "penalties+logprobs_5": SamplingParams(temperature=0.8, repetition_penalty=1.1,
                                           frequency_penalty=0.5, logprobs=5),
}


def _time_ms(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> float:
    samples = []
    for _ in range(15):
        start = time.perf_counter()
        sampler.sample(logits, rows)
        samples.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(samples), 3)


def main() -> None:
    """Print ms per sample() call for batch 1 and 16 under each setting."""
    sampler, gen = Sampler(), torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for batch in (1, 16):
        logits = torch.randn(batch, VOCAB, generator=gen) * 2.5  # peaked, like an LM head
        for name, params in SETTINGS.items():
            rows = [SamplingRow(params, list(range(2000)), list(range(100)),
                                make_generator(i)) for i in range(batch)]
            results.setdefault(name, {})[f"batch_{batch}_ms"] = _time_ms(sampler, logits, rows)
    print(json.dumps({"vocab": VOCAB, "threads": torch.get_num_threads(), **results}, indent=1))


if __name__ == "__main__":
    main()
