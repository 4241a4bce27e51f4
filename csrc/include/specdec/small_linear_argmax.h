// The greedy token of each row of a linear product (an LM head), exact, from one byte per
// weight: argmax_v small_linear(x, weight)[r, v] as verify's greedy rule reads it (lowest id
// on ties, NaN never wins, +inf as the largest float), x and weight both fp32 or both bf16, no
// bias. Header-only, no torch dependency; the op (csrc/small_linear_argmax.cpp) splits the
// first pass over torch's threads and runs the fallback.
//
// A greedy step needs only the argmax of each node's logits, and the LM head is the biggest
// weight a small model reads per step (the default model: 113 MB of its 538 in fp32, 57 of
// 269 in bf16). The first pass multiplies x, rounded to int16 per row (scale xs_r), by an
// int8 copy of the weights (scale ws_v per weight row) in exact integer sums
// (small_linear_q8w_rows): a quarter of the fp32 bytes, half of the bf16 ones. Per weight row
// v, `argmax_weights` (specdec_kernels/ops/small_linear.py) gives err_v = ||w_v - w^_v|| plus
// the fp32 summation error of the exact product in any order, and qnorm_v = ||w^_v||, both
// with a relative slack, where w^_v = ws_v * int8 row; per row, ||x_r|| and ||x_r - x^_r||
// (x^_r = xs_r * int16 row) are computed here. Then
//   |approx[r, v] - exact[r, v]| <= ||x_r|| * err_v + ||x_r - x^_r|| * qnorm_v,
// since x.w - x^.w^ = x.(w - w^) + (x - x^).w^. Every v whose interval reaches the largest
// lower end is a candidate, so the exact argmax is among them (`argmax_scan_range`,
// `argmax_candidates`); bf16 logits are rounded to bf16 before the greedy rule, so there the
// candidates reach 2^-6 of the lower end's magnitude further down (values that round to the
// same bf16 tie, and the lowest id wins). The candidates' exact logits are then computed by
// small_linear's own kernel for this row count (the same sums bit for bit as the full
// product, rounded to bf16 as it does), and the greedy rule picks among them
// (`argmax_pick_exact`). The first pass is the only full read; on the default model's
// hidden states a row keeps a median of 4 candidates (at most ~200 seen).
//
// A row falls back to the full exact product (and verify's own argmax) when its bound cannot
// be trusted or is useless: a non-finite x, approximate value or bound, a bound so large that
// the exact sums could overflow, a non-finite exact candidate, or more than
// kArgmaxMaxCandidates candidates.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "specdec/small_linear.h"

namespace specdec {

constexpr int64_t kArgmaxMaxCandidates = 1024;
// A range's scan keeps at most this many ids (else `overflow`, and the row is rescanned whole).
constexpr size_t kArgmaxMaxKept = 4 * kArgmaxMaxCandidates;
// How far below the largest lower end a bf16 logit may still tie with the best once both are
// rounded to bf16 (8 significant bits: an ulp is at most 2^-7 of the magnitude), relative.
constexpr float kArgmaxBf16Tie = 0x1p-6f;

namespace argmax_detail {

// A bound past this is no bound: ||x|| * err_v >= gamma * ||x|| * ||w_v|| (gamma >= 1e-7 for
// any K >= 1), so below it every partial sum of the exact product stays far from fp32 overflow.
constexpr float kMaxBound = 1e30f;
// Underflow: each rounding of a sum in the subnormal range may lose up to 2^-150; a few
// thousand of them stay far below this.
constexpr float kTinyBound = 1e-30f;

inline float up(float s) { return s + std::fabs(s) * 0x1p-20f; }

}  // namespace argmax_detail

// What bounds a row's approximate logits: the weights' per-row terms (err, qnorm: [V]), the
// row's norms, and `tie`: 0 for fp32 logits, kArgmaxBf16Tie for bf16 ones.
struct ArgmaxBounds {
  const float* err;
  const float* qnorm;
  float tie;
};

struct ArgmaxRow {
  float norm = 0.f;   // ||x_r||, rounded up
  float dnorm = 0.f;  // ||x_r - x^_r||, rounded up
};

namespace argmax_detail {

inline float bound(const ArgmaxBounds& b, const ArgmaxRow& row, int64_t v) {
  return row.norm * b.err[v] + row.dnorm * b.qnorm[v] + kTinyBound;
}

// Which v are candidates: those whose interval [a_v - b_v, a_v + b_v] reaches the largest lower
// end t (less the tie reach). In floats, each sum below rounds by at most 2^-24 of its
// magnitude (and the bound's products and sums too), so v is kept iff up(a_v + b_v) >= floor(t)
// with a slack of 2^-20 of each side's magnitude. floor() increases with t: a running maximum
// t' <= t keeps a superset of what t keeps, so a range can be scanned once, before t is known.
inline float floor_of(float t, float tie) { return t - std::fabs(t) * (0x1p-20f + tie); }

inline bool reaches(float a, float b, float floor) { return up(a + b) >= floor; }

}  // namespace argmax_detail

// Row r of x [rows, k_dim] (fp32, converted from bf16 by the caller where needed) rounded to
// int16 xq (|xq| <= small_linear_q8_x_limit(k_dim), so the first pass's int32 sums are exact)
// with scale xs[r] = max |x_r| / limit, and the row's norms for the bound, rounded up to floats.
// A row of zeros or with a non-finite value gets xs 0 and xq 0 (its norm says which).
inline void argmax_quantize_rows(const float* x, int64_t rows, int64_t k_dim, int16_t* xq, float* xs,
                                 ArgmaxRow* out) {
  const double limit = small_linear_q8_x_limit(k_dim);
  const auto round_up = [](double value) {
    float f = static_cast<float>(value);
    if (static_cast<double>(f) < value) f = std::nextafter(f, std::numeric_limits<float>::infinity());
    return f;
  };
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k_dim;
    int16_t* qr = xq + r * k_dim;
    double sum = 0.0, peak = 0.0;
    for (int64_t k = 0; k < k_dim; ++k) {
      sum += static_cast<double>(xr[k]) * xr[k];
      peak = std::max(peak, std::fabs(static_cast<double>(xr[k])));
    }
    const float scale = std::isfinite(sum) && peak > 0.0 ? static_cast<float>(peak / limit) : 0.f;
    double dsum = 0.0;
    for (int64_t k = 0; k < k_dim; ++k) {
      // (|x / scale| <= limit * (1 + 2^-23) rounds to at most limit)
      const double q = scale > 0.f ? std::nearbyint(xr[k] / static_cast<double>(scale)) : 0.0;
      qr[k] = static_cast<int16_t>(std::max(-limit, std::min(limit, q)));
      const double d = xr[k] - static_cast<double>(scale) * qr[k];  // exact in double up to one rounding
      dsum += d * d;
    }
    xs[r] = scale;
    out[r].norm = round_up(std::sqrt(sum));
    // (the one rounding of each difference and of the sums: 2^-40 is far above them)
    out[r].dnorm = round_up(std::sqrt(dsum) * (1.0 + 0x1p-40) + std::sqrt(sum) * 0x1p-40);
  }
}

// One row's scan of approximate logits a[v0, v1): the largest lower end of the range, whether
// every value and bound there is usable, and the v that the running maximum keeps (ascending;
// at most kArgmaxMaxKept, else `overflow` and the row is rescanned).
struct ArgmaxRangeScan {
  int64_t row = 0;
  float threshold = -std::numeric_limits<float>::infinity();
  bool usable = true;
  bool overflow = false;
  std::vector<int64_t> kept;
};

inline void argmax_scan_range(const float* a, const ArgmaxBounds& bounds, const ArgmaxRow& row, int64_t v0,
                              int64_t v1, ArgmaxRangeScan& out) {
  using namespace argmax_detail;
  float threshold = -std::numeric_limits<float>::infinity(), floor = threshold;
  bool usable = std::isfinite(row.norm) && std::isfinite(row.dnorm);
  for (int64_t v = v0; v < v1; ++v) {
    const float b = bound(bounds, row, v);
    usable &= std::isfinite(a[v]) & (b < kMaxBound);
    if (a[v] - b > threshold) {
      threshold = a[v] - b;
      floor = floor_of(threshold, bounds.tie);
    }
    if (reaches(a[v], b, floor)) {
      if (out.kept.size() < kArgmaxMaxKept) {
        out.kept.push_back(v);
      } else {
        out.overflow = true;
      }
    }
  }
  out.threshold = threshold;
  out.usable = usable;
}

// Each row's candidates from the scans of its ranges (in any order; together they cover
// [0, vocab) of every row once): what the ranges kept against the row's largest lower end,
// ascending, concatenated into `candidates` with row r's at [starts[r], starts[r + 1]).
// fallback[r] (rows entries, set here) marks rows the bound cannot decide. a: the approximate
// logits [rows, vocab].
inline void argmax_candidates(const std::vector<ArgmaxRangeScan>& scans, const float* a, const ArgmaxBounds& bounds,
                              const ArgmaxRow* row_norms, int64_t rows, int64_t vocab,
                              std::vector<int64_t>& candidates, std::vector<int64_t>& starts,
                              std::vector<char>& fallback) {
  using namespace argmax_detail;
  std::vector<float> thresholds(rows, -std::numeric_limits<float>::infinity());
  std::vector<char> rescan(rows, 0);
  fallback.assign(rows, 0);
  for (const ArgmaxRangeScan& scan : scans) {
    thresholds[scan.row] = std::max(thresholds[scan.row], scan.threshold);
    fallback[scan.row] |= !scan.usable;
    rescan[scan.row] |= scan.overflow;
  }
  std::vector<std::vector<int64_t>> kept(rows);
  for (const ArgmaxRangeScan& scan : scans) {
    if (fallback[scan.row] || rescan[scan.row]) continue;
    const float* ar = a + scan.row * vocab;
    const float floor = floor_of(thresholds[scan.row], bounds.tie);
    for (const int64_t v : scan.kept)
      if (reaches(ar[v], bound(bounds, row_norms[scan.row], v), floor)) kept[scan.row].push_back(v);
  }
  candidates.clear();
  starts.assign(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    if (rescan[r] && !fallback[r]) {  // (a range kept too many: the whole row against its threshold)
      const float* ar = a + r * vocab;
      const float floor = floor_of(thresholds[r], bounds.tie);
      for (int64_t v = 0; v < vocab; ++v)
        if (reaches(ar[v], bound(bounds, row_norms[r], v), floor)) kept[r].push_back(v);
    }
    std::sort(kept[r].begin(), kept[r].end());
    if (static_cast<int64_t>(kept[r].size()) > kArgmaxMaxCandidates) fallback[r] = true;
    if (!fallback[r]) candidates.insert(candidates.end(), kept[r].begin(), kept[r].end());
    starts[r + 1] = static_cast<int64_t>(candidates.size());
  }
}

// The exact logits of every candidate (of any row) for all rows, by small_linear's kernel for
// this row count and dtype (packed panels where small_linear packs fp32 rows), one weight row
// at a time: the same sums as the full product's (bf16: rounded to bf16 as it rounds them);
// then the greedy rule over each row's candidates (ascending ids: the first maximum is the
// lowest id) into result[r]. A row whose exact candidate is not finite is marked in
// `fallback` (result[r] left unset). Returns whether any row falls back. Scalar: float or
// cpu::BFloat16Bits, x's and w's.
template <typename Scalar>
inline bool argmax_pick_exact(const Scalar* x, int64_t rows, int64_t k_dim, const Scalar* w,
                              const std::vector<int64_t>& candidates, const std::vector<int64_t>& starts,
                              std::vector<char>& fallback, int64_t* result) {
  std::vector<int64_t> ids(candidates);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const int64_t count = static_cast<int64_t>(ids.size());
  std::vector<float> exact(static_cast<size_t>(rows * std::max<int64_t>(count, 1)));
  if (count > 0) {
    if constexpr (std::is_same<Scalar, float>::value) {
      const bool packed = small_linear_packs_rows(rows);
      std::vector<float> panels;
      if (packed) {
        panels.resize(small_linear_packed_floats(rows, k_dim));
        small_linear_pack_rows(x, rows, k_dim, panels.data());
      }
      for (int64_t j = 0; j < count; ++j) {
        const float* wv = w + ids[j] * k_dim;
        if (packed) {
          small_linear_rows_packed(panels.data(), rows, k_dim, wv, nullptr, exact.data() + j, count, 0, 1);
        } else {
          small_linear_rows(x, rows, k_dim, wv, nullptr, exact.data() + j, count, 0, 1);
        }
      }
    } else {
      std::vector<Scalar> rounded(static_cast<size_t>(rows * count));
      for (int64_t j = 0; j < count; ++j)
        small_linear_rows_bf16(x, rows, k_dim, w + ids[j] * k_dim, nullptr, rounded.data() + j, count, 0, 1);
      for (size_t i = 0; i < rounded.size(); ++i) exact[i] = cpu::to_float(rounded[i]);
    }
  }
  bool any_fallback = false;
  for (int64_t r = 0; r < rows; ++r) {
    if (fallback[r]) {
      any_fallback = true;
      continue;
    }
    int64_t best = -1;
    float best_value = 0.f;
    for (int64_t i = starts[r]; i < starts[r + 1]; ++i) {
      const int64_t v = candidates[i];
      const float value = exact[r * count + (std::lower_bound(ids.begin(), ids.end(), v) - ids.begin())];
      if (!std::isfinite(value)) {
        best = -1;
        break;
      }
      if (best < 0 || value > best_value) {
        best = v;
        best_value = value;
      }
    }
    if (best < 0) {
      fallback[r] = any_fallback = true;
    } else {
      result[r] = best;
    }
  }
  return any_fallback;
}

}  // namespace specdec
