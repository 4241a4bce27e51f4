// CUDA glue for verify: checks, outputs, workspace, current stream; the kernel is in
// include/specdec/verify.cuh. No host sync: the workspace comes from the caching allocator on
// the current stream and the counters are zeroed with cudaMemsetAsync, so the call captures
// into CUDA graphs. Python (specdec_kernels/verify.py) validates values (token ids, parents,
// temperature, top-k/top-p ranges) before calling; here only metadata is checked.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "verify_checks.h"
#include "specdec/verify.cuh"

namespace specdec {
namespace {

constexpr const char* kOp = "verify";

template <typename LogitT>
void run(const cuda::VerifyArgs& args, const at::Tensor& like) {
  cuda::VerifyPlan plan;
  const cudaError_t planned =
      cuda::plan_verify<LogitT>(args.batch, args.num_nodes, args.vocab, args.draft_probs != nullptr, &plan);
  TORCH_CHECK(planned != cudaErrorInvalidValue, kOp, ": T = ", args.num_nodes, " tree nodes over a vocabulary of ",
              args.vocab, " do not fit this GPU: either the tree's per-node shared memory leaves no room for a "
              "vocabulary slice, or one row's slices need more blocks than the GPU can hold at once");
  C10_CUDA_CHECK(planned);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(plan.workspace_bytes)}, like.options().dtype(at::kByte));
  const cudaError_t launched =
      cuda::launch_verify<LogitT>(args, plan, workspace.mutable_data_ptr(), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_CHECK(launched);
}

int32_t dtype_code(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return cuda::kVerifyBFloat16;
    case at::kHalf: return cuda::kVerifyFloat16;
    default: return cuda::kVerifyFloat32;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_cuda(const at::Tensor& target_logits,
                                                           const at::Tensor& tree_tokens, const at::Tensor& parents,
                                                           const std::optional<at::Tensor>& draft_probs,
                                                           const at::Tensor& temperature, const at::Tensor& top_k,
                                                           const at::Tensor& top_p, const at::Tensor& seed) {
  TORCH_CHECK(target_logits.is_cuda(), kOp, ": target_logits must be a CUDA tensor, got ", target_logits.device());
  const at::Device device = target_logits.device();
  check_verify_args(target_logits, tree_tokens, parents, draft_probs, temperature, top_k, top_p, seed, device);
  const int64_t batch = target_logits.size(0);
  const int64_t num_nodes = target_logits.size(1);
  const int64_t vocab = target_logits.size(2);
  // This kernel's limits: rows may be strided, but the vocabulary dim must be contiguous for
  // the 16-byte loads, and sizes are int32.
  check_last_dim_contiguous(kOp, "target_logits", target_logits);
  if (draft_probs.has_value()) check_last_dim_contiguous(kOp, "draft_probs", *draft_probs);
  check_fits_int32(kOp, "B (target_logits.size(0))", batch);
  check_fits_int32(kOp, "V (target_logits.size(2))", vocab);

  const c10::cuda::CUDAGuard guard(device);
  const auto int_options = target_logits.options().dtype(at::kInt);
  at::Tensor accepted_nodes = at::empty({batch, num_nodes}, int_options);
  at::Tensor num_accepted = at::empty({batch}, int_options);
  at::Tensor output_tokens = at::empty({batch, num_nodes}, target_logits.options().dtype(at::kLong));
  if (batch == 0) return {accepted_nodes, num_accepted, output_tokens};

  cuda::VerifyArgs args{};
  args.logits = target_logits.const_data_ptr();
  args.logits_stride_b = target_logits.stride(0);
  args.logits_stride_t = target_logits.stride(1);
  if (draft_probs.has_value()) {
    args.draft_probs = draft_probs->const_data_ptr();
    args.draft_stride_b = draft_probs->stride(0);
    args.draft_stride_t = draft_probs->stride(1);
    args.draft_dtype = dtype_code(draft_probs->scalar_type());
  }
  args.tree_tokens = tree_tokens.const_data_ptr<int64_t>();
  args.tokens_stride_b = tree_tokens.stride(0);
  args.tokens_stride_t = tree_tokens.stride(1);
  args.parents = parents.const_data_ptr<int64_t>();
  args.parents_stride_b = parents.dim() == 2 ? parents.stride(0) : 0;
  args.parents_stride_t = parents.stride(parents.dim() - 1);
  args.temperature = temperature.const_data_ptr<float>();
  args.temperature_stride = temperature.stride(0);
  args.top_k = top_k.const_data_ptr<int64_t>();
  args.top_k_stride = top_k.stride(0);
  args.top_p = top_p.const_data_ptr<float>();
  args.top_p_stride = top_p.stride(0);
  args.seed = seed.const_data_ptr<int64_t>();
  args.seed_stride = seed.stride(0);
  args.batch = static_cast<int32_t>(batch);
  args.num_nodes = static_cast<int32_t>(num_nodes);
  args.vocab = static_cast<int32_t>(vocab);
  args.accepted_nodes = accepted_nodes.mutable_data_ptr<int32_t>();
  args.num_accepted = num_accepted.mutable_data_ptr<int32_t>();
  args.output_tokens = output_tokens.mutable_data_ptr<int64_t>();

  switch (target_logits.scalar_type()) {
    case at::kFloat: run<float>(args, target_logits); break;
    case at::kBFloat16: run<__nv_bfloat16>(args, target_logits); break;
    default: run<__half>(args, target_logits); break;
  }
  return {accepted_nodes, num_accepted, output_tokens};
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CUDA, m) { m.impl("verify", &specdec::verify_cuda); }
