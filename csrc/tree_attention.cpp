// CPU kernel for tree_attention: checks, work split and threading here, loops in
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
#include "specdec/tree_attention.h"

namespace specdec {
namespace {

constexpr const char* kOp = "tree_attention";
// Shortest key range worth a task of its own: below it, transposing the queries again and
// merging the partial results costs about what the extra thread saves.
constexpr int64_t kMinChunkKeys = 128;

// Each thread keeps its buffers across calls: allocating them per call costs as much as a
// small call's work (large blocks come straight from mmap).
cpu::TreeAttentionScratch& thread_scratch() {
  static thread_local cpu::TreeAttentionScratch scratch;
  return scratch;
}

// How many threads at::parallel_for will really use. Under torch's OpenMP backend it is an
// inline `#pragma omp parallel` loop, which runs serially unless this file is compiled
// with -fopenmp; splitting keys for threads that never come would only add work.
int64_t parallel_threads() {
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
  return 1;
#else
  return at::get_num_threads();
#endif
}

template <typename Storage, typename TorchScalar>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tree_mask,
         const int32_t* lengths, double scale, at::Tensor& out) {
  static_assert(sizeof(Storage) == sizeof(TorchScalar), "storage type must match the torch type bit for bit");
  cpu::TreeAttentionProblem<Storage> p;
  p.q = reinterpret_cast<const Storage*>(q.const_data_ptr<TorchScalar>());
  p.q_stride_b = q.stride(0);
  p.q_stride_t = q.stride(1);
  p.q_stride_h = q.stride(2);
  p.k = reinterpret_cast<const Storage*>(k.const_data_ptr<TorchScalar>());
  p.k_stride_b = k.stride(0);
  p.k_stride_s = k.stride(1);
  p.k_stride_h = k.stride(2);
  p.v = reinterpret_cast<const Storage*>(v.const_data_ptr<TorchScalar>());
  p.v_stride_b = v.stride(0);
  p.v_stride_s = v.stride(1);
  p.v_stride_h = v.stride(2);
  if (tree_mask.scalar_type() == at::kBool) {
    p.mask.dense = tree_mask.const_data_ptr<bool>();
  } else {
    p.mask.packed = tree_mask.const_data_ptr<int64_t>();
  }
  p.mask.stride_b = tree_mask.stride(0);
  p.mask.stride_t = tree_mask.stride(1);
  p.mask.stride_col = tree_mask.stride(2);
  p.cache_seqlens = lengths;
  p.num_nodes = q.size(1);
  p.num_q_heads = q.size(2);
  p.num_kv_heads = k.size(2);
  p.head_dim = q.size(3);
  p.scale = static_cast<float>(scale);
  p.out = reinterpret_cast<Storage*>(out.mutable_data_ptr<TorchScalar>());

  // One unit per (row, KV head). With fewer units than threads to keep busy, split each
  // row's keys into `parts` equal ranges (merged afterwards), so that units * parts is a
  // multiple of the thread count: at::parallel_for hands out equal contiguous blocks.
  const int64_t batch = q.size(0);
  const int64_t units = batch * p.num_kv_heads;
  const int64_t threads = parallel_threads();
  int64_t max_keys = 0;
  for (int64_t b = 0; b < batch; ++b) max_keys = std::max(max_keys, p.num_keys(b));
  int64_t parts = units >= 4 * threads ? 1 : threads / std::gcd(units, threads);
  parts = std::max<int64_t>(1, std::min(parts, max_keys / kMinChunkKeys));

  if (parts == 1) {
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      cpu::TreeAttentionScratch& scratch = thread_scratch();
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u / p.num_kv_heads;
        cpu::attend_keys(p, b, u % p.num_kv_heads, 0, p.num_keys(b), scratch);
        cpu::write_output(p, b, u % p.num_kv_heads, scratch);
      }
    });
    return;
  }
  const int64_t chunk = (max_keys + parts - 1) / parts;
  const int64_t size = p.partial_size();
  at::Tensor partials = at::empty({units * parts * size}, q.options().dtype(at::kFloat));
  float* partial_data = partials.mutable_data_ptr<float>();
  at::parallel_for(0, units * parts, 1, [&](int64_t begin, int64_t end) {
    cpu::TreeAttentionScratch& scratch = thread_scratch();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t u = task / parts;
      const int64_t b = u / p.num_kv_heads;
      // A short row may leave its last ranges empty: max -inf, weight 0 in the merge.
      const int64_t first = std::min(p.num_keys(b), (task % parts) * chunk);
      const int64_t last = std::min(p.num_keys(b), first + chunk);
      cpu::attend_keys(p, b, u % p.num_kv_heads, first, last, scratch);
      cpu::save_partial(p, scratch, partial_data + task * size);
    }
  });
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    cpu::TreeAttentionScratch& scratch = thread_scratch();
    for (int64_t u = begin; u < end; ++u) {
      cpu::combine_partials(p, u / p.num_kv_heads, u % p.num_kv_heads, partial_data + u * parts * size, parts, scratch);
    }
  });
}

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& tree_mask, const at::Tensor& cache_seqlens, double scale) {
  const at::Tensor mask =
      check_tree_attention_args(q, k_cache, v_cache, tree_mask, cache_seqlens, at::Device(at::kCPU));
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, like every backend
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
    case at::kFloat: run<float, float>(q, k_cache, v_cache, mask, length_data, scale, out); break;
    case at::kBFloat16:
      run<cpu::BFloat16Bits, at::BFloat16>(q, k_cache, v_cache, mask, length_data, scale, out);
      break;
    default: run<cpu::HalfBits, at::Half>(q, k_cache, v_cache, mask, length_data, scale, out); break;
  }
  return out;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("tree_attention", &specdec::tree_attention_cpu); }
