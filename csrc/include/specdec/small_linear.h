// Few-row linear products on the CPU: y[m, n] = dot(x[m, :], w[n, :]) (+ bias[n]), fp32 or bf16.
//
// A decoding step multiplies every weight matrix by a handful of rows (one per tree node),
// so the job is to read each weight once, at the memory's speed, and use it for all rows
// while it is in registers. With AVX2, 1-7 input rows stream the weight rows one after another,
// each weight vector multiplied into every input row (`small_linear_row_stream_avx2`); 9-10
// rows take blocks of 4 weight rows against 3 input rows per pass, further input rows rereading
// the 4 weight rows from L1. Callers split the output features (n) over threads: each weight
// byte is read from memory by one thread, once.
//
// Header-only, no torch dependency. `small_linear_rows` picks the AVX-512F kernel (4 weight
// rows x 4 input rows, 16 lanes; below) when the CPU has it, else the AVX2+FMA kernel, else a
// portable loop (checked once at run time; the file is built without -mavx2/-mavx512f). On
// AVX2 without AVX-512, products of 8 and 11+ rows take a packed-panel kernel instead
// (`small_linear_packs_rows`, below: inputs packed 8 rows to a vector, weights broadcast).
// The dot-product kernels sum in a fixed order per (m, n): 8 lane partial sums over k, then
// the lanes added pairwise, then the k % 8 tail, so results are deterministic and agree with
// any other summation order to fp32 rounding.
//
// bf16 (`small_linear_rows_bf16`): x, w, bias and y all bf16, sums in fp32 and rounded once
// to bf16 (nearest even), as torch's bf16 linear does. Half the weight bytes of fp32, so on a
// bandwidth-bound step it can run at up to twice the speed. With AVX512-BF16 (checked at run
// time) VDPBF16PS multiplies 32 bf16 pairs and adds them into 16 fp32 lanes per instruction,
// reading the weights as they are stored; it treats subnormal bf16 inputs as 0 and flushes
// subnormal sums, like oneDNN's bf16 kernels. Up to 4 input rows share each pass over 4
// weight rows (16 accumulators of the 32 vector registers), so 1-4 rows cost one weight read
// from memory and more rows reread the 4 weight rows from L1. Without AVX512-BF16 a portable
// loop converts each element (correct, slow: the caller's timing then keeps F.linear).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "specdec/dtypes.h"  // BFloat16Bits, to_float, from_float

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECDEC_SMALL_LINEAR_X86 1
#endif

namespace specdec {

// The widest kernel family allowed: 2 AVX-512, 1 AVX2, 0 the portable loop. The environment
// variable SPECDEC_SMALL_LINEAR_ISA ("avx512", "avx2" or "portable", read once) lowers it, so
// the tests can check every path on a CPU that would otherwise take the widest.
inline int small_linear_isa_cap() {
  static const int cap = [] {
    const char* isa = std::getenv("SPECDEC_SMALL_LINEAR_ISA");
    if (isa == nullptr || std::strcmp(isa, "avx512") == 0) return 2;
    if (std::strcmp(isa, "avx2") == 0) return 1;
    return 0;  // "portable" (or anything else: the safe choice)
  }();
  return cap;
}

// Whether the AVX-512 kernels take a product of `rows` input rows as the stream: 1-2 rows one
// weight row at a time (against every input row in one block: `rows` independent
// accumulators), with no software prefetch: a single stream through the weights, the access
// the hardware prefetchers follow best; 3-8 rows in blocks of 3 weight rows against every
// input row, each weight row prefetched into L2 kSmallLinearL2PrefetchBytes ahead (measured
// there). fp32 and bf16 (AVX512-BF16) stream 1-8 rows (1-4 before the twenty-fourth session).
// Measured on an AMD EPYC (Zen 4, 2 threads, the default model's layer products from memory,
// C++ harness, best of 5 in two rounds), ms, stream against the 4-row blocks: fp32 1 row 14.9-18.7 / 19.3-21.6, 2 rows
// 16.1-17.4 / 18.7-23.0, 6-8 rows worse (31-41 / 24-27); bf16 1 row 8.5-9.5 / 11.6-15.3, 2
// rows 8.1-9.6 / 13.6-14.7, 3 rows 8.2-9.6 / 12.9-13.4, 4 rows 9.5-10.8 / 14.3-14.4, 6-8 rows
// worse. The stream first fed the rows in pairs (the second pair rereading the weight row
// from L1); one block for all of them (twenty-third session, medians of 15, interleaved, three
// runs) took fp32 2 rows 12.5-13.1 ms against the pairs' 16.6-18.6, 3 rows 15.2-16.2 against
// the blocks' 18.2, 4 rows 17.2-18.8 against 19.7, 5 rows 20.8-21.9 against 18.6-19.7 (so fp32
// streams up to 4); bf16 3 rows 6.7-7.4 against 7.2-8.3, 4 rows 8.0-9.9 against 8.0-9.1. The
// blocks and their prefetch were tuned on an Intel Xeon, where the stream has not been
// measured, so only AMD CPUs take it; SPECDEC_SMALL_LINEAR_STREAM=1 / 0 (read once) forces it
// on / off. Either way each output is summed in the same order, so the products agree bit for
// bit.
constexpr int64_t kSmallLinearStreamRows = 8;
inline bool small_linear_streams_avx512(int64_t rows) {
  static const bool on = [] {
    const char* env = std::getenv("SPECDEC_SMALL_LINEAR_STREAM");
    if (env != nullptr && env[0] != '\0') return std::strcmp(env, "0") != 0;
#if defined(__x86_64__) || defined(_M_X64)
    return __builtin_cpu_is("amd") != 0;
#else
    return false;
#endif
  }();
  return on && rows >= 1 && rows <= kSmallLinearStreamRows;
}

// The portable loop: output features [n_begin, n_end) of every row.
inline void small_linear_rows_portable(const float* x, int64_t rows, int64_t k_dim, const float* w,
                                       const float* bias, float* y, int64_t n_dim, int64_t n_begin,
                                       int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* wn = w + n * k_dim;
    for (int64_t m = 0; m < rows; ++m) {
      const float* xm = x + m * k_dim;
      float acc = 0.f;
      for (int64_t k = 0; k < k_dim; ++k) acc += xm[k] * wn[k];
      y[m * n_dim + n] = acc + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

#ifdef SPECDEC_SMALL_LINEAR_X86
// How far ahead in the weights the AVX-512 and AVX2 kernels prefetch (bytes; the same k of a weight row
// 2-8 rows further on, since the rows lie one after another). The hardware prefetchers alone
// kept a 1-8 row product of the default model's 211 weights (538 MB, not cache resident) at
// 6-9 GB/s from 4 rows on, on one core of a Xeon whose memory gives ~14 GB/s; with 18 KB
// ahead, 4 rows ran 1.4x and 8 rows 1.6x faster (9 KB ahead: less; 36 KB: less again).
constexpr int64_t kSmallLinearPrefetchBytes = 18432;
// The stream's distance for 3-8 input rows (small_linear_streams_avx512), into L2 (_MM_HINT_T1)
// for every weight row of its 3-row blocks. Without it the hardware prefetchers fell behind
// once a weight row's compute grew (each weight row is read once, then computed on): the time
// was memory plus compute, not the larger. AMD EPYC (Zen 4), 2 threads, the default model's
// layer products from memory, C++ harness, medians of 15 (twenty-fourth session): fp32 4 / 6 /
// 8 rows 20.0 / 21.2 / 22.3 ms (stream to 4 rows, then 4-row blocks) -> 13.9 / 14.1 / 15.0
// (1 row: 13.2-13.4); bf16 4 / 6 / 8 rows 10.0-11.4 / 11.0-11.7 / 11.4-12.1 -> 6.4-7.2 /
// 7.2-8.0 / 8.1 (1 row: 6.2-6.9). 4 and 16 KB ahead measured about the same; into L1
// (_MM_HINT_T0) at 16 KB no better than none.
constexpr int64_t kSmallLinearL2PrefetchBytes = 8192;
// The AVX2 kernel's distance: half of it. Its L1 (32 KB on the AMD EPYC measured) holds the
// current block, the input rows and what is prefetched, and 18 KB ahead evicted the block
// before its later passes read it: 3 rows of the default model's weights from L3 ran 4.8 ms
// with 9 KB against 6.1 with 18 KB, and 8 rows from memory 21.8 against 22.8.
constexpr int64_t kSmallLinearPrefetchBytesAvx2 = 9216;
// The one-stream kernel's distance (small_linear_row_stream_avx2): its
// single stream is what the hardware prefetchers follow best; 1 KB ahead measured best in a C++
// harness on the AMD EPYC (28.7 GB/s at one row against 26.8-27.0 with none or 2 KB).
constexpr int64_t kSmallLinearStreamPrefetchBytes = 1024;

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Four sums of 8 lanes each, in hsum8's order ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), so a
// block's outputs equal hsum8's bit for bit: the halves added, a 4x4 transpose, two adds.
__attribute__((target("avx2,fma"))) inline __m128 hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m128 u0 = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
  __m128 u1 = _mm_add_ps(_mm256_castps256_ps128(a1), _mm256_extractf128_ps(a1, 1));
  __m128 u2 = _mm_add_ps(_mm256_castps256_ps128(a2), _mm256_extractf128_ps(a2, 1));
  __m128 u3 = _mm_add_ps(_mm256_castps256_ps128(a3), _mm256_extractf128_ps(a3, 1));
  _MM_TRANSPOSE4_PS(u0, u1, u2, u3);  // u_c: lane c of each of the four
  return _mm_add_ps(_mm_add_ps(u0, u2), _mm_add_ps(u1, u3));
}

// XR input rows (1-3) against WR weight rows, one weight vector loaded at a time: XR * WR
// accumulators (at most 12 of the 16 registers, with the XR inputs and the weight vector).
// A prefetch per weight row and cache line kSmallLinearPrefetchBytesAvx2 ahead (the next blocks'
// rows) in every pass: with it only in a block's first group of input rows, the later groups
// (which find the block in L1) left the memory idle, and 5-8 rows of the default model's
// weights ran ~11% slower on 2 AVX2 cores (20.6 -> 18.3 ms at 5 rows, 24.0 -> 21.4 at 8).
// (A prefetch past the end of the weights is harmless: prefetches never fault.)
// Each output's sum in one fixed order, whatever the block: 8 lane partial sums over k, the
// lanes as hsum8 adds them, then the last k_dim % 8 terms, then the bias.
template <int WR, int XR>
__attribute__((target("avx2,fma"))) inline void small_linear_rows_block_avx2(const float* x, int64_t k_dim,
                                                                             const float* w, int64_t n,
                                                                             const float* bias, float* y,
                                                                             int64_t n_dim) {
  __m256 acc[XR][WR];
  const float* wr[WR];
  for (int j = 0; j < WR; ++j) wr[j] = w + (n + j) * k_dim;
  for (int i = 0; i < XR; ++i)
    for (int j = 0; j < WR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = k_dim & ~int64_t(7);
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 xv[XR];
    for (int i = 0; i < XR; ++i) xv[i] = _mm256_loadu_ps(x + i * k_dim + k);
    for (int j = 0; j < WR; ++j) {
      if ((k & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + kSmallLinearPrefetchBytesAvx2, _MM_HINT_T0);
      const __m256 wv = _mm256_loadu_ps(wr[j] + k);
      for (int i = 0; i < XR; ++i) acc[i][j] = _mm256_fmadd_ps(wv, xv[i], acc[i][j]);
    }
  }
  for (int i = 0; i < XR; ++i) {
    float* yi = y + i * n_dim + n;
    if constexpr (WR % 4 == 0) {
      for (int j = 0; j < WR; j += 4) _mm_storeu_ps(yi + j, hsum8x4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]));
    } else {
      for (int j = 0; j < WR; ++j) yi[j] = hsum8(acc[i][j]);
    }
    const float* xi = x + i * k_dim;
    for (int j = 0; j < WR; ++j) {
      float sum = yi[j];
      for (int64_t kk = k8; kk < k_dim; ++kk) sum += xi[kk] * wr[j][kk];
      yi[j] = sum + (bias != nullptr ? bias[n + j] : 0.f);
    }
  }
}

// Weight rows [n, n + WR) against every input row, in groups of 3: the first group's pass
// reads the WR weight rows from memory, the later ones find them in L1 (and every pass
// prefetches the next blocks').
template <int WR>
__attribute__((target("avx2,fma"))) inline void small_linear_pass_avx2(const float* x, int64_t rows, int64_t k_dim,
                                                                       const float* w, int64_t n, const float* bias,
                                                                       float* y, int64_t n_dim) {
  int64_t m = 0;
  for (; m + 3 <= rows; m += 3) {
    small_linear_rows_block_avx2<WR, 3>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim);
  }
  if (rows - m == 2) small_linear_rows_block_avx2<WR, 2>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim);
  if (rows - m == 1) small_linear_rows_block_avx2<WR, 1>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim);
}

// 1-7 input rows against weight row n alone, the weight rows of a call read one after another:
// one stream through memory, with a prefetch per cache line kSmallLinearStreamPrefetchBytes
// ahead. XR accumulators (with the weight vector at most 8 of the 16 registers); each input
// vector comes from L1. One 8-lane accumulator per input row over k, then hsum8, the k_dim % 8
// tail and the bias: each output equals small_linear_rows_block_avx2's bit for bit.
// Why not the 4- and 8-row blocks for so few input rows: reading 4-8 weight rows side by side
// (4-8 streams 2.3 KB apart for the default model) ran below what one stream gets from this
// AMD EPYC's memory. The default model's 211 products, in one process, interleaved (medians of
// 12): 1-7 rows 1.08 / 1.12 / 1.18 / 1.11 / 1.12 / 1.05 / 1.03x faster (rows 1: a second run
// 0.99x; batch-1 plain `generate`, 18 pairs: 1.11x); 8 and more rows keep the blocks and the
// panels (with 5-7 rows in two groups, each rereading the weight row from L1: 0.73-0.9x).
template <int XR>
__attribute__((target("avx2,fma"))) inline void small_linear_row_stream_avx2(const float* x, int64_t k_dim,
                                                                             const float* w, int64_t n,
                                                                             const float* bias, float* y,
                                                                             int64_t n_dim) {
  const int64_t k8 = k_dim & ~int64_t(7);
  const float* wr = w + n * k_dim;
  __m256 acc[XR];
  for (int i = 0; i < XR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k8; k += 8) {
    if ((k & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + k) + kSmallLinearStreamPrefetchBytes, _MM_HINT_T0);
    const __m256 wv = _mm256_loadu_ps(wr + k);
    for (int i = 0; i < XR; ++i) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * k_dim + k), acc[i]);
  }
  for (int i = 0; i < XR; ++i) {
    const float* xi = x + i * k_dim;
    float sum = hsum8(acc[i]);
    for (int64_t k = k8; k < k_dim; ++k) sum += xi[k] * wr[k];
    y[i * n_dim + n] = sum + (bias != nullptr ? bias[n] : 0.f);
  }
}

__attribute__((target("avx2,fma"))) inline void small_linear_rows_avx2(const float* x, int64_t rows, int64_t k_dim,
                                                                       const float* w, const float* bias, float* y,
                                                                       int64_t n_dim, int64_t n_begin,
                                                                       int64_t n_end) {
  if (rows <= 0) return;
  int64_t n = n_begin;
  if (rows <= 7) {  // one weight row at a time, against every input row
    for (; n < n_end; ++n) {
      switch (rows) {
        case 1: small_linear_row_stream_avx2<1>(x, k_dim, w, n, bias, y, n_dim); break;
        case 2: small_linear_row_stream_avx2<2>(x, k_dim, w, n, bias, y, n_dim); break;
        case 3: small_linear_row_stream_avx2<3>(x, k_dim, w, n, bias, y, n_dim); break;
        case 4: small_linear_row_stream_avx2<4>(x, k_dim, w, n, bias, y, n_dim); break;
        case 5: small_linear_row_stream_avx2<5>(x, k_dim, w, n, bias, y, n_dim); break;
        case 6: small_linear_row_stream_avx2<6>(x, k_dim, w, n, bias, y, n_dim); break;
        default: small_linear_row_stream_avx2<7>(x, k_dim, w, n, bias, y, n_dim); break;
      }
    }
    return;
  }
  for (; n + 4 <= n_end; n += 4) small_linear_pass_avx2<4>(x, rows, k_dim, w, n, bias, y, n_dim);
  for (; n < n_end; ++n) small_linear_pass_avx2<1>(x, rows, k_dim, w, n, bias, y, n_dim);
}

// ----------------------------------------------------------------------------- fp32, AVX2, many rows
// From a handful of rows on, the product is bound by the FMAs, not by reading the weights, and
// the dot-product blocks above (a weight vector times an input vector, summed across lanes at
// the end) stall at ~70% of the FMA peak: 7 vector loads feed 12 FMAs, and the 3 input rows of
// each pass come from L2. Here the lanes hold 8 input rows instead: the inputs are first packed
// into panels of 8 rows ([panel][k][8], zero padded; one pass over x per call), and each step
// broadcasts one weight w[n][k] into a register and multiplies it into V panels' x[.][k]
// (V = 1-3, so V * 8 rows against WR weight rows: 3 loads and 4 broadcasts feed 12 FMAs, no
// horizontal sums). The weights stay in their [N, K] layout (nothing is packed per model), and
// each pass over WR weight rows reads them from memory once; the later passes find them in L1
// or L2. The default model's 211 products on 2 AVX2 cores of the AMD EPYC (standalone harness,
// cold weights, packing included): 40 rows 51.6 ms (165 GFLOP/s, 90% of the FMA peak) against
// 67.0 for the dot-product blocks, 16 rows 21.8 against 31.4, 8 rows 18.6 against 20.7.
// Each output is one FMA chain over k in order (then the bias): a row's sums do not depend on
// the rows beside it among products that take this kernel, but they differ in rounding from
// the dot-product kernels' (8 lane partial sums), which take 1-7, 9 and 10 rows.

// Floats of x's packed panels for `rows` rows of k_dim: ceil(rows / 8) panels of k_dim x 8.
inline int64_t small_linear_packed_floats(int64_t rows, int64_t k_dim) { return (rows + 7) / 8 * k_dim * 8; }

// x [rows, k_dim] row-major -> xp [ceil(rows / 8)][k_dim][8], the rows past `rows` zero.
inline void small_linear_pack_rows(const float* x, int64_t rows, int64_t k_dim, float* xp) {
  for (int64_t m0 = 0; m0 < rows; m0 += 8) {
    float* panel = xp + m0 / 8 * k_dim * 8;
    const int64_t panel_rows = rows - m0 < 8 ? rows - m0 : 8;
    for (int64_t k = 0; k < k_dim; ++k) {
      for (int64_t i = 0; i < panel_rows; ++i) panel[k * 8 + i] = x[(m0 + i) * k_dim + k];
      for (int64_t i = panel_rows; i < 8; ++i) panel[k * 8 + i] = 0.f;
    }
  }
}

// Rows [m0, m0 + 8V) (clipped to `rows`) against weight rows [n, n + WR): WR * V accumulators
// (at most 12 of the 16 registers, with V panel vectors and a broadcast weight), a prefetch per
// weight row and cache line kSmallLinearPrefetchBytesAvx2 ahead.
template <int WR, int V>
__attribute__((target("avx2,fma"))) inline void small_linear_panels_block_avx2(const float* xp, int64_t rows, int64_t k_dim,
                                                                               const float* w, int64_t n, const float* bias,
                                                                               float* y, int64_t n_dim, int64_t m0) {
  __m256 acc[V][WR];
  const float* wr[WR];
  for (int j = 0; j < WR; ++j) wr[j] = w + (n + j) * k_dim;
  for (int v = 0; v < V; ++v)
    for (int j = 0; j < WR; ++j) acc[v][j] = _mm256_setzero_ps();
  const float* panels = xp + m0 / 8 * k_dim * 8;
  // One k: written out twice (unrolled body, tail) rather than as a lambda, which GCC would
  // neither compile for AVX2 nor keep the accumulators of in registers.
#define SPECDEC_PANELS_STEP(kx)                                                              \
  {                                                                                          \
    __m256 xv[V];                                                                            \
    for (int v = 0; v < V; ++v) xv[v] = _mm256_loadu_ps(panels + (v * k_dim + (kx)) * 8);   \
    for (int j = 0; j < WR; ++j) {                                                           \
      const __m256 wb = _mm256_broadcast_ss(wr[j] + (kx));                                   \
      for (int v = 0; v < V; ++v) acc[v][j] = _mm256_fmadd_ps(xv[v], wb, acc[v][j]);         \
    }                                                                                        \
  }
  int64_t k = 0;
  for (; k + 16 <= k_dim; k += 16) {
    for (int j = 0; j < WR; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + kSmallLinearPrefetchBytesAvx2, _MM_HINT_T0);
#pragma GCC unroll 16
    for (int kk = 0; kk < 16; ++kk) SPECDEC_PANELS_STEP(k + kk)
  }
  for (; k < k_dim; ++k) SPECDEC_PANELS_STEP(k)
#undef SPECDEC_PANELS_STEP
  alignas(32) float sums[WR][V * 8];
  for (int j = 0; j < WR; ++j)
    for (int v = 0; v < V; ++v) _mm256_store_ps(&sums[j][v * 8], acc[v][j]);
  const int64_t block_rows = rows - m0 < V * 8 ? rows - m0 : V * 8;
  for (int64_t i = 0; i < block_rows; ++i)
    for (int j = 0; j < WR; ++j) y[(m0 + i) * n_dim + n + j] = sums[j][i] + (bias != nullptr ? bias[n + j] : 0.f);
}

// Weight rows [n, n + WR) against every panel, in blocks of 3 panels (24 rows), then 2, never
// a lone panel after others (4 panels: 2 + 2), so most passes keep 12 accumulators busy.
template <int WR>
__attribute__((target("avx2,fma"))) inline void small_linear_panels_pass_avx2(const float* xp, int64_t rows, int64_t k_dim,
                                                                              const float* w, int64_t n, const float* bias,
                                                                              float* y, int64_t n_dim) {
  int64_t m0 = 0, panels = (rows + 7) / 8;
  for (; panels > 4 || panels == 3; panels -= 3, m0 += 24)
    small_linear_panels_block_avx2<WR, 3>(xp, rows, k_dim, w, n, bias, y, n_dim, m0);
  for (; panels >= 2; panels -= 2, m0 += 16) small_linear_panels_block_avx2<WR, 2>(xp, rows, k_dim, w, n, bias, y, n_dim, m0);
  if (panels == 1) small_linear_panels_block_avx2<WR, 1>(xp, rows, k_dim, w, n, bias, y, n_dim, m0);
}

__attribute__((target("avx2,fma"))) inline void small_linear_rows_packed_avx2(const float* xp, int64_t rows, int64_t k_dim,
                                                                              const float* w, const float* bias, float* y,
                                                                              int64_t n_dim, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (rows <= 8) {  // one panel: 8 weight rows at once, so 8 FMA chains hide the FMA latency
    for (; n + 8 <= n_end; n += 8) small_linear_panels_block_avx2<8, 1>(xp, rows, k_dim, w, n, bias, y, n_dim, 0);
  }
  for (; n + 4 <= n_end; n += 4) small_linear_panels_pass_avx2<4>(xp, rows, k_dim, w, n, bias, y, n_dim);
  for (; n < n_end; ++n) small_linear_panels_pass_avx2<1>(xp, rows, k_dim, w, n, bias, y, n_dim);
}
#endif

#ifdef SPECDEC_SMALL_LINEAR_X86
// ----------------------------------------------------------------------------- fp32, AVX-512
// With AVX-512F (checked at run time) the fp32 product runs 16 lanes per FMA and blocks 4
// weight rows against up to 4 input rows (16 accumulators of the 32 vector registers): 8
// loads feed 16 FMAs, where the AVX2 kernel's 2x4 block needs 6 loads for 8 half-width FMAs,
// so from 2 rows on the AVX-512 kernel does up to 4x the arithmetic per instruction (at 8 rows
// on a Xeon the AVX2 kernel ran far below both the memory and the FMA limits). 1-4 rows cost
// one weight read from memory; more rows reread the 4 weight rows from L1. The last
// k_dim % 16 elements go through zero-masked loads. Sums per (m, n): 16 lane partial sums over
// k, then the lanes pairwise (hsum16's fixed order): deterministic, and equal to any other
// order up to fp32 rounding.
#define SPECDEC_AVX512_TARGET __attribute__((target("avx512f")))


// Which of a block's 4 weight rows pass `pass` of `passes` (one pass per 4 input rows)
// prefetches ahead, as a bit mask: the passes share them out (pass p takes rows p, p + passes,
// ...), so each row ahead is prefetched once and the requests are spread over the whole time
// the block takes. (When only the first pass prefetched, a product of 8 or more rows left the
// memory idle during the later, L1-resident passes: time = memory + compute, not the larger.)
inline unsigned small_linear_prefetch_rows(int64_t pass, int64_t passes) {
  unsigned mask = 0;
  for (int64_t j = pass; j < 4; j += passes) mask |= 1u << j;
  return mask;
}

// A block's prefetch of one weight row at k (a pointer to it): kSmallLinearPrefetchBytes ahead
// into L1, or (kToL2: the stream's 3-8 rows) kSmallLinearL2PrefetchBytes ahead into L2. (A
// prefetch past the end of the weights is harmless: prefetches never fault.)
template <bool kToL2>
inline void small_linear_prefetch(const void* row_at_k) {
  const char* at = static_cast<const char*>(row_at_k);
  if constexpr (kToL2) _mm_prefetch(at + kSmallLinearL2PrefetchBytes, _MM_HINT_T1);
  else _mm_prefetch(at + kSmallLinearPrefetchBytes, _MM_HINT_T0);
}

// Horizontal sums of the accumulators, by GCC/Clang vector shuffles (GCC 12's AVX-512
// shuffle intrinsics and _mm512_reduce_add_ps trip -Wuninitialized inside its own headers).
// Each output is summed in one fixed order: 16 lanes -> 8 -> 4 -> 2 -> 1.
typedef float SlVec16 __attribute__((vector_size(64)));
typedef float SlVec8 __attribute__((vector_size(32)));
typedef float SlVec4 __attribute__((vector_size(16)));

SPECDEC_AVX512_TARGET inline float hsum16(__m512 v) {
  const SlVec16 a = (SlVec16)v;
  const SlVec8 h8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  const SlVec4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// The four sums of a, b, c, d at once (the same order per output as hsum16), with the
// shuffles shared: [sum a, sum b, sum c, sum d].
SPECDEC_AVX512_TARGET inline SlVec4 hsum16x4(__m512 va, __m512 vb, __m512 vc, __m512 vd) {
  const SlVec16 a = (SlVec16)va, b = (SlVec16)vb, c = (SlVec16)vc, d = (SlVec16)vd;
  // [a's 8 halves-sums, b's 8], [c's 8, d's 8]
  const SlVec16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const SlVec16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // 4 partial sums each of a, b, c, d
  const SlVec16 q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                    __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  // 2 each, then 1 each: lanes (0 + 2) + (1 + 3) of each output's 4, as in hsum16
  const SlVec8 p = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13) +
                   __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(p, p, 0, 2, 4, 6) + __builtin_shufflevector(p, p, 1, 3, 5, 7);
}

template <int WR, int XR, bool kToL2 = false>
SPECDEC_AVX512_TARGET inline void small_linear_block_f32_avx512(const float* x, int64_t k_dim, const float* w,
                                                                int64_t n, const float* bias, float* y,
                                                                int64_t n_dim, unsigned prefetch_rows) {
  __m512 acc[XR][WR];
  for (int i = 0; i < XR; ++i)
    for (int j = 0; j < WR; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* wr[WR];
  for (int j = 0; j < WR; ++j) wr[j] = w + (n + j) * k_dim;
  int64_t k = 0;
  for (; k + 16 <= k_dim; k += 16) {
    __m512 wv[WR];
    for (int j = 0; j < WR; ++j)
      if (prefetch_rows >> j & 1u) small_linear_prefetch<kToL2>(wr[j] + k);
    for (int j = 0; j < WR; ++j) wv[j] = _mm512_loadu_ps(wr[j] + k);
    for (int i = 0; i < XR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * k_dim + k);
      for (int j = 0; j < WR; ++j) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
    }
  }
  if (k < k_dim) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (k_dim - k)) - 1);
    __m512 wv[WR];
    for (int j = 0; j < WR; ++j) wv[j] = _mm512_maskz_loadu_ps(tail, wr[j] + k);
    for (int i = 0; i < XR; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + i * k_dim + k);
      for (int j = 0; j < WR; ++j) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
    }
  }
  float b[WR];
  for (int j = 0; j < WR; ++j) b[j] = bias != nullptr ? bias[n + j] : 0.f;
  for (int i = 0; i < XR; ++i) {
    if constexpr (WR == 4) {
      const SlVec4 sums = hsum16x4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      for (int j = 0; j < 4; ++j) y[i * n_dim + n + j] = sums[j] + b[j];
    } else {
      for (int j = 0; j < WR; ++j) y[i * n_dim + n + j] = hsum16(acc[i][j]) + b[j];
    }
  }
}

// Weight rows [n, n + WR) against every input row, up to 4 input rows per pass.
template <int WR>
SPECDEC_AVX512_TARGET inline void small_linear_pass_f32_avx512(const float* x, int64_t rows, int64_t k_dim,
                                                               const float* w, int64_t n, const float* bias,
                                                               float* y, int64_t n_dim) {
  const int64_t passes = (rows + 3) / 4;
  int64_t m = 0;
  for (int64_t pass = 0; m + 4 <= rows; m += 4, ++pass)
    small_linear_block_f32_avx512<WR, 4>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim,
                                         small_linear_prefetch_rows(pass, passes));
  const unsigned last = small_linear_prefetch_rows(passes - 1, passes);
  switch (rows - m) {
    case 3: small_linear_block_f32_avx512<WR, 3>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim, last); break;
    case 2: small_linear_block_f32_avx512<WR, 2>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim, last); break;
    case 1: small_linear_block_f32_avx512<WR, 1>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim, last); break;
    default: break;
  }
}

// The stream (small_linear_streams_avx512): weight rows [n_begin, n_end) one at a time, each
// against all XR input rows in one block (XR independent accumulators, the row read once).
template <int XR>
SPECDEC_AVX512_TARGET inline void small_linear_stream_f32_avx512(const float* x, int64_t k_dim, const float* w,
                                                                 const float* bias, float* y, int64_t n_dim,
                                                                 int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if constexpr (XR >= 3)  // blocks of 3 weight rows, each prefetched into L2 (kSmallLinearL2PrefetchBytes)
    for (; n + 3 <= n_end; n += 3) small_linear_block_f32_avx512<3, XR, true>(x, k_dim, w, n, bias, y, n_dim, 7u);
  for (; n < n_end; ++n) small_linear_block_f32_avx512<1, XR, (XR >= 3)>(x, k_dim, w, n, bias, y, n_dim, XR >= 3 ? 1u : 0u);
}

SPECDEC_AVX512_TARGET inline void small_linear_rows_f32_avx512(const float* x, int64_t rows, int64_t k_dim,
                                                               const float* w, const float* bias, float* y,
                                                               int64_t n_dim, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (small_linear_streams_avx512(rows)) {  // 1-2 rows a weight row at a time, 3-8 in blocks of 3
    switch (rows) {
      case 1: small_linear_stream_f32_avx512<1>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 2: small_linear_stream_f32_avx512<2>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 3: small_linear_stream_f32_avx512<3>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 4: small_linear_stream_f32_avx512<4>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 5: small_linear_stream_f32_avx512<5>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 6: small_linear_stream_f32_avx512<6>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 7: small_linear_stream_f32_avx512<7>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      default: small_linear_stream_f32_avx512<8>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
    }
  }
  for (; n + 4 <= n_end; n += 4) small_linear_pass_f32_avx512<4>(x, rows, k_dim, w, n, bias, y, n_dim);
  for (; n < n_end; ++n) small_linear_pass_f32_avx512<1>(x, rows, k_dim, w, n, bias, y, n_dim);
}
#endif

// Whether the AVX-512F fp32 kernel runs on this CPU (the instructions, and the OS saving the
// AVX-512 registers, which the compiler's CPU check includes).
inline bool small_linear_has_avx512() {
#ifdef SPECDEC_SMALL_LINEAR_X86
  static const bool has = small_linear_isa_cap() >= 2 && __builtin_cpu_supports("avx512f");
  return has;
#else
  return false;
#endif
}

// Whether the AVX2+FMA kernel runs on this CPU.
inline bool small_linear_has_avx2() {
#ifdef SPECDEC_SMALL_LINEAR_X86
  static const bool has = small_linear_isa_cap() >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

// y [rows, n_dim] (row-major) for output features [n_begin, n_end): x [rows, k_dim] and
// w [n_dim, k_dim] row-major, bias [n_dim] or nullptr.
inline void small_linear_rows(const float* x, int64_t rows, int64_t k_dim, const float* w, const float* bias, float* y,
                              int64_t n_dim, int64_t n_begin, int64_t n_end) {
#ifdef SPECDEC_SMALL_LINEAR_X86
  if (small_linear_has_avx512()) {
    small_linear_rows_f32_avx512(x, rows, k_dim, w, bias, y, n_dim, n_begin, n_end);
    return;
  }
  if (small_linear_has_avx2()) {
    small_linear_rows_avx2(x, rows, k_dim, w, bias, y, n_dim, n_begin, n_end);
    return;
  }
#endif
  small_linear_rows_portable(x, rows, k_dim, w, bias, y, n_dim, n_begin, n_end);
}

// Whether an fp32 product of `rows` rows takes the packed-panel kernel on this CPU (AVX2
// without AVX-512, whose own 16-lane blocks were never measured against it): a full panel of
// 8 rows, or 11 rows and more. At 9-10 rows half of the second panel's lanes would be padding,
// and the dot-product blocks were as fast. The caller packs x (small_linear_pack_rows) once
// and calls small_linear_rows_packed for its share of the output features.
inline bool small_linear_packs_rows(int64_t rows) {
#ifdef SPECDEC_SMALL_LINEAR_X86
  return !small_linear_has_avx512() && small_linear_has_avx2() && (rows == 8 || rows >= 11);
#else
  return false;
#endif
}

// y [rows, n_dim] for output features [n_begin, n_end) from x packed by small_linear_pack_rows
// (only where small_linear_packs_rows(rows)).
inline void small_linear_rows_packed(const float* xp, int64_t rows, int64_t k_dim, const float* w, const float* bias,
                                     float* y, int64_t n_dim, int64_t n_begin, int64_t n_end) {
#ifdef SPECDEC_SMALL_LINEAR_X86
  small_linear_rows_packed_avx2(xp, rows, k_dim, w, bias, y, n_dim, n_begin, n_end);
#endif
}

// ----------------------------------------------------------------------------- bf16

inline void small_linear_rows_bf16_portable(const cpu::BFloat16Bits* x, int64_t rows, int64_t k_dim,
                                            const cpu::BFloat16Bits* w, const cpu::BFloat16Bits* bias,
                                            cpu::BFloat16Bits* y, int64_t n_dim, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const cpu::BFloat16Bits* wn = w + n * k_dim;
    for (int64_t m = 0; m < rows; ++m) {
      const cpu::BFloat16Bits* xm = x + m * k_dim;
      float acc = 0.f;
      for (int64_t k = 0; k < k_dim; ++k) acc += cpu::to_float(xm[k]) * cpu::to_float(wn[k]);
      cpu::from_float(acc + (bias != nullptr ? cpu::to_float(bias[n]) : 0.f), y + m * n_dim + n);
    }
  }
}

#ifdef SPECDEC_SMALL_LINEAR_X86
#define SPECDEC_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

// WR weight rows [n, n + WR) against XR consecutive input rows from x (row stride k_dim),
// writing y[i * n_dim + n + j]. K runs 32 bf16 at a time; the last k_dim % 32 elements
// through zero-masked loads (products with 0 add nothing), so no scalar tail.
template <int WR, int XR, bool kToL2 = false>
SPECDEC_BF16_TARGET inline void small_linear_block_bf16(const cpu::BFloat16Bits* x, int64_t k_dim,
                                                        const cpu::BFloat16Bits* w, int64_t n,
                                                        const cpu::BFloat16Bits* bias, cpu::BFloat16Bits* y,
                                                        int64_t n_dim, unsigned prefetch_rows) {
  __m512 acc[XR][WR];
  for (int i = 0; i < XR; ++i)
    for (int j = 0; j < WR; ++j) acc[i][j] = _mm512_setzero_ps();
  const cpu::BFloat16Bits* wr[WR];
  for (int j = 0; j < WR; ++j) wr[j] = w + (n + j) * k_dim;
  int64_t k = 0;
  for (; k + 32 <= k_dim; k += 32) {
    __m512i wv[WR];
    for (int j = 0; j < WR; ++j)
      if (prefetch_rows >> j & 1u) small_linear_prefetch<kToL2>(wr[j] + k);
    for (int j = 0; j < WR; ++j) wv[j] = _mm512_loadu_si512(wr[j] + k);
    for (int i = 0; i < XR; ++i) {
      const __m512i xv = _mm512_loadu_si512(x + i * k_dim + k);
      for (int j = 0; j < WR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  if (k < k_dim) {
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (k_dim - k)) - 1);
    __m512i wv[WR];
    for (int j = 0; j < WR; ++j) wv[j] = _mm512_maskz_loadu_epi16(tail, wr[j] + k);
    for (int i = 0; i < XR; ++i) {
      const __m512i xv = _mm512_maskz_loadu_epi16(tail, x + i * k_dim + k);
      for (int j = 0; j < WR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  float b[WR];
  for (int j = 0; j < WR; ++j) b[j] = bias != nullptr ? cpu::to_float(bias[n + j]) : 0.f;
  for (int i = 0; i < XR; ++i) {
    if constexpr (WR == 4) {
      const SlVec4 sums = hsum16x4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      for (int j = 0; j < 4; ++j) cpu::from_float(sums[j] + b[j], y + i * n_dim + n + j);
    } else {
      for (int j = 0; j < WR; ++j) cpu::from_float(hsum16(acc[i][j]) + b[j], y + i * n_dim + n + j);
    }
  }
}

// Weight rows [n, n + WR) against every input row, up to 4 input rows per pass.
template <int WR>
SPECDEC_BF16_TARGET inline void small_linear_pass_bf16(const cpu::BFloat16Bits* x, int64_t rows, int64_t k_dim,
                                                       const cpu::BFloat16Bits* w, int64_t n,
                                                       const cpu::BFloat16Bits* bias, cpu::BFloat16Bits* y,
                                                       int64_t n_dim) {
  const int64_t passes = (rows + 3) / 4;
  int64_t m = 0;
  for (int64_t pass = 0; m + 4 <= rows; m += 4, ++pass)
    small_linear_block_bf16<WR, 4>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim,
                                   small_linear_prefetch_rows(pass, passes));
  const unsigned last = small_linear_prefetch_rows(passes - 1, passes);
  switch (rows - m) {
    case 3: small_linear_block_bf16<WR, 3>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim, last); break;
    case 2: small_linear_block_bf16<WR, 2>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim, last); break;
    case 1: small_linear_block_bf16<WR, 1>(x + m * k_dim, k_dim, w, n, bias, y + m * n_dim, n_dim, last); break;
    default: break;
  }
}

// The stream (small_linear_streams_avx512): as small_linear_stream_f32_avx512, in bf16.
template <int XR>
SPECDEC_BF16_TARGET inline void small_linear_stream_bf16(const cpu::BFloat16Bits* x, int64_t k_dim,
                                                         const cpu::BFloat16Bits* w, const cpu::BFloat16Bits* bias,
                                                         cpu::BFloat16Bits* y, int64_t n_dim, int64_t n_begin,
                                                         int64_t n_end) {
  int64_t n = n_begin;
  if constexpr (XR >= 3)
    for (; n + 3 <= n_end; n += 3) small_linear_block_bf16<3, XR, true>(x, k_dim, w, n, bias, y, n_dim, 7u);
  for (; n < n_end; ++n) small_linear_block_bf16<1, XR, (XR >= 3)>(x, k_dim, w, n, bias, y, n_dim, XR >= 3 ? 1u : 0u);
}

SPECDEC_BF16_TARGET inline void small_linear_rows_bf16_avx512(const cpu::BFloat16Bits* x, int64_t rows, int64_t k_dim,
                                                              const cpu::BFloat16Bits* w,
                                                              const cpu::BFloat16Bits* bias, cpu::BFloat16Bits* y,
                                                              int64_t n_dim, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (small_linear_streams_avx512(rows)) {  // 1-2 rows a weight row at a time, 3-8 in blocks of 3
    switch (rows) {
      case 1: small_linear_stream_bf16<1>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 2: small_linear_stream_bf16<2>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 3: small_linear_stream_bf16<3>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 4: small_linear_stream_bf16<4>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 5: small_linear_stream_bf16<5>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 6: small_linear_stream_bf16<6>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      case 7: small_linear_stream_bf16<7>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
      default: small_linear_stream_bf16<8>(x, k_dim, w, bias, y, n_dim, n, n_end); return;
    }
  }
  for (; n + 4 <= n_end; n += 4) small_linear_pass_bf16<4>(x, rows, k_dim, w, n, bias, y, n_dim);
  for (; n < n_end; ++n) small_linear_pass_bf16<1>(x, rows, k_dim, w, n, bias, y, n_dim);
}
#undef SPECDEC_BF16_TARGET
#undef SPECDEC_AVX512_TARGET
#endif

// Whether the AVX512-BF16 kernel runs on this CPU (the instructions, and the OS saving the
// AVX-512 registers, which the compiler's CPU check includes).
inline bool small_linear_has_avx512_bf16() {
#ifdef SPECDEC_SMALL_LINEAR_X86
  static const bool has = small_linear_isa_cap() >= 2 && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// The bf16 product: as small_linear_rows, with bf16 x, w, bias (or nullptr) and y.
inline void small_linear_rows_bf16(const cpu::BFloat16Bits* x, int64_t rows, int64_t k_dim, const cpu::BFloat16Bits* w,
                                   const cpu::BFloat16Bits* bias, cpu::BFloat16Bits* y, int64_t n_dim,
                                   int64_t n_begin, int64_t n_end) {
#ifdef SPECDEC_SMALL_LINEAR_X86
  if (small_linear_has_avx512_bf16()) {
    small_linear_rows_bf16_avx512(x, rows, k_dim, w, bias, y, n_dim, n_begin, n_end);
    return;
  }
#endif
  small_linear_rows_bf16_portable(x, rows, k_dim, w, bias, y, n_dim, n_begin, n_end);
}


// ----------------------------------------------------------------------------- int16 rows, int8 weights
// y[m, n] = (float(sum_k xq[m, k] * wq[n, k]) * xs[m]) * ws[n]: int16 input rows xq (scale xs[m]
// each) against an int8 copy of the weights wq (scale ws[n] each), the first, approximate pass
// of small_linear_argmax (csrc/include/specdec/small_linear_argmax.h), which reads one byte per
// weight: a quarter of fp32 weights' bytes, half of bf16's. The integer sums are exact (int32:
// the caller keeps |xq| <= small_linear_q8_x_limit(k_dim)), so their order is free and every
// kernel below gives the same y. One weight row at a time (a single stream through the
// weights, which the hardware prefetchers follow) against up to 8 input rows, no bias.

// The largest |xq| whose sums of k_dim products with int8 weights (|wq| <= 127) fit in int32.
inline int32_t small_linear_q8_x_limit(int64_t k_dim) {
  const int64_t limit = int64_t{2147483647} / (127 * (k_dim > 0 ? k_dim : 1));
  return static_cast<int32_t>(limit < 32767 ? limit : 32767);
}

inline void small_linear_q8w_rows_portable(const int16_t* xq, const float* xs, int64_t rows, int64_t k_dim,
                                           const int8_t* wq, const float* ws, float* y, int64_t n_dim,
                                           int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* wn = wq + n * k_dim;
    for (int64_t m = 0; m < rows; ++m) {
      const int16_t* xm = xq + m * k_dim;
      int32_t acc = 0;
      for (int64_t k = 0; k < k_dim; ++k) acc += static_cast<int32_t>(xm[k]) * wn[k];
      y[m * n_dim + n] = static_cast<float>(acc) * xs[m] * ws[n];
    }
  }
}

#ifdef SPECDEC_SMALL_LINEAR_X86
// XR input rows against int8 weight row n, LANES int16 pairs a step: the weights widened to
// int16 (sign-extend), then per input row VPMADDWD (pairs of int16 products summed into int32
// lanes) and an add into its accumulator; the k_dim % LANES tail in scalars. (Measured on the
// AMD EPYC, Zen 4, in a harness over the default model's LM head: two weight rows a pass, which
// share each input vector loaded, and AVX512-VNNI's VPDPWSSD, the multiply and add in one,
// were both no faster at 1-8 rows, two rows side by side clearly slower at 1-2; at 8 rows the
// pass is compute bound, ~2 ms of the default model's ~25 ms fp32 8-token verify, and a
// prefetch into L2 as the bf16 / fp32 stream's was within noise.)
#define SPECDEC_Q8_ROW_KERNEL(NAME, TARGET, VEC, LANES, WIDEN, LOADX, MADD, ADD, ZERO, HSUM)                    \
  template <int XR>                                                                                             \
  TARGET inline void NAME(const int16_t* xq, const float* xs, int64_t k_dim, const int8_t* wq, const float* ws, \
                          int64_t n, float* y, int64_t n_dim) {                                                \
    const int8_t* wr = wq + n * k_dim;                                                                          \
    VEC acc[XR];                                                                                                \
    for (int i = 0; i < XR; ++i) acc[i] = ZERO();                                                               \
    int64_t k = 0;                                                                                              \
    for (; k + LANES <= k_dim; k += LANES) {                                                                    \
      const VEC wv = WIDEN(wr + k);                                                                             \
      for (int i = 0; i < XR; ++i) acc[i] = ADD(acc[i], MADD(LOADX(xq + i * k_dim + k), wv));                   \
    }                                                                                                           \
    for (int i = 0; i < XR; ++i) {                                                                              \
      int32_t sum = HSUM(acc[i]);                                                                               \
      for (int64_t kk = k; kk < k_dim; ++kk) sum += static_cast<int32_t>(xq[i * k_dim + kk]) * wr[kk];           \
      y[i * n_dim + n] = static_cast<float>(sum) * xs[i] * ws[n];                                               \
    }                                                                                                           \
  }

#define SPECDEC_Q8_AVX512 __attribute__((target("avx512f,avx512bw")))
#define SPECDEC_Q8_AVX2 __attribute__((target("avx2")))
SPECDEC_Q8_AVX2 inline int32_t q8_hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
// (Halves by vector shuffles: GCC 12's _mm512_extracti64x4_epi64 trips -Wuninitialized
// inside its own header, as the float shuffles above say.)
typedef int32_t SlInt16 __attribute__((vector_size(64)));
typedef int32_t SlInt8 __attribute__((vector_size(32)));
SPECDEC_Q8_AVX512 inline int32_t q8_hsum16(__m512i v) {
  const SlInt16 a = (SlInt16)v;
  const SlInt8 h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  return q8_hsum8((__m256i)h);
}
SPECDEC_Q8_AVX512 inline __m512i q8_widen32(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
SPECDEC_Q8_AVX512 inline __m512i q8_load_x32(const int16_t* p) { return _mm512_loadu_si512(p); }
SPECDEC_Q8_AVX2 inline __m256i q8_widen16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
SPECDEC_Q8_AVX2 inline __m256i q8_load_x16(const int16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
SPECDEC_Q8_ROW_KERNEL(small_linear_q8w_row_avx512, SPECDEC_Q8_AVX512, __m512i, 32, q8_widen32, q8_load_x32,
                      _mm512_madd_epi16, _mm512_add_epi32, _mm512_setzero_si512, q8_hsum16)
SPECDEC_Q8_ROW_KERNEL(small_linear_q8w_row_avx2, SPECDEC_Q8_AVX2, __m256i, 16, q8_widen16, q8_load_x16,
                      _mm256_madd_epi16, _mm256_add_epi32, _mm256_setzero_si256, q8_hsum8)
#undef SPECDEC_Q8_ROW_KERNEL

// Weight rows [n_begin, n_end) against every input row, 8 input rows a pass (further passes
// reread the weight row from L1).
#define SPECDEC_Q8_ROWS(NAME, ROW, TARGET)                                                                     \
  TARGET inline void NAME(const int16_t* xq, const float* xs, int64_t rows, int64_t k_dim, const int8_t* wq,   \
                          const float* ws, float* y, int64_t n_dim, int64_t n_begin, int64_t n_end) {          \
    for (int64_t n = n_begin; n < n_end; ++n) {                                                                \
      for (int64_t m = 0; m < rows; m += 8) {                                                                  \
        const int16_t* xm = xq + m * k_dim;                                                                    \
        float* ym = y + m * n_dim;                                                                             \
        switch (rows - m < 8 ? rows - m : 8) {                                                                 \
          case 1: ROW<1>(xm, xs + m, k_dim, wq, ws, n, ym, n_dim); break;                                      \
          case 2: ROW<2>(xm, xs + m, k_dim, wq, ws, n, ym, n_dim); break;                                      \
          case 3: ROW<3>(xm, xs + m, k_dim, wq, ws, n, ym, n_dim); break;                                      \
          case 4: ROW<4>(xm, xs + m, k_dim, wq, ws, n, ym, n_dim); break;                                      \
          case 5: ROW<5>(xm, xs + m, k_dim, wq, ws, n, ym, n_dim); break;                                      \
          case 6: ROW<6>(xm, xs + m, k_dim, wq, ws, n, ym, n_dim); break;                                      \
          case 7: ROW<7>(xm, xs + m, k_dim, wq, ws, n, ym, n_dim); break;                                      \
          default: ROW<8>(xm, xs + m, k_dim, wq, ws, n, ym, n_dim); break;                                     \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
  }
SPECDEC_Q8_ROWS(small_linear_q8w_rows_avx512, small_linear_q8w_row_avx512, SPECDEC_Q8_AVX512)
SPECDEC_Q8_ROWS(small_linear_q8w_rows_avx2, small_linear_q8w_row_avx2, SPECDEC_Q8_AVX2)
#undef SPECDEC_Q8_ROWS
#undef SPECDEC_Q8_AVX512
#undef SPECDEC_Q8_AVX2
#endif

// Whether the AVX-512 int8-weight pass runs on this CPU (AVX512BW's 16-bit lanes).
inline bool small_linear_has_avx512bw() {
#ifdef SPECDEC_SMALL_LINEAR_X86
  static const bool has =
      small_linear_isa_cap() >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

inline void small_linear_q8w_rows(const int16_t* xq, const float* xs, int64_t rows, int64_t k_dim, const int8_t* wq,
                                  const float* ws, float* y, int64_t n_dim, int64_t n_begin, int64_t n_end) {
#ifdef SPECDEC_SMALL_LINEAR_X86
  if (small_linear_has_avx512bw()) {
    small_linear_q8w_rows_avx512(xq, xs, rows, k_dim, wq, ws, y, n_dim, n_begin, n_end);
    return;
  }
  if (small_linear_has_avx2()) {
    small_linear_q8w_rows_avx2(xq, xs, rows, k_dim, wq, ws, y, n_dim, n_begin, n_end);
    return;
  }
#endif
  small_linear_q8w_rows_portable(xq, xs, rows, k_dim, wq, ws, y, n_dim, n_begin, n_end);
}

}  // namespace specdec
