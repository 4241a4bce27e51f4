// CPU kernel for verify: checks, dtype dispatch and threading here, the tree walk in
// include/specdec/verify.h. Rows are independent (each has its own seed and tree), so the
// batch is split over threads, one row at a time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "verify_checks.h"
#include "specdec/verify.h"

namespace specdec {
namespace {

// A [B, T, V] tensor whose last dim is contiguous (a copy only when it is not).
at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(2) == 1 || t.size(2) <= 1 ? t : t.contiguous(); }

template <typename Logit, typename Prob>
void run_rows(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
              const at::Tensor* draft_probs, const at::Tensor& temperature, const at::Tensor& top_k,
              const at::Tensor& top_p, const at::Tensor& seed, at::Tensor& accepted_nodes, at::Tensor& num_accepted,
              at::Tensor& output_tokens) {
  const int64_t batch = logits.size(0);
  const int64_t num_nodes = logits.size(1);
  const int64_t vocab = logits.size(2);
  const Logit* logits_data = reinterpret_cast<const Logit*>(logits.const_data_ptr());
  const Prob* probs_data = draft_probs ? reinterpret_cast<const Prob*>(draft_probs->const_data_ptr()) : nullptr;
  const int64_t* tokens_data = tokens.const_data_ptr<int64_t>();
  const int64_t* parents_data = parents.const_data_ptr<int64_t>();
  const float* temperature_data = temperature.const_data_ptr<float>();
  const int64_t* top_k_data = top_k.const_data_ptr<int64_t>();
  const float* top_p_data = top_p.const_data_ptr<float>();
  const int64_t* seed_data = seed.const_data_ptr<int64_t>();
  int32_t* accepted_data = accepted_nodes.mutable_data_ptr<int32_t>();
  int32_t* num_accepted_data = num_accepted.mutable_data_ptr<int32_t>();
  int64_t* output_data = output_tokens.mutable_data_ptr<int64_t>();
  // Grain 1: a row is at least a pass over V logits per visited node, and sampled rows
  // draw V Philox numbers per race, enough work for a thread.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    cpu::VerifyScratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      cpu::VerifyRow<Logit, Prob> row{logits_data + b * logits.stride(0),
                                      logits.stride(1),
                                      probs_data ? probs_data + b * draft_probs->stride(0) : nullptr,
                                      probs_data ? draft_probs->stride(1) : 0,
                                      tokens_data + b * num_nodes,
                                      parents_data + b * num_nodes,
                                      num_nodes,
                                      vocab,
                                      temperature_data[b],
                                      top_k_data[b],
                                      top_p_data[b],
                                      seed_data[b]};
      num_accepted_data[b] = static_cast<int32_t>(
          cpu::verify_row(row, scratch, accepted_data + b * num_nodes, output_data + b * num_nodes));
    }
  });
}

// at::BFloat16 / at::Half have the layout of the torch-free bit-pattern types, so the data
// pointers are reinterpreted; draft_probs may have a dtype other than target_logits'.
template <typename Logit, typename... Args>
void with_prob_type(const at::Tensor* draft_probs, Args&... args) {
  const at::ScalarType dtype = draft_probs ? draft_probs->scalar_type() : at::kFloat;
  if (dtype == at::kFloat) {
    run_rows<Logit, float>(args...);
  } else if (dtype == at::kBFloat16) {
    run_rows<Logit, cpu::BFloat16Bits>(args...);
  } else {
    run_rows<Logit, cpu::HalfBits>(args...);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_cpu(const at::Tensor& target_logits_in,
                                                          const at::Tensor& tree_tokens_in,
                                                          const at::Tensor& parents_in,
                                                          const c10::optional<at::Tensor>& draft_probs_in,
                                                          const at::Tensor& temperature_in, const at::Tensor& top_k_in,
                                                          const at::Tensor& top_p_in, const at::Tensor& seed_in) {
  check_verify_args(target_logits_in, tree_tokens_in, parents_in, draft_probs_in, temperature_in, top_k_in, top_p_in,
                    seed_in, at::Device(at::kCPU));
  const int64_t batch = target_logits_in.size(0);
  const int64_t num_nodes = target_logits_in.size(1);
  at::Tensor draft_probs;
  if (draft_probs_in.has_value()) draft_probs = last_dim_contiguous(*draft_probs_in);

  const at::Tensor logits = last_dim_contiguous(target_logits_in);
  const at::Tensor tokens = tree_tokens_in.contiguous();
  // A [T] parents tensor is shared by every row: the walk reads a contiguous [B, T] copy.
  const at::Tensor parents = (parents_in.dim() == 1 ? parents_in.expand({batch, num_nodes}) : parents_in).contiguous();
  const at::Tensor temperature = temperature_in.contiguous();
  const at::Tensor top_k = top_k_in.contiguous();
  const at::Tensor top_p = top_p_in.contiguous();
  const at::Tensor seed = seed_in.contiguous();
  at::Tensor accepted_nodes = at::empty({batch, num_nodes}, tokens.options().dtype(at::kInt));
  at::Tensor num_accepted = at::empty({batch}, tokens.options().dtype(at::kInt));
  at::Tensor output_tokens = at::empty({batch, num_nodes}, tokens.options());

  const at::Tensor* probs_ptr = draft_probs.defined() ? &draft_probs : nullptr;
  switch (logits.scalar_type()) {
    case at::kFloat:
      with_prob_type<float>(probs_ptr, logits, tokens, parents, probs_ptr, temperature, top_k, top_p, seed,
                            accepted_nodes, num_accepted, output_tokens);
      break;
    case at::kBFloat16:
      with_prob_type<cpu::BFloat16Bits>(probs_ptr, logits, tokens, parents, probs_ptr, temperature, top_k, top_p,
                                        seed, accepted_nodes, num_accepted, output_tokens);
      break;
    default:
      with_prob_type<cpu::HalfBits>(probs_ptr, logits, tokens, parents, probs_ptr, temperature, top_k, top_p, seed,
                                    accepted_nodes, num_accepted, output_tokens);
      break;
  }
  return {accepted_nodes, num_accepted, output_tokens};
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("verify", &specdec::verify_cpu); }
