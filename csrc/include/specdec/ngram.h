// N-gram (prompt lookup) matching on the CPU: plain C++ over raw pointers, no torch.
//
// History s = tokens[0, N). For n from max_n down to min_n, a match is a position j with
// j <= N - n - 1 (at least one token follows it) and s[j, j + n) == s[N - n, N); the first
// n that has any wins, and the policy picks its smallest ("earliest") or largest ("latest")
// j. The proposal is s[j + n, min(j + n + num_tokens, N)).
//
// One pass finds it. Name a match by its end e = j + n - 1 instead: e <= N - 2 and
// s[e] == s[N - 1]. The longest match ending at e has length
//   len(e) = min(cap, common suffix length of s[0, e] and s[0, N)),  cap = min(max_n, N - 1),
// and a match of length n ends at e iff len(e) >= n. So the winning n is max_e len(e) (if
// >= min_n), and its earliest / latest j is the smallest / largest e with len(e) == n. The
// scan only extends backwards from positions holding the last token (found 32 at a time
// with SIMD compares), and stops at the first e with len(e) == cap: scanning upwards for
// "earliest", downwards for "latest".
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace specdec {
namespace cpu {

struct NgramMatch {
  int64_t n;    // match length; 0: no match
  int64_t end;  // e = j + n - 1, the position of the match's last token (-1 if none)
};

// Bit i set iff p[i] == x, for i < 32.
template <typename T>
inline uint32_t eq_mask32(const T* p, T x) {
  uint32_t mask = 0;
  for (int i = 0; i < 32; ++i) {
    mask |= static_cast<uint32_t>(p[i] == x) << i;
  }
  return mask;
}

#if defined(__SSE2__)
template <>
inline uint32_t eq_mask32<int32_t>(const int32_t* p, int32_t x) {
  const __m128i v = _mm_set1_epi32(x);
  uint32_t mask = 0;
  for (int i = 0; i < 8; ++i) {
    const __m128i c = _mm_cmpeq_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * i)), v);
    mask |= static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(c))) << (4 * i);
  }
  return mask;
}

template <>
inline uint32_t eq_mask32<int64_t>(const int64_t* p, int64_t x) {
  // SSE2 has no 64-bit compare: both 32-bit halves must be equal.
  const __m128i v = _mm_set1_epi64x(x);
  uint32_t mask = 0;
  for (int i = 0; i < 16; ++i) {
    const __m128i c = _mm_cmpeq_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)), v);
    const __m128i both = _mm_and_si128(c, _mm_shuffle_epi32(c, _MM_SHUFFLE(2, 3, 0, 1)));
    mask |= static_cast<uint32_t>(_mm_movemask_pd(_mm_castsi128_pd(both))) << (2 * i);
  }
  return mask;
}
#endif

// len(e) for a candidate end e with s[e] == s[N - 1] (so at least 1), capped at `cap`.
template <typename T>
inline int64_t match_length(const T* s, int64_t num, int64_t e, int64_t cap) {
  const int64_t limit = std::min(cap, e + 1);
  int64_t k = 1;
  while (k < limit && s[e - k] == s[num - 1 - k]) {
    ++k;
  }
  return k;
}

// Calls visit(e) for every e in [0, last] with s[e] == x, in increasing order (upwards) or
// decreasing order (!upwards), until visit returns true. Returns whether it stopped early.
template <typename T, typename Visit>
inline bool for_each_equal(const T* s, int64_t last, T x, bool upwards, Visit&& visit) {
  const int64_t count = last + 1;
  const int64_t blocks = count / 32;
  if (upwards) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint32_t mask = eq_mask32(s + 32 * b, x);
      while (mask != 0) {
        const int bit = __builtin_ctz(mask);
        mask &= mask - 1;
        if (visit(32 * b + bit)) return true;
      }
    }
    for (int64_t e = 32 * blocks; e < count; ++e) {
      if (s[e] == x && visit(e)) return true;
    }
  } else {
    // Blocks aligned to the top: [count - 32 (b + 1), count - 32 b), then the head.
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t base = count - 32 * (b + 1);
      uint32_t mask = eq_mask32(s + base, x);
      while (mask != 0) {
        const int bit = 31 - __builtin_clz(mask);
        mask &= ~(1u << bit);
        if (visit(base + bit)) return true;
      }
    }
    for (int64_t e = count - 32 * blocks - 1; e >= 0; --e) {
      if (s[e] == x && visit(e)) return true;
    }
  }
  return false;
}

// The winning match of history s[0, num) (see the top of this file).
template <typename T>
inline NgramMatch find_ngram_match(const T* s, int64_t num, int64_t min_n, int64_t max_n, bool latest) {
  const int64_t cap = std::min(max_n, num - 1);
  if (cap < min_n || cap < 1) return NgramMatch{0, -1};
  const T last = s[num - 1];
  NgramMatch best{0, -1};
  // Upwards, a strictly longer match replaces the best, so ties keep the smallest e;
  // downwards the largest.
  for_each_equal(s, num - 2, last, /*upwards=*/!latest, [&](int64_t e) {
    const int64_t len = match_length(s, num, e, cap);
    if (len > best.n) {
      best = NgramMatch{len, e};
    }
    return len == cap;
  });
  if (best.n < min_n) return NgramMatch{0, -1};
  return best;
}

// Writes the proposal of one row into draft[0, num_tokens) (-1 padded); returns its length.
template <typename T>
inline int64_t ngram_propose_row(const T* s, int64_t num, int64_t min_n, int64_t max_n, int64_t num_tokens,
                                 bool latest, T* draft) {
  const NgramMatch match = find_ngram_match(s, num, min_n, max_n, latest);
  int64_t count = 0;
  if (match.n > 0) {
    const int64_t start = match.end + 1;  // j + n
    count = std::min(num_tokens, num - start);
    std::copy(s + start, s + start + count, draft);
  }
  std::fill(draft + count, draft + num_tokens, static_cast<T>(-1));
  return count;
}

// Every match position of the winning n, in increasing order of j (n returned; 0: none).
template <typename T>
inline int64_t ngram_match_positions(const T* s, int64_t num, int64_t min_n, int64_t max_n,
                                     std::vector<int64_t>& positions) {
  positions.clear();
  const int64_t cap = std::min(max_n, num - 1);
  if (cap < min_n || cap < 1) return 0;
  const T last = s[num - 1];
  int64_t best = 0;
  for_each_equal(s, num - 2, last, /*upwards=*/true, [&](int64_t e) {
    const int64_t len = match_length(s, num, e, cap);
    if (len > best) {
      best = len;
      positions.clear();
    }
    if (len == best) positions.push_back(e);
    return false;
  });
  if (best < min_n) {
    positions.clear();
    return 0;
  }
  for (int64_t& p : positions) p -= best - 1;  // end -> start j
  return best;
}

// One row of ngram_propose_tree. Distinct continuations s[j + n, j + n + num_tokens) of the
// winning n's positions j, ranked by count (ties: smaller first j for "earliest", larger
// last j for "latest"); the best tree_width are merged into a trie under the root (node 0,
// token s[N - 1] or -1), nodes numbered in insertion order, at most max_nodes drafted
// nodes. tree_tokens / parents have 1 + max_nodes entries, -1 padded.
// `scratch` vectors are reused between rows.
struct TreeScratch {
  std::vector<int64_t> positions;
  std::vector<int64_t> order;
  struct Group {
    int64_t count, first, last, rep;
  };
  std::vector<Group> groups;
  std::vector<int64_t> first_child, next_sibling;
};

template <typename T>
inline void ngram_propose_tree_row(const T* s, int64_t num, int64_t min_n, int64_t max_n, int64_t num_tokens,
                                   int64_t tree_width, int64_t max_nodes, bool latest, T* tree_tokens,
                                   int64_t* parents, TreeScratch& scratch) {
  const int64_t size = 1 + max_nodes;
  std::fill(tree_tokens, tree_tokens + size, static_cast<T>(-1));
  std::fill(parents, parents + size, int64_t{-1});
  tree_tokens[0] = num > 0 ? s[num - 1] : static_cast<T>(-1);
  const int64_t n = ngram_match_positions(s, num, min_n, max_n, scratch.positions);
  if (n == 0) return;
  const std::vector<int64_t>& pos = scratch.positions;

  // Group equal continuations: sort match indices by (continuation, j); a continuation that
  // is a proper prefix of another sorts first, so equal ones are adjacent.
  auto cont_len = [&](int64_t j) { return std::min(num_tokens, num - (j + n)); };
  std::vector<int64_t>& order = scratch.order;
  order.resize(pos.size());
  for (size_t i = 0; i < pos.size(); ++i) order[i] = static_cast<int64_t>(i);
  auto compare = [&](int64_t a, int64_t b) {  // -1, 0, 1 on continuations only
    const int64_t ja = pos[a] + n, jb = pos[b] + n;
    const int64_t la = cont_len(pos[a]), lb = cont_len(pos[b]);
    const int64_t common = std::min(la, lb);
    for (int64_t k = 0; k < common; ++k) {
      if (s[ja + k] != s[jb + k]) return s[ja + k] < s[jb + k] ? -1 : 1;
    }
    return la == lb ? 0 : (la < lb ? -1 : 1);
  };
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int c = compare(a, b);
    return c != 0 ? c < 0 : a < b;
  });
  std::vector<TreeScratch::Group>& groups = scratch.groups;
  groups.clear();
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t j = pos[order[i]];
    if (i == 0 || compare(order[i - 1], order[i]) != 0) {
      groups.push_back({1, j, j, j});
    } else {
      TreeScratch::Group& g = groups.back();
      ++g.count;
      g.last = j;  // indices are increasing within a group, and so are positions
    }
  }
  // Rank: count desc, then first asc / last desc (unique keys: positions are distinct).
  auto better = [&](const TreeScratch::Group& a, const TreeScratch::Group& b) {
    if (a.count != b.count) return a.count > b.count;
    return latest ? a.last > b.last : a.first < b.first;
  };
  const int64_t width = std::min<int64_t>(tree_width, static_cast<int64_t>(groups.size()));
  std::partial_sort(groups.begin(), groups.begin() + width, groups.end(), better);

  // Trie merge in rank order; children found through first-child / next-sibling links.
  std::vector<int64_t>& first_child = scratch.first_child;
  std::vector<int64_t>& next_sibling = scratch.next_sibling;
  first_child.assign(static_cast<size_t>(size), -1);
  next_sibling.assign(static_cast<size_t>(size), -1);
  int64_t used = 1;
  for (int64_t g = 0; g < width; ++g) {
    const int64_t start = groups[g].rep + n;
    const int64_t len = cont_len(groups[g].rep);
    int64_t node = 0;
    for (int64_t k = 0; k < len; ++k) {
      const T tok = s[start + k];
      int64_t child = first_child[node];
      while (child != -1 && tree_tokens[child] != tok) child = next_sibling[child];
      if (child == -1) {
        if (used == size) break;  // budget spent: this continuation stops here
        child = used++;
        tree_tokens[child] = tok;
        parents[child] = node;
        // Push onto the front of the sibling list (order does not matter for lookups).
        next_sibling[child] = first_child[node];
        first_child[node] = child;
      }
      node = child;
    }
  }
}

}  // namespace cpu
}  // namespace specdec
