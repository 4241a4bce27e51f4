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
// its own sequence, in one 12-byte cell with its token (a probe reads one cache line, not
// three). Positions are absolute (0, 1, 2, ...; stored + 1, 0 = none) and never reused, so
// a link to an evicted position is recognised (< begin) instead of followed. Eviction is by
// the token budget, oldest tokens first: whole old sequences go before newer ones (a
// sequence evicted half-way keeps its tail). Per order: `head[bucket]` = the newest
// position whose context (the `order` tokens ending there) hashes to `bucket`, and
// `chain[pos]` = the previous position of the same bucket. A bucket may mix contexts (the
// table is direct-mapped, no keys): every candidate is verified token by token against the
// query's suffix, so a collision costs a probe, never a wrong match.
//
// Bytes per cached token: 12 (token, prev, next) + 4 * orders (chains) + 4 * orders *
// table_size / capacity (heads; table_size = capacity by default): 92 bytes with the 10
// orders of max_depth 32, times capacity / max_tokens (< 2) when max_tokens is not a power
// of two. Live slots add sizeof(Slot) = 192 bytes each. The arrays are allocated once
// (zero pages mapped lazily) and ask Linux for transparent huge pages: nearly every access
// is a random one, and with 4 KiB pages each would also miss the TLB.
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
//
// How a lookup is made fast without changing that result (the floor is memory latency:
// a chain walk is a pointer chase through a 92 MB arena, ~130 ns per dependent miss here):
// - The lookups of 16 rows ("lanes") advance in lockstep, one probe per lane per round:
//   each probe prefetches the next candidate's lines, which arrive while the other lanes
//   take their turn, so the misses of different rows overlap (a chain walk is a pointer
//   chase: within one row they cannot). A lane that finishes builds its row's tree and takes
//   the next row, so the lanes stay full.
// - Each slot keeps its suffix's bucket per order, computed once when its last token was
//   appended (a lookup hashes nothing), and remembers the order its last lookup matched.
//   The next lookup first walks the order just above that one; if that chain ends (no
//   further candidates, before max_probes) without a match, no longer order can match
//   either (a position whose longer context matches also matches the shorter one, and it
//   is linked into the shorter order's chain under the same bucket), so those orders are
//   skipped. Rows on novel text match order 1 or nothing, and no longer walk nine chains
//   of collisions to find that out. Otherwise the scan starts at the top as specified.
// - Appends compute every row's buckets first and prefetch the hash heads a few tokens
//   ahead of the writes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace specdec {
namespace cpu {

namespace suffix_detail {
constexpr uint64_t kHashMul = 0x9E3779B97F4A7C15ull;
constexpr int kMaxDepth = 32;
// Powers of kHashMul and of its inverse mod 2^64, for SuffixCache::compute_buckets.
struct HashPowers {
  uint64_t forward[kMaxDepth], inverse[kMaxDepth];
  constexpr HashPowers() : forward(), inverse() {
    uint64_t inv = kHashMul;  // Newton's iteration: each step doubles the correct low bits
    for (int i = 0; i < 6; ++i) inv *= 2 - kHashMul * inv;
    forward[0] = inverse[0] = 1;
    for (int i = 1; i < kMaxDepth; ++i) forward[i] = forward[i - 1] * kHashMul, inverse[i] = inverse[i - 1] * inv;
  }
};
inline constexpr HashPowers kHashPowers{};
static_assert(kHashMul * kHashPowers.inverse[1] == 1, "the inverse of the hash multiplier");
}  // namespace suffix_detail

// A fixed zero-initialised array of trivially copyable T, allocated once. On Linux it is an
// anonymous mapping (zero pages arrive lazily, so a large budget costs nothing until used)
// aligned to 2 MiB with transparent huge pages requested: lookups touch it at random.
template <typename T>
class LargeArray {
 public:
  LargeArray() = default;
  explicit LargeArray(size_t count) : count_(count) {
    if (count == 0) return;
    bytes_ = count * sizeof(T);
#if defined(__linux__)
    constexpr size_t kHuge = size_t{2} << 20;
    if (bytes_ >= kHuge) {
      mapped_ = bytes_ + kHuge;
      void* base = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base == MAP_FAILED) throw std::bad_alloc();
      base_ = base;
      const uintptr_t aligned = (reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~(uintptr_t{kHuge} - 1);
      data_ = reinterpret_cast<T*>(aligned);
#if defined(MADV_HUGEPAGE)
      madvise(data_, bytes_, MADV_HUGEPAGE);  // a hint: without it (or refused) pages are 4 KiB
#endif
      return;
    }
#endif
    data_ = static_cast<T*>(std::calloc(count, sizeof(T)));
    if (data_ == nullptr) throw std::bad_alloc();
  }
  LargeArray(const LargeArray&) = delete;
  LargeArray& operator=(const LargeArray&) = delete;
  LargeArray(LargeArray&& other) noexcept { swap(other); }
  LargeArray& operator=(LargeArray&& other) noexcept {
    LargeArray(std::move(other)).swap(*this);
    return *this;
  }
  ~LargeArray() { release(); }

  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  T* data() { return data_; }
  size_t size() const { return count_; }
  void fill_zero() {
    if (count_ > 0) std::fill(data_, data_ + count_, T{});
  }

 private:
  void swap(LargeArray& other) noexcept {
    std::swap(data_, other.data_), std::swap(base_, other.base_), std::swap(count_, other.count_);
    std::swap(bytes_, other.bytes_), std::swap(mapped_, other.mapped_);
  }
  void release() {
#if defined(__linux__)
    if (base_ != nullptr) {
      munmap(base_, mapped_);
      base_ = nullptr, data_ = nullptr;
      return;
    }
#endif
    std::free(data_);
    data_ = nullptr;
  }

  T* data_ = nullptr;
  void* base_ = nullptr;  // the mapping (Linux, large arrays), else null: data_ is malloc'ed
  size_t count_ = 0, bytes_ = 0, mapped_ = 0;
};

class SuffixCache {
 public:
  static constexpr int kMaxDepth = suffix_detail::kMaxDepth;
  static constexpr int kAllOrders[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32};
  static constexpr int kMaxOrders = 10;
  // Absolute positions are stored as uint32 (+ 1); past this many appended tokens the
  // cache forgets everything and starts over (after 2 billion tokens: a few days of serving).
  static constexpr uint64_t kPositionLimit = (uint64_t{1} << 31) - 2;
  static constexpr uint64_t kHashMul = suffix_detail::kHashMul;
  static constexpr int32_t kNoHint = 127;  // Slot::hint before the slot's first lookup

  // A live sequence: its last position, length, last kMaxDepth tokens (its suffix is hashed
  // and compared from here, so it never depends on what the arena still holds), the
  // buckets of that suffix per order and the order its last lookup matched.
  struct Slot {
    uint32_t last = 0;        // absolute position + 1 of the last token, 0 = none
    int32_t usable = 0;       // orders <= length: bucket[0 .. usable) are valid
    int32_t hint = kNoHint;   // order index the last lookup matched (-1: none; kNoHint: none yet)
    int32_t padding = 0;      // (explicit: length is 8-aligned either way)
    int64_t length = 0;
    uint32_t bucket[kMaxOrders] = {0};
    int32_t ring[kMaxDepth] = {0};
    int32_t back(int64_t i) const { return ring[(length - 1 - i) & (kMaxDepth - 1)]; }  // i-th last token
  };
  static_assert(sizeof(Slot) == 192, "the bytes per slot stated in the header comment and the Python docstring");

  // One cached position: its token and its neighbours in its sequence (absolute + 1, 0 = none).
  struct Cell {
    int32_t token;
    uint32_t prev, next;
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
    std::fill(std::begin(order_index_), std::end(order_index_), -1);
    for (size_t o = 0; o < orders_.size(); ++o) order_index_[orders_[o]] = static_cast<int8_t>(o);
    int bits = 0;
    while ((uint64_t{1} << bits) < max_tokens_) ++bits;
    capacity_ = uint64_t{1} << bits;
    table_bits_ = table_bits > 0 ? static_cast<int>(table_bits) : std::max(bits, 4);
    const size_t num_orders = orders_.size();
    cells_ = LargeArray<Cell>(capacity_);
    chain_ = LargeArray<uint32_t>(capacity_ * num_orders);
    head_ = LargeArray<uint32_t>((size_t{1} << table_bits_) * num_orders);
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
    return static_cast<int64_t>(cells_.size() * sizeof(Cell) + chain_.size() * 4 + head_.size() * 4 +
                                slots_.capacity() * sizeof(Slot));
  }

  // Forget every cached token and every slot's sequence.
  void clear() {
    head_.fill_zero();
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
    push_run(add_slot_, tokens, count);
    add_slot_ = Slot();
  }

  template <typename T>
  void append(int64_t slot, const T* tokens, int64_t count) {
    push_run(slots_[slot], tokens, count);
  }

  // tokens[r * width, + counts[r]) appended to slot slot_ids[r], rows in order; the slots
  // must be distinct. The same as append() row by row; the hash heads are prefetched ahead.
  template <typename T>
  void append_rows(const int64_t* slot_ids, const T* tokens, int64_t width, const int64_t* counts, int64_t rows) {
    int64_t total = 0;
    for (int64_t r = 0; r < rows; ++r) total += counts[r];
    if (total == 0) return;
    if (end_ + static_cast<uint64_t>(total) >= kPositionLimit) {  // a clear() on the way: no lookahead
      for (int64_t r = 0; r < rows; ++r) append(slot_ids[r], tokens + r * width, counts[r]);
      return;
    }
    const size_t no = orders_.size();
    pending_buckets_.resize(static_cast<size_t>(total) * no);
    pending_usable_.resize(static_cast<size_t>(total));
    int64_t j = 0;
    for (int64_t r = 0; r < rows; ++r) {  // every push's buckets (a slot's depend on its own tokens only)
      Slot ahead = slots_[slot_ids[r]];
      for (int64_t i = 0; i < counts[r]; ++i, ++j) {
        advance(ahead, static_cast<int32_t>(tokens[r * width + i]));
        pending_usable_[j] = static_cast<uint8_t>(compute_buckets(ahead, &pending_buckets_[j * no]));
      }
    }
    for (int64_t i = 0; i < std::min<int64_t>(kPushAhead, total); ++i) prefetch_heads(i);
    j = 0;
    for (int64_t r = 0; r < rows; ++r) {
      Slot& s = slots_[slot_ids[r]];
      for (int64_t i = 0; i < counts[r]; ++i, ++j) {
        if (j + kPushAhead < total) prefetch_heads(j + kPushAhead);
        push(s, static_cast<int32_t>(tokens[r * width + i]), &pending_buckets_[j * no], pending_usable_[j]);
      }
    }
  }

  // One token: its cell, its sequence links, and its position linked into each order's
  // chain. `buckets` / `usable`: the slot's suffix buckets after this token (as
  // compute_buckets gives them), or null to compute them here.
  void push(Slot& s, int32_t token, const uint32_t* buckets = nullptr, int usable = 0) {
    if (end_ >= kPositionLimit) clear(), buckets = nullptr;  // see kPositionLimit (s is reset too)
    if (end_ - begin_ >= max_tokens_) ++begin_;              // evict the oldest token
    const uint64_t p = end_++;
    const size_t at = p & (capacity_ - 1);
    const bool linked = s.last != 0 && s.last - 1 >= begin_;
    cells_[at] = Cell{token, linked ? s.last : 0, 0};
    if (linked && cells_[(s.last - 1) & (capacity_ - 1)].next == 0) {
      cells_[(s.last - 1) & (capacity_ - 1)].next = static_cast<uint32_t>(p + 1);
    }
    advance(s, token);
    s.last = static_cast<uint32_t>(p + 1);
    const size_t num_orders = orders_.size();
    if (buckets == nullptr) {
      usable = compute_buckets(s, s.bucket);
      // The heads of a large cache are cache misses: start them all before the first is needed.
      for (int o = 0; o < usable; ++o) prefetch(&head_[(static_cast<size_t>(o) << table_bits_) + s.bucket[o]]);
    } else {
      std::copy(buckets, buckets + usable, s.bucket);
    }
    s.usable = usable;
    uint32_t* link = &chain_[at * num_orders];
    for (size_t o = 0; o < num_orders; ++o) {
      if (static_cast<int>(o) < usable) {
        uint32_t& h = head_[(o << table_bits_) + s.bucket[o]];
        link[o] = h;
        h = static_cast<uint32_t>(p + 1);
      } else {
        link[o] = 0;
      }
    }
  }

  // The slot's suffix buckets per order (orders <= its length); returns how many. The hash
  // of order k is h_k = sum_{i<k} (x_i + 1) M^(k-1-i) mod 2^64 (x_i the i-th last token:
  // Horner's rule h = h M + x + 1 from the last token back), evaluated as M^(k-1) * sum_{i<k}
  // (x_i + 1) M^-i (M is odd, so invertible mod 2^64): independent products and a running
  // sum instead of a chain of 32 dependent multiplications. The same values.
  int compute_buckets(const Slot& s, uint32_t* buckets) const {
    uint64_t sum = 0;
    int o = 0;
    const int64_t top = std::min<int64_t>(s.length, max_order_);
    for (int64_t i = 0; i < top; ++i) {
      sum += (static_cast<uint64_t>(static_cast<uint32_t>(s.back(i))) + 1) * suffix_detail::kHashPowers.inverse[i];
      if (i + 1 == orders_[o]) buckets[o++] = static_cast<uint32_t>(bucket(sum * suffix_detail::kHashPowers.forward[i], i + 1));
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
      if (p < begin_) return false;
      const Cell& c = cells_[p & (capacity_ - 1)];
      if (c.token != s.back(i)) return false;
      if (i + 1 == k) return true;
      if (c.prev == 0) return false;
      p = c.prev - 1;
    }
  }

  // The drafts of rows [0, rows): row r for slot slot_ids[r] (slots may repeat), written at
  // r * (1 + max_nodes) of out_tokens (root = the slot's last token, -1 padding),
  // out_parents (-1 root and padding) and out_counts (root: candidates kept; padding 0),
  // and its match length (0: no match) at out_match[r]. Every slot must hold >= 1 token.
  // Read-only: rows may be drafted from several threads at once; afterwards (one thread)
  // remember() stores the matches as the slots' hints.
  template <typename Tok>
  void draft_rows(const int64_t* slot_ids, int64_t rows, int64_t depth, int64_t max_nodes, Tok* out_tokens,
                  int64_t* out_parents, int32_t* out_counts, int32_t* out_match) const {
    Scratch& scratch = scratch_for_thread();
    const int64_t lanes = std::min<int64_t>(kLanes, rows);
    scratch.walks.resize(static_cast<size_t>(lanes));
    scratch.kept.resize(static_cast<size_t>(lanes * max_candidates_));
    scratch.lane_row.assign(static_cast<size_t>(lanes), -1);
    const int64_t width = 1 + max_nodes;
    // Continuations are read by build_tree: from keep() on, prefetch what `depth` tokens of a
    // contiguous one (a finished sequence) take.
    const int32_t continuation_bytes = static_cast<int32_t>(std::min<int64_t>(depth, 64) * sizeof(Cell));
    int64_t next_row = 0;
    auto start_lane = [&](int64_t lane) {
      if (next_row == rows) return;
      Walk& w = scratch.walks[lane];
      w.kept = &scratch.kept[static_cast<size_t>(lane * max_candidates_)];
      w.continuation_bytes = continuation_bytes;
      scratch.lane_row[lane] = next_row;
      begin_walk(w, slots_[slot_ids[next_row++]]);
    };
    for (int64_t lane = 0; lane < lanes; ++lane) start_lane(lane);
    // Lanes of lookups in lockstep: each round gives every lane one step, so a lane's
    // prefetches have the other lanes' turns to arrive. A finished lane builds its row's
    // tree a round later (its continuations prefetched meanwhile) and takes the next row, so
    // as many chains stay in flight as there are rows left.
    for (int64_t busy = lanes; busy > 0;) {
      busy = 0;
      for (int64_t lane = 0; lane < lanes; ++lane) {
        const int64_t r = scratch.lane_row[lane];
        if (r < 0) continue;
        Walk& w = scratch.walks[lane];
        ++busy;
        if (!w.done) {
          step(w);
          continue;
        }
        out_match[r] = static_cast<int32_t>(w.match);
        build_tree(w, scratch, depth, max_nodes, out_tokens + r * width, out_parents + r * width,
                   out_counts + r * width);
        scratch.lane_row[lane] = -1;
        start_lane(lane);
      }
    }
  }

  // One slot's draft (draft_rows for one row); returns the match length. Read-only.
  template <typename Tok>
  int64_t draft(int64_t slot_id, int64_t depth, int64_t max_nodes, Tok* out_tokens, int64_t* out_parents,
                int32_t* out_counts) const {
    int32_t match = 0;
    draft_rows(&slot_id, 1, depth, max_nodes, out_tokens, out_parents, out_counts, &match);
    return match;
  }

  // Stores each row's match length (from draft_rows) as its slot's hint for the next
  // lookup: where the search starts, never what it finds. The last row of a repeated slot wins.
  void remember(const int64_t* slot_ids, const int32_t* matches, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) slots_[slot_ids[r]].hint = order_index_[matches[r]];
  }

 private:
  static constexpr int64_t kLanes = 16;     // lookups in flight at once (rows interleaved)
  static constexpr int64_t kPushAhead = 4;  // appended tokens whose hash heads are prefetched ahead

  // A run of trie nodes (see build_tree); indices into Scratch::edges, -1 none, 0 the root.
  struct Edge {
    uint32_t pos;   // arena position (+ 1) of its first node's token; the rest follow by next links
    int32_t token;  // its first node's token
    // Nodes: at most `length`, fewer where its sequence ends first (found when followed: the
    // continuations are not walked twice); continuations through them; candidate that made
    // them; depth of the first.
    int32_t length, count, creator, depth;
    int32_t parent, first_child, next_sibling;
    int32_t out_last;  // output index of its last node, once emitted
  };
  // One row's lookup in progress (see step()).
  struct Walk {
    enum Phase : int8_t { kHead, kProbe, kVerify };
    const Slot* slot;
    uint64_t* kept;     // max_candidates entries
    uint64_t pending;   // kVerify: the position whose context is compared this step
    int64_t match;
    uint32_t cand;      // the next position to probe (+ 1, 0 = end of chain)
    int32_t order;      // index into orders_ of the chain being walked
    int32_t top;        // the order index the scan starts from
    int32_t probes, num_kept;
    int32_t continuation_bytes;  // prefetched at a kept candidate's continuation
    Phase phase;
    bool testing;       // walking the hint's test order: stop at the first kept
    bool done;
  };
  // Per-thread buffers of draft_rows (it runs on several threads at once; no allocation per call).
  struct Scratch {
    std::vector<Walk> walks;
    std::vector<int64_t> lane_row;  // the row each lane looks up, -1: none
    std::vector<uint64_t> kept;
    std::vector<Edge> edges;
    std::vector<int32_t> order;
  };
  static Scratch& scratch_for_thread() {
    thread_local Scratch scratch;
    return scratch;
  }

  // The slot's ring and length after `token` (no arena change).
  static void advance(Slot& s, int32_t token) {
    s.ring[s.length & (kMaxDepth - 1)] = token;
    ++s.length;
  }

  void prefetch_heads(int64_t j) const {
    const uint32_t* buckets = &pending_buckets_[static_cast<size_t>(j) * orders_.size()];
    for (int o = 0; o < pending_usable_[j]; ++o) prefetch(&head_[(static_cast<size_t>(o) << table_bits_) + buckets[o]]);
  }

  // The cell and the order-o chain link of candidate cand (+ 1): what its probe reads.
  void prefetch_candidate(uint32_t cand, int32_t o) const {
    if (cand == 0) return;
    const size_t at = (cand - 1) & (capacity_ - 1);
    prefetch(&cells_[at]);
    prefetch(&chain_[at * orders_.size() + o]);
  }

  template <typename T>
  void push_run(Slot& s, const T* tokens, int64_t count) {
    for (int64_t i = 0; i < count; ++i) push(s, static_cast<int32_t>(tokens[i]));
  }

  void begin_walk(Walk& w, const Slot& s) const {
    w.slot = &s;
    w.num_kept = 0;
    w.match = 0;
    w.done = false;
    w.top = s.usable - 1;
    const int32_t hint = s.hint;
    w.testing = hint != kNoHint && hint + 1 <= w.top;
    if (w.testing && hint >= 0) {  // the likely answer when the test finds nothing
      prefetch(&head_[(static_cast<size_t>(hint) << table_bits_) + s.bucket[hint]]);
    }
    begin_order(w, w.testing ? hint + 1 : w.top);
  }

  void begin_order(Walk& w, int32_t o) const {
    if (o < 0) {
      w.done = true;
      return;
    }
    w.order = o;
    w.probes = 0;
    w.phase = Walk::kHead;
    prefetch(&head_[(static_cast<size_t>(o) << table_bits_) + w.slot->bucket[o]]);
  }

  // The order's walk ended: with candidates kept, or with none and `exhausted` (the chain
  // ran out before max_probes: nothing in it matches), or with none after max_probes.
  void end_order(Walk& w, bool exhausted) const {
    if (w.testing) {
      w.testing = false;
      const bool longer_ones_empty = w.num_kept == 0 && exhausted;  // see the header comment
      w.num_kept = 0;
      begin_order(w, longer_ones_empty ? w.order - 1 : w.top);
    } else if (w.num_kept > 0) {
      w.done = true;
      w.match = orders_[w.order];
    } else {
      begin_order(w, w.order - 1);
    }
  }

  // Keeps p; returns whether the order's walk is over.
  bool keep(Walk& w, uint64_t p, uint32_t next) const {
    w.kept[w.num_kept++] = p;
    // The continuation, for build_tree: one line, or (next to p: a contiguous sequence) depth tokens.
    const char* line = reinterpret_cast<const char*>(&cells_[(next - 1) & (capacity_ - 1)]);
    const int32_t bytes = next - 1 == p + 1 ? w.continuation_bytes : 1;
    for (int32_t b = 0; b < bytes; b += 64) prefetch(line + b);
    if (bytes > 1) prefetch(line + bytes - 1);  // the last line (the first one need not be aligned)
    return w.testing || w.num_kept == max_candidates_;
  }

  // One step of a row's lookup: read an order's head, or probe one candidate (the same
  // checks, in the same order, as the scan the header comment specifies), or finish a
  // candidate's context comparison.
  void step(Walk& w) const {
    const Slot& s = *w.slot;
    const size_t num_orders = orders_.size();
    switch (w.phase) {
      case Walk::kHead:
        w.cand = head_[(static_cast<size_t>(w.order) << table_bits_) + s.bucket[w.order]];
        prefetch_candidate(w.cand, w.order);
        w.phase = Walk::kProbe;
        return;
      case Walk::kVerify: {
        w.phase = Walk::kProbe;
        if (matches(w.pending, s, orders_[w.order]) && keep(w, w.pending, cells_[w.pending & (capacity_ - 1)].next)) {
          end_order(w, false);
        }
        return;
      }
      case Walk::kProbe: {
        if (w.cand == 0) return end_order(w, true);
        if (w.probes >= max_probes_) return end_order(w, false);
        const uint64_t p = w.cand - 1;
        if (p < begin_) return end_order(w, true);  // chains run newest to oldest: the rest is evicted too
        ++w.probes;
        const size_t at = p & (capacity_ - 1);
        const Cell& c = cells_[at];
        w.cand = chain_[at * num_orders + w.order];
        prefetch_candidate(w.cand, w.order);
        if (c.next == 0 || c.token != s.back(0)) return;
        if (w.order == 0) {  // order 1: the token itself is the context
          if (keep(w, p, c.next)) end_order(w, false);
          return;
        }
        // Compare the rest of the context next round; its cells usually sit just before p.
        const int64_t k = orders_[w.order];
        const size_t first = at >= static_cast<size_t>(k - 1) ? at - static_cast<size_t>(k - 1) : 0;
        const char* base = reinterpret_cast<const char*>(&cells_[0]);
        for (size_t b = first * sizeof(Cell); b < at * sizeof(Cell); b += 64) prefetch(base + b);
        w.pending = p;
        w.phase = Walk::kVerify;
        return;
      }
    }
  }

  // The continuations' trie of the kept positions, and the output (see the header comment).
  //
  // The trie is path-compressed: an edge is a run of nodes that one candidate created (the
  // nodes after its continuation left the existing trie: a new node has no children yet,
  // so everything after it is new too), kept as the arena position of its first token and
  // a length, and split where a later continuation leaves it or ends inside it. Novel text
  // has continuations that share nothing, and costs one edge each instead of one node per
  // token. A node's creation rank in the uncompressed trie is (candidate that created it,
  // depth), so "highest count, then created first" orders nodes by (count desc, creator,
  // depth); the nodes of an edge share count and creator and have consecutive depths, and
  // edges with the same count and creator are pieces of one run (disjoint depths), so
  // emitting whole edges sorted by (count desc, creator, first depth) gives that order.
  template <typename Tok>
  void build_tree(const Walk& w, Scratch& scratch, int64_t depth, int64_t max_nodes, Tok* out_tokens,
                  int64_t* out_parents, int32_t* out_counts) const {
    const Slot& s = *w.slot;
    for (int64_t i = 0; i <= max_nodes; ++i) {
      out_tokens[i] = -1;
      out_parents[i] = -1;
      out_counts[i] = 0;
    }
    out_tokens[0] = static_cast<Tok>(s.back(0));
    out_counts[0] = w.num_kept;
    if (w.num_kept == 0 || max_nodes == 0 || depth == 0) return;
    const uint64_t mask = capacity_ - 1;
    auto cell = [&](uint32_t q) -> const Cell& { return cells_[(q - 1) & mask]; };  // q > p >= begin: cached
    std::vector<Edge>& edges = scratch.edges;
    edges.clear();
    edges.push_back(Edge{0, -1, 0, w.num_kept, -1, 0, -1, -1, -1, 0});  // the root
    for (int32_t c = 0; c < w.num_kept; ++c) {
      uint32_t q = cells_[w.kept[c] & mask].next;  // the continuation's next token (+ 1)
      int64_t d = 0;                                // its tokens placed so far
      int32_t at = 0;                               // the edge they end on
      while (d < depth && q != 0) {
        const int32_t token = cell(q).token;
        int32_t e = edges[at].first_child, last = -1;
        while (e >= 0 && edges[e].token != token) {
          last = e;
          e = edges[e].next_sibling;
        }
        if (e < 0) {  // the rest of the continuation is new: one edge
          const int32_t added = static_cast<int32_t>(edges.size());
          edges.push_back(Edge{q, token, static_cast<int32_t>(depth - d), 1, c, static_cast<int32_t>(d + 1), at, -1, -1,
                               0});
          if (last < 0) edges[at].first_child = added;
          else edges[last].next_sibling = added;
          break;
        }
        // Follow edge e while the continuation agrees with it (its first token does).
        int32_t i = 0;
        uint32_t pe = edges[e].pos;
        do {
          ++i, ++d;
          pe = cell(pe).next;
          q = cell(q).next;
        } while (i < edges[e].length && pe != 0 && d < depth && q != 0 && cell(pe).token == cell(q).token);
        if (pe == 0) edges[e].length = i;  // the edge's sequence ends here: now its length is known
        if (i < edges[e].length) {  // left or ended inside e: split it, the tail keeps e's count
          const int32_t tail = static_cast<int32_t>(edges.size());
          const Edge& head = edges[e];
          edges.push_back(Edge{pe, cell(pe).token, head.length - i, head.count, head.creator, head.depth + i, e,
                               head.first_child, -1, 0});
          for (int32_t ch = edges[tail].first_child; ch >= 0; ch = edges[ch].next_sibling) edges[ch].parent = tail;
          edges[e].first_child = tail;
          edges[e].length = i;
        }
        ++edges[e].count;
        at = e;
      }
    }
    std::vector<int32_t>& order = scratch.order;
    order.resize(edges.size() - 1);
    for (size_t i = 1; i < edges.size(); ++i) order[i - 1] = static_cast<int32_t>(i);
    std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
      const Edge &a = edges[x], &b = edges[y];
      if (a.count != b.count) return a.count > b.count;
      if (a.creator != b.creator) return a.creator < b.creator;
      return a.depth < b.depth;
    });
    // Emit: a parent edge precedes its children in this order, so its last node's output
    // index is known when a child's first node needs it.
    int64_t emitted = 0;
    for (int32_t e : order) {
      Edge& edge = edges[e];
      int64_t parent = edge.parent == 0 ? 0 : edges[edge.parent].out_last;
      uint32_t pe = edge.pos;
      for (int32_t j = 0; j < edge.length && pe != 0; ++j) {
        if (emitted == max_nodes) return;
        ++emitted;
        out_tokens[emitted] = static_cast<Tok>(cell(pe).token);
        out_parents[emitted] = parent;
        out_counts[emitted] = edge.count;
        parent = emitted;
        pe = cell(pe).next;
      }
      edge.out_last = static_cast<int32_t>(parent);
    }
  }

  uint64_t max_tokens_, capacity_ = 0;
  int64_t max_candidates_, max_probes_;
  int table_bits_ = 0;
  int64_t max_order_ = 1;
  std::vector<int> orders_;
  int8_t order_index_[kMaxDepth + 1];  // match length -> order index (-1: no such order)
  LargeArray<Cell> cells_;
  LargeArray<uint32_t> chain_, head_;
  std::vector<Slot> slots_;
  Slot add_slot_;
  uint64_t begin_ = 0, end_ = 0;
  std::vector<uint32_t> pending_buckets_;  // append_rows: every push's buckets, then the pushes
  std::vector<uint8_t> pending_usable_;
};

}  // namespace cpu
}  // namespace specdec
