// Input checks shared by the CPU and CUDA glue. Python validates and normalises inputs
// first, so these only catch misuse of torch.ops.specdec.* directly: metadata only (dims,
// dtypes, devices, sizes), never a scan of the data. Messages name the op and argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "specdec/kv_cache.h"

namespace specdec {

inline void check_tensor(const char* op, const char* name, const at::Tensor& t, int64_t dims, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == dims, op, ": ", name, " must be a ", dims, "-D tensor, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must have dtype ", dtype, ", got ", t.scalar_type());
}

inline void check_device(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, " like the other inputs, got ",
              t.device());
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, int64_t expected,
                       const char* what) {
  TORCH_CHECK(t.size(dim) == expected, op, ": ", name, ".size(", dim, ") must be ", what, " = ", expected,
              ", got shape ", t.sizes());
}

inline void check_fits_int32(const char* op, const char* name, int64_t value) {
  TORCH_CHECK(value <= std::numeric_limits<int32_t>::max(), op, ": ", name, " = ", value, " does not fit in int32");
}

// Checks compact_kv_cache_'s arguments (all on `device`) and returns each cache as bytes.
inline std::vector<KvCacheView> compact_kv_cache_views(at::TensorList caches, const at::Tensor& cache_seqlens,
                                                       const at::Tensor& accepted_nodes,
                                                       const at::Tensor& num_accepted, const at::Device& device) {
  constexpr const char* op = "compact_kv_cache_";
  check_tensor(op, "accepted_nodes", accepted_nodes, 2, at::kInt);
  check_tensor(op, "cache_seqlens", cache_seqlens, 1, at::kInt);
  check_tensor(op, "num_accepted", num_accepted, 1, at::kInt);
  check_device(op, "accepted_nodes", accepted_nodes, device);
  check_device(op, "cache_seqlens", cache_seqlens, device);
  check_device(op, "num_accepted", num_accepted, device);
  const int64_t batch = accepted_nodes.size(0);
  check_size(op, "cache_seqlens", cache_seqlens, 0, batch, "B (accepted_nodes.size(0))");
  check_size(op, "num_accepted", num_accepted, 0, batch, "B (accepted_nodes.size(0))");
  check_fits_int32(op, "T (accepted_nodes.size(1))", accepted_nodes.size(1));

  std::vector<KvCacheView> views;
  views.reserve(caches.size());
  for (size_t i = 0; i < caches.size(); ++i) {
    const at::Tensor& cache = caches[i];
    const std::string name = "caches[" + std::to_string(i) + "]";
    // Any dtype is fine: entries are moved as bytes.
    TORCH_CHECK(cache.dim() == 4, op, ": ", name, " must be a 4-D [B, S, H, D] tensor, got shape ", cache.sizes());
    check_device(op, name.c_str(), cache, device);
    check_size(op, name.c_str(), cache, 0, batch, "B (accepted_nodes.size(0))");
    TORCH_CHECK(cache.stride(3) == 1 || cache.size(3) <= 1, op, ": ", name,
                " needs a contiguous last dim (stride 1), got strides ", cache.strides());
    const int64_t element = cache.element_size();
    check_fits_int32(op, (name + ".size(1)").c_str(), cache.size(1));
    check_fits_int32(op, (name + ".size(2)").c_str(), cache.size(2));
    check_fits_int32(op, (name + ".size(3) * element size").c_str(), cache.size(3) * element);
    views.push_back(KvCacheView{static_cast<char*>(cache.data_ptr()), cache.stride(0) * element,
                                cache.stride(1) * element, cache.stride(2) * element,
                                static_cast<int32_t>(cache.size(1)), static_cast<int32_t>(cache.size(2)),
                                static_cast<int32_t>(cache.size(3) * element), /*vec_bytes=*/0});
  }
  return views;
}

}  // namespace specdec
