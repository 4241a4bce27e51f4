// CPU kernels for ngram_propose and ngram_propose_tree, and the incremental index class
// torch.classes.specdec.NgramIndex: threading here, argument rules in ngram_checks.h, loops
// in include/specdec/ngram.h and include/specdec/ngram_index.h.
//
// The GIL: calls through torch.ops.specdec.* and through torch.classes methods release
// the GIL before running the kernel (torch's Python bindings for operators and script
// methods drop it around the call), so other Python threads run meanwhile;
// python_tests/test_ngram_index.py::test_gil_released checks it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "ngram_checks.h"
#include "specdec/ngram.h"
#include "specdec/ngram_index.h"

namespace specdec {
namespace {

// Roughly how many history tokens a thread should get before threading pays off.
constexpr int64_t kGrainTokens = 65536;

// Row lengths, checked against L (cheap: B reads), and the grain for parallel_for.
std::vector<int64_t> row_lengths(const char* op, const at::Tensor& lengths, int64_t width, int64_t* grain) {
  const at::Tensor lens = lengths.contiguous();
  const int64_t* data = lens.const_data_ptr<int64_t>();
  std::vector<int64_t> out(data, data + lens.numel());
  int64_t total = 0;
  for (size_t b = 0; b < out.size(); ++b) {
    TORCH_CHECK(out[b] >= 0 && out[b] <= width, op, ": lengths[", b, "] = ", out[b], "; expected 0 <= lengths[b] <= L = ",
                width);
    total += out[b];
  }
  const int64_t mean = out.empty() ? 1 : std::max<int64_t>(1, total / static_cast<int64_t>(out.size()));
  *grain = std::max<int64_t>(1, kGrainTokens / mean);
  return out;
}

std::tuple<at::Tensor, at::Tensor> ngram_propose_cpu(const at::Tensor& tokens_in, const at::Tensor& lengths,
                                                     int64_t min_n, int64_t max_n, int64_t num_tokens,
                                                     std::string policy) {
  constexpr const char* op = "ngram_propose";
  const bool latest =
      check_ngram_args(op, tokens_in, lengths, min_n, max_n, num_tokens, policy, at::Device(at::kCPU));
  const at::Tensor tokens = tokens_in.contiguous();  // rows are scanned with SIMD loads
  const int64_t batch = tokens.size(0);
  const int64_t width = tokens.size(1);
  int64_t grain = 1;
  const std::vector<int64_t> lens = row_lengths(op, lengths, width, &grain);
  at::Tensor drafts = tokens.new_empty({batch, num_tokens});
  at::Tensor draft_lens = tokens.new_empty({batch}, tokens.options().dtype(at::kInt));
  int32_t* lens_out = draft_lens.mutable_data_ptr<int32_t>();
  AT_DISPATCH_INDEX_TYPES(tokens.scalar_type(), "ngram_propose_cpu", [&] {
    const index_t* data = tokens.const_data_ptr<index_t>();
    index_t* out = drafts.mutable_data_ptr<index_t>();
    at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        lens_out[b] = static_cast<int32_t>(
            cpu::ngram_propose_row(data + b * width, lens[b], min_n, max_n, num_tokens, latest, out + b * num_tokens));
      }
    });
  });
  return {drafts, draft_lens};
}

std::tuple<at::Tensor, at::Tensor> ngram_propose_tree_cpu(const at::Tensor& tokens_in, const at::Tensor& lengths,
                                                          int64_t min_n, int64_t max_n, int64_t num_tokens,
                                                          int64_t tree_width, int64_t max_nodes, std::string policy) {
  constexpr const char* op = "ngram_propose_tree";
  const bool latest =
      check_ngram_args(op, tokens_in, lengths, min_n, max_n, num_tokens, policy, at::Device(at::kCPU));
  check_ngram_tree_args(op, tree_width, max_nodes);
  const at::Tensor tokens = tokens_in.contiguous();
  const int64_t batch = tokens.size(0);
  const int64_t width = tokens.size(1);
  int64_t grain = 1;
  const std::vector<int64_t> lens = row_lengths(op, lengths, width, &grain);
  const int64_t size = 1 + max_nodes;
  at::Tensor tree_tokens = tokens.new_empty({batch, size});
  at::Tensor parents = tokens.new_empty({batch, size}, tokens.options().dtype(at::kLong));
  int64_t* parents_out = parents.mutable_data_ptr<int64_t>();
  AT_DISPATCH_INDEX_TYPES(tokens.scalar_type(), "ngram_propose_tree_cpu", [&] {
    const index_t* data = tokens.const_data_ptr<index_t>();
    index_t* out = tree_tokens.mutable_data_ptr<index_t>();
    at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
      cpu::TreeScratch scratch;
      for (int64_t b = begin; b < end; ++b) {
        cpu::ngram_propose_tree_row(data + b * width, lens[b], min_n, max_n, num_tokens, tree_width, max_nodes, latest,
                                    out + b * size, parents_out + b * size, scratch);
      }
    });
  });
  return {tree_tokens, parents};
}

// ----------------------------------------------------------------------------- NgramIndex

// One NgramHistoryIndex per slot (running sequence). Methods take int64 CPU tensors; the
// Python wrapper (specdec_kernels/ngram_index.py) normalises arguments.
class NgramIndex : public torch::CustomClassHolder {
 public:
  NgramIndex(int64_t num_slots, int64_t max_n, int64_t hash_bits) {
    TORCH_CHECK(num_slots >= 1, "NgramIndex: num_slots must be >= 1, got ", num_slots);
    TORCH_CHECK(max_n >= 1 && max_n <= 64, "NgramIndex: max_n must be in [1, 64], got ", max_n);
    TORCH_CHECK(hash_bits >= 0 && hash_bits <= 64, "NgramIndex: hash_bits must be in [0, 64], got ", hash_bits);
    const uint64_t mask = hash_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << hash_bits) - 1;
    slots_.reserve(static_cast<size_t>(num_slots));
    for (int64_t i = 0; i < num_slots; ++i) slots_.emplace_back(max_n, mask);
    max_n_ = max_n;
  }

  int64_t num_slots() const { return static_cast<int64_t>(slots_.size()); }
  int64_t max_n() const { return max_n_; }

  int64_t length(int64_t slot) const { return slots_[check_slot("length", slot)].size(); }

  int64_t memory_bytes() const {
    int64_t total = 0;
    for (const auto& s : slots_) total += s.memory_bytes();
    return total;
  }

  at::Tensor history(int64_t slot) const {
    const auto& s = slots_[check_slot("history", slot)];
    at::Tensor out = at::empty({s.size()}, at::TensorOptions().dtype(at::kLong));
    std::copy(s.tokens(), s.tokens() + s.size(), out.mutable_data_ptr<int64_t>());
    return out;
  }

  void reset(int64_t slot, const at::Tensor& prompt) {
    cpu::NgramHistoryIndex& s = slots_[check_slot("reset", slot)];
    check_tensor("NgramIndex.reset", "prompt_tokens", prompt, 1, at::kLong);
    check_device("NgramIndex.reset", "prompt_tokens", prompt, at::Device(at::kCPU));
    const at::Tensor p = prompt.contiguous();
    TORCH_CHECK(p.numel() <= s.capacity_limit(), "NgramIndex.reset: prompt_tokens has ", p.numel(),
                " tokens, more than this index holds per slot (", s.capacity_limit(), ")");
    s.clear(p.numel());
    s.append(p.const_data_ptr<int64_t>(), p.numel());
  }

  void append(const at::Tensor& slots, const at::Tensor& tokens, const at::Tensor& counts) {
    const Rows rows = check_rows("NgramIndex.append", slots, &tokens, &counts, /*distinct=*/true);
    at::parallel_for(0, rows.count, kIndexGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        slots_[rows.slots[r]].append(rows.tokens + r * rows.width, rows.counts[r]);
      }
    });
  }

  std::tuple<at::Tensor, at::Tensor> propose(const at::Tensor& slots, int64_t min_n, int64_t max_n,
                                             int64_t num_tokens, std::string policy) {
    const Rows rows = check_rows("NgramIndex.propose", slots, nullptr, nullptr, /*distinct=*/false);
    return propose_rows(rows, min_n, max_n, num_tokens, policy, /*append=*/false);
  }

  std::tuple<at::Tensor, at::Tensor> append_and_propose(const at::Tensor& slots, const at::Tensor& tokens,
                                                        const at::Tensor& counts, int64_t min_n, int64_t max_n,
                                                        int64_t num_tokens, std::string policy) {
    const Rows rows = check_rows("NgramIndex.append_and_propose", slots, &tokens, &counts, /*distinct=*/true);
    return propose_rows(rows, min_n, max_n, num_tokens, policy, /*append=*/true);
  }

 private:
  static constexpr int64_t kIndexGrain = 64;  // rows per thread: each costs ~1 us

  struct Rows {
    int64_t count = 0, width = 0;
    const int64_t* slots = nullptr;
    const int64_t* tokens = nullptr;
    const int64_t* counts = nullptr;
    at::Tensor keep_slots, keep_tokens, keep_counts;  // contiguous copies, if any were made
  };

  int64_t check_slot(const char* what, int64_t slot) const {
    TORCH_CHECK(slot >= 0 && slot < num_slots(), "NgramIndex.", what, ": slot ", slot, " is out of range [0, ",
                num_slots(), ")");
    return slot;
  }

  Rows check_rows(const char* op, const at::Tensor& slots, const at::Tensor* tokens, const at::Tensor* counts,
                  bool distinct) const {
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

  std::tuple<at::Tensor, at::Tensor> propose_rows(const Rows& rows, int64_t min_n, int64_t max_n, int64_t num_tokens,
                                                  const std::string& policy, bool append) {
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

  std::vector<cpu::NgramHistoryIndex> slots_;
  int64_t max_n_ = 0;
};

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("ngram_propose", &specdec::ngram_propose_cpu);
  m.impl("ngram_propose_tree", &specdec::ngram_propose_tree_cpu);
}

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.class_<specdec::NgramIndex>("NgramIndex")
      .def(torch::init<int64_t, int64_t, int64_t>())
      .def("num_slots", &specdec::NgramIndex::num_slots)
      .def("max_n", &specdec::NgramIndex::max_n)
      .def("length", &specdec::NgramIndex::length)
      .def("memory_bytes", &specdec::NgramIndex::memory_bytes)
      .def("history", &specdec::NgramIndex::history)
      .def("reset", &specdec::NgramIndex::reset)
      .def("append", &specdec::NgramIndex::append)
      .def("propose", &specdec::NgramIndex::propose)
      .def("append_and_propose", &specdec::NgramIndex::append_and_propose);
}
