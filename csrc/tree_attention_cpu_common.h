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
#include <vector>

#include "specdec/tree_attention.h"

namespace specdec {
namespace cpu_glue {

// Shortest key range worth a task of its own: below it, transposing the queries again and
// merging the partial results costs about what the extra thread saves.
constexpr int64_t kMinChunkKeys = 128;

// The calling thread's buffers for the kernel `Kernel` (a tag type of its file: each kernel
// keeps its own), at least `count` of them (one per KV head on the all-heads path, else one).
// Kept across calls: allocating them per call costs as much as a small call's work (large
// blocks come straight from mmap).
template <typename Kernel>
cpu::TreeAttentionScratch* thread_scratch(int64_t count = 1) {
  static thread_local std::vector<cpu::TreeAttentionScratch> scratch;
  if (static_cast<int64_t>(scratch.size()) < count) scratch.resize(count);
  return scratch.data();
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
  p.mask.chain = cpu::is_causal_chain(p.mask, q.size(0), q.size(1));
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

// Queries x KV heads per row up to which a task takes every KV head of its row (the
// all-heads path of run_split): each head keeps its own scratch (queries, scores,
// accumulators and two key / value tiles: ~70 KB at 48 queries and D = 64), and all of them
// should stay in L2 together (192 rows: ~240 KB for 3 heads of 64).
constexpr int64_t kAllHeadsMaxRows = 192;

// Where range `part` of `parts` of row b's keys begins (part = parts: where the last ends) on a
// causal chain (p.mask.chain): equal shares of the key x query work rather than of the keys, as
// attend_tile skips the queries that come before a tree key (for a prefill chunk with no prefix
// the first half of the keys holds three quarters of the work). A prefix key counts T queries,
// tree node n T - n.
template <typename Problem>
int64_t chain_range_start(const Problem& p, int64_t b, int64_t part, int64_t parts) {
  const int64_t nodes = p.num_nodes, first = p.first_key(b), prefix = p.cache_seqlens[b];
  const int64_t prefix_work = (prefix - first) * nodes;
  int64_t work = (prefix_work + nodes * (nodes + 1) / 2) * part / parts;
  if (work <= prefix_work) return first + work / std::max<int64_t>(nodes, 1);
  work -= prefix_work;
  int64_t node = 0;
  while (node < nodes && work >= nodes - node) work -= nodes - node++;
  return prefix + node;
}

// Runs problem `p` (a cpu::TreeAttentionProblem, dense or paged) for `batch` rows, over keys
// first_key(b) .. num_keys(b) - 1 of each row (all of them without a sliding window).
//
// The work is split into tasks of one row's keys, or of a range of them (`parts` equal ranges
// per row, merged afterwards by log-sum-exp) where there are too few rows to keep the threads
// busy; at::parallel_for hands out equal contiguous blocks of tasks, so the task count is made
// a multiple of the thread count where it can be. Ranges are at least kMinChunkKeys long. A
// task covers every KV head of its row (the all-heads path: each tile of keys is one
// contiguous read) where the queries x KV heads are at most kAllHeadsMaxRows and the row tasks
// alone keep every thread busy; otherwise each task is one (row, KV head) unit (prefill chunks,
// or a short row, whose heads are the only work to split). Partial results are fp32 tensors
// with `options`' device. Kernel: the calling kernel's tag (its thread_scratch).
template <typename Kernel, typename Problem>
void run_split(const Problem& p, int64_t batch, const at::TensorOptions& options) {
  const int64_t threads = parallel_threads();
  int64_t max_keys = 0;
  for (int64_t b = 0; b < batch; ++b) max_keys = std::max(max_keys, p.num_keys(b) - p.first_key(b));
  // Ranges per task unit, for `units` units.
  auto parts_for = [&](int64_t units) {
    const int64_t parts = units >= 4 * threads ? 1 : threads / std::gcd(units, threads);
    return std::max<int64_t>(1, std::min(parts, max_keys / kMinChunkKeys));
  };
  const bool all_heads = p.rows() * p.num_kv_heads <= kAllHeadsMaxRows && batch * parts_for(batch) >= threads;
  const int64_t heads_per_task = all_heads ? p.num_kv_heads : 1;
  const int64_t units = batch * p.num_kv_heads / heads_per_task;  // a unit: a row, or a (row, KV head)
  const int64_t parts = parts_for(units);
  const int64_t chunk = (max_keys + parts - 1) / parts;
  const int64_t size = p.partial_size();
  at::Tensor partials;
  float* partial_data = nullptr;
  if (parts > 1) {
    partials = at::empty({batch * p.num_kv_heads * parts * size}, options.dtype(at::kFloat));
    partial_data = partials.mutable_data_ptr<float>();
  }
  at::parallel_for(0, units * parts, 1, [&](int64_t begin, int64_t end) {
    cpu::TreeAttentionScratch* scratch = thread_scratch<Kernel>(heads_per_task);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t u = task / parts, part = task % parts;
      const int64_t b = u * heads_per_task / p.num_kv_heads;
      const int64_t head0 = u * heads_per_task % p.num_kv_heads;
      // A short row may leave its last ranges empty: max -inf, weight 0 in the merge.
      int64_t first = std::min(p.num_keys(b), p.first_key(b) + part * chunk);
      int64_t last = std::min(p.num_keys(b), first + chunk);
      if (p.mask.chain && parts > 1) {
        first = chain_range_start(p, b, part, parts);
        last = chain_range_start(p, b, part + 1, parts);
      }
      if (all_heads) {
        cpu::attend_keys_all_heads(p, b, first, last, scratch);
      } else {
        cpu::attend_keys(p, b, head0, first, last, scratch[0]);
      }
      for (int64_t h = 0; h < heads_per_task; ++h) {
        const int64_t head = head0 + h;  // (partials: [row][KV head][part])
        if (parts > 1) {
          cpu::save_partial(p, scratch[h], partial_data + ((b * p.num_kv_heads + head) * parts + part) * size);
        } else {
          cpu::write_output(p, b, head, scratch[h]);
        }
      }
    }
  });
  if (parts == 1) return;
  at::parallel_for(0, batch * p.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    cpu::TreeAttentionScratch& scratch = *thread_scratch<Kernel>();
    for (int64_t u = begin; u < end; ++u) {
      cpu::combine_partials(p, u / p.num_kv_heads, u % p.num_kv_heads, partial_data + u * parts * size, parts, scratch);
    }
  });
}

}  // namespace cpu_glue
}  // namespace specdec
