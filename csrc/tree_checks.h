// tree_mask's and pack_tree_mask's argument rules, shared by their CPU glue (csrc/tree.cpp)
// and CUDA glue (csrc/cuda/tree.cu): metadata only. Whether parents is topological is a
// value check, made by the CPU kernel while it builds the mask.
#pragma once

#include <ATen/core/Tensor.h>

#include "checks.h"

namespace specdec {

// parents: int64 [B, T] on `device`.
inline void check_tree_mask_args(const at::Tensor& parents, const at::Device& device) {
  check_tensor("tree_mask", "parents", parents, 2, at::kLong);
  check_device("tree_mask", "parents", parents, device);
}

// mask: bool [B, T, K] on `device`.
inline void check_pack_tree_mask_args(const at::Tensor& mask, const at::Device& device) {
  check_tensor("pack_tree_mask", "mask", mask, 3, at::kBool);
  check_device("pack_tree_mask", "mask", mask, device);
}

}  // namespace specdec
