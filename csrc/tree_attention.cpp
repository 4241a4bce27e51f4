// CPU kernel for tree_attention: checks here, work split and threading in
// tree_attention_cpu_common.h (shared with tree_attention_paged.cpp), loops in
// include/specdec/tree_attention.h.
#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>

#include "tree_attention_checks.h"
#include "tree_attention_cpu_common.h"
#include "specdec/tree_attention.h"

namespace specdec {
namespace {

constexpr const char* kOp = "tree_attention";

struct DenseKernel;  // tag of this kernel's thread_local scratch (cpu_glue::thread_scratch)

template <typename Storage, typename TorchScalar>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tree_mask,
         const int32_t* lengths, double scale, int64_t window, double softcap, at::Tensor& out) {
  cpu::TreeAttentionProblem<Storage> p;
  cpu_glue::fill_problem<Storage, TorchScalar>(p, q, k, v, tree_mask, lengths, scale, window, softcap, out);
  cpu_glue::run_split<DenseKernel>(p, q.size(0), q.options());
}

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& tree_mask, const at::Tensor& cache_seqlens, double scale,
                              int64_t window, double softcap) {
  const at::Tensor mask =
      check_tree_attention_args(q, k_cache, v_cache, tree_mask, cache_seqlens, at::Device(at::kCPU));
  check_window_softcap(kOp, window, softcap);
  // [B, T, Hq, Dv], contiguous like every backend
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v_cache.size(3)}, q.options());
  if (out.numel() == 0) return out;
  // The kernel reads keys up to L_b + T - 1, so the bounds are checked here (B reads).
  const at::Tensor lengths = cache_seqlens.contiguous();
  const int32_t* length_data = lengths.const_data_ptr<int32_t>();
  const int64_t cache_len = k_cache.size(1);
  const int64_t num_nodes = q.size(1);
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(length_data[b] >= 0 && length_data[b] + num_nodes <= cache_len, kOp, ": cache_seqlens[", b,
                "] = ", length_data[b], "; the prefix + T=", num_nodes, " tree entries must fit in the cache (S=",
                cache_len, ")");
  }
  switch (q.scalar_type()) {
    case at::kFloat: run<float, float>(q, k_cache, v_cache, mask, length_data, scale, window, softcap, out); break;
    case at::kBFloat16:
      run<cpu::BFloat16Bits, at::BFloat16>(q, k_cache, v_cache, mask, length_data, scale, window, softcap, out);
      break;
    default:
      run<cpu::HalfBits, at::Half>(q, k_cache, v_cache, mask, length_data, scale, window, softcap, out);
      break;
  }
  return out;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("tree_attention", &specdec::tree_attention_cpu); }
