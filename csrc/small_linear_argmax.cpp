// The small_linear_argmax op (CPU): the torch side of csrc/include/specdec/small_linear_argmax.h,
// which says how each row's greedy token is found exactly from an int8 copy of the weights.
// Here: the operands' checks, the first pass (int8-weight product and each range's scan) split
// over torch's threads, and the fallback rows' full product with verify's own greedy rule.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "small_linear_cpu.h"
#include "specdec/small_linear_argmax.h"
#include "specdec/verify.h"  // cpu::verify_detail::load_logits: the greedy rule over a row of logits

namespace {

using Bits = specdec::cpu::BFloat16Bits;

at::Tensor small_linear_argmax_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_int8,
                                   const at::Tensor& row_stats) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && weight_int8.device().is_cpu() &&
                  row_stats.device().is_cpu(),
              "small_linear_argmax: every tensor must be on the CPU");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf16) && weight.scalar_type() == x.scalar_type(),
              "small_linear_argmax: x and weight must be both float32 or both bfloat16, got ", x.scalar_type(),
              " and ", weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_linear_argmax: x must be [rows, K] and weight [V, K], got ",
              x.dim(), " and ", weight.dim(), " dims");
  const int64_t rows = x.size(0), k_dim = x.size(1), vocab = weight.size(0);
  TORCH_CHECK(weight.size(1) == k_dim, "small_linear_argmax: x has K = ", k_dim, " but weight has K = ",
              weight.size(1));
  TORCH_CHECK(vocab >= 1, "small_linear_argmax: weight has no rows");
  TORCH_CHECK(weight_int8.scalar_type() == at::kChar && weight_int8.sizes() == weight.sizes(),
              "small_linear_argmax: weight_int8 must be an int8 copy of weight, [", vocab, ", ", k_dim, "]");
  TORCH_CHECK(row_stats.scalar_type() == at::kFloat && row_stats.dim() == 2 && row_stats.size(0) == 3 &&
                  row_stats.size(1) == vocab,
              "small_linear_argmax: row_stats must be float32 [3, V] = [3, ", vocab, "] (scale, error, norm)");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  if (rows == 0) return out;
  const at::Tensor x_c = x.contiguous(), w_c = weight.contiguous(), wq_c = weight_int8.contiguous(),
                   stats_c = row_stats.contiguous();
  const at::Tensor x_f = bf16 ? x_c.to(at::kFloat) : x_c;  // (exact: the bound's norms and the int16 rows)
  const float* stats = stats_c.const_data_ptr<float>();
  const float* w_scale = stats;
  const specdec::ArgmaxBounds bounds{stats + vocab, stats + 2 * vocab, bf16 ? specdec::kArgmaxBf16Tie : 0.f};
  const int8_t* wq = wq_c.const_data_ptr<int8_t>();

  std::vector<int16_t> xq(rows * k_dim);
  std::vector<float> xs(rows);
  std::vector<specdec::ArgmaxRow> norms(rows);
  specdec::argmax_quantize_rows(x_f.const_data_ptr<float>(), rows, k_dim, xq.data(), xs.data(), norms.data());

  // 1. The approximate logits, the int8 weight rows split over torch's threads, each thread
  // scanning its range of every row right after (still in its caches). (A buffer per calling
  // thread, kept: a fresh one page-faults on every call.)
  thread_local std::vector<float> approx;
  approx.resize(std::max<size_t>(approx.size(), static_cast<size_t>(rows * vocab)));
  float* a = approx.data();
  std::vector<specdec::ArgmaxRangeScan> scans;
  std::mutex scans_lock;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k_dim, 1));
  at::parallel_for(0, vocab, grain, [&](int64_t v0, int64_t v1) {
    specdec::small_linear_q8w_rows(xq.data(), xs.data(), rows, k_dim, wq, w_scale, a, vocab, v0, v1);
    std::vector<specdec::ArgmaxRangeScan> mine(rows);
    for (int64_t r = 0; r < rows; ++r) {
      mine[r].row = r;
      specdec::argmax_scan_range(a + r * vocab, bounds, norms[r], v0, v1, mine[r]);
    }
    const std::lock_guard<std::mutex> guard(scans_lock);
    for (specdec::ArgmaxRangeScan& scan : mine) scans.push_back(std::move(scan));
  });

  // 2. Each row's candidates; 3. their exact logits and the greedy rule.
  std::vector<int64_t> candidates, starts;
  std::vector<char> fallback;
  specdec::argmax_candidates(scans, a, bounds, norms.data(), rows, vocab, candidates, starts, fallback);
  int64_t* result = out.mutable_data_ptr<int64_t>();
  const bool any_fallback =
      bf16 ? specdec::argmax_pick_exact(reinterpret_cast<const Bits*>(x_c.const_data_ptr<at::BFloat16>()), rows,
                                        k_dim, reinterpret_cast<const Bits*>(w_c.const_data_ptr<at::BFloat16>()),
                                        candidates, starts, fallback, result)
           : specdec::argmax_pick_exact(x_c.const_data_ptr<float>(), rows, k_dim, w_c.const_data_ptr<float>(),
                                        candidates, starts, fallback, result);

  // Fallback rows: the full exact product (every row, so each keeps its row count's sums) and
  // verify's own greedy rule on theirs.
  if (any_fallback) {
    at::Tensor logits = at::empty({rows, vocab}, x.options());
    const specdec::LinearProduct product{&w_c, nullptr, &logits};
    specdec::small_linear_many(x_c, product);
    const at::Tensor logits_f = logits.to(at::kFloat);  // (bf16 logits: exact in fp32, as verify reads them)
    std::vector<float> scratch(vocab);
    for (int64_t r = 0; r < rows; ++r) {
      if (!fallback[r]) continue;
      float row_max = 0.f;
      result[r] = specdec::cpu::verify_detail::load_logits(logits_f.const_data_ptr<float>() + r * vocab, vocab,
                                                           scratch.data(), &row_max);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("small_linear_argmax", &small_linear_argmax_cpu); }
