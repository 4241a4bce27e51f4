// KV-cache compaction after verification on NVIDIA GPUs: kernel and launcher, no torch.
//
// Every layer's keys and values move in one launch: the cache views travel by value in the
// kernel parameters (no device buffer to fill, so it needs no host sync and captures into
// CUDA graphs as is). 256 views take 12 KiB, which needs the large kernel parameters of
// CUDA >= 12.1 on sm_70+; more than 256 caches take one launch per 256. Caches are moved
// concurrently, so no two of them may share memory (pass each tensor once).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kv_cache.h"

namespace specdec {
namespace cuda {

constexpr int kCompactThreads = 128;
constexpr int kCompactMaxCaches = 256;  // caches per launch: 128 layers of keys and values
constexpr int kCompactPathChunk = 8;    // path rows a thread holds in registers at once

template <int kMaxCaches>
struct CompactParams {
  KvCacheView caches[kMaxCaches];
  int32_t num_caches;
};

// One thread moves one Vec-sized column slice of row b's accepted path in one cache. Node
// ids are bounded by the cache (0 <= node < node_limit = S - prefix), not by T.
// It loads up to kChunk path rows into registers before storing any, so a path of up to
// kChunk nodes (the usual case) is gathered completely before anything is written, for any
// path. Longer paths go chunk by chunk in path order, which is still exact for every real
// tree path: its node ids increase strictly (each node follows its parent), so node j is
// >= j and every later source lies past every destination already written.
template <typename Vec, int kChunk>
__device__ __forceinline__ void move_path(const KvCacheView& cache, int64_t b, int32_t prefix,
                                          const int32_t* __restrict__ path, int32_t path_len, int32_t node_limit) {
  const int64_t vecs_per_head = cache.head_bytes / static_cast<int32_t>(sizeof(Vec));
  const int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (v >= vecs_per_head * cache.heads) return;
  char* tree = cache.data + b * cache.stride_b + prefix * cache.stride_s + (v / vecs_per_head) * cache.stride_h +
               (v % vecs_per_head) * static_cast<int64_t>(sizeof(Vec));
  for (int32_t first = 0; first < path_len; first += kChunk) {
    Vec rows[kChunk];
    int32_t nodes[kChunk];
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const int32_t j = first + k;
      nodes[k] = j < path_len ? __ldg(path + j) : j;
      // A node already in place needs no move (every node of an accepted chain); a node id
      // outside the cache ([0, S - prefix)) is skipped too, since the kernel cannot raise.
      if (nodes[k] < 0 || nodes[k] >= node_limit) nodes[k] = j;
      if (nodes[k] != j) rows[k] = *reinterpret_cast<const Vec*>(tree + nodes[k] * cache.stride_s);
    }
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const int32_t j = first + k;
      if (nodes[k] != j) *reinterpret_cast<Vec*>(tree + j * cache.stride_s) = rows[k];
    }
  }
}

// grid = (slices of a row, B, caches). accepted_nodes is [B, T] contiguous; the other index
// tensors are [B]. new_seqlens (nullptr: not written) gets cache_seqlens + num_accepted + 1.
template <int kMaxCaches, int kChunk>
__global__ void __launch_bounds__(kCompactThreads)
    compact_kv_cache_kernel(const __grid_constant__ CompactParams<kMaxCaches> params,
                            const int32_t* __restrict__ cache_seqlens, const int32_t* __restrict__ accepted_nodes,
                            const int32_t* __restrict__ num_accepted, int32_t num_nodes,
                            int32_t* __restrict__ new_seqlens) {
  const int64_t b = blockIdx.y;
  const int32_t prefix = cache_seqlens[b];
  const int32_t accepted = num_accepted[b];
  if (new_seqlens != nullptr && blockIdx.x == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
    new_seqlens[b] = prefix + accepted + 1;
  }
  if (static_cast<int32_t>(blockIdx.z) >= params.num_caches) return;
  const KvCacheView& cache = params.caches[blockIdx.z];
  // Rows the CPU kernel would reject (negative prefix, path length outside [1, T], a path
  // whose destinations prefix + j, j <= accepted, leave the cache) are left untouched: a
  // kernel cannot raise, and Python validates beforehand. Node ids are bounded by the cache,
  // not by T (a path may come in a narrower tensor than its tree).
  if (prefix < 0 || accepted < 0 || accepted >= num_nodes || static_cast<int64_t>(prefix) + accepted >= cache.seq_len) {
    return;
  }
  const int32_t node_limit = cache.seq_len - prefix;
  const int32_t* path = accepted_nodes + b * num_nodes;
  const int32_t path_len = accepted + 1;
  switch (cache.vec_bytes) {  // the same for the whole block: no divergence
    case 16: move_path<uint4, kChunk>(cache, b, prefix, path, path_len, node_limit); break;
    case 8: move_path<uint2, kChunk>(cache, b, prefix, path, path_len, node_limit); break;
    case 4: move_path<uint32_t, kChunk>(cache, b, prefix, path, path_len, node_limit); break;
    case 2: move_path<uint16_t, kChunk>(cache, b, prefix, path, path_len, node_limit); break;
    default: move_path<uint8_t, kChunk>(cache, b, prefix, path, path_len, node_limit); break;
  }
}

// Largest batch the grid's y dimension holds.
constexpr int64_t kCompactMaxBatch = 65535;

// Compacts `num_caches` caches (their vec_bytes is filled in here) in one launch per
// kMaxCaches of them. Returns cudaErrorInvalidValue for a batch over kCompactMaxBatch.
template <int kMaxCaches = kCompactMaxCaches, int kChunk = kCompactPathChunk>
cudaError_t launch_compact_kv_cache(const KvCacheView* caches, int64_t num_caches, const int32_t* cache_seqlens,
                                    const int32_t* accepted_nodes, const int32_t* num_accepted, int64_t batch,
                                    int32_t num_nodes, int32_t* new_seqlens, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (batch > kCompactMaxBatch) return cudaErrorInvalidValue;
  int64_t first = 0;
  do {  // at least one launch, so new_seqlens is written even without caches
    CompactParams<kMaxCaches> params{};  // zeroed: unused slots hold no stale bytes
    params.num_caches = static_cast<int32_t>(num_caches - first < kMaxCaches ? num_caches - first : kMaxCaches);
    int64_t slices = 1;
    for (int32_t c = 0; c < params.num_caches; ++c) {
      KvCacheView view = caches[first + c];
      view.vec_bytes = widest_vector_bytes(view);
      params.caches[c] = view;
      const int64_t row_vecs = static_cast<int64_t>(view.heads) * (view.head_bytes / view.vec_bytes);
      const int64_t needed = (row_vecs + kCompactThreads - 1) / kCompactThreads;
      slices = needed > slices ? needed : slices;
    }
    const dim3 grid(static_cast<unsigned int>(slices), static_cast<unsigned int>(batch),
                    static_cast<unsigned int>(params.num_caches > 0 ? params.num_caches : 1));
    compact_kv_cache_kernel<kMaxCaches, kChunk><<<grid, kCompactThreads, 0, stream>>>(
        params, cache_seqlens, accepted_nodes, num_accepted, num_nodes, first == 0 ? new_seqlens : nullptr);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    first += params.num_caches;
  } while (first < num_caches);
  return cudaSuccess;
}

// ------------------------------------------------------------------------------- paged caches
// A paged cache is a pool [num_pages, page_size, H, D]; in its KvCacheView stride_b is the
// page stride and seq_len the page size. Position s of row b is slot s % page_size of page
// table[b * table_stride + s / page_size]. The same moves as above, each row found through
// the block table: one thread gathers up to kChunk path rows into registers before storing
// any (exact for any path of up to kChunk nodes, and chunk by chunk for longer real tree
// paths, whose node ids increase strictly). Rows of different batch rows never share a tree
// slot (Python checks it), so the blocks of different rows do not race.

// Byte offset of position `pos` through a row's block table, or -1 if its page id is not
// in [0, num_pages) (the kernel cannot raise; such moves are skipped).
__device__ __forceinline__ int64_t paged_row_offset(const KvCacheView& cache, const int32_t* __restrict__ pages,
                                                    int32_t num_pages, int64_t pos) {
  const int64_t page = pos / cache.seq_len;
  const int32_t id = __ldg(pages + page);
  if (id < 0 || id >= num_pages) return -1;
  return id * cache.stride_b + (pos - page * cache.seq_len) * cache.stride_s;
}

template <typename Vec, int kChunk>
__device__ __forceinline__ void move_path_paged(const KvCacheView& cache, const int32_t* __restrict__ pages,
                                                int32_t num_pages, int32_t prefix, const int32_t* __restrict__ path,
                                                int32_t path_len, int32_t num_nodes) {
  const int64_t vecs_per_head = cache.head_bytes / static_cast<int32_t>(sizeof(Vec));
  const int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (v >= vecs_per_head * cache.heads) return;
  const int64_t column = (v / vecs_per_head) * cache.stride_h + (v % vecs_per_head) * static_cast<int64_t>(sizeof(Vec));
  for (int32_t first = 0; first < path_len; first += kChunk) {
    Vec rows[kChunk];
    int32_t nodes[kChunk];
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const int32_t j = first + k;
      nodes[k] = j < path_len ? __ldg(path + j) : j;
      if (nodes[k] < 0 || nodes[k] >= num_nodes) nodes[k] = j;
      if (nodes[k] != j) {
        const int64_t src = paged_row_offset(cache, pages, num_pages, static_cast<int64_t>(prefix) + nodes[k]);
        if (src < 0) {
          nodes[k] = j;  // a bad page id: leave this slot alone
        } else {
          rows[k] = *reinterpret_cast<const Vec*>(cache.data + src + column);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const int32_t j = first + k;
      if (nodes[k] == j) continue;
      const int64_t dst = paged_row_offset(cache, pages, num_pages, static_cast<int64_t>(prefix) + j);
      if (dst >= 0) *reinterpret_cast<Vec*>(cache.data + dst + column) = rows[k];
    }
  }
}

// grid = (slices of a row, B, caches); block_table int32 [B, num_cols] with row stride
// table_stride. capacity = num_cols * page_size: rows whose tree does not fit are skipped.
template <int kMaxCaches, int kChunk>
__global__ void __launch_bounds__(kCompactThreads)
    compact_kv_cache_paged_kernel(const __grid_constant__ CompactParams<kMaxCaches> params,
                                  const int32_t* __restrict__ cache_seqlens, const int32_t* __restrict__ accepted_nodes,
                                  const int32_t* __restrict__ num_accepted, int32_t num_nodes,
                                  const int32_t* __restrict__ block_table, int64_t table_stride, int64_t capacity,
                                  int32_t num_pages, int32_t* __restrict__ new_seqlens) {
  const int64_t b = blockIdx.y;
  const int32_t prefix = cache_seqlens[b];
  const int32_t accepted = num_accepted[b];
  if (new_seqlens != nullptr && blockIdx.x == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
    new_seqlens[b] = prefix + accepted + 1;
  }
  if (static_cast<int32_t>(blockIdx.z) >= params.num_caches) return;
  const KvCacheView& cache = params.caches[blockIdx.z];
  if (prefix < 0 || static_cast<int64_t>(prefix) + num_nodes > capacity || accepted < 0 || accepted >= num_nodes) {
    return;
  }
  const int32_t* path = accepted_nodes + b * num_nodes;
  const int32_t* pages = block_table + b * table_stride;
  const int32_t path_len = accepted + 1;
  switch (cache.vec_bytes) {
    case 16: move_path_paged<uint4, kChunk>(cache, pages, num_pages, prefix, path, path_len, num_nodes); break;
    case 8: move_path_paged<uint2, kChunk>(cache, pages, num_pages, prefix, path, path_len, num_nodes); break;
    case 4: move_path_paged<uint32_t, kChunk>(cache, pages, num_pages, prefix, path, path_len, num_nodes); break;
    case 2: move_path_paged<uint16_t, kChunk>(cache, pages, num_pages, prefix, path, path_len, num_nodes); break;
    default: move_path_paged<uint8_t, kChunk>(cache, pages, num_pages, prefix, path, path_len, num_nodes); break;
  }
}

// launch_compact_kv_cache for paged caches (views as described above; num_pages = the
// smallest pool's page count).
template <int kMaxCaches = kCompactMaxCaches, int kChunk = kCompactPathChunk>
cudaError_t launch_compact_kv_cache_paged(const KvCacheView* caches, int64_t num_caches, const int32_t* cache_seqlens,
                                          const int32_t* accepted_nodes, const int32_t* num_accepted, int64_t batch,
                                          int32_t num_nodes, const int32_t* block_table, int64_t table_stride,
                                          int64_t num_cols, int32_t num_pages, int32_t* new_seqlens,
                                          cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (batch > kCompactMaxBatch) return cudaErrorInvalidValue;
  int64_t first = 0;
  do {
    CompactParams<kMaxCaches> params{};
    params.num_caches = static_cast<int32_t>(num_caches - first < kMaxCaches ? num_caches - first : kMaxCaches);
    int64_t slices = 1;
    int64_t page_size = 1;
    for (int32_t c = 0; c < params.num_caches; ++c) {
      KvCacheView view = caches[first + c];
      view.vec_bytes = widest_vector_bytes(view);
      params.caches[c] = view;
      page_size = view.seq_len;
      const int64_t row_vecs = static_cast<int64_t>(view.heads) * (view.head_bytes / view.vec_bytes);
      const int64_t needed = (row_vecs + kCompactThreads - 1) / kCompactThreads;
      slices = needed > slices ? needed : slices;
    }
    const dim3 grid(static_cast<unsigned int>(slices), static_cast<unsigned int>(batch),
                    static_cast<unsigned int>(params.num_caches > 0 ? params.num_caches : 1));
    compact_kv_cache_paged_kernel<kMaxCaches, kChunk><<<grid, kCompactThreads, 0, stream>>>(
        params, cache_seqlens, accepted_nodes, num_accepted, num_nodes, block_table, table_stride,
        num_cols * page_size, num_pages, first == 0 ? new_seqlens : nullptr);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    first += params.num_caches;
  } while (first < num_caches);
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace specdec
