// Tree attention on NVIDIA GPUs: kernels and their launchers, no torch.
//
// Contract (specdec_kernels/tree_attention.py, reference/tree_attention.py): q [B, T, Hq, D],
// k/v caches [B, S, Hkv, D] (any strides, contiguous last dim), cache_seqlens int32 [B]; query
// i of row b attends to keys 0 .. L_b - 1 and to tree key L_b + j iff bit j of its packed
// ancestor mask is set. Output [B, T, Hq, D] in q's dtype, fp32 accumulation. Only keys below
// L_b + T are ever read: slots past the tree may hold garbage (even NaN) or lie past S.
// Options (TreeAttentionParams; 0: off): a sliding window (a query at sequence position
// p = L_b + depth, depth = its ancestor count from the mask, sees a key at position k only
// if p - k < window; prefix key s is at s, tree node j at L_b + depth(j)), soft-capping
// (score -> softcap * tanh(score / softcap) on the scaled score), and a value head dim Dv
// of its own (MLA; the fallback kernel only: the host sends Dv != D there). NOT RUN ON A
// GPU: written and compile-checked only (tools/compile_check.sh), like the rest of this file.
//
// ------------------------------------------------------------------------------- roofline
// Target config: bf16, B = 8, Hq = 32, Hkv = 8 (group 4), D = 128, T = 64, prefix 8192.
//   Keys per row L + T = 8256. K and V read once: B * Hkv * 8256 * D * 2 B * 2 = 270.5 MB
//   (+ q and out, 4.2 MB each) = 279 MB -> 83 us at 3.35 TB/s (H100 SXM), 58 us at 4.8 TB/s (H200).
//   Flops: 2 GEMMs * 2 * B * Hq * T * 8256 * D = 69.3 GFLOP -> 70 us at 989 TFLOP/s (dense bf16).
//   Intensity 248 flop/B against ridge points of 295 (H100) / 206 (H200): the op sits on the
//   ridge, so the floor is max(memory, tensor) = ~83 us on H100, ~70 us on H200, and it is
//   reached only if (a) every K/V byte comes from HBM once: all T * group = 256 query rows of
//   a KV head share each K/V tile (here 2 CTAs of 128 rows, scheduled next to each other so
//   the second read hits L2), (b) split-KV gives >= 1 full wave (B * Hkv = 64 pairs is half of
//   132 SMs), and (c) the tensor cores run near peak, with the 135 M exp2 (~36 us of MUFU at
//   16/clk/SM) overlapped with the GEMMs.
// This kernel uses mma.sync m16n8k16 (sm_80+), which on Hopper reaches only ~60-70% of the
// wgmma peak, so its compute ceiling is ~105-115 us for the target: expect ~1.3-1.9x the floor.
// Why no wgmma/TMA yet: wgmma needs M = 64 per warpgroup with its B operand in shared memory
// and a producer/consumer (TMA + mbarrier) pipeline; that is a separate kernel (sm_90a only)
// and could not be validated without a GPU. Next step: an sm_90a kernel with 2 consumer
// warpgroups of 64 rows (128 rows per CTA, as here), K/V tiles by TMA into 128-B-swizzled
// shared memory behind an mbarrier pipeline, S = Q K^T and O += P V by wgmma (P from
// registers), and the softmax of one warpgroup overlapped with the other's GEMMs (FA3-style
// ping-pong). The split-KV grid, tree tile and combine of this file carry over unchanged.
//
// ------------------------------------------------------------------------------- design
// Tensor-core path (tree_attention_mma_kernel; fp16 / bf16, D in {64, 128, 256}, 16-byte
// aligned rows, sm_80+). grid = (m_tiles * splits, Hkv, B), m_tile fastest so the CTAs sharing
// a K/V tile run together. A CTA owns kBlockM = 16 * kWarps query rows m = node * group + g
// (all T nodes times the query heads of KV head h, packed into the M dimension); each warp
// owns 16 rows. The prefix 0 .. L - 1 is cut into `splits` chunks (multiples of kBlockN) from
// L on the device, so the host picks `splits` from shapes only (no sync). The last split also
// does the tree keys L .. L + T - 1 as ceil(T / kBlockN) more tiles in the same pipeline, with
// visibility from the packed ancestor words (one 64-bit word per row and tile, in registers).
// K/V tiles go global -> shared by cp.async (16 B, zero-fill past the valid range), double
// buffered; fragments come from shared memory by ldmatrix (K, Q) and ldmatrix.trans (V).
// Online softmax in fp32 with exp2 (scale * log2 e folded into the scores); P goes to
// registers as the A operand of P V without a trip through shared memory. Each split writes
// its normalised partial output and log2-sum-exp2 (or, with one split, the output itself);
// tree_attention_combine_kernel merges the splits.
//
// Resources (ptxas, CUDA 13, sm_80 / sm_90a, no spills): D = 64: 168-188 registers; D = 128:
// 234-243 (8 warps, 1 CTA/SM) and 255 (4 warps, 2 CTAs/SM); D = 256: 255 (4 warps). Shared
// memory 32 / 64 / 96 KiB dynamic (D = 64 / 128 / 256) + 0.6-1.1 KiB static, under sm_86's
// 99 KiB. For the target (256 rows per KV head -> 2 row tiles of 128) the host picks 3 splits:
// 384 CTAs of 8 warps, ~2.9 waves on 132 SMs.
//
// Fallback path (tree_attention_simt_kernel): fp32 inputs, head dims other than 64/128/256
// (up to 256), unaligned views, and GPUs below sm_80. One warp per (row, node, query head),
// lanes across D, one key at a time, no split: correct but slow; it exists so the CUDA kernel
// accepts every input the Python contract accepts (a registered kernel gets every dtype).
//
// mma.sync.m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4; every 32-bit register holds two 16-bit elements, the lower
// column (A) / lower k (B) in the low half:
//   A (16 x 16, row-major, 4 regs): a0 = (row g, k 2t..2t+1), a1 = (row g+8, k 2t..2t+1),
//                                   a2 = (row g, k 2t+8..2t+9), a3 = (row g+8, k 2t+8..2t+9)
//   B (16 x 8, "col", 2 regs):      b0 = (k 2t..2t+1, col g), b1 = (k 2t+8..2t+9, col g)
//   C/D (16 x 8 fp32, 4 regs):      c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, same cols)
// ldmatrix.x4: lanes 8i .. 8i+7 give the row addresses of 8x8 matrix i, and register i of lane
// l receives matrix i's (row l/4, cols 2(l%4), 2(l%4)+1); with .trans it receives (rows
// 2(l%4), 2(l%4)+1, col l/4). Hence: Q rows (row-major, D contiguous) load straight into A;
// K rows (key-major, D contiguous) are B = K^T in "col" layout without .trans; V rows
// (key-major) need .trans to become B = V. The S accumulators of n-blocks 2kk and 2kk+1 are
// exactly the A fragment of P for k-chunk kk (c0c1 -> a0, c2c3 -> a1, next block -> a2, a3).
//
// Shared memory: rows of D elements in 16-byte chunks, chunk c of row r stored at chunk
// c ^ (r % 8) (D / 8 >= 8 chunks per row), so the 8 row addresses of every ldmatrix phase
// hit 8 different 16-byte bank groups, and cp.async writes stay 16-B aligned.
//
// -inf handling: a masked score is set to -inf after scaling; a row whose running max is
// still -inf uses 0 as the reference point, so exp2(-inf) = 0 and nothing becomes NaN. A split
// in which a row saw nothing (sum exactly 0) writes o = 0 and lse = -inf, which the combine
// weighs by 0. A row with no weight anywhere (every score -inf, or a mask without its diagonal
// and L = 0) is written as 0 * (1 / 0) = NaN, the reference's softmax over nothing. A NaN
// score (NaN in q or a visible key) makes the row's sum NaN: its split's lse stays NaN (not
// -inf), so the combine passes NaN on instead of dropping that split. Tree V rows no query
// of the CTA sees are zeroed in shared memory, so NaN there cannot leak through 0 * NaN (keys
// are masked by select, not product); a non-finite tree V row that some query of the CTA
// sees still reaches the CTA's other queries of that KV head through 0 * NaN in P V (a
// documented gap, as on the CPU kernel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace specdec {
namespace cuda {

constexpr int kTreeAttnMaxHeadDim = 256;  // the fallback keeps D / 32 values per lane
constexpr int kTreeAttnMaxSplits = 64;
constexpr int kTreeAttnCombineWarps = 4;
constexpr int kTreeAttnSimtWarps = 4;

// Everything the kernels read; element strides. mask is packed int64 [B, T, ceil(T/64)] with
// any strides (mask_stride_b == 0: one mask shared by all rows). out is written with its
// strides; part_o [B, Hkv, splits, rows, D] and part_lse [B, Hkv, splits, rows] (fp32,
// contiguous) are used only when num_splits > 1.
struct TreeAttentionParams {
  const void* q;
  const void* k;
  const void* v;
  const int64_t* mask;
  const int32_t* seqlens;
  void* out;
  float* part_o;
  float* part_lse;
  int64_t q_stride_b, q_stride_t, q_stride_h;
  int64_t k_stride_b, k_stride_s, k_stride_h;
  int64_t v_stride_b, v_stride_s, v_stride_h;
  int64_t mask_stride_b, mask_stride_t, mask_stride_w;
  int64_t out_stride_b, out_stride_t, out_stride_h;
  int32_t batch, num_nodes, num_q_heads, num_kv_heads, head_dim, group;
  int32_t value_dim;    // Dv: V's, the output's and the partials' head dim (== head_dim on the mma path)
  int32_t window;       // sliding window in positions; 0: none
  float softcap;        // soft-capping of the natural-unit scores; 0: none
  float scale;          // softmax scale (natural units; scale_log2 = scale * log2 e)
  int32_t cache_len;    // S: prefixes are clamped to [0, S - T] so bad lengths cannot read out of bounds
  int32_t num_splits;   // KV splits of the prefix (mma path)
  int32_t num_m_tiles;  // ceil(num_nodes * group / kBlockM) (mma path)
  float scale_log2;     // softmax scale * log2(e)
  // Paged caches (kernels instantiated with kPaged): k / v are pools of pages [num_pages,
  // page_size, Hkv, D], k_stride_b / v_stride_b their page strides, and key s of row b is in
  // page block_table[b * block_table_stride + s / page_size], slot s % page_size. The glue
  // checks every page id a row uses (Python, unless value checks are off: ids are clamped to
  // [0, num_pages) so a bad table cannot read outside the pool); cache_len is the logical
  // capacity P * page_size.
  const int32_t* block_table;
  int64_t block_table_stride;
  int32_t num_pages;
  int32_t page_size;
  int32_t page_shift;  // log2(page_size) for a power of two, else -1
};

// Element offset of key `key` of row b from the row's base pointer (which already holds
// b * stride_b in a dense cache, and only the head offset in a paged one). Positions fit in
// int32 (S is checked), so the page lookup divides in 32 bits, or shifts for 16 / 32 / 64.
template <bool kPaged>
__device__ __forceinline__ int64_t kv_row_offset(const TreeAttentionParams& p, int64_t b, int64_t key,
                                                 int64_t stride_page, int64_t stride_s) {
  if constexpr (kPaged) {
    const int32_t pos = static_cast<int32_t>(key);
    const int32_t page = p.page_shift >= 0 ? pos >> p.page_shift : pos / p.page_size;
    const int32_t slot = pos - page * p.page_size;
    const int64_t id = min(max(__ldg(p.block_table + b * p.block_table_stride + page), 0), p.num_pages - 1);
    return id * stride_page + static_cast<int64_t>(slot) * stride_s;
  } else {
    return key * stride_s;
  }
}

// ------------------------------------------------------------------------------- element types

template <typename Elem>
struct ElemOps;

template <>
struct ElemOps<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);  // .x (low half) = lo
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  // d += a * b, m16n8k16, fp16 inputs, fp32 accumulate.
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
};

template <>
struct ElemOps<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
};

template <>
struct ElemOps<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

// ------------------------------------------------------------------------------- PTX helpers

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy; !valid fills the 16 bytes with zeros and reads nothing
// (src must still be a valid address: callers pass a row known to be in bounds).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* addr) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(addr)));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* addr) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(addr)));
#endif
}

__device__ __forceinline__ int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// Python validates 0 <= L and L + T <= S; a kernel cannot raise, so out-of-range lengths (only
// possible with value checks off) are clamped instead of reading outside the cache.
__device__ __forceinline__ int64_t clamp_prefix(int32_t len, int32_t cache_len, int32_t num_nodes) {
  const int64_t most = static_cast<int64_t>(cache_len) - num_nodes;
  return len < 0 ? 0 : (len > most ? (most < 0 ? 0 : most) : len);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Bits [shift, shift + count) of `word` moved down to bit 0; count in 1 .. 64.
__device__ __forceinline__ uint64_t take_bits(uint64_t word, int shift, int count) {
  word >>= shift;
  return count >= 64 ? word : word & ((uint64_t{1} << count) - 1);
}

// Depth of tree node `node` of row b: its ancestors in the packed mask (itself excluded), so
// its sequence position is L_b + depth. Sliding windows only (a few words per node).
__device__ __forceinline__ int node_depth(const TreeAttentionParams& p, int64_t b, int node) {
  const int64_t* row = p.mask + b * p.mask_stride_b + node * p.mask_stride_t;
  int count = 0;
  for (int j0 = 0; j0 < p.num_nodes; j0 += 64) {
    const int bits = p.num_nodes - j0 < 64 ? p.num_nodes - j0 : 64;
    count += __popcll(take_bits(static_cast<uint64_t>(row[(j0 / 64) * p.mask_stride_w]), 0, bits));
  }
  return count - 1;
}

// The scaled score in log2 units (the kernels use exp2), soft-capped when p.softcap > 0:
// softcap * tanh(dot * scale / softcap) * log2 e.
__device__ __forceinline__ float scaled_score(const TreeAttentionParams& p, float dot) {
  if (p.softcap > 0.f) return p.softcap * tanhf(dot * p.scale / p.softcap) * 1.4426950408889634f;
  return dot * p.scale_log2;
}

// The first prefix key any query of row b may see: with a window, the root (position L_b)
// sees nothing at or before L_b - window, and every other node sits later.
__device__ __forceinline__ int64_t first_visible_key(const TreeAttentionParams& p, int64_t prefix_len) {
  if (p.window <= 0) return 0;
  const int64_t first = prefix_len - p.window + 1;
  return first < 0 ? 0 : first;
}

// ------------------------------------------------------------------------------- tensor-core path

template <typename Elem, int kHeadDim, int kWarps>
struct MmaTileConfig {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dims 64, 128, 256");
  static_assert(kWarps == 4 || kWarps == 8, "4 or 8 warps of 16 rows");
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = kWarps * 16;
  // 64 keys per tile; 32 at D = 256 to keep 2 stages of K and V in 64 KiB.
  static constexpr int kBlockN = kHeadDim <= 128 ? 64 : 32;
  // Q fragments stay in registers up to D = 128 (D / 4 registers); at D = 256 the O
  // accumulator alone takes 128 registers, so Q is re-read from shared memory per tile.
  static constexpr bool kQInRegs = kHeadDim <= 128;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr int kTileElems = kBlockN * kHeadDim;
  static constexpr int kStageElems = 2 * kTileElems;  // K tile, then V tile
  static constexpr int kQElems = kBlockM * kHeadDim;
  // With Q in registers, Q passes through the stage buffers before the first K/V load.
  static constexpr int kSmemElems = 2 * kStageElems + (kQInRegs ? 0 : kQElems);
  static constexpr size_t kSmemBytes = static_cast<size_t>(kSmemElems) * sizeof(Elem);
  static_assert(!kQInRegs || kQElems <= 2 * kStageElems, "Q must fit in the stage buffers it borrows");
  static_assert(64 % kBlockN == 0, "a tree tile must lie inside one 64-bit mask word");
  static_assert((kBlockN * kChunks) % kThreads == 0 && (kBlockM * kChunks) % kThreads == 0, "even cp.async split");
  static_assert(kBlockM <= kThreads, "one thread per row reads the mask words");
};

// Element offset of chunk `chunk` (8 elements) of row `row` in a swizzled [rows, kHeadDim] tile.
template <int kHeadDim>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

template <typename Elem, int kHeadDim, int kWarps, bool kPaged = false>
__global__ void __launch_bounds__(kWarps * 32, 1) tree_attention_mma_kernel(const TreeAttentionParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the host sends GPUs below sm_80 to the fallback kernel
#else
  using Cfg = MmaTileConfig<Elem, kHeadDim, kWarps>;
  using Ops = ElemOps<Elem>;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kChunks = Cfg::kChunks;
  constexpr int kNBlocks = kBlockN / 8;   // n8 blocks of S
  constexpr int kDBlocks = kHeadDim / 8;  // n8 blocks of O

  extern __shared__ __align__(128) unsigned char smem_raw[];
  Elem* smem = reinterpret_cast<Elem*>(smem_raw);
  __shared__ uint64_t s_words[kBlockM];  // tree tile: each row's visible columns
  __shared__ uint64_t s_seen[kWarps];    // tree tile: columns some row of the warp sees

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // fragment row (and row + 8)
  const int t = lane % 4;  // fragment column pair
  const int m_tile = static_cast<int>(blockIdx.x) % p.num_m_tiles;
  const int split = static_cast<int>(blockIdx.x) / p.num_m_tiles;
  const int kv_head = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int group = p.group;
  const int num_nodes = p.num_nodes;
  const int num_rows = num_nodes * group;
  const int row0 = m_tile * kBlockM;
  // Warps whose 16 rows are all padding skip the math (they still load and synchronise).
  const bool warp_active = row0 + warp * 16 < num_rows;

  const Elem* q_base = static_cast<const Elem*>(p.q) + b * p.q_stride_b;
  // Paged: k/v_stride_b are page strides, applied per key through the block table.
  const Elem* k_base = static_cast<const Elem*>(p.k) + (kPaged ? 0 : b * p.k_stride_b) + kv_head * p.k_stride_h;
  const Elem* v_base = static_cast<const Elem*>(p.v) + (kPaged ? 0 : b * p.v_stride_b) + kv_head * p.v_stride_h;

  // This split's prefix keys [lo, hi): equal chunks rounded up to whole tiles, from the first
  // key the window lets any query see (0 without a window).
  const int64_t prefix_len = clamp_prefix(p.seqlens[b], p.cache_len, num_nodes);
  const int64_t first_key = first_visible_key(p, prefix_len);
  const int64_t per_split = (prefix_len - first_key + p.num_splits - 1) / p.num_splits;
  const int64_t chunk = (per_split + kBlockN - 1) / kBlockN * kBlockN;
  const int64_t lo = min_i64(first_key + split * chunk, prefix_len);
  const int64_t hi = min_i64(lo + chunk, prefix_len);
  const int num_prefix_tiles = static_cast<int>((hi - lo + kBlockN - 1) / kBlockN);
  const int num_tree_tiles = split == p.num_splits - 1 ? (num_nodes + kBlockN - 1) / kBlockN : 0;
  const int num_tiles = num_prefix_tiles + num_tree_tiles;

  // Keys [start, end) of tile `tile`: prefix tiles first, then the tree tiles (key L + j).
  auto tile_range = [&](int tile, int64_t& start, int64_t& end) {
    if (tile < num_prefix_tiles) {
      start = lo + static_cast<int64_t>(tile) * kBlockN;
      end = hi;
    } else {
      start = prefix_len + static_cast<int64_t>(tile - num_prefix_tiles) * kBlockN;
      end = prefix_len + num_nodes;
    }
  };

  auto load_tile = [&](int tile, int stage) {
    int64_t start, end;
    tile_range(tile, start, end);
    Elem* sk = smem + stage * Cfg::kStageElems;
    Elem* sv = sk + Cfg::kTileElems;
#pragma unroll
    for (int i = 0; i < kBlockN * kChunks / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      const int r = idx / kChunks;
      const int c = idx % kChunks;
      const bool valid = start + r < end;
      const int64_t key = valid ? start + r : start;  // `start` is always a readable key
      const Elem* k_row = k_base + kv_row_offset<kPaged>(p, b, key, p.k_stride_b, p.k_stride_s);
      const Elem* v_row = v_base + kv_row_offset<kPaged>(p, b, key, p.v_stride_b, p.v_stride_s);
      cp_async_16(sk + swizzle<kHeadDim>(r, c), k_row + c * 8, valid);
      cp_async_16(sv + swizzle<kHeadDim>(r, c), v_row + c * 8, valid);
    }
  };

  // ---- Q tile -> shared (rows past num_rows are zeros).
  Elem* sq = Cfg::kQInRegs ? smem : smem + 2 * Cfg::kStageElems;
#pragma unroll
  for (int i = 0; i < kBlockM * kChunks / kThreads; ++i) {
    const int idx = tid + i * kThreads;
    const int r = idx / kChunks;
    const int c = idx % kChunks;
    const int m = row0 + r;
    const bool valid = m < num_rows;
    const int node = valid ? m / group : 0;
    const int head = kv_head * group + (valid ? m % group : 0);
    cp_async_16(sq + swizzle<kHeadDim>(r, c), q_base + node * p.q_stride_t + head * p.q_stride_h + c * 8, valid);
  }
  cp_async_commit();

  // A fragments of this warp's 16 Q rows for k-chunk kk (16 dims).
  auto load_q_frag = [&](uint32_t (&a)[4], int kk) {
    const int row = warp * 16 + (lane & 15);
    ldmatrix_x4(a, sq + swizzle<kHeadDim>(row, 2 * kk + (lane >> 4)));
  };
  constexpr int kQFragChunks = Cfg::kQInRegs ? kHeadDim / 16 : 1;
  uint32_t q_frag[kQFragChunks][4];
  if constexpr (Cfg::kQInRegs) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) load_q_frag(q_frag[kk], kk);
    __syncthreads();  // Q's shared memory becomes stage buffers
  }

  float o_acc[kDBlocks][4];
#pragma unroll
  for (int nb = 0; nb < kDBlocks; ++nb) o_acc[nb][0] = o_acc[nb][1] = o_acc[nb][2] = o_acc[nb][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // rows g and g + 8, log2 units
  float row_sum[2] = {0.f, 0.f};              // this thread's columns only; quad-summed at the end
  // Sliding window: the sequence positions of rows g and g + 8 (their nodes' L_b + depth).
  int64_t row_pos[2] = {0, 0};
  if (p.window > 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = row0 + warp * 16 + g + 8 * half;
      row_pos[half] = prefix_len + (m < num_rows ? node_depth(p, b, m / group) : 0);
    }
  }

  if (num_tiles > 0) load_tile(0, 0);
  cp_async_commit();

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < num_tiles) load_tile(tile + 1, stage ^ 1);
    cp_async_commit();  // possibly empty, so that "all but the newest group" is always this tile

    const bool is_tree = tile >= num_prefix_tiles;  // uniform over the CTA
    int64_t start, end;
    tile_range(tile, start, end);
    const int valid_cols = static_cast<int>(min_i64(end - start, kBlockN));
    if (is_tree) {
      // Row tid's visible columns of this tile, from its packed ancestor word.
      const int j0 = (tile - num_prefix_tiles) * kBlockN;
      uint64_t word = 0;
      const int m = row0 + tid;
      if (tid < kBlockM && m < num_rows) {
        const int node = m / group;
        word = take_bits(static_cast<uint64_t>(
                             p.mask[b * p.mask_stride_b + node * p.mask_stride_t + (j0 / 64) * p.mask_stride_w]),
                         j0 % 64, valid_cols);
        if (p.window > 0 && word != 0) {
          // Ancestors d levels up are d positions back: drop those the window does not reach.
          const int depth = node_depth(p, b, node);
          for (uint64_t bits = word; bits != 0; bits &= bits - 1) {
            const int j = __ffsll(static_cast<long long>(bits)) - 1;
            if (depth - node_depth(p, b, j0 + j) >= p.window) word &= ~(uint64_t{1} << j);
          }
        }
      }
      if (tid < kBlockM) s_words[tid] = word;
      uint32_t lo32 = static_cast<uint32_t>(word), hi32 = static_cast<uint32_t>(word >> 32);
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        lo32 |= __shfl_xor_sync(0xffffffffu, lo32, off);
        hi32 |= __shfl_xor_sync(0xffffffffu, hi32, off);
      }
      if (lane == 0) s_seen[warp] = (static_cast<uint64_t>(hi32) << 32) | lo32;
    }

    cp_async_wait<1>();
    __syncthreads();  // this tile's K/V (and, first time, Q) and the mask words are visible

    Elem* sk = smem + stage * Cfg::kStageElems;
    Elem* sv = sk + Cfg::kTileElems;
    uint64_t vis_row[2] = {0, 0};
    if (is_tree) {
      uint64_t seen = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) seen |= s_seen[w];
      // Zero the V rows no row of this CTA sees: their probabilities are 0 everywhere, and
      // 0 * NaN would still be NaN.
#pragma unroll
      for (int i = 0; i < kBlockN * kChunks / kThreads; ++i) {
        const int idx = tid + i * kThreads;
        const int r = idx / kChunks;
        if (!((seen >> r) & 1)) *reinterpret_cast<uint4*>(sv + swizzle<kHeadDim>(r, idx % kChunks)) = make_uint4(0, 0, 0, 0);
      }
      vis_row[0] = s_words[warp * 16 + g];
      vis_row[1] = s_words[warp * 16 + g + 8];
      __syncthreads();
    }

    if (warp_active) {
      // ---- S = Q K^T for this warp's 16 rows and kBlockN keys.
      float s[kNBlocks][4];
#pragma unroll
      for (int nb = 0; nb < kNBlocks; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t a[4];
        if constexpr (Cfg::kQInRegs) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[i] = q_frag[kk][i];
        } else {
          load_q_frag(a, kk);
        }
#pragma unroll
        for (int nb2 = 0; nb2 < kNBlocks / 2; ++nb2) {
          // matrices: keys +0..7 / chunk 2kk, keys +0..7 / 2kk+1, keys +8..15 / 2kk, keys +8..15 / 2kk+1
          uint32_t bk[4];
          const int key = nb2 * 16 + (lane >> 4) * 8 + (lane & 7);
          ldmatrix_x4(bk, sk + swizzle<kHeadDim>(key, 2 * kk + ((lane >> 3) & 1)));
          Ops::mma(s[2 * nb2], a, bk[0], bk[1]);
          Ops::mma(s[2 * nb2 + 1], a, bk[2], bk[3]);
        }
      }

      // ---- Scale (and soft-cap), mask, online softmax (base 2).
#pragma unroll
      for (int nb = 0; nb < kNBlocks; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nb * 8 + 2 * t + (e & 1);
          const int half = e >> 1;  // 0: row g, 1: row g + 8
          bool visible;
          if (is_tree) {
            visible = (vis_row[half] >> col) & 1;  // the window is already in the words
          } else {
            visible = col < valid_cols && (p.window <= 0 || row_pos[half] - (start + col) < p.window);
          }
          s[nb][e] = visible ? scaled_score(p, s[nb][e]) : -INFINITY;
        }
      }
      float alpha[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = row_max[half];
#pragma unroll
        for (int nb = 0; nb < kNBlocks; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * half], s[nb][2 * half + 1]));
        mx = quad_max(mx);
        const float ref = mx == -INFINITY ? 0.f : mx;  // nothing seen yet: every exp2 below is 0
        alpha[half] = exp2f(row_max[half] - ref);
        row_max[half] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nb = 0; nb < kNBlocks; ++nb) {
          s[nb][2 * half] = exp2f(s[nb][2 * half] - ref);
          s[nb][2 * half + 1] = exp2f(s[nb][2 * half + 1] - ref);
          sum += s[nb][2 * half] + s[nb][2 * half + 1];
        }
        row_sum[half] = row_sum[half] * alpha[half] + sum;
      }
#pragma unroll
      for (int nb = 0; nb < kDBlocks; ++nb) {
        o_acc[nb][0] *= alpha[0];
        o_acc[nb][1] *= alpha[0];
        o_acc[nb][2] *= alpha[1];
        o_acc[nb][3] *= alpha[1];
      }

      // ---- O += P V: P's A fragments are the S accumulators of n-blocks 2kk, 2kk + 1.
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint32_t a[4] = {Ops::pack2(s[2 * kk][0], s[2 * kk][1]), Ops::pack2(s[2 * kk][2], s[2 * kk][3]),
                               Ops::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               Ops::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int nb2 = 0; nb2 < kDBlocks / 2; ++nb2) {
          // matrices (.trans): keys +0..7 / chunk 2nb2, keys +8..15 / 2nb2, +0..7 / 2nb2+1, +8..15 / 2nb2+1
          uint32_t bv[4];
          const int key = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
          ldmatrix_x4_trans(bv, sv + swizzle<kHeadDim>(key, 2 * nb2 + (lane >> 4)));
          Ops::mma(o_acc[2 * nb2], a, bv[0], bv[1]);
          Ops::mma(o_acc[2 * nb2 + 1], a, bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // everyone is done with this stage before the next iteration refills it
  }
  cp_async_wait<0>();  // nothing may be in flight when the CTA exits (only empty groups remain)

  if (!warp_active) return;
  // ---- Normalise and write: the output (one split) or this split's partials.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int m = row0 + warp * 16 + g + 8 * half;
    const float sum = quad_sum(row_sum[half]);  // all lanes take part, before the row check
    if (m >= num_rows) continue;
    if (p.num_splits == 1) {
      const float inv = 1.f / sum;  // unguarded: no weight at all gives 0 * inf = NaN (see the top)
      const int node = m / group;
      const int head = kv_head * group + m % group;
      Elem* out = static_cast<Elem*>(p.out) + b * p.out_stride_b + node * p.out_stride_t + head * p.out_stride_h;
#pragma unroll
      for (int nb = 0; nb < kDBlocks; ++nb) {
        *reinterpret_cast<uint32_t*>(out + nb * 8 + 2 * t) =
            Ops::pack2(o_acc[nb][2 * half] * inv, o_acc[nb][2 * half + 1] * inv);
      }
    } else {
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // an empty split's partials: 0, weighed 0
      const int64_t part = ((b * p.num_kv_heads + kv_head) * p.num_splits + split) * num_rows + m;
      float* po = p.part_o + part * kHeadDim;
#pragma unroll
      for (int nb = 0; nb < kDBlocks; ++nb) {
        *reinterpret_cast<float2*>(po + nb * 8 + 2 * t) =
            make_float2(o_acc[nb][2 * half] * inv, o_acc[nb][2 * half + 1] * inv);
      }
      // -inf only for an empty split: a NaN sum keeps a NaN lse, which the combine passes on.
      if (t == 0) p.part_lse[part] = sum == 0.f ? -INFINITY : row_max[half] + __log2f(sum);
    }
  }
#endif
}

// One warp per query row: merges the splits' partial outputs by their log2-sum-exp2.
// grid = (ceil(rows / kTreeAttnCombineWarps), Hkv, B). Splits that saw nothing (lse = -inf)
// get weight 0; a row with no mass anywhere gets NaN (0 * (1 / 0)), as the reference; a split
// with a NaN lse gives NaN weights, so NaN reaches the output.
template <typename Elem>
__global__ void __launch_bounds__(kTreeAttnCombineWarps * 32) tree_attention_combine_kernel(const TreeAttentionParams p) {
  using Ops = ElemOps<Elem>;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int num_rows = p.num_nodes * p.group;
  const int m = blockIdx.x * kTreeAttnCombineWarps + warp;
  if (m >= num_rows) return;
  const int kv_head = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int splits = p.num_splits;
  const int64_t first = (b * p.num_kv_heads + kv_head) * splits * static_cast<int64_t>(num_rows) + m;

  float mx = -INFINITY;
  for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, p.part_lse[first + s * static_cast<int64_t>(num_rows)]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const float ref = mx == -INFINITY ? 0.f : mx;
  float total = 0.f;
  for (int s = lane; s < splits; s += 32) total += exp2f(p.part_lse[first + s * static_cast<int64_t>(num_rows)] - ref);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
  const float inv = 1.f / total;  // total >= 1 unless every split is empty (then NaN, see above)

  const int node = m / p.group;
  const int head = kv_head * p.group + m % p.group;
  Elem* out = static_cast<Elem*>(p.out) + b * p.out_stride_b + node * p.out_stride_t + head * p.out_stride_h;
  for (int d = 4 * lane; d < p.value_dim; d += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < splits; ++s) {
      const int64_t part = first + s * static_cast<int64_t>(num_rows);
      const float w = exp2f(p.part_lse[part] - ref);
      if (w == 0.f) continue;  // an empty split: skip its (zero) partials
      const float4 o = *reinterpret_cast<const float4*>(p.part_o + part * p.value_dim + d);
      acc.x += w * o.x;
      acc.y += w * o.y;
      acc.z += w * o.z;
      acc.w += w * o.w;
    }
    out[d] = Ops::from_float(acc.x * inv);
    out[d + 1] = Ops::from_float(acc.y * inv);
    out[d + 2] = Ops::from_float(acc.z * inv);
    out[d + 3] = Ops::from_float(acc.w * inv);
  }
}

// ------------------------------------------------------------------------------- fallback path

// One warp per (row b, node, query head); lane l holds dims l, l + 32, ... (up to 256).
// grid = (ceil(T * Hq / kTreeAttnSimtWarps), B). Only visible keys are read.
template <typename Elem, bool kPaged = false>
__global__ void __launch_bounds__(kTreeAttnSimtWarps * 32) tree_attention_simt_kernel(const TreeAttentionParams p) {
  using Ops = ElemOps<Elem>;
  constexpr int kPerLane = kTreeAttnMaxHeadDim / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int idx = blockIdx.x * kTreeAttnSimtWarps + warp;
  if (idx >= p.num_nodes * p.num_q_heads) return;
  const int64_t b = blockIdx.y;
  const int node = idx / p.num_q_heads;
  const int head = idx % p.num_q_heads;
  const int kv_head = head / p.group;
  const int dim = p.head_dim;

  const Elem* q = static_cast<const Elem*>(p.q) + b * p.q_stride_b + node * p.q_stride_t + head * p.q_stride_h;
  const Elem* k = static_cast<const Elem*>(p.k) + (kPaged ? 0 : b * p.k_stride_b) + kv_head * p.k_stride_h;
  const Elem* v = static_cast<const Elem*>(p.v) + (kPaged ? 0 : b * p.v_stride_b) + kv_head * p.v_stride_h;
  float qr[kPerLane], acc[kPerLane];  // q over D, the output over Dv (both <= 256)
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    qr[i] = d < dim ? Ops::to_float(q[d]) : 0.f;
    acc[i] = 0.f;
  }
  float row_max = -INFINITY, row_sum = 0.f;
  auto attend = [&](int64_t key) {
    const Elem* kr = k + kv_row_offset<kPaged>(p, b, key, p.k_stride_b, p.k_stride_s);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < dim) dot += qr[i] * Ops::to_float(kr[d]);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float score = scaled_score(p, dot);
    const float mx = fmaxf(row_max, score);
    const float ref = mx == -INFINITY ? 0.f : mx;
    const float alpha = exp2f(row_max - ref);
    const float prob = exp2f(score - ref);
    row_max = mx;
    row_sum = row_sum * alpha + prob;
    const Elem* vr = v + kv_row_offset<kPaged>(p, b, key, p.v_stride_b, p.v_stride_s);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < p.value_dim) acc[i] = acc[i] * alpha + prob * Ops::to_float(vr[d]);
    }
  };
  const int64_t prefix_len = clamp_prefix(p.seqlens[b], p.cache_len, p.num_nodes);
  // Sliding window: this node sits at L_b + depth and sees keys after position - window, so
  // prefix keys from L_b + depth - window + 1 and ancestors of depth >= depth - window + 1.
  int min_depth = -1;  // every ancestor (depths are >= 0)
  int64_t first = 0;
  if (p.window > 0) {
    min_depth = node_depth(p, b, node) - p.window + 1;
    first = prefix_len + min_depth;
    first = first < 0 ? 0 : first;
  }
  for (int64_t key = first; key < prefix_len; ++key) attend(key);
  const int64_t* mask = p.mask + b * p.mask_stride_b + node * p.mask_stride_t;
  for (int j0 = 0; j0 < p.num_nodes; j0 += 64) {
    const int count = p.num_nodes - j0 < 64 ? p.num_nodes - j0 : 64;
    uint64_t word = take_bits(static_cast<uint64_t>(mask[(j0 / 64) * p.mask_stride_w]), 0, count);
    while (word != 0) {  // uniform over the warp: every lane reads the same word
      const int j = __ffsll(static_cast<long long>(word)) - 1;
      word &= word - 1;
      if (min_depth > 0 && node_depth(p, b, j0 + j) < min_depth) continue;
      attend(prefix_len + j0 + j);
    }
  }
  const float inv = 1.f / row_sum;  // no weight at all: 0 * inf = NaN, the reference's softmax over nothing
  Elem* out = static_cast<Elem*>(p.out) + b * p.out_stride_b + node * p.out_stride_t + head * p.out_stride_h;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < p.value_dim) out[d] = Ops::from_float(acc[i] * inv);
  }
}

// ------------------------------------------------------------------------------- host side

// Warps per CTA of the tensor-core kernel (16 rows each): 8 (128 rows) when there are more
// than 64 rows, else 4; always 4 at D = 256 (its O accumulator is 128 registers per thread
// and 8 warps with Q in shared memory would need 128 KiB).
inline int tree_attention_mma_warps(int head_dim, int64_t rows) { return head_dim == 256 || rows <= 64 ? 4 : 8; }

// KV splits of the prefix, from shapes only (no host sync): enough CTAs for about two per SM,
// at most one split per 64 allocated cache slots (one key tile), and the fp32 partials (8 B
// per row and dim, written and read back) at most a quarter of the 16-bit K/V bytes (4 B per
// key and dim). (One split per 256 slots until the eleventh session: a decode query of the
// default model, 3 KV heads over ~300 keys, then ran 6 CTAs of 2-3 tiles in series, 17.7 us a
// layer on an H200. Splits past a row's length are empty and cost a CTA start each. Not yet
// measured on a GPU.)
inline int tree_attention_num_splits(int64_t batch, int64_t num_kv_heads, int64_t m_tiles, int64_t rows,
                                     int64_t cache_len, int num_sms) {
  const int64_t ctas = std::max<int64_t>(1, batch * num_kv_heads * m_tiles);
  const int64_t want = (2 * static_cast<int64_t>(num_sms) + ctas - 1) / ctas;
  const int64_t by_length = std::max<int64_t>(1, cache_len / 64);
  const int64_t by_partials = std::max<int64_t>(1, cache_len / (8 * std::max<int64_t>(1, rows)));
  return static_cast<int>(std::max<int64_t>(1, std::min({want, by_length, by_partials, int64_t{kTreeAttnMaxSplits}})));
}

// Launches the tensor-core kernel (and the combine when p.num_splits > 1). p.num_m_tiles
// must be ceil(rows / (16 * kWarps)); part_o / part_lse sized for p.num_splits.
template <typename Elem, int kHeadDim, int kWarps, bool kPaged = false>
cudaError_t launch_tree_attention_mma(const TreeAttentionParams& p, cudaStream_t stream) {
  using Cfg = MmaTileConfig<Elem, kHeadDim, kWarps>;
  auto kernel = tree_attention_mma_kernel<Elem, kHeadDim, kWarps, kPaged>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Cfg::kSmemBytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned int>(p.num_m_tiles * p.num_splits), static_cast<unsigned int>(p.num_kv_heads),
                  static_cast<unsigned int>(p.batch));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  const int rows = p.num_nodes * p.group;
  const dim3 combine_grid(static_cast<unsigned int>((rows + kTreeAttnCombineWarps - 1) / kTreeAttnCombineWarps),
                          static_cast<unsigned int>(p.num_kv_heads), static_cast<unsigned int>(p.batch));
  tree_attention_combine_kernel<Elem><<<combine_grid, kTreeAttnCombineWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename Elem, bool kPaged = false>
cudaError_t launch_tree_attention_simt(const TreeAttentionParams& p, cudaStream_t stream) {
  const int64_t warps = static_cast<int64_t>(p.num_nodes) * p.num_q_heads;
  const dim3 grid(static_cast<unsigned int>((warps + kTreeAttnSimtWarps - 1) / kTreeAttnSimtWarps),
                  static_cast<unsigned int>(p.batch));
  tree_attention_simt_kernel<Elem, kPaged><<<grid, kTreeAttnSimtWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

// Whether the tensor-core kernel takes this head dim (the caller also checks dtype, sm_80+
// and 16-byte alignment of every row).
inline bool tree_attention_mma_head_dim(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

// The tensor-core launch for a 16-bit Elem, by head dim and warps (tree_attention_mma_warps).
template <typename Elem, bool kPaged = false>
cudaError_t launch_tree_attention_mma_dispatch(const TreeAttentionParams& p, int warps, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return warps == 8 ? launch_tree_attention_mma<Elem, 64, 8, kPaged>(p, stream)
                        : launch_tree_attention_mma<Elem, 64, 4, kPaged>(p, stream);
    case 128:
      return warps == 8 ? launch_tree_attention_mma<Elem, 128, 8, kPaged>(p, stream)
                        : launch_tree_attention_mma<Elem, 128, 4, kPaged>(p, stream);
    case 256:
      return launch_tree_attention_mma<Elem, 256, 4, kPaged>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace specdec
