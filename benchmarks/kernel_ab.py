"""A variant of kernels.cpp against the installed build, in one process, interleaved rounds.

A change to a kernel is worth a few percent; two processes minutes apart differ by more
than that on a shared host. This builds the variant (a copy of kernels.cpp edited
elsewhere) under another module name, loads it beside the installed build, and times
both on the same inputs, alternating, taking each side's minimum over --rounds:

- `gemm`: one SmolLM2 layer's four projections (q4 weights, int8 activations:
  `quantized_linear_int8`, with the weights packed by `q4_panels` for a build that has
  them) at each of --rows, after checking that both builds give the same bits
  (--no-check to time a deliberately wrong variant);
- `lm_head`: SmolLM2's q8 lm_head [49152, 576] at each of --rows (q8_panels likewise);
- `attention`: paged decode attention at W1's batched-decode shape (benchmarks/
  decode_attention.py's pools), cold, fp32 and bf16 K/V, outputs checked likewise.
- `prefill`: ext's flash attention (`prefill_attention`) with SmolLM2's heads at --rows
  causal queries (a chunk over as many cached keys as it has queries), fp32, and with
  bf16 dot products where both builds have them (`has_bf16_attention`), checked likewise.

Run: .venv/bin/python benchmarks/kernel_ab.py VARIANT_DIR [--what gemm,lm_head,attention,prefill]
     [--rows 1,4,16,512,2048] [--rounds 9]
VARIANT_DIR holds the edited kernels.cpp; the build goes there too (about a minute), and
is reused while kernels.cpp there is older than the build.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import time
from pathlib import Path

import torch

VARIANT = "ctxwarden_kernels_ab"
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of one SmolLM2 layer


def build_variant(folder: Path):
    """Compile folder/kernels.cpp as module VARIANT (reusing a build newer than the source)."""
    from torch.utils import cpp_extension

    from ctxwarden.ext.build import FLAGS

    source = folder / "kernels.cpp"
    built = sorted(folder.glob(f"{VARIANT}*.so"))
    if not built or built[0].stat().st_mtime < source.stat().st_mtime:
        cpp_extension.load(VARIANT, [str(source)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(folder))
        built = sorted(folder.glob(f"{VARIANT}*.so"))
    loader = importlib.machinery.ExtensionFileLoader(VARIANT, str(built[0]))
    spec = importlib.util.spec_from_file_location(VARIANT, built[0], loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def q4_weight(n: int, k: int):
    """Random q4 codes, fp16 scales and zero points of SmolLM2's magnitudes."""
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scale = (torch.rand(n, k // 32) * 0.01 + 0.001).half()
    zero = (-8 * scale.float() + torch.randn(n, k // 32) * 1e-3).half()
    return codes, scale, zero


def interleaved(fns: dict, rounds: int) -> dict[str, float]:
    """Each side's minimum seconds over `rounds` alternating calls (after one warm-up each)."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for i in range(rounds):
        for name in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            start = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def report(label: str, best: dict[str, float]) -> None:
    base, var = best["installed"], best["variant"]
    print(f"{label:34s} installed {1e3 * base:9.3f} ms   variant {1e3 * var:9.3f} ms   "
          f"speedup {base / var:5.3f}x", flush=True)


def ab_gemm(ext, alt, rows: list[int], rounds: int, check: bool) -> None:
    torch.manual_seed(0)
    weights = [q4_weight(o, i) for i, o in SHAPES]
    # a build that packs q4 weights at load (q4_panels) gets them packed, as pack_linear does
    panels = {mod: [mod.q4_panels(*w) if has_panels(mod) else None for w in weights] for mod in (ext, alt)}
    for m in rows:
        xs = {i: torch.randn(m, i) for i, _ in SHAPES}

        def layer(mod):
            if panels[mod][0] is None:
                return lambda: [mod.quantized_linear_int8(xs[c.shape[1] * 2], c, s, z) for c, s, z in weights]
            return lambda: [mod.quantized_linear_int8(xs[c.shape[1] * 2], c, s, z, p)
                            for (c, s, z), p in zip(weights, panels[mod])]

        if check:
            for a, b in zip(layer(ext)(), layer(alt)()):
                if not torch.equal(a, b):
                    raise SystemExit(f"gemm at {m} rows: the variant's output differs (max "
                                     f"{(a - b).abs().max().item():.3g}); --no-check to time it anyway")
        report(f"gemm, 4 projections, {m} rows", interleaved({"installed": layer(ext), "variant": layer(alt)},
                                                             rounds))


def has_panels(mod) -> bool:
    return getattr(mod, "has_panels", lambda: False)()  # builds before the panels lack it


def ab_lm_head(ext, alt, rows: list[int], rounds: int, check: bool) -> None:
    """SmolLM2's tied lm_head as the GGUF has it: q8 [49152, 576], int8 activations."""
    torch.manual_seed(0)
    codes = torch.randint(-127, 128, (49152, 576), dtype=torch.int8)
    scale = (torch.rand(49152, 18) * 0.01 + 0.001).half()
    panels = {mod: (mod.q8_panels(codes, scale) if has_panels(mod) else None)
              for mod in (ext, alt)}
    for m in rows:
        x = torch.randn(m, 576)

        def call(mod):
            return lambda: mod.quantized_linear_int8(x, codes, scale, None, panels[mod])

        if check and not torch.equal(call(ext)(), call(alt)()):
            raise SystemExit(f"lm_head at {m} rows: the variant's output differs; --no-check to time it anyway")
        report(f"lm_head q8, {m} rows", interleaved({"installed": call(ext), "variant": call(alt)}, rounds))


def ab_attention(ext, alt, rounds: int, check: bool, batch: int = 16, keys: int = 560, layers: int = 30) -> None:
    from decode_attention import HEAD_DIM, HQ, pools_and_slots

    q = torch.randn(batch, HQ, HEAD_DIM)
    num_keys = torch.full((batch,), keys, dtype=torch.long)
    num_sink = torch.zeros(batch, dtype=torch.long)
    for dtype in (torch.float32, torch.bfloat16):
        pools, slots = pools_and_slots(batch, keys, layers, dtype, shuffled=True)

        def step(mod):
            return lambda: [mod.paged_decode_attention(q, None, k, v, slots, num_keys, num_sink, HEAD_DIM ** -0.5,
                                                       0.0) for k, v in pools]

        if check:
            for a, b in zip(step(ext)(), step(alt)()):
                if not torch.equal(a, b):
                    raise SystemExit("attention: the variant's output differs; --no-check to time it anyway")
        best = interleaved({"installed": step(ext), "variant": step(alt)}, rounds)
        report(f"decode attention {str(dtype)[6:]}, per layer", {k: v / layers for k, v in best.items()})


def ab_prefill(ext, alt, rows: list[int], rounds: int, check: bool) -> None:
    def has_bf16(mod) -> bool:
        return bool(getattr(mod, "has_bf16_attention", lambda: False)())

    for n in rows:
        m = 2 * n  # a chunk after n cached tokens: n x 2n keys, causal
        q = torch.randn(n, 9, 64) * 2
        k, v = torch.randn(m, 3, 64).bfloat16(), torch.randn(m, 3, 64).bfloat16()
        kf, vf = k.float(), v.float()
        kinds = [("fp32", lambda mod: lambda: mod.prefill_attention(q, kf, vf, m - n, 0, 0, 0.125))]
        if has_bf16(ext) and has_bf16(alt):
            kinds.append(("bf16 dots", lambda mod: lambda: mod.prefill_attention(q, k, v, m - n, 0, 0, 0.125,
                                                                                 None, 0, True)))
        for name, call in kinds:
            if check and not torch.equal(call(ext)(), call(alt)()):
                raise SystemExit(f"prefill {name}: the variant's output differs; --no-check to time it anyway")
            report(f"prefill attention {name}, {n} x {m}", interleaved({"installed": call(ext), "variant": call(alt)},
                                                                       rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant", type=Path, help="folder holding the edited kernels.cpp")
    ap.add_argument("--what", default="gemm,attention")
    ap.add_argument("--rows", default="1,4,16,512,2048")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--no-check", action="store_true", help="time even if the outputs differ")
    args = ap.parse_args()
    from ctxwarden.ext import kernels

    ext = kernels()
    if ext is None:
        raise SystemExit("the installed kernels are not built (or stale): run make install")
    alt = build_variant(args.variant.resolve())
    print(f"threads {torch.get_num_threads()}, {args.rounds} interleaved rounds, min of each", flush=True)
    what = args.what.split(",")
    if "gemm" in what:
        ab_gemm(ext, alt, [int(r) for r in args.rows.split(",")], args.rounds, not args.no_check)
    if "lm_head" in what:
        ab_lm_head(ext, alt, [int(r) for r in args.rows.split(",")], args.rounds, not args.no_check)
    if "attention" in what:
        ab_attention(ext, alt, args.rounds, not args.no_check)
    if "prefill" in what:
        ab_prefill(ext, alt, [int(r) for r in args.rows.split(",")], args.rounds, not args.no_check)


if __name__ == "__main__":
    main()
