// tree_attention's argument rules, shared by its CPU glue (csrc/tree_attention.cpp) and CUDA
// glue (csrc/cuda/tree_attention.cu): metadata only. Each backend adds its kernel's own
// limits (the CPU glue checks cache_seqlens' values, the CUDA glue head dims and grid sizes).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

#include "checks.h"

namespace specdec {

// Checks q [B, T, Hq, D], k_cache [B, S, Hkv, D], v_cache [B, S, Hkv, Dv] (q's dtype, Hq a
// multiple of Hkv; Dv may differ from D),
// tree_mask ([B, T, T] / [T, T] bool or [B, T, ceil(T/64)] / [T, ceil(T/64)] packed int64)
// and cache_seqlens (int32 [B]), all on `device`, each with a contiguous last dim where the
// kernels read rows. Returns the mask as [B, T, *]: a 2-D mask, shared by every row, is
// expanded (batch stride 0, no copy).
inline at::Tensor check_tree_attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                            const at::Tensor& tree_mask, const at::Tensor& cache_seqlens,
                                            const at::Device& device) {
  constexpr const char* op = "tree_attention";
  TORCH_CHECK(q.dim() == 4, op, ": q must be a 4-D [B, T, Hq, D] tensor, got shape ", q.sizes());
  check_float_dtype(op, "q", q);
  check_tensor(op, "k_cache", k_cache, 4, q.scalar_type());
  check_tensor(op, "v_cache", v_cache, 4, q.scalar_type());
  TORCH_CHECK(tree_mask.dim() == 2 || tree_mask.dim() == 3, op,
              ": tree_mask must be [B, T, T] / [T, T] (bool) or [B, T, W] / [T, W] (packed int64), got shape ",
              tree_mask.sizes());
  const bool packed = tree_mask.scalar_type() == at::kLong;
  TORCH_CHECK(packed || tree_mask.scalar_type() == at::kBool, op,
              ": tree_mask must have dtype bool or int64 (packed), got ", tree_mask.scalar_type());
  check_tensor(op, "cache_seqlens", cache_seqlens, 1, at::kInt);
  check_device(op, "q", q, device);
  check_device(op, "k_cache", k_cache, device);
  check_device(op, "v_cache", v_cache, device);
  check_device(op, "tree_mask", tree_mask, device);
  check_device(op, "cache_seqlens", cache_seqlens, device);

  const int64_t batch = q.size(0);
  const int64_t num_nodes = q.size(1);
  check_size(op, "k_cache", k_cache, 0, batch, "B (q.size(0))");
  check_size(op, "k_cache", k_cache, 3, q.size(3), "D (q.size(3))");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) &&
                  v_cache.size(2) == k_cache.size(2),
              op, ": v_cache must be [B, S, Hkv, Dv] with k_cache's B, S, Hkv ", k_cache.sizes(), ", got ",
              v_cache.sizes());
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_kv_heads > 0 && q.size(2) % num_kv_heads == 0, op, ": query heads (", q.size(2),
              ") must be a multiple of KV heads (", num_kv_heads, ")");
  const at::Tensor mask = tree_mask.dim() == 3 ? tree_mask : tree_mask.unsqueeze(0).expand({batch, -1, -1});
  check_size(op, "tree_mask", mask, 0, batch, "B (q.size(0))");
  check_size(op, "tree_mask", mask, 1, num_nodes, "T (q.size(1))");
  check_size(op, "tree_mask", mask, 2, packed ? (num_nodes + 63) / 64 : num_nodes,
             packed ? "ceil(T / 64) (packed words)" : "T (q.size(1))");
  check_size(op, "cache_seqlens", cache_seqlens, 0, batch, "B (q.size(0))");
  check_last_dim_contiguous(op, "q", q);
  check_last_dim_contiguous(op, "k_cache", k_cache);
  check_last_dim_contiguous(op, "v_cache", v_cache);
  return mask;
}

// window (a sliding window, 0: none) and softcap (0: none), shared by every tree attention glue.
inline void check_window_softcap(const char* op, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, op, ": window must be >= 1, or 0 for no sliding window, got ", window);
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), op,
              ": softcap must be a finite value > 0, or 0 for no soft-capping, got ", softcap);
}

}  // namespace specdec
