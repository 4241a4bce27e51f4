// CPU verification (lossless acceptance of a token tree against the target): one batch row
// per call, torch-free. The rules are those of specdec_kernels/reference/verify.py (its
// module docstring is the contract) and the random numbers those of
// specdec_kernels/philox.py (include/specdec/philox.h), so on the same inputs this emits the
// same tokens as the reference. The reference's plain-torch Philox emulates 32-bit multiplies with int64
// tensor ops (~150 passes over the vocabulary per sampled node); here it is a few integer
// instructions per token.
//
// Per row the walk visits only the accepted path's nodes (and the node where the correction
// or bonus token is drawn). Per visited node: one pass for the sanitized logits' max/argmax;
// sampled rows then build the warped target p in a scratch fp32 row (top-k by nth_element
// on a copy, top-p by sorting the largest nonzero probabilities only when top_p < 1), and sample by
// the exponential race (Philox drawn in vectorised blocks of 256 ids, skipping blocks whose
// largest weight cannot win). With draft probabilities, each rejected child costs one pass for the
// residual normalise(max(r - q, 0)), materialised like the reference does.
//
// Bit-compatibility: the arithmetic follows the reference operation by operation (fp32
// (x - max) / T, exp, times 1 / sum, u * q(x) < r(x), w / (-log u), lowest index on ties),
// except where torch's vectorised kernels fix an order or an approximation we do not copy:
// the softmax and residual sums (torch: fp32 SIMD lanes; here: fp64, rounded once), exp and
// log (Sleef vs libm, within an ulp). So p, r and E can differ from the reference's in the
// last bit, which changes a decision only when it sits within an ulp of its threshold (a
// race whose two best ratios nearly tie, u * q(x) within an ulp of r(x), a top-p boundary).
// The reference also renormalises every row after top-p when any row of the batch uses it;
// here only rows with top_p < 1 are. python_tests/test_verify_cpu.py measured no mismatch in
// 1.5 x 10^5 random sampled rows.
// Parents are trusted to be topological (the Python API checks them): a child is looked for
// only among nodes after the current one, so the walk ends whatever the input.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "specdec/dtypes.h"  // BFloat16Bits, HalfBits, to_float
#include "specdec/philox.h"

// The race's Philox loop is built for AVX-512, AVX2 and baseline x86-64, picked at load time.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SPECDEC_VERIFY_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPECDEC_VERIFY_MULTIVERSION
#endif

namespace specdec {
namespace cpu {

// ----------------------------------------------------------------------------- one row

// One batch row's inputs. Node t's logits start at logits + t * logits_stride (contiguous
// over the vocabulary), likewise draft_probs (nullptr: deterministic drafts). tokens and
// parents are this row's contiguous [T] int64 arrays.
template <typename Logit, typename Prob>
struct VerifyRow {
  const Logit* logits;
  int64_t logits_stride;
  const Prob* draft_probs;
  int64_t draft_stride;
  const int64_t* tokens;
  const int64_t* parents;
  int64_t num_nodes;
  int64_t vocab;
  float temperature;  // 0: greedy
  int64_t top_k;      // 0 or >= vocab: off
  float top_p;        // >= 1: off
  int64_t seed;
};

// Per-thread scratch rows of V floats, reused across rows and nodes.
struct VerifyScratch {
  std::vector<float> x;         // sanitized logits, then z = (x - max) / T
  std::vector<float> probs;     // the warped target p
  std::vector<float> residual;  // the SpecInfer residual after a rejection
  std::vector<float> work;      // top-k / top-p selection copies
};

namespace verify_detail {

constexpr float kFloatMax = std::numeric_limits<float>::max();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Sanitized logits (NaN -> -inf, +inf -> the largest float) into x, and their max. Written
// as element-wise selects and 16 running maxima so that it vectorises without -ffast-math.
template <typename Logit>
SPECDEC_VERIFY_MULTIVERSION float load_sanitized(const Logit* src, int64_t vocab, float* x) {
  constexpr int64_t kLanes = 16;
  float lane_max[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lane_max[i] = kNegInf;
  const int64_t body = vocab / kLanes * kLanes;
  for (int64_t start = 0; start < vocab; start += kLanes) {
    const int64_t count = start < body ? kLanes : vocab - start;
    for (int64_t i = 0; i < count; ++i) {
      const float value = to_float(src[start + i]);
      const float clean = value != value ? kNegInf : (value > kFloatMax ? kFloatMax : value);
      x[start + i] = clean;
      lane_max[i] = lane_max[i] > clean ? lane_max[i] : clean;
    }
  }
  float best = kNegInf;
  for (int64_t i = 0; i < kLanes; ++i) best = best > lane_max[i] ? best : lane_max[i];
  return best;
}

// Sanitized logits into x; returns the argmax (lowest id on ties, 0 when all are -inf) and
// sets *row_max.
template <typename Logit>
int64_t load_logits(const Logit* src, int64_t vocab, float* x, float* row_max) {
  const float best = load_sanitized(src, vocab, x);
  *row_max = best;
  int64_t index = 0;
  while (index < vocab && x[index] != best) ++index;
  return index < vocab ? index : 0;
}

// Draft probabilities as the reference reads them: nan_to_num (NaN -> 0, +inf -> the largest
// float), then negatives -> 0.
template <typename Prob>
inline float draft_q(Prob value) {
  const float q = to_float(value);
  if (std::isnan(q)) return 0.0f;
  return std::max(std::min(q, kFloatMax), 0.0f);
}

// The warped target (reference `target_probs`) into probs, from the sanitized logits in x
// (overwritten with z) and their max.
inline void target_probs(float* x, float row_max, int64_t vocab, float temperature, int64_t top_k, float top_p,
                         float* probs, std::vector<float>& work) {
  const float temp = temperature > 0.0f ? temperature : 1.0f;
  // (x - max) / T, not x / T - max / T: tiny T would overflow x / T into ties.
  const float shift = std::isfinite(row_max) ? row_max : 0.0f;
  for (int64_t v = 0; v < vocab; ++v) x[v] = (x[v] - shift) / temp;

  if (top_k > 0 && top_k < vocab) {  // keep every z >= the k-th largest (boundary ties kept)
    work.assign(x, x + vocab);
    std::nth_element(work.begin(), work.begin() + (top_k - 1), work.end(), std::greater<float>());
    const float kth_largest = work[top_k - 1];
    for (int64_t v = 0; v < vocab; ++v) x[v] = x[v] < kth_largest ? kNegInf : x[v];
  }

  float z_max = kNegInf;
  for (int64_t v = 0; v < vocab; ++v) z_max = std::max(z_max, x[v]);
  if (z_max == kNegInf) {  // nothing left (all -inf / NaN): token 0 gets all the mass
    x[0] = 0.0f;
    z_max = 0.0f;
  }
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) {
    probs[v] = std::exp(x[v] - z_max);
    sum += probs[v];
  }
  const float inv_sum = 1.0f / static_cast<float>(sum);  // softmax multiplies by 1 / sum, like torch
  for (int64_t v = 0; v < vocab; ++v) probs[v] *= inv_sum;

  if (top_p < 1.0f) {
    // Keep v iff the mass of strictly more likely tokens is < top_p (boundary ties kept): in
    // descending order, mass_before_i = cumsum_i - p_i with the cumsum in fp64 rounded to fp32
    // (as torch's CPU cumsum). Zeros come last; only the nonzero ones are ordered. The kept set
    // is usually a few hundred tokens of a vocabulary of ~10^5, so only the largest `prefix`
    // are sorted (nth_element, then sort: O(V + k log k) against a full sort's O(V log V)):
    // once element i fails the test every later one fails too (cumsum only grows, p only
    // shrinks, and fp32 rounding is monotone), so counting stops there, with the same count a
    // full sort would give. The prefix grows 8x until it holds a failing element.
    work.clear();
    for (int64_t v = 0; v < vocab; ++v)
      if (probs[v] > 0.0f) work.push_back(probs[v]);
    const int64_t num_nonzero = static_cast<int64_t>(work.size());
    double cumsum = 0.0;
    int64_t num_kept = 0;
    bool done = false;
    for (int64_t sorted = 0, prefix = std::min<int64_t>(256, num_nonzero); !done;
         prefix = std::min<int64_t>(prefix * 8, num_nonzero)) {
      if (prefix < num_nonzero)
        std::nth_element(work.begin() + sorted, work.begin() + (prefix - 1), work.end(), std::greater<float>());
      std::sort(work.begin() + sorted, work.begin() + prefix, std::greater<float>());
      for (; sorted < prefix; ++sorted) {
        const float p = work[sorted];
        cumsum += p;
        if (static_cast<float>(cumsum) - p < top_p) {
          ++num_kept;
        } else {
          done = true;
          break;
        }
      }
      done = done || sorted == num_nonzero;
    }
    const int64_t num_zeros = vocab - num_nonzero;
    if (num_kept == num_nonzero && num_zeros > 0 && static_cast<float>(cumsum) < top_p)
      num_kept += num_zeros;  // (rounding corner)
    num_kept = std::max<int64_t>(num_kept, 1);
    const float smallest_kept = num_kept <= static_cast<int64_t>(work.size()) ? work[num_kept - 1] : 0.0f;
    double kept = 0.0;
    for (int64_t v = 0; v < vocab; ++v) {
      probs[v] = probs[v] >= smallest_kept ? probs[v] : 0.0f;
      kept += probs[v];
    }
    const float kept_mass = static_cast<float>(kept);
    for (int64_t v = 0; v < vocab; ++v) probs[v] /= kept_mass;
  }
}

// Philox uniforms (seed, node, PURPOSE_SAMPLE, first + i) for i < count, in a loop the
// compiler vectorises (32 x 32 -> 64-bit multiplies are one instruction per lane in AVX2).
SPECDEC_VERIFY_MULTIVERSION
inline void sample_uniforms(uint32_t k0, uint32_t k1, uint32_t node, uint32_t first, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    out[i] = philox::word_to_uniform(
        philox::word0(first + static_cast<uint32_t>(i), node, philox::kPurposeSample, 0u, k0, k1));
  }
}

// The exponential race: argmax_v w_v / (-log u_v), u_v the (seed, node, PURPOSE_SAMPLE, v)
// uniforms; lowest id on ties. The uniforms are drawn a block at a time, and a block is
// skipped when even its largest weight could not win: every E = -log(u) we draw is
// >= -log(1 - 2^-24) ~ 5.96e-8, so w / E <= w * 2e7 (a margin over 1 / 5.96e-8), and a token
// with w * 2e7 < best ratio so far cannot beat it (not even tie it, which an earlier id wins).
// In LLM distributions most of the vocabulary is far below that bar. A zero weight has ratio 0
// whatever u is.
inline int64_t sample_race(const float* weights, int64_t vocab, int64_t seed, int64_t node) {
  constexpr int64_t kBlock = 256;
  constexpr float kInvMinExponential = 2.0e7f;
  const uint64_t key = static_cast<uint64_t>(seed);
  const uint32_t k0 = static_cast<uint32_t>(key);
  const uint32_t k1 = static_cast<uint32_t>(key >> 32);
  float uniforms[kBlock];
  // Start from the heaviest token's ratio (a real candidate), so that blocks before it can
  // be skipped too; ties then go to the lower id explicitly.
  const int64_t heaviest = std::max_element(weights, weights + vocab) - weights;
  const float u_heaviest =
      philox::uniform(key, static_cast<uint32_t>(node), philox::kPurposeSample, static_cast<uint32_t>(heaviest));
  float best = weights[heaviest] / -std::log(u_heaviest);
  int64_t best_index = heaviest;
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t count = std::min(kBlock, vocab - start);
    float block_max = 0.0f;
    for (int64_t i = 0; i < count; ++i) block_max = std::max(block_max, weights[start + i]);
    if (block_max * kInvMinExponential <= best) continue;  // (also skips all-zero blocks)
    sample_uniforms(k0, k1, static_cast<uint32_t>(node), static_cast<uint32_t>(start), count, uniforms);
    for (int64_t i = 0; i < count; ++i) {
      const float w = weights[start + i];
      const float ratio = w != 0.0f ? w / -std::log(uniforms[i]) : 0.0f;
      if (ratio > best || (ratio == best && start + i < best_index)) {
        best = ratio;
        best_index = start + i;
      }
    }
  }
  return best_index;
}

}  // namespace verify_detail

// Walks one row's tree from the root (reference `verify`, one row). Writes accepted_nodes[T]
// (node 0 first, -1 padded) and output_tokens[T] (-1 padded); returns the number of accepted
// drafts. Emitted ids are always in [0, V).
template <typename Logit, typename Prob>
int64_t verify_row(const VerifyRow<Logit, Prob>& row, VerifyScratch& scratch, int32_t* accepted_nodes,
                   int64_t* output_tokens) {
  using namespace verify_detail;
  const int64_t vocab = row.vocab;
  const int64_t num_nodes = row.num_nodes;
  const bool greedy = row.temperature == 0.0f;
  scratch.x.resize(vocab);
  if (!greedy) scratch.probs.resize(vocab);
  for (int64_t t = 0; t < num_nodes; ++t) {
    accepted_nodes[t] = -1;
    output_tokens[t] = -1;
  }
  accepted_nodes[0] = 0;

  int64_t cur = 0;
  int64_t num_accepted = 0;
  while (true) {
    float row_max = 0.0f;
    const int64_t argmax = load_logits(row.logits + cur * row.logits_stride, vocab, scratch.x.data(), &row_max);
    int64_t next = -1;
    int64_t emitted = argmax;
    if (greedy || row.draft_probs == nullptr) {
      // Greedy, or deterministic drafts: the next token y is the argmax or a sample from p;
      // move to the (first) child holding it.
      if (!greedy) {
        target_probs(scratch.x.data(), row_max, vocab, row.temperature, row.top_k, row.top_p, scratch.probs.data(),
                     scratch.work);
        emitted = sample_race(scratch.probs.data(), vocab, row.seed, cur);
      }
      for (int64_t j = cur + 1; j < num_nodes && next < 0; ++j)
        if (row.parents[j] == cur && row.tokens[j] == emitted) next = j;
    } else {
      // SpecInfer multi-step speculative sampling over the children in index order.
      target_probs(scratch.x.data(), row_max, vocab, row.temperature, row.top_k, row.top_p, scratch.probs.data(),
                   scratch.work);
      const Prob* q = row.draft_probs + cur * row.draft_stride;
      const float* residual = scratch.probs.data();
      for (int64_t j = cur + 1; j < num_nodes && next < 0; ++j) {
        if (row.parents[j] != cur) continue;
        const int64_t x = std::min(std::max<int64_t>(row.tokens[j], 0), vocab - 1);
        const float u =
            philox::uniform(static_cast<uint64_t>(row.seed), static_cast<uint32_t>(j), philox::kPurposeAccept, 0u);
        if (u * draft_q(q[x]) < residual[x]) {  // q(x) = 0: accepted iff r(x) > 0
          next = j;
          break;
        }
        // Rejected: r <- normalise(max(r - q, 0)), unchanged if that sums to zero.
        scratch.work.resize(vocab);
        float* updated = scratch.work.data();
        double total = 0.0;
        for (int64_t v = 0; v < vocab; ++v) {
          updated[v] = std::max(residual[v] - draft_q(q[v]), 0.0f);
          total += updated[v];
        }
        if (total > 0.0) {
          const float total_f = static_cast<float>(total);
          scratch.residual.resize(vocab);
          for (int64_t v = 0; v < vocab; ++v) scratch.residual[v] = updated[v] / total_f;
          residual = scratch.residual.data();
        }
      }
      if (next < 0) emitted = sample_race(residual, vocab, row.seed, cur);
    }
    if (next < 0) {
      output_tokens[num_accepted] = emitted;
      return num_accepted;
    }
    output_tokens[num_accepted] = row.tokens[next];
    accepted_nodes[num_accepted + 1] = static_cast<int32_t>(next);
    ++num_accepted;
    cur = next;
  }
}

}  // namespace cpu
}  // namespace specdec
