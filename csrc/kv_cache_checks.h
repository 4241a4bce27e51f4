// compact_kv_cache_'s argument rules, shared by its CPU glue (csrc/kv_cache.cpp) and CUDA
// glue (csrc/cuda/kv_cache.cu): metadata only. The path values (node ids, lengths) are the
// CPU kernel's to check (cpu::path_error), since only it can read them without a host sync.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <vector>

#include "checks.h"
#include "specdec/kv_cache.h"

namespace specdec {

// Checks the path arguments of `op` (compact_kv_cache_ or compact_kv_cache_paged_): int32
// accepted_nodes [B, T], cache_seqlens [B] and num_accepted [B], all on `device`, T within
// int32. Returns B.
inline int64_t check_compact_path_args(const char* op, const at::Tensor& cache_seqlens,
                                       const at::Tensor& accepted_nodes, const at::Tensor& num_accepted,
                                       const at::Device& device) {
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
  return batch;
}

// Checks what both compaction ops ask of one cache tensor `caches[index]` of `op`: 4-D
// (`layout` names the expected shape, for the message), on `device`, a contiguous last dim,
// and sizes the byte view holds in int32. Returns it as bytes: stride_b is the row stride of
// a dense [B, S, H, D] cache or the page stride of a [num_pages, page_size, H, D] pool, and
// seq_len is S or the page size. Any dtype is fine: entries are moved as bytes.
inline KvCacheView kv_cache_view(const char* op, size_t index, const at::Tensor& cache, const at::Device& device,
                                 const char* layout) {
  const std::string name = "caches[" + std::to_string(index) + "]";
  TORCH_CHECK(cache.dim() == 4, op, ": ", name, " must be a 4-D ", layout, " tensor, got shape ", cache.sizes());
  check_device(op, name.c_str(), cache, device);
  check_last_dim_contiguous(op, name.c_str(), cache);
  const int64_t element = cache.element_size();
  check_fits_int32(op, (name + ".size(1)").c_str(), cache.size(1));
  check_fits_int32(op, (name + ".size(2)").c_str(), cache.size(2));
  check_fits_int32(op, (name + ".size(3) * element size").c_str(), cache.size(3) * element);
  return KvCacheView{static_cast<char*>(cache.data_ptr()), cache.stride(0) * element, cache.stride(1) * element,
                     cache.stride(2) * element, static_cast<int32_t>(cache.size(1)),
                     static_cast<int32_t>(cache.size(2)), static_cast<int32_t>(cache.size(3) * element),
                     /*vec_bytes=*/0};
}

// Checks compact_kv_cache_'s arguments (all on `device`) and returns each cache as bytes.
// Node ids on the path are bounded by the cache (cache_seqlens[b] + node < S), not by
// accepted_nodes' width T: T only bounds the path's length (num_accepted < T).
inline std::vector<KvCacheView> compact_kv_cache_views(at::TensorList caches, const at::Tensor& cache_seqlens,
                                                       const at::Tensor& accepted_nodes,
                                                       const at::Tensor& num_accepted, const at::Device& device) {
  constexpr const char* op = "compact_kv_cache_";
  const int64_t batch = check_compact_path_args(op, cache_seqlens, accepted_nodes, num_accepted, device);

  std::vector<KvCacheView> views;
  views.reserve(caches.size());
  for (size_t i = 0; i < caches.size(); ++i) {
    views.push_back(kv_cache_view(op, i, caches[i], device, "[B, S, H, D]"));
    check_size(op, ("caches[" + std::to_string(i) + "]").c_str(), caches[i], 0, batch, "B (accepted_nodes.size(0))");
  }
  return views;
}

}  // namespace specdec
