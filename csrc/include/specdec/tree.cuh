// Token-tree masks on NVIDIA GPUs: kernels and their launchers, no torch.
//
// Same tree convention as tree.h. A kernel cannot report bad input without a host sync, so
// a parent that is neither -1 nor an earlier node simply ends the ancestor walk (the node
// is treated as a root); the Python layer validates parents before calling.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace specdec {
namespace cuda {

constexpr int kTreeThreads = 256;

// Grid size for a grid-stride loop over `work` items: enough blocks to fill any GPU,
// capped so huge inputs loop instead of overflowing the grid.
inline unsigned int grid_for(int64_t work, int threads) {
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 65536)));
}

// The 64 mask columns [first, first + 64) of node `node`'s row, as bits. Ancestors have
// strictly smaller indices, so the walk stops as soon as it drops below `first`.
template <typename Index>
__device__ __forceinline__ uint64_t ancestor_bits(const Index* parents, int64_t stride, int64_t node, int64_t first) {
  uint64_t bits = 0;
  while (node >= first) {
    if (node < first + 64) bits |= uint64_t{1} << (node - first);
    const int64_t parent = static_cast<int64_t>(parents[node * stride]);
    if (parent < 0 || parent >= node) break;  // root, padding, or invalid: no further ancestors
    node = parent;
  }
  return bits;
}

// mask [B, T, T] (contiguous bool) from parents [B, T]. One thread per (row b, node i,
// 64-column word), so a thread's walk covers one word and its writes are contiguous.
template <typename Index>
__global__ void __launch_bounds__(kTreeThreads)
    tree_mask_kernel(const Index* __restrict__ parents, int64_t parent_stride_b, int64_t parent_stride_t,
                     int64_t batch, int64_t num_nodes, bool* __restrict__ mask) {
  const int64_t num_words = (num_nodes + 63) / 64;
  const int64_t total = batch * num_nodes * num_words;
  // Rows start 8-byte aligned when T % 8 == 0 (the allocation itself is aligned), which
  // allows 8 bools per store.
  const bool wide_stores = num_nodes % 8 == 0;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t word = idx % num_words;
    const int64_t row = idx / num_words;  // b * T + i
    const int64_t b = row / num_nodes;
    const int64_t i = row % num_nodes;
    const uint64_t bits = ancestor_bits(parents + b * parent_stride_b, parent_stride_t, i, word * 64);
    bool* out = mask + row * num_nodes + word * 64;
    const int64_t count = num_nodes - word * 64 < 64 ? num_nodes - word * 64 : 64;
    if (wide_stores) {
      for (int64_t k = 0; k < count; k += 8) {
        // Spread bits k..k+7 to the low bit of 8 bytes (little-endian: byte 0 = column k).
        uint64_t bytes = 0;
#pragma unroll
        for (int bit = 0; bit < 8; ++bit) bytes |= ((bits >> (k + bit)) & 1) << (8 * bit);
        *reinterpret_cast<uint64_t*>(out + k) = bytes;
      }
    } else {
      for (int64_t k = 0; k < count; ++k) out[k] = (bits >> k) & 1;
    }
  }
}

// packed [B, T, ceil(K/64)] (contiguous int64) from mask [B, T, K] (uint8 0/1, any strides).
// One warp per mask row: each ballot turns 32 columns into 32 bits, and adjacent lanes
// read adjacent columns, so loads are coalesced when the last dim is contiguous.
template <typename Mask>
__global__ void __launch_bounds__(kTreeThreads)
    pack_tree_mask_kernel(const Mask* __restrict__ mask, int64_t stride_b, int64_t stride_t, int64_t stride_k,
                          int64_t batch, int64_t num_nodes, int64_t num_keys, int64_t* __restrict__ packed) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t num_words = (num_keys + 63) / 64;
  // `row` depends only on the warp, so every lane takes the same trips and the full-warp
  // ballots below are safe (blockDim.x is a multiple of 32).
  for (int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; row < batch * num_nodes;
       row += warps) {
    const Mask* src = mask + (row / num_nodes) * stride_b + (row % num_nodes) * stride_t;
    for (int64_t word = 0; word < num_words; ++word) {
      const int64_t lo = word * 64 + lane;
      const int64_t hi = lo + 32;
      const unsigned int lo_bits = __ballot_sync(0xffffffffu, lo < num_keys && src[lo * stride_k] != 0);
      const unsigned int hi_bits = __ballot_sync(0xffffffffu, hi < num_keys && src[hi * stride_k] != 0);
      if (lane == 0) {
        packed[row * num_words + word] = static_cast<int64_t>((static_cast<uint64_t>(hi_bits) << 32) | lo_bits);
      }
    }
  }
}

template <typename Index>
cudaError_t launch_tree_mask(const Index* parents, int64_t parent_stride_b, int64_t parent_stride_t, int64_t batch,
                             int64_t num_nodes, bool* mask, cudaStream_t stream) {
  const int64_t work = batch * num_nodes * ((num_nodes + 63) / 64);
  if (work == 0) return cudaSuccess;
  tree_mask_kernel<Index><<<grid_for(work, kTreeThreads), kTreeThreads, 0, stream>>>(
      parents, parent_stride_b, parent_stride_t, batch, num_nodes, mask);
  return cudaGetLastError();
}

template <typename Mask>
cudaError_t launch_pack_tree_mask(const Mask* mask, int64_t stride_b, int64_t stride_t, int64_t stride_k,
                                  int64_t batch, int64_t num_nodes, int64_t num_keys, int64_t* packed,
                                  cudaStream_t stream) {
  const int64_t rows = batch * num_nodes;
  if (rows == 0 || num_keys == 0) return cudaSuccess;
  pack_tree_mask_kernel<Mask><<<grid_for(rows * 32, kTreeThreads), kTreeThreads, 0, stream>>>(
      mask, stride_b, stride_t, stride_k, batch, num_nodes, num_keys, packed);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specdec
