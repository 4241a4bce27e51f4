// The torch side of the few-row linear product (csrc/include/specdec/small_linear.h): the
// split of one or more products of the same input over torch's threads. Shared by
// small_linear.cpp (the op) and decoder_layer.cpp (q/k/v and gate/up products of one layer in
// one parallel region).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <vector>

#include "specdec/small_linear.h"

namespace specdec {

// One product y = x @ weight^T (+ bias) of a small_linear_many call; y is preallocated
// [rows, N] contiguous, in x's dtype.
struct LinearProduct {
  const at::Tensor* weight;  // [N, K], contiguous, x's dtype
  const at::Tensor* bias;    // [N] contiguous, x's dtype, or nullptr
  at::Tensor* y;
};

// Every product of `products` with the same contiguous x [rows, K] (operands checked and
// contiguous), in one parallel region: the output features of all of them, in blocks of 4
// weight rows, are split over torch's threads, so each thread streams its own share of all
// the weights once. Tasks of at least ~128 KB of weights: enough work to hide the split.
inline void small_linear_many(const at::Tensor& x, c10::ArrayRef<LinearProduct> products) {
  const int64_t rows = x.size(0), k_dim = x.size(1);
  if (rows == 0) return;
  int64_t total_blocks = 0;
  for (const LinearProduct& p : products) total_blocks += (p.weight->size(0) + 3) / 4;
  if (total_blocks == 0) return;
  const int64_t grain = std::max<int64_t>(1, (32768 / x.element_size()) / std::max<int64_t>(k_dim, 1));
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  // Many fp32 rows: x packed into panels of 8 rows once, for every product and thread.
  const bool packed = !bf16 && specdec::small_linear_packs_rows(rows);
  // (A buffer per calling thread, kept: with a fresh allocation per product, which
  // page-faults, the default model's layers took 6-8% longer at 128-256 rows.)
  thread_local std::vector<float> panels;
  if (packed) {
    panels.resize(std::max<size_t>(panels.size(), specdec::small_linear_packed_floats(rows, k_dim)));
    specdec::small_linear_pack_rows(x.const_data_ptr<float>(), rows, k_dim, panels.data());
  }
  const float* xp = panels.data();  // (the workers' own thread_local `panels` are other, empty buffers)
  using Bits = specdec::cpu::BFloat16Bits;
  static_assert(sizeof(Bits) == sizeof(at::BFloat16), "bf16 storage must match at::BFloat16 bit for bit");
  at::parallel_for(0, total_blocks, grain, [&](int64_t b0, int64_t b1) {
    int64_t first = 0;  // the first block of the current product in the concatenation
    for (const LinearProduct& p : products) {
      const int64_t n_dim = p.weight->size(0), blocks = (n_dim + 3) / 4;
      const int64_t lo = std::max(b0, first), hi = std::min(b1, first + blocks);
      if (lo < hi) {
        const int64_t n_begin = (lo - first) * 4, n_end = std::min(n_dim, (hi - first) * 4);
        if (bf16) {
          specdec::small_linear_rows_bf16(
              reinterpret_cast<const Bits*>(x.const_data_ptr<at::BFloat16>()), rows, k_dim,
              reinterpret_cast<const Bits*>(p.weight->const_data_ptr<at::BFloat16>()),
              p.bias ? reinterpret_cast<const Bits*>(p.bias->const_data_ptr<at::BFloat16>()) : nullptr,
              reinterpret_cast<Bits*>(p.y->mutable_data_ptr<at::BFloat16>()), n_dim, n_begin, n_end);
        } else if (packed) {
          specdec::small_linear_rows_packed(xp, rows, k_dim, p.weight->const_data_ptr<float>(),
                                            p.bias ? p.bias->const_data_ptr<float>() : nullptr,
                                            p.y->mutable_data_ptr<float>(), n_dim, n_begin, n_end);
        } else {
          specdec::small_linear_rows(x.const_data_ptr<float>(), rows, k_dim, p.weight->const_data_ptr<float>(),
                                     p.bias ? p.bias->const_data_ptr<float>() : nullptr,
                                     p.y->mutable_data_ptr<float>(), n_dim, n_begin, n_end);
        }
      }
      first += blocks;
    }
  });
}

}  // namespace specdec
