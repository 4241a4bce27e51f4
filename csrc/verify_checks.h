// verify's argument rules, shared by its CPU glue (csrc/verify.cpp) and CUDA glue
// (csrc/cuda/verify.cu): metadata only. Python (specdec_kernels/verify.py) validates values
// (token ids, parents, temperature, top-k/top-p ranges) before calling. Each backend adds its
// kernel's limits (the CUDA kernel needs a contiguous vocabulary dim and int32 sizes; the CPU
// glue copies a strided one).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>

#include "checks.h"

namespace specdec {

// target_logits [B, T, V] (T, V >= 1) and draft_probs (its shape) float32 / bfloat16 /
// float16; tree_tokens int64 [B, T]; parents int64 [B, T] or [T] (shared by every row, any
// strides); temperature / top_p float32 [B]; top_k / seed int64 [B]; all on `device`.
inline void check_verify_args(const at::Tensor& target_logits, const at::Tensor& tree_tokens,
                              const at::Tensor& parents, const c10::optional<at::Tensor>& draft_probs,
                              const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                              const at::Tensor& seed, const at::Device& device) {
  constexpr const char* op = "verify";
  TORCH_CHECK(target_logits.dim() == 3, op, ": target_logits must be a 3-D [B, T, V] tensor, got shape ",
              target_logits.sizes());
  check_float_dtype(op, "target_logits", target_logits);
  check_device(op, "target_logits", target_logits, device);
  const int64_t batch = target_logits.size(0);
  const int64_t num_nodes = target_logits.size(1);
  TORCH_CHECK(num_nodes >= 1 && target_logits.size(2) >= 1, op,
              ": target_logits needs T >= 1 nodes and V >= 1 tokens, got shape ", target_logits.sizes());
  check_fits_int32(op, "T (target_logits.size(1))", num_nodes);

  check_tensor(op, "tree_tokens", tree_tokens, 2, at::kLong);
  check_device(op, "tree_tokens", tree_tokens, device);
  check_size(op, "tree_tokens", tree_tokens, 0, batch, "B (target_logits.size(0))");
  check_size(op, "tree_tokens", tree_tokens, 1, num_nodes, "T (target_logits.size(1))");

  TORCH_CHECK(parents.dim() == 1 || parents.dim() == 2, op, ": parents must be [B, T] or [T], got shape ",
              parents.sizes());
  TORCH_CHECK(parents.scalar_type() == at::kLong, op, ": parents must have dtype int64, got ", parents.scalar_type());
  check_device(op, "parents", parents, device);
  if (parents.dim() == 2) check_size(op, "parents", parents, 0, batch, "B (target_logits.size(0))");
  check_size(op, "parents", parents, parents.dim() - 1, num_nodes, "T (target_logits.size(1))");

  if (draft_probs.has_value()) {
    TORCH_CHECK(draft_probs->dim() == 3, op, ": draft_probs must be a 3-D [B, T, V] tensor, got shape ",
                draft_probs->sizes());
    check_float_dtype(op, "draft_probs", *draft_probs);
    check_device(op, "draft_probs", *draft_probs, device);
    TORCH_CHECK(draft_probs->sizes() == target_logits.sizes(), op, ": draft_probs must have the shape of ",
                "target_logits ", target_logits.sizes(), ", got ", draft_probs->sizes());
  }

  const struct {
    const char* name;
    const at::Tensor& t;
    at::ScalarType dtype;
  } per_row[] = {{"temperature", temperature, at::kFloat},
                 {"top_k", top_k, at::kLong},
                 {"top_p", top_p, at::kFloat},
                 {"seed", seed, at::kLong}};
  for (const auto& [name, t, dtype] : per_row) {
    check_tensor(op, name, t, 1, dtype);
    check_device(op, name, t, device);
    check_size(op, name, t, 0, batch, "B (target_logits.size(0))");
  }
}

}  // namespace specdec
