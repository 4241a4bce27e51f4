// CUDA glue for ngram_propose and ngram_propose_tree: checks, outputs, workspaces, current
// stream; the kernels are in include/specdec/ngram.cuh. No host sync, and every allocation's
// size depends on shapes only, so both ops can be captured in a CUDA graph.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <string>
#include <tuple>

#include "ngram_checks.h"
#include "specdec/ngram.cuh"

namespace specdec {
namespace {

// The checks both ops share (ngram_checks.h), plus this kernel's limits.
bool check_ngram_args_cuda(const char* op, const at::Tensor& tokens, const at::Tensor& lengths, int64_t min_n,
                           int64_t max_n, int64_t num_tokens, const std::string& policy) {
  TORCH_CHECK(tokens.is_cuda(), op, ": tokens must be a CUDA tensor, got ", tokens.device());
  const bool latest = check_ngram_args(op, tokens, lengths, min_n, max_n, num_tokens, policy, tokens.device());
  check_fits_int32(op, "B (tokens.size(0))", tokens.size(0));
  return latest;
}

std::tuple<at::Tensor, at::Tensor> ngram_propose_cuda(const at::Tensor& tokens, const at::Tensor& lengths,
                                                      int64_t min_n, int64_t max_n, int64_t num_tokens,
                                                      std::string policy) {
  constexpr const char* op = "ngram_propose";
  const bool latest = check_ngram_args_cuda(op, tokens, lengths, min_n, max_n, num_tokens, policy);
  TORCH_CHECK(tokens.size(1) < (int64_t{1} << cuda::kNgramPositionBits), op, ": L = ", tokens.size(1),
              " is too long (at most 2^32 - 1)");
  const c10::cuda::CUDAGuard guard(tokens.device());
  const at::Tensor lens = lengths.contiguous();
  at::Tensor drafts = tokens.new_empty({tokens.size(0), num_tokens});
  at::Tensor draft_lens = tokens.new_empty({tokens.size(0)}, tokens.options().dtype(at::kInt));
  AT_DISPATCH_INDEX_TYPES(tokens.scalar_type(), "ngram_propose_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_ngram_propose<index_t>(
        tokens.const_data_ptr<index_t>(), tokens.stride(0), tokens.stride(1), lens.const_data_ptr<int64_t>(),
        tokens.size(0), tokens.size(1), min_n, max_n, num_tokens, latest,
        drafts.mutable_data_ptr<index_t>(), draft_lens.mutable_data_ptr<int32_t>(),
        c10::cuda::getCurrentCUDAStream()));
  });
  return {drafts, draft_lens};
}

std::tuple<at::Tensor, at::Tensor> ngram_propose_tree_cuda(const at::Tensor& tokens, const at::Tensor& lengths,
                                                           int64_t min_n, int64_t max_n, int64_t num_tokens,
                                                           int64_t tree_width, int64_t max_nodes,
                                                           std::string policy) {
  constexpr const char* op = "ngram_propose_tree";
  const bool latest = check_ngram_args_cuda(op, tokens, lengths, min_n, max_n, num_tokens, policy);
  check_ngram_tree_args(op, tree_width, max_nodes);
  // Positions are kept as int32 in the kernel's hash table and rank keys.
  TORCH_CHECK(tokens.size(1) <= std::numeric_limits<int32_t>::max(), op, ": L = ", tokens.size(1),
              " is too long (at most 2^31 - 1)");
  const c10::cuda::CUDAGuard guard(tokens.device());
  const at::Tensor lens = lengths.contiguous();
  const int64_t batch = tokens.size(0);
  const int64_t width = tokens.size(1);
  at::Tensor tree_tokens = tokens.new_empty({batch, 1 + max_nodes});
  at::Tensor parents = tokens.new_empty({batch, 1 + max_nodes}, tokens.options().dtype(at::kLong));
  // Workspaces (uninitialised; the kernel writes before it reads).
  const int64_t ranks = cuda::ngram_tree_ranks(tree_width, max_nodes, num_tokens, width);
  at::Tensor pending = tokens.new_empty({batch, cuda::ngram_tree_pending_stride(width)},
                                        tokens.options().dtype(at::kInt));
  at::Tensor ranked = tokens.new_empty({batch, cuda::ngram_tree_ranked_stride(ranks)},
                                       tokens.options().dtype(at::kLong));
  AT_DISPATCH_INDEX_TYPES(tokens.scalar_type(), "ngram_propose_tree_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_ngram_propose_tree<index_t>(
        tokens.const_data_ptr<index_t>(), tokens.stride(0), tokens.stride(1), lens.const_data_ptr<int64_t>(), batch,
        width, min_n, max_n, num_tokens, tree_width, max_nodes, latest,
        pending.mutable_data_ptr<int32_t>(), ranked.mutable_data_ptr<int64_t>(),
        tree_tokens.mutable_data_ptr<index_t>(), parents.mutable_data_ptr<int64_t>(),
        c10::cuda::getCurrentCUDAStream()));
  });
  return {tree_tokens, parents};
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("ngram_propose", &specdec::ngram_propose_cuda);
  m.impl("ngram_propose_tree", &specdec::ngram_propose_tree_cuda);
}
