// CPU kernel for compact_kv_cache_paged_ (compaction of paged caches): checks and threading
// here, the move in include/specdec/kv_cache.h (compact_row_paged).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "checks_paged.h"
#include "specdec/kv_cache.h"

namespace specdec {
namespace {

at::Tensor compact_kv_cache_paged_cpu(at::TensorList caches, const at::Tensor& cache_seqlens,
                                      const at::Tensor& accepted_nodes, const at::Tensor& num_accepted,
                                      const at::Tensor& block_table) {
  constexpr const char* op = "compact_kv_cache_paged_";
  const std::vector<KvCacheView> views = compact_kv_cache_paged_views(caches, cache_seqlens, accepted_nodes,
                                                                      num_accepted, block_table, at::Device(at::kCPU));
  const int64_t batch = accepted_nodes.size(0);
  const int32_t num_nodes = static_cast<int32_t>(accepted_nodes.size(1));
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const at::Tensor nodes = accepted_nodes.contiguous();
  const at::Tensor accepted = num_accepted.contiguous();
  const at::Tensor table = block_table.contiguous();
  const int32_t* seqlens_data = seqlens.const_data_ptr<int32_t>();
  const int32_t* nodes_data = nodes.const_data_ptr<int32_t>();
  const int32_t* accepted_data = accepted.const_data_ptr<int32_t>();
  const int32_t* table_data = table.const_data_ptr<int32_t>();
  const int64_t num_cols = table.size(1);
  at::Tensor new_seqlens = cache_seqlens.new_empty({batch});
  int32_t* new_data = new_seqlens.mutable_data_ptr<int32_t>();

  int64_t scratch_bytes = 0;
  int64_t num_pages = std::numeric_limits<int64_t>::max();
  for (size_t i = 0; i < views.size(); ++i) {
    scratch_bytes = std::max(scratch_bytes, cpu::compact_scratch_bytes(views[i], num_nodes));
    num_pages = std::min(num_pages, caches[i].size(0));
  }
  const int64_t page_size = caches.empty() ? 1 : caches[0].size(1);
  // Each row's logical capacity is its table row: P pages.
  const int64_t capacity = std::min<int64_t>(num_cols * page_size, std::numeric_limits<int32_t>::max());

  // Every row is checked before any slot moves, so bad input never leaves the caches half
  // compacted: the path (as for dense caches) and the page ids of every position it may touch.
  for (int64_t b = 0; b < batch; ++b) {
    const char* error = cpu::path_error(seqlens_data[b], nodes_data + b * num_nodes, accepted_data[b], num_nodes,
                                        static_cast<int32_t>(capacity));
    TORCH_CHECK(error == nullptr, op, ": batch row ", b, ": ", error, " (cache_seqlens = ", seqlens_data[b],
                ", num_accepted = ", accepted_data[b], ", T = ", num_nodes, ", block_table capacity = ", capacity,
                ")");
    // Paged paths also stay inside the tree (node < T, as the Python checks and the CUDA
    // kernel require): the page ids are checked below only for positions before
    // cache_seqlens + T, so a node past the tree would read an unchecked page.
    const int32_t last = nodes_data[b * num_nodes + accepted_data[b]];  // the path's largest node
    TORCH_CHECK(last < num_nodes, op, ": batch row ", b, ": accepted_nodes has node ", last,
                " outside the tree [0, T = ", num_nodes, ")");
  }
  if (!caches.empty()) {
    check_block_table_pages(op, table_data, num_cols, num_cols, seqlens_data, batch, num_nodes, page_size, num_pages);
  }
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> scratch(static_cast<size_t>(scratch_bytes));
    for (int64_t b = begin; b < end; ++b) {
      const int32_t* path = nodes_data + b * num_nodes;
      for (const KvCacheView& view : views) {
        cpu::compact_row_paged(view, table_data + b * num_cols, seqlens_data[b], path, accepted_data[b] + 1,
                               scratch.data());
      }
      new_data[b] = seqlens_data[b] + accepted_data[b] + 1;
    }
  });
  return new_seqlens;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("compact_kv_cache_paged_", &specdec::compact_kv_cache_paged_cpu); }
