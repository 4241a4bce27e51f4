// Suffix cache: one index over every token sequence a drafter has seen (finished sequences,
// and live ones that grow a few tokens per decoding step), answering "which continuations
// followed the longest suffix of this sequence anywhere in the cache?" as a token tree with
// counts. Plain C++, no torch.
//
// Why not a suffix tree: a suffix tree (SuffixDecoding) or a trie of every context up to
// depth D finds the longest match directly, but costs up to D nodes per cached token for
// novel text and needs node deletion to evict. This index is LZ77-style hash chains
// instead, one chain per context length ("order") in a fixed set {1, 2, 3, 4, 6, 8, 12, 16,
// 24, 32} (those <= max_depth): appending a token links its position into each order's
// chain (O(number of orders)), a lookup walks the chain of the longest order whose suffix
// occurs (O(max_probes * order) token comparisons), and the tree is built from the first
// max_candidates occurrences' continuations (O(max_candidates * depth)). None of it depends
// on how much is cached, and memory is a fixed arena.
//
// Layout. Tokens live in a ring ("arena") of `capacity` = 2^ceil(log2(max_tokens))
// positions, in the order they were appended; sequences interleave (live rows append a few
// tokens each per step), so each position keeps `prev` / `next` links to its neighbours in
// its own sequence. Positions are absolute (0, 1, 2, ...; stored + 1, 0 = none) and never
// reused, so a link to an evicted position is recognised (< begin) instead of followed.
// Eviction is by the token budget, oldest tokens first: whole old sequences go before newer
// ones (a sequence evicted half-way keeps its tail). Per order: `head[bucket]` = the newest
// position whose context (the `order` tokens ending there) hashes to `bucket`, and
// `chain[pos]` = the previous position of the same bucket. A bucket may mix contexts (the
// table is direct-mapped, no keys): every candidate is verified token by token against the
// query's suffix, so a collision costs a probe, never a wrong match.
//
// Bytes per cached token: 4 (token) + 8 (prev, next) + 4 * orders (chains) + 4 * orders *
// table_size / capacity (heads; table_size = capacity by default): 92 bytes with the 10
// orders of max_depth 32, times capacity / max_tokens (< 2) when max_tokens is not a power
// of two. Live slots add 160 bytes each.
//
// Semantics of a lookup (python reference: specdec_kernels/ops/reference/suffix_index.py;
// brute force: python_tests/test_suffix_index.py). For the slot's sequence s (length N):
// for each order k (longest first, k <= N), walk the k-chain of the bucket of s's last k
// tokens from its newest position, visiting at most `max_probes` positions p >= begin;
// keep p when the k tokens ending at p (following prev links, all still cached) equal s's
// last k tokens and p has a next token; stop at max_candidates kept. The first order that
// keeps any is the match (match length k). The kept positions' continuations (the tokens
// after p in p's sequence, up to `depth`, as far as that sequence goes: a live sibling's
// tokens up to its latest) are merged into a trie; a node's count is how many
// continuations pass through it. The output keeps the `max_nodes` nodes with the highest
// counts (ties: the node created first; creation follows the candidates newest first), in
// that order, which is topological (a child never outranks its parent).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace specdec {
namespace cpu {

class SuffixCache {
 public:
  static constexpr int kMaxDepth = 32;
  static constexpr int kAllOrders[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32};
  // Absolute positions are stored as uint32 (+ 1); past this many appended tokens the
  // cache forgets everything and starts over (after 2 billion tokens: a few days of serving).
  static constexpr uint64_t kPositionLimit = (uint64_t{1} << 31) - 2;
  static constexpr uint64_t kHashMul = 0x9E3779B97F4A7C15ull;

  // A live sequence: its last position, length, and last kMaxDepth tokens (its suffix is
  // hashed and compared from here, so it never depends on what the arena still holds).
  struct Slot {
    uint32_t last = 0;  // absolute position + 1 of the last token, 0 = none
    int64_t length = 0;
    int32_t ring[kMaxDepth] = {0};
    int32_t back(int64_t i) const { return ring[(length - 1 - i) & (kMaxDepth - 1)]; }  // i-th last token
  };

  // max_tokens >= 1 cached tokens; max_depth in [1, 32]; num_slots live sequences;
  // table_bits 0 = log2(capacity).
  SuffixCache(int64_t max_tokens, int64_t max_depth, int64_t num_slots, int64_t max_candidates, int64_t max_probes,
              int64_t table_bits)
      : max_tokens_(static_cast<uint64_t>(max_tokens)),
        max_candidates_(max_candidates),
        max_probes_(max_probes),
        slots_(static_cast<size_t>(num_slots)) {
    for (int k : kAllOrders)
      if (k <= max_depth) orders_.push_back(k);
    max_order_ = orders_.back();
    int bits = 0;
    while ((uint64_t{1} << bits) < max_tokens_) ++bits;
    capacity_ = uint64_t{1} << bits;
    table_bits_ = table_bits > 0 ? static_cast<int>(table_bits) : std::max(bits, 4);
    const size_t num_orders = orders_.size();
    token_.assign(capacity_, 0);
    prev_.assign(capacity_, 0);
    next_.assign(capacity_, 0);
    chain_.assign(capacity_ * num_orders, 0);
    head_.assign((size_t{1} << table_bits_) * num_orders, 0);
  }

  int64_t num_slots() const { return static_cast<int64_t>(slots_.size()); }
  // More slots (never fewer): the cache is kept.
  void reserve_slots(int64_t num_slots) {
    if (num_slots > this->num_slots()) slots_.resize(static_cast<size_t>(num_slots));
  }
  int64_t num_orders() const { return static_cast<int64_t>(orders_.size()); }
  int64_t max_order() const { return max_order_; }
  int64_t cached() const { return static_cast<int64_t>(end_ - begin_); }
  int64_t appended() const { return static_cast<int64_t>(end_); }
  int64_t slot_length(int64_t slot) const { return slots_[slot].length; }
  int64_t max_nodes_limit(int64_t depth) const { return max_candidates_ * depth; }

  int64_t memory_bytes() const {
    return static_cast<int64_t>(token_.capacity() * 4 + prev_.capacity() * 4 + next_.capacity() * 4 +
                                chain_.capacity() * 4 + head_.capacity() * 4 + slots_.capacity() * sizeof(Slot));
  }

  // Forget every cached token and every slot's sequence.
  void clear() {
    std::fill(head_.begin(), head_.end(), 0u);
    begin_ = end_ = 0;
    for (Slot& s : slots_) s = Slot();
    add_slot_ = Slot();
  }

  // Slot `slot` starts a new sequence (its old one stays cached), empty.
  void start(int64_t slot) { slots_[slot] = Slot(); }
  // Slot `slot` continues where `from` is now (same tokens, shared positions): siblings with
  // one prompt cache it once; their first tokens all follow its last position.
  void share(int64_t slot, int64_t from) { slots_[slot] = slots_[from]; }

  // A finished sequence, added through a slot of its own.
  template <typename T>
  void add(const T* tokens, int64_t count) {
    add_slot_ = Slot();
    for (int64_t i = 0; i < count; ++i) push(add_slot_, static_cast<int32_t>(tokens[i]));
    add_slot_ = Slot();
  }

  template <typename T>
  void append(int64_t slot, const T* tokens, int64_t count) {
    for (int64_t i = 0; i < count; ++i) push(slots_[slot], static_cast<int32_t>(tokens[i]));
  }

  void push(Slot& s, int32_t token) {
    if (end_ >= kPositionLimit) clear();  // see kPositionLimit (s is reset too)
    if (end_ - begin_ >= max_tokens_) ++begin_;  // evict the oldest token
    const uint64_t p = end_++;
    const size_t at = p & (capacity_ - 1);
    token_[at] = token;
    next_[at] = 0;
    const bool linked = s.last != 0 && s.last - 1 >= begin_;
    prev_[at] = linked ? s.last : 0;
    if (linked && next_[(s.last - 1) & (capacity_ - 1)] == 0) next_[(s.last - 1) & (capacity_ - 1)] = static_cast<uint32_t>(p + 1);
    s.ring[s.length & (kMaxDepth - 1)] = token;
    ++s.length;
    s.last = static_cast<uint32_t>(p + 1);
    uint64_t buckets[kMaxDepth];
    const int usable = suffix_buckets(s, buckets);
    const size_t num_orders = orders_.size();
    // The heads of a large cache are cache misses: start them all before the first is needed.
    for (int o = 0; o < usable; ++o) prefetch(&head_[(static_cast<size_t>(o) << table_bits_) + buckets[o]]);
    for (size_t o = 0; o < num_orders; ++o) {
      uint32_t& link = chain_[at * num_orders + o];
      if (static_cast<int>(o) < usable) {
        uint32_t& h = head_[(o << table_bits_) + buckets[o]];
        link = h;
        h = static_cast<uint32_t>(p + 1);
      } else {
        link = 0;
      }
    }
  }

  // The slot's suffix buckets per order (orders <= its length); returns how many.
  int suffix_buckets(const Slot& s, uint64_t* buckets) const {
    uint64_t h = 0;
    int o = 0;
    const int64_t top = std::min<int64_t>(s.length, max_order_);
    for (int64_t k = 1; k <= top; ++k) {
      h = h * kHashMul + static_cast<uint64_t>(static_cast<uint32_t>(s.back(k - 1))) + 1;
      if (k == orders_[o]) buckets[o++] = bucket(h, k);
    }
    return o;
  }

  static void prefetch(const void* address) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(address);
#else
    (void)address;
#endif
  }

  uint64_t bucket(uint64_t h, int64_t k) const {
    uint64_t x = h ^ (static_cast<uint64_t>(k) * 0xD6E8FEB86659FD93ull);  // splitmix64's finalizer
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return x >> (64 - table_bits_);
  }

  // Whether the k tokens ending at absolute position p are still cached and equal the slot's last k.
  bool matches(uint64_t p, const Slot& s, int64_t k) const {
    for (int64_t i = 0;; ++i) {
      if (p < begin_ || token_[p & (capacity_ - 1)] != s.back(i)) return false;
      if (i + 1 == k) return true;
      const uint32_t before = prev_[p & (capacity_ - 1)];
      if (before == 0) return false;
      p = before - 1;
    }
  }

  // The slot's draft (see the header comment). Writes 1 + max_nodes entries of tokens
  // (root = the slot's last token, -1 padding), parents (-1 root and padding) and counts
  // (root: candidates kept; padding 0); returns the match length (0: no match). The slot
  // must hold >= 1 token. Read-only: rows may be looked up from several threads at once.
  template <typename Tok>
  int64_t draft(int64_t slot_id, int64_t depth, int64_t max_nodes, Tok* out_tokens, int64_t* out_parents,
                int32_t* out_counts) const {
    const Slot& s = slots_[slot_id];
    for (int64_t i = 0; i <= max_nodes; ++i) {
      out_tokens[i] = -1;
      out_parents[i] = -1;
      out_counts[i] = 0;
    }
    out_tokens[0] = static_cast<Tok>(s.back(0));
    uint64_t buckets[kMaxDepth];
    const int usable = suffix_buckets(s, buckets);
    const size_t num_orders = orders_.size();
    // Two waves of prefetches (every order's head, then the token its newest entry holds):
    // the orders are tried longest first, and each try would otherwise wait on two misses.
    uint32_t heads[kMaxDepth];
    for (int o = 0; o < usable; ++o) prefetch(&head_[(static_cast<size_t>(o) << table_bits_) + buckets[o]]);
    for (int o = 0; o < usable; ++o) {
      heads[o] = head_[(static_cast<size_t>(o) << table_bits_) + buckets[o]];
      if (heads[o] != 0) prefetch(&token_[(heads[o] - 1) & (capacity_ - 1)]);
    }
    Scratch& scratch = scratch_for_thread();
    std::vector<uint64_t>& kept = scratch.kept;
    kept.clear();
    int64_t match = 0;
    for (int o = usable - 1; o >= 0 && kept.empty(); --o) {
      const int64_t k = orders_[o];
      uint32_t cand = heads[o];
      for (int64_t probes = 0; cand != 0 && probes < max_probes_; ++probes) {
        const uint64_t p = cand - 1;
        if (p < begin_) break;  // chains run newest to oldest: the rest is evicted too
        const size_t at = p & (capacity_ - 1);
        if (next_[at] != 0 && matches(p, s, k)) {
          kept.push_back(p);
          if (static_cast<int64_t>(kept.size()) == max_candidates_) break;
        }
        cand = chain_[at * num_orders + o];
      }
      if (!kept.empty()) match = k;
    }
    out_counts[0] = static_cast<int32_t>(kept.size());
    if (kept.empty() || max_nodes == 0 || depth == 0) return match;
    // The continuations' trie: node 0 the root; children as sibling lists.
    std::vector<Node>& nodes = scratch.nodes;
    nodes.clear();
    nodes.push_back({-1, -1, 0, -1, -1});
    for (uint64_t p : kept) {
      int32_t node = 0;
      uint32_t q = next_[p & (capacity_ - 1)];
      for (int64_t d = 0; d < depth && q != 0; ++d) {
        const size_t at = (q - 1) & (capacity_ - 1);  // q > p >= begin: cached
        const int32_t token = token_[at];
        int32_t child = nodes[node].first_child, last = -1;
        while (child >= 0 && nodes[child].token != token) {
          last = child;
          child = nodes[child].next_sibling;
        }
        if (child < 0) {
          child = static_cast<int32_t>(nodes.size());
          nodes.push_back({token, node, 0, -1, -1});
          if (last < 0) nodes[node].first_child = child;
          else nodes[last].next_sibling = child;
        }
        ++nodes[child].count;
        node = child;
        q = next_[at];
      }
    }
    // Highest counts first, ties by creation: a counting sort (counts <= candidates kept).
    // Topological, since a child's count never exceeds its parent's and the parent was
    // created first.
    const int32_t top = out_counts[0];
    std::vector<int32_t>& start = scratch.start;
    start.assign(static_cast<size_t>(top) + 2, 0);
    for (size_t i = 1; i < nodes.size(); ++i) ++start[top - nodes[i].count + 1];
    for (int32_t c = 1; c <= top + 1; ++c) start[c] += start[c - 1];
    std::vector<int32_t>& order = scratch.order;
    order.resize(nodes.size() - 1);
    for (size_t i = 1; i < nodes.size(); ++i) order[start[top - nodes[i].count]++] = static_cast<int32_t>(i);
    const int64_t take = std::min<int64_t>(max_nodes, static_cast<int64_t>(order.size()));
    for (int64_t i = 0; i < take; ++i) {
      Node& n = nodes[order[i]];
      n.first_child = static_cast<int32_t>(i + 1);  // reused: the node's output index
      out_tokens[i + 1] = static_cast<Tok>(n.token);
      out_parents[i + 1] = n.parent == 0 ? 0 : nodes[n.parent].first_child;
      out_counts[i + 1] = n.count;
    }
    return match;
  }

 private:
  struct Node {
    int32_t token, parent, count, first_child, next_sibling;
  };
  // Per-thread buffers of `draft` (it runs on several threads at once; no allocation per call).
  struct Scratch {
    std::vector<uint64_t> kept;
    std::vector<Node> nodes;
    std::vector<int32_t> start, order;
  };
  static Scratch& scratch_for_thread() {
    thread_local Scratch scratch;
    return scratch;
  }

  uint64_t max_tokens_, capacity_ = 0;
  int64_t max_candidates_, max_probes_;
  int table_bits_ = 0;
  int64_t max_order_ = 1;
  std::vector<int> orders_;
  std::vector<int32_t> token_;
  std::vector<uint32_t> prev_, next_, chain_, head_;
  std::vector<Slot> slots_;
  Slot add_slot_;
  uint64_t begin_ = 0, end_ = 0;
};

}  // namespace cpu
}  // namespace specdec
