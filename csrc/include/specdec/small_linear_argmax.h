// The greedy token of each row of a linear product (an LM head), exact, from half the weight
// bytes: argmax_v small_linear(x, weight)[r, v] as verify's greedy rule reads it (lowest id on
// ties, NaN never wins, +inf as the largest float), fp32 x and weight, no bias. Header-only,
// no torch dependency; the op (csrc/small_linear_argmax.cpp) splits the first pass over
// torch's threads and runs the fallback.
//
// A greedy step needs only the argmax of each node's logits, and the LM head is the biggest
// weight a small model reads per step (the default model: 113 MB of its 538). The first pass
// multiplies x by a bf16 copy of the weights (half the bytes) in fp32 (small_linear_bf16w_rows);
// a per-weight-row bound e_v (specdec_kernels/ops/small_linear.py `argmax_weights`: |bf16
// rounding of the row| plus the fp32 summation error of both products, any summation order,
// with a relative slack) gives |approx[r, v] - exact[r, v]| <= ||x_r|| * e_v. Every v whose
// interval reaches the largest lower end is a candidate, so the exact argmax is among them
// (`argmax_scan_range`, `argmax_candidates`); the candidates' exact logits are then computed
// by small_linear's own kernel for this row count (the same sums bit for bit as the full
// product), and the greedy rule picks among them (`argmax_pick_exact`). The first pass is the
// only full read; a row usually keeps 1-10 candidates.
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
#include <vector>

#include "specdec/small_linear.h"

namespace specdec {

constexpr int64_t kArgmaxMaxCandidates = 1024;
// A range's scan keeps at most this many ids (else `overflow`, and the row is rescanned whole).
constexpr size_t kArgmaxMaxKept = 4 * kArgmaxMaxCandidates;

namespace argmax_detail {

// A bound past this is no bound: ||x|| * e_v >= gamma * ||x|| * ||w_v|| (gamma >= 1e-7 for any
// K >= 1), so below it every partial sum of the exact product stays far from fp32 overflow.
constexpr float kMaxBound = 1e30f;
// Underflow: each rounding of a sum in the subnormal range may lose up to 2^-150; a few
// thousand of them stay far below this.
constexpr float kTinyBound = 1e-30f;

// Which v are candidates: those whose interval [a_v - b_v, a_v + b_v] reaches the largest lower
// end t. In floats, each sum below rounds by at most 2^-24 of its magnitude (and the bound's
// product and sum too), so v is kept iff up(a_v + b_v) >= down(t) with a slack of 2^-20 of
// each side's magnitude. down() increases with t: a running maximum t' <= t keeps a superset
// of what t keeps, so a range can be scanned once, before t is known.
inline float up(float s) { return s + std::fabs(s) * 0x1p-20f; }
inline float down(float t) { return t - std::fabs(t) * 0x1p-20f; }

inline bool reaches(float a, float err, float norm, float floor) { return up(a + (norm * err + kTinyBound)) >= floor; }

}  // namespace argmax_detail

// ||x_r|| of each row, rounded up to a float.
inline void argmax_row_norms(const float* x, int64_t rows, int64_t k_dim, float* norms) {
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0.0;
    for (int64_t k = 0; k < k_dim; ++k) sum += static_cast<double>(x[r * k_dim + k]) * x[r * k_dim + k];
    const double norm = std::sqrt(sum);
    norms[r] = static_cast<float>(norm);
    if (static_cast<double>(norms[r]) < norm) norms[r] = std::nextafter(norms[r], std::numeric_limits<float>::infinity());
  }
}

// One row's scan of approximate logits a[v0, v1) with bounds norm * err[v]: the largest lower
// end of the range, whether every value and bound there is usable, and the v that the running
// maximum keeps (ascending; at most kArgmaxMaxKept, else `overflow` and the row is rescanned).
struct ArgmaxRangeScan {
  int64_t row = 0;
  float threshold = -std::numeric_limits<float>::infinity();
  bool usable = true;
  bool overflow = false;
  std::vector<int64_t> kept;
};

inline void argmax_scan_range(const float* a, const float* err, int64_t v0, int64_t v1, float norm,
                              ArgmaxRangeScan& out) {
  using namespace argmax_detail;
  float threshold = -std::numeric_limits<float>::infinity(), floor = threshold;
  bool usable = std::isfinite(norm);
  for (int64_t v = v0; v < v1; ++v) {
    const float bound = norm * err[v] + kTinyBound;
    usable &= std::isfinite(a[v]) & (bound < kMaxBound);
    if (a[v] - bound > threshold) {
      threshold = a[v] - bound;
      floor = down(threshold);
    }
    if (up(a[v] + bound) >= floor) {
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
inline void argmax_candidates(const std::vector<ArgmaxRangeScan>& scans, const float* a, const float* err,
                              const float* norms, int64_t rows, int64_t vocab, std::vector<int64_t>& candidates,
                              std::vector<int64_t>& starts, std::vector<char>& fallback) {
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
    const float floor = down(thresholds[scan.row]);
    for (const int64_t v : scan.kept)
      if (reaches(ar[v], err[v], norms[scan.row], floor)) kept[scan.row].push_back(v);
  }
  candidates.clear();
  starts.assign(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    if (rescan[r] && !fallback[r]) {  // (a range kept too many: the whole row against its threshold)
      const float* ar = a + r * vocab;
      const float floor = down(thresholds[r]);
      for (int64_t v = 0; v < vocab; ++v)
        if (reaches(ar[v], err[v], norms[r], floor)) kept[r].push_back(v);
    }
    std::sort(kept[r].begin(), kept[r].end());
    if (static_cast<int64_t>(kept[r].size()) > kArgmaxMaxCandidates) fallback[r] = true;
    if (!fallback[r]) candidates.insert(candidates.end(), kept[r].begin(), kept[r].end());
    starts[r + 1] = static_cast<int64_t>(candidates.size());
  }
}

// The exact logits of every candidate (of any row) for all rows, by small_linear's kernel for
// this row count (packed panels where small_linear packs), one weight row at a time: the same
// sums as the full product's; then the greedy rule over each row's candidates (ascending ids:
// the first maximum is the lowest id) into result[r]. A row whose exact candidate is not
// finite is marked in `fallback` (result[r] left unset). Returns whether any row falls back.
inline bool argmax_pick_exact(const float* x, int64_t rows, int64_t k_dim, const float* w,
                              const std::vector<int64_t>& candidates, const std::vector<int64_t>& starts,
                              std::vector<char>& fallback, int64_t* result) {
  std::vector<int64_t> ids(candidates);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const int64_t count = static_cast<int64_t>(ids.size());
  std::vector<float> exact(static_cast<size_t>(rows * std::max<int64_t>(count, 1)));
  if (count > 0) {
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
