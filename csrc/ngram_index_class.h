// torch.classes.specdec.NgramIndex: the incremental n-gram index of running sequences, one
// cpu::NgramHistoryIndex (include/specdec/ngram_index.h) per slot. Declared here so that
// csrc/ops.cpp registers it with every other schema; the methods are in ngram_index.cpp.
// Methods take int64 CPU tensors; the Python wrapper (specdec_kernels/ngram_index.py)
// normalises arguments. Calls through torch.classes methods release the GIL around the call
// (python_tests/test_ngram_index.py::test_gil_released).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "specdec/ngram_index.h"

namespace specdec {

class NgramIndex : public torch::CustomClassHolder {
 public:
  // num_slots >= 1 sequences, n-grams up to max_n in [1, 64] tokens, hash_bits in [0, 64]
  // (how many bits of each token id the hash keeps).
  NgramIndex(int64_t num_slots, int64_t max_n, int64_t hash_bits);

  int64_t num_slots() const { return static_cast<int64_t>(slots_.size()); }
  int64_t max_n() const { return max_n_; }
  int64_t length(int64_t slot) const;  // tokens held by `slot`
  int64_t memory_bytes() const;        // bytes held by all slots
  at::Tensor history(int64_t slot) const;  // a copy of the slot's tokens, int64 [length]

  // Replaces `slot`'s history by `prompt` (int64 [N]).
  void reset(int64_t slot, const at::Tensor& prompt);
  // Appends tokens[r, :counts[r]] to slots[r] (distinct slots), rows in parallel.
  void append(const at::Tensor& slots, const at::Tensor& tokens, const at::Tensor& counts);
  // ngram_propose on each slot's history: (drafts int64 [R, num_tokens], lengths int32 [R]).
  std::tuple<at::Tensor, at::Tensor> propose(const at::Tensor& slots, int64_t min_n, int64_t max_n,
                                             int64_t num_tokens, std::string policy);
  // append, then propose, in one pass over the rows.
  std::tuple<at::Tensor, at::Tensor> append_and_propose(const at::Tensor& slots, const at::Tensor& tokens,
                                                        const at::Tensor& counts, int64_t min_n, int64_t max_n,
                                                        int64_t num_tokens, std::string policy);

 private:
  // The rows of one call: slot ids, and for appends the tokens and counts (contiguous).
  struct Rows {
    int64_t count = 0, width = 0;
    const int64_t* slots = nullptr;
    const int64_t* tokens = nullptr;
    const int64_t* counts = nullptr;
    at::Tensor keep_slots, keep_tokens, keep_counts;  // contiguous copies, if any were made
  };

  int64_t check_slot(const char* what, int64_t slot) const;
  Rows check_rows(const char* op, const at::Tensor& slots, const at::Tensor* tokens, const at::Tensor* counts,
                  bool distinct) const;
  std::tuple<at::Tensor, at::Tensor> propose_rows(const Rows& rows, int64_t min_n, int64_t max_n, int64_t num_tokens,
                                                  const std::string& policy, bool append);

  std::vector<cpu::NgramHistoryIndex> slots_;
  int64_t max_n_ = 0;
};

}  // namespace specdec
