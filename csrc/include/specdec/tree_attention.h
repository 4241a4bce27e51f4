// Tree attention on the CPU: plain C++ over raw pointers and strides, no torch.
//
// Query i of row b (of T tree nodes) attends to the row's prefix keys 0 .. L_b-1 and to
// tree key L_b + j iff mask bit (i, j). Options (0: off): a sliding window W, where a query
// at sequence position p (node i: L_b + depth(i), its depth counted from the mask) sees a
// key at position k (prefix key s: s; tree node j: L_b + depth(j)) only if p - k < W, so
// keys before L_b - W + 1 are never read; and soft-capping, scores -> c * tanh(score / c).
// Values may have their own head dim Dv (MLA); scores use the key dim D. The work unit is one (row, KV head, key range):
// the `group = Hq / Hkv` query heads of all T nodes that share the KV head form one block
// of M = T * group query rows, so each key and value row is read once for all of them.
// Keys are processed in tiles of kTileKeys with an online (running max) softmax in fp32;
// a key range's result is either normalised straight into the output or kept as a partial
// (unnormalised sum, max, denominator) that combine_partials merges with the other ranges
// of the same (row, KV head) by log-sum-exp, so long prefixes can be split across threads.
// A decode or verify step's few queries take all KV heads of a row together, tile by tile
// (attend_keys_all_heads), so each tile of the cache is read as one contiguous stretch.
//
// Speed: the inner loops use GCC/Clang vector extensions (16 floats) and, with GCC on
// x86-64 Linux, are compiled for AVX-512, AVX2+FMA and baseline x86-64, picked at load
// time (target_clones), since the extension is built without -march. The blocking is
// tuned for AVX-512 (32 vector registers); the AVX2 clone is correct but spills.
// Layouts are chosen so that no loop needs a horizontal reduction: queries are
// transposed once per unit to [D][M] (scaled), so scores come out as [key][query] with
// the queries along the vector lanes (max, exp and sums over keys are then plain
// lane-wise operations), and P @ V runs along D. fp32 keys and values are read in place:
// a dense cache's tile is rows one stride apart, a paged cache's tile is a list of row
// pointers (page by page), so a tile spans page boundaries at the dense tile size.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "specdec/dtypes.h"  // BFloat16Bits, HalfBits, to_float, from_float

// 64-byte vector arguments of always-inline helpers would change the ABI without AVX-512;
// they never cross a real call, so the warning is noise. (GCC reports it at the end of
// the translation unit, so it cannot be pushed and popped around this header.)
#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SPECDEC_CPU_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPECDEC_CPU_MULTIVERSION
#endif
#define SPECDEC_CPU_INLINE inline __attribute__((always_inline))

namespace specdec {
namespace cpu {

namespace attention_detail {

constexpr int64_t kLanes = 16;     // floats per vector
constexpr int64_t kTileKeys = 64;  // keys per softmax tile: scores [64][M] stay in L1/L2

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
// Half a vector: query lanes are processed in multiples of 8, so a block of M = 18 or 24
// queries computes 24 lanes, not 32.
typedef float HalfVec __attribute__((vector_size(kLanes / 2 * sizeof(float))));

// The helpers work on either vector type V; a comparison of two V gives the matching
// vector of int32 lane masks (all ones or all zeros).
template <typename V>
SPECDEC_CPU_INLINE V splat(float x) {
  return V{} + x;
}
template <typename V = Vec>
SPECDEC_CPU_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
SPECDEC_CPU_INLINE void store(float* p, const V& v) {
  std::memcpy(p, &v, sizeof(v));
}
template <typename V, typename Mask>
SPECDEC_CPU_INLINE V select(const Mask& mask, const V& a, const V& b) {
  return (V)((mask & (Mask)a) | (~mask & (Mask)b));
}
template <typename V>
SPECDEC_CPU_INLINE V vmax(const V& a, const V& b) {
  return select(a > b, a, b);
}

// e^x for x <= 0 (all callers pass differences to a running max), exactly 0 below -87
// (where e^x would be subnormal) and for -inf; relative error a few ulp. e^x = 2^n e^r
// with n = rint(x / ln 2), |r| <= ln 2 / 2, and a degree-6 polynomial for e^r.
// NaN in, NaN out: a NaN score (NaN in q or k, or inf * 0) or an inf - inf (a +inf score
// minus the running max it set) makes its query's probabilities and denominator NaN, so the
// output is NaN exactly where a softmax over the same scores (the reference) gives NaN.
template <typename V>
SPECDEC_CPU_INLINE V exp_nonpositive(const V& input) {
  using Bits = decltype(input < input);
  const Bits underflow = input < splat<V>(-87.0f);
  // The clamp keeps NaN (a comparison with NaN is false, so NaN is not `underflow`).
  const V x = select(underflow, splat<V>(-87.0f), input);
  // Adding 1.5 * 2^23 rounds x / ln 2 to an integer held in the low mantissa bits.
  const V shifter = splat<V>(12582912.0f);
  const V shifted = x * splat<V>(1.44269504088896341f) + shifter;
  const V n = shifted - shifter;
  V r = x - n * splat<V>(0.693359375f);  // ln 2 in two parts, so r is exact enough
  r = r - n * splat<V>(-2.12194440e-4f);
  V p = splat<V>(1.9875691500e-4f);
  p = p * r + splat<V>(1.3981999507e-3f);
  p = p * r + splat<V>(8.3334519073e-3f);
  p = p * r + splat<V>(4.1665795894e-2f);
  p = p * r + splat<V>(1.6666665459e-1f);
  p = p * r + splat<V>(5.0000001201e-1f);
  p = p * (r * r) + r + splat<V>(1.0f);
  // 2^n: n + 127 in the exponent field (n >= -126 after the clamp, so a normal number).
  const Bits two_n = ((Bits)shifted - (Bits)shifter + 127) << 23;
  return select(underflow, splat<V>(0.0f), p * (V)two_n);
}

// ----------------------------------------------------------------------------- tile kernels

// Where a tile's key / value rows are. StridedRows: rows `stride` floats apart (a dense cache,
// or the scratch tiles); RowList: one pointer per row (a paged cache, read in place). The
// tile kernels take either, so paged tiles need neither a copy nor a cut at each page end.
struct StridedRows {
  const float* base;
  int64_t stride;
  SPECDEC_CPU_INLINE const float* operator[](int64_t n) const { return base + n * stride; }
  SPECDEC_CPU_INLINE StridedRows from(int64_t n) const { return {base + n * stride, stride}; }
};
struct RowList {
  const float* const* rows;
  SPECDEC_CPU_INLINE const float* operator[](int64_t n) const { return rows[n]; }
  SPECDEC_CPU_INLINE RowList from(int64_t n) const { return {rows + n}; }
};

// For kKeys keys r and the query lanes of kVecs full vectors plus, if kHalf, a half vector:
// scores[r][lane] = sum_d keys[r][d] * queries_t[d][lane].
template <int kKeys, int kVecs, bool kHalf, typename Rows>
SPECDEC_CPU_INLINE void score_block(const float* queries_t, int64_t stride, const Rows& keys, int64_t head_dim,
                                    float* scores) {
  Vec acc[kKeys][kVecs > 0 ? kVecs : 1] = {};
  HalfVec acc_half[kKeys] = {};
  const float* key[kKeys];
  for (int r = 0; r < kKeys; ++r) key[r] = keys[r];
  for (int64_t d = 0; d < head_dim; ++d) {
    const float* q_row = queries_t + d * stride;
    Vec q[kVecs > 0 ? kVecs : 1];
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) q[c] = load(q_row + c * kLanes);
    const HalfVec q_half = kHalf ? load<HalfVec>(q_row + kVecs * kLanes) : HalfVec{};
#pragma GCC unroll 8
    for (int r = 0; r < kKeys; ++r) {
      const float k = key[r][d];
#pragma GCC unroll 4
      for (int c = 0; c < kVecs; ++c) acc[r][c] += q[c] * k;
      if (kHalf) acc_half[r] += q_half * k;
    }
  }
  for (int r = 0; r < kKeys; ++r) {
    for (int c = 0; c < kVecs; ++c) store(scores + r * stride + c * kLanes, acc[r][c]);
    if (kHalf) store(scores + r * stride + kVecs * kLanes, acc_half[r]);
  }
}

// All keys against one group of lanes; blocks of more keys when the group is narrow, so
// each loaded query vector feeds enough multiply-adds.
template <int kVecs, bool kHalf, typename Rows, int kKeys = (kVecs + kHalf <= 2 ? 8 : 4)>
SPECDEC_CPU_INLINE void score_lanes(const float* queries_t, int64_t stride, const Rows& keys, int64_t num_keys,
                                    int64_t head_dim, float* scores) {
  int64_t n = 0;
  for (; n + kKeys <= num_keys; n += kKeys) {
    score_block<kKeys, kVecs, kHalf>(queries_t, stride, keys.from(n), head_dim, scores + n * stride);
  }
  for (; n < num_keys; ++n) {
    score_block<1, kVecs, kHalf>(queries_t, stride, keys.from(n), head_dim, scores + n * stride);
  }
}

// kNarrow's score block: kKeys keys against kGroups groups of 8 query lanes, in 8-float
// vectors only: kKeys * kGroups accumulators (at most 12 of AVX2's 16 registers, beside the
// kGroups query vectors and one broadcast key element). Each key element loaded feeds
// kGroups multiply-adds and each query vector kKeys.
template <int kKeys, int kGroups, typename Rows>
SPECDEC_CPU_INLINE void score_block_narrow(const float* queries_t, int64_t stride, const Rows& keys, int64_t head_dim,
                                           float* scores) {
  HalfVec acc[kKeys][kGroups];
#pragma GCC unroll 12
  for (int r = 0; r < kKeys; ++r) {
    for (int g = 0; g < kGroups; ++g) acc[r][g] = splat<HalfVec>(0.0f);
  }
  const float* key[kKeys];
  for (int r = 0; r < kKeys; ++r) key[r] = keys[r];
  for (int64_t d = 0; d < head_dim; ++d) {
    HalfVec q[kGroups];
#pragma GCC unroll 3
    for (int g = 0; g < kGroups; ++g) q[g] = load<HalfVec>(queries_t + d * stride + g * (kLanes / 2));
#pragma GCC unroll 8
    for (int r = 0; r < kKeys; ++r) {
      const float k = key[r][d];
#pragma GCC unroll 3
      for (int g = 0; g < kGroups; ++g) acc[r][g] += q[g] * k;
    }
  }
  for (int r = 0; r < kKeys; ++r) {
    for (int g = 0; g < kGroups; ++g) store(scores + r * stride + g * (kLanes / 2), acc[r][g]);
  }
}

// All keys against kGroups groups of 8 lanes: blocks of kKeys keys, then one key at a time.
template <int kKeys, int kGroups, typename Rows>
SPECDEC_CPU_INLINE void score_lanes_narrow(const float* queries_t, int64_t stride, const Rows& keys, int64_t num_keys,
                                           int64_t head_dim, float* scores) {
  int64_t n = 0;
  for (; n + kKeys <= num_keys; n += kKeys) {
    score_block_narrow<kKeys, kGroups>(queries_t, stride, keys.from(n), head_dim, scores + n * stride);
  }
  for (; n < num_keys; ++n) {
    score_block_narrow<1, kGroups>(queries_t, stride, keys.from(n), head_dim, scores + n * stride);
  }
}

// scores [num_keys][stride] = keys [num_keys][head_dim] (rows as `keys` says) @
// queries_t [head_dim][stride], for the first `lanes` query lanes (a multiple of 8).
// kNarrow: for CPUs without AVX-512 (the AVX2 and baseline clones): 8-float vectors only
// (HalfVec, one AVX2 register) and at most 12 accumulators. GCC lowers the 16-float `Vec`
// there through the stack (two thirds of the wide code's instructions were loads and stores
// of spilled halves), which made the decode shape ~10x slower than these blocks on an AVX2
// machine. The blocks let each loaded element feed several multiply-adds and keep 9-12
// independent FMA chains (3 lane groups x 4 keys here, 6 rows x 16 columns in probs @ values):
// on the 2-core AMD EPYC a 6-node verify over 700-1400 keys ran 1.2x faster than with 1 group
// x 8 keys and 4 rows a pass (the same sums in the same order, bit for bit).
template <bool kNarrow, typename Rows>
SPECDEC_CPU_INLINE void tile_scores_impl(const float* queries_t, int64_t stride, int64_t lanes, const Rows& keys,
                                         int64_t num_keys, int64_t head_dim, float* scores) {
  if constexpr (kNarrow) {
    // Up to 3 groups of 8 lanes a pass (24 lanes: a 6-node tree of 3 query heads per KV
    // head), so a key element is loaded once per 24 lanes, not once per 8.
    for (int64_t c = 0; c < lanes;) {
      switch (std::min<int64_t>(3, (lanes - c) / (kLanes / 2))) {
        case 3: score_lanes_narrow<4, 3>(queries_t + c, stride, keys, num_keys, head_dim, scores + c); c += 3 * kLanes / 2; break;
        case 2: score_lanes_narrow<5, 2>(queries_t + c, stride, keys, num_keys, head_dim, scores + c); c += kLanes; break;
        default: score_lanes_narrow<8, 1>(queries_t + c, stride, keys, num_keys, head_dim, scores + c); c += kLanes / 2; break;
      }
    }
    return;
  }
  for (int64_t c = 0; c < lanes; c += 4 * kLanes) {
    const float* q = queries_t + c;
    float* s = scores + c;
    const int64_t left = lanes - c;
    const bool half = left < 4 * kLanes && left % kLanes != 0;
    switch (std::min<int64_t>(4, left / kLanes) * 2 + half) {
      case 1: score_lanes<0, true>(q, stride, keys, num_keys, head_dim, s); break;
      case 2: score_lanes<1, false>(q, stride, keys, num_keys, head_dim, s); break;
      case 3: score_lanes<1, true>(q, stride, keys, num_keys, head_dim, s); break;
      case 4: score_lanes<2, false>(q, stride, keys, num_keys, head_dim, s); break;
      case 5: score_lanes<2, true>(q, stride, keys, num_keys, head_dim, s); break;
      case 6: score_lanes<3, false>(q, stride, keys, num_keys, head_dim, s); break;
      case 7: score_lanes<3, true>(q, stride, keys, num_keys, head_dim, s); break;
      default: score_lanes<4, false>(q, stride, keys, num_keys, head_dim, s); break;
    }
  }
}
// Whether the kernels run the narrow blocks (tile_scores_impl): on CPUs without AVX-512,
// whose clones have 16 vector registers of at most 8 floats. The environment variable
// SPECDEC_TREE_ATTENTION_BLOCKS ("narrow" or "wide", read once) overrides it, so tests reach
// both on any x86 CPU (either is correct on any CPU; only the speed differs).
inline bool narrow_vectors() {
  static const bool narrow = [] {
    const char* blocks = std::getenv("SPECDEC_TREE_ATTENTION_BLOCKS");
    if (blocks != nullptr && std::strcmp(blocks, "narrow") == 0) return true;
    if (blocks != nullptr && std::strcmp(blocks, "wide") == 0) return false;
#if defined(__GNUC__) && defined(__x86_64__)
    return !__builtin_cpu_supports("avx512f");
#else
    return false;
#endif
  }();
  return narrow;
}
template <typename Rows>
SPECDEC_CPU_INLINE void tile_scores_blocks(const float* queries_t, int64_t stride, int64_t lanes, const Rows& keys,
                                           int64_t num_keys, int64_t head_dim, float* scores) {
  if (narrow_vectors()) {
    tile_scores_impl<true>(queries_t, stride, lanes, keys, num_keys, head_dim, scores);
  } else {
    tile_scores_impl<false>(queries_t, stride, lanes, keys, num_keys, head_dim, scores);
  }
}
SPECDEC_CPU_MULTIVERSION
inline void tile_scores(const float* queries_t, int64_t stride, int64_t lanes, StridedRows keys, int64_t num_keys,
                        int64_t head_dim, float* scores) {
  tile_scores_blocks(queries_t, stride, lanes, keys, num_keys, head_dim, scores);
}
SPECDEC_CPU_MULTIVERSION
inline void tile_scores(const float* queries_t, int64_t stride, int64_t lanes, RowList keys, int64_t num_keys,
                        int64_t head_dim, float* scores) {
  tile_scores_blocks(queries_t, stride, lanes, keys, num_keys, head_dim, scores);
}

// acc[r][c*16 + lane] += sum_n probs[n][r] * values[n][c*16 + lane], r < kRows, c < kVecs.
template <int kRows, int kVecs, typename Rows>
SPECDEC_CPU_INLINE void pv_block(const float* probs, int64_t p_stride, const Rows& values, int64_t column,
                                 int64_t num_keys, float* acc, int64_t acc_stride) {
  Vec o[kRows][kVecs] = {};
  for (int64_t n = 0; n < num_keys; ++n) {
    Vec v[kVecs];
    const float* row = values[n] + column;
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) v[c] = load(row + c * kLanes);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const float p = probs[n * p_stride + r];
#pragma GCC unroll 4
      for (int c = 0; c < kVecs; ++c) o[r][c] += v[c] * p;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kVecs; ++c) {
      float* out = acc + r * acc_stride + c * kLanes;
      store(out, load(out) + o[r][c]);
    }
  }
}

template <int kRows, bool kNarrow, typename Rows>
SPECDEC_CPU_INLINE void pv_rows(const float* probs, int64_t p_stride, const Rows& values, int64_t padded_dim,
                                int64_t num_keys, float* acc) {
  const int64_t total_vecs = padded_dim / kLanes;
  if constexpr (kNarrow) {  // 16 columns a pass, in 8-float vectors (tile_scores_impl says why)
    for (int64_t column = 0; column < padded_dim; column += kLanes) {
      HalfVec o[kRows][2] = {};
      for (int64_t n = 0; n < num_keys; ++n) {
        const float* row = values[n] + column;
        const HalfVec v0 = load<HalfVec>(row), v1 = load<HalfVec>(row + kLanes / 2);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          const float p = probs[n * p_stride + r];
          o[r][0] += v0 * p;
          o[r][1] += v1 * p;
        }
      }
      for (int r = 0; r < kRows; ++r) {
        float* out = acc + r * padded_dim + column;
        store(out, load<HalfVec>(out) + o[r][0]);
        store(out + kLanes / 2, load<HalfVec>(out + kLanes / 2) + o[r][1]);
      }
    }
    return;
  }
  for (int64_t c = 0; c < total_vecs; c += 4) {
    const int64_t column = c * kLanes;
    float* o = acc + column;
    switch (std::min<int64_t>(4, total_vecs - c)) {
      case 1: pv_block<kRows, 1>(probs, p_stride, values, column, num_keys, o, padded_dim); break;
      case 2: pv_block<kRows, 2>(probs, p_stride, values, column, num_keys, o, padded_dim); break;
      case 3: pv_block<kRows, 3>(probs, p_stride, values, column, num_keys, o, padded_dim); break;
      default: pv_block<kRows, 4>(probs, p_stride, values, column, num_keys, o, padded_dim); break;
    }
  }
}

// The last `count` (< kGroup) accumulator rows in one pass over the values.
template <int kGroup, bool kNarrow, typename Rows>
SPECDEC_CPU_INLINE void pv_last_rows(int64_t count, const float* probs, int64_t p_stride, const Rows& values,
                                     int64_t padded_dim, int64_t num_keys, float* acc) {
  if constexpr (kGroup > 1) {
    if (count == kGroup - 1) {
      pv_rows<kGroup - 1, kNarrow>(probs, p_stride, values, padded_dim, num_keys, acc);
      return;
    }
    pv_last_rows<kGroup - 1, kNarrow>(count, probs, p_stride, values, padded_dim, num_keys, acc);
  }
}

// acc[m] += probs[.][m] @ values for all `rows` accumulator rows, kGroup rows a pass.
template <int kGroup, bool kNarrow, typename Rows>
SPECDEC_CPU_INLINE void pv_all_rows(const float* probs, int64_t p_stride, const Rows& values, int64_t padded_dim,
                                    int64_t num_keys, int64_t rows, float* acc) {
  int64_t m = 0;
  for (; m + kGroup <= rows; m += kGroup) {
    pv_rows<kGroup, kNarrow>(probs + m, p_stride, values, padded_dim, num_keys, acc + m * padded_dim);
  }
  pv_last_rows<kGroup, kNarrow>(rows - m, probs + m, p_stride, values, padded_dim, num_keys, acc + m * padded_dim);
}

// The online-softmax update of one group of query lanes (V: a full or half vector) for a
// tile of scores: running max and denominator, the factor alpha that rescales what was
// accumulated before, and the scores replaced by the probabilities.
template <typename V>
SPECDEC_CPU_INLINE void softmax_lanes(float* scores, int64_t num_keys, int64_t stride, float* row_max, float* row_sum,
                                      float* alpha) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  V tile_max = splat<V>(neg_inf);
  for (int64_t n = 0; n < num_keys; ++n) tile_max = vmax(tile_max, load<V>(scores + n * stride));
  const V old_max = load<V>(row_max);
  const V new_max = vmax(old_max, tile_max);
  // A query that has seen no visible key yet keeps max -inf; subtracting 0 instead keeps
  // its probabilities at exactly 0 rather than NaN (-inf - -inf).
  const V shift = select(new_max == splat<V>(neg_inf), splat<V>(0.0f), new_max);
  const V scale = exp_nonpositive(old_max - shift);
  V sum = load<V>(row_sum) * scale;
  for (int64_t n = 0; n < num_keys; ++n) {
    float* s = scores + n * stride;
    const V p = exp_nonpositive(load<V>(s) - shift);
    store(s, p);
    sum += p;
  }
  store(row_max, new_max);
  store(row_sum, sum);
  store(alpha, scale);
}

// One online-softmax step over a tile of scores [num_keys][stride] (masked entries -inf)
// for the first `lanes` query lanes: updates the running max and denominator of each,
// rescales the first `rows` accumulator rows [rows][padded_dim], overwrites scores with
// the probabilities and adds probs^T @ values [num_keys][padded_dim] (rows as `values`
// says) into the accumulators.
template <bool kNarrow, typename Rows>
SPECDEC_CPU_INLINE void tile_softmax_pv_impl(float* scores, int64_t num_keys, int64_t stride, int64_t lanes,
                                             int64_t rows, const Rows& values, int64_t padded_dim, float* row_max,
                                             float* row_sum, float* alpha, float* acc) {
  int64_t c = 0;
  if constexpr (!kNarrow) {
    for (; c + kLanes <= lanes; c += kLanes) {
      softmax_lanes<Vec>(scores + c, num_keys, stride, row_max + c, row_sum + c, alpha + c);
    }
  }
  for (; c < lanes; c += kLanes / 2) {
    softmax_lanes<HalfVec>(scores + c, num_keys, stride, row_max + c, row_sum + c, alpha + c);
  }
  for (int64_t m = 0; m < rows; ++m) {
    if (alpha[m] == 1.0f) continue;  // max unchanged: the common case after the first tiles
    float* out = acc + m * padded_dim;
    const HalfVec a = splat<HalfVec>(alpha[m]);
    for (int64_t d = 0; d < padded_dim; d += kLanes / 2) store(out + d, load<HalfVec>(out + d) * a);
  }
  // probs @ values, a group of rows a pass: 6 with 8-float vectors (12 accumulators of 16
  // columns x 6 rows, so each value vector loaded feeds 6 multiply-adds and the FMA chains are
  // enough to hide their latency), 4 with 16-float ones.
  pv_all_rows<kNarrow ? 6 : 4, kNarrow>(scores, stride, values, padded_dim, num_keys, rows, acc);
}
// The block layout this CPU runs (narrow_vectors), inlined into each clone below (target_clones
// takes no templates, hence one clone set per row kind).
template <typename Rows>
SPECDEC_CPU_INLINE void tile_softmax_pv_blocks(float* scores, int64_t num_keys, int64_t stride, int64_t lanes,
                                               int64_t rows, const Rows& values, int64_t padded_dim, float* row_max,
                                               float* row_sum, float* alpha, float* acc) {
  if (narrow_vectors()) {
    tile_softmax_pv_impl<true>(scores, num_keys, stride, lanes, rows, values, padded_dim, row_max, row_sum, alpha,
                               acc);
  } else {
    tile_softmax_pv_impl<false>(scores, num_keys, stride, lanes, rows, values, padded_dim, row_max, row_sum, alpha,
                                acc);
  }
}
SPECDEC_CPU_MULTIVERSION
inline void tile_softmax_pv(float* scores, int64_t num_keys, int64_t stride, int64_t lanes, int64_t rows,
                            StridedRows values, int64_t padded_dim, float* row_max, float* row_sum, float* alpha,
                            float* acc) {
  tile_softmax_pv_blocks(scores, num_keys, stride, lanes, rows, values, padded_dim, row_max, row_sum, alpha, acc);
}
SPECDEC_CPU_MULTIVERSION
inline void tile_softmax_pv(float* scores, int64_t num_keys, int64_t stride, int64_t lanes, int64_t rows,
                            RowList values, int64_t padded_dim, float* row_max, float* row_sum, float* alpha,
                            float* acc) {
  tile_softmax_pv_blocks(scores, num_keys, stride, lanes, rows, values, padded_dim, row_max, row_sum, alpha, acc);
}

// Soft-capping of a tile of scores [num_keys][stride], first `lanes` query lanes (a multiple
// of 8; the stride, a multiple of 16, leaves room to round them up to whole vectors):
// x -> cap * tanh(x / cap), with tanh(a) = sign(a) (1 - e^(-2|a|)) / (1 + e^(-2|a|)) so that
// the exponential's argument is <= 0 (exp_nonpositive). Error: a few ulp of cap for large
// |x|, ~1e-7 * cap absolute near 0; +-inf -> +-cap, NaN stays NaN.
SPECDEC_CPU_MULTIVERSION
inline void softcap_scores(float* scores, int64_t num_keys, int64_t stride, int64_t lanes, float cap) {
  const Vec two_over_cap = splat<Vec>(2.0f / cap), cap_v = splat<Vec>(cap), one = splat<Vec>(1.0f);
  for (int64_t n = 0; n < num_keys; ++n) {
    float* row = scores + n * stride;
    for (int64_t c = 0; c < lanes; c += kLanes) {
      const Vec x = load(row + c);
      const auto negative = x < splat<Vec>(0.0f);
      const Vec e = exp_nonpositive(select(negative, x, -x) * two_over_cap);  // e^(-2|x| / cap)
      const Vec t = (one - e) / (one + e) * cap_v;
      store(row + c, select(negative, -t, t));
    }
  }
}

// ----------------------------------------------------------------------------- row loads

// One row to fp32 (the 16-bit conversions vectorise in the AVX2 / AVX-512 clones).
inline void load_row(const float* src, int64_t count, float* dst) { std::memcpy(dst, src, count * sizeof(float)); }
SPECDEC_CPU_MULTIVERSION
inline void load_row(const BFloat16Bits* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = to_float(src[i]);
}
SPECDEC_CPU_MULTIVERSION
inline void load_row(const HalfBits* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = to_float(src[i]);
}

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

}  // namespace attention_detail

// ----------------------------------------------------------------------------- problem

// Which tree keys each query sees: bool [B, T, T] (element strides) or packed int64
// [B, T, ceil(T/64)] words (word strides; bit j % 64 of word j / 64). Strides may be 0
// (a mask shared by all rows).
struct TreeMaskView {
  const bool* dense = nullptr;
  const int64_t* packed = nullptr;
  int64_t stride_b = 0, stride_t = 0, stride_col = 0;
  // Every row's mask is a causal chain, query t seeing exactly nodes 0 .. t (a prefill chunk,
  // or a chain draft; `is_causal_chain`): the kernels then know who sees a tree key without
  // reading the mask, and skip the queries that see none of a tile's keys.
  bool chain = false;

  bool visible(int64_t b, int64_t query, int64_t key) const {
    const int64_t base = b * stride_b + query * stride_t;
    if (dense != nullptr) return dense[base + key * stride_col];
    const uint64_t word = static_cast<uint64_t>(packed[base + (key >> 6) * stride_col]);
    return (word >> (key & 63)) & 1u;
  }
};

// Whether every one of the `batch` rows of mask `m` over `num_nodes` nodes is a causal chain
// (query t sees exactly nodes 0 .. t). Reads the whole mask: B x T x ceil(T / 64) words packed,
// B x T x T bools (once where rows share it: stride_b 0); a packed word's bits past T are not
// part of the mask and are ignored.
inline bool is_causal_chain(const TreeMaskView& m, int64_t batch, int64_t num_nodes) {
  const int64_t rows = m.stride_b == 0 ? std::min<int64_t>(batch, 1) : batch;
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t t = 0; t < num_nodes; ++t) {
      const int64_t base = b * m.stride_b + t * m.stride_t;
      if (m.dense != nullptr) {
        for (int64_t j = 0; j < num_nodes; ++j) {
          if (m.dense[base + j * m.stride_col] != (j <= t)) return false;
        }
        continue;
      }
      for (int64_t w = 0; w * 64 < num_nodes; ++w) {
        auto low_bits = [](int64_t n) { return n <= 0 ? uint64_t{0} : n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1; };
        const uint64_t word = static_cast<uint64_t>(m.packed[base + w * m.stride_col]);
        if ((word & low_bits(num_nodes - w * 64)) != low_bits(t + 1 - w * 64)) return false;
      }
    }
  }
  return true;
}

// One call's inputs. Strides are in elements; the last dim of q, k and v is contiguous.
// q [B, T, Hq, D], k/v [B, S, Hkv, D], cache_seqlens [B] with L_b + T <= S (checked by
// the caller), output [B, T, Hq, D] contiguous.
template <typename Scalar>
struct TreeAttentionProblem {
  const Scalar* q;
  int64_t q_stride_b, q_stride_t, q_stride_h;
  const Scalar* k;
  int64_t k_stride_b, k_stride_s, k_stride_h;
  const Scalar* v;
  int64_t v_stride_b, v_stride_s, v_stride_h;
  TreeMaskView mask;
  const int32_t* cache_seqlens;
  int64_t num_nodes, num_q_heads, num_kv_heads, head_dim;
  int64_t value_dim;   // Dv: the values' and the output's head dim (head_dim: queries' and keys')
  float scale;
  int64_t window = 0;   // sliding window in positions; 0: none
  float softcap = 0.0f;  // soft-capping of the scaled scores; 0: none
  Scalar* out;
  // Paged caches (block_table != nullptr): k and v are pools of pages [num_pages, page_size,
  // Hkv, D], so k_stride_b / v_stride_b are page strides, and key s of row b lives in page
  // block_table[b * block_table_stride + s / page_size], slot s % page_size (the caller
  // checked every page id a row uses).
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0, page_size = 0;
  int page_shift = -1;  // log2(page_size) for a power of two (shift, no division)

  // Key (value) s of row b of a dense cache (paged caches: paged_rows).
  const Scalar* key_row(int64_t b, int64_t kv_head, int64_t s) const {
    return k + b * k_stride_b + s * k_stride_s + kv_head * k_stride_h;
  }
  const Scalar* value_row(int64_t b, int64_t kv_head, int64_t s) const {
    return v + b * v_stride_b + s * v_stride_s + kv_head * v_stride_h;
  }
  // Row pointers of keys first .. first + count - 1 of row b (KV head kv_head) of a paged
  // cache, page by page: one block-table read per page, not per key.
  void paged_rows(int64_t b, int64_t kv_head, int64_t first, int64_t count, const Scalar** key_rows,
                  const Scalar** value_rows) const {
    const int32_t* pages = block_table + b * block_table_stride;
    for (int64_t n = 0; n < count;) {
      const int64_t pos = first + n;
      const int64_t page = page_shift >= 0 ? pos >> page_shift : pos / page_size;  // no division for 16/32/64
      const int64_t slot = pos - page * page_size;
      const int64_t run = std::min(count - n, page_size - slot);
      const Scalar* key = k + pages[page] * k_stride_b + slot * k_stride_s + kv_head * k_stride_h;
      const Scalar* value = v + pages[page] * v_stride_b + slot * v_stride_s + kv_head * v_stride_h;
      for (int64_t i = 0; i < run; ++i) {
        key_rows[n + i] = key + i * k_stride_s;
        value_rows[n + i] = value + i * v_stride_s;
      }
      n += run;
    }
  }

  int64_t group() const { return num_q_heads / num_kv_heads; }
  int64_t rows() const { return num_nodes * group(); }               // M: queries per (row, KV head)
  int64_t num_keys(int64_t b) const { return cache_seqlens[b] + num_nodes; }  // keys row b may read
  // The first key any query of row b sees: with a window, the root (position L_b) sees no
  // key at or before L_b - window, and every other query sits at a later position.
  int64_t first_key(int64_t b) const {
    return window > 0 ? std::max<int64_t>(0, cache_seqlens[b] - window + 1) : 0;
  }
  int64_t partial_size() const { return rows() * (value_dim + 2); }  // floats per partial result
};

// Per-thread buffers, reused across units and calls (sized on first use).
class TreeAttentionScratch {
 public:
  float* queries_t = nullptr;  // [D][Mp], scaled
  float* keys = nullptr;       // [kTileKeys][max(D, Dv)] (also one query or value row)
  float* values = nullptr;     // [kTileKeys][Dvp], zero padded
  float* scores = nullptr;     // [kTileKeys][Mp]
  float* row_max = nullptr;    // [Mp]
  float* row_sum = nullptr;    // [Mp]
  float* alpha = nullptr;      // [Mp]
  float* acc = nullptr;        // [Mp][Dvp]
  int64_t padded_rows = 0, padded_dim = 0;  // Mp, Dvp (the value dim padded to the vectors)
  std::vector<int64_t> depth;  // [T] each query's depth in the tree (sliding windows only)
  int64_t window_end = 0;      // sliding windows: keys below it need the position test (begin_unit)

  void prepare(int64_t rows, int64_t head_dim, int64_t value_dim) {
    using namespace attention_detail;
    padded_rows = round_up(rows, kLanes);
    padded_dim = round_up(value_dim, kLanes);
    const int64_t sizes[] = {head_dim * padded_rows, kTileKeys * std::max(head_dim, value_dim), kTileKeys * padded_dim,
                             kTileKeys * padded_rows, padded_rows, padded_rows, padded_rows,
                             padded_rows * padded_dim};
    int64_t total = 0;
    for (int64_t size : sizes) total += round_up(size, kLanes);
    if (static_cast<int64_t>(storage_.size()) < total + kLanes) storage_.assign(total + kLanes, 0.0f);
    // 64-byte aligned regions (vector loads never split a cache line).
    const uintptr_t base = reinterpret_cast<uintptr_t>(storage_.data());
    float* p = storage_.data() + ((64 - base % 64) % 64) / sizeof(float);
    float** regions[] = {&queries_t, &keys, &values, &scores, &row_max, &row_sum, &alpha, &acc};
    for (int i = 0; i < 8; ++i) {
      *regions[i] = p;
      p += round_up(sizes[i], kLanes);
    }
  }

 private:
  std::vector<float> storage_;
};

// The start of a unit (row b, KV head kv_head): its M = T * group queries scaled and transposed
// to [D][Mp] in s, the running max, denominator and accumulators reset, and with a sliding
// window each query's depth in the tree.
template <typename Scalar>
void begin_unit(const TreeAttentionProblem<Scalar>& p, int64_t b, int64_t kv_head, TreeAttentionScratch& s) {
  using namespace attention_detail;
  const int64_t group = p.group();
  const int64_t rows = p.rows();
  const int64_t head_dim = p.head_dim;
  s.prepare(rows, head_dim, p.value_dim);
  const int64_t mp = s.padded_rows;
  const int64_t dp = s.padded_dim;

  // Queries, scaled and transposed to [D][Mp]; padding lanes are 0 (finite scores, ignored).
  std::fill(s.queries_t, s.queries_t + head_dim * mp, 0.0f);
  float* row = s.keys;  // one query row in fp32 (the key tile is free until the tiles start)
  for (int64_t t = 0; t < p.num_nodes; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const Scalar* src = p.q + b * p.q_stride_b + t * p.q_stride_t + (kv_head * group + g) * p.q_stride_h;
      load_row(src, head_dim, row);
      const int64_t m = t * group + g;
      for (int64_t d = 0; d < head_dim; ++d) s.queries_t[d * mp + m] = row[d] * p.scale;
    }
  }
  std::fill(s.row_max, s.row_max + mp, -std::numeric_limits<float>::infinity());
  std::fill(s.row_sum, s.row_sum + mp, 0.0f);
  std::fill(s.acc, s.acc + rows * dp, 0.0f);
  std::fill(s.values, s.values + kTileKeys * dp, 0.0f);  // the padding columns stay 0

  // Sliding window: each query's depth (its ancestors in the mask, itself excluded), so its
  // position L_b + depth; a tile is masked by position only if it reaches back to
  // max position - window (the deepest query's first hidden key).
  s.window_end = std::numeric_limits<int64_t>::min();  // keys below it need the position test
  if (p.window > 0) {
    s.depth.assign(p.num_nodes, -1);
    int64_t max_depth = 0;
    for (int64_t t = 0; t < p.num_nodes; ++t) {
      if (p.mask.chain) {
        s.depth[t] = t;
      } else {
        for (int64_t j = 0; j < p.num_nodes; ++j) s.depth[t] += p.mask.visible(b, t, j);
      }
      max_depth = std::max(max_depth, s.depth[t]);
    }
    s.window_end = p.cache_seqlens[b] + max_depth - p.window + 1;
  }
}

// One tile of keys [first, first + count) (count <= kTileKeys, within 0 .. L_b + T) of the
// unit (row b, KV head kv_head) that begin_unit started in s: the scores, the masks, the
// online softmax and probs @ values into s's accumulators. rows_converted: the caller has already
// converted the tile's 16-bit key and value rows into s.keys and s.values (attend_keys_all_heads).
template <typename Scalar>
void attend_tile(const TreeAttentionProblem<Scalar>& p, int64_t b, int64_t kv_head, int64_t first, int64_t count,
                 TreeAttentionScratch& s, bool rows_converted = false) {
  using namespace attention_detail;
  const int64_t group = p.group();
  const int64_t rows = p.rows();
  const int64_t head_dim = p.head_dim;
  const int64_t value_dim = p.value_dim;
  const int64_t mp = s.padded_rows;
  const int64_t lanes = round_up(rows, kLanes / 2);  // query lanes computed (<= mp)
  const int64_t dp = s.padded_dim;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t prefix_len = p.cache_seqlens[b];
  const int64_t window = p.window;
  // fp32 keys are read in place, and values too when their rows are as wide as the vectors
  // (D a multiple of 16): a dense cache's rows one stride apart, a paged cache's through a
  // pointer per row (found page by page), so paged tiles are as long as dense ones. Other
  // rows are converted (and padded) into the scratch tiles.
  constexpr bool kFloat = std::is_same<Scalar, float>::value;
  const bool paged = p.block_table != nullptr;
  const bool values_in_place = kFloat && dp == value_dim;
  const Scalar* key_rows[kTileKeys];
  const Scalar* value_rows[kTileKeys];
  bool hidden[kTileKeys];
  // A causal chain's query t sees tree node n only if n <= t, so the queries before the tile's
  // first tree node see none of its keys (a tile past the prefix): their lanes are left out of
  // the scores and the softmax, which then touch each query's state only for tiles it sees (a
  // prefill chunk computes its T x T triangle, not the square). lane0 is a multiple of kLanes:
  // the skipped lanes' state is as the tile would have left it (all -inf: max, sum and
  // accumulators unchanged), and vectors stay aligned.
  const int64_t first_node = first - prefix_len;
  const int64_t lane0 = p.mask.chain && first_node > 0 ? first_node * group / kLanes * kLanes : 0;
  float* const scores = s.scores + lane0;
  const float* const queries_t = s.queries_t + lane0;
  const int64_t live_lanes = lanes - lane0;
  auto softmax_pv = [&](auto values) {
    tile_softmax_pv(scores, count, mp, live_lanes, rows - lane0, values, dp, s.row_max + lane0, s.row_sum + lane0,
                    s.alpha + lane0, s.acc + lane0 * dp);
  };
  if (paged) p.paged_rows(b, kv_head, first, count, key_rows, value_rows);
  if constexpr (kFloat) {
    if (paged) {
      tile_scores(queries_t, mp, live_lanes, RowList{key_rows}, count, head_dim, scores);
    } else {
      tile_scores(queries_t, mp, live_lanes, StridedRows{p.key_row(b, kv_head, first), p.k_stride_s}, count, head_dim,
                  scores);
    }
  } else {
    for (int64_t n = 0; n < count && !rows_converted; ++n) {
      load_row(paged ? key_rows[n] : p.key_row(b, kv_head, first + n), head_dim, s.keys + n * head_dim);
    }
    tile_scores(queries_t, mp, live_lanes, StridedRows{s.keys, head_dim}, count, head_dim, scores);
  }
  // Before any masking (a masked score is overwritten with -inf below).
  if (p.softcap > 0.0f) softcap_scores(scores, count, mp, live_lanes, p.softcap);
  if (first < std::min(s.window_end, prefix_len)) {
    // Prefix keys some query is too far from (p - k >= window). Every key from first_key(b)
    // on is seen by the root, so none is hidden from all queries. (lane0 is 0 here.)
    for (int64_t n = 0; n < count && first + n < prefix_len; ++n) {
      const int64_t key_pos = first + n;
      for (int64_t t = 0; t < p.num_nodes; ++t) {
        if (prefix_len + s.depth[t] - key_pos >= window) std::fill_n(s.scores + n * mp + t * group, group, neg_inf);
      }
    }
  }

  // Tree keys: mask per query (overwriting, so NaN keys cannot leak through), and note
  // the keys no query sees, whose values must be zeroed (0 * NaN would still be NaN).
  bool any_hidden = false;
  if (p.mask.chain) {
    // Node n is seen by queries n .. T - 1 (with a window, those less than `window` deeper):
    // none is hidden (each query sees itself).
    for (int64_t n = 0; n < count; ++n) {
      const int64_t node = first_node + n;
      hidden[n] = false;
      if (node < 0) continue;
      float* row = s.scores + n * mp;
      if (node * group > lane0) std::fill(row + lane0, row + node * group, neg_inf);
      if (window > 0 && node + window < p.num_nodes) std::fill(row + (node + window) * group, row + rows, neg_inf);
    }
  } else {
    for (int64_t n = 0; n < count; ++n) {
      const int64_t node = first_node + n;
      hidden[n] = false;
      if (node < 0) continue;
      bool seen = false;
      for (int64_t t = 0; t < p.num_nodes; ++t) {
        if (p.mask.visible(b, t, node) && (window == 0 || s.depth[t] - s.depth[node] < window)) {
          seen = true;
        } else {
          std::fill_n(s.scores + n * mp + t * group, group, neg_inf);
        }
      }
      hidden[n] = !seen;
      any_hidden |= !seen;
    }
  }

  if constexpr (kFloat) {
    if (values_in_place && paged) {
      // A hidden key's value row points at zeros instead (s.values is all zeros: with
      // values read in place, nothing is ever copied into it).
      for (int64_t n = 0; n < count; ++n) {
        if (hidden[n]) value_rows[n] = s.values;
      }
      softmax_pv(RowList{value_rows});
      return;
    }
    if (values_in_place && !any_hidden) {
      softmax_pv(StridedRows{p.value_row(b, kv_head, first), p.v_stride_s});
      return;
    }
  }
  for (int64_t n = 0; n < count; ++n) {
    if (hidden[n]) {
      std::fill_n(s.values + n * dp, value_dim, 0.0f);
    } else if (!rows_converted) {
      load_row(paged ? value_rows[n] : p.value_row(b, kv_head, first + n), value_dim, s.values + n * dp);
    }
  }
  softmax_pv(StridedRows{s.values, dp});
}

// Asks the memory system for the keys and values [first, first + count) of KV heads
// [head0, head0 + heads) of row b, one tile before they are read. A decode step's attention
// is a short stream per (row, KV head, key range) -- a few hundred rows of 128-256 bytes, one
// row stride apart -- that the hardware prefetchers barely start on: a 700-token cache of the
// default model (30 layers, 16 MB in bf16, 32 MB in fp32) was read at ~4-8 GB/s, and the
// 16-bit conversion of each row stalled on its load (docs/loop.md).
// count <= kTileKeys; rows found as attend_tile finds them (paged: `paged_rows`).
template <typename Scalar>
void prefetch_tile(const TreeAttentionProblem<Scalar>& p, int64_t b, int64_t head0, int64_t heads, int64_t first,
                   int64_t count) {
  const int64_t key_bytes = p.head_dim * static_cast<int64_t>(sizeof(Scalar));
  const int64_t value_bytes = p.value_dim * static_cast<int64_t>(sizeof(Scalar));
  const Scalar* key_rows[attention_detail::kTileKeys];
  const Scalar* value_rows[attention_detail::kTileKeys];
  const bool paged = p.block_table != nullptr;
  for (int64_t h = head0; h < head0 + heads; ++h) {
    if (paged) p.paged_rows(b, h, first, count, key_rows, value_rows);
    for (int64_t n = 0; n < count; ++n) {
      const char* key = reinterpret_cast<const char*>(paged ? key_rows[n] : p.key_row(b, h, first + n));
      const char* value = reinterpret_cast<const char*>(paged ? value_rows[n] : p.value_row(b, h, first + n));
      for (int64_t byte = 0; byte < key_bytes; byte += 64) __builtin_prefetch(key + byte, 0, 3);
      for (int64_t byte = 0; byte < value_bytes; byte += 64) __builtin_prefetch(value + byte, 0, 3);
    }
  }
}

// Attention of the M = T * group queries of (row b, KV head kv_head) over the keys
// [key_begin, key_end) (within 0 .. L_b + T), unnormalised: leaves in scratch the
// accumulators acc [M][Dp], running max row_max [M] and denominator row_sum [M].
template <typename Scalar>
void attend_keys(const TreeAttentionProblem<Scalar>& p, int64_t b, int64_t kv_head, int64_t key_begin,
                 int64_t key_end, TreeAttentionScratch& s) {
  using attention_detail::kTileKeys;
  begin_unit(p, b, kv_head, s);
  prefetch_tile(p, b, kv_head, 1, key_begin, std::min(key_end - key_begin, kTileKeys));
  for (int64_t first = key_begin, count = 0; first < key_end; first += count) {
    count = std::min(key_end - first, kTileKeys);
    const int64_t next = first + count;
    prefetch_tile(p, b, kv_head, 1, next, std::min(key_end - next, kTileKeys));
    attend_tile(p, b, kv_head, first, count, s);
  }
}

// attend_keys for every KV head of row b over the same keys, tile by tile, heads[h] holding
// head h's state: the cache stores a position's keys (values) of all heads side by side, so
// each tile's rows are read as one contiguous stretch of memory rather than one stretch of
// D in every Hkv * D per head (on the 2-core AMD EPYC, a decode step's attention over a
// 700-token cache, cold: ~1.5x faster; docs/loop.md).
template <typename Scalar>
void attend_keys_all_heads(const TreeAttentionProblem<Scalar>& p, int64_t b, int64_t key_begin, int64_t key_end,
                           TreeAttentionScratch* heads) {
  using attention_detail::kTileKeys;
  for (int64_t h = 0; h < p.num_kv_heads; ++h) begin_unit(p, b, h, heads[h]);
  // 16-bit rows of a dense cache are converted for every head first, in memory order (a
  // position's heads side by side, then the next position), one pass over the tile's keys and
  // one over its values; converted head by head inside attend_tile, each pass stepped through
  // the tile at the position stride and stalled on its loads. On the 2-core AMD EPYC, cold
  // (a 7 MB product between layers), bf16, 9 / 3 heads, D 64, a decode step's attention over
  // 300 / 700 keys: 8 rows 412-426 / 918-956 -> 265-293 / 562-582 us a layer, 1 row 70-73 /
  // 129-133 -> 48-55 / 97-102 (twenty-fourth session). The same conversions: the same bits.
  const bool convert_first = !std::is_same<Scalar, float>::value && p.block_table == nullptr;
  prefetch_tile(p, b, 0, p.num_kv_heads, key_begin, std::min(key_end - key_begin, kTileKeys));
  for (int64_t first = key_begin, count = 0; first < key_end; first += count) {
    count = std::min(key_end - first, kTileKeys);
    const int64_t next = first + count;
    prefetch_tile(p, b, 0, p.num_kv_heads, next, std::min(key_end - next, kTileKeys));
    if (convert_first) {
      for (int64_t n = 0; n < count; ++n) {
        for (int64_t h = 0; h < p.num_kv_heads; ++h) {
          attention_detail::load_row(p.key_row(b, h, first + n), p.head_dim, heads[h].keys + n * p.head_dim);
        }
      }
      for (int64_t n = 0; n < count; ++n) {
        for (int64_t h = 0; h < p.num_kv_heads; ++h) {
          attention_detail::load_row(p.value_row(b, h, first + n), p.value_dim,
                                     heads[h].values + n * heads[h].padded_dim);
        }
      }
    }
    for (int64_t h = 0; h < p.num_kv_heads; ++h) attend_tile(p, b, h, first, count, heads[h], convert_first);
  }
}

// Writes the normalised result of attend_keys over all of row b's keys to the output.
// A query that saw no key at all gets NaN (0 / 0), like a softmax over nothing.
template <typename Scalar>
void write_output(const TreeAttentionProblem<Scalar>& p, int64_t b, int64_t kv_head, const TreeAttentionScratch& s) {
  const int64_t group = p.group();
  for (int64_t m = 0; m < p.rows(); ++m) {
    const int64_t t = m / group;
    Scalar* out = p.out + ((b * p.num_nodes + t) * p.num_q_heads + kv_head * group + m % group) * p.value_dim;
    const float inv = 1.0f / s.row_sum[m];
    const float* acc = s.acc + m * s.padded_dim;
    for (int64_t d = 0; d < p.value_dim; ++d) from_float(acc[d] * inv, out + d);
  }
}

// Saves attend_keys' result for one key range as a partial: [M][Dv] sums, [M] max, [M] denominator.
template <typename Scalar>
void save_partial(const TreeAttentionProblem<Scalar>& p, const TreeAttentionScratch& s, float* partial) {
  const int64_t rows = p.rows();
  const int64_t dim = p.value_dim;
  for (int64_t m = 0; m < rows; ++m) std::copy_n(s.acc + m * s.padded_dim, dim, partial + m * dim);
  std::copy_n(s.row_max, rows, partial + rows * dim);
  std::copy_n(s.row_sum, rows, partial + rows * (dim + 1));
}

// Merges the partials of (row b, KV head) over num_parts key ranges (each
// p.partial_size() floats, consecutive) by log-sum-exp and writes the normalised output.
template <typename Scalar>
void combine_partials(const TreeAttentionProblem<Scalar>& p, int64_t b, int64_t kv_head, const float* partials,
                      int64_t num_parts, TreeAttentionScratch& s) {
  const int64_t rows = p.rows();
  s.prepare(rows, p.head_dim, p.value_dim);
  float* row = s.acc;
  const int64_t dim = p.value_dim;  // the partials' and the output's head dim
  const int64_t size = p.partial_size();
  const int64_t group = p.group();
  for (int64_t m = 0; m < rows; ++m) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < num_parts; ++c) best = std::max(best, partials[c * size + rows * dim + m]);
    std::fill_n(row, dim, 0.0f);
    float sum = 0.0f;
    for (int64_t c = 0; c < num_parts; ++c) {
      const float* part = partials + c * size;
      const float part_max = part[rows * dim + m];
      // A range where the query saw no key has weight 0 (not exp(-inf - -inf) = NaN), but its
      // sums still count: they are 0, or NaN from 0 * NaN (or inf) values, like a softmax's.
      const float weight =
          part_max == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(part_max - best);
      sum += weight * part[rows * (dim + 1) + m];
      for (int64_t d = 0; d < dim; ++d) row[d] += weight * part[m * dim + d];
    }
    const int64_t t = m / group;
    Scalar* out = p.out + ((b * p.num_nodes + t) * p.num_q_heads + kv_head * group + m % group) * dim;
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < dim; ++d) from_float(row[d] * inv, out + d);
  }
}

}  // namespace cpu
}  // namespace specdec

#undef SPECDEC_CPU_INLINE
#undef SPECDEC_CPU_MULTIVERSION
