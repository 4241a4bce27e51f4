// CUDA glue for tree_mask and pack_tree_mask: checks, outputs, current stream; the kernels
// are in include/specdec/tree.cuh. No host sync.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "tree_checks.h"
#include "specdec/tree.cuh"

namespace specdec {
namespace {

at::Tensor tree_mask_cuda(const at::Tensor& parents) {
  check_tree_mask_args(parents, parents.device());  // (the only tensor: it chose this CUDA kernel)
  const c10::cuda::CUDAGuard guard(parents.device());
  const int64_t batch = parents.size(0);
  const int64_t num_nodes = parents.size(1);
  at::Tensor mask = parents.new_empty({batch, num_nodes, num_nodes}, parents.options().dtype(at::kBool));
  C10_CUDA_CHECK(cuda::launch_tree_mask(parents.const_data_ptr<int64_t>(), parents.stride(0), parents.stride(1),
                                        batch, num_nodes, mask.mutable_data_ptr<bool>(),
                                        c10::cuda::getCurrentCUDAStream()));
  return mask;
}

at::Tensor pack_tree_mask_cuda(const at::Tensor& mask) {
  check_pack_tree_mask_args(mask, mask.device());  // (the only tensor: it chose this CUDA kernel)
  const c10::cuda::CUDAGuard guard(mask.device());
  const int64_t batch = mask.size(0);
  const int64_t num_nodes = mask.size(1);
  const int64_t num_keys = mask.size(2);
  at::Tensor packed = mask.new_empty({batch, num_nodes, (num_keys + 63) / 64}, mask.options().dtype(at::kLong));
  // bool is read as its byte, so the kernel never loads a bool that is not 0 or 1.
  C10_CUDA_CHECK(cuda::launch_pack_tree_mask(reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>()),
                                             mask.stride(0), mask.stride(1), mask.stride(2), batch, num_nodes,
                                             num_keys, packed.mutable_data_ptr<int64_t>(),
                                             c10::cuda::getCurrentCUDAStream()));
  return packed;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("tree_mask", &specdec::tree_mask_cuda);
  m.impl("pack_tree_mask", &specdec::pack_tree_mask_cuda);
}
