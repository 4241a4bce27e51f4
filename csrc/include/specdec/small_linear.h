// Few-row linear products on the CPU: y[m, n] = dot(x[m, :], w[n, :]) (+ bias[n]), fp32.
//
// A decoding step multiplies every weight matrix by a handful of rows (one per tree node),
// so the job is to read each weight once, at the memory's speed, and use it for all rows
// while it is in registers. The kernel takes 4 weight rows at a time and runs them against 2
// input rows per pass (8 AVX2 accumulators, 8 lanes each); further pairs of input rows reread
// the same 4 weight rows from L1. Callers split the output features (n) over threads: each
// weight byte is read from memory by one thread, once.
//
// Header-only, no torch dependency. `small_linear_rows` picks the AVX2+FMA kernel when the
// CPU has it (checked once at run time; the file is built without -mavx2) and a portable
// loop otherwise. Sums run in a fixed order per (m, n): 8 lane partial sums over k, then the
// lanes added pairwise, then the k % 8 tail, so results are deterministic and agree with
// any other summation order to fp32 rounding.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECDEC_SMALL_LINEAR_X86 1
#endif

namespace specdec {

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
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// WR weight rows (1 or 4) against input rows xa and xb (xb may repeat xa: its results are
// then not stored), writing y[ma, n + j] and, if has_b, y[ma + 1, n + j].
template <int WR>
__attribute__((target("avx2,fma"))) inline void small_linear_block_avx2(const float* xa, const float* xb, bool has_b,
                                                                        int64_t k_dim, const float* w, int64_t n,
                                                                        const float* bias, float* ya, float* yb) {
  __m256 acc_a[WR], acc_b[WR];
  for (int j = 0; j < WR; ++j) acc_a[j] = acc_b[j] = _mm256_setzero_ps();
  const int64_t k8 = k_dim & ~int64_t(7);
  for (int64_t k = 0; k < k8; k += 8) {
    const __m256 va = _mm256_loadu_ps(xa + k);
    const __m256 vb = _mm256_loadu_ps(xb + k);
    for (int j = 0; j < WR; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + (n + j) * k_dim + k);
      acc_a[j] = _mm256_fmadd_ps(wv, va, acc_a[j]);
      acc_b[j] = _mm256_fmadd_ps(wv, vb, acc_b[j]);
    }
  }
  for (int j = 0; j < WR; ++j) {
    const float* wn = w + (n + j) * k_dim;
    float sa = hsum8(acc_a[j]), sb = hsum8(acc_b[j]);
    for (int64_t k = k8; k < k_dim; ++k) {
      sa += xa[k] * wn[k];
      sb += xb[k] * wn[k];
    }
    const float b = bias != nullptr ? bias[n + j] : 0.f;
    ya[n + j] = sa + b;
    if (has_b) yb[n + j] = sb + b;
  }
}

// Weight rows [n, n + WR) against every input row, two input rows per pass.
template <int WR>
__attribute__((target("avx2,fma"))) inline void small_linear_pass_avx2(const float* x, int64_t rows, int64_t k_dim,
                                                                       const float* w, int64_t n, const float* bias,
                                                                       float* y, int64_t n_dim) {
  for (int64_t m = 0; m < rows; m += 2) {
    const bool has_b = m + 1 < rows;
    const float* xa = x + m * k_dim;
    small_linear_block_avx2<WR>(xa, has_b ? xa + k_dim : xa, has_b, k_dim, w, n, bias, y + m * n_dim,
                                y + (has_b ? m + 1 : m) * n_dim);
  }
}

__attribute__((target("avx2,fma"))) inline void small_linear_rows_avx2(const float* x, int64_t rows, int64_t k_dim,
                                                                       const float* w, const float* bias, float* y,
                                                                       int64_t n_dim, int64_t n_begin,
                                                                       int64_t n_end) {
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) small_linear_pass_avx2<4>(x, rows, k_dim, w, n, bias, y, n_dim);
  for (; n < n_end; ++n) small_linear_pass_avx2<1>(x, rows, k_dim, w, n, bias, y, n_dim);
}
#endif

// Whether the AVX2+FMA kernel runs on this CPU.
inline bool small_linear_has_avx2() {
#ifdef SPECDEC_SMALL_LINEAR_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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
  if (small_linear_has_avx2()) {
    small_linear_rows_avx2(x, rows, k_dim, w, bias, y, n_dim, n_begin, n_end);
    return;
  }
#endif
  small_linear_rows_portable(x, rows, k_dim, w, bias, y, n_dim, n_begin, n_end);
}

}  // namespace specdec
