// Fused verification on NVIDIA GPUs (rejection sampling for chains and token trees, straight
// from the target's logits): kernel, planner and launcher, no torch.
//
// The rules are those of specdec_kernels/reference/verify.py (module docstring), and the
// random numbers are the reference's bit for bit (Philox4x32-10, key = seed, counter =
// (index, node, purpose, 0), word 0, u = ((word >> 9) + 0.5) * 2^-23), so a row's tokens match
// the reference except where two candidates are within fp32 rounding of each other.
//
// Design. One persistent kernel. The grid is `groups x chunks` blocks: the `chunks` blocks of
// a group each own one contiguous slice of the vocabulary and walk the same batch rows (rows
// g, g + groups, ...) together, one tree depth at a time; they agree on every decision
// through slots in a global workspace and a per-group barrier (an arrival counter in global
// memory). All blocks are co-resident (the planner sizes the grid from the occupancy
// calculator and the launch is cooperative, so the driver refuses a grid that could
// deadlock), which is what makes the spinning barrier safe. Per visited node:
//   1. each block loads its slice of the node's logits once (16-byte loads, any alignment,
//      odd V) into shared memory as sanitised fp32, and reduces max / argmax (lowest id);
//      barrier; every block combines the C slots in the same fixed order, so every block
//      takes the same decision. Greedy rows stop here: 1 barrier per depth.
//   2. sampled rows: x = (l - max) / T in place; top-k threshold = the k-th largest x by a
//      4-pass radix select over the fp32 key (8-bit digits, count histograms merged across
//      blocks; exact, boundary ties kept); top-p threshold = 4 more passes over the key of
//      e = exp(x) with the mass in 2^-40 fixed point (integer sums: deterministic, and every
//      block sees the same cumulative masses), keeping v iff the mass strictly above it is
//      < top_p * Z; then w = e on the kept set.
//   3. deterministic drafts: exponential race argmax_v w_v / -log(u_v) (1 barrier), then the
//      child holding that token. (The race runs on e, not e / Z: the same winner up to fp32
//      rounding ties, and one barrier less.)
//      draft probabilities: Z = sum w (1 barrier; exact 128-bit fixed-point sums, like the
//      residual sums below, so no result depends on how V is split, i.e. on the batch size);
//      p = w / Z in place; children in index
//      order: every block evaluates the acceptance test u * q(x) < r(x) itself (r(x) is
//      recomputed from the logit and q at x and the residual sums so far, with exactly the
//      operations applied to the shared-memory copy, so all blocks agree); a rejection loads
//      q's slice (first time only), sums max(r - q, 0) (1 barrier) and renormalises in place
//      (r kept when the sum is 0). If every child is rejected (or there is none) the race
//      samples from r (1 barrier).
// Only the visited nodes' logits are read (and draft_probs only at nodes where a child was
// rejected), each byte once; every later pass runs on shared memory. Bytes per visited node:
// V * sizeof(logit) (+ V * sizeof(draft prob) after a rejection). The floor is those bytes at
// HBM bandwidth. Large batches (B * V * depth >> L2) are expected at ~50-70% of it: the
// loads are 16 B wide with 4 in flight per thread, but the kernel needs ~150 registers, so
// one 256-thread block per SM (16 KB in flight per SM, about half of what saturates HBM);
// the per-depth barriers of different groups overlap. Small batches
// are latency-bound (a barrier is ~1-3 us, a top-k/top-p node costs ~10 barriers), far
// below the floor in % but tens of microseconds per call. These figures
// are estimates: the kernel has not been run on a GPU yet.
//
// Why not one launch per depth: the depth is data-dependent, so without a host sync every
// launch sequence would need T launches. Why not one block per row: a batch of a few rows
// would use a few SMs out of 132.
//
// Shared memory per block: tree tokens / parents / residual sums (16 B per node) + the slice
// (4 B per element, 8 B with draft_probs) + 3.2 KB static. Workspace (allocated by the caller,
// graph-safe): groups * chunks * 2 slots (double-buffered by barrier parity) + one counter per
// group, zeroed by the launcher with cudaMemsetAsync.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "specdec/philox.h"  // philox::uniform, the Philox of the CPU verify too

namespace specdec {
namespace cuda {

constexpr int kVerifyThreads = 256;
constexpr int kVerifyWarps = kVerifyThreads / 32;
constexpr int kVerifyBins = 256;        // radix-select digit: 8 bits, 4 passes per threshold
constexpr int kVerifyMaxChunks = 32;    // blocks per row when the vocabulary does not force more
constexpr int kVerifyMinChunk = 2048;   // fewer elements per block are not worth a block
constexpr int kVerifyLoadBatch = 4;     // 16-byte loads in flight per thread
constexpr int kVerifyMaxDevices = 64;
static_assert(kVerifyThreads == kVerifyBins, "one thread per histogram bin");

// What one block publishes for one barrier.
struct alignas(16) VerifySlot {
  float value;    // max logit / best race ratio
  int32_t index;  // argmax / race winner
  int32_t pad[2];
  unsigned long long sum_lo, sum_hi;  // partial sum, 2^-96 fixed point (128 bits)
  uint32_t count[kVerifyBins];
  unsigned long long mass[kVerifyBins];  // 2^-40 fixed point
};

// Inputs and outputs. Logits / draft_probs: [B, T, V] with a contiguous last dim (the other
// strides in elements); every other pointer with its strides in elements. Outputs contiguous.
struct VerifyArgs {
  const void* logits;
  int64_t logits_stride_b, logits_stride_t;
  const void* draft_probs;  // nullptr: deterministic drafts
  int64_t draft_stride_b, draft_stride_t;
  int32_t draft_dtype;  // a VerifyDtype (runtime: the draft path is cold, one kernel per logit dtype)
  const int64_t* tree_tokens;
  int64_t tokens_stride_b, tokens_stride_t;
  const int64_t* parents;
  int64_t parents_stride_b, parents_stride_t;
  const float* temperature;
  int64_t temperature_stride;
  const int64_t* top_k;
  int64_t top_k_stride;
  const float* top_p;
  int64_t top_p_stride;
  const int64_t* seed;
  int64_t seed_stride;
  int32_t batch, num_nodes, vocab;
  int32_t* accepted_nodes;  // [B, T]
  int32_t* num_accepted;    // [B]
  int64_t* output_tokens;   // [B, T]
};

enum VerifyDtype : int32_t { kVerifyFloat32 = 0, kVerifyBFloat16 = 1, kVerifyFloat16 = 2 };

struct VerifyPlan {
  int32_t chunks = 0;     // blocks per row (vocabulary slices)
  int32_t chunk_len = 0;  // elements per slice (multiple of 8)
  int32_t groups = 0;     // rows processed concurrently
  size_t smem_bytes = 0;  // dynamic shared memory per block
  size_t counter_bytes = 0;
  size_t workspace_bytes = 0;  // counters, then slots
};

// ------------------------------------------------------------------------------------------
// Element access
// ------------------------------------------------------------------------------------------

template <typename T>
struct VerifyElem;

template <>
struct VerifyElem<float> {
  static constexpr int kPerVec = 4;
  __device__ __forceinline__ static float at(const uint4& v, int k) { return __uint_as_float((&v.x)[k]); }
  __device__ __forceinline__ static float load(const float* p) { return __ldg(p); }
};

template <>
struct VerifyElem<__nv_bfloat16> {
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static float at(const uint4& v, int k) {
    const uint32_t word = (&v.x)[k / 2];
    return __uint_as_float((k % 2 == 0 ? word << 16 : word & 0xFFFF0000u));
  }
  __device__ __forceinline__ static float load(const __nv_bfloat16* p) {
    return __uint_as_float(static_cast<uint32_t>(__ldg(reinterpret_cast<const unsigned short*>(p))) << 16);
  }
};

template <>
struct VerifyElem<__half> {
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static float at(const uint4& v, int k) {
    const uint32_t word = (&v.x)[k / 2];
    return __half2float(__ushort_as_half(static_cast<unsigned short>(k % 2 == 0 ? word & 0xFFFFu : word >> 16)));
  }
  __device__ __forceinline__ static float load(const __half* p) {
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p))));
  }
};

// Calls store(i, value) for i in [0, n) of src: a scalar head up to 16-byte alignment, a body
// of 16-byte loads (kVerifyLoadBatch in flight per thread), a scalar tail. Any n, any offset.
template <typename T, typename Store>
__device__ __forceinline__ void load_slice(const T* __restrict__ src, int32_t n, Store&& store) {
  constexpr int kW = VerifyElem<T>::kPerVec;
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(src) & 15u;
  int32_t head = static_cast<int32_t>(((16u - misaligned) & 15u) / sizeof(T));
  if (head > n) head = n;
  const int32_t vecs = (n - head) / kW;
  const int32_t tail = head + vecs * kW;
  for (int32_t i = threadIdx.x; i < head; i += kVerifyThreads) store(i, VerifyElem<T>::load(src + i));
  const uint4* body = reinterpret_cast<const uint4*>(src + head);
  for (int32_t base = threadIdx.x; base < vecs; base += kVerifyThreads * kVerifyLoadBatch) {
    uint4 v[kVerifyLoadBatch];
#pragma unroll
    for (int u = 0; u < kVerifyLoadBatch; ++u) {
      const int32_t i = base + u * kVerifyThreads;
      if (i < vecs) v[u] = __ldg(body + i);
    }
#pragma unroll
    for (int u = 0; u < kVerifyLoadBatch; ++u) {
      const int32_t i = base + u * kVerifyThreads;
      if (i < vecs) {
#pragma unroll
        for (int k = 0; k < kW; ++k) store(head + i * kW + k, VerifyElem<T>::at(v[u], k));
      }
    }
  }
  for (int32_t i = tail + threadIdx.x; i < n; i += kVerifyThreads) store(i, VerifyElem<T>::load(src + i));
}

// Draft probabilities of any float dtype (known at run time): element `offset` of `base`.
__device__ __forceinline__ float load_prob(const void* base, int32_t dtype, int64_t offset) {
  switch (dtype) {
    case kVerifyBFloat16: return VerifyElem<__nv_bfloat16>::load(static_cast<const __nv_bfloat16*>(base) + offset);
    case kVerifyFloat16: return VerifyElem<__half>::load(static_cast<const __half*>(base) + offset);
    default: return VerifyElem<float>::load(static_cast<const float*>(base) + offset);
  }
}
template <typename Store>
__device__ __forceinline__ void load_prob_slice(const void* base, int32_t dtype, int64_t offset, int32_t n,
                                                Store&& store) {
  switch (dtype) {
    case kVerifyBFloat16: load_slice(static_cast<const __nv_bfloat16*>(base) + offset, n, store); break;
    case kVerifyFloat16: load_slice(static_cast<const __half*>(base) + offset, n, store); break;
    default: load_slice(static_cast<const float*>(base) + offset, n, store); break;
  }
}

// ------------------------------------------------------------------------------------------
// Numerics shared by the shared-memory passes and the point evaluations (must stay identical:
// every block recomputes r(x) at a drafted token and must get the owner's bits)
// ------------------------------------------------------------------------------------------

// NaN -> -inf (probability 0), +inf -> the largest finite float.
__device__ __forceinline__ float sanitize_logit(float x) { return isnan(x) ? -INFINITY : fminf(x, FLT_MAX); }
// Draft probabilities: NaN -> 0, negatives -> 0.
__device__ __forceinline__ float sanitize_prob(float x) { return isnan(x) ? 0.f : fmaxf(x, 0.f); }

// uint32 key with the order of the float (no NaN here); -0 was canonicalised to +0.
__device__ __forceinline__ uint32_t ordered_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Per-node sampling state, identical in every block of the group.
struct NodeWarp {
  float max;       // row max of the sanitised logits
  float temp;      // temperature (> 0)
  uint32_t kth;    // top-k: keep x with ordered_key(x) >= kth (0: keep all)
  uint32_t pkey;   // top-p: keep e with bits(e) >= pkey (0: keep all)
  bool dead;       // every logit -inf / NaN: token 0 gets all the mass
};

// (l - max) / T rounded like the reference's fp32 ops; -0 -> +0 so ties compare as keys.
__device__ __forceinline__ float scaled_logit(float l, const NodeWarp& w) {
  const float x = __fdiv_rn(__fsub_rn(l, w.max), w.temp);
  return x == 0.f ? 0.f : x;
}
// exp(x) if x survives top-k, else 0.
__device__ __forceinline__ float topk_weight(float x, uint32_t kth) { return ordered_key(x) >= kth ? expf(x) : 0.f; }
// Unnormalised target weight of token v from its scaled logit x.
__device__ __forceinline__ float node_weight_scaled(float x, int32_t v, const NodeWarp& w) {
  if (w.dead) return v == 0 ? 1.f : 0.f;
  const float e = topk_weight(x, w.kth);
  return __float_as_uint(e) >= w.pkey ? e : 0.f;
}
__device__ __forceinline__ float node_weight(float l, int32_t v, const NodeWarp& w) {
  return node_weight_scaled(w.dead ? l : scaled_logit(l, w), v, w);
}
// One residual update, r <- max(r - q, 0) / s (s > 0).
__device__ __forceinline__ float residual_step(float r, float q, float s) {
  return __fdiv_rn(fmaxf(__fsub_rn(r, q), 0.f), s);
}
__device__ __forceinline__ unsigned long long to_fixed40(float e) { return __float2ull_rn(__fmul_rn(e, 0x1p40f)); }

// ------------------------------------------------------------------------------------------
// Block and group reductions
// ------------------------------------------------------------------------------------------

// Larger value wins, the lower index on ties (torch.argmax's first maximum). No NaN here.
__device__ __forceinline__ bool verify_better(float v, int32_t i, float best, int32_t best_i) {
  return v > best || (v == best && i < best_i);
}

__device__ __forceinline__ void warp_argbest(float& v, int32_t& i) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, i, offset);
    if (verify_better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// Sums of weights and residuals are exact: each value in [0, 2) becomes an integer multiple
// of 2^-96 in 128 bits (values below 2^-96 vanish; V < 2^31 values cannot overflow), so the
// total does not depend on the order of the additions, hence not on how the vocabulary is
// split across blocks, hence not on the batch size: a row's result depends only on the row.
using VerifyFixed = unsigned __int128;
__device__ __forceinline__ VerifyFixed to_fixed96(float x) {
  if (!(x > 0.f)) return 0;
  const uint32_t bits = __float_as_uint(x);
  const int exponent = static_cast<int>(bits >> 23);  // x > 0: no sign bit
  if (exponent == 0) return 0;                        // subnormal: below 2^-126
  const uint32_t mantissa = (bits & 0x7FFFFFu) | 0x800000u;
  const int shift = exponent - 150 + 96;  // x = mantissa * 2^(exponent - 150)
  if (shift <= -24) return 0;
  if (shift < 0) return mantissa >> -shift;
  return static_cast<VerifyFixed>(mantissa) << shift;
}
__device__ __forceinline__ float from_fixed96(VerifyFixed v) {
  const double d = static_cast<double>(static_cast<unsigned long long>(v >> 64)) * 0x1p64 +
                   static_cast<double>(static_cast<unsigned long long>(v));
  return static_cast<float>(d * 0x1p-96);
}
__device__ __forceinline__ VerifyFixed shfl_xor_fixed(VerifyFixed v, int offset) {
  const unsigned long long lo = __shfl_xor_sync(0xffffffffu, static_cast<unsigned long long>(v), offset);
  const unsigned long long hi = __shfl_xor_sync(0xffffffffu, static_cast<unsigned long long>(v >> 64), offset);
  return (static_cast<VerifyFixed>(hi) << 64) | lo;
}
__device__ __forceinline__ VerifyFixed warp_sum_fixed(VerifyFixed v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += shfl_xor_fixed(v, offset);
  return v;
}

struct VerifyShared {
  uint32_t count[kVerifyBins];
  unsigned long long mass[kVerifyBins];
  unsigned long long scan[kVerifyWarps];
  VerifyFixed sum[kVerifyWarps];
  float red_value[kVerifyWarps];
  int32_t red_index[kVerifyWarps];
  int32_t selected_bin;
  unsigned long long selected_before;
  unsigned long long total;
};

// The chunks blocks of one group: their slots and barrier.
struct VerifyGroup {
  VerifySlot* slots;      // chunks x 2 (barrier parity)
  unsigned int* counter;  // arrivals, zeroed before the launch
  int32_t chunks;
  int32_t chunk;  // this block's slice
  uint32_t phase;  // barriers passed so far

  // Where this block publishes for the next barrier.
  __device__ __forceinline__ VerifySlot* mine() const { return slots + static_cast<size_t>(chunk) * 2 + (phase & 1u); }
  // Block c's slot of the barrier just passed.
  __device__ __forceinline__ const VerifySlot* slot(int32_t c) const {
    return slots + static_cast<size_t>(c) * 2 + ((phase - 1u) & 1u);
  }

  // Every block of the group arrives, then waits for all. Writes before it (any thread) are
  // visible to every block after it. Two slot buffers alternate: a block rewrites a buffer
  // only after the next barrier, which every block reaches only after reading it.
  __device__ __forceinline__ void sync() {
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned int target = (phase + 1u) * static_cast<unsigned int>(chunks);
      __threadfence();
      atomicAdd(counter, 1u);
      unsigned int seen;
      for (;;) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        if (static_cast<int>(seen - target) >= 0) break;
        __nanosleep(32);
      }
      __threadfence();
    }
    ++phase;
    __syncthreads();
  }
};

// Block (value, index) argbest published in this block's slot (thread 0 writes).
__device__ __forceinline__ void publish_argbest(float v, int32_t i, VerifyShared& sh, VerifySlot* slot) {
  warp_argbest(v, i);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    sh.red_value[warp] = v;
    sh.red_index[warp] = i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kVerifyWarps; ++w) {
      if (verify_better(sh.red_value[w], sh.red_index[w], v, i)) {
        v = sh.red_value[w];
        i = sh.red_index[w];
      }
    }
    __stcg(&slot->value, v);
    __stcg(&slot->index, i);
  }
}

// Block sum (exact) published in this block's slot.
__device__ __forceinline__ void publish_sum(VerifyFixed v, VerifyShared& sh, VerifySlot* slot) {
  v = warp_sum_fixed(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) sh.sum[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    VerifyFixed total = 0;
    for (int w = 0; w < kVerifyWarps; ++w) total += sh.sum[w];
    __stcg(&slot->sum_lo, static_cast<unsigned long long>(total));
    __stcg(&slot->sum_hi, static_cast<unsigned long long>(total >> 64));
  }
}

// After a barrier: the group's argbest, computed by every warp in the same order (no shared
// memory round trip; every thread ends with the same bits).
__device__ __forceinline__ void combine_argbest(const VerifyGroup& g, float& v, int32_t& i) {
  v = -INFINITY;
  i = INT_MAX;
  for (int32_t c = threadIdx.x % 32; c < g.chunks; c += 32) {
    const VerifySlot* s = g.slot(c);
    const float ov = __ldcg(&s->value);
    const int32_t oi = __ldcg(&s->index);
    if (verify_better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
  warp_argbest(v, i);
}

// After a barrier: the group's exact sum as the nearest-ish float (same bits in every thread).
__device__ __forceinline__ float combine_sum(const VerifyGroup& g) {
  VerifyFixed total = 0;
  for (int32_t c = threadIdx.x % 32; c < g.chunks; c += 32) {
    const VerifySlot* s = g.slot(c);
    total += (static_cast<VerifyFixed>(__ldcg(&s->sum_hi)) << 64) | __ldcg(&s->sum_lo);
  }
  return from_fixed96(warp_sum_fixed(total));
}

// Inclusive scan over the block's threads in thread order; `total` gets the block total.
template <typename U>
__device__ __forceinline__ U block_inclusive_scan(U x, unsigned long long* warp_scratch, U& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const U other = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += other;
  }
  if (lane == 31) warp_scratch[warp] = x;
  __syncthreads();
  U before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kVerifyWarps; ++w) {
    const U t = static_cast<U>(warp_scratch[w]);
    if (w < warp) before += t;
    total += t;
  }
  __syncthreads();  // warp_scratch is reused by the next scan
  return x + before;
}

// ------------------------------------------------------------------------------------------
// Radix select (top-k, top-p thresholds)
// ------------------------------------------------------------------------------------------

// Adds this block's keys to sh.count / sh.mass: elements whose key matches `prefix` under
// `mask`, binned by the 8-bit digit at `shift`. Lanes of a warp that hit the same bin are
// merged first (match + integer reductions), so a clustered distribution does not serialise
// on one shared-memory address. KeyFn(float) -> (key, weight).
template <bool kMass, typename KeyFn>
__device__ __forceinline__ void histogram_slice(const float* vals, int32_t n, KeyFn&& key_of, uint32_t prefix,
                                                uint32_t mask, int shift, VerifyShared& sh) {
  const int lane = threadIdx.x % 32;
  for (int32_t base = threadIdx.x - lane; base < n; base += kVerifyThreads) {  // warp-uniform trips
    const int32_t i = base + lane;
    bool valid = false;
    uint32_t bin = 0;
    unsigned long long m = 0;
    if (i < n) {
      float weight;
      const uint32_t key = key_of(vals[i], weight);
      valid = (key & mask) == prefix;
      bin = (key >> shift) & 0xFFu;
      if (kMass) m = to_fixed40(weight);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    // __reduce_add_sync needs sm_80 (only a TORCH_CUDA_ARCH_LIST naming an older GPU builds
    // this): each lane adds its own element. Integer atomics, so the same sums, only slower.
    if (valid) {
      if (kMass) atomicAdd(&sh.mass[bin], m);
      atomicAdd(&sh.count[bin], 1u);
    }
#else
    const unsigned int active = __ballot_sync(0xffffffffu, valid);
    if (valid) {
      const unsigned int peers = __match_any_sync(active, bin);
      const bool leader = lane == __ffs(peers) - 1;
      if (kMass) {
        // m <= 2^40: two 20-bit halves, each summed over <= 32 lanes stays below 2^25.
        const unsigned int lo = __reduce_add_sync(peers, static_cast<unsigned int>(m & 0xFFFFFu));
        const unsigned int hi = __reduce_add_sync(peers, static_cast<unsigned int>(m >> 20));
        if (leader) atomicAdd(&sh.mass[bin], (static_cast<unsigned long long>(hi) << 20) + lo);
      }
      if (leader) atomicAdd(&sh.count[bin], static_cast<unsigned int>(__popc(peers)));
    }
#endif
  }
}

// The threshold key of the row (all blocks of the group agree), 4 passes of 8 bits, most
// significant first. kMass = false: the key of the rank-th largest element (top-k).
// kMass = true: the smallest key whose strictly-larger mass is < top_p * total (top-p).
// Returns 0 (keep everything) if no bin qualifies, which exact integer sums rule out.
template <bool kMass, typename KeyFn>
__device__ uint32_t radix_select(const float* vals, int32_t n, KeyFn&& key_of, uint32_t rank, float top_p,
                                 VerifyGroup& g, VerifyShared& sh) {
  uint32_t prefix = 0, mask = 0;
  unsigned long long mass_above = 0;
  double target = 0.0;
  const int t = threadIdx.x;
  for (int shift = 24; shift >= 0; shift -= 8) {
    sh.count[t] = 0;
    if (kMass) sh.mass[t] = 0;
    if (t == 0) sh.selected_bin = -1;
    __syncthreads();
    histogram_slice<kMass>(vals, n, key_of, prefix, mask, shift, sh);
    __syncthreads();
    VerifySlot* mine = g.mine();
    __stcg(&mine->count[t], sh.count[t]);
    if (kMass) __stcg(&mine->mass[t], sh.mass[t]);
    g.sync();
    // Thread t owns bin 255 - t: thread order is descending key order.
    const int bin = kVerifyBins - 1 - t;
    unsigned long long count = 0, mass = 0;
    for (int32_t c = 0; c < g.chunks; ++c) {
      count += __ldcg(&g.slot(c)->count[bin]);
      if (kMass) mass += __ldcg(&g.slot(c)->mass[bin]);
    }
    unsigned long long total;
    if (kMass) {
      const unsigned long long incl = block_inclusive_scan(mass, sh.scan, total);
      if (shift == 24) {
        target = static_cast<double>(top_p) * static_cast<double>(total);
        // top_p <= 0 (only reachable with value checks off) keeps the most likely token(s), as
        // the reference and the CPU kernel do: the first nonempty bin reaches any positive target.
        if (!(target > 0.0)) target = 1e-300;
      }
      const unsigned long long before = mass_above + incl - mass;
      if (count > 0 && static_cast<double>(before) < target && static_cast<double>(mass_above + incl) >= target) {
        sh.selected_bin = bin;
        sh.selected_before = before;
      }
    } else {
      const unsigned long long incl = block_inclusive_scan(count, sh.scan, total);
      const unsigned long long before = incl - count;
      if (count > 0 && before < rank && incl >= rank) {
        sh.selected_bin = bin;
        sh.selected_before = before;
      }
    }
    __syncthreads();
    const int selected = sh.selected_bin;
    const unsigned long long selected_before = sh.selected_before;
    __syncthreads();  // sh is rewritten by the next pass
    if (selected < 0) return 0;
    if (kMass) {
      mass_above = selected_before;
    } else {
      rank -= static_cast<uint32_t>(selected_before);
    }
    prefix |= static_cast<uint32_t>(selected) << shift;
    mask |= 0xFFu << shift;
  }
  return prefix;
}

// ------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------

// Dynamic shared memory before the vocabulary slice: tokens (8 B), parents (4 B) and
// residual sums (4 B) per node, rounded to 16 B.
__host__ __device__ inline size_t verify_meta_bytes(int64_t num_nodes) {
  return (static_cast<size_t>(num_nodes) * 16u + 15u) / 16u * 16u;
}

// Race over this block's weights; returns the group's winner (every thread, same value).
__device__ __forceinline__ int32_t race(const float* vals, int32_t n, int32_t lo, uint64_t seed, int32_t node,
                                        int32_t vocab, VerifyGroup& g, VerifyShared& sh) {
  float best = -1.f;
  int32_t best_i = INT_MAX;
  for (int32_t i = threadIdx.x; i < n; i += kVerifyThreads) {
    const float w = vals[i];
    if (w > 0.f) {  // weight 0 never wins: some weight is positive
      const float u =
          philox::uniform(seed, static_cast<uint32_t>(node), philox::kPurposeSample, static_cast<uint32_t>(lo + i));
      const float ratio = __fdiv_rn(w, -logf(u));
      if (verify_better(ratio, lo + i, best, best_i)) {
        best = ratio;
        best_i = lo + i;
      }
    }
  }
  publish_argbest(best, best_i, sh, g.mine());
  g.sync();
  float v;
  int32_t winner;
  combine_argbest(g, v, winner);
  return (winner >= 0 && winner < vocab) ? winner : 0;  // never an out-of-vocabulary id
}

// First child of `node` (index order) holding `token`, or -1. Children have larger indices.
__device__ __forceinline__ int32_t find_child(const int32_t* parent, const int64_t* tokens, int32_t num_nodes,
                                              int32_t node, int64_t token) {
  for (int32_t j = node + 1; j < num_nodes; ++j) {
    if (parent[j] == node && tokens[j] == token) return j;
  }
  return -1;
}

// grid = groups * chunks blocks (block = group * chunks + chunk), all co-resident.
template <typename LogitT>
__global__ void __launch_bounds__(kVerifyThreads, 1)
    verify_kernel(const __grid_constant__ VerifyArgs args, int32_t chunks, int32_t chunk_len,
                  VerifySlot* __restrict__ slots, unsigned int* __restrict__ counters) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ VerifyShared sh;
  const int32_t num_nodes = args.num_nodes;
  const int32_t vocab = args.vocab;
  int64_t* s_tokens = reinterpret_cast<int64_t*>(smem);
  int32_t* s_parent = reinterpret_cast<int32_t*>(s_tokens + num_nodes);
  float* s_sums = reinterpret_cast<float*>(s_parent + num_nodes);
  float* vals = reinterpret_cast<float*>(smem + verify_meta_bytes(num_nodes));
  float* qs = vals + chunk_len;  // only with draft_probs

  const int32_t group = blockIdx.x / chunks;
  const int32_t groups = gridDim.x / chunks;
  VerifyGroup g{slots + static_cast<size_t>(group) * chunks * 2, counters + group, chunks,
                static_cast<int32_t>(blockIdx.x % chunks), 0u};
  const int32_t lo = g.chunk * chunk_len;
  const int32_t n = min(chunk_len, vocab - lo);  // >= 1: the planner makes no empty slice
  const LogitT* logits = static_cast<const LogitT*>(args.logits);
  const void* draft = args.draft_probs;
  const bool writer = g.chunk == 0;

  for (int32_t row = group; row < args.batch; row += groups) {
    // Tree of this row. Anything but an earlier node is no parent (padding; invalid parents
    // are rejected by Python), so the walk only moves to larger indices and always ends.
    for (int32_t j = threadIdx.x; j < num_nodes; j += kVerifyThreads) {
      const int64_t p = args.parents[row * args.parents_stride_b + j * args.parents_stride_t];
      s_parent[j] = (p >= 0 && p < j) ? static_cast<int32_t>(p) : -1;
      s_tokens[j] = args.tree_tokens[row * args.tokens_stride_b + j * args.tokens_stride_t];
      if (writer) {
        args.accepted_nodes[static_cast<int64_t>(row) * num_nodes + j] = j == 0 ? 0 : -1;
        args.output_tokens[static_cast<int64_t>(row) * num_nodes + j] = -1;
      }
    }
    __syncthreads();
    const float temperature = args.temperature[row * args.temperature_stride];
    const bool greedy = temperature == 0.f;
    const int64_t top_k = args.top_k[row * args.top_k_stride];
    const float top_p = args.top_p[row * args.top_p_stride];
    const uint64_t seed = static_cast<uint64_t>(args.seed[row * args.seed_stride]);
    const bool use_top_k = top_k > 0 && top_k < vocab;
    const bool use_top_p = top_p < 1.f;

    int32_t cur = 0, accepted = 0;
    for (;;) {
      const LogitT* lrow = logits + row * args.logits_stride_b + cur * args.logits_stride_t;
      // 1. Load the slice, max / argmax.
      float best = -INFINITY;
      int32_t best_i = INT_MAX;
      load_slice(lrow + lo, n, [&](int32_t i, float x) {
        x = sanitize_logit(x);
        vals[i] = x;
        if (verify_better(x, lo + i, best, best_i)) {
          best = x;
          best_i = lo + i;
        }
      });
      publish_argbest(best, best_i, sh, g.mine());
      g.sync();
      float row_max;
      int32_t argmax;
      combine_argbest(g, row_max, argmax);
      if (argmax < 0 || argmax >= vocab) argmax = 0;

      int32_t next = -1;
      int64_t emitted = argmax;
      if (!greedy) {
        NodeWarp w{row_max, temperature > 0.f ? temperature : 1.f, 0u, 0u, row_max == -INFINITY};
        // 2. Scaled logits, thresholds, weights.
        if (!w.dead) {
          for (int32_t i = threadIdx.x; i < n; i += kVerifyThreads) vals[i] = scaled_logit(vals[i], w);
          __syncthreads();
          if (use_top_k) {
            w.kth = radix_select<false>(
                vals, n, [](float x, float& weight) { weight = 0.f; return ordered_key(x); },
                static_cast<uint32_t>(top_k), 1.f, g, sh);
          }
          if (use_top_p) {
            const uint32_t kth = w.kth;
            w.pkey = radix_select<true>(
                vals, n,
                [kth](float x, float& weight) {
                  weight = topk_weight(x, kth);
                  return __float_as_uint(weight);
                },
                0u, top_p, g, sh);
          }
        }
        for (int32_t i = threadIdx.x; i < n; i += kVerifyThreads) vals[i] = node_weight_scaled(vals[i], lo + i, w);
        __syncthreads();

        int32_t first_child = -1;
        for (int32_t j = cur + 1; j < num_nodes && first_child < 0; ++j) {
          if (s_parent[j] == cur) first_child = j;
        }
        if (draft == nullptr || first_child < 0) {
          // 3a. Sample y ~ p, move to the child holding y.
          const int32_t y = race(vals, n, lo, seed, cur, vocab, g, sh);
          emitted = y;
          next = find_child(s_parent, s_tokens, num_nodes, cur, y);
        } else {
          // 3b. Multi-step speculative sampling over the children in index order.
          VerifyFixed part = 0;
          for (int32_t i = threadIdx.x; i < n; i += kVerifyThreads) part += to_fixed96(vals[i]);
          publish_sum(part, sh, g.mine());
          g.sync();
          const float z = combine_sum(g);  // >= the max weight > 0
          for (int32_t i = threadIdx.x; i < n; i += kVerifyThreads) vals[i] = __fdiv_rn(vals[i], z);
          __syncthreads();
          const int64_t qrow = row * args.draft_stride_b + cur * args.draft_stride_t;  // element offset
          int32_t num_sums = 0;
          bool q_loaded = false;
          for (int32_t j = first_child; j < num_nodes; ++j) {
            if (s_parent[j] != cur) continue;
            const int64_t token = s_tokens[j];
            const int32_t x = static_cast<int32_t>(token < 0 ? 0 : (token >= vocab ? vocab - 1 : token));
            // Every thread of every block evaluates the test on the same bits.
            const float qx = sanitize_prob(load_prob(draft, args.draft_dtype, qrow + x));
            float r = __fdiv_rn(node_weight(sanitize_logit(VerifyElem<LogitT>::load(lrow + x)), x, w), z);
            for (int32_t h = 0; h < num_sums; ++h) r = residual_step(r, qx, s_sums[h]);
            const float u = philox::uniform(seed, static_cast<uint32_t>(j), philox::kPurposeAccept, 0u);
            if (__fmul_rn(u, qx) < r) {  // q(x) = 0: accepted iff r(x) > 0
              next = j;
              break;
            }
            // Rejected: r <- normalise(max(r - q, 0)), unchanged if that sums to 0.
            if (!q_loaded) {
              load_prob_slice(draft, args.draft_dtype, qrow + lo, n,
                              [&](int32_t i, float q) { qs[i] = sanitize_prob(q); });
              q_loaded = true;
              __syncthreads();
            }
            part = 0;
            for (int32_t i = threadIdx.x; i < n; i += kVerifyThreads) {
              part += to_fixed96(fmaxf(__fsub_rn(vals[i], qs[i]), 0.f));
            }
            publish_sum(part, sh, g.mine());
            g.sync();
            const float s = combine_sum(g);
            if (s > 0.f) {
              for (int32_t i = threadIdx.x; i < n; i += kVerifyThreads) vals[i] = residual_step(vals[i], qs[i], s);
              if (threadIdx.x == 0) s_sums[num_sums] = s;
              ++num_sums;
              __syncthreads();
            }
          }
          if (next < 0) emitted = race(vals, n, lo, seed, cur, vocab, g, sh);
        }
      } else {
        next = find_child(s_parent, s_tokens, num_nodes, cur, argmax);
      }

      if (writer && threadIdx.x == 0) {
        int64_t* out = args.output_tokens + static_cast<int64_t>(row) * num_nodes;
        if (next >= 0) {
          out[accepted] = s_tokens[next];
          args.accepted_nodes[static_cast<int64_t>(row) * num_nodes + accepted + 1] = next;
        } else {
          out[accepted] = emitted;
          args.num_accepted[row] = accepted;
        }
      }
      __syncthreads();  // vals / qs / s_sums are rewritten for the next node
      if (next < 0) break;
      ++accepted;
      cur = next;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

// Grid, slices and workspace for one call (host queries only: no sync, capturable). Returns
// cudaErrorInvalidValue when the tree's per-node shared memory leaves no room for a slice.
template <typename LogitT>
cudaError_t plan_verify(int64_t batch, int64_t num_nodes, int64_t vocab, bool has_draft, VerifyPlan* plan) {
  if (batch <= 0 || num_nodes <= 0 || vocab <= 0) return cudaErrorInvalidValue;
  int device = 0, sms = 0, smem_optin = 0, smem_per_sm = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (error == cudaSuccess) error = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (error == cudaSuccess) {
    error = cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  }
  if (error != cudaSuccess) return error;
  auto kernel = verify_kernel<LogitT>;
  cudaFuncAttributes attributes{};
  error = cudaFuncGetAttributes(&attributes, kernel);
  if (error != cudaSuccess) return error;
  // Allow the largest dynamic shared memory once per device (not a stream operation).
  static std::atomic<bool> raised[kVerifyMaxDevices];
  if (device >= kVerifyMaxDevices || !raised[device].load()) {
    error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 smem_optin - static_cast<int>(attributes.sharedSizeBytes));
    if (error != cudaSuccess) return error;
    if (device < kVerifyMaxDevices) raised[device].store(true);
  }

  const size_t meta = verify_meta_bytes(num_nodes);
  const size_t per_element = has_draft ? 8 : 4;
  // Half an SM's shared memory per block, so two blocks share an SM even with huge slices.
  const int64_t budget = std::min<int64_t>(smem_optin, smem_per_sm / 2) - static_cast<int64_t>(attributes.sharedSizeBytes) -
                         static_cast<int64_t>(meta) - 1024;
  if (budget < static_cast<int64_t>(per_element) * kVerifyThreads) return cudaErrorInvalidValue;
  const int64_t slice_max = budget / static_cast<int64_t>(per_element) / 8 * 8;
  const int64_t chunks_min = (vocab + slice_max - 1) / slice_max;
  const int64_t chunks_fill = (2 * static_cast<int64_t>(sms) + batch - 1) / batch;
  const int64_t chunks_cap = std::max<int64_t>(1, vocab / kVerifyMinChunk);
  int64_t chunks = std::max<int64_t>(chunks_min, std::min<int64_t>({chunks_fill, chunks_cap, kVerifyMaxChunks}));
  const int64_t chunk_len = ((vocab + chunks - 1) / chunks + 7) / 8 * 8;
  chunks = (vocab + chunk_len - 1) / chunk_len;  // no empty slice
  const size_t smem = meta + static_cast<size_t>(chunk_len) * per_element;

  int per_sm = 0;
  error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kVerifyThreads, smem);
  if (error != cudaSuccess) return error;
  const int64_t capacity = static_cast<int64_t>(per_sm) * sms;
  const int64_t groups = std::min<int64_t>(batch, capacity / chunks);
  if (groups < 1) return cudaErrorInvalidValue;

  plan->chunks = static_cast<int32_t>(chunks);
  plan->chunk_len = static_cast<int32_t>(chunk_len);
  plan->groups = static_cast<int32_t>(groups);
  plan->smem_bytes = smem;
  plan->counter_bytes = (static_cast<size_t>(groups) * sizeof(unsigned int) + 255u) / 256u * 256u;
  plan->workspace_bytes = plan->counter_bytes + static_cast<size_t>(groups * chunks) * 2 * sizeof(VerifySlot);
  return cudaSuccess;
}

// Launches the plan on `stream`; `workspace` holds plan.workspace_bytes (256-byte aligned).
template <typename LogitT>
cudaError_t launch_verify(const VerifyArgs& args, const VerifyPlan& plan, void* workspace, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  unsigned int* counters = static_cast<unsigned int*>(workspace);
  VerifySlot* slots = reinterpret_cast<VerifySlot*>(static_cast<char*>(workspace) + plan.counter_bytes);
  cudaError_t error = cudaMemsetAsync(counters, 0, plan.counter_bytes, stream);
  if (error != cudaSuccess) return error;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned int>(plan.groups * plan.chunks));
  config.blockDim = dim3(kVerifyThreads);
  config.dynamicSmemBytes = plan.smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeCooperative;  // co-residency: the barrier needs it
  attribute[0].val.cooperative = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  error = cudaLaunchKernelEx(&config, verify_kernel<LogitT>, args, plan.chunks, plan.chunk_len, slots, counters);
  if (error != cudaSuccess) return error;
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specdec
