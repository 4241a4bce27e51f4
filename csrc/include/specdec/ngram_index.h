// Incremental n-gram index for one growing history (one running sequence): plain C++, no
// torch. Answers exactly what find_ngram_match (ngram.h) answers for the whole history, in
// O(max_n + num_tokens) per query and O(max_n) expected per appended token.
//
// Every distinct n-gram (n <= max_n) seen so far has an exact integer id: the n-gram
// s[e - n + 1, e] is the (n - 1)-gram s[e - n + 1, e - 1] followed by s[e], so its id is
// looked up in one hash table keyed by the pair (id of that (n - 1)-gram, s[e]) (the
// 0-gram has id -1). Keys are compared exactly, so a hash collision only costs a probe; it
// can never merge two n-grams. Per id we keep the smallest and the largest end e at which
// it occurs with e <= N - 2 (followed by at least one token): when token N arrives, the
// n-grams ending at N - 1 are "committed" (they are now followed by a token), then the ids
// of the n-grams ending at N are computed. A query for n reads the id of the current
// suffix of length n, and its committed first / latest end gives the earliest / latest
// match j = e - n + 1 directly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace specdec {
namespace cpu {

class NgramHistoryIndex {
 public:
  // hash_mask: bits of the hash that are used (all by default). Tests pass a tiny mask to
  // force collisions; the results must not change, only get slower.
  explicit NgramHistoryIndex(int64_t max_n = 4, uint64_t hash_mask = ~uint64_t{0})
      : max_n_(std::min(max_n, kMaxOrder)), hash_mask_(hash_mask), current_(static_cast<size_t>(max_n_), -1) {
    clear(0);
  }

  int64_t max_n() const { return max_n_; }
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  const int64_t* tokens() const { return tokens_.data(); }

  // Largest history this index can hold (ids and positions are int32).
  int64_t capacity_limit() const { return (std::numeric_limits<int32_t>::max() - 1) / (max_n_ + 1); }

  // Empties the history, sized for about `expected` tokens.
  void clear(int64_t expected) {
    tokens_.clear();
    tokens_.reserve(static_cast<size_t>(std::max<int64_t>(expected, 0)));
    ends_.clear();
    size_t want = 16;
    while (want < static_cast<size_t>(2 * max_n_ * std::max<int64_t>(expected, 0))) want *= 2;
    table_.assign(want, Entry{0, kEmpty, 0});
    std::fill(current_.begin(), current_.end(), -1);
  }

  template <typename T>
  void append(const T* tokens, int64_t count) {
    for (int64_t i = 0; i < count; ++i) push(static_cast<int64_t>(tokens[i]));
  }

  void push(int64_t token) {
    const int64_t pos = size();
    const int64_t old_orders = std::min(max_n_, pos);  // n-grams ending at pos - 1
    const int64_t orders = std::min(max_n_, pos + 1);   // n-grams ending at pos
    // Every key is known up front (the ids of the n-grams ending at pos - 1), so the
    // lookups are independent: touch all their cache lines first, then do the work. With
    // long histories the table is far larger than the caches and this overlaps the misses.
    uint64_t slot[kMaxOrder];
    const size_t mask = table_.size() - 1;
    for (int64_t n = 1; n <= orders; ++n) {
      slot[n - 1] = static_cast<size_t>(hash(n == 1 ? -1 : current_[n - 2], token)) & mask;
      __builtin_prefetch(&table_[slot[n - 1]]);
    }
    // The n-grams ending at pos - 1 are now followed by a token: commit their end.
    for (int64_t k = 0; k < old_orders; ++k) {
      Ends& ends = ends_[current_[k]];
      if (ends.first < 0) ends.first = static_cast<int32_t>(pos - 1);
      ends.latest = static_cast<int32_t>(pos - 1);
    }
    // Ids of the n-grams ending at pos: longest first, so current_[n - 2] still holds the
    // (n - 1)-gram ending at pos - 1 when it is read.
    for (int64_t n = orders; n >= 1; --n) {
      const int32_t prev = n == 1 ? -1 : current_[n - 2];
      // A table that grew meanwhile invalidates the precomputed slot.
      const size_t start = table_.size() - 1 == mask ? slot[n - 1] : (hash(prev, token) & (table_.size() - 1));
      current_[n - 1] = find_or_insert(prev, token, start);
    }
    tokens_.push_back(token);
  }

  // The winning match for min_n <= n <= max_n (max_n <= this->max_n()): same result as
  // find_ngram_match over the whole history. end = j + n - 1.
  void match(int64_t min_n, int64_t max_n, bool latest, int64_t* n_out, int64_t* end_out) const {
    const int64_t num = size();
    for (int64_t n = std::min(std::min(max_n, max_n_), num - 1); n >= min_n && n >= 1; --n) {
      const Ends& ends = ends_[current_[n - 1]];
      if (ends.first >= 0) {
        *n_out = n;
        *end_out = latest ? ends.latest : ends.first;
        return;
      }
    }
    *n_out = 0;
    *end_out = -1;
  }

  // Proposal into draft[0, num_tokens) (-1 padded); returns its length.
  template <typename T>
  int64_t propose(int64_t min_n, int64_t max_n, int64_t num_tokens, bool latest, T* draft) const {
    int64_t n = 0, end = -1;
    match(min_n, max_n, latest, &n, &end);
    int64_t count = 0;
    if (n > 0) {
      const int64_t start = end + 1;
      count = std::min(num_tokens, size() - start);
      for (int64_t k = 0; k < count; ++k) draft[k] = static_cast<T>(tokens_[start + k]);
    }
    for (int64_t k = count; k < num_tokens; ++k) draft[k] = static_cast<T>(-1);
    return count;
  }

  // Bytes held (tokens, table, per-id positions), for reporting.
  int64_t memory_bytes() const {
    return static_cast<int64_t>(tokens_.capacity() * sizeof(int64_t) + table_.capacity() * sizeof(Entry) +
                                ends_.capacity() * sizeof(Ends));
  }

 private:
  static constexpr int32_t kEmpty = std::numeric_limits<int32_t>::min();
  static constexpr int64_t kMaxOrder = 64;  // largest max_n
  struct Entry {
    int64_t token;
    int32_t prev;  // id of the (n - 1)-gram, -1 for n = 1; kEmpty: free slot
    int32_t id;
  };

  uint64_t hash(int32_t prev, int64_t token) const {
    uint64_t x = static_cast<uint64_t>(token) * 0x9E3779B97F4A7C15ull ^ static_cast<uint32_t>(prev);
    x ^= x >> 31;  // splitmix64 finaliser
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return x & hash_mask_;
  }

  int32_t find_or_insert(int32_t prev, int64_t token, size_t start) {
    const size_t mask = table_.size() - 1;
    size_t i = start;
    while (true) {
      Entry& e = table_[i];
      if (e.prev == kEmpty) break;
      if (e.prev == prev && e.token == token) return e.id;
      i = (i + 1) & mask;
    }
    const int32_t id = static_cast<int32_t>(ends_.size());
    table_[i] = Entry{token, prev, id};
    ends_.push_back(Ends{-1, -1});
    if (2 * ends_.size() > table_.size()) grow();
    return id;
  }

  void grow() {
    std::vector<Entry> old(table_.size() * 2, Entry{0, kEmpty, 0});
    old.swap(table_);
    const size_t mask = table_.size() - 1;
    for (const Entry& e : old) {
      if (e.prev == kEmpty) continue;
      size_t i = static_cast<size_t>(hash(e.prev, e.token)) & mask;
      while (table_[i].prev != kEmpty) i = (i + 1) & mask;
      table_[i] = e;
    }
  }

  int64_t max_n_;
  uint64_t hash_mask_;
  std::vector<int64_t> tokens_;
  std::vector<Entry> table_;
  struct Ends {
    int32_t first, latest;  // smallest / largest committed end, -1: none yet
  };
  std::vector<Ends> ends_;               // per id
  std::vector<int32_t> current_;         // current_[n - 1]: id of the n-gram ending at N - 1
};

}  // namespace cpu
}  // namespace specdec
