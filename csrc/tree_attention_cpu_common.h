// What the CPU tree attention kernels (tree_attention.cpp and tree_attention_paged.cpp) share:
// filling the problem from the tensors, the work split and the threading. Both run the loops
// of include/specdec/tree_attention.h over the same units, and differ only in how rows are
// found (dense cache, or pages through a block table).
#pragma once

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <numeric>

#include "specdec/tree_attention.h"

namespace specdec {
namespace cpu_glue {

// Shortest key range worth a task of its own: below it, transposing the queries again and
// merging the partial results costs about what the extra thread saves.
constexpr int64_t kMinChunkKeys = 128;

// The calling thread's buffers for the kernel `Kernel` (a tag type of its file: each kernel
// keeps its own). Kept across calls: allocating them per call costs as much as a small call's
// work (large blocks come straight from mmap).
template <typename Kernel>
cpu::TreeAttentionScratch& thread_scratch() {
  static thread_local cpu::TreeAttentionScratch scratch;
  return scratch;
}

// How many threads at::parallel_for will really use. Under torch's OpenMP backend it is an
// inline `#pragma omp parallel` loop, which runs serially unless the including file is
// compiled with -fopenmp; splitting keys for threads that never come would only add work.
inline int64_t parallel_threads() {
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
  return 1;
#else
  return at::get_num_threads();
#endif
}

// Fills the fields of `p` that the dense and paged kernels share: q [B, T, Hq, D], k and v
// ([B, S, Hkv, D] caches, or [num_pages, page_size, Hkv, D] pools whose dim 0 is then the
// page stride), the tree mask (bool, or int64 packed), the prefix lengths and the output.
// Storage is the kernel's element type, TorchScalar the torch type it matches bit for bit.
// window (0: none) and softcap (0: none) as the op's schema takes them.
template <typename Storage, typename TorchScalar>
void fill_problem(cpu::TreeAttentionProblem<Storage>& p, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& tree_mask, const int32_t* lengths, double scale,
                  int64_t window, double softcap, at::Tensor& out) {
  static_assert(sizeof(Storage) == sizeof(TorchScalar), "storage type must match the torch type bit for bit");
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
  p.value_dim = v.size(3);
  p.scale = static_cast<float>(scale);
  p.window = window;
  p.softcap = static_cast<float>(softcap);
  p.out = reinterpret_cast<Storage*>(out.mutable_data_ptr<TorchScalar>());
}

// Runs problem `p` (a cpu::TreeAttentionProblem, dense or paged) for `batch` rows. One unit
// per (row, KV head), over keys first_key(b) .. num_keys(b) - 1 (all of them without a
// sliding window). With fewer units than threads to keep busy, each row's keys are split
// into `parts` equal ranges (merged afterwards), so that units * parts is a multiple of the
// thread count: at::parallel_for hands out equal contiguous blocks. Partial results are
// fp32 tensors with `options`' device. Kernel: the calling kernel's tag (its thread_scratch).
template <typename Kernel, typename Problem>
void run_split(const Problem& p, int64_t batch, const at::TensorOptions& options) {
  const int64_t units = batch * p.num_kv_heads;
  const int64_t threads = parallel_threads();
  int64_t max_keys = 0;
  for (int64_t b = 0; b < batch; ++b) max_keys = std::max(max_keys, p.num_keys(b) - p.first_key(b));
  int64_t parts = units >= 4 * threads ? 1 : threads / std::gcd(units, threads);
  parts = std::max<int64_t>(1, std::min(parts, max_keys / kMinChunkKeys));

  if (parts == 1) {
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      cpu::TreeAttentionScratch& scratch = thread_scratch<Kernel>();
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u / p.num_kv_heads;
        cpu::attend_keys(p, b, u % p.num_kv_heads, p.first_key(b), p.num_keys(b), scratch);
        cpu::write_output(p, b, u % p.num_kv_heads, scratch);
      }
    });
    return;
  }
  const int64_t chunk = (max_keys + parts - 1) / parts;
  const int64_t size = p.partial_size();
  at::Tensor partials = at::empty({units * parts * size}, options.dtype(at::kFloat));
  float* partial_data = partials.mutable_data_ptr<float>();
  at::parallel_for(0, units * parts, 1, [&](int64_t begin, int64_t end) {
    cpu::TreeAttentionScratch& scratch = thread_scratch<Kernel>();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t u = task / parts;
      const int64_t b = u / p.num_kv_heads;
      // A short row may leave its last ranges empty: max -inf, weight 0 in the merge.
      const int64_t first = std::min(p.num_keys(b), p.first_key(b) + (task % parts) * chunk);
      const int64_t last = std::min(p.num_keys(b), first + chunk);
      cpu::attend_keys(p, b, u % p.num_kv_heads, first, last, scratch);
      cpu::save_partial(p, scratch, partial_data + task * size);
    }
  });
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    cpu::TreeAttentionScratch& scratch = thread_scratch<Kernel>();
    for (int64_t u = begin; u < end; ++u) {
      cpu::combine_partials(p, u / p.num_kv_heads, u % p.num_kv_heads, partial_data + u * parts * size, parts, scratch);
    }
  });
}

}  // namespace cpu_glue
}  // namespace specdec
