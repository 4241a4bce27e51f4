// CPU kernels for tree_mask and pack_tree_mask: checks and threading here, loops in
// include/specdec/tree.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#include "tree_checks.h"
#include "specdec/tree.h"

namespace specdec {
namespace {

// Roughly how many output elements a thread should get before threading pays off.
constexpr int64_t kGrainElements = 32768;

at::Tensor tree_mask_cpu(const at::Tensor& parents) {
  check_tree_mask_args(parents, at::Device(at::kCPU));
  const int64_t batch = parents.size(0);
  const int64_t num_nodes = parents.size(1);
  at::Tensor mask = parents.new_empty({batch, num_nodes, num_nodes}, parents.options().dtype(at::kBool));
  const int64_t* parents_data = parents.const_data_ptr<int64_t>();
  bool* mask_data = mask.mutable_data_ptr<bool>();
  const int64_t stride_b = parents.stride(0);
  const int64_t stride_t = parents.stride(1);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, num_nodes * num_nodes));
  at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* row = parents_data + b * stride_b;
      const int64_t bad = cpu::tree_mask(row, stride_t, num_nodes, mask_data + b * num_nodes * num_nodes);
      // The check happens while building the mask anyway, so it costs no extra pass.
      TORCH_CHECK(bad < 0, "tree_mask: parents[", b, ", ", bad, "] = ", bad < 0 ? 0 : row[bad * stride_t],
                  "; expected -1 (root or padding) or an earlier node in [0, ", bad, ") (topological order)");
    }
  });
  return mask;
}

at::Tensor pack_tree_mask_cpu(const at::Tensor& mask) {
  check_pack_tree_mask_args(mask, at::Device(at::kCPU));
  const int64_t batch = mask.size(0);
  const int64_t num_nodes = mask.size(1);
  const int64_t num_keys = mask.size(2);
  const int64_t num_words = (num_keys + 63) / 64;
  at::Tensor packed = mask.new_empty({batch, num_nodes, num_words}, mask.options().dtype(at::kLong));
  const bool* mask_data = mask.const_data_ptr<bool>();
  int64_t* packed_data = packed.mutable_data_ptr<int64_t>();
  const int64_t stride_b = mask.stride(0);
  const int64_t stride_t = mask.stride(1);
  const int64_t stride_k = mask.stride(2);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, num_keys));
  at::parallel_for(0, batch * num_nodes, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const bool* src = mask_data + (row / num_nodes) * stride_b + (row % num_nodes) * stride_t;
      cpu::pack_mask_row(src, stride_k, num_keys, packed_data + row * num_words);
    }
  });
  return packed;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("tree_mask", &specdec::tree_mask_cpu);
  m.impl("pack_tree_mask", &specdec::pack_tree_mask_cpu);
}
