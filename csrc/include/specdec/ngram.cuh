// N-gram (prompt lookup) matching on NVIDIA GPUs: the kernels and their launchers, no torch.
// ngram_propose first; ngram_propose_tree (its own description) below it.
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
// Positions and match lengths are both < L < 2^32, so each gets 32 bits of the key (with 40
// position bits a match of 2^24 tokens or more wrapped past the top of the key).
constexpr int kNgramPositionBits = 32;

// key = len << 32 | rank, rank = e ("latest") or (2^32 - 1 - e) ("earliest"); 0 = none.
__device__ __forceinline__ uint64_t ngram_key(int64_t len, int64_t e, bool latest) {
  const uint64_t rank = latest ? static_cast<uint64_t>(e)
                               : ((uint64_t{1} << kNgramPositionBits) - 1 - static_cast<uint64_t>(e));
  return (static_cast<uint64_t>(len) << kNgramPositionBits) | rank;
}

// Block-wide max of a 64-bit key over kThreads threads (all call it; every thread gets the
// result): warps by shuffles, then the first warp over the warp results. Two __syncthreads.
template <int kThreads>
__device__ __forceinline__ uint64_t block_max_u64(uint64_t v, uint64_t* warp_max, uint64_t* result) {
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, v, delta);
    v = other > v ? other : v;
  }
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0;
#pragma unroll
    for (int delta = 16; delta > 0; delta /= 2) {
      const uint64_t other = __shfl_xor_sync(0xffffffffu, v, delta);
      v = other > v ? other : v;
    }
    if (threadIdx.x == 0) *result = v;
  }
  __syncthreads();
  return *result;
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

  best = block_max_u64<kNgramThreads>(best, warp_best, &row_best);

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


// ----------------------------------------------------------------------------- ngram_propose_tree
//
// Same contract as ngram_propose_tree_row in ngram.h. One block per row, four phases:
//
// 1. Best n: the scan above, keeping only max len(e) (stops at the first tile that reaches
//    cap). n = that max if >= min_n, else no match (the tree is just the root).
// 2. Grouping: a second coalesced scan finds every candidate end e (s[e] == s[N - 1] and the
//    n - 1 tokens before it equal the suffix's) and inserts its continuation start
//    c = e + 1 into a shared-memory hash table of kNgramTreeSlots groups: one 64-bit word per
//    slot, (hash << 32 | c + 1) claimed with atomicCAS, then count (atomicAdd) and the first
//    (atomicMin, "earliest") or last (atomicMax, "latest") c of the group. The hash is only a
//    filter: a slot whose hash matches is the same group only if the continuation tokens
//    (read from the history) are equal, token by token. Slots are never freed within a round,
//    so probing is lock free and exact: a thread that looked at all kNgramTreeProbes slots of its
//    hash's window and saw each held by another continuation knows its group cannot be in
//    the table this round, and defers c to a global-memory list (`pending`, one int32 per
//    history position, so it never overflows). After the scan, every group in the table is
//    complete (each member found it or inserted it) and disjoint from the deferred ones.
// 3. Ranking: groups are ranked by key = count << 32 | tiebreak (tiebreak = 2^31 - 1 - first
//    or last), unique because a position belongs to one group; the table's keys are merged
//    with the ranks kept so far into the best `ranks` keys (repeated block-wide max below the
//    previous one). Then the table is cleared and the next round inserts the deferred list
//    (compacted in place). Every round's first insert succeeds, so rounds terminate; one
//    round suffices unless a row has more than ~kNgramTreeSlots distinct continuations.
// 4. Trie: for rank i, shared_i = the longest common prefix with an earlier rank (owner_i:
//    the first rank attaining it). Inserting in rank order (as the CPU kernel does) adds
//    exactly tokens shared_i .. len_i - 1 of rank i as new nodes, numbered consecutively
//    after the earlier ranks' new nodes (an exclusive prefix sum of len_i - shared_i); the
//    first new node hangs under owner_i's node at depth shared_i - 1 (owner_i is the first
//    rank with that prefix, so that node is one of its own new nodes), or under the root.
//    Nodes numbered past max_nodes are dropped, which is the CPU kernel's budget cut.
//
// Only the first `ranks` = min(tree_width, max_nodes + num_tokens - 1, L - 1) ranks can add a
// node: before the budget runs out each rank adds a node or is a proper prefix of an earlier
// rank, and such prefixes run into the end of the history (length < num_tokens), at most one
// per length. Workspaces (global memory, sized from shapes only, so the op is CUDA-graph
// capturable): pending int32 [B, max(L, 1)] and ranked int64 [B, 5 * max(ranks, 1)].
// Positions must fit in 31 bits (L < 2^31).
// Cost: two scans of the row, then per round one pass over that round's candidates and up to
// `ranks` block-wide max reductions (cheap for the usual tree_width <= 8; a tree_width in the
// thousands makes ranking slow, not wrong), and O(ranks^2 * num_tokens / threads) for the trie.

constexpr int kNgramTreeThreads = 256;
constexpr int kNgramTreeItems = 4;    // positions per thread per tile
constexpr int kNgramTreeSlots = 2048;  // power of two; 16 bytes per slot in shared memory
constexpr int kNgramTreeProbes = 32;   // linear-probing window per hash
constexpr int32_t kNgramTreeNoFirst = 0x7fffffff;

// How many ranked continuations can add a node (see above); 0 when max_nodes == 0.
__host__ __device__ inline int64_t ngram_tree_ranks(int64_t tree_width, int64_t max_nodes, int64_t num_tokens,
                                                   int64_t width) {
  if (max_nodes <= 0 || width <= 1) return 0;
  int64_t ranks = tree_width < width - 1 ? tree_width : width - 1;
  if (max_nodes - 1 < ranks - num_tokens) ranks = max_nodes + num_tokens - 1;  // no overflow
  return ranks;
}

// Workspace sizes (elements per row) for launch_ngram_propose_tree.
__host__ __device__ inline int64_t ngram_tree_pending_stride(int64_t width) { return width > 1 ? width : 1; }
__host__ __device__ inline int64_t ngram_tree_ranked_stride(int64_t ranks) { return 5 * (ranks > 1 ? ranks : 1); }

// 32-bit hash of the continuation s[c, c + len) (only a filter: equal groups are compared).
template <typename Index>
__device__ __forceinline__ uint32_t ngram_tree_hash(const Index* s, int64_t stride_t, int64_t c, int64_t len) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(len);
  for (int64_t k = 0; k < len; ++k) {
    h ^= static_cast<uint64_t>(static_cast<int64_t>(s[(c + k) * stride_t]));
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 29;
  }
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return static_cast<uint32_t>(h >> 32);
}


// Adds continuation start c to its group in the table; false if it must wait for a later
// round (every slot of its window holds another continuation).
template <typename Index>
__device__ __forceinline__ bool ngram_tree_insert(const Index* s, int64_t stride_t, int64_t num, int64_t num_tokens,
                                                  int64_t c, bool latest, uint64_t* slots, int32_t* counts,
                                                  int32_t* occurrence) {
  const int64_t len = num - c < num_tokens ? num - c : num_tokens;
  const uint32_t hash = ngram_tree_hash(s, stride_t, c, len);
  const uint64_t word = (static_cast<uint64_t>(hash) << 32) | static_cast<uint64_t>(c + 1);
  int found = -1;
  for (int probe = 0; probe < kNgramTreeProbes; ++probe) {
    const int idx = static_cast<int>((hash + static_cast<uint32_t>(probe)) & (kNgramTreeSlots - 1));
    uint64_t cur = *static_cast<volatile uint64_t*>(&slots[idx]);
    if (cur == 0) {
      cur = atomicCAS(reinterpret_cast<unsigned long long*>(&slots[idx]), 0ull, static_cast<unsigned long long>(word));
      if (cur == 0) {  // claimed: c is the group's first member seen
        found = idx;
        break;
      }
    }
    // Occupied (for good within this round): the same group iff the same tokens.
    if (static_cast<uint32_t>(cur >> 32) != hash) continue;
    const int64_t other = static_cast<int64_t>(cur & 0xffffffffull) - 1;
    const int64_t other_len = num - other < num_tokens ? num - other : num_tokens;
    if (other_len != len) continue;
    int64_t k = 0;
    while (k < len && s[(c + k) * stride_t] == s[(other + k) * stride_t]) ++k;
    if (k == len) {
      found = idx;
      break;
    }
  }
  if (found < 0) return false;
  atomicAdd(&counts[found], 1);
  if (latest) {
    atomicMax(&occurrence[found], static_cast<int32_t>(c));
  } else {
    atomicMin(&occurrence[found], static_cast<int32_t>(c));
  }
  return true;
}

// Continuation start c of a rank key (count << 32 | tiebreak, phase 3 above).
__device__ __forceinline__ int64_t ngram_tree_key_start(uint64_t key, bool latest) {
  const int64_t low = static_cast<int64_t>(key & 0xffffffffull);
  return latest ? low : kNgramTreeNoFirst - low;
}

// Min 3 blocks per SM: without a minimum ptxas picks 48 registers for the int32 kernel on
// sm_90a and spills; 3 allows 80 (no spills), and ~33 KB of shared memory per block lets 3
// blocks share an SM anyway.
template <typename Index>
__global__ void __launch_bounds__(kNgramTreeThreads, 3)
    ngram_propose_tree_kernel(const Index* __restrict__ tokens, int64_t stride_b, int64_t stride_t,
                              const int64_t* __restrict__ lengths, int64_t width, int64_t min_n, int64_t max_n,
                              int64_t num_tokens, int64_t max_nodes, int64_t ranks, bool latest,
                              int32_t* __restrict__ pending_all, int64_t* __restrict__ ranked_all,
                              Index* __restrict__ tree_tokens, int64_t* __restrict__ parents) {
  __shared__ uint64_t slots[kNgramTreeSlots];
  __shared__ int32_t counts[kNgramTreeSlots];
  __shared__ int32_t occurrence[kNgramTreeSlots];  // first ("earliest") or last ("latest") c
  __shared__ uint64_t warp_max[kNgramTreeThreads / 32];
  __shared__ uint64_t block_result;
  __shared__ int32_t num_pending;

  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x;
  const Index* s = tokens + b * stride_b;
  int64_t num = lengths[b];
  num = num < 0 ? 0 : (num > width ? width : num);
  const int64_t size = 1 + max_nodes;
  Index* out_tokens = tree_tokens + b * size;
  int64_t* out_parents = parents + b * size;

  // Root and padding; the nodes below are written after several __syncthreads.
  for (int64_t k = tid; k < size; k += kNgramTreeThreads) {
    out_tokens[k] = (k == 0 && num > 0) ? s[(num - 1) * stride_t] : static_cast<Index>(-1);
    out_parents[k] = -1;
  }
  const int64_t cap = max_n < num - 1 ? max_n : num - 1;
  if (ranks <= 0 || cap < min_n || cap < 1) return;  // uniform: no node can be added

  // 1. The winning n = max len(e) over candidate ends e in [0, N - 2].
  const Index last = s[(num - 1) * stride_t];
  const int64_t tile = static_cast<int64_t>(kNgramTreeThreads) * kNgramTreeItems;
  int64_t n = 0;
  {
    const int64_t count = num - 1;
    int64_t best = 0;
    for (int64_t base = 0; base < count; base += tile) {
#pragma unroll
      for (int i = 0; i < kNgramTreeItems; ++i) {
        const int64_t e = base + i * kNgramTreeThreads + tid;
        if (e < count && s[e * stride_t] == last) {
          const int64_t limit = cap < e + 1 ? cap : e + 1;
          int64_t len = 1;
          while (len < limit && s[(e - len) * stride_t] == s[(num - 1 - len) * stride_t]) ++len;
          best = len > best ? len : best;
        }
      }
      if (__syncthreads_or(best >= cap)) break;
    }
    best = static_cast<int64_t>(block_max_u64<kNgramTreeThreads>(static_cast<uint64_t>(best), warp_max, &block_result));
    if (best < min_n) return;  // uniform
    n = best;
  }

  // 2. Round 0: scan ends e in [n - 1, N - 2] and group their continuations.
  int32_t* pending = pending_all + b * ngram_tree_pending_stride(width);
  for (int t = tid; t < kNgramTreeSlots; t += kNgramTreeThreads) {
    slots[t] = 0;
    counts[t] = 0;
    occurrence[t] = latest ? -1 : kNgramTreeNoFirst;
  }
  if (tid == 0) num_pending = 0;
  __syncthreads();
  {
    const int64_t count = num - n;
    for (int64_t base = 0; base < count; base += tile) {
#pragma unroll
      for (int i = 0; i < kNgramTreeItems; ++i) {
        const int64_t offset = base + i * kNgramTreeThreads + tid;
        if (offset < count) {
          const int64_t e = n - 1 + offset;
          if (s[e * stride_t] == last) {
            int64_t k = 1;
            while (k < n && s[(e - k) * stride_t] == s[(num - 1 - k) * stride_t]) ++k;
            if (k == n &&
                !ngram_tree_insert(s, stride_t, num, num_tokens, e + 1, latest, slots, counts, occurrence)) {
              pending[atomicAdd(&num_pending, 1)] = static_cast<int32_t>(e + 1);
            }
          }
        }
      }
    }
  }

  // 3. Rank the table's groups into the best `ranks` keys; more rounds for deferred ones.
  // Row workspace: two key buffers (current best keys, descending, and the next ones), then
  // per-rank shared prefix length, owner and first node id for phase 4.
  int64_t* row_ws = ranked_all + b * ngram_tree_ranked_stride(ranks);
  int64_t* keys = row_ws;
  int64_t* next_keys = row_ws + ranks;
  int64_t num_ranked = 0;  // the same in every thread
  while (true) {
    __syncthreads();  // the round's inserts (and earlier writes of `keys`) are complete
    int64_t merged = 0;
    uint64_t below = ~0ull;
    for (; merged < ranks; ++merged) {
      uint64_t best = 0;
      for (int t = tid; t < kNgramTreeSlots; t += kNgramTreeThreads) {
        const int32_t cnt = counts[t];
        if (cnt > 0) {
          const uint32_t tie = latest ? static_cast<uint32_t>(occurrence[t])
                                      : static_cast<uint32_t>(kNgramTreeNoFirst - occurrence[t]);
          const uint64_t key = (static_cast<uint64_t>(cnt) << 32) | tie;
          if (key < below && key > best) best = key;
        }
      }
      for (int64_t k = tid; k < num_ranked; k += kNgramTreeThreads) {
        const uint64_t key = static_cast<uint64_t>(keys[k]);
        if (key < below && key > best) best = key;
      }
      best = block_max_u64<kNgramTreeThreads>(best, warp_max, &block_result);
      if (best == 0) break;  // uniform
      if (tid == 0) next_keys[merged] = static_cast<int64_t>(best);
      below = best;
    }
    num_ranked = merged;
    int64_t* swap = keys;
    keys = next_keys;
    next_keys = swap;

    const int32_t total = num_pending;  // final: read after the round's __syncthreads
    if (total == 0) break;              // uniform
    __syncthreads();                    // everyone has read the table and num_pending
    for (int t = tid; t < kNgramTreeSlots; t += kNgramTreeThreads) {
      slots[t] = 0;
      counts[t] = 0;
      occurrence[t] = latest ? -1 : kNgramTreeNoFirst;
    }
    if (tid == 0) num_pending = 0;
    __syncthreads();
    // Deferred entries are compacted in place: tile writes land below the end of the tiles
    // read so far, and the __syncthreads orders this tile's reads before any write.
    for (int64_t base = 0; base < total; base += kNgramTreeThreads) {
      const int64_t i = base + tid;
      const int32_t c = i < total ? pending[i] : -1;
      __syncthreads();
      if (c >= 0 && !ngram_tree_insert(s, stride_t, num, num_tokens, static_cast<int64_t>(c), latest, slots, counts,
                                       occurrence)) {
        pending[atomicAdd(&num_pending, 1)] = c;
      }
    }
  }
  __syncthreads();  // thread 0's last key writes are visible

  // 4. Trie: shared prefix and owner per rank, node numbering, nodes.
  int64_t* shared_len = row_ws + 2 * ranks;
  int64_t* owner = row_ws + 3 * ranks;
  int64_t* node_base = row_ws + 4 * ranks;
  for (int64_t i = tid; i < num_ranked; i += kNgramTreeThreads) {
    const int64_t c = ngram_tree_key_start(static_cast<uint64_t>(keys[i]), latest);
    const int64_t len = num - c < num_tokens ? num - c : num_tokens;
    int64_t best = 0, best_owner = -1;
    for (int64_t o = 0; o < i && best < len; ++o) {
      const int64_t co = ngram_tree_key_start(static_cast<uint64_t>(keys[o]), latest);
      const int64_t lo = num - co < num_tokens ? num - co : num_tokens;
      const int64_t common = len < lo ? len : lo;
      int64_t k = 0;
      while (k < common && s[(c + k) * stride_t] == s[(co + k) * stride_t]) ++k;
      if (k > best) {
        best = k;
        best_owner = o;
      }
    }
    shared_len[i] = best;
    owner[i] = best_owner;
  }
  __syncthreads();
  if (tid < 32) {  // node_base[i] = 1 + sum of new-node counts of ranks < i (warp scan)
    int64_t carry = 1;
    for (int64_t chunk = 0; chunk < num_ranked; chunk += 32) {
      const int64_t i = chunk + tid;
      int64_t fresh = 0;
      if (i < num_ranked) {
        const int64_t c = ngram_tree_key_start(static_cast<uint64_t>(keys[i]), latest);
        fresh = (num - c < num_tokens ? num - c : num_tokens) - shared_len[i];
      }
      int64_t sum = fresh;
#pragma unroll
      for (int delta = 1; delta < 32; delta *= 2) {
        const int64_t other = __shfl_up_sync(0xffffffffu, sum, delta);
        if (tid >= delta) sum += other;
      }
      if (i < num_ranked) node_base[i] = carry + sum - fresh;
      carry += __shfl_sync(0xffffffffu, sum, 31);
    }
  }
  __syncthreads();
  for (int64_t i = tid; i < num_ranked; i += kNgramTreeThreads) {
    const int64_t first_id = node_base[i];
    if (first_id > max_nodes) continue;
    const int64_t c = ngram_tree_key_start(static_cast<uint64_t>(keys[i]), latest);
    const int64_t len = num - c < num_tokens ? num - c : num_tokens;
    const int64_t sh = shared_len[i];
    int64_t parent = 0;
    if (sh > 0) {
      const int64_t o = owner[i];
      parent = node_base[o] + (sh - 1 - shared_len[o]);
    }
    for (int64_t k = sh; k < len; ++k) {
      const int64_t id = first_id + (k - sh);
      if (id > max_nodes) break;
      out_tokens[id] = s[(c + k) * stride_t];
      out_parents[id] = parent;
      parent = id;
    }
  }
}

// tree_tokens [B, 1 + max_nodes] and parents (int64, same shape; both contiguous) from tokens
// [B, L] (any strides) and lengths [B] (int64). Workspaces: pending int32
// [B, ngram_tree_pending_stride(L)] and ranked int64 [B, ngram_tree_ranked_stride(ranks)] with
// ranks = ngram_tree_ranks(tree_width, max_nodes, num_tokens, L); uninitialised is fine.
// Requires B <= 2^31 - 1 and L < 2^31.
template <typename Index>
cudaError_t launch_ngram_propose_tree(const Index* tokens, int64_t stride_b, int64_t stride_t, const int64_t* lengths,
                                      int64_t batch, int64_t width, int64_t min_n, int64_t max_n, int64_t num_tokens,
                                      int64_t tree_width, int64_t max_nodes, bool latest, int32_t* pending,
                                      int64_t* ranked, Index* tree_tokens, int64_t* parents, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  const int64_t ranks = ngram_tree_ranks(tree_width, max_nodes, num_tokens, width);
  ngram_propose_tree_kernel<Index><<<static_cast<unsigned int>(batch), kNgramTreeThreads, 0, stream>>>(
      tokens, stride_b, stride_t, lengths, width, min_n, max_n, num_tokens, max_nodes, ranks, latest, pending, ranked,
      tree_tokens, parents);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specdec
