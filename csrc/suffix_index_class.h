// torch.classes.specdec.SuffixIndex: the cross-sequence suffix cache of
// include/specdec/suffix_index.h (cpu::SuffixCache) behind a torch custom class. Declared
// here so that csrc/ops.cpp registers it with every other schema; the methods are in
// suffix_index.cpp. Methods take int64 CPU tensors; the Python wrapper
// (specdec_kernels/ops/suffix_index.py) normalises arguments. Calls through torch.classes
// methods release the GIL around the call.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <tuple>

#include "specdec/suffix_index.h"

namespace specdec {

class SuffixIndex : public torch::CustomClassHolder {
 public:
  // See SuffixCache; vocab_size 0: token ids only need to fit in int32.
  SuffixIndex(int64_t max_tokens, int64_t max_depth, int64_t num_slots, int64_t max_candidates, int64_t max_probes,
              int64_t vocab_size, int64_t table_bits);

  int64_t num_slots() const { return cache_.num_slots(); }
  void reserve_slots(int64_t num_slots) { cache_.reserve_slots(num_slots); }
  int64_t cached() const { return cache_.cached(); }
  int64_t appended() const { return cache_.appended(); }
  int64_t memory_bytes() const { return cache_.memory_bytes(); }
  int64_t length(int64_t slot) const;
  void clear() { cache_.clear(); }

  // Finished sequences: tokens[offsets[i] : offsets[i + 1]] (int64 [N], offsets int64 [S + 1]).
  void add(const at::Tensor& tokens, const at::Tensor& offsets);
  // `slot` starts a new live sequence holding `prompt` (int64 [N], may be empty).
  void start(int64_t slot, const at::Tensor& prompt);
  // `slot` continues as `from` is now (shared cached tokens).
  void fork(int64_t slot, int64_t from);
  // tokens[r, :counts[r]] appended to slots[r], in row order (distinct slots).
  void append(const at::Tensor& slots, const at::Tensor& tokens, const at::Tensor& counts);
  // Per row: (tokens int64 [R, 1 + max_nodes], parents int64, counts int32, match_lengths int32 [R]).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft(const at::Tensor& slots, int64_t depth,
                                                                   int64_t max_nodes);
  // append (every row first: rows see each other's new tokens), then draft.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> append_and_draft(const at::Tensor& slots,
                                                                              const at::Tensor& tokens,
                                                                              const at::Tensor& counts, int64_t depth,
                                                                              int64_t max_nodes);

 private:
  int64_t check_slot(const char* op, const char* name, int64_t slot) const;
  void check_tokens(const char* op, const char* name, const int64_t* tokens, int64_t count) const;
  void check_slots(const char* op, const at::Tensor& slots, bool distinct) const;

  cpu::SuffixCache cache_;
  int64_t vocab_size_;
};

}  // namespace specdec
