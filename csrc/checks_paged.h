// Input checks of the paged-cache ops (tree_attention_paged, compact_kv_cache_paged_), shared
// by the CPU and CUDA glue: metadata only, like checks.h. A paged cache is a pool of pages
// [num_pages, page_size, H, D]; block_table int32 [B, P] lists each row's pages.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <vector>

#include "checks.h"
#include "kv_cache_checks.h"
#include "specdec/kv_cache.h"

namespace specdec {

inline void check_block_table(const char* op, const at::Tensor& block_table, int64_t batch, const at::Device& device) {
  check_tensor(op, "block_table", block_table, 2, at::kInt);
  check_device(op, "block_table", block_table, device);
  check_size(op, "block_table", block_table, 0, batch, "B");
  TORCH_CHECK(block_table.size(1) >= 1, op, ": block_table needs at least one page column, got shape ",
              block_table.sizes());
}

// Host-side values (CPU tensors only): row b's first ceil(num_tokens_b / page_size) entries
// exist and are page ids in [0, num_pages), num_tokens_b = cache_seqlens[b] + num_nodes.
inline void check_block_table_pages(const char* op, const int32_t* table, int64_t table_stride, int64_t num_cols,
                                    const int32_t* seqlens, int64_t batch, int64_t num_nodes, int64_t page_size,
                                    int64_t num_pages) {
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(seqlens[b] >= 0, op, ": cache_seqlens[", b, "] = ", seqlens[b], " is negative");
    const int64_t tokens = static_cast<int64_t>(seqlens[b]) + num_nodes;
    const int64_t pages = (tokens + page_size - 1) / page_size;
    TORCH_CHECK(pages <= num_cols, op, ": block_table row ", b, " needs ", pages, " pages of ", page_size,
                " slots for cache_seqlens[b] + T = ", tokens, " tokens, but has ", num_cols, " columns");
    for (int64_t j = 0; j < pages; ++j) {
      const int32_t page = table[b * table_stride + j];
      TORCH_CHECK(page >= 0 && page < num_pages, op, ": block_table[", b, ", ", j, "] = ", page,
                  " is not a page id in [0, ", num_pages, ")");
    }
  }
}

// Checks compact_kv_cache_paged_'s arguments (all on `device`) and returns each cache as
// bytes, with stride_b = the page stride and seq_len = the page size (shared by all caches).
inline std::vector<KvCacheView> compact_kv_cache_paged_views(at::TensorList caches, const at::Tensor& cache_seqlens,
                                                             const at::Tensor& accepted_nodes,
                                                             const at::Tensor& num_accepted,
                                                             const at::Tensor& block_table, const at::Device& device) {
  constexpr const char* op = "compact_kv_cache_paged_";
  const int64_t batch = check_compact_path_args(op, cache_seqlens, accepted_nodes, num_accepted, device);
  check_block_table(op, block_table, batch, device);

  std::vector<KvCacheView> views;
  views.reserve(caches.size());
  for (size_t i = 0; i < caches.size(); ++i) {
    const at::Tensor& cache = caches[i];
    views.push_back(kv_cache_view(op, i, cache, device, "[num_pages, page_size, H, D]"));
    TORCH_CHECK(cache.size(0) >= 1 && cache.size(1) >= 1, op, ": caches[", i,
                "] must hold at least one page of at least one slot, got shape ", cache.sizes());
    TORCH_CHECK(cache.size(1) == caches[0].size(1), op, ": caches[", i, "] has page size ", cache.size(1),
                "; every cache shares the block table, so its page size (", caches[0].size(1), ")");
  }
  return views;
}

}  // namespace specdec
