// CPU kernel for compact_kv_cache_: checks and threading here, the move in
// include/specdec/kv_cache.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "kv_cache_checks.h"
#include "specdec/kv_cache.h"

namespace specdec {
namespace {

at::Tensor compact_kv_cache_cpu(at::TensorList caches, const at::Tensor& cache_seqlens,
                                const at::Tensor& accepted_nodes, const at::Tensor& num_accepted) {
  const std::vector<KvCacheView> views =
      compact_kv_cache_views(caches, cache_seqlens, accepted_nodes, num_accepted, at::Device(at::kCPU));
  const int64_t batch = accepted_nodes.size(0);
  const int32_t num_nodes = static_cast<int32_t>(accepted_nodes.size(1));
  // The small index tensors are copied only if a caller passed a strided view.
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const at::Tensor nodes = accepted_nodes.contiguous();
  const at::Tensor accepted = num_accepted.contiguous();
  const int32_t* seqlens_data = seqlens.const_data_ptr<int32_t>();
  const int32_t* nodes_data = nodes.const_data_ptr<int32_t>();
  const int32_t* accepted_data = accepted.const_data_ptr<int32_t>();
  at::Tensor new_seqlens = cache_seqlens.new_empty({batch});
  int32_t* new_data = new_seqlens.mutable_data_ptr<int32_t>();

  int32_t min_seq_len = std::numeric_limits<int32_t>::max();
  int64_t scratch_bytes = 0;
  for (const KvCacheView& view : views) {
    min_seq_len = std::min(min_seq_len, view.seq_len);
    scratch_bytes = std::max(scratch_bytes, cpu::compact_scratch_bytes(view, num_nodes));
  }

  // Every row is checked before any slot moves, so bad input never leaves the caches half
  // compacted (O(B * T) index reads: nothing next to the move itself).
  for (int64_t b = 0; b < batch; ++b) {
    const char* error =
        cpu::path_error(seqlens_data[b], nodes_data + b * num_nodes, accepted_data[b], num_nodes, min_seq_len);
    TORCH_CHECK(error == nullptr, "compact_kv_cache_: batch row ", b, ": ", error, " (cache_seqlens = ",
                seqlens_data[b], ", num_accepted = ", accepted_data[b], ", T = ", num_nodes, ", S = ", min_seq_len,
                ")");
  }
  // Batch rows touch disjoint cache slots, so threads split the batch; each thread moves
  // its rows in every cache.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> scratch(static_cast<size_t>(scratch_bytes));
    for (int64_t b = begin; b < end; ++b) {
      const int32_t* path = nodes_data + b * num_nodes;
      for (const KvCacheView& view : views) {
        cpu::compact_row(view, b, seqlens_data[b], path, accepted_data[b] + 1, scratch.data());
      }
      new_data[b] = seqlens_data[b] + accepted_data[b] + 1;
    }
  });
  return new_seqlens;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("compact_kv_cache_", &specdec::compact_kv_cache_cpu); }
