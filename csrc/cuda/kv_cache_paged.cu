// CUDA glue for compact_kv_cache_paged_ (compaction of paged caches): checks, cache views,
// current stream; the kernel is in include/specdec/kv_cache.cuh. One launch moves every
// cache; no host sync (page ids are validated by Python; the kernel skips bad ones). NOT YET
// RUN ON A GPU: it compiles (tools/compile_check.sh) and python_tests/test_paged.py has its
// GPU tests.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "checks_paged.h"
#include "specdec/kv_cache.cuh"

namespace specdec {
namespace {

at::Tensor compact_kv_cache_paged_cuda(at::TensorList caches, const at::Tensor& cache_seqlens,
                                       const at::Tensor& accepted_nodes, const at::Tensor& num_accepted,
                                       const at::Tensor& block_table) {
  constexpr const char* op = "compact_kv_cache_paged_";
  TORCH_CHECK(cache_seqlens.is_cuda(), op, ": cache_seqlens must be a CUDA tensor, got ", cache_seqlens.device());
  const std::vector<KvCacheView> views = compact_kv_cache_paged_views(caches, cache_seqlens, accepted_nodes,
                                                                      num_accepted, block_table, cache_seqlens.device());
  const int64_t batch = accepted_nodes.size(0);
  TORCH_CHECK(batch <= cuda::kCompactMaxBatch, op, ": batch size ", batch, " exceeds ", cuda::kCompactMaxBatch,
              " (one grid row per batch row)");
  int64_t num_pages = std::numeric_limits<int32_t>::max();
  for (const at::Tensor& cache : caches) num_pages = std::min(num_pages, cache.size(0));
  const c10::cuda::CUDAGuard guard(cache_seqlens.device());
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const at::Tensor nodes = accepted_nodes.contiguous();
  const at::Tensor accepted = num_accepted.contiguous();
  const at::Tensor table = block_table.contiguous();
  at::Tensor new_seqlens = cache_seqlens.new_empty({batch});
  C10_CUDA_CHECK(cuda::launch_compact_kv_cache_paged(
      views.data(), static_cast<int64_t>(views.size()), seqlens.const_data_ptr<int32_t>(),
      nodes.const_data_ptr<int32_t>(), accepted.const_data_ptr<int32_t>(), batch,
      static_cast<int32_t>(accepted_nodes.size(1)), table.const_data_ptr<int32_t>(), table.stride(0), table.size(1),
      static_cast<int32_t>(num_pages), new_seqlens.mutable_data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream()));
  return new_seqlens;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CUDA, m) { m.impl("compact_kv_cache_paged_", &specdec::compact_kv_cache_paged_cuda); }
