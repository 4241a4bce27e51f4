// The greedy token of each row of a linear product (an LM head), exact, from half the weight
// bytes: argmax_v small_linear(x, weight)[r, v] as verify's greedy rule reads it (lowest id on
// ties, NaN never wins, +inf as the largest float), CPU, fp32 x and weight, no bias.
//
// A greedy step needs only the argmax of each node's logits, and the LM head is the biggest
// weight a small model reads per step (the default model: 113 MB of its 538). The first pass
// multiplies x by a bf16 copy of the weights (half the bytes) in fp32; a per-weight-row bound
// e_v (specdec_kernels/ops/small_linear.py `argmax_weights`: |bf16 rounding of the row| plus
// the fp32 summation error of both products, any summation order, with a relative slack) gives
// |approx[r, v] - exact[r, v]| <= ||x_r|| * e_v. Every v whose interval reaches the largest
// lower end is a candidate, so the exact argmax is among them; the candidates' exact logits are
// then computed by small_linear's own kernel for this row count (the same sums bit for bit as
// the full product), and the greedy rule picks among them. The first pass is the only full
// read; a row usually keeps 1-10 candidates.
//
// A row falls back to the full exact product (and verify's own argmax) when its bound cannot
// be trusted or is useless: a non-finite x, approximate value or bound, a bound so large that
// the exact sums could overflow, a non-finite exact candidate, or more than kMaxCandidates
// candidates.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "small_linear_cpu.h"
#include "specdec/verify.h"  // cpu::verify_detail::load_logits: the greedy rule over a row of logits

namespace {

constexpr int64_t kMaxCandidates = 1024;
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

// One row's scan of approximate logits a[v0, v1) with bounds norm * err[v]: the largest lower
// end of the range, whether every value and bound there is usable, and the v that the running
// maximum keeps (ascending; at most kMaxKept, else `overflow` and the caller rescans the row).
struct RangeScan {
  int64_t row = 0;
  float threshold = -std::numeric_limits<float>::infinity();
  bool usable = true;
  bool overflow = false;
  std::vector<int64_t> kept;
};
constexpr size_t kMaxKept = 4 * kMaxCandidates;

void scan_range(const float* a, const float* err, int64_t v0, int64_t v1, float norm, RangeScan& out) {
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
      if (out.kept.size() < kMaxKept) {
        out.kept.push_back(v);
      } else {
        out.overflow = true;
      }
    }
  }
  out.threshold = threshold;
  out.usable = usable;
}

at::Tensor small_linear_argmax_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_bf16,
                                   const at::Tensor& row_error) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && weight_bf16.device().is_cpu() &&
                  row_error.device().is_cpu(),
              "small_linear_argmax: every tensor must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "small_linear_argmax: x and weight must be float32, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_linear_argmax: x must be [rows, K] and weight [V, K], got ",
              x.dim(), " and ", weight.dim(), " dims");
  const int64_t rows = x.size(0), k_dim = x.size(1), vocab = weight.size(0);
  TORCH_CHECK(weight.size(1) == k_dim, "small_linear_argmax: x has K = ", k_dim, " but weight has K = ",
              weight.size(1));
  TORCH_CHECK(vocab >= 1, "small_linear_argmax: weight has no rows");
  TORCH_CHECK(weight_bf16.scalar_type() == at::kBFloat16 && weight_bf16.sizes() == weight.sizes(),
              "small_linear_argmax: weight_bf16 must be a bfloat16 copy of weight, [", vocab, ", ", k_dim, "]");
  TORCH_CHECK(row_error.scalar_type() == at::kFloat && row_error.dim() == 1 && row_error.size(0) == vocab,
              "small_linear_argmax: row_error must be float32 [V] = [", vocab, "]");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  if (rows == 0) return out;
  const at::Tensor x_c = x.contiguous(), w_c = weight.contiguous(), wb_c = weight_bf16.contiguous(),
                   err_c = row_error.contiguous();
  const float* xp = x_c.const_data_ptr<float>();
  const float* w = w_c.const_data_ptr<float>();
  const float* err = err_c.const_data_ptr<float>();
  using Bits = specdec::cpu::BFloat16Bits;
  const Bits* wb = reinterpret_cast<const Bits*>(wb_c.const_data_ptr<at::BFloat16>());

  // ||x_r||, rounded up to a float.
  std::vector<float> norms(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0.0;
    for (int64_t k = 0; k < k_dim; ++k) sum += static_cast<double>(xp[r * k_dim + k]) * xp[r * k_dim + k];
    const double norm = std::sqrt(sum);
    norms[r] = static_cast<float>(norm);
    if (static_cast<double>(norms[r]) < norm) norms[r] = std::nextafter(norms[r], std::numeric_limits<float>::infinity());
  }

  // 1. The approximate logits, the bf16 weight rows split over torch's threads, each thread
  // scanning its range of every row right after (still in its caches). (A buffer per calling
  // thread, kept: a fresh one page-faults on every call.)
  thread_local std::vector<float> approx;
  approx.resize(std::max<size_t>(approx.size(), static_cast<size_t>(rows * vocab)));
  float* a = approx.data();
  std::vector<RangeScan> scans;
  std::mutex scans_lock;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k_dim, 1));
  at::parallel_for(0, vocab, grain, [&](int64_t v0, int64_t v1) {
    specdec::small_linear_bf16w_rows(xp, rows, k_dim, wb, a, vocab, v0, v1);
    std::vector<RangeScan> mine(rows);
    for (int64_t r = 0; r < rows; ++r) {
      mine[r].row = r;
      scan_range(a + r * vocab, err, v0, v1, norms[r], mine[r]);
    }
    const std::lock_guard<std::mutex> guard(scans_lock);
    for (RangeScan& scan : mine) scans.push_back(std::move(scan));
  });

  // 2. Each row's candidates: what its ranges kept, against the row's largest lower end.
  std::vector<float> thresholds(rows, -std::numeric_limits<float>::infinity());
  std::vector<char> fallback(rows, 0), rescan(rows, 0);
  for (const RangeScan& scan : scans) {
    thresholds[scan.row] = std::max(thresholds[scan.row], scan.threshold);
    fallback[scan.row] |= !scan.usable;
    rescan[scan.row] |= scan.overflow;
  }
  std::vector<std::vector<int64_t>> kept(rows);
  for (const RangeScan& scan : scans) {
    if (fallback[scan.row] || rescan[scan.row]) continue;
    const float* ar = a + scan.row * vocab;
    const float floor = down(thresholds[scan.row]), norm = norms[scan.row];
    for (const int64_t v : scan.kept)
      if (up(ar[v] + (norm * err[v] + kTinyBound)) >= floor) kept[scan.row].push_back(v);
  }
  std::vector<int64_t> candidates, starts(rows + 1, 0);
  bool any_fallback = false;
  for (int64_t r = 0; r < rows; ++r) {
    if (rescan[r] && !fallback[r]) {  // (a range kept too many: the whole row against its threshold)
      const float* ar = a + r * vocab;
      const float floor = down(thresholds[r]);
      for (int64_t v = 0; v < vocab; ++v)
        if (up(ar[v] + (norms[r] * err[v] + kTinyBound)) >= floor) kept[r].push_back(v);
    }
    std::sort(kept[r].begin(), kept[r].end());
    if (static_cast<int64_t>(kept[r].size()) > kMaxCandidates) fallback[r] = true;
    any_fallback |= fallback[r];
    if (!fallback[r]) candidates.insert(candidates.end(), kept[r].begin(), kept[r].end());
    starts[r + 1] = static_cast<int64_t>(candidates.size());
  }

  // 3. The exact logits of every candidate (of any row) for all rows, by small_linear's kernel
  // for this row count, one weight row at a time: the same sums as the full product's.
  std::vector<int64_t> ids(candidates);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const int64_t count = static_cast<int64_t>(ids.size());
  std::vector<float> exact(static_cast<size_t>(rows * std::max<int64_t>(count, 1)));
  if (count > 0) {
    const bool packed = specdec::small_linear_packs_rows(rows);
    std::vector<float> panels;
    if (packed) {
      panels.resize(specdec::small_linear_packed_floats(rows, k_dim));
      specdec::small_linear_pack_rows(xp, rows, k_dim, panels.data());
    }
    for (int64_t j = 0; j < count; ++j) {
      const float* wv = w + ids[j] * k_dim;
      if (packed) {
        specdec::small_linear_rows_packed(panels.data(), rows, k_dim, wv, nullptr, exact.data() + j, count, 0, 1);
      } else {
        specdec::small_linear_rows(xp, rows, k_dim, wv, nullptr, exact.data() + j, count, 0, 1);
      }
    }
  }

  // 4. The greedy rule over each row's candidates (ascending ids: the first maximum is the lowest id).
  int64_t* result = out.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    if (fallback[r]) continue;
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

  // Fallback rows: the full exact product (every row, so each keeps its row count's sums) and
  // verify's own greedy rule on theirs.
  if (any_fallback) {
    at::Tensor logits = at::empty({rows, vocab}, x.options());
    const specdec::LinearProduct product{&w_c, nullptr, &logits};
    specdec::small_linear_many(x_c, product);
    std::vector<float> scratch(vocab);
    for (int64_t r = 0; r < rows; ++r) {
      if (!fallback[r]) continue;
      float row_max = 0.f;
      result[r] = specdec::cpu::verify_detail::load_logits(logits.const_data_ptr<float>() + r * vocab, vocab,
                                                      scratch.data(), &row_max);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("small_linear_argmax", &small_linear_argmax_cpu); }
