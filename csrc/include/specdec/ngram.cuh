// N-gram (prompt lookup) matching on NVIDIA GPUs: the kernel and its launcher, no torch.
//
// Same contract and the same one-pass idea as ngram.h: a match is named by its end e
// (e <= N - 2, s[e] == s[N - 1]), len(e) = common suffix length of s[0, e] and s[0, N)
// capped at cap = min(max_n, N - 1), the winning n is max len(e) (if >= min_n), and the
// policy picks the smallest ("earliest") or largest ("latest") e of that length.
//
// One block per batch row. The block walks the row in tiles of kNgramThreads *
// kNgramItems positions (from the start for "earliest", from the end for "latest"; loads
// coalesced), each thread keeping its best (len, e) as one 64-bit key so that "better" is
// plain integer max. After each tile the block stops if any thread reached len == cap:
// every earlier tile had none, so the best key of this tile is the answer. A block
// reduction then picks the row's key, and the block writes the proposal.
// Bad lengths cannot be reported without a host sync: they are clamped to [0, L] (the
// Python layer validates them).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace specdec {
namespace cuda {

constexpr int kNgramThreads = 256;
constexpr int kNgramItems = 4;  // positions per thread per tile
constexpr int kNgramPositionBits = 40;

// key = len << 40 | rank, rank = e ("latest") or (2^40 - 1 - e) ("earliest"); 0 = none.
__device__ __forceinline__ uint64_t ngram_key(int64_t len, int64_t e, bool latest) {
  const uint64_t rank = latest ? static_cast<uint64_t>(e)
                               : ((uint64_t{1} << kNgramPositionBits) - 1 - static_cast<uint64_t>(e));
  return (static_cast<uint64_t>(len) << kNgramPositionBits) | rank;
}

template <typename Index>
__global__ void __launch_bounds__(kNgramThreads)
    ngram_propose_kernel(const Index* __restrict__ tokens, int64_t stride_b, int64_t stride_t,
                         const int64_t* __restrict__ lengths, int64_t width, int64_t min_n, int64_t max_n,
                         int64_t num_tokens, bool latest, Index* __restrict__ drafts, int32_t* __restrict__ draft_lens) {
  __shared__ uint64_t warp_best[kNgramThreads / 32];
  __shared__ uint64_t row_best;
  const int64_t b = blockIdx.x;
  const Index* s = tokens + b * stride_b;
  int64_t num = lengths[b];
  num = num < 0 ? 0 : (num > width ? width : num);
  const int64_t cap = max_n < num - 1 ? max_n : num - 1;

  uint64_t best = 0;
  if (cap >= min_n && cap >= 1) {
    const Index last = s[(num - 1) * stride_t];
    const int64_t count = num - 1;  // candidate ends e in [0, N - 2]
    const int64_t tile = static_cast<int64_t>(kNgramThreads) * kNgramItems;
    const uint64_t full = static_cast<uint64_t>(cap) << kNgramPositionBits;
    for (int64_t base = 0; base < count; base += tile) {
#pragma unroll
      for (int i = 0; i < kNgramItems; ++i) {
        const int64_t offset = base + i * kNgramThreads + threadIdx.x;
        if (offset < count) {
          const int64_t e = latest ? count - 1 - offset : offset;
          if (s[e * stride_t] == last) {
            const int64_t limit = cap < e + 1 ? cap : e + 1;
            int64_t len = 1;
            while (len < limit && s[(e - len) * stride_t] == s[(num - 1 - len) * stride_t]) ++len;
            const uint64_t key = ngram_key(len, e, latest);
            best = key > best ? key : best;
          }
        }
      }
      if (__syncthreads_or(best >= full)) break;
    }
  }

  // Block max of the keys: warps by shuffles, then the first warp over the warp results.
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, best, delta);
    best = other > best ? other : best;
  }
  if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
  __syncthreads();
  if (threadIdx.x < 32) {
    best = threadIdx.x < kNgramThreads / 32 ? warp_best[threadIdx.x] : 0;
#pragma unroll
    for (int delta = 16; delta > 0; delta /= 2) {
      const uint64_t other = __shfl_xor_sync(0xffffffffu, best, delta);
      best = other > best ? other : best;
    }
    if (threadIdx.x == 0) row_best = best;
  }
  __syncthreads();
  best = row_best;

  const int64_t len = static_cast<int64_t>(best >> kNgramPositionBits);
  int64_t start = 0, produced = 0;
  if (len >= min_n && len >= 1) {
    const uint64_t rank = best & ((uint64_t{1} << kNgramPositionBits) - 1);
    const int64_t e = latest ? static_cast<int64_t>(rank)
                             : static_cast<int64_t>((uint64_t{1} << kNgramPositionBits) - 1 - rank);
    start = e + 1;
    produced = num - start < num_tokens ? num - start : num_tokens;
  }
  Index* out = drafts + b * num_tokens;
  for (int64_t k = threadIdx.x; k < num_tokens; k += kNgramThreads) {
    out[k] = k < produced ? s[(start + k) * stride_t] : static_cast<Index>(-1);
  }
  if (threadIdx.x == 0) draft_lens[b] = static_cast<int32_t>(produced);
}

// drafts [B, num_tokens] and draft_lens [B] (contiguous) from tokens [B, L] (any strides)
// and lengths [B] (int64). Requires B <= 2^31 - 1 and L < 2^40.
template <typename Index>
cudaError_t launch_ngram_propose(const Index* tokens, int64_t stride_b, int64_t stride_t, const int64_t* lengths,
                                 int64_t batch, int64_t width, int64_t min_n, int64_t max_n, int64_t num_tokens,
                                 bool latest, Index* drafts, int32_t* draft_lens, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  ngram_propose_kernel<Index><<<static_cast<unsigned int>(batch), kNgramThreads, 0, stream>>>(
      tokens, stride_b, stride_t, lengths, width, min_n, max_n, num_tokens, latest, drafts, draft_lens);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specdec
