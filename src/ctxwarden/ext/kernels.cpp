// ctxwarden's CPU kernels: quantized linear layers with fp32 activations and paged decode
// attention that reads K/V pages where they lie. Built by `make install` with the machine's
// compiler (torch.utils.cpp_extension, -O3 -march=native); ctxwarden falls back to plain
// torch ops when this extension is absent.
//
// Why fp32 activations: a GGUF's Q4_1 / Q8_0 weights dequantize to exact fp32 values
// (d * q + m); multiplying them with fp32 activations reproduces the dequantized fp32
// model up to summation order, so quantized storage costs no accuracy at all. torch's own
// int4 / int8 CPU kernels are fast only with bf16 activations.
//
// Layouts (groups of 32 along the input dimension K, G = K / 32):
//   q4: codes uint8 [N, K/2]; group g of row n is 16 bytes, element i < 16 in the low
//       nibble of byte i, element 16 + i in its high nibble (GGUF's Q4_0/Q4_1 order);
//       scale, zero fp16 [N, G] (as GGUF stores them): w = scale * code + zero.
//   q8: codes int8 [N, K], scale fp16 [N, G]: w = scale * code.
//   KV pool: [num_blocks, block_size, num_kv_heads, head_dim] fp32 or bf16; a key is one
//       flat slot (block * block_size + offset).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

// ---- AMX (Intel's tile units), where the build and the kernel have them ----------------
// Eight tile registers of up to 16 rows x 64 bytes, configured per thread (a palette of
// shapes, _tile_loadconfig); TDPBF16PS adds a 16 x 32 bf16 tile (A) times a 32 x 16 one
// held as 16 rows of pairs (B) into a 16 x 16 fp32 tile, 8,192 multiply-adds an
// instruction. Linux hands a process the tiles only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); where that is refused the AVX-512 paths run.
#if defined(__AMX_TILE__) && defined(__linux__) && defined(__AVX512F__)
#define CW_AMX 1
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#else
#define CW_AMX 0
#endif
std::atomic<bool> g_amx_enabled{true};
// Whether the kernels may run on AMX tiles: a build with them, the kernel granted them, and
// not switched off (set_amx(false): the AVX-512 paths, e.g. to measure one against the other).
bool use_amx() {
#if CW_AMX
  return g_amx_enabled.load(std::memory_order_relaxed) && amx_ready();
#else
  return false;
#endif
}

inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// ---- 16 fp32 lanes: one zmm register on AVX-512, two ymm registers on AVX2 + FMA ----
// Every vectorized kernel below is written once against V16; CW_SIMD says which set this
// build has (0: none, the scalar loops run; the Python side then keeps no quantized
// weights, see simd_level()).
#if defined(__AVX512F__)
#define CW_SIMD 2
struct V16 { __m512 v; };
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 vload(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline void vstore(float* p, V16 x) { _mm512_storeu_ps(p, x.v); }
inline V16 vfmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline float vsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vhmax(V16 a) { return _mm512_reduce_max_ps(a.v); }
// whether any lane is above x
inline bool vany_gt(V16 a, float x) { return _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(x), _CMP_GT_OQ) != 0; }
// whether any lane is NaN
inline bool vany_nan(V16 a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q) != 0; }
// 16 unsigned bytes (in a register) / 16 signed bytes (at p), widened to fp32
inline V16 vfrom_u8(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }
inline V16 vfrom_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// e^x for x <= 0 (scores minus their max): 2^(x log2 e) split as 2^n * 2^f, |f| <= 1/2,
// 2^f by its Taylor series to degree 7 (relative error < 2e-8 on that range).
// x is clamped at kExpFloor: e^-86 = 4.5e-38 is still a normal float. The clamp was -100,
// whose e^x (3.7e-44) is denormal, and a denormal result costs a microcode assist per
// vector: the masked lanes of a block (-inf, zeroed after) paid it on every row. With the
// 4 sinks of StreamingLLM (60 masked lanes per row in the sinks' block) prefill attention
// ran 1.29-1.44x the window-only time on an Intel Xeon; an e^x below 4.5e-38 next to the
// row's max (e^0 = 1) vanishes in any fp32 or bf16 sum either way.
constexpr float kExpFloor = -86.f;
inline V16 vexp_nonpositive(V16 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x.v, _mm512_set1_ps(kExpFloor)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return {_mm512_scalef_ps(p, n)};
}
// vexp_nonpositive to 3.6e-6 relative (a degree-4 least-squares fit of e^g on |g| <= ln 2 / 2
// for the Taylor series): softmax weights that are rounded to bf16 (2^-9) next.
inline V16 vexp_nonpositive_coarse(V16 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x.v, _mm512_set1_ps(kExpFloor)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(0.041917529687968275f);
  for (float c : {0.16792160974653284f, 0.4999886910881161f, 0.9999622784754362f, 1.00000007549535f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return {_mm512_scalef_ps(p, n)};
}
#if defined(__AVX512BF16__)
inline void vstore(at::BFloat16* dst, V16 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x.v)));
}
#define CW_NATIVE_BF16_STORE 1
#endif
// dot_block's register tile: 4 weight rows x 3 input rows x 2 halves = 24 of 32 zmm
#define CW_TILE_N_DEFAULT 4
#define CW_TILE_M_DEFAULT 3
// At one row of x, 2 weight rows per tile: on a Zen 4 EPYC (SmolLM2's 120 q4 projections
// with fp32 activations, passive, minima of 21 interleaved rounds, same bits) 7.8-8.1 ms
// against 8.3-8.8 at 4 (1.07-1.09x), 10.1 at 1, 8.7 at 8; the q8 lm_head 1.02x.
#define CW_TILE_N1_DEFAULT 2

#elif defined(__AVX2__) && defined(__FMA__)
#define CW_SIMD 1
struct V16 { __m256 a, b; };
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline V16 vload(const at::BFloat16* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline void vstore(float* p, V16 x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
inline V16 vfmadd(V16 x, V16 y, V16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline V16 vmul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline V16 vadd(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline V16 vsub(V16 x, V16 y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
// 8 lanes reduced by op (add, max) in one fixed tree: halves, then pairs, then the last two.
template <typename Op, typename OpScalar>
inline float hreduce8(__m256 s, Op op, OpScalar op_last) {
  __m128 h = op(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = op(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(op_last(h, _mm_movehdup_ps(h)));
}
inline float vsum(V16 x) {
  return hreduce8(_mm256_add_ps(x.a, x.b), [](__m128 a, __m128 b) { return _mm_add_ps(a, b); },
                  [](__m128 a, __m128 b) { return _mm_add_ss(a, b); });
}
inline V16 vmax(V16 x, V16 y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
inline float vhmax(V16 x) {
  return hreduce8(_mm256_max_ps(x.a, x.b), [](__m128 a, __m128 b) { return _mm_max_ps(a, b); },
                  [](__m128 a, __m128 b) { return _mm_max_ss(a, b); });
}
inline bool vany_gt(V16 x, float y) {
  const __m256 t = _mm256_set1_ps(y);
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x.a, t, _CMP_GT_OQ), _mm256_cmp_ps(x.b, t, _CMP_GT_OQ))) != 0;
}
inline bool vany_nan(V16 x) {
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x.a, x.a, _CMP_UNORD_Q), _mm256_cmp_ps(x.b, x.b, _CMP_UNORD_Q))) != 0;
}
inline V16 vfrom_u8(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 vfrom_i8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
// As the AVX-512 one, with 2^n built in the exponent bits (x clamped to -87 so that n >= -126
// stays a normal float; e^-87 ~ 1.6e-38 is as good as zero next to the maximum's 1).
inline __m256 exp8_nonpositive(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline V16 vexp_nonpositive(V16 x) { return {exp8_nonpositive(x.a), exp8_nonpositive(x.b)}; }
// dot_block's tile on 16 ymm registers: 1 weight row x 4 input rows, one accumulator chain
// per (weight row, input row) for both halves of a group (CW_ONE_CHAIN). Measured on an
// AVX2 EPYC, q4 [1536, 576] from L3, one thread, us per call at 1 / 4 / 16 rows: 1x4
// 152-155 / 180-182 / 643-871; 2x2 151 / 233 / 867; 4x1 179 / 366 / 1437. Two threads,
// two chains vs one: 79 / 127 / 406 vs 82 / 101 / 365; 1x6 and 1x7 with one chain spill.
#define CW_TILE_N_DEFAULT 1
#define CW_TILE_M_DEFAULT 4
#define CW_TILE_N1_DEFAULT 1

#else
#define CW_SIMD 0
#endif

#if CW_SIMD
#if !defined(CW_TILE_N)  // -DCW_TILE_N=.. -DCW_TILE_M=.. to measure other tiles
#define CW_TILE_N CW_TILE_N_DEFAULT
#define CW_TILE_M CW_TILE_M_DEFAULT
#endif
#if !defined(CW_TILE_N1)  // weight rows per tile at one row of x
#define CW_TILE_N1 CW_TILE_N1_DEFAULT
#endif
constexpr int kTileN = CW_TILE_N, kTileM = CW_TILE_M, kTileN1 = CW_TILE_N1;

// The 32 codes of one q4 group as fp32 integers 0-15 in two vectors (elements 0-15, 16-31):
// each byte widened to a 32-bit lane straight from memory, then its two nibbles taken
// there (an and, a shift), which is 2 shuffles per group where widening the masked bytes
// from a register took 6 (q4 at one row: 4.0 -> 2.5 ns a group, measured on the AVX2 EPYC).
inline void codes_q4(const uint8_t* codes, V16& lo, V16& hi) {
#if CW_SIMD == 2
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  lo = {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)))};
  hi = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
#else
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8)));
  const __m256i m4 = _mm256_set1_epi32(0x0F);
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, m4)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, m4))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
#endif
}

// The 32 dequantized weights of one q4 group, fma(c, s, z), as two vectors (elements 0-15,
// 16-31). Under AVX-512 the group's 16 possible values are made first (one fma of 0..15)
// and each code looks its value up (vpermps reads an index's low 4 bits: the low nibble
// needs no mask, the high one a shift): one fma and two permutes where converting the codes
// took two conversions and two fmas. The same fma of the same numbers, so the same bits.
// On a Zen 4 EPYC (one thread, SmolLM2's q4 projections at one row, from L2 and from DRAM)
// 1.13-1.16x; the 120 projections with 2 threads 8.62 -> 7.88 ms.
inline void dequant_q4(const uint8_t* codes, V16 s, V16 z, V16& lo, V16& hi) {
#if CW_SIMD == 2
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512 values = _mm512_fmadd_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), s.v, z.v);
  lo = {_mm512_permutexvar_ps(b, values)};
  hi = {_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values)};
#else
  codes_q4(codes, lo, hi);
  lo = vfmadd(lo, s, z);
  hi = vfmadd(hi, s, z);
#endif
}
inline void dequant_q4(const uint8_t* codes, float scale, float zero, V16& lo, V16& hi) {
  dequant_q4(codes, vset1(scale), vset1(zero), lo, hi);
}

inline void codes_q8(const int8_t* codes, V16& lo, V16& hi) {
#if CW_SIMD == 2
  lo = vfrom_i8(codes);
  hi = vfrom_i8(codes + 16);
#else
  auto widen8 = [](const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  };
  lo = {widen8(codes), widen8(codes + 8)};
  hi = {widen8(codes + 16), widen8(codes + 24)};
#endif
}
// q8: s * c (exact in fp32: an fp16 scale's 11 bits times 8).
inline void dequant_q8(const int8_t* codes, V16 s, V16& lo, V16& hi) {
  codes_q8(codes, lo, hi);
  lo = vmul(lo, s);
  hi = vmul(hi, s);
}

// A row-major q4 / q8 weight's codes as dot_block and dequant_block read them.
struct Q4RowCodes {
  const uint8_t* codes;
  int64_t row_bytes;  // K / 2
  const uint8_t* at(int64_t j, int64_t g) const { return codes + j * row_bytes + g * 16; }
  void operator()(int64_t j, int64_t g, V16 s, V16 z, V16& lo, V16& hi) const { dequant_q4(at(j, g), s, z, lo, hi); }
};
struct Q8RowCodes {
  const int8_t* codes;
  int64_t row_bytes;  // K
  const int8_t* at(int64_t j, int64_t g) const { return codes + j * row_bytes + g * kGroup; }
  void operator()(int64_t j, int64_t g, V16 s, V16, V16& lo, V16& hi) const { dequant_q8(at(j, g), s, lo, hi); }
};

// n fp16 values -> fp32 (F16C, eight at a time).
inline void widen_halves(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

inline V16 vbroadcast(const float* p) {
#if CW_SIMD == 2
  return {_mm512_set1_ps(*p)};
#else
  const __m256 v = _mm256_broadcast_ss(p);
  return {v, v};
#endif
}


#if !defined(CW_NATIVE_BF16_STORE)
inline void vstore(at::BFloat16* dst, V16 x) {
  alignas(64) float tmp[16];
  vstore(tmp, x);
  for (int i = 0; i < 16; ++i) dst[i] = static_cast<at::BFloat16>(tmp[i]);
}
#endif

// y[m0..m0+R, n0..n0+NB] for R rows of x and NB weight rows: each group of each weight
// row is dequantized once (s * c + z, q8: z = 0; the fp16 scales widened a chunk at a
// time, then broadcast from memory) and used by R rows. Every (weight row, x row) is
// computed the same way in every tile shape, so a row's result does not depend on how many
// rows came with it.
constexpr int64_t kScaleChunk = 64;  // groups whose fp16 scales are widened at once

// Each weight row's codes are asked for CW_PF bytes ahead of where they are read (a
// prefetch every second group: a q8 group is 32 bytes, a q4 one 16). The hardware
// prefetchers alone left the tile waiting on memory: on a Zen 4 EPYC (2 threads, passive,
// minima of 9 interleaved rounds, every weight from DRAM) SmolLM2's q8 lm_head at one row
// took 2.07-2.22 ms without and 1.53-1.62 with it (4 KiB ahead 1.60, 16 KiB 1.55; the
// scales prefetched too gained nothing), its 120 q4 projections 7.4-7.9 -> 6.6-6.8 ms.
// The int8 panels (one sequential stream) and dense_linear gained nothing from the same.
#if !defined(CW_PF)
#define CW_PF 8192
#endif
inline void prefetch_ahead(const void* p) {
  if (CW_PF > 0) _mm_prefetch(static_cast<const char*>(p) + CW_PF, _MM_HINT_T0);
}

// Not inlined: inlined into its callers, GCC spilled the R = 4 tile's accumulators to the
// stack (q8 at 4 rows ran 1.2x slower than this function called as it is).
// Codes: codes.at(j, g) -> where group g of weight row j starts; codes(j, g, s, z, lo, hi)
// -> its 32 dequantized weights (q4 / q8 below).
template <int NB, int R, bool Zero, typename Codes>
[[gnu::noinline]] void dot_block(const float* x, int64_t k, int64_t m0, int64_t n0, int64_t groups, Codes codes,
                      const at::Half* sp, const at::Half* zp, float* y, int64_t ldy) {
  // At one row of x a group's two scalar fp16 conversions are a fifth of its work, so the
  // scales are widened eight at a time first; with R rows sharing them that costs more than
  // it saves (a tile's setup against 18 groups' work at K = 576).
  constexpr bool kWiden = R == 1;
  constexpr int64_t kChunk = kWiden ? kScaleChunk : (int64_t{1} << 40);
  V16 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = vzero();
  alignas(64) float sc[NB][kWiden ? kScaleChunk : 1], zc[NB][kWiden && Zero ? kScaleChunk : 1];
  for (int64_t g0 = 0; g0 < groups; g0 += kChunk) {
    const int64_t ge = std::min(groups, g0 + kChunk);
    if (kWiden)
      for (int b = 0; b < NB; ++b) {
        widen_halves(sp + (n0 + b) * groups + g0, ge - g0, sc[b]);
        if (Zero) widen_halves(zp + (n0 + b) * groups + g0, ge - g0, zc[b]);
      }
    for (int64_t g = g0; g < ge; ++g) {
      V16 lo[NB], hi[NB];
      if (g % 2 == 0)
        for (int b = 0; b < NB; ++b) prefetch_ahead(codes.at(n0 + b, g));
      for (int b = 0; b < NB; ++b) {
        const int64_t at = (n0 + b) * groups + g;
        const V16 s = kWiden ? vbroadcast(sc[b] + (g - g0)) : vset1(half_to_float(sp[at]));
        const V16 z = !Zero ? vzero() : kWiden ? vbroadcast(zc[b] + (g - g0)) : vset1(half_to_float(zp[at]));
        codes(n0 + b, g, s, z, lo[b], hi[b]);
      }
      for (int r = 0; r < R; ++r) {
        const float* xr = x + (m0 + r) * k + g * kGroup;
        const V16 xl = vload(xr), xh = vload(xr + 16);
        for (int b = 0; b < NB; ++b) acc[b][r] = vfmadd(hi[b], xh, vfmadd(lo[b], xl, acc[b][r]));
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) y[(m0 + r) * ldy + n0 + b] = vsum(acc[b][r]);
}

// The lanes a dense tile accumulates on: V16 under AVX-512, single ymm registers under
// AVX2 (16 ymm: a V16 takes two, so a V16 tile stops at 2 x 2, while on single ymm lanes a
// 3 x 4 tile fits: 12 accumulators, 3 weights, 1 x, so 7 loads per 12 FMAs).
// V16Lanes (16 lanes, as dot_block sums a group) is what a dequantized q4 / q8 block runs
// on under both, so that its outputs stay bit-identical to dot_block's.
#if CW_SIMD
struct V16Lanes {
  using T = V16;
  static constexpr int64_t kWidth = 16;
  static T zero() { return vzero(); }
  static T load(const float* p) { return vload(p); }
  static T load(const at::BFloat16* p) { return vload(p); }
  static T fma(T a, T b, T c) { return vfmadd(a, b, c); }
  static float sum(T a) { return vsum(a); }
};
#endif
#if CW_SIMD == 2
using DenseLanes = V16Lanes;
#elif CW_SIMD == 1
struct DenseLanes {
  using T = __m256;
  static constexpr int64_t kWidth = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const at::BFloat16* p) { return bf16x8(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(T s) { return vsum(V16{s, _mm256_setzero_ps()}); }
};
#endif

template <int NB, int R, typename L = DenseLanes, typename W>
inline void dense_block(const W* w, int64_t k, const float* x, int64_t m, int64_t n0, float* y, int64_t ldy);

#if CW_SIMD

// From g_qdense_min_rows rows of x up (CW_QDENSE_MIN_ROWS until layers/linear.py has timed
// both paths on this CPU and set it), a block of weight rows is dequantized
// once into an fp32 scratch (4 rows x K: 9 KB at K = 576, in L1) and multiplied by the
// dense fp32 tile, instead of being dequantized again for every 3 rows of x (at 16 rows
// that was 6 dequantizations per weight, more work than the FMAs). The same fp32 values
// (fma(code, scale, zero), rounded once) meet the same x in the same order (each group's
// low 16 then high 16, 16 lanes summed at the end), so each output is bit-identical to
// dot_block's: a row's result still does not depend on its batch. The tile runs on
// V16Lanes under AVX2 as well (two ymm per V16, the order dot_block sums in), not on the
// 8-lane DenseLanes of AVX2's plain fp32 weights, whose sums would differ in the last bit.
#if !defined(CW_QDENSE_MIN_ROWS)
#define CW_QDENSE_MIN_ROWS 8
#endif
// Tile 4 weight rows x 6 rows of x (24 zmm accumulators). Measured on the Zen 5 EPYC,
// SmolLM2's 120 q4 projections, passive threads, medians of 9, ms at 8 / 16 / 32 rows:
// 4 x 6 22.9 / 32.7 / 50.3, 4 x 4 24.4 / 35.1 / 58.3, 2 x 2 30.6 / 45.6 / 76.8, dot_block
// (dequantizing per 3 rows) 28.2 / 36.5 / 56.7. What is left at 16 rows (~100 GFLOP/s
// of the ~400 oneDNN reaches) is mostly the 16-lane horizontal sum each output pays at
// K = 576, the price of keeping every row's summation order the same in any batch.
#if !defined(CW_QDENSE_N)
#if CW_SIMD == 2
#define CW_QDENSE_N 4
#define CW_QDENSE_M 6
#else
// AVX2: 1 weight row x 4 rows of x (8 ymm accumulators, 2 for the weight, 2 for x).
// Measured on an AVX2 EPYC (Zen 1, family 23), the same 120 projections + the Q8_0
// lm_head, passive threads, medians of 11, ms at 8 / 16 rows: 1 x 4 64.8-68.0 /
// 105.9-116.3, 2 x 3 68.7 / 112.0, 3 x 2 66.3 / 110.7, 1 x 5 76.2 / 122.0, 2 x 2 73.8 /
// 124.0, 1 x 3 80.1 / 125.9, 2 x 4 (spills) 94.6 / 172.1; dot_block (dequantizing per 4
// rows) 71.2-72.7 / 137.8-141.5. So 1.22-1.30x at 16 rows (W1's batched decode).
#define CW_QDENSE_N 1
#define CW_QDENSE_M 4
#endif
#endif

// The row count the panel starts at in this process. Both ways give the same bits, so it
// is a speed choice only, and tiles that won on one CPU lost on another (2 x 3 and 3 x 4
// panels lost to dot_block on a Zen 3 AVX2 EPYC): layers/linear.py's qdense_min_rows
// times both here once per process and sets it (set_qdense_min_rows).
std::atomic<int64_t> g_qdense_min_rows{CW_QDENSE_MIN_ROWS};

template <bool Zero, typename Codes>
inline void dequant_block(int64_t n0, int nb, int64_t k, int64_t groups, Codes codes, const at::Half* sp,
                          const at::Half* zp, float* dst) {
  for (int b = 0; b < nb; ++b)
    for (int64_t g = 0; g < groups; ++g) {
      V16 lo, hi;
      const int64_t at = (n0 + b) * groups + g;
      codes(n0 + b, g, vset1(half_to_float(sp[at])), Zero ? vset1(half_to_float(zp[at])) : vzero(), lo, hi);
      vstore(dst + b * k + g * kGroup, lo);
      vstore(dst + b * k + g * kGroup + 16, hi);
    }
}

template <bool Zero, typename Codes>
void dequant_dense_range(const float* x, int64_t m, int64_t k, int64_t n_begin, int64_t n_end, int64_t groups,
                         Codes codes, const at::Half* sp, const at::Half* zp, float* y, int64_t ldy) {
  constexpr int NB = CW_QDENSE_N, R = CW_QDENSE_M;
  thread_local std::vector<float> scratch;
  scratch.resize(NB * k);
  float* w = scratch.data();
  int64_t n0 = n_begin;
  for (; n0 + NB <= n_end; n0 += NB) {
    dequant_block<Zero>(n0, NB, k, groups, codes, sp, zp, w);
    dense_block<NB, R, V16Lanes>(w, k, x, m, 0, y + n0, ldy);
  }
  for (; n0 < n_end; ++n0) {
    dequant_block<Zero>(n0, 1, k, groups, codes, sp, zp, w);
    dense_block<1, 1, V16Lanes>(w, k, x, m, 0, y + n0, ldy);
  }
}
#endif

// Weight rows [n_begin, n_end) against every row of x.
template <bool Zero, typename Codes>
inline void dot_range(const float* x, int64_t m, int64_t k, int64_t n_begin, int64_t n_end, int64_t groups,
                      Codes codes, const at::Half* sp, const at::Half* zp, float* y, int64_t ldy) {
#if CW_SIMD
  if (m >= g_qdense_min_rows.load(std::memory_order_relaxed))
    return dequant_dense_range<Zero>(x, m, k, n_begin, n_end, groups, codes, sp, zp, y, ldy);
#endif
  int64_t n0 = n_begin;
  if (m == 1)
    for (; n0 + kTileN1 <= n_end; n0 += kTileN1) dot_block<kTileN1, 1, Zero>(x, k, 0, n0, groups, codes, sp, zp, y, ldy);
  for (; n0 + kTileN <= n_end; n0 += kTileN) {
    int64_t m0 = 0;
    for (; m0 + kTileM <= m; m0 += kTileM) dot_block<kTileN, kTileM, Zero>(x, k, m0, n0, groups, codes, sp, zp, y, ldy);
    for (; m0 < m; ++m0) dot_block<kTileN, 1, Zero>(x, k, m0, n0, groups, codes, sp, zp, y, ldy);
  }
  for (; n0 < n_end; ++n0)
    for (int64_t m0 = 0; m0 < m; ++m0) dot_block<1, 1, Zero>(x, k, m0, n0, groups, codes, sp, zp, y, ldy);
}

#endif  // CW_SIMD
#if !CW_SIMD
struct DenseLanes {};  // the scalar build's dense tiles do not use lanes
template <int NB, int R, typename L = DenseLanes, typename W>
inline void dense_block(const W* w, int64_t k, const float* x, int64_t m, int64_t n0, float* y, int64_t ldy);
#endif

void check_linear_args(const at::Tensor& x, const at::Tensor& scale, int64_t k) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " features, the weight ", k);
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(scale.dtype() == at::kHalf && scale.is_contiguous(), "scales must be fp16");
}

// Grain of the parallel loop over output features: enough rows that a thread's share
// is worth waking it for (a wake-up costs tens of microseconds under a passive policy).
// 2^(CW_GRAIN_LOG2 + 3) weight-rows per thread at least. AVX2 (half the lanes, so twice
// the time per weight): 2^17 left every projection of SmolLM2's batch-1 decode on one
// thread; 2^14 took its step 29.3 -> 17.9 ms under OMP passive (2^15: 22.1, 2^13: 18.0).
#if !defined(CW_GRAIN_LOG2)
#if CW_SIMD == 2
#define CW_GRAIN_LOG2 17
#else
#define CW_GRAIN_LOG2 14
#endif
#endif
int64_t feature_grain(int64_t m, int64_t k) {
  return std::max<int64_t>(16, (int64_t{1} << CW_GRAIN_LOG2) / std::max<int64_t>(1, m * k / 8));
}

}  // namespace

namespace {

// Weight rows [begin, end) of a q4 weight [N, K] against every row of x [M, K]: y [M, ldy].
void q4_rows(const float* xp, int64_t m, int64_t k, const uint8_t* cp, const at::Half* sp,
             const at::Half* zp, int64_t begin, int64_t end, float* yp, int64_t ldy) {
  const int64_t groups = k / kGroup;
#if CW_SIMD
  const Q4RowCodes codes{cp, k / 2};
  dot_range<true>(xp, m, k, begin, end, groups, codes, sp, zp, yp, ldy);
#else
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = cp + j * (k / 2);
    const at::Half *rs = sp + j * groups, *rz = zp + j * groups;
    for (int64_t r = 0; r < m; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g)
        for (int i = 0; i < 16; ++i) {
          uint8_t b = row[g * 16 + i];
          const float s = rs[g], z = rz[g];
          acc += (s * (b & 0x0F) + z) * xp[r * k + g * kGroup + i];
          acc += (s * (b >> 4) + z) * xp[r * k + g * kGroup + 16 + i];
        }
      yp[r * ldy + j] = acc;
    }
  }
#endif
}

// The same for a q8 weight [N, K].
void q8_rows(const float* xp, int64_t m, int64_t k, const int8_t* cp, const at::Half* sp,
             int64_t begin, int64_t end, float* yp, int64_t ldy) {
  const int64_t groups = k / kGroup;
#if CW_SIMD
  const Q8RowCodes codes{cp, k};
  dot_range<false>(xp, m, k, begin, end, groups, codes, sp, nullptr, yp, ldy);
#else
  for (int64_t j = begin; j < end; ++j) {
    const int8_t* row = cp + j * k;
    const at::Half* rs = sp + j * groups;
    for (int64_t r = 0; r < m; ++r) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc += static_cast<float>(rs[i / kGroup]) * row[i] * xp[r * k + i];
      yp[r * ldy + j] = acc;
    }
  }
#endif
}

}  // namespace

// y [M, N] = x [M, K] @ dequant(q4 weight)^T, fp32 throughout.
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& zero) {
  const int64_t n = codes.size(0), k = codes.size(1) * 2, m = x.size(0);
  check_linear_args(x, scale, k);
  TORCH_CHECK(codes.dtype() == at::kByte && codes.is_contiguous(), "q4 codes must be uint8");
  TORCH_CHECK(zero.dtype() == at::kHalf && zero.is_contiguous(), "zeros must be fp16");
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half *sp = scale.data_ptr<at::Half>(), *zp = zero.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, feature_grain(m, k), [&](int64_t begin, int64_t end) {
    q4_rows(xp, m, k, cp, sp, zp, begin, end, yp, n);
  });
  return y;
}

// y [M, N] = x [M, K] @ dequant(q8 weight)^T, fp32 throughout.
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  const int64_t n = codes.size(0), k = codes.size(1), m = x.size(0);
  check_linear_args(x, scale, k);
  TORCH_CHECK(codes.dtype() == at::kChar && codes.is_contiguous(), "q8 codes must be int8");
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, feature_grain(m, k), [&](int64_t begin, int64_t end) {
    q8_rows(xp, m, k, cp, sp, begin, end, yp, n);
  });
  return y;
}

// ---- int8 activations: integer dot products (weights="auto-int8act") --------------------
// Each row of x is quantized per group of 32: d = max|x| / 127, q = round(x / d) in int8, and
// the group's exact fp32 sum is kept for q4's zero point. A group's product is then one
// integer dot product (vpmaddubsw: unsigned weight codes x signed activations, pairs summed
// to int16; vpmaddwd: to int32), scaled once: y += d_w d_x sum(c q) (+ z_w sum(x) for q4).
// That is llama.cpp's method for its quantized matmuls (its own code is not used here); it
// costs the activations' rounding (|x - d q| <= d / 2) and buys about half the instructions
// per weight. Written in AVX2 instructions, which every AVX-512 CPU has too.
#if !defined(CW_I8_GEMM_MIN_ROWS)
#define CW_I8_GEMM_MIN_ROWS 16
#endif
// Rows at which quantized_linear_int8 takes the q4 GEMM (below: dot_block_i8's tiles);
// set_i8_gemm_min_rows changes it (benchmarks/prefill_gemm.py times both side by side).
namespace {
std::atomic<int64_t> g_gemm_min_rows{CW_I8_GEMM_MIN_ROWS};
inline int64_t gemm_min_rows() { return g_gemm_min_rows.load(std::memory_order_relaxed); }
}  // namespace

#if CW_SIMD
namespace {

struct Int8Rows {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, G]
  std::vector<float> sum;  // [M, G] d * sum(q): the rounded group's sum
};

inline float hmax8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

inline float hsum8f(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// 32 fp32 -> 32 int8 codes (in order), their scale and their sum.
inline void quantize_group(const float* x, int8_t* q, float* d, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  const float amax = hmax8(m), scale = amax / 127.f;
  *d = scale;
  const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.f / amax : 0.f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // nearest
  // the codes' sum, not x's: then q4's zero-point term z d sum(q) makes the group's result
  // exactly sum((s c + z) d q), the dequantized weight against the rounded x (half the
  // error of using sum(x), whose rounding would then meet s c alone, which spans max - min)
  const __m256i cs = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  *sum = scale * hsum8f(_mm256_cvtepi32_ps(cs));
  // packs interleave 128-bit lanes: [0-3 8-11 | 4-7 12-15] etc.; the permute restores order
  const __m256i w01 = _mm256_packs_epi32(c[0], c[1]), w23 = _mm256_packs_epi32(c[2], c[3]);
  const __m256i b = _mm256_packs_epi16(w01, w23);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, order));
}

// paired: each pair of groups (2p, 2p + 1) of a row stored as their first halves, then their
// second halves, 64 bytes: [2p: 0-15 | 2p+1: 0-15 | 2p: 16-31 | 2p+1: 16-31], the order in
// which one 32-byte load of two q4 groups' codes yields its low and high nibbles (an odd
// last group stays as it is).
void quantize_row_range(const float* xp, int64_t k, int64_t r0, int64_t r1, Int8Rows& out, bool paired) {
  const int64_t groups = k / kGroup;
  for (int64_t i = r0 * groups; i < r1 * groups; ++i) {
    int8_t* q = out.q.data() + i * kGroup;
    quantize_group(xp + i * kGroup, q, out.d.data() + i, out.sum.data() + i);
    if (paired && i % groups % 2 == 1) {  // the second of a pair: swap the middle halves
      const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q - 16));
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q - 16), b0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), a1);
    }
  }
}

void size_rows(Int8Rows& out, int64_t m, int64_t k) {
  out.q.resize(m * k);
  out.d.resize(m * (k / kGroup));
  out.sum.resize(m * (k / kGroup));
}

void quantize_rows(const at::Tensor& x, Int8Rows& out, bool paired) {
  const int64_t m = x.size(0), k = x.size(1);
  size_rows(out, m, k);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, (1 << 16) / k), [&](int64_t r0, int64_t r1) {
    quantize_row_range(xp, k, r0, r1, out, paired);
  });
}

// Eight vectors -> one vector of their eight horizontal sums (6 hadds, 2 permutes, 1 add,
// instead of eight separate reductions of ~6 instructions each), for fp32 or int32 lanes.
template <typename T, typename Hadd, typename Fold>
inline T hsum8_lanes(const T* a, Hadd hadd, Fold fold) {
  const T h01 = hadd(a[0], a[1]), h23 = hadd(a[2], a[3]), h45 = hadd(a[4], a[5]), h67 = hadd(a[6], a[7]);
  // lower 128 bits: sums of lanes 0-3 of a[0..3]; upper: of lanes 4-7
  return fold(hadd(h01, h23), hadd(h45, h67));
}

inline __m256i hsum8_epi32(const __m256i* a) {
  return hsum8_lanes(a, [](__m256i x, __m256i y) { return _mm256_hadd_epi32(x, y); },
                     [](__m256i lo, __m256i hi) {
                       return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                               _mm256_permute2x128_si256(lo, hi, 0x31));
                     });
}

// Eight fp16 values -> fp32 (F16C).
inline __m256 half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Group g of a q4 weight row as 32 unsigned bytes in element order (low nibbles 0-15,
// high nibbles 16-31).
inline __m256i unpack_q4(const uint8_t* codes) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Group g of a paired row of codes (quantize_rows) in element order.
inline __m256i paired_group(const int8_t* row, int64_t g, int64_t groups) {
  if (g % 2 == 0 && g + 1 == groups)  // an odd last group: not paired
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kGroup));
  const int8_t* pair = row + (g / 2) * 2 * kGroup + (g % 2) * 16;
  return _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + kGroup)),
                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
}

// sum over the group of w * x as 8 int32 lanes (unsigned w, signed x)
// AVX-512 VNNI (with VL: on ymm) does all three steps in one vpdpbusd; its int32 sums are
// exact like the pairs' int16 sums here (no operand pair reaches 2^15), so both builds give
// the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CW_VNNI 1
inline __m256i dot_u8_i8(__m256i w, __m256i x) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x); }
// acc + the dot products of the low and of the high nibbles
inline __m256i dot2_u8_i8(__m256i wlo, __m256i xlo, __m256i whi, __m256i xhi) {
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wlo, xlo), whi, xhi);
}
#else
#define CW_VNNI 0
inline __m256i dot_u8_i8(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
inline __m256i dot2_u8_i8(__m256i wlo, __m256i xlo, __m256i whi, __m256i xhi) {
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(wlo, xlo), _mm256_maddubs_epi16(whi, xhi)),
                           _mm256_set1_epi16(1));
}
#endif

// The lane dot_block_i8<Q4> accumulates group g into, o = g % 8: its main loop's hadds
// order eight groups [g0 g2 g4 g6 g1 g3 g5 g7]; a tail group takes the lane its o would.
constexpr int q4_lane(int64_t o) { return static_cast<int>((o % 2) * 4 + o / 2); }

// All ones in lane l, zeros elsewhere (x & mask: x in lane l; fma(x & mask, s, a) leaves a's
// other lanes as they are).
inline __m256 lane_mask(int l) {
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(l)));
}

// The last T (1 or 2) groups of a q4 tile, from g0 (a multiple of 8), for all NB weight
// rows in one reduction (NB * T <= 8: SmolLM2's K = 576 gives 4 rows x 2 groups): pair
// b * T + t's exact sum goes to the lane group g0 + t takes (q4_lane) of row b's
// accumulator, scaled and then its zero point added by the fmas of dot_block_i8's
// per-group tail, with the other lanes getting fma(0, s, a) = a as there: the same
// numbers, one hadd tree per input row instead of a horizontal sum per group and row.
template <int NB, int T, int R>
inline void q4_tail_block(const Int8Rows& xa, int64_t k, int64_t m0, int64_t n0, int64_t groups, int64_t g0,
                          const uint8_t* codes, const at::Half* ws, const at::Half* wz, __m256 (&acc)[NB][R]) {
  static_assert((T == 1 || T == 2) && NB * T <= 8, "a tail of 1 or 2 groups, in eight lanes");
  __m256i w[8];
  auto bits = [&](const at::Half* src, int i) -> short {
    return i < NB * T ? static_cast<short>(src[(n0 + i / T) * groups + g0 + i % T].x) : short(0);
  };
  auto halves = [&](const at::Half* src) {
    return _mm256_cvtph_ps(_mm_setr_epi16(bits(src, 0), bits(src, 1), bits(src, 2), bits(src, 3), bits(src, 4),
                                          bits(src, 5), bits(src, 6), bits(src, 7)));
  };
  for (int i = 0; i < 8; ++i)
    w[i] = i < NB * T ? unpack_q4(codes + (n0 + i / T) * (k / 2) + (g0 + i % T) * 16) : _mm256_setzero_si256();
  // on: the lanes the tail's groups take; lanes: group t's lane <- entry t of [v0 v1 v0 v1 ..]
  __m256 on = _mm256_setzero_ps();
  __m256i lanes = _mm256_setzero_si256();
  for (int t = 0; t < T; ++t) {
    const __m256 m = lane_mask(q4_lane(t));
    on = _mm256_or_ps(on, m);
    lanes = _mm256_or_si256(lanes, _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(t)));
  }
  const __m256 sw = halves(ws), zw = halves(wz);
  __m256i idx[NB];
  __m256 swl[NB], zwl[NB];
  for (int b = 0; b < NB; ++b) {
    idx[b] = _mm256_add_epi32(lanes, _mm256_set1_epi32(b * T));  // lanes off the tail: masked
    swl[b] = _mm256_permutevar8x32_ps(sw, idx[b]);
    zwl[b] = _mm256_and_ps(_mm256_permutevar8x32_ps(zw, idx[b]), on);
  }
  for (int r = 0; r < R; ++r) {
    const int8_t* xrow = xa.q.data() + (m0 + r) * k;
    const int64_t xi = (m0 + r) * groups + g0;
    __m256i xq[T];
    for (int t = 0; t < T; ++t) xq[t] = paired_group(xrow, g0 + t, groups);
    __m256i p[8];
    for (int i = 0; i < 8; ++i) p[i] = i < NB * T ? dot_u8_i8(w[i], xq[i % T]) : _mm256_setzero_si256();
    const __m256 sums = _mm256_cvtepi32_ps(hsum8_epi32(p));  // exact: |sum| < 2^16
    __m256 dx, xs;
    if constexpr (T == 2) {
      dx = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(xa.d.data() + xi)));
      xs = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(xa.sum.data() + xi)));
    } else {
      dx = _mm256_broadcast_ss(xa.d.data() + xi), xs = _mm256_broadcast_ss(xa.sum.data() + xi);
    }
    dx = _mm256_permutevar8x32_ps(dx, lanes), xs = _mm256_permutevar8x32_ps(xs, lanes);
    for (int b = 0; b < NB; ++b) {
      const __m256 f = _mm256_and_ps(_mm256_permutevar8x32_ps(sums, idx[b]), on);
      acc[b][r] = _mm256_fmadd_ps(f, _mm256_mul_ps(swl[b], dx), acc[b][r]);
      acc[b][r] = _mm256_fmadd_ps(zwl[b], xs, acc[b][r]);
    }
  }
}

// y[m0..m0+R, n0..n0+NB] with int8 activations; Q4: unsigned codes plus zero points,
// else signed q8 codes (vpmaddubsw needs one unsigned operand: |w| against x * sign(w)).
template <bool Q4, int NB, int R>
inline void dot_block_i8(const Int8Rows& xa, int64_t k, int64_t m0, int64_t n0, int64_t groups,
                         const uint8_t* codes, const at::Half* ws, const at::Half* wz,
                         float* y, int64_t ldy) {
  const int64_t row_bytes = Q4 ? k / 2 : k;
  __m256 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  // Eight groups at a time: their int32 dot products reduced into one vector of eight
  // group sums, converted and scaled once, with the eight groups' scales (and zero points)
  // as vectors; weights unpacked once per block for all R rows.
  int64_t g0 = 0;
  if constexpr (Q4) {
    // x is paired (quantize_rows): one 32-byte load of two groups' codes gives their low
    // nibbles (elements 0-15 of both) and high nibbles (16-31), each against one 32-byte
    // load of x; both products in int16 (|sum| <= 4 * 15 * 127), one vpmaddwd. Four pairs
    // reduce in three hadds to lanes ordered [g0 g2 g4 g6 g1 g3 g5 g7]; scales follow.
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (; g0 + 8 <= groups; g0 += 8) {
      __m256i wlo[NB][4], whi[NB][4];
      __m256 sw[NB], zw8[NB];
      for (int b = 0; b < NB; ++b) {
        const uint8_t* c = codes + (n0 + b) * row_bytes + g0 * 16;
        for (int p = 0; p < 4; ++p) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + p * 32));
          wlo[b][p] = _mm256_and_si256(raw, nib);
          whi[b][p] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
        }
        sw[b] = _mm256_permutevar8x32_ps(half8(ws + (n0 + b) * groups + g0), order);
        zw8[b] = _mm256_permutevar8x32_ps(half8(wz + (n0 + b) * groups + g0), order);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t xi = (m0 + r) * groups + g0;
        const int8_t* xq = xa.q.data() + xi * kGroup;
        const __m256 dx = _mm256_permutevar8x32_ps(_mm256_loadu_ps(xa.d.data() + xi), order);
        const __m256 xs = _mm256_permutevar8x32_ps(_mm256_loadu_ps(xa.sum.data() + xi), order);
        for (int b = 0; b < NB; ++b) {
          __m256i v[4];
          for (int p = 0; p < 4; ++p) {
            const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + p * 64));
            const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + p * 64 + 32));
            v[p] = dot2_u8_i8(wlo[b][p], xlo, whi[b][p], xhi);
          }
          const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
          acc[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sw[b], dx), acc[b][r]);
          acc[b][r] = _mm256_fmadd_ps(zw8[b], xs, acc[b][r]);
        }
      }
    }
  }
  for (; !Q4 && g0 + 8 <= groups; g0 += 8) {
    alignas(32) __m256i wb[NB][8];
    __m256 sw[NB], zw8[NB];
    for (int b = 0; b < NB; ++b) {
      const uint8_t* c = codes + (n0 + b) * row_bytes + g0 * (Q4 ? 16 : 32);
      for (int gi = 0; gi < 8; ++gi)
        wb[b][gi] = Q4 ? unpack_q4(c + gi * 16) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + gi * 32));
      sw[b] = half8(ws + (n0 + b) * groups + g0);
      if (Q4) zw8[b] = half8(wz + (n0 + b) * groups + g0);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t xi = (m0 + r) * groups + g0;
      const int8_t* xq = xa.q.data() + xi * kGroup;
      const __m256 dx = _mm256_loadu_ps(xa.d.data() + xi);
      const __m256 xs = Q4 ? _mm256_loadu_ps(xa.sum.data() + xi) : _mm256_setzero_ps();
      for (int b = 0; b < NB; ++b) {
        __m256i p[8];
        for (int gi = 0; gi < 8; ++gi) {
          const __m256i x8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + gi * kGroup));
          p[gi] = Q4 ? dot_u8_i8(wb[b][gi], x8)
                     : dot_u8_i8(_mm256_sign_epi8(wb[b][gi], wb[b][gi]), _mm256_sign_epi8(x8, wb[b][gi]));
        }
        acc[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_epi32(p)), _mm256_mul_ps(sw[b], dx), acc[b][r]);
        if (Q4) acc[b][r] = _mm256_fmadd_ps(zw8[b], xs, acc[b][r]);
      }
    }
  }
  if constexpr (Q4 && NB <= 4) {
    if (groups - g0 == 2) q4_tail_block<NB, 2, R>(xa, k, m0, n0, groups, g0, codes, ws, wz, acc), g0 = groups;
    else if (groups - g0 == 1) q4_tail_block<NB, 1, R>(xa, k, m0, n0, groups, g0, codes, ws, wz, acc), g0 = groups;
  }
  for (int64_t g = g0; g < groups; ++g) {
    __m256i w[NB];
    float dw[NB], zw[NB];
    for (int b = 0; b < NB; ++b) {
      const uint8_t* c = codes + (n0 + b) * row_bytes + g * (Q4 ? 16 : 32);
      w[b] = Q4 ? unpack_q4(c) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
      dw[b] = half_to_float(ws[(n0 + b) * groups + g]);
      if (Q4) zw[b] = half_to_float(wz[(n0 + b) * groups + g]);
    }
    // q4: the group's exact sum goes whole into the lane a main-loop group g would take
    // (q4_lane), scaled and then its zero point added there, which is what lets q4_gemm_tile
    // take every group alike; q8: lane t gets the group's quad t.
    const __m256 lane = Q4 ? lane_mask(q4_lane(g % 8)) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t xi = (m0 + r) * groups + g;
      const __m256i xq = Q4 ? paired_group(xa.q.data() + (m0 + r) * k, g, groups)
                            : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa.q.data() + xi * kGroup));
      const float dx = xa.d[xi];
      for (int b = 0; b < NB; ++b) {
        if constexpr (Q4) {
          const float sum = hsum8f(_mm256_cvtepi32_ps(dot_u8_i8(w[b], xq)));  // exact: |sum| < 2^16
          acc[b][r] = _mm256_fmadd_ps(_mm256_and_ps(_mm256_set1_ps(sum), lane), _mm256_set1_ps(dw[b] * dx),
                                      acc[b][r]);
          acc[b][r] = _mm256_fmadd_ps(_mm256_and_ps(_mm256_set1_ps(zw[b]), lane), _mm256_set1_ps(xa.sum[xi]),
                                      acc[b][r]);
        } else {
          const __m256i p = dot_u8_i8(_mm256_sign_epi8(w[b], w[b]), _mm256_sign_epi8(xq, w[b]));
          acc[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[b] * dx), acc[b][r]);
        }
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) y[(m0 + r) * ldy + n0 + b] = hsum8f(acc[b][r]);
}

// Tile of the int8 kernels: 4 weight rows x 2 input rows. Measured on the AVX2 EPYC (q4,
// us per call at 1 / 16 / 512 rows, [1536, 576] and [576, 1536], two threads, a noisy
// host: best of two runs): 4x2 37 / 289 / 7375 and 26 / 188 / 5466; 2x4 38 / 322 / 9816
// and 34 / 226 / 6152; 2x3 38 / 237 / 7026 and 28 / 164 / 6027; 1x4 42 / 249 / 7988.
#if !defined(CW_I8_TILE_N)  // -DCW_I8_TILE_N=.. -DCW_I8_TILE_M=.. to measure others
#define CW_I8_TILE_N 4
#define CW_I8_TILE_M 2
#endif
constexpr int kI8TileN = CW_I8_TILE_N, kI8TileM = CW_I8_TILE_M;
constexpr int64_t kI8RowBlock = 64;  // x rows per pass over a thread's weights (L2-sized)

template <bool Q4>
void linear_i8_range(const Int8Rows& xa, int64_t m, int64_t k, int64_t n_begin, int64_t n_end,
                     const uint8_t* codes, const at::Half* ws, const at::Half* wz, float* y, int64_t ldy) {
  const int64_t groups = k / kGroup;
  for (int64_t mb = 0; mb < m; mb += kI8RowBlock) {
    const int64_t me = std::min(m, mb + kI8RowBlock);
    int64_t n0 = n_begin;
    for (; n0 + kI8TileN <= n_end; n0 += kI8TileN) {
      int64_t m0 = mb;
      for (; m0 + kI8TileM <= me; m0 += kI8TileM)
        dot_block_i8<Q4, kI8TileN, kI8TileM>(xa, k, m0, n0, groups, codes, ws, wz, y, ldy);
      for (; m0 < me; ++m0) dot_block_i8<Q4, kI8TileN, 1>(xa, k, m0, n0, groups, codes, ws, wz, y, ldy);
    }
    for (; n0 < n_end; ++n0)
      for (int64_t m0 = mb; m0 < me; ++m0) dot_block_i8<Q4, 1, 1>(xa, k, m0, n0, groups, codes, ws, wz, y, ldy);
  }
}

// ---- q4 x int8 at prefill sizes: a register-blocked GEMM, the same numbers -----------
// dot_block_i8 reads each weight group once per tile of 4 weight rows x 2 input rows and
// holds both in registers it does not have (AVX2: 16 ymm), so at 512 rows it runs at about
// fp32 GEMM's rate. Here a panel of 16 weight rows is unpacked once per call to bytes laid
// out [group][quad t][row][4 elements] (one ymm: 8 weight rows x elements 4t..4t+3), and
// each 4-byte quad of an input row is broadcast against it: vpmaddubsw gives each weight
// row's two pair sums in int16; a group's 8 quads add in int16 (|sum| <= 8 * 2 * 15 * 127
// < 2^15) and one vpmaddwd makes the group's exact int32 sum for 8 weight rows at once.
// The fp32 part repeats dot_block_i8's operations in its order (each group's sum scaled
// into the accumulator lane it takes there, then its zero point; lanes reduced in hsum8f's
// tree), so a row's result is bit-identical whichever kernel ran it
// (tests/runner/test_kernels.py) and a row still never depends on its batch. Tail groups
// (past the last 8) take the lane of their position mod 8 in both kernels, so here every
// group runs the same loop; the first 8 groups start their lanes (a multiply, no zeroing).
constexpr int kGemmCols = 16;  // weight rows per panel (2 ymm)
constexpr int kGemmRows = 4;   // input rows per tile

struct Q4Panel {
  std::vector<int32_t> quads;  // [groups][8][16]: quad t of weight row c (4 unsigned codes)
  std::vector<float> sw, zw;   // [groups][16]
};

// Eight vectors of 8 x 32 bits, transposed in place: v[t] lane c <- v[c] lane t.
inline void transpose8x8(__m256* v) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Weight rows n0 .. n0 + cols (<= 16; the rest of the panel zero) unpacked into p. A full
// panel takes each group of 8 rows as eight unpacked vectors transposed (quad t of the 8
// rows in one vector): about a quarter of the scalar scatter's time, which at 16 rows was
// a third of the call.
void pack_q4_panel(const uint8_t* codes, const at::Half* ws, const at::Half* wz, int64_t k, int64_t n0,
                   int cols, Q4Panel& p) {
  const int64_t groups = k / kGroup;
  const size_t quads = groups * 8 * kGemmCols, scales = groups * kGemmCols;
  if (cols == kGemmCols) {  // every entry is written below: no zeroing
    p.quads.resize(quads), p.sw.resize(scales), p.zw.resize(scales);
    for (int64_t g = 0; g < groups; ++g)
      for (int h = 0; h < 2; ++h) {
        __m256 v[8];
        for (int c = 0; c < 8; ++c)
          v[c] = _mm256_castsi256_ps(unpack_q4(codes + (n0 + 8 * h + c) * (k / 2) + g * 16));
        transpose8x8(v);
        for (int t = 0; t < 8; ++t)
          _mm256_storeu_ps(reinterpret_cast<float*>(p.quads.data() + (g * 8 + t) * kGemmCols + 8 * h), v[t]);
      }
  } else {
    p.quads.assign(quads, 0), p.sw.assign(scales, 0.f), p.zw.assign(scales, 0.f);
    alignas(32) int32_t q[8];
    for (int c = 0; c < cols; ++c)
      for (int64_t g = 0; g < groups; ++g) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(q), unpack_q4(codes + (n0 + c) * (k / 2) + g * 16));
        for (int t = 0; t < 8; ++t) p.quads[(g * 8 + t) * kGemmCols + c] = q[t];
      }
  }
  for (int c = 0; c < cols; ++c)
    for (int64_t g = 0; g < groups; ++g) {
      p.sw[g * kGemmCols + c] = half_to_float(ws[(n0 + c) * groups + g]);
      p.zw[g * kGemmCols + c] = half_to_float(wz[(n0 + c) * groups + g]);
    }
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int R>
void q4_gemm_tile(const Int8Rows& xa, int64_t k, int64_t m0, const Q4Panel& p, float* y, int64_t ldy,
                  int64_t n0, int cols) {
  const int64_t groups = k / kGroup;
  __m256 acc[R][8][2];  // [row][lane][panel half]
  for (int64_t o = groups; o < 8; ++o)  // lanes no group reaches (fewer than 8 groups)
    for (int r = 0; r < R; ++r) acc[r][q4_lane(o)][0] = acc[r][q4_lane(o)][1] = _mm256_setzero_ps();
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i s16[R][2];
    const int32_t* quad = p.quads.data() + g * 8 * kGemmCols;
    const int8_t* xg = xa.q.data() + m0 * k + g * kGroup;
    {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 8));
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(load_i32(xg + r * k));
#if CW_VNNI
        s16[r][0] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w0, xb);
        s16[r][1] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w1, xb);
#else
        s16[r][0] = _mm256_maddubs_epi16(w0, xb);
        s16[r][1] = _mm256_maddubs_epi16(w1, xb);
#endif
      }
    }
#pragma GCC unroll 1
    for (int t = 1; t < 8; ++t) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + t * kGemmCols));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + t * kGemmCols + 8));
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(load_i32(xg + r * k + t * 4));
#if CW_VNNI
        s16[r][0] = _mm256_dpbusd_epi32(s16[r][0], w0, xb);
        s16[r][1] = _mm256_dpbusd_epi32(s16[r][1], w1, xb);
#else
        s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_maddubs_epi16(w0, xb));
        s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_maddubs_epi16(w1, xb));
#endif
      }
      // an empty asm that holds the 8 sums in registers: without it GCC spills one (and
      // copies the rest) every quad, and the store-to-load round trip sits on that sum's
      // chain (1.09-1.15x the GEMM at 16 to 2048 rows on the Zen 3, in-process A/B)
      for (int r = 0; r < R; ++r) asm("" : "+x"(s16[r][0]), "+x"(s16[r][1]));
    }
    const int lane = q4_lane(g % 8);
    const bool first = g < 8;  // the lane's first group: fma(f, s, 0) is f * s
    for (int h = 0; h < 2; ++h) {
      const __m256 sw = _mm256_loadu_ps(p.sw.data() + g * kGemmCols + 8 * h);
      const __m256 zw = _mm256_loadu_ps(p.zw.data() + g * kGemmCols + 8 * h);
      for (int r = 0; r < R; ++r) {
        const int64_t xi = (m0 + r) * groups + g;
#if CW_VNNI
        const __m256 f = _mm256_cvtepi32_ps(s16[r][h]);  // already the group's int32 sums
#else
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r][h], ones));
#endif
        const __m256 s = _mm256_mul_ps(sw, _mm256_set1_ps(xa.d[xi]));
        __m256& a = acc[r][lane][h];
        a = first ? _mm256_mul_ps(f, s) : _mm256_fmadd_ps(f, s, a);
        a = _mm256_fmadd_ps(zw, _mm256_set1_ps(xa.sum[xi]), a);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kGemmCols];
    for (int h = 0; h < 2; ++h) {  // hsum8f's tree: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
      const __m256* a = &acc[r][0][h];
      auto at = [&](int l) { return a[l * 2]; };
      const __m256 t0 = _mm256_add_ps(at(0), at(4)), t1 = _mm256_add_ps(at(1), at(5));
      const __m256 t2 = _mm256_add_ps(at(2), at(6)), t3 = _mm256_add_ps(at(3), at(7));
      _mm256_store_ps(out + 8 * h, _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3)));
    }
    if (cols == kGemmCols) {
      _mm256_storeu_ps(y + (m0 + r) * ldy + n0, _mm256_load_ps(out));
      _mm256_storeu_ps(y + (m0 + r) * ldy + n0 + 8, _mm256_load_ps(out + 8));
    } else {
      for (int c = 0; c < cols; ++c) y[(m0 + r) * ldy + n0 + c] = out[c];
    }
  }
}

#if CW_VNNI && defined(__AVX512F__)
// The panel tiles below (weights packed at load) are q4_gemm_tile on zmm: a panel's 16
// weight rows in one register (its two ymm halves side by side), every operation of the
// ymm tile on both halves at once, so the same bits in half the instructions. (An
// unpacked-panel zmm tile measured 1.19-1.25x the ymm one; with the weights packed at load
// it was never reached, so only the packed one is kept.)
#if !defined(CW_GEMM_ROWS_Z)
#define CW_GEMM_ROWS_Z 4
#endif
constexpr int kGemmRowsZ = CW_GEMM_ROWS_Z;

// tile(std::integral_constant<int, R>, m0) over m rows: tiles of kGemmRowsZ rows, then one
// of the 1-3 rows left.
template <typename F>
inline void for_row_tiles(int64_t m, F&& tile) {
  int64_t m0 = 0;
  for (; m0 + kGemmRowsZ <= m; m0 += kGemmRowsZ) tile(std::integral_constant<int, kGemmRowsZ>{}, m0);
  switch (m - m0) {
    case 3: tile(std::integral_constant<int, 3>{}, m0); break;
    case 2: tile(std::integral_constant<int, 2>{}, m0); break;
    case 1: tile(std::integral_constant<int, 1>{}, m0); break;
  }
}

// Group g's int32 sums s[r] (16 weight rows each) scaled into the lane q4 group g takes
// (the first 8 groups start their lanes), then its zero point: the ymm tile's fp32
// operations on both halves at once.
template <int R>
inline void add_q4_group_z(__m512 (&acc)[R][8], const __m512i* s, __m512 sw, __m512 zw, const Int8Rows& xa,
                           int64_t m0, int64_t g, int64_t groups) {
  const int lane = q4_lane(g % 8);
  const bool first = g < 8;
  for (int r = 0; r < R; ++r) {
    const int64_t xi = (m0 + r) * groups + g;
    const __m512 f = _mm512_cvtepi32_ps(s[r]);
    const __m512 sc = _mm512_mul_ps(sw, _mm512_set1_ps(xa.d[xi]));
    __m512& a = acc[r][lane];
    a = first ? _mm512_mul_ps(f, sc) : _mm512_fmadd_ps(f, sc, a);
    a = _mm512_fmadd_ps(zw, _mm512_set1_ps(xa.sum[xi]), a);
  }
}

// Each row's 8 lanes reduced in hsum8f's tree, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 +
// l7)), into y's cols (<= 16) columns from n0.
template <int R>
inline void store_lanes_z(const __m512 (&acc)[R][8], float* y, int64_t ldy, int64_t m0, int64_t n0, int cols) {
  for (int r = 0; r < R; ++r) {
    const __m512* a = acc[r];
    const __m512 t0 = _mm512_add_ps(a[0], a[4]), t1 = _mm512_add_ps(a[1], a[5]);
    const __m512 t2 = _mm512_add_ps(a[2], a[6]), t3 = _mm512_add_ps(a[3], a[7]);
    const __m512 out = _mm512_add_ps(_mm512_add_ps(t0, t2), _mm512_add_ps(t1, t3));
    _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, static_cast<__mmask16>((1u << cols) - 1), out);
  }
}
#endif

// ---- q4 weights packed once for the zmm tile (AVX-512 VNNI builds) ---------------------
// pack_q4_panel's work, done at load instead of at every call: at a 16-row decode step it
// was a fifth of the GEMM's time. Each panel of 16 weight rows holds, per group, the codes
// as the tile reads them, 4 x 64 bytes: block j holds bytes 4j..4j+3 of each row's group
// (row c at 4c), whose low nibbles are the row's quad j (elements 4j..4j+3) and high
// nibbles its quad j + 4 (16 + 4j..); then the 16 rows' fp16 scales and zero points.
// Rows past n (a last panel's) are zero. Same bytes as the codes, scales and zeros.
#if CW_VNNI && defined(__AVX512F__)
#define CW_Q4_PANELS 1
constexpr int64_t kPanelCodeBytes = 4 * 64, kPanelGroupBytes = kPanelCodeBytes + 2 * 2 * kGemmCols;

// f(panel group's bytes, group g, column c, weight row) for every (panel, group, column) of
// panels [p0, p1), group_bytes each.
template <typename F>
inline void for_panel_columns(int64_t groups, int64_t group_bytes, int64_t p0, int64_t p1, uint8_t* out, F&& f) {
  for (int64_t pi = p0; pi < p1; ++pi)
    for (int64_t g = 0; g < groups; ++g)
      for (int c = 0; c < kGemmCols; ++c) f(out + (pi * groups + g) * group_bytes, g, c, pi * kGemmCols + c);
}

void pack_q4_panels_range(const uint8_t* codes, const at::Half* ws, const at::Half* wz, int64_t n, int64_t k,
                          int64_t p0, int64_t p1, uint8_t* out) {
  const int64_t groups = k / kGroup;
  for_panel_columns(groups, kPanelGroupBytes, p0, p1, out, [&](uint8_t* dst, int64_t g, int c, int64_t row) {
    uint8_t* sd = dst + kPanelCodeBytes + 2 * c;
    if (row >= n) {
      for (int j = 0; j < 4; ++j) std::memset(dst + j * 64 + 4 * c, 0, 4);
      std::memset(sd, 0, 2), std::memset(sd + 2 * kGemmCols, 0, 2);
      return;
    }
    const uint8_t* src = codes + row * (k / 2) + g * 16;
    for (int j = 0; j < 4; ++j) std::memcpy(dst + j * 64 + 4 * c, src + 4 * j, 4);
    std::memcpy(sd, ws + row * groups + g, 2);
    std::memcpy(sd + 2 * kGemmCols, wz + row * groups + g, 2);
  });
}

// q4_gemm_tile's numbers from a packed panel (its first group at pp): the nibbles split in
// registers (the int32 sums are the same whichever order the quads add in).
template <int R>
void q4_panel_tile(const Int8Rows& xa, int64_t k, int64_t m0, const uint8_t* pp, float* y, int64_t ldy,
                   int64_t n0, int cols) {
  const int64_t groups = k / kGroup;
  __m512 acc[R][8];
  for (int64_t o = groups; o < 8; ++o)
    for (int r = 0; r < R; ++r) acc[r][q4_lane(o)] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* pg = pp + g * kPanelGroupBytes;
    const int8_t* xg = xa.q.data() + m0 * k + g * kGroup;
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(pg + j * 64);
      const __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
      for (int r = 0; r < R; ++r) s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(load_i32(xg + r * k + 4 * j)));
      for (int r = 0; r < R; ++r)
        s[r] = _mm512_dpbusd_epi32(s[r], hi, _mm512_set1_epi32(load_i32(xg + r * k + 16 + 4 * j)));
      for (int r = 0; r < R; ++r) asm("" : "+v"(s[r]));
    }
    const __m256i* half = reinterpret_cast<const __m256i*>(pg + kPanelCodeBytes);
    add_q4_group_z<R>(acc, s, _mm512_cvtph_ps(_mm256_loadu_si256(half)), _mm512_cvtph_ps(_mm256_loadu_si256(half + 1)),
                      xa, m0, g, groups);
  }
  store_lanes_z<R>(acc, y, ldy, m0, n0, cols);
}

// Weight rows [begin, end) (begin a multiple of 16) from packed panels, every row of x.
void q4_panel_range(const Int8Rows& xa, int64_t m, int64_t k, int64_t n, int64_t begin, int64_t end,
                    const uint8_t* panels, float* y, int64_t ldy) {
  const int64_t groups = k / kGroup;
  for (int64_t n0 = begin; n0 < end; n0 += kGemmCols) {
    const int cols = static_cast<int>(std::min<int64_t>(kGemmCols, std::min(end, n) - n0));
    const uint8_t* pp = panels + (n0 / kGemmCols) * groups * kPanelGroupBytes;
    for_row_tiles(m, [&](auto R, int64_t m0) { q4_panel_tile<decltype(R)::value>(xa, k, m0, pp, y, ldy, n0, cols); });
  }
}

// q8 weights the same way, for the lm_head at a batched decode step. vpdpbusd multiplies
// unsigned by signed bytes, so x goes in as x + 128 (its codes with the top bit flipped)
// against the signed codes, and each group's sum starts at -128 sum(w), stored with the
// panel: sum((x + 128) w) - 128 sum(w) = sum(x w), exactly, in int32. A panel group: the
// codes [quad t][row c][4] (512 bytes), -128 sum(w) per row (int32 [16]), fp16 scales [16].
// The fp32 part is dot_block_i8<q8>'s: groups of whole blocks of 8 add their sum into lane
// g % 8; groups past the last block add quad t's sum into lane t.
constexpr int64_t kQ8PanelCodeBytes = 8 * 64, kQ8PanelGroupBytes = kQ8PanelCodeBytes + 4 * kGemmCols + 2 * kGemmCols;

void pack_q8_panels_range(const int8_t* codes, const at::Half* ws, int64_t n, int64_t k, int64_t p0, int64_t p1,
                          uint8_t* out) {
  const int64_t groups = k / kGroup;
  for_panel_columns(groups, kQ8PanelGroupBytes, p0, p1, out, [&](uint8_t* dst, int64_t g, int c, int64_t row) {
    int32_t corr = 0;
    if (row < n) {
      const int8_t* src = codes + row * k + g * kGroup;
      for (int t = 0; t < 8; ++t) std::memcpy(dst + t * 64 + 4 * c, src + 4 * t, 4);
      for (int i = 0; i < kGroup; ++i) corr -= 128 * src[i];
      std::memcpy(dst + kQ8PanelCodeBytes + 4 * kGemmCols + 2 * c, ws + row * groups + g, 2);
    } else {
      for (int t = 0; t < 8; ++t) std::memset(dst + t * 64 + 4 * c, 0, 4);
      std::memset(dst + kQ8PanelCodeBytes + 4 * kGemmCols + 2 * c, 0, 2);
    }
    std::memcpy(dst + kQ8PanelCodeBytes + 4 * c, &corr, 4);
  });
}

// xu: x's codes + 128 (unsigned), in element order.
template <int R>
void q8_panel_tile(const Int8Rows& xa, const uint8_t* xu, int64_t k, int64_t m0, const uint8_t* pp, float* y,
                   int64_t ldy, int64_t n0, int cols) {
  const int64_t groups = k / kGroup, blocks = groups / 8 * 8;
  __m512 acc[R][8];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 8; ++l) acc[r][l] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* pg = pp + g * kQ8PanelGroupBytes;
    const uint8_t* xg = xu + m0 * k + g * kGroup;
    const __m512 sw =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + kQ8PanelCodeBytes + 4 * kGemmCols)));
    __m512 sc[R];
    for (int r = 0; r < R; ++r) sc[r] = _mm512_mul_ps(sw, _mm512_set1_ps(xa.d[(m0 + r) * groups + g]));
    if (g < blocks) {
      __m512i s[R];
      const __m512i negc = _mm512_loadu_si512(pg + kQ8PanelCodeBytes);
      for (int r = 0; r < R; ++r) s[r] = negc;
#pragma GCC unroll 1
      for (int t = 0; t < 8; ++t) {
        const __m512i w = _mm512_loadu_si512(pg + t * 64);
        for (int r = 0; r < R; ++r)
          s[r] = _mm512_dpbusd_epi32(s[r], _mm512_set1_epi32(load_i32(reinterpret_cast<const int8_t*>(xg + r * k + 4 * t))), w);
        for (int r = 0; r < R; ++r) asm("" : "+v"(s[r]));
      }
      for (int r = 0; r < R; ++r) acc[r][g % 8] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), sc[r], acc[r][g % 8]);
    } else {
      for (int t = 0; t < 8; ++t) {
        const __m512i w = _mm512_loadu_si512(pg + t * 64);
        const __m512i corr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), w);
        for (int r = 0; r < R; ++r) {
          const __m512i xb = _mm512_set1_epi32(load_i32(reinterpret_cast<const int8_t*>(xg + r * k + 4 * t)));
          const __m512i q = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xb, w), corr);
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), sc[r], acc[r][t]);
        }
      }
    }
  }
  store_lanes_z<R>(acc, y, ldy, m0, n0, cols);
}

void q8_panel_range(const Int8Rows& xa, const uint8_t* xu, int64_t m, int64_t k, int64_t n, int64_t begin,
                    int64_t end, const uint8_t* panels, float* y, int64_t ldy) {
  const int64_t groups = k / kGroup;
  for (int64_t n0 = begin; n0 < end; n0 += kGemmCols) {
    const int cols = static_cast<int>(std::min<int64_t>(kGemmCols, std::min(end, n) - n0));
    const uint8_t* pp = panels + (n0 / kGemmCols) * groups * kQ8PanelGroupBytes;
    for_row_tiles(m, [&](auto R, int64_t m0) {
      q8_panel_tile<decltype(R)::value>(xa, xu, k, m0, pp, y, ldy, n0, cols);
    });
  }
}
#else
#define CW_Q4_PANELS 0
#endif

// Weight rows [begin, end) against every row of x (quantized in element order): panels of
// 16 from begin (a row's result does not depend on which panel holds it).
void q4_gemm_range(const Int8Rows& xa, int64_t m, int64_t k, int64_t begin, int64_t end, const uint8_t* cp,
                   const at::Half* sp, const at::Half* zp, float* yp, int64_t ldy, Q4Panel& p) {
  for (int64_t n0 = begin; n0 < end; n0 += kGemmCols) {
    const int cols = static_cast<int>(std::min<int64_t>(kGemmCols, end - n0));
    pack_q4_panel(cp, sp, zp, k, n0, cols, p);
    int64_t m0 = 0;
    for (; m0 + kGemmRows <= m; m0 += kGemmRows) q4_gemm_tile<kGemmRows>(xa, k, m0, p, yp, ldy, n0, cols);
    for (; m0 < m; ++m0) q4_gemm_tile<1>(xa, k, m0, p, yp, ldy, n0, cols);
  }
}

void q4_gemm(const Int8Rows& xa, int64_t m, int64_t k, int64_t n, const uint8_t* cp, const at::Half* sp,
             const at::Half* zp, float* yp) {
  const int64_t panels = (n + kGemmCols - 1) / kGemmCols;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    Q4Panel p;
    q4_gemm_range(xa, m, k, begin * kGemmCols, std::min(n, end * kGemmCols), cp, sp, zp, yp, n, p);
  });
}

}  // namespace
#endif  // CW_SIMD

// Whether this build multiplies q4 / q8 weights from panels (q4_panels, q8_panels; else they
// are not made).
bool has_panels() {
#if CW_Q4_PANELS
  return true;
#else
  return false;
#endif
}

#if CW_Q4_PANELS
void check_panels(const at::Tensor& panels, int64_t n, int64_t k, bool q4 = true) {
  const int64_t bytes = q4 ? kPanelGroupBytes : kQ8PanelGroupBytes;
  TORCH_CHECK(panels.dtype() == at::kByte && panels.is_contiguous() && panels.dim() == 2 &&
                  panels.size(0) == (n + kGemmCols - 1) / kGemmCols && panels.size(1) == k / kGroup * bytes,
              q4 ? "q4 panels must be q4_panels'" : "q8 panels must be q8_panels'", " uint8 [ceil(N / 16), K / 32 * ",
              bytes, "] for this weight");
}
#endif

// A q8 weight (codes int8 [N, K], fp16 scales [N, K/32]) packed for the q8 panel tile.
at::Tensor q8_panels(const at::Tensor& codes, const at::Tensor& scale) {
#if CW_Q4_PANELS
  const int64_t n = codes.size(0), k = codes.size(1), groups = k / kGroup;
  TORCH_CHECK(codes.is_contiguous() && codes.dtype() == at::kChar && codes.dim() == 2 && k % kGroup == 0,
              "q8 codes must be int8 [N, K], K a multiple of 32");
  TORCH_CHECK(scale.dtype() == at::kHalf && scale.is_contiguous() && scale.numel() == n * groups,
              "q8 scales must be fp16 [N, K/32]");
  const int64_t np = (n + kGemmCols - 1) / kGemmCols;
  at::Tensor out = at::empty({np, groups * kQ8PanelGroupBytes}, codes.options().dtype(at::kByte));
  const int8_t* cp = codes.data_ptr<int8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, np, 16, [&](int64_t p0, int64_t p1) { pack_q8_panels_range(cp, sp, n, k, p0, p1, op); });
  return out;
#else
  TORCH_CHECK(false, "q8 panels need the AVX-512 VNNI build of the kernels (has_panels() is False)");
#endif
}

// A q4 weight (codes [N, K/2], fp16 scales and zeros [N, K/32]) packed for the panel tile.
at::Tensor q4_panels(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero) {
#if CW_Q4_PANELS
  const int64_t n = codes.size(0), k = codes.size(1) * 2, groups = k / kGroup;
  TORCH_CHECK(codes.is_contiguous() && codes.dtype() == at::kByte && k % kGroup == 0, "q4 codes must be uint8 [N, K/2]");
  TORCH_CHECK(scale.dtype() == at::kHalf && zero.dtype() == at::kHalf && scale.is_contiguous() && zero.is_contiguous() &&
                  scale.numel() == n * groups && zero.numel() == n * groups, "q4 scales and zeros must be fp16 [N, K/32]");
  const int64_t np = (n + kGemmCols - 1) / kGemmCols;
  at::Tensor out = at::empty({np, groups * kPanelGroupBytes}, codes.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half *sp = scale.data_ptr<at::Half>(), *zp = zero.data_ptr<at::Half>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, np, 16, [&](int64_t p0, int64_t p1) { pack_q4_panels_range(cp, sp, zp, n, k, p0, p1, op); });
  return out;
#else
  TORCH_CHECK(false, "q4 panels need the AVX-512 VNNI build of the kernels (has_panels() is False)");
#endif
}

// y [M, N] = x [M, K] @ dequant(q4 weight [N, K])^T, x quantized to int8 per group, the
// weight from its panels (q4_panels): the q4 GEMM's numbers at any number of rows.
at::Tensor q4_panel_linear(const at::Tensor& x, int64_t n, int64_t k, const at::Tensor& panels) {
#if CW_Q4_PANELS
  check_panels(panels, n, k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.dtype() == at::kFloat && x.is_contiguous(),
              "x must be contiguous fp32 [M, ", k, "]");
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  Int8Rows xa;
  quantize_rows(x, xa, false);
  const uint8_t* pp = panels.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (n + kGemmCols - 1) / kGemmCols, 1, [&](int64_t begin, int64_t end) {
    q4_panel_range(xa, m, k, n, begin * kGemmCols, end * kGemmCols, pp, yp, n);
  });
  return y;
#else
  TORCH_CHECK(false, "q4 panels need the AVX-512 VNNI build of the kernels (has_panels() is False)");
#endif
}

// y [M, N] = x [M, K] @ dequant(q4 or q8 weight)^T with x quantized to int8 per group of 32
// (a q4 weight from its panels where they are given: they must be this weight's).
at::Tensor quantized_linear_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& panels) {
  const bool q4 = zero.has_value();
  // a q4 weight with panels may come without its row-major codes (layers/linear.py drops
  // them: the panels hold the same bytes); N and K then come from its scales [N, K / 32]
  if (q4 && panels.has_value() && panels->numel() && scale.dim() == 2)
    return q4_panel_linear(x, scale.size(0), scale.size(1) * kGroup, *panels);  // any row count
  const int64_t n = codes.size(0), k = q4 ? codes.size(1) * 2 : codes.size(1), m = x.size(0);
  check_linear_args(x, scale, k);
  TORCH_CHECK(codes.is_contiguous() && codes.dtype() == (q4 ? at::kByte : at::kChar),
              q4 ? "q4 codes must be uint8" : "q8 codes must be int8");
#if CW_SIMD
  at::Tensor y = at::empty({m, n}, x.options());
  Int8Rows xa;
#if CW_Q4_PANELS
  if (!q4 && panels.has_value() && panels->numel()) {
    check_panels(*panels, n, k, false);
    quantize_rows(x, xa, false);
    std::vector<uint8_t> xu(xa.q.size());
    for (size_t i = 0; i < xu.size(); ++i) xu[i] = static_cast<uint8_t>(xa.q[i]) ^ 0x80;  // x + 128
    const uint8_t* pp = panels->data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, (n + kGemmCols - 1) / kGemmCols, 1, [&](int64_t begin, int64_t end) {
      q8_panel_range(xa, xu.data(), m, k, n, begin * kGemmCols, end * kGemmCols, pp, yp, n);
    });
    return y;
  }
#else
  TORCH_CHECK(!panels.has_value() || !panels->numel(), "panels need the AVX-512 VNNI build of the kernels");
#endif
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const at::Half* sp = scale.data_ptr<at::Half>();
  const at::Half* zp = q4 ? zero->data_ptr<at::Half>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (q4 && m >= gemm_min_rows()) {
    quantize_rows(x, xa, false);  // the GEMM reads the codes in element order
    q4_gemm(xa, m, k, n, cp, sp, zp, yp);
    return y;
  }
  quantize_rows(x, xa, q4);
  at::parallel_for(0, n, feature_grain(m, k), [&](int64_t begin, int64_t end) {
    if (q4) linear_i8_range<true>(xa, m, k, begin, end, cp, sp, zp, yp, n);
    else linear_i8_range<false>(xa, m, k, begin, end, cp, sp, zp, yp, n);
  });
  return y;
#else
  TORCH_CHECK(false, "int8 activations need the AVX2 or AVX-512 build of the kernels");
#endif
}

namespace {

template <typename T>
void q4_dequantize_into(const uint8_t* cp, const at::Half* sp, const at::Half* zp, int64_t n,
                        int64_t k, T* wp) {
  const int64_t groups = k / kGroup;
  // ~0.25 ms per 1.8M weights on one core: split only far larger weights (a second thread
  // that has to wait for a shared core stalls the whole region for milliseconds)
  at::parallel_for(0, n, std::max<int64_t>(64, (1 << 23) / k), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t g = 0; g < groups; ++g) {
        const float s = half_to_float(sp[j * groups + g]), z = half_to_float(zp[j * groups + g]);
        T* dst = wp + j * k + g * kGroup;
#if CW_SIMD
        V16 lo, hi;
        dequant_q4(cp + j * (k / 2) + g * 16, s, z, lo, hi);
        vstore(dst, lo);
        vstore(dst + 16, hi);
#else
        for (int i = 0; i < 16; ++i) {
          const uint8_t b = cp[j * (k / 2) + g * 16 + i];
          dst[i] = static_cast<T>(s * (b & 0x0F) + z);
          dst[16 + i] = static_cast<T>(s * (b >> 4) + z);
        }
#endif
      }
  });
}

}  // namespace

// Dequantize a q4 weight to a dense [N, K] fp32 or bf16 tensor (for prefill-sized steps,
// where one dense GEMM beats the dequantizing kernel); vectorized and parallel.
at::Tensor q4_dequantize(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                         bool to_bf16) {
  const int64_t n = codes.size(0), k = codes.size(1) * 2;
  TORCH_CHECK(scale.dtype() == at::kHalf && zero.dtype() == at::kHalf, "scales must be fp16");
  at::Tensor w = at::empty({n, k}, scale.options().dtype(to_bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half *sp = scale.data_ptr<at::Half>(), *zp = zero.data_ptr<at::Half>();
  if (to_bf16)
    q4_dequantize_into(cp, sp, zp, n, k, w.data_ptr<at::BFloat16>());
  else
    q4_dequantize_into(cp, sp, zp, n, k, w.data_ptr<float>());
  return w;
}

namespace {

// What one decode query needs to know about the keys it reads.
struct DecodeArgs {
  int64_t num_kv_heads, group, head_dim;
  float scale, softcap;  // softcap <= 0: none
};

template <typename T>
inline float dot_head(const float* q, const T* k, int64_t d) {
#if CW_SIMD
  if (d % 16 == 0) {
    V16 acc = vzero();
    for (int64_t i = 0; i < d; i += 16) acc = vfmadd(vload(q + i), vload(k + i), acc);
    return vsum(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

template <typename T>
inline void axpy_head(float p, const T* v, float* out, int64_t d) {
#if CW_SIMD
  if (d % 16 == 0) {
    const V16 pv = vset1(p);
    for (int64_t i = 0; i < d; i += 16) vstore(out + i, vfmadd(pv, vload(v + i), vload(out + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < d; ++i) out[i] += p * static_cast<float>(v[i]);
}


inline float exp_sum(float* scores, int64_t n, float top) {
  int64_t j = 0;
  float total = 0.f;
#if CW_SIMD
  V16 acc = vzero();
  const V16 top16 = vset1(top);
  for (; j + 16 <= n; j += 16) {
    const V16 e = vexp_nonpositive(vsub(vload(scores + j), top16));
    vstore(scores + j, e);
    acc = vadd(acc, e);
  }
  total = vsum(acc);
#endif
  for (; j < n; ++j) total += (scores[j] = std::exp(scores[j] - top));
  return total;
}

#if CW_SIMD
// The two 8-lane halves of a V16 added: one ymm (AVX2 instructions, which every AVX-512
// CPU has too).
#if CW_SIMD == 2
inline __m256 vfold8(V16 x) {
  return _mm256_add_ps(_mm512_castps512_ps256(x.v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1)));
}
#else
inline __m256 vfold8(V16 x) { return _mm256_add_ps(x.a, x.b); }
#endif

inline __m256 hsum8(const __m256* a) {
  return hsum8_lanes(a, [](__m256 x, __m256 y) { return _mm256_hadd_ps(x, y); },
                     [](__m256 lo, __m256 hi) {
                       return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                                            _mm256_permute2f128_ps(lo, hi, 0x31));
                     });
}

// One head's slice (d elements) of a K or V row, asked for one tile ahead of its use. Each
// key row of a tile asks for the same head's slice of the row kKeyTile keys on, as it is
// scored (or, for V, in the first 16-lane chunk's pass): the misses stay spread through the
// compute. Asking for the whole next tile at its start, all KV heads at once, left the
// tile's compute to run after the memory time rather than under it (cold time was warm
// time plus bytes over bandwidth; the burst probably filled the miss buffers). Spread out:
// 1.16-1.20x a layer's cold call with bf16 K/V and 1.02-1.11x with fp32
// (benchmarks/decode_attention.py shapes, Zen 3, in-process A/B). Two tiles ahead measured
// 1.04-1.05x, no better.
template <typename T>
inline void prefetch_head(const T* p, int64_t d) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// out[g][j] = scale * q_g . k_j for keys j < n (key j at flat slot slots[j]; the first
// `ahead` keys of the next tile, slots[n ..], are asked for meanwhile) and GN query
// heads sharing one KV head: each key row is loaded (and, for bf16, widened) once for all
// GN heads (it was once per head; 1.03-1.16x the whole call on the Zen 3, bit-identical),
// eight keys per reduction; each head's sums run the same operations in the same order
// whatever GN is. D > 0 fixes the head size at compile time.
template <int D, int GN, typename T>
void score_keys_group(const float* const* q, const T* kp, const int64_t* slots, int64_t row, int64_t d,
                      int64_t n, float scale, float* const* out, int64_t ahead) {
  const int64_t dd = D > 0 ? D : d;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 part[GN][8];
    for (int u = 0; u < 8; ++u) {
      if (j + u < ahead) prefetch_head(kp + slots[n + j + u] * row, dd);
      const T* kr = kp + slots[j + u] * row;
      V16 acc[GN];
      {
        const V16 k = vload(kr);
        for (int g = 0; g < GN; ++g) acc[g] = vmul(vload(q[g]), k);
      }
      for (int64_t i = 16; i < dd; i += 16) {
        const V16 k = vload(kr + i);
        for (int g = 0; g < GN; ++g) acc[g] = vfmadd(vload(q[g] + i), k, acc[g]);
      }
      for (int g = 0; g < GN; ++g) part[g][u] = vfold8(acc[g]);
    }
    for (int g = 0; g < GN; ++g) _mm256_storeu_ps(out[g] + j, _mm256_mul_ps(hsum8(part[g]), _mm256_set1_ps(scale)));
  }
  for (; j < n; ++j)
    for (int g = 0; g < GN; ++g) out[g][j] = dot_head(q[g], kp + slots[j] * row, dd) * scale;
}

template <int GN, typename T>
void score_keys_group_any(const float* const* q, const T* kp, const int64_t* slots, int64_t row, int64_t d,
                          int64_t n, float scale, float* const* out, int64_t ahead) {
  if (d == 64) return score_keys_group<64, GN>(q, kp, slots, row, d, n, scale, out, ahead);
  if (d == 128) return score_keys_group<128, GN>(q, kp, slots, row, d, n, scale, out, ahead);
  score_keys_group<0, GN>(q, kp, slots, row, d, n, scale, out, ahead);
}

// out_g[c*16 .. c*16+16) += sum_j p_g[j] v_j[c*16 ..) over one tile of keys, for GN query
// heads of one KV head: the GN accumulators of one 16-lane chunk stay in registers (AVX2's
// 16 ymm cannot hold 3 heads x 4 chunks), so the chunks take turns over the tile's rows,
// which lie in L1 after the first chunk's pass.
template <int GN, typename T>
inline void weigh_values(const float* const* p, const T* vp, const int64_t* slots, int64_t row,
                         int64_t n, int64_t c, float* const* out, int64_t ahead, int64_t d) {
  V16 acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = vload(out[g] + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    if (c == 0 && j < ahead) prefetch_head(vp + slots[n + j] * row, d);
    const V16 v = vload(vp + slots[j] * row + c * 16);
    for (int g = 0; g < GN; ++g) acc[g] = vfmadd(vset1(p[g][j]), v, acc[g]);
  }
  for (int g = 0; g < GN; ++g) vstore(out[g] + c * 16, acc[g]);
}

#if CW_SIMD == 2
// weigh_values for all NC chunks of the head at once (AVX-512: 32 zmm hold GN x NC <= 12
// accumulators and NC value vectors): each key's value slice is loaded once, and GN x NC
// independent FMA chains run instead of GN, whose latency bounded the chunk-at-a-time loop.
// Every accumulator still adds the tile's keys in order: the same bits as weigh_values.
template <int GN, int NC, typename T>
inline void weigh_values_all(const float* const* p, const T* vp, const int64_t* slots, int64_t row, int64_t n,
                             float* const* out, int64_t ahead, int64_t d) {
  V16 acc[GN][NC];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = vload(out[g] + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    if (j < ahead) prefetch_head(vp + slots[n + j] * row, d);
    const T* vr = vp + slots[j] * row;
    V16 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = vload(vr + c * 16);
    for (int g = 0; g < GN; ++g) {
      const V16 pg = vset1(p[g][j]);
      for (int c = 0; c < NC; ++c) acc[g][c] = vfmadd(pg, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) vstore(out[g] + c * 16, acc[g][c]);
}
#endif

// The largest of n scores (exact in any order: the same value as a scalar scan).
inline float max_score(const float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if (n >= 16) {
    V16 m = vload(s);
    for (j = 16; j + 16 <= n; j += 16) m = vmax(m, vload(s + j));
    top = vhmax(m);
  }
  for (; j < n; ++j) top = std::max(top, s[j]);
  return top;
}

#endif  // CW_SIMD

// Query heads [u0, u1) in runs of at most 4 that share one KV head: f(kv head, first head, count).
template <typename F>
inline void for_head_runs(int64_t u0, int64_t u1, int64_t g_count, F&& f) {
  for (int64_t u = u0; u < u1;) {
    const int64_t h = u / g_count, ue = std::min({u1, (h + 1) * g_count, u + 4});
    f(h, u, static_cast<int>(ue - u));
    u = ue;
  }
}

// f(std::integral_constant<int, gn>) for a run of gn = 1..4 heads (the kernels' GN).
template <typename F>
inline void by_group_size(int gn, F&& f) {
  if (gn == 4) f(std::integral_constant<int, 4>{});
  else if (gn == 3) f(std::integral_constant<int, 3>{});
  else if (gn == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

constexpr int64_t kMaxGroup = 64;  // query heads per KV head (checked at the call)
// Keys per tile: a tile's K (or V) rows, all KV heads of each (contiguous in the pool),
// come from memory once, in address order within a page, and serve every query head from
// L1 (SmolLM2: 16 x 768 B = 12 KB of fp32).
constexpr int64_t kKeyTile = 16;

// Keys per chunk of one sequence's decode attention. A sequence longer than this is split
// into chunks from its first key, each chunk's softmax partial (its max, its sum of
// e^(s - max), its unnormalized sum of values) computed on its own, then merged in chunk
// order (merge_chunks). The chunks are fixed by key index, never by thread count, so the
// result is the same however threads share them, and a sequence of at most kDecodeChunk
// keys is one chunk, computed exactly as an unsplit call (the same bits: W1's 576-key and
// W3's contexts are not split). Before, a batch-1
// step split only heads over threads: SmolLM2's 3 KV heads over 2 threads read 4/3 of
// the K/V, each thread a 128-byte stripe of every 384-byte key row.
constexpr int64_t kDecodeChunk = 1024;

inline int64_t decode_chunks(int64_t num_keys) { return std::max<int64_t>(1, (num_keys + kDecodeChunk - 1) / kDecodeChunk); }

// Query heads [u0, u1) of one sequence (head u reads KV head u / group) over its keys
// [jb, je) (keys < num_sink scored against q_sink, StreamingLLM's re-positioned query;
// num_keys bounds the prefetch). With ml null: softmax, out[u * d] = the weighted values.
// Else the chunk's partial: out[u * d] = sum_j e^(s_j - m) v_j, ml[2u] = m, ml[2u + 1] =
// sum_j e^(s_j - m). Every head's sums run in the same order whatever [u0, u1) is (the
// DecodeStack and the per-layer call split heads differently and agree bit for bit):
// scores in 8-key blocks from the start of each of the two key ranges, values one key
// after another.
template <typename T>
void decode_keys(const DecodeArgs& a, const float* q, const float* q_sink, const T* kp, const T* vp,
                 const int64_t* slots, int64_t jb, int64_t je, int64_t num_keys, int64_t num_sink, int64_t u0,
                 int64_t u1, float* out, float* ml, std::vector<float>& scores) {
  const int64_t d = a.head_dim, row = a.num_kv_heads * d, g_count = a.group, nu = u1 - u0, cn = je - jb;
  scores.resize(nu * cn + nu);
  float *const sc = scores.data(), *const inv = sc + nu * cn;  // inv: 1 / each head's sum
#if CW_SIMD
  const bool vec = d % 16 == 0;
#else
  const bool vec = false;
#endif
  if (vec) {
#if CW_SIMD
    for (int part = 0; part < 2; ++part) {
      const int64_t pb = part ? std::max(jb, num_sink) : jb, pe = part ? je : std::min(je, num_sink);
      const float* qq = part ? q : q_sink;
      for (int64_t j0 = pb; j0 < pe; j0 += kKeyTile) {
        const int64_t tn = std::min(kKeyTile, pe - j0);
        const int64_t next = std::min(kKeyTile, num_keys - j0 - tn);
        for_head_runs(u0, u1, g_count, [&](int64_t h, int64_t u, int gn) {
          const float* qg[4];
          float* og[4];
          for (int g = 0; g < gn; ++g) {
            qg[g] = qq + (u + g) * d;
            og[g] = sc + (u + g - u0) * cn + (j0 - jb);
          }
          by_group_size(gn, [&](auto GN) {
            score_keys_group_any<decltype(GN)::value>(qg, kp + h * d, slots + j0, row, d, tn, a.scale, og, next);
          });
        });
      }
    }
#endif
  } else {
    for (int64_t u = u0; u < u1; ++u)
      for (int64_t j = jb; j < je; ++j)
        sc[(u - u0) * cn + j - jb] =
            dot_head((j < num_sink ? q_sink : q) + u * d, kp + (u / g_count) * d + slots[j] * row, d) * a.scale;
  }
  if (a.softcap > 0)
    for (int64_t i = 0; i < nu * cn; ++i) sc[i] = a.softcap * std::tanh(sc[i] / a.softcap);
  for (int64_t u = 0; u < nu; ++u) {
    float* su = sc + u * cn;
#if CW_SIMD
    const float top = max_score(su, cn);
#else
    const float top = *std::max_element(su, su + cn);
#endif
    const float total = exp_sum(su, cn, top);
    if (ml) {
      ml[2 * (u0 + u)] = top;
      ml[2 * (u0 + u) + 1] = total;
    }
    inv[u] = 1.f / total;
  }
  std::fill(out + u0 * d, out + u1 * d, 0.f);
  if (vec) {
#if CW_SIMD
    for (int64_t j0 = jb; j0 < je; j0 += kKeyTile) {
      const int64_t tn = std::min(kKeyTile, je - j0);
      const int64_t next = std::min(kKeyTile, num_keys - j0 - tn);
      for_head_runs(u0, u1, g_count, [&](int64_t h, int64_t u, int gn) {
        const float* p[4];
        float* o[4];
        for (int g = 0; g < gn; ++g) {
          p[g] = sc + (u + g - u0) * cn + (j0 - jb);
          o[g] = out + (u + g) * d;
        }
        by_group_size(gn, [&](auto GN) {
#if CW_SIMD == 2
          if (d == 64) return weigh_values_all<decltype(GN)::value, 4>(p, vp + h * d, slots + j0, row, tn, o, next, d);
#endif
          for (int64_t c = 0; c < d / 16; ++c)
            weigh_values<decltype(GN)::value>(p, vp + h * d, slots + j0, row, tn, c, o, next, d);
        });
      });
    }
    if (!ml)
      for (int64_t u = u0; u < u1; ++u)
        for (int64_t i = 0; i < d; i += 16) vstore(out + u * d + i, vmul(vload(out + u * d + i), vset1(inv[u - u0])));
#endif
  } else {
    for (int64_t u = u0; u < u1; ++u)
      for (int64_t j = jb; j < je; ++j)
        axpy_head(sc[(u - u0) * cn + j - jb] * (ml ? 1.f : inv[u - u0]), vp + (u / g_count) * d + slots[j] * row,
                  out + u * d, d);
  }
}

// Heads [u0, u1) of a sequence from its nc chunks' partials (chunk c's sums at po + c * stride,
// its maxima and totals at pml + c * 2 * hq): rescaled to the largest max, added in chunk
// order, divided by the total (times its reciprocal, as an unsplit call does).
inline void merge_chunks(const float* po, const float* pml, int64_t nc, int64_t stride, int64_t hq, int64_t d,
                         int64_t u0, int64_t u1, float* out) {
  for (int64_t u = u0; u < u1; ++u) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < nc; ++c) top = std::max(top, pml[c * 2 * hq + 2 * u]);
    float total = 0.f;
    float* o = out + u * d;
    std::fill(o, o + d, 0.f);
    for (int64_t c = 0; c < nc; ++c) {
      const float w = std::exp(pml[c * 2 * hq + 2 * u] - top);
      total += w * pml[c * 2 * hq + 2 * u + 1];
      const float* oc = po + c * stride + u * d;
      for (int64_t i = 0; i < d; ++i) o[i] += w * oc[i];
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

// A decode step's attention as pieces: (sequence, chunk, query head) in that order, each
// chunk of a sequence with more than one writing partials (its slot: first_chunk[s] + c).
struct DecodePlan {
  std::vector<int64_t> first_chunk, num_chunks;  // per sequence
  int64_t total_chunks = 0;
  bool split = false;  // some sequence has more than one chunk
  std::vector<float> partial_o, partial_ml;  // [chunks, hq, d], [chunks, hq, 2]

  DecodePlan(const int64_t* num_keys, int64_t b, int64_t hq, int64_t d) : first_chunk(b), num_chunks(b) {
    for (int64_t s = 0; s < b; ++s) {
      first_chunk[s] = total_chunks;
      total_chunks += num_chunks[s] = decode_chunks(num_keys[s]);
      split = split || num_chunks[s] > 1;
    }
    if (split) {
      partial_o.resize(total_chunks * hq * d);
      partial_ml.resize(total_chunks * hq * 2);
    }
  }

  // Keys [first, end) of sequence s's chunk c (num_keys as given to the constructor).
  std::pair<int64_t, int64_t> keys_of(const int64_t* num_keys, int64_t s, int64_t c) const {
    return {c * kDecodeChunk, std::min(num_keys[s], (c + 1) * kDecodeChunk)};
  }
};

// Pieces [p0, p1) of plan's (sequence, chunk, query head) list (hq heads a chunk): each run
// of one chunk's heads in one decode_keys call.
template <typename T>
void decode_pieces(const DecodeArgs& a, DecodePlan& plan, const float* qp, const float* qsp, const T* kp,
                   const T* vp, const int64_t* sp, int64_t width, const int64_t* np, const int64_t* nsp, int64_t hq,
                   int64_t p0, int64_t p1, float* op, std::vector<float>& scores) {
  const int64_t d = a.head_dim;
  for (int64_t p = p0; p < p1;) {
    const int64_t chunk = p / hq, u0 = p % hq, u1 = std::min(hq, u0 + (p1 - p));
    const int64_t s = std::upper_bound(plan.first_chunk.begin(), plan.first_chunk.end(), chunk) - plan.first_chunk.begin() - 1;
    const auto [jb, je] = plan.keys_of(np, s, chunk - plan.first_chunk[s]);
    const bool whole = plan.num_chunks[s] == 1;  // normalized straight into op
    decode_keys<T>(a, qp + s * hq * d, qsp + s * hq * d, kp, vp, sp + s * width, jb, je, np[s], nsp[s], u0, u1,
                   whole ? op + s * hq * d : plan.partial_o.data() + chunk * hq * d,
                   whole ? nullptr : plan.partial_ml.data() + chunk * hq * 2, scores);
    p += u1 - u0;
  }
}

// The (sequence, head) pairs [r0, r1) of a split plan merged into op (single-chunk ones are done).
inline void merge_pieces(const DecodePlan& plan, int64_t hq, int64_t d, int64_t r0, int64_t r1, float* op) {
  for (int64_t r = r0; r < r1;) {
    const int64_t s = r / hq, u0 = r % hq, u1 = std::min(hq, u0 + (r1 - r));
    if (plan.num_chunks[s] > 1)
      merge_chunks(plan.partial_o.data() + plan.first_chunk[s] * hq * d,
                   plan.partial_ml.data() + plan.first_chunk[s] * hq * 2, plan.num_chunks[s], hq * d, hq, d, u0, u1,
                   op + s * hq * d);
    r += u1 - u0;
  }
}

// The piece a thread's share of plan's list starts at: shares of equal key counts (a
// chunk's pieces cost its keys each), so a long sequence's chunks spread over the threads.
inline int64_t piece_share_start(const DecodePlan& plan, const int64_t* np, int64_t b, int64_t hq, int tid, int team) {
  if (tid <= 0) return 0;
  int64_t total = 0;
  for (int64_t s = 0; s < b; ++s) total += std::max<int64_t>(np[s], 1) * hq;
  const int64_t target = (total * tid + team - 1) / team;  // the first piece at or past tid / team of the keys
  int64_t acc = 0;
  for (int64_t s = 0; s < b; ++s)
    for (int64_t c = 0; c < plan.num_chunks[s]; ++c) {
      const auto [jb, je] = plan.keys_of(np, s, c);
      const int64_t keys = std::max<int64_t>(je - jb, 1);
      if (acc + keys * hq > target) {
        const int64_t into = (target - acc + keys - 1) / keys;  // heads of this chunk before the share starts
        return (plan.first_chunk[s] + c) * hq + std::min(hq, into);
      }
      acc += keys * hq;
    }
  return plan.total_chunks * hq;
}

template <typename T>
void decode_attention_impl(const DecodeArgs& a, const at::Tensor& q, const at::Tensor& q_sink,
                           const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& slots, const at::Tensor& num_keys,
                           const at::Tensor& num_sink, at::Tensor& out) {
  const int64_t b = q.size(0), width = slots.size(1), hq = q.size(1), d = a.head_dim;
  const float* qp = q.data_ptr<float>();
  const float* qsp = q_sink.defined() ? q_sink.data_ptr<float>() : qp;
  const T *kp = k_pool.data_ptr<T>(), *vp = v_pool.data_ptr<T>();
  const int64_t *sp = slots.data_ptr<int64_t>(), *np = num_keys.data_ptr<int64_t>();
  const int64_t* nsp = num_sink.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  DecodePlan plan(np, b, hq, d);
  // Small steps stay on one thread; else each thread its share of the pieces (as the
  // DecodeStack splits them), then of the (sequence, head) merges.
  int64_t keys = 0;
  for (int64_t s = 0; s < b; ++s) keys += np[s];
  const int team = keys * hq * d < (1 << 18) ? 1 : std::max(1, at::get_num_threads());
  at::parallel_for(0, team, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t)
      decode_pieces<T>(a, plan, qp, qsp, kp, vp, sp, width, np, nsp, hq,
                       piece_share_start(plan, np, b, hq, static_cast<int>(t), team),
                       piece_share_start(plan, np, b, hq, static_cast<int>(t + 1), team), op, scores);
  });
  if (plan.split) merge_pieces(plan, hq, d, 0, b * hq, op);
}

}  // namespace

// Decode attention over paged K/V read in place: q [B, Hq, D] fp32, pools
// [blocks, block_size, Hkv, D], slots [B, W] int64 (row s reads its first num_keys[s]),
// the first num_sink[s] keys scored against q_sink (may be empty). -> [B, Hq, D] fp32.
at::Tensor paged_decode_attention(const at::Tensor& q, const c10::optional<at::Tensor>& q_sink,
                                  const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& slots, const at::Tensor& num_keys,
                                  const at::Tensor& num_sink, double scale, double softcap) {
  TORCH_CHECK(q.dtype() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q must be fp32 [B, Hq, D]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 4, "pools must be contiguous");
  TORCH_CHECK(slots.dtype() == at::kLong && num_keys.dtype() == at::kLong && num_sink.dtype() == at::kLong,
              "slots and counts must be int64");
  const int64_t hkv = k_pool.size(2);
  TORCH_CHECK(q.size(1) % hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(1) / hkv <= kMaxGroup, "at most ", kMaxGroup, " query heads per KV head");
  DecodeArgs a{hkv, q.size(1) / hkv, q.size(2), static_cast<float>(scale), static_cast<float>(softcap)};
  at::Tensor qs = q_sink.has_value() ? q_sink->contiguous() : at::Tensor();
  at::Tensor out = at::empty_like(q);
  at::Tensor sl = slots.contiguous();
  if (k_pool.dtype() == at::kFloat)
    decode_attention_impl<float>(a, q, qs, k_pool, v_pool, sl, num_keys, num_sink, out);
  else if (k_pool.dtype() == at::kBFloat16)
    decode_attention_impl<at::BFloat16>(a, q, qs, k_pool, v_pool, sl, num_keys, num_sink, out);
  else
    TORCH_CHECK(false, "the KV pool must be fp32 or bf16");
  return out;
}

// ---- fused small ops of a decode step ------------------------------------------------
// Each replaces 4-12 torch ops whose dispatch (a few microseconds each) costs more than
// their arithmetic on a handful of rows. Rows are independent, so they run on one thread.

namespace {

// silu(g) * u over n elements: g * sigmoid(g), sigmoid from e = exp(-|g|) (a nonpositive
// argument, vexp_nonpositive's range): 1 / (1 + e) for g >= 0, e / (1 + e) below. Sixteen
// lanes at a time (a scalar expf per element cost ~0.5 ms of SmolLM2's batch-1 step and
// ~8 ms of a 16-sequence one); a tail under 16 takes std::exp. Every caller passes chunks
// starting at multiples of 16 from the row's start, so an element is computed the same way
// whichever call (silu_mul, run_layers' column shares) computes it.
inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#if CW_SIMD == 2
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = vexp_nonpositive({_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g))}).v;
    const __mmask16 pos = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 num = _mm512_mask_blend_ps(pos, e, one);
    const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_loadu_ps(up + i)));
  }
#elif CW_SIMD == 1
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 16 <= n; i += 16) {
    for (int h = 0; h < 2; ++h) {
      const __m256 g = _mm256_loadu_ps(gate + i + 8 * h);
      const __m256 e = exp8_nonpositive(_mm256_or_ps(g, sign));  // -|g|
      const __m256 pos = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
      const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, one, pos), _mm256_add_ps(one, e));
      _mm256_storeu_ps(out + i + 8 * h, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i + 8 * h)));
    }
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// Rows of a [T, ...] op split across threads only for prefill-sized steps: a decode step's
// few rows cost less than waking a thread.
constexpr int64_t kRowGrain = 64;

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps, float offset) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = 1.f / std::sqrt(static_cast<float>(ss / n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * r) * (offset + w[i]);
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(), what,
              " must be a contiguous fp32 [T, n] tensor");
}

}  // namespace

// RMSNorm of each row of x [T, n] (fp32): (x / rms(x)) * (offset + w).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  check_rows(x, "x");
  at::Tensor out = at::empty_like(x);
  const int64_t t = x.size(0), n = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps), static_cast<float>(offset));
  });
  return out;
}

// x += delta (in place), then return RMSNorm(x): a residual add and the next norm in one.
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps,
                        double offset) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  at::Tensor out = at::empty_like(x);
  const int64_t t = x.size(0), n = x.size(1);
  float *xp = x.data_ptr<float>(), *op = out.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, t, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * n; i < r1 * n; ++i) xp[i] += dp[i];
    for (int64_t r = r0; r < r1; ++r)
      norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps), static_cast<float>(offset));
  });
  return out;
}

// silu(gate) * up for gate_up [T, 2I] (gate columns first) -> [T, I].
// ---- sampling: each logits row's first argmax, its max and its log-sum-exp -----------------
// What greedy decoding needs from a step's logits (the token and its logprob), in two passes
// over a row that sits in L2 (SmolLM2's 49,152 logits: 192 KiB): the max (and whether a
// lane is NaN or the max infinite, which the caller hands to torch), then e^(x - max)
// summed. torch's argmax and logsumexp took 43 and 57-230 us a row on a Zen 4 EPYC (the
// latter with 2 threads under a passive OpenMP policy): 0.4 ms of a 4-8 ms decode step.
// out[r] = {index, max, lse}; {nan, nan, nan} where the row is not finite.
namespace {
void max_lse_row(const float* x, int64_t v, double* out) {
  const float inf = std::numeric_limits<float>::infinity();
  float mx = -inf;
  bool nan = false;
  int64_t i = 0;
#if CW_SIMD
  V16 m = vset1(-inf);
  for (; i + 16 <= v; i += 16) {
    const V16 a = vload(x + i);
    nan = nan || vany_nan(a);
    m = vmax(m, a);
  }
  mx = vhmax(m);
#endif
  for (; i < v; ++i) {
    nan = nan || std::isnan(x[i]);
    mx = std::max(mx, x[i]);
  }
  if (nan || !std::isfinite(mx) || v == 0) {
    out[0] = out[1] = out[2] = std::numeric_limits<double>::quiet_NaN();
    return;
  }
  int64_t at = 0;  // the first lane holding the max (torch.argmax's choice among ties)
#if CW_SIMD
  const float below = std::nextafter(mx, -inf);
  while (at + 16 <= v && !vany_gt(vload(x + at), below)) at += 16;
#endif
  while (x[at] != mx) ++at;
  double sum = 0.0;
  i = 0;
#if CW_SIMD
  V16 acc = vzero();
  const V16 vm = vset1(mx);
  for (; i + 16 <= v; i += 16) acc = vadd(acc, vexp_nonpositive(vsub(vload(x + i), vm)));
  sum = vsum(acc);
#endif
  for (; i < v; ++i) sum += std::exp(static_cast<double>(x[i]) - mx);
  out[0] = static_cast<double>(at);
  out[1] = mx;
  out[2] = mx + std::log(sum);
}
}  // namespace

at::Tensor logits_max_lse(const at::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t m = logits.size(0), v = logits.size(1);
  at::Tensor out = at::empty({m, 3}, logits.options().dtype(at::kDouble));
  const float* lp = logits.data_ptr<float>();
  double* op = out.data_ptr<double>();
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) max_lse_row(lp + r * v, v, op + 3 * r);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t t = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({t, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      silu_mul_row(gp + r * 2 * inter, gp + r * 2 * inter + inter, op + r * inter, inter);
  });
  return out;
}

namespace {

template <typename T>
void rope_write_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots, int64_t hq,
                     int64_t hkv, int64_t d, at::Tensor& q_out) {
  const int64_t t = qkv.size(0), width = qkv.size(1), rd = cos.size(1), half = rd / 2;
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T *kp = k_pool.data_ptr<T>(), *vp = v_pool.data_ptr<T>();
  float* qo = q_out.data_ptr<float>();
  auto rotate = [&](const float* src, const float* c, const float* s, auto store) {
    for (int64_t i = 0; i < half; ++i) {  // NeoX: first half against second half
      store(i, src[i] * c[i] - src[i + half] * s[i]);
      store(i + half, src[i + half] * c[i + half] + src[i] * s[i + half]);
    }
    for (int64_t i = rd; i < d; ++i) store(i, src[i]);
  };
#if CW_SIMD
  // The usual shape (rotary over the whole head, half a multiple of 16): 16 lanes at a time
  // (a 2,048-row prefill step of SmolLM2, pages touched before: 2.2 -> 0.6 ms). The same products
  // and differences as the scalar loop, each rounded once (no contraction into an FMA).
  if (rd == d && half % 16 == 0) {
    auto rot16 = [&](const float* src, const float* c, const float* sn, auto* dst) {
      for (int64_t i = 0; i < half; i += 16) {
        const V16 a = vload(src + i), b = vload(src + i + half);
        vstore(dst + i, vsub(vmul(a, vload(c + i)), vmul(b, vload(sn + i))));
        vstore(dst + i + half, vadd(vmul(b, vload(c + i + half)), vmul(a, vload(sn + i + half))));
      }
    };
    at::parallel_for(0, t, kRowGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float *row = xp + r * width, *c = cp + r * rd, *sn = sp + r * rd;
        for (int64_t h = 0; h < hq; ++h) rot16(row + h * d, c, sn, qo + (r * hq + h) * d);
        for (int64_t h = 0; h < hkv; ++h) {
          rot16(row + (hq + h) * d, c, sn, kp + (slot[r] * hkv + h) * d);
          const float* vs = row + (hq + hkv + h) * d;
          T* vd = vp + (slot[r] * hkv + h) * d;
          for (int64_t i = 0; i < d; i += 16) vstore(vd + i, vload(vs + i));
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, t, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // rows write distinct slots: any split is safe
      const float *row = xp + r * width, *c = cp + r * rd, *s = sp + r * rd;
      for (int64_t h = 0; h < hq; ++h) {
        float* dst = qo + (r * hq + h) * d;
        rotate(row + h * d, c, s, [&](int64_t i, float v) { dst[i] = v; });
      }
      for (int64_t h = 0; h < hkv; ++h) {
        T* kd = kp + (slot[r] * hkv + h) * d;
        T* vd = vp + (slot[r] * hkv + h) * d;
        rotate(row + (hq + h) * d, c, s, [&](int64_t i, float v) { kd[i] = static_cast<T>(v); });
        const float* vs = row + (hq + hkv + h) * d;
        for (int64_t i = 0; i < d; ++i) vd[i] = static_cast<T>(vs[i]);
      }
    }
  });
}

}  // namespace

// From a fused projection qkv [T, (Hq + 2 Hkv) * D]: rotate q and k by cos/sin [T, rd],
// write rotated k and v to the pool at flat slots [T], return rotated q [T, Hq, D].
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                         int64_t hq, int64_t hkv, int64_t d) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d, "qkv width does not match the head counts");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == at::kFloat, "cos/sin must be fp32");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  TORCH_CHECK(slots.dtype() == at::kLong && slots.numel() == qkv.size(0), "one int64 slot per row");
  at::Tensor q = at::empty({qkv.size(0), hq, d}, qkv.options());
  if (k_pool.dtype() == at::kFloat)
    rope_write_impl<float>(qkv, cos, sin, k_pool, v_pool, slots, hq, hkv, d, q);
  else if (k_pool.dtype() == at::kBFloat16)
    rope_write_impl<at::BFloat16>(qkv, cos, sin, k_pool, v_pool, slots, hq, hkv, d, q);
  else
    TORCH_CHECK(false, "the KV pool must be fp32 or bf16");
  return q;
}

// ---- dense fp32 weights at a few rows (decode) ------------------------------------------
// A decode step's dense projection reads every weight once and does 2 flops per 4 bytes:
// the rate is the memory's. A tile of weight rows streams in once and serves every row of
// x while it sits in L1 (4 rows x K x 4 bytes: 9 KB at K = 576).
//
// decode_layer (below) names each projection's kernel by a mode, assigned in
// layers/linear.py's decode_kernel: 0 plain fp32 weight (dense_linear), 1 q4 with fp32
// activations, 2 q8 with fp32 activations, 3 q4 with int8 activations, 4 q8 with int8
// activations, 5 plain bf16 weight (dense_linear, fp32 activations), 6 q4 with int8
// activations from its panels (q4_panels; slots: codes, scales, panels).

namespace {

// y[r, n0 + b] for NB weight rows x R rows of x: each weight load feeds R FMAs and each
// x load NB (a 2 x 2 tile of V16 issues one load per FMA, the load ports' rate).
template <int NB, int R, typename L = DenseLanes, typename W>
inline void dense_tile(const W* w, int64_t k, const float* x, int64_t n0, int64_t r0,
                       float* y, int64_t ldy) {
#if CW_SIMD
  typename L::T acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = L::zero();
  int64_t i = 0;
  for (; i + L::kWidth <= k; i += L::kWidth) {
    typename L::T wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = L::load(w + (n0 + b) * k + i);
    for (int r = 0; r < R; ++r) {
      const typename L::T xv = L::load(x + (r0 + r) * k + i);
      for (int b = 0; b < NB; ++b) acc[b][r] = L::fma(wv[b], xv, acc[b][r]);
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) {
      const W* wr = w + (n0 + b) * k;
      const float* xr = x + (r0 + r) * k;
      float s = L::sum(acc[b][r]);
      for (int64_t j = i; j < k; ++j) s += static_cast<float>(wr[j]) * xr[j];
      y[(r0 + r) * ldy + n0 + b] = s;
    }
#else
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int64_t j = 0; j < k; ++j) s += static_cast<float>(w[(n0 + b) * k + j]) * x[(r0 + r) * k + j];
      y[(r0 + r) * ldy + n0 + b] = s;
    }
#endif
}

// Weight rows per tile at one row of x: N1 (several streams in flight, each weight row
// read beside its neighbours) or, where g_dense_one_stream is set, one row at a time
// (the weight read as one sequential stream, the order a hardware prefetcher follows
// best). Which is faster depends on the CPU: on a Zen 4 EPYC (SmolLM2's batch-1 matmuls,
// passive, minima of 30 interleaved rounds) one stream took fp32's 538 MB in 13-20% less
// time than 8 rows (N1 = 2 lost 15-20%), bf16's 269 MB in 35% less (13.9 against 21.3
// ms); on a Zen 5, 8 rows had beaten 4 for bf16 (below). layers/linear.py times both
// once per process (dense_one_stream) and sets it. Each output's sum is the same either
// way, so the results are bit-identical.
#if !defined(CW_DENSE_N1)
#if CW_SIMD == 2
#define CW_DENSE_N1 8  // fp32 on the Zen 4: 1.08-1.10x 4 rows (8 zmm accumulators)
#else
#define CW_DENSE_N1 4  // AVX2: 8 would not fit 16 ymm registers
#endif
#endif
std::atomic<bool> g_dense_one_stream{false};

#if !defined(CW_DENSE_N)  // fp32 / bf16 weights at several rows: AVX2's 3 x 4 ymm (DenseLanes)
#if CW_SIMD == 1
#define CW_DENSE_N 3
#define CW_DENSE_M 4
#else
#define CW_DENSE_N 2
#define CW_DENSE_M 2
#endif
#endif

// Tile shapes per weight type: N1 weight rows at one row of x; NB x R at several rows,
// NBW x RW from 8 rows up. A bf16 weight under AVX-512 takes wider tiles (measured on a
// Zen 5 EPYC, SmolLM2's 120 projections, passive threads, medians of 15: at 1 row N1 = 8
// 12.1 ms against 13.0 at 4; at 16 rows 4 x 4 26.1-27.5 ms against 31.4 at 2 x 2, while
// 4 rows lost 3-8% at 4 x 4). The same changes on an fp32 weight gained nothing at 16
// rows (37.3 vs 38.1-38.6 ms) and lost 5-7% at 4, so fp32 keeps its tiles.
template <typename W>
struct DenseTiles {
  static constexpr int N1 = CW_DENSE_N1, NB = CW_DENSE_N, R = CW_DENSE_M, NBW = NB, RW = R;
};
#if CW_SIMD == 2
template <>
struct DenseTiles<at::BFloat16> {
  static constexpr int N1 = 8, NB = CW_DENSE_N, R = CW_DENSE_M, NBW = 4, RW = 4;
};
#endif

// Weight rows [begin, end) against every row of x: blocks of NB (NBW) rows, each serving
// all of x while it sits in L1.
template <int NB, int R, typename L, typename W>
inline void dense_block(const W* w, int64_t k, const float* x, int64_t m, int64_t n0, float* y, int64_t ldy) {
  int64_t r0 = 0;
  for (; r0 + R <= m; r0 += R) dense_tile<NB, R, L>(w, k, x, n0, r0, y, ldy);
  for (; r0 < m; ++r0) dense_tile<NB, 1, L>(w, k, x, n0, r0, y, ldy);
}

template <typename W>
inline void dense_range(const W* w, int64_t k, const float* x, int64_t m, int64_t begin,
                        int64_t end, float* y, int64_t ldy) {
  using T = DenseTiles<W>;
  int64_t n0 = begin;
  if (m == 1) {
    if (!g_dense_one_stream.load(std::memory_order_relaxed))
      for (; n0 + T::N1 <= end; n0 += T::N1) dense_tile<T::N1, 1>(w, k, x, n0, 0, y, ldy);
  } else if (m >= 8) {
    for (; n0 + T::NBW <= end; n0 += T::NBW) dense_block<T::NBW, T::RW>(w, k, x, m, n0, y, ldy);
  } else {
    for (; n0 + T::NB <= end; n0 += T::NB) dense_block<T::NB, T::R>(w, k, x, m, n0, y, ldy);
  }
  for (; n0 < end; ++n0)
    for (int64_t r0 = 0; r0 < m; ++r0) dense_tile<1, 1>(w, k, x, n0, r0, y, ldy);
}

}  // namespace

// y [M, N] = x [M, K] @ w^T for a plain fp32 or bf16 weight w [N, K] (row-major, as
// stored). A bf16 weight is widened to fp32 in registers (a 16-bit shift: exact) and
// multiplied with the fp32 activations, so the result is the bf16-rounded weight's fp32
// product at half the bytes streamed.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK((w.dtype() == at::kFloat || w.dtype() == at::kBFloat16) && w.dim() == 2 && w.is_contiguous(),
              "w must be a contiguous fp32 or bf16 [N, K] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k, "x has ", k, " features, the weight ", w.size(1));
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // at least 2^15 multiply-adds (128 KB of fp32 weights at one row) per thread: less is
  // not worth a wake-up
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 15) / std::max<int64_t>(1, k * m));
  auto run = [&](const auto* wp) {
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { dense_range(wp, k, xp, m, begin, end, yp, n); });
  };
  if (w.dtype() == at::kBFloat16) run(w.data_ptr<at::BFloat16>());
  else run(w.data_ptr<float>());
  return y;
}

// ---- one whole decode layer ---------------------------------------------------------------
// The fused ops above, in the order models/llama.py's fused path calls them, in one call and
// one parallel region. Called op by op, a layer costs ~10 calls from Python (~25-35 us of
// dispatch and glue) and opens a parallel region for each projection and attention: ~6 per
// layer, each a wake-up of the other threads (~12 us under OMP_WAIT_POLICY=PASSIVE, which is
// ~2 ms of SmolLM2's batch-1 step). Here the threads start once per layer and pass the
// phases through a spin barrier (they are all running then: a wait is the imbalance of two
// shares, a microsecond). Same kernels on the same inputs, and every output element is
// computed whole by one thread in the same order whatever the split, so the result is
// bit-identical to the Python sequence (tests/runner/test_kernels.py).
// A projection is a mode (see dense_linear's section) and three tensors, unused ones empty.

namespace {

at::Tensor run_linear(const at::Tensor& x, int64_t mode, const at::Tensor* t) {
  switch (mode) {
    case 0: return dense_linear(x, t[0]);
    case 1: return q4_linear(x, t[0], t[1], t[2]);
    case 2: return q8_linear(x, t[0], t[1]);
    case 3: return quantized_linear_int8(x, t[0], t[1], t[2], c10::nullopt);
    case 4: return quantized_linear_int8(x, t[0], t[1], c10::nullopt, c10::nullopt);
    case 5: return dense_linear(x, t[0]);
    case 6: return q4_panel_linear(x, t[1].size(0), t[1].size(1) * kGroup, t[0]);
  }
  TORCH_CHECK(false, "unknown projection mode ", mode);
}

// One projection of a layer, its tensors checked and read once, before the parallel region.
struct Projection {
  int64_t mode, n, k;
  const void* codes;  // mode 0 / 5: the fp32 / bf16 weight
  const at::Half *scale, *zero;
};

Projection projection_of(int64_t mode, const at::Tensor* t) {
  TORCH_CHECK(mode >= 0 && mode <= 6, "unknown projection mode ", mode);
  TORCH_CHECK(t[0].is_contiguous() && t[0].dim() == 2, "a projection's weight must be contiguous [N, K]");
  if (mode == 6) {  // q4 with int8 activations from panels: [panels, scales (for N, K), -]
    TORCH_CHECK(t[1].dim() == 2, "mode 6 needs the weight's scales [N, K / 32] for its shape");
    const int64_t n = t[1].size(0), k = t[1].size(1) * kGroup;
#if CW_Q4_PANELS
    check_panels(t[0], n, k);
#else
    TORCH_CHECK(false, "mode 6 (q4 panels) needs the AVX-512 VNNI build of the kernels");
#endif
    return {mode, n, k, t[0].data_ptr(), nullptr, nullptr};
  }
  if (mode == 0 || mode == 5) {
    TORCH_CHECK(t[0].dtype() == (mode == 0 ? at::kFloat : at::kBFloat16),
                "mode ", mode, " takes a plain ", mode == 0 ? "fp32" : "bf16", " weight");
    return {mode, t[0].size(0), t[0].size(1), t[0].data_ptr(), nullptr, nullptr};
  }
  const bool q4 = mode == 1 || mode == 3;
  TORCH_CHECK(t[0].dtype() == (q4 ? at::kByte : at::kChar), q4 ? "q4 codes must be uint8" : "q8 codes must be int8");
  const int64_t k = q4 ? t[0].size(1) * 2 : t[0].size(1);
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(t[1].dtype() == at::kHalf && t[1].is_contiguous(), "scales must be fp16");
  TORCH_CHECK(!q4 || (t[2].dtype() == at::kHalf && t[2].is_contiguous()), "zeros must be fp16");
#if !CW_SIMD
  TORCH_CHECK(mode < 3, "int8 activations need the AVX2 or AVX-512 build of the kernels");
#endif
  return {mode, t[0].size(0), k, t[0].data_ptr(), t[1].data_ptr<at::Half>(),
          q4 ? t[2].data_ptr<at::Half>() : nullptr};
}

// Scratch a thread keeps through a layer: x rounded to int8 for the modes that take it.
struct ThreadScratch {
#if CW_SIMD
  Int8Rows xa;
  Q4Panel panel;
#endif
  std::vector<float> scores;
};

// Weight rows [begin, end) of p against x [m, p.k] into y [m, p.n].
void project_rows(const Projection& p, const float* x, int64_t m, int64_t begin, int64_t end, float* y,
                  ThreadScratch& s) {
  switch (p.mode) {
    case 0: dense_range(static_cast<const float*>(p.codes), p.k, x, m, begin, end, y, p.n); return;
    case 5: dense_range(static_cast<const at::BFloat16*>(p.codes), p.k, x, m, begin, end, y, p.n); return;
    case 1: q4_rows(x, m, p.k, static_cast<const uint8_t*>(p.codes), p.scale, p.zero, begin, end, y, p.n); return;
    case 2: q8_rows(x, m, p.k, static_cast<const int8_t*>(p.codes), p.scale, begin, end, y, p.n); return;
  }
#if CW_SIMD
  size_rows(s.xa, m, p.k);
#if CW_Q4_PANELS
  if (p.mode == 6) {  // begin: a multiple of 16 (project's share)
    quantize_row_range(x, p.k, 0, m, s.xa, false);
    q4_panel_range(s.xa, m, p.k, p.n, begin, end, static_cast<const uint8_t*>(p.codes), y, p.n);
    return;
  }
#endif
  const bool gemm = p.mode == 3 && m >= gemm_min_rows();  // as quantized_linear_int8 chooses
  quantize_row_range(x, p.k, 0, m, s.xa, p.mode == 3 && !gemm);  // each thread its own copy: K*m, tiny
  const auto* cp = static_cast<const uint8_t*>(p.codes);
  if (gemm) q4_gemm_range(s.xa, m, p.k, begin, end, cp, p.scale, p.zero, y, p.n, s.panel);
  else if (p.mode == 3) linear_i8_range<true>(s.xa, m, p.k, begin, end, cp, p.scale, p.zero, y, p.n);
  else linear_i8_range<false>(s.xa, m, p.k, begin, end, cp, p.scale, nullptr, y, p.n);
#endif
}

// Items [begin, end) of n for thread tid of nt: equal shares, rounded up to `align` items.
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int nt, int64_t align) {
  int64_t chunk = (n + nt - 1) / nt;
  chunk = (chunk + align - 1) / align * align;
  const int64_t begin = std::min(n, tid * chunk);
  return {begin, std::min(n, begin + chunk)};
}

// The threads of one parallel region meet here between phases. They spin (pause) rather
// than sleep: all of them are working, so a wait lasts as long as the imbalance of their
// shares. One that waits long (another process took its core's partner) yields.
class SpinBarrier {
 public:
  void wait(int threads) {
    if (threads == 1) return;
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == threads - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();
    }
  }

 private:
  std::atomic<int> count_{0}, gen_{0};
};

}  // namespace

namespace {

// What stays the same from step to step: a layer's projections, norms and KV pool pair.
struct LayerParts {
  Projection pj[4];
  const float *input_norm, *post_norm;
  at::Tensor k_pool, v_pool;
};

// A model's shape as the layers see it.
struct StackShape {
  int64_t hidden, hq, hkv, d, inter;
  float eps, offset;
  bool bf16_pool;
};

// Checks a layer's tensors against the shape and reads them into parts (before any region).
LayerParts layer_parts(const StackShape& sh, const at::Tensor* norms, const at::Tensor* weights,
                       const int64_t* modes, const at::Tensor& k_pool, const at::Tensor& v_pool) {
  LayerParts l{{projection_of(modes[0], weights), projection_of(modes[1], weights + 3),
                projection_of(modes[2], weights + 6), projection_of(modes[3], weights + 9)},
               nullptr, nullptr, k_pool, v_pool};
  const Projection* pj = l.pj;
  TORCH_CHECK(pj[0].k == sh.hidden && pj[0].n == (sh.hq + 2 * sh.hkv) * sh.d && pj[1].k == sh.hq * sh.d &&
                  pj[1].n == sh.hidden && pj[2].k == sh.hidden && pj[2].n == 2 * sh.inter && pj[3].k == sh.inter &&
                  pj[3].n == sh.hidden,
              "a decode layer's weights do not match hidden size ", sh.hidden, ", intermediate size ", sh.inter,
              " and heads ", sh.hq, "/", sh.hkv, "x", sh.d);
  for (int i = 0; i < 2; ++i)
    TORCH_CHECK(norms[i].dtype() == at::kFloat && norms[i].is_contiguous() && norms[i].numel() == sh.hidden,
                "norm weights must be fp32 [", sh.hidden, "]");
  l.input_norm = norms[0].data_ptr<float>();
  l.post_norm = norms[1].data_ptr<float>();
  const auto pool_dtype = sh.bf16_pool ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 4 && k_pool.size(2) == sh.hkv &&
                  k_pool.size(3) == sh.d && v_pool.sizes() == k_pool.sizes() && k_pool.dtype() == pool_dtype &&
                  v_pool.dtype() == pool_dtype,
              "KV pools must be contiguous ", sh.bf16_pool ? "bf16" : "fp32", " [blocks, block_size, ", sh.hkv, ", ",
              sh.d, "]");
  return l;
}

StackShape stack_shape(int64_t hidden, int64_t inter, int64_t hq, int64_t hkv, int64_t d, double eps,
                       double offset, const at::Tensor& k_pool) {
  TORCH_CHECK(hq % hkv == 0 && hq / hkv <= kMaxGroup, "query heads must be a multiple of KV heads (at most ",
              kMaxGroup, " per KV head)");
  TORCH_CHECK(k_pool.dtype() == at::kFloat || k_pool.dtype() == at::kBFloat16, "the KV pool must be fp32 or bf16");
  return {hidden, hq, hkv, d, inter, static_cast<float>(eps), static_cast<float>(offset),
          k_pool.dtype() == at::kBFloat16};
}

// Layers [0, n) of a decode step on x [T, hidden] (in place), all in one parallel region.
void run_layers(const StackShape& sh, const LayerParts* layers, int64_t n, at::Tensor& x, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& key_slots,
                const at::Tensor& num_keys, const at::Tensor& num_sink, double scale, double softcap) {
  check_rows(x, "x");
  const int64_t t = x.size(0), hidden = sh.hidden, hq = sh.hq, hkv = sh.hkv, d = sh.d, inter = sh.inter;
  TORCH_CHECK(x.size(1) == hidden, "x has ", x.size(1), " features, the layers ", hidden);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == at::kFloat && sin.dtype() == at::kFloat &&
                  cos.dim() == 2 && cos.size(0) == t && sin.sizes() == cos.sizes() && cos.size(1) <= d,
              "cos/sin must be fp32 [T, rotary dims]");
  TORCH_CHECK(slot_mapping.dtype() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == t,
              "one int64 slot per row");
  TORCH_CHECK(key_slots.dtype() == at::kLong && num_keys.dtype() == at::kLong && num_sink.dtype() == at::kLong &&
                  key_slots.dim() == 2 && key_slots.size(0) == t && num_keys.numel() == t && num_sink.numel() == t &&
                  num_keys.is_contiguous() && num_sink.is_contiguous(),
              "slots and counts must be int64, one row per sequence");
  const DecodeArgs a{hkv, hq / hkv, d, static_cast<float>(scale), static_cast<float>(softcap)};
  const int nt = std::max(1, at::get_num_threads());
  const auto f = x.options();
  at::Tensor qkv = at::empty({t, (hq + 2 * hkv) * d}, f), q = at::empty({t, hq, d}, f), attn = at::empty({t, hq * d}, f),
             o = at::empty({t, hidden}, f), gu = at::empty({t, 2 * inter}, f), act = at::empty({t, inter}, f),
             dn = at::empty({t, hidden}, f), own = at::empty({nt, 3, t, hidden}, f);
  const at::Tensor slots = key_slots.contiguous();
  float *xp = x.data_ptr<float>(), *qkvp = qkv.data_ptr<float>(), *qp = q.data_ptr<float>(),
        *attnp = attn.data_ptr<float>(), *op = o.data_ptr<float>(), *gup = gu.data_ptr<float>(),
        *actp = act.data_ptr<float>(), *dnp = dn.data_ptr<float>(), *ownp = own.data_ptr<float>();
  const int64_t *sp = slots.data_ptr<int64_t>(), *np = num_keys.data_ptr<int64_t>(), *nsp = num_sink.data_ptr<int64_t>();
  const int64_t width = slots.size(1);
  DecodePlan plan(np, t, hq, d);  // the same pieces in every layer
  SpinBarrier barrier;

#pragma omp parallel num_threads(nt)
  {
#if defined(_OPENMP)
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
#else
    const int tid = 0, team = 1;
#endif
    ThreadScratch scratch;
    float *h = ownp + (tid * 3) * t * hidden, *r = h + t * hidden, *h2 = r + t * hidden;
    auto project = [&](const Projection& p, const float* in, float* out) {
      const auto [b, end] = share(p.n, tid, team, p.mode == 6 ? 16 : 8);  // 6: whole panels
      if (b < end) project_rows(p, in, t, b, end, out, scratch);
      barrier.wait(team);
    };
    const auto [ub, ue] = share(t * hq, tid, team, 1);  // attention merges: (sequence, query head)
    const int64_t pb = piece_share_start(plan, np, t, hq, tid, team), pe = piece_share_start(plan, np, t, hq, tid + 1, team);
    const auto [cb, ce] = share(inter, tid, team, 16);
    const auto [xb, xe] = share(t * hidden, tid, team, 16);
    for (int64_t li = 0; li < n; ++li) {
      const LayerParts& l = layers[li];
      // each thread its own norm of x: no barrier
      for (int64_t i = 0; i < t; ++i) norm_row(xp + i * hidden, l.input_norm, h + i * hidden, hidden, sh.eps, sh.offset);
      project(l.pj[0], h, qkvp);
      if (tid == 0) {
        at::Tensor kpool = l.k_pool, vpool = l.v_pool;  // handles (rope_write_impl takes references)
        if (sh.bf16_pool) rope_write_impl<at::BFloat16>(qkv, cos, sin, kpool, vpool, slot_mapping, hq, hkv, d, q);
        else rope_write_impl<float>(qkv, cos, sin, kpool, vpool, slot_mapping, hq, hkv, d, q);
      }
      barrier.wait(team);
      const void *kp = l.k_pool.data_ptr(), *vp = l.v_pool.data_ptr();
      if (sh.bf16_pool)  // this thread's pieces: (sequence, chunk, query head), as the per-layer call splits them
        decode_pieces<at::BFloat16>(a, plan, qp, qp, static_cast<const at::BFloat16*>(kp),
                                    static_cast<const at::BFloat16*>(vp), sp, width, np, nsp, hq, pb, pe, attnp,
                                    scratch.scores);
      else
        decode_pieces<float>(a, plan, qp, qp, static_cast<const float*>(kp), static_cast<const float*>(vp), sp, width,
                             np, nsp, hq, pb, pe, attnp, scratch.scores);
      barrier.wait(team);
      if (plan.split) {  // the chunks of long sequences merged, each thread its (sequence, head) share
        merge_pieces(plan, hq, d, ub, ue, attnp);
        barrier.wait(team);
      }
      project(l.pj[1], attnp, op);
      for (int64_t i = 0; i < t * hidden; ++i) r[i] = xp[i] + op[i];  // x + o, each thread its own
      for (int64_t i = 0; i < t; ++i) norm_row(r + i * hidden, l.post_norm, h2 + i * hidden, hidden, sh.eps, sh.offset);
      project(l.pj[2], h2, gup);
      for (int64_t i = 0; i < t; ++i)  // silu(gate) * up, as silu_mul computes it (cb: a multiple of 16)
        silu_mul_row(gup + i * 2 * inter + cb, gup + i * 2 * inter + inter + cb, actp + i * inter + cb, ce - cb);
      barrier.wait(team);
      project(l.pj[3], actp, dnp);
      for (int64_t i = xb; i < xe; ++i) xp[i] = r[i] + dnp[i];  // (x + o) + down
      if (li + 1 < n) barrier.wait(team);  // the next layer's norm reads all of x
    }
  }
}

}  // namespace

// A model's decode layers, held once: run() takes a whole decode step's layers in one call
// and one parallel region (the threads start once per step, not once per layer). Built from
// per-layer lists: norms [2L] (input, post-attention), weights [12L] (qkv, o, gate_up, down; 3
// slots each), modes [4L], and each layer's K/V pool pair (the pool's tensors never change).
class DecodeStack {
 public:
  DecodeStack(const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& weights,
              const std::vector<int64_t>& modes, const std::vector<at::Tensor>& k_pools,
              const std::vector<at::Tensor>& v_pools, int64_t hidden, int64_t inter, int64_t hq, int64_t hkv,
              int64_t d, double eps, double offset) {
    const size_t n = k_pools.size();
    TORCH_CHECK(n > 0 && v_pools.size() == n && norms.size() == 2 * n && weights.size() == 12 * n &&
                    modes.size() == 4 * n,
                "DecodeStack takes per layer 2 norms, 12 weight tensors, 4 modes and a K/V pool pair");
    shape_ = stack_shape(hidden, inter, hq, hkv, d, eps, offset, k_pools[0]);
    held_ = norms;
    held_.insert(held_.end(), weights.begin(), weights.end());
    for (size_t i = 0; i < n; ++i)
      layers_.push_back(layer_parts(shape_, &norms[2 * i], &weights[12 * i], &modes[4 * i], k_pools[i], v_pools[i]));
  }

  void run(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
           const at::Tensor& key_slots, const at::Tensor& num_keys, const at::Tensor& num_sink, double scale,
           double softcap) const {
    run_layers(shape_, layers_.data(), static_cast<int64_t>(layers_.size()), x, cos, sin, slot_mapping, key_slots,
               num_keys, num_sink, scale, softcap);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  StackShape shape_{};
  std::vector<at::Tensor> held_;  // keeps the weights alive while layers_ points into them
  std::vector<LayerParts> layers_;
};

// One decode layer (a one-layer DecodeStack): x [T, hidden] fp32 updated in place (the
// residual stream); weights: 12 tensors (qkv, o, gate_up, down; 3 slots each) with modes
// [4]; norms [2]: input, post-attention.
void decode_layer(at::Tensor& x, const std::vector<at::Tensor>& norms, double eps, double offset,
                  const std::vector<at::Tensor>& weights, const std::vector<int64_t>& modes,
                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool, at::Tensor& v_pool,
                  const at::Tensor& slot_mapping, int64_t hq, int64_t hkv, int64_t d,
                  const at::Tensor& key_slots, const at::Tensor& num_keys, const at::Tensor& num_sink,
                  double scale, double softcap) {
  TORCH_CHECK(norms.size() == 2 && weights.size() == 12 && modes.size() == 4,
              "decode_layer takes 2 norms, 12 weight tensors and 4 modes");
  TORCH_CHECK(modes[2] >= 0 && modes[2] <= 6 && weights[6].dim() == 2 && (modes[2] != 6 || weights[7].dim() == 2),
              "gate_up must be a [2I, K] weight");
  // mode 6: [panels, scales [2I, K / 32], -] (the panels' rows are 2I / 16)
  const int64_t gate_up_rows = (modes[2] == 6 ? weights[7] : weights[6]).size(0);
  const StackShape sh = stack_shape(x.size(1), gate_up_rows / 2, hq, hkv, d, eps, offset, k_pool);
  const LayerParts l = layer_parts(sh, norms.data(), weights.data(), modes.data(), k_pool, v_pool);
  run_layers(sh, &l, 1, x, cos, sin, slot_mapping, key_slots, num_keys, num_sink, scale, softcap);
}

// Which vector set the kernels were compiled for: "avx512", "avx2" or "none" (scalar loops:
// the quantized linears 7.5-13x slower than a dense fp32 matvec at one row, 40x at 16 rows).
std::string simd_level() { return CW_SIMD == 2 ? "avx512" : CW_SIMD == 1 ? "avx2" : "none"; }

// Rows of x from which q4_linear / q8_linear dequantize a block of weight rows once (the
// panel) instead of per tile of rows; returns the previous value. 0 in the scalar build,
// which has one path.
int64_t set_qdense_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "the panel's first row count must be >= 1, got ", rows);
#if CW_SIMD
  return g_qdense_min_rows.exchange(rows);
#else
  return 0;
#endif
}

// ---- prefill attention: flash attention over a chunk's keys ------------------------------
// torch's CPU flash attention ran SmolLM2's causal prefill attention (9 heads of 64, 3 KV
// heads) at ~110-125 GFLOP/s on a Zen 5 EPYC whose fp32 GEMMs reach ~400: its tiles are
// small GEMM calls with the softmax between. Here one task is (KV head, block of queries):
// the group's query heads of those queries share every K/V block they read; a key block
// (64 keys) is transposed once into a buffer and scored by a register tile (kFaRows query
// rows x 64 keys: on AVX-512 6 x 4 zmm accumulators, per head dimension 4 key loads and 6
// query broadcasts for 24 FMAs), then an online softmax per row (running max and sum, the
// output rescaled when the max grows) and P x V by a kFaRows x 64 values tile. Masking
// is the runner's rule (runner/attention.py): key k visible to query p when k <= p and
// (no window, p - k < window, or k a sink); sink keys are scored against the query
// rotated for them (q_sink). fp32 throughout: the softmax of the same scores as SDPA in
// another summation order (1e-6 of its output); ~300 GFLOP/s at 4,096 causal tokens.
namespace {

#if CW_SIMD
constexpr int64_t kFaKeys = 64;  // keys per block: 4 V16
// Query rows per register tile (-DCW_FA_ROWS=.. to measure). AVX-512: 6 rows x 4 V16 = 24
// accumulators and 4 key vectors of 32 zmm; measured on the Zen 5 EPYC (9 heads of 64, 3
// KV heads, causal, 2,048 / 4,096 tokens, medians of 7) 15.6 / 64.6 ms, against 23.3 /
// 94.2 at 4 rows, 19.8 / 73.9 at 7 (spills) and torch's flash attention 36.1 / 144.5.
// AVX2 (16 ymm, a V16 is two): 6 rows x 1 V16 of keys (12 accumulators, 2 key vectors, a
// broadcast), the 64-key block in four such passes; measured on the AVX2 EPYC (Zen 3, same
// shapes, medians of 5-7) 2.6 / 34.4 / 145 ms at 512 / 2,048 / 4,096 tokens against torch's
// flash attention 4.9 / 47.7 / 192 (1.33-1.89x); 1 x 4 (the AVX-512 shape's one row) 2.9 /
// 42.5 / 183, 2 x 2 48.2 at 2,048, 5 x 1 35.6 / 152, 7 x 1 (spills) 42.5 / 179.
#if !defined(CW_FA_ROWS)
#define CW_FA_ROWS 6
#endif
#if !defined(CW_FA_COLS)  // V16 of keys per register tile: 4, 2 or 1
#if CW_SIMD == 2
#define CW_FA_COLS 4
#else
#define CW_FA_COLS 1
#endif
#endif
constexpr int kFaRows = CW_FA_ROWS, kFaCols = CW_FA_COLS;
// Query rows (queries x the group's heads) per task: 96 against 48 (2.0x vs 2.3x torch's)
// and 192 (level) on the Zen 5; 96 keeps short chunks split across threads.
#if !defined(CW_FA_TASK_ROWS)
#define CW_FA_TASK_ROWS 96
#endif

struct FlashArgs {
  int64_t n, m, hq, hkv, d, g;  // queries, keys, heads, head dim, query heads per KV head
  int64_t q0, k0, window;        // first query / key position, window (0: none)
  float scale;
  bool amx = false;  // bf16 dots on the tile units (CW_FA_AMX): every row in 16-row tiles
  // bf16 path: the packed column where the keys after the sinks start, a whole key block
  // past them (sink_gap), so their tiles load from block-aligned columns
  int64_t key_column = 0;
};

// Where the keys after num_sink sinks start in the bf16 packed layout: the sinks' block
// rounded up to whole key blocks (0 sinks: 0). With the 4 sinks of StreamingLLM at column
// 4, every window key tile loaded 16 bytes off its block: 2,048 queries over a window of
// 1,024 took 8.9-9.1 ms on AMX against 8.0-8.1 with the gap (window only: 7.4).
inline int64_t sink_gap(int64_t num_sink) { return (num_sink + kFaKeys - 1) / kFaKeys * kFaKeys; }

// S[r, 0..64) = Q[r] . Kt[:, 0..64) for RT rows from r0 (Kt: [d][ldk], Q pre-scaled).
template <int RT, int CT>
inline void fa_scores(const float* qb, const float* kt, int64_t ldk, int64_t d, int64_t r0, float* s) {
  V16 acc[RT][CT];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c) acc[r][c] = vzero();
  for (int64_t dd = 0; dd < d; ++dd) {
    V16 kv[CT];
    for (int c = 0; c < CT; ++c) kv[c] = vload(kt + dd * ldk + c * 16);
    for (int r = 0; r < RT; ++r) {
      const V16 qv = vbroadcast(qb + (r0 + r) * d + dd);
      for (int c = 0; c < CT; ++c) acc[r][c] = vfmadd(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c) vstore(s + (r0 + r) * kFaKeys + c * 16, acc[r][c]);
}

// O[r, c0*16 .. (c0+CT)*16) += P[r, 0..nb) V[0..nb) for RT rows from r0 (V rows strided).
template <int RT, int CT>
inline void fa_values(const float* p, const float* v, int64_t vstride, int64_t nb, int64_t r0, int64_t c0,
                      float* o, int64_t d) {
  V16 acc[RT][CT];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c) acc[r][c] = vload(o + (r0 + r) * d + (c0 + c) * 16);
  for (int64_t j = 0; j < nb; ++j) {
    V16 vv[CT];
    for (int c = 0; c < CT; ++c) vv[c] = vload(v + j * vstride + (c0 + c) * 16);
    for (int r = 0; r < RT; ++r) {
      const V16 pv = vbroadcast(p + (r0 + r) * kFaKeys + j);
      for (int c = 0; c < CT; ++c) acc[r][c] = vfmadd(pv, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c) vstore(o + (r0 + r) * d + (c0 + c) * 16, acc[r][c]);
}

// V's key pairs per head: ldk (>= m + 64) / 2 plus the pad an odd count of sinks leaves
inline int64_t bf16_value_pairs(int64_t ldk) { return ldk / 2 + 1; }

#if CW_SIMD == 2 && defined(__AVX512BF16__)
#define CW_FA_BF16 1
// bf16 dot products (vdpbf16ps: a lane's two bf16 products added into fp32, twice the
// multiply-adds of an fp32 FMA per instruction). Operands are pairs in one 32-bit lane:
// Q [r][d/2] and K^T [d/2][ldk] pair two head dimensions, P [r][32] and V [ldk/2][d] two
// keys. Each product of two bf16 values is exact in fp32; what is rounded is the query
// (times the scale) and the softmax weights P, to bf16 (round to nearest even).
inline uint32_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
inline uint32_t bf16_bits(at::BFloat16 x) { return x.x; }
inline uint32_t bf16_pair(uint32_t lo, uint32_t hi) { return lo | (hi << 16); }
inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// S[r, 0..64) = Q[r] . K[0..64) for RT rows from r0 (Q: [rows][dp_n] pairs, Kt: [dp_n][ldk]).
template <int RT>
inline void fa_scores_bf16(const uint32_t* qb, const uint32_t* kt, int64_t ldk, int64_t dp_n, int64_t r0, float* s) {
  __m512 acc[RT][4];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < dp_n; ++dp) {
    __m512i kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = _mm512_loadu_si512(kt + dp * ldk + c * 16);
    for (int r = 0; r < RT; ++r) {
      const __m512i qv = _mm512_set1_epi32(static_cast<int>(qb[(r0 + r) * dp_n + dp]));
      for (int c = 0; c < 4; ++c) acc[r][c] = dpbf16(acc[r][c], qv, kv[c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + (r0 + r) * kFaKeys + c * 16, acc[r][c]);
}

// O[r, c0*16 .. (c0+CT)*16) += P[r, keys 0..2np) V[keys 0..2np) (P: [rows][32] pairs,
// V: [np][d] pairs from this block's first key).
template <int RT, int CT>
inline void fa_values_bf16(const uint32_t* p, const uint32_t* v, int64_t np, int64_t r0, int64_t c0, float* o,
                           int64_t d) {
  __m512 acc[RT][CT];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c) acc[r][c] = _mm512_loadu_ps(o + (r0 + r) * d + (c0 + c) * 16);
  for (int64_t jp = 0; jp < np; ++jp) {
    __m512i vv[CT];
    for (int c = 0; c < CT; ++c) vv[c] = _mm512_loadu_si512(v + jp * d + (c0 + c) * 16);
    for (int r = 0; r < RT; ++r) {
      const __m512i pv = _mm512_set1_epi32(static_cast<int>(p[(r0 + r) * (kFaKeys / 2) + jp]));
      for (int c = 0; c < CT; ++c) acc[r][c] = dpbf16(acc[r][c], pv, vv[c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c) _mm512_storeu_ps(o + (r0 + r) * d + (c0 + c) * 16, acc[r][c]);
}
#else
#define CW_FA_BF16 0
#endif

#if CW_FA_BF16 && CW_AMX && defined(__AMX_BF16__)
#define CW_FA_AMX 1
// bf16 dots on AMX: TDPBF16PS, 16 times vdpbf16ps' multiply-adds an instruction. The bf16
// attention's layouts are already what the tiles load: Q and P rows of pairs (A), K^T and
// V as rows of pairs (B). Every tile here is 16 rows of 64 bytes.
inline const AmxConfig& amx_config() {
  static const AmxConfig cfg = [] {
    AmxConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  return cfg;
}
// Q K^T of 16 query rows from r0 against one block's 64 keys: S [16][64] fp32.
// Tiles: 0-3 the four 16-key columns of S, 4 the queries, 5-7 the keys (loads overlap).
inline void amx_scores(const uint32_t* qb, const uint32_t* kt, int64_t ldk, int64_t dp_n, int64_t r0, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t dp = 0; dp < dp_n; dp += 16) {
    _tile_loadd(4, qb + r0 * dp_n + dp, dp_n * 4);
    const uint32_t* kb = kt + dp * ldk;
    _tile_loadd(5, kb, ldk * 4);
    _tile_loadd(6, kb + 16, ldk * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(7, kb + 32, ldk * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, kb + 48, ldk * 4);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  float* sr = s + r0 * kFaKeys;
  _tile_stored(0, sr, kFaKeys * 4);
  _tile_stored(1, sr + 16, kFaKeys * 4);
  _tile_stored(2, sr + 32, kFaKeys * 4);
  _tile_stored(3, sr + 48, kFaKeys * 4);
}
// O[16 rows from r0][c0*16 .. (c0+CT)*16) += P V over the block's 32 key pairs (P zero past
// the visible keys). Tiles 0..CT-1 the output columns, 4 P, 5-7 V.
template <int CT>
inline void amx_values(const uint32_t* p, const uint32_t* v, int64_t r0, int64_t c0, float* o, int64_t d) {
  float* ob = o + r0 * d + c0 * 16;
  const uint32_t* vb = v + c0 * 16;
  _tile_loadd(0, ob, d * 4);
  if constexpr (CT > 1) _tile_loadd(1, ob + 16, d * 4);
  if constexpr (CT > 2) _tile_loadd(2, ob + 32, d * 4);
  if constexpr (CT > 3) _tile_loadd(3, ob + 48, d * 4);
  for (int64_t kp = 0; kp < kFaKeys / 2; kp += 16) {
    _tile_loadd(4, p + r0 * (kFaKeys / 2) + kp, kFaKeys / 2 * 4);
    const uint32_t* vk = vb + kp * d;
    _tile_loadd(5, vk, d * 4);
    if constexpr (CT > 1) _tile_loadd(6, vk + 16, d * 4);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (CT > 2) _tile_loadd(7, vk + 32, d * 4);
    if constexpr (CT > 1) _tile_dpbf16ps(1, 4, 6);
    if constexpr (CT > 3) _tile_loadd(5, vk + 48, d * 4);
    if constexpr (CT > 2) _tile_dpbf16ps(2, 4, 7);
    if constexpr (CT > 3) _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, ob, d * 4);
  if constexpr (CT > 1) _tile_stored(1, ob + 16, d * 4);
  if constexpr (CT > 2) _tile_stored(2, ob + 32, d * 4);
  if constexpr (CT > 3) _tile_stored(3, ob + 48, d * 4);
}
#else
#define CW_FA_AMX 0
#endif

struct FlashScratch {
  std::vector<float> qb, o, s, mx, sum;  // sum: 16 lanes a row
  std::vector<int64_t> lo, hi;
  std::vector<uint32_t> qb2, p2;  // bf16 pairs: queries, softmax weights
};

// Keys [jbase, jbase + count) of k / v (at positions kpos0..) against the task's rows of qb
// (queries [i0, i1) x the group's heads), folded into the running max, sum and output.
// windowed: the window applies (sink keys are visible to every later query).
// Bf16: kt / v are the bf16 pair layouts (K^T [d/2][ldk]; V [pairs][d], each segment's
// keys paired from its first) and the tiles are fa_scores_bf16 / fa_values_bf16; blocks
// then start at an even key of the segment.
template <bool Bf16>
void flash_segment(const FlashArgs& a, const void* kt_any, int64_t ldk, const void* v_any, int64_t h, int64_t i0,
                   int64_t i1, int64_t jbase, int64_t count, int64_t kpos0, bool windowed, FlashScratch& w) {
  const float* kt = static_cast<const float*>(kt_any);
  const float* v = static_cast<const float*>(v_any);
  const int64_t g = a.g, d = a.d, rows = (i1 - i0) * g, kstride = a.hkv * d;
  for (int64_t r = 0; r < rows; ++r) {  // visible key indices [lo, hi) of the segment
    const int64_t p = a.q0 + i0 + r / g;
    w.hi[r] = std::min(count, p - kpos0 + 1);
    w.lo[r] = windowed && a.window > 0 ? std::max<int64_t>(0, p - kpos0 - a.window + 1) : 0;
  }
  const int64_t j_hi = w.hi[rows - 1];  // the union over the task's rows
  const int64_t j_lo = Bf16 ? w.lo[0] & ~int64_t{1} : w.lo[0];  // bf16: whole key pairs
  for (int64_t j0 = j_lo; j0 < j_hi; j0 += kFaKeys) {
    const int64_t nb = std::min(kFaKeys, j_hi - j0);
    int64_t r0 = 0;
    if constexpr (Bf16) {
#if CW_FA_BF16
      const uint32_t* kb = static_cast<const uint32_t*>(kt_any) + jbase + j0;
#if CW_FA_AMX
      if (a.amx) {  // rows padded to whole tiles (the pad rows' queries are zero)
        for (r0 = 0; r0 < rows; r0 += 16) amx_scores(w.qb2.data(), kb, ldk, d / 2, r0, w.s.data());
        r0 = rows;
      }
#endif
      for (; r0 + kFaRows <= rows; r0 += kFaRows)
        fa_scores_bf16<kFaRows>(w.qb2.data(), kb, ldk, d / 2, r0, w.s.data());
      for (; r0 < rows; ++r0) fa_scores_bf16<1>(w.qb2.data(), kb, ldk, d / 2, r0, w.s.data());
#endif
    } else {
      const float* kb = kt + jbase + j0;  // columns past nb hold other keys or padding: masked
      for (int64_t c = 0; c < 4; c += kFaCols) {  // kFaCols V16 of keys per register tile
        for (r0 = 0; r0 + kFaRows <= rows; r0 += kFaRows)
          fa_scores<kFaRows, kFaCols>(w.qb.data(), kb + c * 16, ldk, d, r0, w.s.data() + c * 16);
        for (; r0 < rows; ++r0) fa_scores<1, kFaCols>(w.qb.data(), kb + c * 16, ldk, d, r0, w.s.data() + c * 16);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = w.s.data() + r * kFaKeys;
      const int64_t lo = std::max<int64_t>(0, w.lo[r] - j0), hi = std::min(nb, w.hi[r] - j0);
      const bool masked = lo > 0 || hi < kFaKeys;
      if (hi <= lo) {  // nothing visible to this row here
        std::fill(sr, sr + kFaKeys, 0.f);
        if constexpr (Bf16) std::fill(w.p2.data() + r * (kFaKeys / 2), w.p2.data() + (r + 1) * (kFaKeys / 2), 0u);
        continue;
      }
      if (masked) {
        for (int64_t jj = 0; jj < lo; ++jj) sr[jj] = -INFINITY;
        for (int64_t jj = hi; jj < kFaKeys; ++jj) sr[jj] = -INFINITY;
      }
      const V16 m4 = vmax(vmax(vload(sr), vload(sr + 16)), vmax(vload(sr + 32), vload(sr + 48)));
      // the reduction only where a score passes the running max (past the first blocks, rarely)
      const float top = vany_gt(m4, w.mx[r]) ? std::max(w.mx[r], vhmax(m4)) : w.mx[r];
      const float alpha = top == w.mx[r] ? 1.f : std::exp(w.mx[r] - top);  // 0 on the first block
      w.mx[r] = top;
      const V16 t16 = vset1(top);
#if CW_FA_BF16
      if constexpr (Bf16) {
        for (int c = 0; c < 4; ++c) vstore(sr + c * 16, vexp_nonpositive_coarse(vsub(vload(sr + c * 16), t16)));
      } else
#endif
      {
        for (int c = 0; c < 4; ++c) vstore(sr + c * 16, vexp_nonpositive(vsub(vload(sr + c * 16), t16)));
      }
      if (masked) {  // e^-inf is not exactly 0 in vexp_nonpositive's clamped range
        for (int64_t jj = 0; jj < lo; ++jj) sr[jj] = 0.f;
        for (int64_t jj = hi; jj < kFaKeys; ++jj) sr[jj] = 0.f;
      }
      // the row's sum kept in 16 lanes (reduced once, at the end)
      const V16 acc = vadd(vadd(vload(sr), vload(sr + 16)), vadd(vload(sr + 32), vload(sr + 48)));
      float* sum16 = w.sum.data() + r * 16;
      vstore(sum16, alpha == 1.f ? vadd(vload(sum16), acc) : vfmadd(vload(sum16), vset1(alpha), acc));
#if CW_FA_BF16
      if constexpr (Bf16) {  // the weights as bf16 pairs of consecutive keys
        __m512i* pr = reinterpret_cast<__m512i*>(w.p2.data() + r * (kFaKeys / 2));
        for (int c = 0; c < 2; ++c)
          _mm512_storeu_si512(pr + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + c * 32 + 16),
                                                                   _mm512_loadu_ps(sr + c * 32)));
      }
#endif
      if (alpha != 1.f) {
        float* orow = w.o.data() + r * d;
        const V16 a16 = vset1(alpha);
        for (int64_t c = 0; c < d; c += 16) vstore(orow + c, vmul(vload(orow + c), a16));
      }
    }
    if constexpr (Bf16) {
#if CW_FA_BF16
      // the segment's key pairs start at pair (jbase + 1) / 2: the sinks' pairs come first
      const uint32_t* vb = static_cast<const uint32_t*>(v_any) + ((jbase + 1) / 2 + j0 / 2) * d;
      const int64_t np = (nb + 1) / 2;
#if CW_FA_AMX
      if (a.amx) {  // all 32 pairs of the block: P is zero past the visible keys
        for (r0 = 0; r0 < rows; r0 += 16) {
          int64_t c0 = 0;
          for (; c0 + 4 <= d / 16; c0 += 4) amx_values<4>(w.p2.data(), vb, r0, c0, w.o.data(), d);
          if (d / 16 - c0 == 2) amx_values<2>(w.p2.data(), vb, r0, c0, w.o.data(), d);
        }
        continue;
      }
#endif
      for (int64_t c0 = 0; c0 < d / 16; c0 += 4) {
        const int ct = static_cast<int>(std::min<int64_t>(4, d / 16 - c0));
        r0 = 0;
        if (ct == 4) {
          for (; r0 + kFaRows <= rows; r0 += kFaRows)
            fa_values_bf16<kFaRows, 4>(w.p2.data(), vb, np, r0, c0, w.o.data(), d);
          for (; r0 < rows; ++r0) fa_values_bf16<1, 4>(w.p2.data(), vb, np, r0, c0, w.o.data(), d);
        } else {
          for (; r0 < rows; ++r0)
            for (int c = 0; c < ct; ++c) fa_values_bf16<1, 1>(w.p2.data(), vb, np, r0, c0 + c, w.o.data(), d);
        }
      }
#endif
    } else {
      const float* vb = v + (jbase + j0) * kstride + h * d;
      for (int64_t c0 = 0; c0 < d / 16; c0 += kFaCols) {
        const int ct = static_cast<int>(std::min<int64_t>(kFaCols, d / 16 - c0));
        r0 = 0;
        if (ct == kFaCols) {
          for (; r0 + kFaRows <= rows; r0 += kFaRows)
            fa_values<kFaRows, kFaCols>(w.s.data(), vb, kstride, nb, r0, c0, w.o.data(), d);
          for (; r0 < rows; ++r0) fa_values<1, kFaCols>(w.s.data(), vb, kstride, nb, r0, c0, w.o.data(), d);
        } else {
          for (; r0 < rows; ++r0)
            for (int c = 0; c < ct; ++c) fa_values<1, 1>(w.s.data(), vb, kstride, nb, r0, c0 + c, w.o.data(), d);
        }
      }
    }
  }
}

// The task's rows of a query tensor [n, Hq, D] into w.qb (bf16: w.qb2, pairs), pre-scaled.
template <bool Bf16>
void flash_load_queries(const FlashArgs& a, const float* q, int64_t h, int64_t i0, int64_t i1, FlashScratch& w) {
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t gi = 0; gi < a.g; ++gi) {
      const float* src = q + (i * a.hq + h * a.g + gi) * a.d;
      const int64_t r = (i - i0) * a.g + gi;
      if constexpr (Bf16) {
#if CW_FA_BF16
        uint32_t* dst = w.qb2.data() + r * (a.d / 2);
        for (int64_t dp = 0; dp < a.d / 2; ++dp)
          dst[dp] = bf16_pair(bf16_bits(src[2 * dp] * a.scale), bf16_bits(src[2 * dp + 1] * a.scale));
#endif
      } else {
        float* dst = w.qb.data() + r * a.d;
        for (int64_t dd = 0; dd < a.d; ++dd) dst[dd] = src[dd] * a.scale;
      }
    }
}

// One task: KV head h, queries [i0, i1). The first num_sink keys (positions 0..) are scored
// against q_sink, the rest (positions k0..) against q. Bf16: kt / v are the pair layouts
// of every head (pack_bf16_kv).
template <bool Bf16>
void flash_task(const FlashArgs& a, const float* q, const float* q_sink, int64_t num_sink, const void* kt,
                int64_t ldk, const void* v, float* out, int64_t h, int64_t i0, int64_t i1, FlashScratch& w) {
  const int64_t g = a.g, d = a.d, rows = (i1 - i0) * g;
  const int64_t tile_rows = Bf16 && a.amx ? (rows + 15) / 16 * 16 : rows;  // AMX: whole 16-row tiles
  if constexpr (Bf16) {
    kt = static_cast<const uint32_t*>(kt) + h * (d / 2) * ldk;
    v = static_cast<const uint32_t*>(v) + h * bf16_value_pairs(ldk) * d;
    w.qb2.assign(tile_rows * (d / 2), 0u);
    w.p2.assign(tile_rows * (kFaKeys / 2), 0u);
  } else {
    kt = static_cast<const float*>(kt) + h * d * ldk;
    w.qb.resize(rows * d);
  }
  w.o.assign(tile_rows * d, 0.f);
  w.s.resize(tile_rows * kFaKeys);
  w.mx.assign(rows, -INFINITY);
  w.sum.assign(rows * 16, 0.f);
  w.lo.resize(rows);
  w.hi.resize(rows);
  if (num_sink > 0) {
    flash_load_queries<Bf16>(a, q_sink, h, i0, i1, w);
    flash_segment<Bf16>(a, kt, ldk, v, h, i0, i1, 0, num_sink, 0, false, w);
  }
  flash_load_queries<Bf16>(a, q, h, i0, i1, w);
  flash_segment<Bf16>(a, kt, ldk, v, h, i0, i1, Bf16 ? a.key_column : num_sink, a.m - num_sink, a.k0, true, w);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t r = (i - i0) * g + gi;
      const float sum = vsum(vload(w.sum.data() + r * 16));
      const float inv = sum > 0 ? 1.f / sum : 0.f;
      float* dst = out + (i * a.hq + h * g + gi) * d;
      for (int64_t dd = 0; dd < d; ++dd) dst[dd] = w.o[r * d + dd] * inv;
    }
}

#if CW_FA_BF16
// K [m, Hkv, D] -> [Hkv][D/2][ldk] and V -> [Hkv][bf16_value_pairs(ldk)][D], bf16 pairs:
// the sinks [0, num_sink) from column 0 and the other keys from column sink_gap(num_sink)
// (zero between and past them). V pairs the sinks from key 0 and the other keys from pair
// sink_gap / 2 (an odd num_sink leaves a zero key in the sinks' last pair).
template <typename T>
void pack_bf16_kv(const T* kp, const T* vp, int64_t m, int64_t num_sink, int64_t hkv, int64_t d, int64_t ldk,
                  uint32_t* kt, uint32_t* vt) {
  const int64_t pairs = bf16_value_pairs(ldk), krows = hkv * (d / 2), vrows = hkv * pairs;
  const int64_t sink_pairs = (num_sink + 1) / 2, gap = sink_gap(num_sink);
#pragma omp for schedule(static) nowait
  for (int64_t hp = 0; hp < krows; ++hp) {
    const int64_t h = hp / (d / 2), dd = 2 * (hp % (d / 2));
    uint32_t* row = kt + hp * ldk;
    std::fill(row, row + ldk, 0u);
    for (int64_t j = 0; j < m; ++j) {
      const T* src = kp + (j * hkv + h) * d + dd;
      row[j < num_sink ? j : j - num_sink + gap] = bf16_pair(bf16_bits(src[0]), bf16_bits(src[1]));
    }
  }
#pragma omp for schedule(static)
  for (int64_t hj = 0; hj < vrows; ++hj) {
    const int64_t h = hj / pairs, jp = hj % pairs;
    const bool sink = jp < sink_pairs;
    // pairs between the sinks' and gap / 2 hold no key (j = end: zeros)
    const int64_t j = sink ? 2 * jp : jp < gap / 2 ? m : num_sink + 2 * (jp - gap / 2), end = sink ? num_sink : m;
    uint32_t* row = vt + hj * d;
    const T* v0 = vp + (j * hkv + h) * d;
    const T* v1 = v0 + hkv * d;
    for (int64_t dd = 0; dd < d; ++dd)
      row[dd] = bf16_pair(j < end ? bf16_bits(v0[dd]) : 0u, j + 1 < end ? bf16_bits(v1[dd]) : 0u);
  }
}
#endif
#endif  // CW_SIMD

}  // namespace

#if !defined(CW_FA_BF16)
#define CW_FA_BF16 0
#endif
#if !defined(CW_FA_AMX)
#define CW_FA_AMX 0
#endif
bool has_bf16_attention() { return CW_FA_BF16 != 0; }

bool set_amx(bool on) { return g_amx_enabled.exchange(on); }
bool has_amx_attention() { return CW_FA_AMX && use_amx(); }

// Attention of n queries [n, Hq, D] at positions q0.. over m keys / values [m, Hkv, D]
// (contiguous), causal, with an optional window (0: none): the first num_sink keys are the
// sinks at positions 0.. (StreamingLLM: visible to every later query, scored against
// q_sink [n, Hq, D]), the others at positions k0... A query that sees no key gets zeros.
// fp32 q, k and v by default; bf16_dots (AVX-512 BF16 builds): k and v fp32 or
// bf16, Q K^T and P V as bf16 dot products with fp32 sums. -> [n, Hq, D] fp32.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q0, int64_t k0,
                             int64_t window, double scale, const c10::optional<at::Tensor>& q_sink,
                             int64_t num_sink, bool bf16_dots) {
  TORCH_CHECK(q.dtype() == at::kFloat, "prefill_attention takes fp32 q");
  TORCH_CHECK(k.dtype() == v.dtype() && (k.dtype() == at::kFloat || (bf16_dots && k.dtype() == at::kBFloat16)),
              "prefill_attention takes fp32 k and v (bf16 too with bf16_dots), got ", k.dtype(), " and ", v.dtype());
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.is_contiguous() && k.is_contiguous() &&
                  v.is_contiguous(),
              "q must be contiguous [n, Hq, D], k and v contiguous [m, Hkv, D]");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), m = k.size(0), hkv = k.size(1);
  TORCH_CHECK(k.size(2) == d && hq % hkv == 0, "head dims must match and Hq be a multiple of Hkv");
  TORCH_CHECK(d % 16 == 0 && d <= 512, "head_dim must be a multiple of 16 up to 512, got ", d);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(num_sink >= 0 && num_sink <= m, "num_sink must be in [0, ", m, "], got ", num_sink);
  TORCH_CHECK(num_sink == 0 || (q_sink.has_value() && q_sink->dtype() == at::kFloat && q_sink->is_contiguous() &&
                                q_sink->sizes() == q.sizes()),
              "sink keys need q_sink: a contiguous fp32 tensor shaped like q");
  TORCH_CHECK(!bf16_dots || CW_FA_BF16,
              "bf16_dots needs the AVX-512 BF16 build of the kernels (has_bf16_attention() is False)");
#if CW_SIMD
  at::Tensor out = at::empty_like(q);
  if (n == 0) return out;
  FlashArgs a{n, m, hq, hkv, d, hq / hkv, q0, k0, window, static_cast<float>(scale)};
#if CW_FA_AMX
  a.amx = bf16_dots && d % 32 == 0 && use_amx();
#endif
  // ~CW_FA_TASK_ROWS query rows (queries x the group's heads) per task; most keys first
  const int64_t per_task = std::max<int64_t>(1, CW_FA_TASK_ROWS / a.g), blocks = (n + per_task - 1) / per_task;
  const int64_t tasks = blocks * hkv;
  const float* qp = q.data_ptr<float>();
  const float* qsp = num_sink > 0 ? q_sink->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // K transposed once per call, [Hkv][D][ldk] (a key block's D x 64 scores tile reads
  // rows of it), zero past m: transposing per task cost each key up to n / 32 copies.
  const int64_t ldk = (m + kFaKeys - 1) / kFaKeys * kFaKeys + kFaKeys;
  const int nt = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), tasks));
  if (bf16_dots) {
#if CW_FA_BF16
    a.key_column = sink_gap(num_sink);
    const int64_t columns = m - num_sink + a.key_column;  // the packed layout's, gap included
    const int64_t ldk = (columns + kFaKeys - 1) / kFaKeys * kFaKeys + kFaKeys;
    std::vector<uint32_t> kt(static_cast<size_t>(hkv * (d / 2) * ldk));
    std::vector<uint32_t> vt(static_cast<size_t>(hkv * bf16_value_pairs(ldk) * d));
#pragma omp parallel num_threads(nt)
    {
      if (k.dtype() == at::kFloat)
        pack_bf16_kv(k.data_ptr<float>(), v.data_ptr<float>(), m, num_sink, hkv, d, ldk, kt.data(), vt.data());
      else
        pack_bf16_kv(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), m, num_sink, hkv, d, ldk, kt.data(),
                     vt.data());
      FlashScratch w;
#if CW_FA_AMX
      if (a.amx) _tile_loadconfig(&amx_config());
#endif
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < tasks; ++t) {
        const int64_t b = blocks - 1 - t / hkv, h = t % hkv;
        flash_task<true>(a, qp, qsp, num_sink, kt.data(), ldk, vt.data(), op, h, b * per_task,
                         std::min(n, (b + 1) * per_task), w);
      }
#if CW_FA_AMX
      if (a.amx) _tile_release();
#endif
    }
#endif
    return out;
  }
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  std::vector<float> kt(static_cast<size_t>(hkv * d * ldk));
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int64_t hd = 0; hd < hkv * d; ++hd) {
      const int64_t h = hd / d, dd = hd % d;
      float* row = kt.data() + hd * ldk;
      for (int64_t j = 0; j < m; ++j) row[j] = kp[(j * hkv + h) * d + dd];
      std::fill(row + m, row + ldk, 0.f);
    }
    FlashScratch w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t b = blocks - 1 - t / hkv, h = t % hkv;
      flash_task<false>(a, qp, qsp, num_sink, kt.data(), ldk, vp, op, h, b * per_task, std::min(n, (b + 1) * per_task),
                        w);
    }
  }
  return out;
#else
  TORCH_CHECK(false, "prefill_attention needs the AVX2 or AVX-512 build of the kernels");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs with the GIL released (arguments are converted before, the result
  // after): a prefill chunk's attention can take a second, and a server's event loop
  // (/metrics, new requests) must keep running beside it, as it does beside torch's ops.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("simd_level", &simd_level, "vector instruction set of this build");
  m.def("set_dense_one_stream", [](bool on) { return g_dense_one_stream.exchange(on); },
        "dense_linear at one row reads the weight one row at a time (True) or N1 rows at once; returns the old");
  m.def("set_qdense_min_rows", &set_qdense_min_rows, "rows from which q4/q8 dequantize weight rows once; returns the old");
  m.def("q4_linear", &q4_linear, nogil, "x @ dequant(q4)^T with fp32 activations");
  m.def("q8_linear", &q8_linear, nogil, "x @ dequant(q8)^T with fp32 activations");
  m.def("set_i8_gemm_min_rows", [](int64_t rows) { return g_gemm_min_rows.exchange(std::max<int64_t>(1, rows)); },
        "rows from which quantized_linear_int8 runs q4 weights as a GEMM (same numbers); returns the old value");
  m.def("quantized_linear_int8", &quantized_linear_int8, nogil, "x @ dequant(q4 | q8)^T, x quantized to int8 per group",
        py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("zero") = py::none(),
        py::arg("panels") = py::none());
  m.def("has_panels", &has_panels, "whether this build multiplies q4 / q8 weights with int8 activations from panels (q4_panels, q8_panels)");
  m.def("q4_panels", &q4_panels, nogil, "a q4 weight packed for quantized_linear_int8's panel tile (same bytes)");
  m.def("q8_panels", &q8_panels, nogil, "a q8 weight packed for quantized_linear_int8's panel tile");
  m.def("dense_linear", &dense_linear, nogil, "x @ w^T for a plain fp32 weight at a few rows");
  m.def("decode_layer", &decode_layer, nogil, "one llama decode layer: norm, qkv, rope + KV write, attention, o, norm, MLP");
  // module_local: two builds of these kernels can then load in one process (an in-process
  // A/B of an old build against a new one; otherwise pybind11 refuses the second type)
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local(), "a model's llama decode layers, a whole step's in one call")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<int64_t>&,
                    const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, int64_t, int64_t, int64_t,
                    int64_t, int64_t, double, double>(),
           py::arg("norms"), py::arg("weights"), py::arg("modes"), py::arg("k_pools"), py::arg("v_pools"),
           py::arg("hidden"), py::arg("intermediate"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("offset"))
      .def("run", &DecodeStack::run, nogil, "every layer of a decode step on x (in place)")
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
  m.def("q4_dequantize", &q4_dequantize, nogil, "q4 weight -> dense fp32 or bf16 [N, K]");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm of fp32 rows");
  m.def("add_rms_norm", &add_rms_norm, nogil, "x += delta; RMSNorm(x)");
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up");
  m.def("logits_max_lse", &logits_max_lse, nogil,
        "per fp32 logits row: [first argmax, max, logsumexp] as float64 [M, 3] (NaN where not finite)");
  m.def("rope_write_kv", &rope_write_kv, nogil, "rotate q/k, write k/v to the pool, return q");
  m.def("paged_decode_attention", &paged_decode_attention, nogil, "decode attention over KV pages in place");
  m.def("has_amx_attention", &has_amx_attention,
        "whether prefill_attention's bf16_dots run on AMX tiles (AMX-BF16 build, granted by the kernel, not switched off)");
  m.def("set_amx", &set_amx, "switch the AMX tiles on or off (off: the AVX-512 paths); returns the old setting");
  m.def("prefill_attention", &prefill_attention, nogil, "causal (windowed, sink) flash attention of a chunk's queries, fp32",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q0"), py::arg("k0"), py::arg("window"), py::arg("scale"),
        py::arg("q_sink") = py::none(), py::arg("num_sink") = 0, py::arg("bf16_dots") = false);
  m.def("has_bf16_attention", &has_bf16_attention,
        "whether prefill_attention can take bf16_dots (bf16 Q K^T and P V with fp32 sums: AVX-512 BF16)");
}
