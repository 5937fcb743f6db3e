"""ext's paged decode attention at W1's batched-decode shape, cold (from DRAM) and warm.

B sequences of --keys keys each, SmolLM2's heads (9 query, 3 KV, head size 64), 16-token
pages. "cold": one call per layer over --layers distinct K/V pools, as a decode step
reads them (a step's K/V far exceeds the caches); "warm": the same pool every call (L3).
Pages laid out in order or shuffled (as a long-running pool ends up). Prints the
per-layer time and the K/V bytes it read per second beside a buffer sum's rate: where cold
is far above warm, the kernel waits on memory; where warm is far above the FMA bound, on
its own loop.

Run: .venv/bin/python benchmarks/decode_attention.py [--batch 16] [--keys 560] [--ext OLD.so] [--out FILE]
(side by side with an older build: copy its _build/*.so aside first, then alternate runs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from decode_step import read_bandwidth_gbs

HQ, HKV, HEAD_DIM, BLOCK = 9, 3, 64, 16


def pools_and_slots(batch: int, keys: int, layers: int, dtype: torch.dtype, shuffled: bool):
    num_blocks = batch * keys // BLOCK
    pools = [tuple(torch.randn(num_blocks, BLOCK, HKV, HEAD_DIM).to(dtype) for _ in range(2))
             for _ in range(layers)]
    order = torch.randperm(num_blocks) if shuffled else torch.arange(num_blocks)
    slots = (order.view(batch, keys // BLOCK).unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).view(batch, keys)
    return pools, slots.contiguous()


def per_layer_s(ext, q, pools, slots, num_keys, num_sink, repeats: int) -> tuple[float, float]:
    """(cold, warm) medians of seconds per call over `repeats` passes."""
    cold, warm = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for k, v in pools:
            ext.paged_decode_attention(q, None, k, v, slots, num_keys, num_sink, HEAD_DIM ** -0.5, 0.0)
        cold.append((time.perf_counter() - start) / len(pools))
        k, v = pools[0]
        start = time.perf_counter()
        for _ in pools:
            ext.paged_decode_attention(q, None, k, v, slots, num_keys, num_sink, HEAD_DIM ** -0.5, 0.0)
        warm.append((time.perf_counter() - start) / len(pools))
    return statistics.median(cold), statistics.median(warm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--keys", type=int, default=560, help="keys per sequence (a multiple of 16)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ext", type=Path, default=None,
                    help="another build of the kernels (a .so, e.g. a saved copy of the last commit's) to time instead")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode_attention.json")
    args = ap.parse_args()
    from ctxwarden.ext import kernels, load_module

    ext = kernels() if args.ext is None else load_module(args.ext)
    if ext is None:
        raise SystemExit("ext/ is not built: run make install")
    q = torch.randn(args.batch, HQ, HEAD_DIM)
    num_keys = torch.full((args.batch,), args.keys, dtype=torch.long)
    num_sink = torch.zeros(args.batch, dtype=torch.long)
    rows, bandwidth = [], read_bandwidth_gbs()
    for dtype in (torch.float32, torch.bfloat16):
        for shuffled in (False, True):
            pools, slots = pools_and_slots(args.batch, args.keys, args.layers, dtype, shuffled)
            cold, warm = per_layer_s(ext, q, pools, slots, num_keys, num_sink, args.repeats)
            mb = sum(t.numel() * t.element_size() for t in pools[0]) / 1e6
            rows.append({"kv_dtype": str(dtype).removeprefix("torch."), "shuffled": shuffled, "kv_mb_per_layer": mb,
                         "cold_ms": 1e3 * cold, "warm_ms": 1e3 * warm, "cold_gbs": mb / cold / 1e3})
            print(f"{rows[-1]['kv_dtype']:8s} pages {'shuffled' if shuffled else 'in order'}: cold {1e3 * cold:.2f} ms "
                  f"({mb / cold / 1e3:.1f} GB/s of {mb:.1f} MB), warm {1e3 * warm:.2f} ms per layer "
                  f"(a buffer sum: {bandwidth:.1f} GB/s)", flush=True)
    args.out.write_text(json.dumps({"batch": args.batch, "keys": args.keys, "layers": args.layers,
                                    "heads": [HQ, HKV, HEAD_DIM], "read_bandwidth_gbs": bandwidth,
                                    "threads": torch.get_num_threads(), "rows": rows,
                                    "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))


if __name__ == "__main__":
    main()
