// CPU kernels for ngram_propose and ngram_propose_tree: threading here, argument rules in
// ngram_checks.h, loops in include/specdec/ngram.h. (The incremental index class
// torch.classes.specdec.NgramIndex is in ngram_index.cpp.)
//
// The GIL: calls through torch.ops.specdec.* release the GIL before running the kernel
// (torch's Python bindings for operators drop it around the call), so other Python threads
// run meanwhile; python_tests/test_ngram_index.py::test_gil_released checks it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "ngram_checks.h"
#include "specdec/ngram.h"

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

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("ngram_propose", &specdec::ngram_propose_cpu);
  m.impl("ngram_propose_tree", &specdec::ngram_propose_tree_cpu);
}
