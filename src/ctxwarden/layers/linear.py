"""y = x @ W.T with the weight laid out once, at load time, for this CPU.

Three layouts (`LinearWeight.kind`):

- "onednn": an fp32 or bf16 weight reordered ahead of time for oneDNN. Measured on the
  Zen 4 machines (fp32, 30 weights of [3072, 576] in turn, so they come from DRAM as in a
  real forward) it beats `x @ W.t()` (MKL sgemm on a transposed view) at every row count:
  1 row 1.2-1.8x, 16 rows 1.7-2.1x, 2048 rows 1.35-1.5x. On a CPU with AMX, bf16 weights
  run on its tile units (far faster than fp32 at prefill sizes) with fp32 inputs cast to
  bf16 at the call and fp32 outputs.
- "plain": the weight as it is, through `F.linear` (no oneDNN, or another dtype). An fp32
  weight stays plain wherever the ext/ kernels have a vector path: steps of up to
  DENSE_MIN_ROWS rows (decode) then run ext's `dense_linear`, which streams each weight row
  once and beats the reordered weight at 1 row (measured on an AVX2 EPYC, SmolLM2's 120
  projections, passive threads: 17.4 vs 20.8 ms; 2-16 rows level, 32-48 rows 3-6%
  slower), and longer steps `F.linear` (MKL), which on that machine is 0.92x the
  reordered weight's time at 512 and 2,048 rows and 1.1-1.17x at 64-128.
  A bf16 weight in an fp32 model (weights="bf16", dtype fp32) stays plain too: bf16
  storage, fp32 compute. `dense_linear` widens it in registers at decode (half the bytes
  of fp32 streamed, the same fp32 arithmetic), and longer steps widen it to fp32 for one
  `fp32_gemm`, so every step size computes the bf16-rounded weight in fp32 and a recompute
  after preemption reproduces the KV that decode steps wrote (see docs/runner.md).
- "q4" / "q8": group-quantized codes (layers/quant.py) for the ext/ kernels, which take
  fp32 activations and reproduce the dequantized fp32 weight exactly. Steps of many rows
  (prefill) dequantize the weight for the call and run one dense GEMM instead: the
  dequantization is then a few percent of the matmul, and dense GEMMs are far faster per
  row than a dequantizing kernel. A weight loaded with int8 activations
  (weights="auto-int8act") takes the integer kernels at every row count instead (q4:
  the 4 x 2 tiles below 16 rows, the GEMM from 16; on AVX-512 VNNI builds, q4 and q8
  alike, one panel tile at every row count on the weight packed once at load,
  `int8_panels`; all bit-identical to each other): each
  row's result is then the same in any batch and at any step size, so chunking,
  batching and recompute after preemption reproduce one another exactly.

The reordered tensor replaces the plain one (no second copy is kept).

Prefill-sized fp32 GEMMs (more than DENSE_MIN_ROWS rows: a plain fp32 weight, a bf16 one
widened for the call, a quantized one expanded to fp32) run through `fp32_gemm`, which
takes MKL (`F.linear`, what transformers runs) or oneDNN on the plain weight, whichever
`fp32_gemm_backend` measured faster on this CPU when the process first needed one. The
two disagree by fp32 summation order only (4e-6 on a [100, 576] x [576, 960] product of
unit-scale values). Measured on a Zen 5 EPYC (benchmarks/prefill_gemm.py, 2026-12-04):
oneDNN 2.07-2.26x MKL at 64-2,048 rows, a weight reordered ahead 2.25-2.61x (not kept:
it would be a second copy beside the decode kernels' plain one); on the AVX2 EPYC MKL
won by 1.09x. CTXWARDEN_FP32_GEMM=mkl|onednn skips the measurement.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.nn.functional as F

from ctxwarden.ext import has_vector_kernels, kernels
from ctxwarden.layers.quant import GROUP, Q4, QuantizedWeight, dequantize, quantize
from ctxwarden.plan.weights import KernelCaps

# Rows at which a quantized weight is dequantized for one dense GEMM instead of being
# multiplied by the dequantizing kernel; a plain fp32 weight takes ext's dense_linear up
# to this many rows, F.linear above.
DENSE_MIN_ROWS = 48


@dataclass(frozen=True)
class LinearWeight:
    """One projection's weight [out_features, in_features] in its runtime layout."""

    weight: torch.Tensor  # dense (plain or reordered), the quantized codes, or a q4 weight's panels
    is_packed: bool  # reordered for oneDNN
    out_features: int
    in_features: int
    quant: QuantizedWeight | None = None
    dense_dtype: torch.dtype = torch.float32  # dtype a quantized weight is expanded to
    dense_kernel: bool = False  # plain fp32 / bf16, fp32 compute: ext's dense_linear at few rows
    # a weight with int8 activations packed for ext's panel tiles (int8_panels) where the
    # kernels have them (AVX-512 VNNI): it then runs from these at every row count. A q4
    # weight's panels replace its row-major codes (`quant.codes` is empty; `codes_of`
    # unpacks them for the rare reader); a q8 one keeps its codes for the embedding lookup
    panels: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        """'q4' | 'q8' | 'onednn' | 'plain'."""
        if self.quant is not None:
            return self.quant.kind
        return "onednn" if self.is_packed else "plain"

    @property
    def nbytes(self) -> int:
        """Bytes the weight holds in its runtime layout."""
        if self.quant is None:
            return self.weight.nbytes
        return self.quant.nbytes + (self.panels.nbytes if self.panels is not None else 0)


def can_pack(weight: torch.Tensor, dense_dtype: torch.dtype = torch.float32) -> bool:
    """Whether `pack_linear` would reorder this weight for oneDNN: a bf16 weight where oneDNN
    has bf16, an fp32 one where the ext/ kernels have no vector path; neither when the
    ext/ kernels multiply it in fp32 (an fp32 weight, or a bf16 one in an fp32 model)."""
    if (weight.dtype == torch.float32 or dense_dtype == torch.float32) and _has_dense_kernel(weight):
        return False
    return (weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and (weight.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def _has_dense_kernel(weight: torch.Tensor) -> bool:
    """Whether ext's dense_linear takes this weight (fp32 or bf16 [N, K], vector build)."""
    return (weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and weight.device.type == "cpu" and has_vector_kernels())


def pack_linear(weight: torch.Tensor | QuantizedWeight, enabled: bool = True,
                dense_dtype: torch.dtype = torch.float32) -> LinearWeight:
    """Prepare `weight` [out, in] for `linear` (reordered for oneDNN where possible).

    `dense_dtype` is the model's compute dtype. A quantized weight stays quantized when
    the ext/ kernels are built with a vector path (expanded to `dense_dtype` for
    prefill-sized steps); without them it is dequantized here to fp32 and takes the dense
    path: the dequantized model's numbers, at dense speed and size.
    """
    if isinstance(weight, QuantizedWeight):
        out_features, in_features = weight.shape
        if has_vector_kernels():
            if not weight.int8_activations:
                qdense_min_rows()  # times the two q4/q8 paths once per process, sets the faster
            panels = int8_panels(weight)
            if panels is not None and weight.kind == Q4:  # the same bytes: keep one copy
                weight = replace(weight, codes=weight.codes.new_empty((0, in_features // 2)))
                return LinearWeight(panels, False, out_features, in_features, weight, dense_dtype, panels=panels)
            return LinearWeight(weight.codes, False, out_features, in_features, weight, dense_dtype,
                                panels=panels)
        weight = dequantize(weight)
    out_features, in_features = weight.shape
    if enabled and can_pack(weight, dense_dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        return LinearWeight(packed, True, out_features, in_features)
    if _has_dense_kernel(weight) and (weight.dtype == torch.float32 or dense_dtype == torch.float32):
        dense_one_stream(weight.dtype)  # times dense_linear's two one-row orders once per process
        return LinearWeight(weight.contiguous(), False, out_features, in_features, dense_kernel=True)
    return LinearWeight(weight, False, out_features, in_features)


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """x [..., in] -> [..., out] = x @ W.T, in x's dtype."""
    q = w.quant
    if q is not None:
        if x.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous():
            # a decode step's shape: straight to the kernel (the general path's reshapes
            # and casts cost 8-12 us a call, ~1.2 ms of a 120-projection step)
            if q.int8_activations:
                return kernels().quantized_linear_int8(x, q.codes, q.scale, q.zero, w.panels)
            if x.shape[0] < DENSE_MIN_ROWS:
                return (kernels().q4_linear(x, q.codes, q.scale, q.zero) if q.kind == Q4
                        else kernels().q8_linear(x, q.codes, q.scale))
        return _quantized_linear(x, w)
    if w.dense_kernel and x.dtype is torch.float32:
        if x.dim() == 2 and x.shape[0] <= DENSE_MIN_ROWS and x.is_contiguous():
            return kernels().dense_linear(x, w.weight)
        # bf16 storage, fp32 compute (see the docstring)
        return fp32_gemm(x, w.weight.float() if w.weight.dtype is torch.bfloat16 else w.weight)
    if w.is_packed:
        return _bucketed(x, w.weight.dtype, w.out_features, lambda rows: torch.ops.mkldnn._linear_pointwise(
            rows, w.weight, None, "none", [], ""))
    if x.dtype != w.weight.dtype:
        return F.linear(x.to(w.weight.dtype), w.weight).to(x.dtype)
    return F.linear(x, w.weight)


def fp32_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T for an fp32 x and a plain fp32 weight [out, in], on the
    faster of MKL and oneDNN here (`fp32_gemm_backend`); for prefill-sized steps."""
    if x.numel() and fp32_gemm_backend()[0] == "onednn":
        return _bucketed(x, torch.float32, weight.shape[0], lambda rows: torch.ops.mkldnn._linear_pointwise(
            rows.contiguous(), weight, None, "none", [], ""))
    return F.linear(x, weight)


@lru_cache(maxsize=1)
def fp32_gemm_backend() -> tuple[str, float | None]:
    """('mkl' | 'onednn', oneDNN's speed over MKL as measured, or None when not measured).

    Times both on one SmolLM2-sized product ([256, 576] x [576, 1536]), interleaved, 5
    rounds of 2 calls after a warm-up (~40 ms, once per process), and takes oneDNN only
    when its median is under 0.9x MKL's: on a near tie the status quo (MKL, the peer's
    path) stays. $CTXWARDEN_FP32_GEMM (mkl / onednn) decides without measuring.
    """
    forced = os.environ.get("CTXWARDEN_FP32_GEMM", "").strip().lower()
    if forced in ("mkl", "onednn"):
        return ("onednn" if forced == "onednn" and torch.backends.mkldnn.is_available() else "mkl"), None
    if forced:
        raise ValueError(f"CTXWARDEN_FP32_GEMM must be 'mkl' or 'onednn', got {forced!r}; unset it to "
                         "let ctxwarden measure which is faster on this CPU")
    if not torch.backends.mkldnn.is_available():
        return "mkl", None
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 576, generator=g), torch.randn(1536, 576, generator=g)

    def onednn():
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    def mkl():
        return F.linear(x, w)

    ratio = speedup(mkl, onednn)
    return ("onednn" if ratio > 1 / 0.9 else "mkl"), ratio


def speedup(baseline, candidate, rounds: int = 5) -> float:
    """baseline's median time over candidate's: both called once to warm up, then `rounds`
    interleaved rounds of 2 calls each (the per-process choices between two kernels)."""
    times = {baseline: [], candidate: []}
    for fn in times:
        fn()
    for _ in range(rounds):
        for fn, samples in times.items():
            start = time.perf_counter()
            fn(), fn()
            samples.append(time.perf_counter() - start)
    return statistics.median(times[baseline]) / statistics.median(times[candidate])


# Row counts qdense_min_rows times, and its answer for "never" (above any decode batch:
# steps of DENSE_MIN_ROWS rows or more take the dense GEMM).
_QDENSE_TRIAL_ROWS = (8, 16)
QDENSE_NEVER = 1 << 30


@lru_cache(maxsize=1)
def qdense_min_rows() -> tuple[int, dict[int, float] | None]:
    """(rows, {trial rows: panel's speed over the per-tile path}) for ext's q4 / q8 kernels with
    fp32 activations, set in the ext: from `rows` rows of x up a block of weight rows is
    dequantized once into L1 and run through a dense tile (the panel), below them every tile
    of rows dequantizes its own (dot_block). Both give every output the same bits, so this
    is speed only; on a Zen 1 the panel won at 16 rows (1.06-1.12x) and lost at 8
    (0.71-0.99x), and other panel tiles lost on a Zen 3 (kernels.cpp). So it is timed here,
    once per process (at the first quantized weight's load, ~0.2 s): q4_linear on a
    SmolLM2-sized [1536, 576] weight at 8 and 16 rows, both ways interleaved, medians of 15
    rounds of 3 calls (5 rounds flipped the answer on a noisy 2-vCPU host); rows is the
    smallest trial count at which the panel's median wins, QDENSE_NEVER where it wins at
    neither. $CTXWARDEN_QDENSE_MIN_ROWS (a row count, or 0 for never) decides without
    timing. (QDENSE_NEVER, None) when the ext has no vector path.
    """
    ext = kernels()
    if ext is None or not has_vector_kernels():
        return QDENSE_NEVER, None
    forced = os.environ.get("CTXWARDEN_QDENSE_MIN_ROWS", "").strip()
    if forced:
        if not forced.isdigit():
            raise ValueError(f"CTXWARDEN_QDENSE_MIN_ROWS must be a row count (0: never), got {forced!r}; "
                             "unset it to let ctxwarden time both q4/q8 paths on this CPU")
        rows = int(forced) or QDENSE_NEVER
        ext.set_qdense_min_rows(rows)
        return rows, None
    g = torch.Generator().manual_seed(0)
    q = quantize(torch.randn(1536, 576, generator=g) * 0.05, Q4)
    speed = {}
    for m in _QDENSE_TRIAL_ROWS:
        x = torch.randn(m, 576, generator=g)
        times = {1: [], QDENSE_NEVER: []}
        for _ in range(16):  # the first round warms up and is dropped
            for start_rows, samples in times.items():
                ext.set_qdense_min_rows(start_rows)
                start = time.perf_counter()
                for _ in range(3):
                    ext.q4_linear(x, q.codes, q.scale, q.zero)
                samples.append(time.perf_counter() - start)
        speed[m] = statistics.median(times[QDENSE_NEVER][1:]) / statistics.median(times[1][1:])
    rows = next((m for m in _QDENSE_TRIAL_ROWS if speed[m] > 1), QDENSE_NEVER)
    ext.set_qdense_min_rows(rows)
    return rows, speed


DENSE_PROBE_BYTES = 64 << 20  # past a 2-vCPU slice's L3 share: the probe streams from memory


_dense_choice: list[tuple[bool, float | None]] = []  # dense_one_stream's answer, once per process


def dense_one_stream(dtype: torch.dtype = torch.float32) -> tuple[bool, float | None]:
    """(one_stream, one stream's speed over N1 rows as measured) for ext's dense_linear at
    one row of x (a batch-1 decode step's fp32 / bf16 projections), set in the ext.

    A weight can be read one row at a time (one sequential stream) or N1 rows side by side
    (N1 streams). Both give each output the same bits, so this is speed only, and the
    winner depends on the CPU's prefetchers: on a Zen 4 EPYC one stream took SmolLM2's fp32
    batch-1 step from 21.8 to 19.7 ms and its bf16 one from 14.5 to 10.6 (kernels.cpp). So
    it is timed here, once per process, at the first plain weight's load (~0.1 s):
    dense_linear on a 64 MiB weight of `dtype` (larger than the last-level cache a 2-vCPU
    share sees, so it streams from memory as a model's weights do), both ways interleaved,
    medians of 9 rounds after a warm-up; one stream is taken when its median is faster.
    $CTXWARDEN_DENSE_ONE_STREAM (1 / 0) decides without timing. (False, None) when the ext
    has no vector path. The first call decides (the flag is one per process, whatever the
    weight's dtype).
    """
    if not _dense_choice:
        _dense_choice.append(_time_dense_one_stream(dtype))
    return _dense_choice[0]


def _time_dense_one_stream(dtype: torch.dtype) -> tuple[bool, float | None]:
    ext = kernels()
    if ext is None or not has_vector_kernels() or not hasattr(ext, "set_dense_one_stream"):
        return False, None
    forced = os.environ.get("CTXWARDEN_DENSE_ONE_STREAM", "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"CTXWARDEN_DENSE_ONE_STREAM must be 1 (one row at a time) or 0 (several rows "
                             f"side by side), got {forced!r}; unset it to let ctxwarden time both on this CPU")
        ext.set_dense_one_stream(forced == "1")
        return forced == "1", None
    k = 576
    w = torch.empty(DENSE_PROBE_BYTES // (k * torch.empty((), dtype=dtype).element_size()), k, dtype=dtype)
    w.fill_(0.01)
    x = torch.full((1, k), 0.5)
    times = {False: [], True: []}
    for i in range(10):  # the first round warms up and is dropped
        for mode in ((False, True) if i % 2 == 0 else (True, False)):
            ext.set_dense_one_stream(mode)
            start = time.perf_counter()
            ext.dense_linear(x, w)
            times[mode].append(time.perf_counter() - start)
    ratio = statistics.median(times[False][1:]) / statistics.median(times[True][1:])
    ext.set_dense_one_stream(ratio > 1)
    return ratio > 1, ratio


# oneDNN caches one primitive (with its scratch memory) per distinct input shape, up to
# 1,024 by default: a server that sees every prompt length grows by megabytes per new
# length for hours (issue 17). Steps of more than BUCKET_ROWS rows are padded up to a
# multiple of it, so at most max_batched_tokens / 64 large shapes exist per weight; the
# padding costs under 64 rows of a step of >= 64 (at 2048 rows, at most 3%).
BUCKET_ROWS = 64


def _bucketed(x: torch.Tensor, dtype: torch.dtype, out_features: int, matmul) -> torch.Tensor:
    """matmul(rows) on x's rows cast to `dtype`, row count padded to a bucket; x's dtype out."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = -(-n // BUCKET_ROWS) * BUCKET_ROWS if n > BUCKET_ROWS else n
    if padded != n or rows.dtype != dtype:
        staged = rows.new_zeros((padded, rows.shape[1]), dtype=dtype)
        staged[:n] = rows
        rows = staged
    out = matmul(rows)[:n]
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def _quantized_linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    rows = x.reshape(-1, w.in_features)
    q = w.quant
    if q.int8_activations:  # every step size: a row's result never depends on its batch
        out = kernels().quantized_linear_int8(rows.float().contiguous(), q.codes, q.scale, q.zero, w.panels)
        return out.to(x.dtype).reshape(*x.shape[:-1], w.out_features)
    if rows.shape[0] >= DENSE_MIN_ROWS:
        dense = dense_weight(w)
        if dense.dtype is torch.float32 and x.dtype is torch.float32:
            return fp32_gemm(x, dense)
        return _bucketed(x, dense.dtype, w.out_features, lambda r: F.linear(r, dense))
    rows = rows.float().contiguous()
    ext = kernels()
    out = (ext.q4_linear(rows, q.codes, q.scale, q.zero) if q.kind == Q4
           else ext.q8_linear(rows, q.codes, q.scale))
    return out.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


def decode_kernel(w: LinearWeight) -> tuple[int, list[torch.Tensor]] | None:
    """The ext/ kernel `linear` runs for `w` at a decode step, as ext's decode_layer names
    it: (mode, 3 tensors; unused slots empty), or None where there is none (a reordered
    weight). Modes: 0 / 5 dense_linear on an fp32 / bf16 weight, 1 q4_linear, 2 q8_linear,
    3 / 4 quantized_linear_int8 on q4 / q8 codes, 6 on a q4 weight's panels."""
    q, empty = w.quant, torch.empty(0)
    if w.panels is not None and q.kind == Q4:  # q8's panel tile is not in the stack: mode 4
        return 6, [w.panels, q.scale, empty]
    if q is not None:
        mode = (3 if q.kind == Q4 else 4) if q.int8_activations else (1 if q.kind == Q4 else 2)
        return mode, [q.codes, q.scale, q.zero if q.zero is not None else empty]
    if w.dense_kernel:
        return (0 if w.weight.dtype == torch.float32 else 5), [w.weight, empty, empty]
    return None


def kernel_caps() -> KernelCaps:
    """What pack_linear does on this machine, for the planner's runtime layout (plan/weights.py)."""
    ext = kernels()
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return KernelCaps(vector=has_vector_kernels(), panels=bool(ext is not None and ext.has_panels()),
                      onednn_bf16=bool(onednn_bf16))


def int8_panels(q: QuantizedWeight) -> torch.Tensor | None:
    """`q` packed for ext's panel tiles, where it runs from them: a weight with int8
    activations on a build that has the tiles (AVX-512 VNNI). The panels hold the codes
    and scales again in the tiles' order (q4: the same bytes; q8: 4 more per group, its
    -128 sum(w)); the row-major codes stay for everything else that reads them (the
    embedding lookup of a tied lm_head, dequantization). None elsewhere."""
    ext = kernels()
    if not q.int8_activations or ext is None or not ext.has_panels():
        return None
    return ext.q4_panels(q.codes, q.scale, q.zero) if q.kind == Q4 else ext.q8_panels(q.codes, q.scale)


def unpack_q4_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The row-major q4 codes uint8 [n, k / 2] that `panels` (ext's q4_panels) hold.

    A panel of 16 weight rows holds, per group of 32, 4 blocks of 64 bytes (block j: bytes
    4j..4j+3 of each of the 16 rows' group, row c at 4c) and then the 16 rows' fp16 scales
    and zero points (kernels.cpp, pack_q4_panels_range).
    """
    groups = k // GROUP
    blocks = panels.view(panels.shape[0], groups, -1)[:, :, :4 * 64]
    codes = blocks.reshape(-1, groups, 4, 16, 4).permute(0, 3, 1, 2, 4)  # [panel, row, group, j, byte]
    return codes.reshape(-1, k // 2)[:n].contiguous()


def codes_of(w: LinearWeight) -> QuantizedWeight:
    """`w.quant` with its row-major codes (unpacked from the panels where they were dropped)."""
    q = w.quant
    if q.has_codes:
        return q
    return replace(q, codes=unpack_q4_panels(w.panels, w.out_features, w.in_features))


def dense_weight(w: LinearWeight) -> torch.Tensor:
    """The weight as a dense [out, in] tensor (a temporary for quantized layouts)."""
    if w.quant is None:
        return w.weight
    q = codes_of(w)
    if q.kind == Q4 and kernels() is not None and w.dense_dtype in (torch.float32, torch.bfloat16):
        return kernels().q4_dequantize(q.codes, q.scale, q.zero, w.dense_dtype == torch.bfloat16)
    return dequantize(q).to(w.dense_dtype)
