// KV-cache compaction after verification, CPU side: plain C++ over raw pointers, no torch.
//
// A cache is one [B, S, H, D] tensor (a layer's keys or values) seen as bytes: the move
// never looks at the values, so one code path serves every dtype. Row b's tree occupies
// positions prefix_b + node; the accepted path accepted[0..n] (node 0, the root, first,
// then strictly increasing node ids) moves to positions prefix_b + j, j <= n.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace specdec {

// One [B, S, H, D] cache as bytes. Plain data, passed by value to the CUDA kernel too.
struct KvCacheView {
  char* data;
  int64_t stride_b;    // bytes between batch rows
  int64_t stride_s;    // bytes between positions
  int64_t stride_h;    // bytes between heads
  int32_t seq_len;     // S
  int32_t heads;       // H
  int32_t head_bytes;  // D * element size (a head's D values are contiguous)
  int32_t vec_bytes;   // CUDA: widest load (16, 8, 4, 2 or 1 bytes) the layout allows
};

// The widest power-of-two access, at most 16 bytes, that divides the base address, every
// stride and the head size, so every vector of every row is aligned.
inline int32_t widest_vector_bytes(const KvCacheView& cache) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(cache.data) | static_cast<uint64_t>(cache.stride_b) |
                        static_cast<uint64_t>(cache.stride_s) | static_cast<uint64_t>(cache.stride_h) |
                        static_cast<uint64_t>(cache.head_bytes);
  int32_t vec = 16;
  while (vec > 1 && (bits & static_cast<uint64_t>(vec - 1)) != 0) vec /= 2;
  return vec;
}

namespace cpu {

// Why batch row `path` cannot be compacted in a cache of `seq_len` positions, or nullptr.
// The path holds num_accepted + 1 nodes, 1..T of them (T = num_nodes, the width of the
// accepted_nodes tensor); it starts at the root (node 0) and strictly increases, as every
// root-to-node path of a topologically ordered tree does; its node ids are bounded by the
// cache (prefix + node < seq_len), not by T, so a path may come in a narrower tensor than
// the tree it was accepted from. Increasing paths also keep every destination
// prefix + j <= prefix + path[j] inside the cache.
inline const char* path_error(int32_t prefix, const int32_t* path, int32_t num_accepted, int32_t num_nodes,
                              int32_t seq_len) {
  if (prefix < 0) return "cache_seqlens is negative";
  if (num_accepted < 0 || num_accepted >= num_nodes) return "num_accepted is outside [0, T)";
  if (path[0] != 0) return "accepted_nodes must start at node 0 (the root)";
  for (int32_t j = 1; j <= num_accepted; ++j) {
    if (path[j] <= path[j - 1]) return "accepted_nodes must strictly increase along the path";
  }
  // The path increases, so its last node is its largest.
  if (static_cast<int64_t>(prefix) + path[num_accepted] >= seq_len) {
    return "accepted_nodes has a node past the cache (cache_seqlens + node >= S)";
  }
  return nullptr;
}

// Bytes of scratch `compact_row` needs for a path of up to num_nodes nodes.
inline int64_t compact_scratch_bytes(const KvCacheView& cache, int32_t num_nodes) {
  return static_cast<int64_t>(num_nodes) * cache.heads * cache.head_bytes;
}

// Moves row b's accepted path (path_len = num_accepted + 1 nodes, already checked with
// path_error) in one cache. Every source is copied to `scratch` before any destination is
// written, because a source slot can also be a destination.
inline void compact_row(const KvCacheView& cache, int64_t b, int32_t prefix, const int32_t* path, int32_t path_len,
                        char* scratch) {
  char* tree = cache.data + b * cache.stride_b + static_cast<int64_t>(prefix) * cache.stride_s;
  const int64_t row_bytes = static_cast<int64_t>(cache.heads) * cache.head_bytes;
  // Nodes already in place (path[j] == j, e.g. every node of an accepted chain) are skipped:
  // destinations are distinct, so nothing else writes their slot.
  for (int32_t j = 0; j < path_len; ++j) {
    if (path[j] == j) continue;
    const char* src = tree + path[j] * cache.stride_s;
    for (int32_t h = 0; h < cache.heads; ++h) {
      std::memcpy(scratch + j * row_bytes + h * cache.head_bytes, src + h * cache.stride_h, cache.head_bytes);
    }
  }
  for (int32_t j = 0; j < path_len; ++j) {
    if (path[j] == j) continue;
    char* dst = tree + j * cache.stride_s;
    for (int32_t h = 0; h < cache.heads; ++h) {
      std::memcpy(dst + h * cache.stride_h, scratch + j * row_bytes + h * cache.head_bytes, cache.head_bytes);
    }
  }
}

// ----------------------------------------------------------------------------- paged caches
// A paged cache is a pool of pages [num_pages, page_size, H, D]: in its KvCacheView,
// stride_b is the page stride, stride_s the slot stride and seq_len the page size. Position s
// of row b is slot s % page_size of page pages[s / page_size], pages = that row's block table
// entries (checked by the caller for every position the row uses).

// Byte offset of row b's position `pos` in a paged cache.
inline int64_t paged_offset(const KvCacheView& cache, const int32_t* pages, int64_t pos) {
  const int64_t page_size = cache.seq_len;
  const int64_t page = pos / page_size;
  return pages[page] * cache.stride_b + (pos - page * page_size) * cache.stride_s;
}

// compact_row on a paged cache: the same moves (every source copied to `scratch` before any
// destination is written), each position found through the row's block table `pages`.
inline void compact_row_paged(const KvCacheView& cache, const int32_t* pages, int32_t prefix, const int32_t* path,
                              int32_t path_len, char* scratch) {
  const int64_t row_bytes = static_cast<int64_t>(cache.heads) * cache.head_bytes;
  for (int32_t j = 0; j < path_len; ++j) {
    if (path[j] == j) continue;
    const char* src = cache.data + paged_offset(cache, pages, static_cast<int64_t>(prefix) + path[j]);
    for (int32_t h = 0; h < cache.heads; ++h) {
      std::memcpy(scratch + j * row_bytes + h * cache.head_bytes, src + h * cache.stride_h, cache.head_bytes);
    }
  }
  for (int32_t j = 0; j < path_len; ++j) {
    if (path[j] == j) continue;
    char* dst = cache.data + paged_offset(cache, pages, static_cast<int64_t>(prefix) + j);
    for (int32_t h = 0; h < cache.heads; ++h) {
      std::memcpy(dst + h * cache.stride_h, scratch + j * row_bytes + h * cache.head_bytes, cache.head_bytes);
    }
  }
}

}  // namespace cpu
}  // namespace specdec
