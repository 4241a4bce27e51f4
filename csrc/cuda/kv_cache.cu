// CUDA glue for compact_kv_cache_: checks, cache views, current stream; the kernel is in
// include/specdec/kv_cache.cuh. One launch moves every cache; no host sync.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "kv_cache_checks.h"
#include "specdec/kv_cache.cuh"

namespace specdec {
namespace {

at::Tensor compact_kv_cache_cuda(at::TensorList caches, const at::Tensor& cache_seqlens,
                                 const at::Tensor& accepted_nodes, const at::Tensor& num_accepted) {
  TORCH_CHECK(cache_seqlens.is_cuda(), "compact_kv_cache_: cache_seqlens must be a CUDA tensor, got ",
              cache_seqlens.device());
  const std::vector<KvCacheView> views =
      compact_kv_cache_views(caches, cache_seqlens, accepted_nodes, num_accepted, cache_seqlens.device());
  const int64_t batch = accepted_nodes.size(0);
  TORCH_CHECK(batch <= cuda::kCompactMaxBatch, "compact_kv_cache_: batch size ", batch, " exceeds ",
              cuda::kCompactMaxBatch, " (one grid row per batch row)");
  const c10::cuda::CUDAGuard guard(cache_seqlens.device());
  // The small index tensors are copied (asynchronously) only if a caller passed a strided view.
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const at::Tensor nodes = accepted_nodes.contiguous();
  const at::Tensor accepted = num_accepted.contiguous();
  at::Tensor new_seqlens = cache_seqlens.new_empty({batch});
  C10_CUDA_CHECK(cuda::launch_compact_kv_cache(
      views.data(), static_cast<int64_t>(views.size()), seqlens.const_data_ptr<int32_t>(),
      nodes.const_data_ptr<int32_t>(), accepted.const_data_ptr<int32_t>(), batch,
      static_cast<int32_t>(accepted_nodes.size(1)), new_seqlens.mutable_data_ptr<int32_t>(),
      c10::cuda::getCurrentCUDAStream()));
  return new_seqlens;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CUDA, m) { m.impl("compact_kv_cache_", &specdec::compact_kv_cache_cuda); }
