// SuffixIndex's methods (the class is declared in suffix_index_class.h and registered in
// ops.cpp): argument checks and threading here, the cache itself in
// include/specdec/suffix_index.h. Appends are serial (every row writes the one shared
// cache, in row order, so results do not depend on threads); drafts only read it and run
// rows in parallel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "checks.h"
#include "suffix_index_class.h"

namespace specdec {
namespace {

// Rows per thread. A draft costs ~0.5-1 us; at 64 rows a second thread saved up to ~0.4 us
// per row on an idle 2-core machine, but when the other core was busy (other processes) the
// fork/join waited milliseconds for the worker (~120 us per row, both before and after the
// lookups were interleaved, in 3 of 6 benchmark runs): threads only from 128 rows up.
constexpr int64_t kDraftGrain = 64;

cpu::SuffixCache make_cache(int64_t max_tokens, int64_t max_depth, int64_t num_slots, int64_t max_candidates,
                            int64_t max_probes, int64_t table_bits) {
  TORCH_CHECK(max_tokens >= 1 && max_tokens <= (int64_t{1} << 30), "SuffixIndex: max_tokens must be in [1, 2^30], got ",
              max_tokens);
  TORCH_CHECK(max_depth >= 1 && max_depth <= cpu::SuffixCache::kMaxDepth,
              "SuffixIndex: max_depth must be in [1, 32], got ", max_depth);
  TORCH_CHECK(num_slots >= 1, "SuffixIndex: num_slots must be >= 1, got ", num_slots);
  TORCH_CHECK(max_candidates >= 1 && max_candidates <= 1024, "SuffixIndex: max_candidates must be in [1, 1024], got ",
              max_candidates);
  TORCH_CHECK(max_probes >= 1, "SuffixIndex: max_probes must be >= 1, got ", max_probes);
  TORCH_CHECK(table_bits >= 0 && table_bits <= 31, "SuffixIndex: table_bits must be in [0, 31], got ", table_bits);
  return cpu::SuffixCache(max_tokens, max_depth, num_slots, max_candidates, max_probes, table_bits);
}

}  // namespace

SuffixIndex::SuffixIndex(int64_t max_tokens, int64_t max_depth, int64_t num_slots, int64_t max_candidates,
                         int64_t max_probes, int64_t vocab_size, int64_t table_bits)
    : cache_(make_cache(max_tokens, max_depth, num_slots, max_candidates, max_probes, table_bits)),
      vocab_size_(vocab_size) {
  TORCH_CHECK(vocab_size >= 0 && vocab_size <= std::numeric_limits<int32_t>::max(),
              "SuffixIndex: vocab_size must be in [0, 2^31 - 1] (0: unknown), got ", vocab_size);
}

int64_t SuffixIndex::length(int64_t slot) const { return cache_.slot_length(check_slot("SuffixIndex.length", "slot", slot)); }

int64_t SuffixIndex::check_slot(const char* op, const char* name, int64_t slot) const {
  TORCH_CHECK(slot >= 0 && slot < num_slots(), op, ": ", name, " = ", slot, " is out of range [0, ", num_slots(), ")");
  return slot;
}

void SuffixIndex::check_tokens(const char* op, const char* name, const int64_t* tokens, int64_t count) const {
  const int64_t limit = vocab_size_ > 0 ? vocab_size_ : std::numeric_limits<int32_t>::max();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < limit, op, ": ", name, " holds token id ", tokens[i],
                "; expected ids in [0, ", limit, ")", vocab_size_ > 0 ? " (the vocabulary)" : "");
  }
}

void SuffixIndex::check_slots(const char* op, const at::Tensor& slots, bool distinct) const {
  check_tensor(op, "slots", slots, 1, at::kLong);
  check_device(op, "slots", slots, at::Device(at::kCPU));
  std::vector<char> seen(distinct ? static_cast<size_t>(num_slots()) : 0, 0);
  const at::Tensor s = slots.contiguous();
  const int64_t* ids = s.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < s.size(0); ++r) {
    TORCH_CHECK(ids[r] >= 0 && ids[r] < num_slots(), op, ": slots[", r, "] = ", ids[r], " is out of range [0, ",
                num_slots(), ")");
    if (distinct) {
      TORCH_CHECK(!seen[ids[r]], op, ": slots[", r, "] = ", ids[r], " appears twice; each slot may be appended once per call");
      seen[ids[r]] = 1;
    }
  }
}

void SuffixIndex::add(const at::Tensor& tokens, const at::Tensor& offsets) {
  const char* op = "SuffixIndex.add";
  check_tensor(op, "tokens", tokens, 1, at::kLong);
  check_tensor(op, "offsets", offsets, 1, at::kLong);
  check_device(op, "tokens", tokens, at::Device(at::kCPU));
  check_device(op, "offsets", offsets, at::Device(at::kCPU));
  TORCH_CHECK(offsets.size(0) >= 1, op, ": offsets must have S + 1 >= 1 entries");
  const at::Tensor t = tokens.contiguous(), o = offsets.contiguous();
  const int64_t* tok = t.const_data_ptr<int64_t>();
  const int64_t* off = o.const_data_ptr<int64_t>();
  const int64_t num = o.size(0) - 1;
  TORCH_CHECK(off[0] == 0 && off[num] == t.size(0), op, ": offsets must start at 0 and end at tokens.size(0) = ",
              t.size(0));
  for (int64_t i = 0; i < num; ++i) TORCH_CHECK(off[i] <= off[i + 1], op, ": offsets must be non-decreasing");
  check_tokens(op, "tokens", tok, t.size(0));
  for (int64_t i = 0; i < num; ++i) cache_.add(tok + off[i], off[i + 1] - off[i]);
}

void SuffixIndex::start(int64_t slot, const at::Tensor& prompt) {
  const char* op = "SuffixIndex.start";
  check_slot(op, "slot", slot);
  check_tensor(op, "prompt_tokens", prompt, 1, at::kLong);
  check_device(op, "prompt_tokens", prompt, at::Device(at::kCPU));
  const at::Tensor p = prompt.contiguous();
  check_tokens(op, "prompt_tokens", p.const_data_ptr<int64_t>(), p.numel());
  cache_.start(slot);
  cache_.append(slot, p.const_data_ptr<int64_t>(), p.numel());
}

void SuffixIndex::fork(int64_t slot, int64_t from) {
  check_slot("SuffixIndex.fork", "slot", slot);
  check_slot("SuffixIndex.fork", "from_slot", from);
  cache_.share(slot, from);
}

void SuffixIndex::append(const at::Tensor& slots, const at::Tensor& tokens, const at::Tensor& counts) {
  const char* op = "SuffixIndex.append";
  check_slots(op, slots, /*distinct=*/true);
  const int64_t rows = slots.size(0);
  check_tensor(op, "accepted_tokens", tokens, 2, at::kLong);
  check_tensor(op, "counts", counts, 1, at::kLong);
  check_device(op, "accepted_tokens", tokens, at::Device(at::kCPU));
  check_device(op, "counts", counts, at::Device(at::kCPU));
  check_size(op, "accepted_tokens", tokens, 0, rows, "R (slots.size(0))");
  check_size(op, "counts", counts, 0, rows, "R (slots.size(0))");
  const at::Tensor s = slots.contiguous(), t = tokens.contiguous(), c = counts.contiguous();
  const int64_t* ids = s.const_data_ptr<int64_t>();
  const int64_t* tok = t.const_data_ptr<int64_t>();
  const int64_t* cnt = c.const_data_ptr<int64_t>();
  const int64_t width = t.size(1);
  for (int64_t r = 0; r < rows; ++r) {  // every check before the first write
    TORCH_CHECK(cnt[r] >= 0 && cnt[r] <= width, op, ": counts[", r, "] = ", cnt[r], "; expected 0 <= counts[r] <= K = ",
                width);
    check_tokens(op, "accepted_tokens", tok + r * width, cnt[r]);
  }
  cache_.append_rows(ids, tok, width, cnt, rows);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> SuffixIndex::draft(const at::Tensor& slots, int64_t depth,
                                                                               int64_t max_nodes) {
  const char* op = "SuffixIndex.draft";
  check_slots(op, slots, /*distinct=*/false);
  TORCH_CHECK(depth >= 0, op, ": num_tokens must be >= 0, got ", depth);
  TORCH_CHECK(max_nodes >= 0, op, ": max_nodes must be >= 0, got ", max_nodes);
  const at::Tensor s = slots.contiguous();
  const int64_t* ids = s.const_data_ptr<int64_t>();
  const int64_t rows = s.size(0), width = 1 + max_nodes;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(cache_.slot_length(ids[r]) >= 1, op, ": slot ", ids[r], " holds no tokens (start it with a prompt)");
  }
  const auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor tokens = at::empty({rows, width}, opts), parents = at::empty({rows, width}, opts);
  at::Tensor counts = at::empty({rows, width}, at::TensorOptions().dtype(at::kInt));
  at::Tensor matches = at::empty({rows}, at::TensorOptions().dtype(at::kInt));
  int64_t* tok = tokens.mutable_data_ptr<int64_t>();
  int64_t* par = parents.mutable_data_ptr<int64_t>();
  int32_t* cnt = counts.mutable_data_ptr<int32_t>();
  int32_t* match = matches.mutable_data_ptr<int32_t>();
  at::parallel_for(0, rows, kDraftGrain, [&](int64_t begin, int64_t end) {
    cache_.draft_rows(ids + begin, end - begin, depth, max_nodes, tok + begin * width, par + begin * width,
                      cnt + begin * width, match + begin);
  });
  cache_.remember(ids, match, rows);  // where each slot's next lookup starts (never what it finds)
  return {tokens, parents, counts, matches};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> SuffixIndex::append_and_draft(
    const at::Tensor& slots, const at::Tensor& tokens, const at::Tensor& counts, int64_t depth, int64_t max_nodes) {
  append(slots, tokens, counts);
  return draft(slots, depth, max_nodes);
}

}  // namespace specdec
