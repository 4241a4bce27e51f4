// NgramIndex's methods (the class is declared in ngram_index_class.h and registered in
// ops.cpp): argument checks and threading here, the index itself in
// include/specdec/ngram_index.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "ngram_checks.h"
#include "ngram_index_class.h"

namespace specdec {
namespace {

constexpr int64_t kIndexGrain = 64;  // rows per thread: each costs ~1 us

}  // namespace

NgramIndex::NgramIndex(int64_t num_slots, int64_t max_n, int64_t hash_bits) {
  TORCH_CHECK(num_slots >= 1, "NgramIndex: num_slots must be >= 1, got ", num_slots);
  TORCH_CHECK(max_n >= 1 && max_n <= 64, "NgramIndex: max_n must be in [1, 64], got ", max_n);
  TORCH_CHECK(hash_bits >= 0 && hash_bits <= 64, "NgramIndex: hash_bits must be in [0, 64], got ", hash_bits);
  const uint64_t mask = hash_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << hash_bits) - 1;
  slots_.reserve(static_cast<size_t>(num_slots));
  for (int64_t i = 0; i < num_slots; ++i) slots_.emplace_back(max_n, mask);
  max_n_ = max_n;
}

int64_t NgramIndex::length(int64_t slot) const { return slots_[check_slot("length", slot)].size(); }

int64_t NgramIndex::memory_bytes() const {
  int64_t total = 0;
  for (const auto& s : slots_) total += s.memory_bytes();
  return total;
}

at::Tensor NgramIndex::history(int64_t slot) const {
  const auto& s = slots_[check_slot("history", slot)];
  at::Tensor out = at::empty({s.size()}, at::TensorOptions().dtype(at::kLong));
  std::copy(s.tokens(), s.tokens() + s.size(), out.mutable_data_ptr<int64_t>());
  return out;
}

void NgramIndex::reset(int64_t slot, const at::Tensor& prompt) {
  cpu::NgramHistoryIndex& s = slots_[check_slot("reset", slot)];
  check_tensor("NgramIndex.reset", "prompt_tokens", prompt, 1, at::kLong);
  check_device("NgramIndex.reset", "prompt_tokens", prompt, at::Device(at::kCPU));
  const at::Tensor p = prompt.contiguous();
  TORCH_CHECK(p.numel() <= s.capacity_limit(), "NgramIndex.reset: prompt_tokens has ", p.numel(),
              " tokens, more than this index holds per slot (", s.capacity_limit(), ")");
  s.clear(p.numel());
  s.append(p.const_data_ptr<int64_t>(), p.numel());
}

void NgramIndex::append(const at::Tensor& slots, const at::Tensor& tokens, const at::Tensor& counts) {
  const Rows rows = check_rows("NgramIndex.append", slots, &tokens, &counts, /*distinct=*/true);
  at::parallel_for(0, rows.count, kIndexGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      slots_[rows.slots[r]].append(rows.tokens + r * rows.width, rows.counts[r]);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> NgramIndex::propose(const at::Tensor& slots, int64_t min_n, int64_t max_n,
                                                       int64_t num_tokens, std::string policy) {
  const Rows rows = check_rows("NgramIndex.propose", slots, nullptr, nullptr, /*distinct=*/false);
  return propose_rows(rows, min_n, max_n, num_tokens, policy, /*append=*/false);
}

std::tuple<at::Tensor, at::Tensor> NgramIndex::append_and_propose(const at::Tensor& slots, const at::Tensor& tokens,
                                                                  const at::Tensor& counts, int64_t min_n,
                                                                  int64_t max_n, int64_t num_tokens,
                                                                  std::string policy) {
  const Rows rows = check_rows("NgramIndex.append_and_propose", slots, &tokens, &counts, /*distinct=*/true);
  return propose_rows(rows, min_n, max_n, num_tokens, policy, /*append=*/true);
}

int64_t NgramIndex::check_slot(const char* what, int64_t slot) const {
  TORCH_CHECK(slot >= 0 && slot < num_slots(), "NgramIndex.", what, ": slot ", slot, " is out of range [0, ",
              num_slots(), ")");
  return slot;
}

NgramIndex::Rows NgramIndex::check_rows(const char* op, const at::Tensor& slots, const at::Tensor* tokens,
                                        const at::Tensor* counts, bool distinct) const {
  Rows rows;
  check_tensor(op, "slots", slots, 1, at::kLong);
  check_device(op, "slots", slots, at::Device(at::kCPU));
  rows.keep_slots = slots.contiguous();
  rows.slots = rows.keep_slots.const_data_ptr<int64_t>();
  rows.count = slots.size(0);
  std::vector<char> seen(distinct ? slots_.size() : 0, 0);
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t s = rows.slots[r];
    TORCH_CHECK(s >= 0 && s < num_slots(), op, ": slots[", r, "] = ", s, " is out of range [0, ", num_slots(), ")");
    if (distinct) {
      TORCH_CHECK(!seen[s], op, ": slots[", r, "] = ", s, " appears twice; each slot may be appended once per call");
      seen[s] = 1;
    }
  }
  if (tokens != nullptr) {
    check_tensor(op, "accepted_tokens", *tokens, 2, at::kLong);
    check_tensor(op, "counts", *counts, 1, at::kLong);
    check_device(op, "accepted_tokens", *tokens, at::Device(at::kCPU));
    check_device(op, "counts", *counts, at::Device(at::kCPU));
    check_size(op, "accepted_tokens", *tokens, 0, rows.count, "R (slots.size(0))");
    check_size(op, "counts", *counts, 0, rows.count, "R (slots.size(0))");
    rows.keep_tokens = tokens->contiguous();
    rows.keep_counts = counts->contiguous();
    rows.tokens = rows.keep_tokens.const_data_ptr<int64_t>();
    rows.counts = rows.keep_counts.const_data_ptr<int64_t>();
    rows.width = tokens->size(1);
    for (int64_t r = 0; r < rows.count; ++r) {
      const int64_t c = rows.counts[r];
      TORCH_CHECK(c >= 0 && c <= rows.width, op, ": counts[", r, "] = ", c, "; expected 0 <= counts[r] <= K = ",
                  rows.width);
      const auto& s = slots_[rows.slots[r]];
      TORCH_CHECK(s.size() + c <= s.capacity_limit(), op, ": slot ", rows.slots[r], " would exceed ",
                  s.capacity_limit(), " tokens");
    }
  }
  return rows;
}

std::tuple<at::Tensor, at::Tensor> NgramIndex::propose_rows(const Rows& rows, int64_t min_n, int64_t max_n,
                                                            int64_t num_tokens, const std::string& policy,
                                                            bool append) {
  const char* op = append ? "NgramIndex.append_and_propose" : "NgramIndex.propose";
  check_ngram_sizes(op, min_n, max_n, num_tokens);
  TORCH_CHECK(max_n <= max_n_, op, ": max_n = ", max_n, " exceeds the index's max_n = ", max_n_);
  const bool latest = parse_policy(op, policy);
  at::Tensor drafts = at::empty({rows.count, num_tokens}, at::TensorOptions().dtype(at::kLong));
  at::Tensor lens = at::empty({rows.count}, at::TensorOptions().dtype(at::kInt));
  int64_t* out = drafts.mutable_data_ptr<int64_t>();
  int32_t* lens_out = lens.mutable_data_ptr<int32_t>();
  at::parallel_for(0, rows.count, kIndexGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      cpu::NgramHistoryIndex& s = slots_[rows.slots[r]];
      if (append) s.append(rows.tokens + r * rows.width, rows.counts[r]);
      lens_out[r] = static_cast<int32_t>(s.propose(min_n, max_n, num_tokens, latest, out + r * num_tokens));
    }
  });
  return {drafts, lens};
}

}  // namespace specdec
