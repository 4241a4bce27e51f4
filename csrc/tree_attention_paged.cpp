// CPU kernel for tree_attention_paged (tree attention over paged KV caches): checks here, work
// split and threading in tree_attention_cpu_common.h (shared with tree_attention.cpp), loops in
// include/specdec/tree_attention.h (the dense kernel's, with rows found through the block table).
#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <type_traits>
#include <utility>

#include "checks_paged.h"
#include "tree_attention_checks.h"
#include "tree_attention_cpu_common.h"
#include "specdec/tree_attention.h"

namespace specdec {
namespace {

constexpr const char* kOp = "tree_attention_paged";

struct PagedKernel;  // tag of this kernel's thread_local scratch (cpu_glue::thread_scratch)

void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& tree_mask, const at::Tensor& cache_seqlens, const at::Tensor& block_table) {
  TORCH_CHECK(q.dim() == 4, kOp, ": q must be a 4-D [B, T, Hq, D] tensor, got shape ", q.sizes());
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kOp,
              ": q must have dtype float32, bfloat16 or float16, got ", dtype);
  check_tensor(kOp, "k_cache", k_cache, 4, dtype);
  check_tensor(kOp, "v_cache", v_cache, 4, dtype);
  TORCH_CHECK(tree_mask.dim() == 3, kOp,
              ": tree_mask must be a 3-D [B, T, T] bool or [B, T, ceil(T/64)] int64 tensor, got shape ",
              tree_mask.sizes());
  TORCH_CHECK(tree_mask.scalar_type() == at::kBool || tree_mask.scalar_type() == at::kLong, kOp,
              ": tree_mask must have dtype bool or int64 (packed), got ", tree_mask.scalar_type());
  check_tensor(kOp, "cache_seqlens", cache_seqlens, 1, at::kInt);
  const at::Device cpu(at::kCPU);
  check_device(kOp, "q", q, cpu);
  check_device(kOp, "k_cache", k_cache, cpu);
  check_device(kOp, "v_cache", v_cache, cpu);
  check_device(kOp, "tree_mask", tree_mask, cpu);
  check_device(kOp, "cache_seqlens", cache_seqlens, cpu);

  const int64_t batch = q.size(0);
  const int64_t num_nodes = q.size(1);
  check_block_table(kOp, block_table, batch, cpu);
  TORCH_CHECK(k_cache.size(0) >= 1 && k_cache.size(1) >= 1, kOp,
              ": k_cache must be a [num_pages, page_size, Hkv, D] pool with at least one page of at least one slot, "
              "got shape ",
              k_cache.sizes());
  check_size(kOp, "k_cache", k_cache, 3, q.size(3), "D (q.size(3))");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) &&
                  v_cache.size(2) == k_cache.size(2),
              kOp, ": v_cache must be a [num_pages, page_size, Hkv, Dv] pool with k_cache's first three dims ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_kv_heads > 0 && q.size(2) % num_kv_heads == 0, kOp, ": query heads (", q.size(2),
              ") must be a multiple of KV heads (", num_kv_heads, ")");
  const int64_t mask_cols = tree_mask.scalar_type() == at::kBool ? num_nodes : (num_nodes + 63) / 64;
  check_size(kOp, "tree_mask", tree_mask, 0, batch, "B (q.size(0))");
  check_size(kOp, "tree_mask", tree_mask, 1, num_nodes, "T (q.size(1))");
  check_size(kOp, "tree_mask", tree_mask, 2, mask_cols, tree_mask.scalar_type() == at::kBool ? "T" : "ceil(T / 64)");
  check_size(kOp, "cache_seqlens", cache_seqlens, 0, batch, "B (q.size(0))");
  const std::pair<const char*, const at::Tensor*> tensors[] = {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}};
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(t->stride(3) == 1 || t->size(3) <= 1, kOp, ": ", name,
                " needs a contiguous last dim (stride 1), got strides ", t->strides());
  }
}

template <typename Storage, typename TorchScalar>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tree_mask,
         const int32_t* lengths, const at::Tensor& table, double scale, int64_t window, double softcap,
         at::Tensor& out) {
  cpu::TreeAttentionProblem<Storage> p;
  cpu_glue::fill_problem<Storage, TorchScalar>(p, q, k, v, tree_mask, lengths, scale, window, softcap, out);
  p.block_table = table.const_data_ptr<int32_t>();
  p.block_table_stride = table.stride(0);
  p.page_size = k.size(1);
  if ((p.page_size & (p.page_size - 1)) == 0) {
    p.page_shift = 0;
    while ((int64_t{1} << p.page_shift) < p.page_size) ++p.page_shift;
  }

  // The same split as the dense kernel (tree_attention_cpu_common.h): tiles follow row
  // pointers across page ends, so ranges need no alignment to pages.
  cpu_glue::run_split<PagedKernel>(p, q.size(0), q.options());
}

at::Tensor tree_attention_paged_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& tree_mask, const at::Tensor& cache_seqlens,
                                    const at::Tensor& block_table, double scale, int64_t window, double softcap) {
  check_inputs(q, k_cache, v_cache, tree_mask, cache_seqlens, block_table);
  check_window_softcap(kOp, window, softcap);
  // [B, T, Hq, Dv], contiguous like every backend
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v_cache.size(3)}, q.options());
  if (out.numel() == 0) return out;
  // The kernel reads every position below L_b + T through the table, so each page id it
  // will use is checked here (about (L_b + T) / page_size reads per row).
  const at::Tensor lengths = cache_seqlens.contiguous();
  const at::Tensor table = block_table.contiguous();
  const int32_t* length_data = lengths.const_data_ptr<int32_t>();
  check_block_table_pages(kOp, table.const_data_ptr<int32_t>(), table.stride(0), table.size(1), length_data, q.size(0),
                          q.size(1), k_cache.size(1), k_cache.size(0));
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float, float>(q, k_cache, v_cache, tree_mask, length_data, table, scale, window, softcap, out);
      break;
    case at::kBFloat16:
      run<cpu::BFloat16Bits, at::BFloat16>(q, k_cache, v_cache, tree_mask, length_data, table, scale, window, softcap,
                                           out);
      break;
    default:
      run<cpu::HalfBits, at::Half>(q, k_cache, v_cache, tree_mask, length_data, table, scale, window, softcap, out);
      break;
  }
  return out;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("tree_attention_paged", &specdec::tree_attention_paged_cpu); }
