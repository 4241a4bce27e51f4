// ngram_propose's and ngram_propose_tree's argument rules, shared by their CPU glue
// (csrc/ngram.cpp), their CUDA glue (csrc/cuda/ngram.cu) and NgramIndex's methods
// (csrc/ngram_index.cpp): metadata and scalar arguments only. Row lengths are values: the
// CPU glue checks them (B reads), the CUDA kernels clamp them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "checks.h"

namespace specdec {

// min_n >= 1, max_n >= min_n, num_tokens >= 1.
inline void check_ngram_sizes(const char* op, int64_t min_n, int64_t max_n, int64_t num_tokens) {
  TORCH_CHECK(min_n >= 1, op, ": min_n must be >= 1, got ", min_n);
  TORCH_CHECK(max_n >= min_n, op, ": max_n must be >= min_n = ", min_n, ", got ", max_n);
  TORCH_CHECK(num_tokens >= 1, op, ": num_tokens must be >= 1, got ", num_tokens);
}

// Whether `policy` asks for the latest match ("latest") rather than the earliest.
inline bool parse_policy(const char* op, const std::string& policy) {
  TORCH_CHECK(policy == "earliest" || policy == "latest", op, ": policy must be \"earliest\" or \"latest\", got \"",
              policy, "\"");
  return policy == "latest";
}

// tokens int32 / int64 [B, L] and lengths int64 [B] on `device`, and the scalar arguments.
// Returns whether the policy is "latest".
inline bool check_ngram_args(const char* op, const at::Tensor& tokens, const at::Tensor& lengths, int64_t min_n,
                             int64_t max_n, int64_t num_tokens, const std::string& policy, const at::Device& device) {
  TORCH_CHECK(tokens.dim() == 2, op, ": tokens must be a 2-D [B, L] tensor, got shape ", tokens.sizes());
  TORCH_CHECK(tokens.scalar_type() == at::kInt || tokens.scalar_type() == at::kLong, op,
              ": tokens must have dtype int32 or int64, got ", tokens.scalar_type());
  check_tensor(op, "lengths", lengths, 1, at::kLong);
  check_device(op, "tokens", tokens, device);
  check_device(op, "lengths", lengths, device);
  check_size(op, "lengths", lengths, 0, tokens.size(0), "B (tokens.size(0))");
  check_ngram_sizes(op, min_n, max_n, num_tokens);
  return parse_policy(op, policy);
}

// ngram_propose_tree's extra arguments.
inline void check_ngram_tree_args(const char* op, int64_t tree_width, int64_t max_nodes) {
  TORCH_CHECK(tree_width >= 1, op, ": tree_width must be >= 1, got ", tree_width);
  TORCH_CHECK(max_nodes >= 0, op, ": max_nodes must be >= 0, got ", max_nodes);
}

}  // namespace specdec
